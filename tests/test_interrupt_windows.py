"""Ctrl-C at any moment of a reentrant backward: See Note [A backward that
raises leaves its ready queue], Note [Where the twin's main thread sees an
interrupt] (both in ``pyengine/_pure/engine.py``) and Note [A slot taken for
a pool thread] (in ``pyengine/_pure/thread_pool.py``).

Each scenario runs in a fresh interpreter on the core under test, with a
timeout (a hang fails the test instead of hanging the suite). Oracles: the
exact gradient of a chain of reentrant backwards (one per level, 13 levels:
13.0), and every pool thread idle again afterwards (the pool's count of
threads equals the live ones and a full-depth chain still finds a thread).

- A seeded random batch: SIGINT or ``_thread.interrupt_main`` at a random
  moment of a reentrant chain that crosses several pool threads; and one
  where a second interrupt follows the first within 4 ms.
- Deterministic: a caller that gave up its hand-off, whose next backward
  would share the ready queue with the pool threads still running the old
  chain (both cores); Ctrl-C while a pool thread is made (both cores); and,
  in the twin, KeyboardInterrupt raised by a trace function at each place
  where the main thread's Python engine takes two steps that must both
  happen.
"""

from __future__ import annotations

import signal
import textwrap

import pytest
from conftest import run_on_this_core

import pyengine

pytestmark = pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")

twin_only = pytest.mark.skipif(pyengine.IMPLEMENTATION != "pure",
                               reason="the window is in the twin's Python engine only")

# A reentrant chain: Reenter(depth) runs a backward from Reenter(depth - 1)
# inside its apply; every level adds 1.0 into x.grad.
PRELUDE = textwrap.dedent('''
    import _thread, random, signal, sys, threading, time
    import numpy as np
    import pyengine

    signal.signal(signal.SIGINT, signal.default_int_handler)

    class Leaf:
        def __init__(self, data):
            self.data = data; self.grad = None; self.grad_fn = None
            self.output_nr = 0; self.requires_grad = True

    def run(root, grad, engine):
        engine.execute([pyengine.Edge(root, 0)], [grad], False, False, True)

    x = Leaf(np.ones(()))

    class Reenter(pyengine.Node):
        def __init__(self, depth, engine, pause=0.0):
            super().__init__([pyengine.gradient_edge(x)], [((), np.float64)])
            self.depth = depth; self.engine = engine; self.pause = pause
        def apply(self, grads):
            time.sleep(self.pause)
            if self.depth > 0:
                run(Reenter(self.depth - 1, self.engine, self.pause), np.ones(()), self.engine)
            time.sleep(self.pause)
            return [grads[0]]

    def pool_threads():
        return [t for t in threading.enumerate() if t.name == "pyengine-reentrant"]

    def check_clean_runs(engine, runs=20):
        """The chain, uninterrupted: exact every time, no pool thread left behind."""
        for _ in range(runs):
            x.grad = None
            run(Reenter(12, engine), np.ones(()), engine)
            assert x.grad == 13.0, x.grad
        if pyengine.IMPLEMENTATION == "pure":
            pool = engine._pool
            with pool.condition:
                assert pool.num_idle == pool.num_threads == len(pool_threads()), (
                    pool.num_idle, pool.num_threads, len(pool_threads()))
                assert not pool.graph_tasks
        print("clean", runs, flush=True)

    def refused_while_the_old_chain_runs(error):
        """A run that starts while an interrupted chain still runs on its pool
        threads (See Note [A backward that raises leaves its ready queue]) may
        find the capped pool full: the engine refuses, as documented, and
        nothing else may go wrong."""
        if "reentrant pool are busy" not in str(error):
            raise error

    def check_pool_threads_end(engine):
        """Every pool thread ends on stop: none sleeps for a task that never comes."""
        engine.stop(timeout=2.0)
        alive = [t for t in pool_threads() if t.is_alive()]
        assert not alive, f"{len(alive)} pool threads stuck"
        print("all pool threads ended", flush=True)
''')


def run_scenario(body, timeout=60):
    return run_on_this_core(PRELUDE + textwrap.dedent(body), timeout)


def run_random_interrupts(seeds, second_within_s=None):
    """Runs of a reentrant chain across pool threads, each interrupted at a
    random moment (SIGINT or ``_thread.interrupt_main``); with
    ``second_within_s``, a second interrupt follows the first within that
    many seconds, while the engine or the caller's handler deals with it.
    Oracles: the exact gradient of clean runs afterwards, every pool thread
    idle again and ending on stop, and most runs interrupted."""
    lines = run_scenario(f'''
        engine = pyengine.Engine(max_recursion_depth=2, max_pool_threads=6)
        interrupted = 0

        def interrupt():
            if random.random() < 0.5:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            else:
                _thread.interrupt_main()

        def send():
            interrupt()
            if {second_within_s!r} is not None:
                time.sleep(random.uniform(0.0, {second_within_s!r}))
                interrupt()

        for seed in {tuple(seeds)!r}:
            random.seed(seed)
            for _ in range(40):
                timer = threading.Timer(random.uniform(0.0, 0.06), send)
                try:
                    try:
                        timer.start()
                        run(Reenter(12, engine, pause=0.002), np.ones(()), engine)
                    except KeyboardInterrupt:
                        interrupted += 1
                    except RuntimeError as error:
                        refused_while_the_old_chain_runs(error)
                except KeyboardInterrupt:  # a second one, in a handler above
                    pass
                while True:
                    try:
                        timer.join(); time.sleep(0.02); break
                    except KeyboardInterrupt:
                        pass
        print("interrupted", interrupted, flush=True)
        # The old chains finish on their pool threads.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and pyengine.IMPLEMENTATION == "pure":
            pool = engine._pool
            with pool.condition:
                if pool.num_idle == pool.num_threads:
                    break
            time.sleep(0.05)
        time.sleep(0.5)
        check_clean_runs(engine)
        check_pool_threads_end(engine)
    ''', timeout=120)
    assert lines[-2:] == ["clean 20", "all pool threads ended"], lines
    interrupted = int(next(line for line in lines if line.startswith("interrupted")).split()[1])
    assert interrupted > 20, lines


@pytest.mark.stress
def test_random_interrupts_in_a_reentrant_chain():
    # The audit's repro, smaller: an interrupt at a random moment of each run.
    run_random_interrupts(seeds=(1, 2))


@pytest.mark.stress
def test_a_second_interrupt_while_the_first_is_handled():
    run_random_interrupts(seeds=(3,), second_within_s=0.004)


def test_a_caller_that_gave_up_a_hand_off_does_not_share_its_queue():
    # max_recursion_depth=0: every reentrant backward goes to a pool thread.
    # O (main) -> I (pool thread 1, waits for gate) -> J (pool thread 2).
    # The caller gives up I (Ctrl-C), then runs a backward that waits for a
    # device node; meanwhile I goes on and hands J off. J must run on a
    # pool thread: had the caller kept its queue, it would pop J's task
    # and complete J's graph task while pool thread 2 sleeps in pop for it.
    lines = run_scenario('''
        from pyengine import fake_device as fd
        engine = pyengine.Engine(max_recursion_depth=0, max_pool_threads=16)
        gate = threading.Event()
        j_ran = threading.Event()
        z = Leaf(np.ones(()))

        class J(pyengine.Node):
            def __init__(self):
                super().__init__([pyengine.gradient_edge(z)], [((), np.float64)])
                self.ran_on = None
            def apply(self, grads):
                self.ran_on = threading.current_thread().name
                j_ran.set()
                return [grads[0]]

        class I(pyengine.Node):
            def __init__(self, inner):
                super().__init__([pyengine.gradient_edge(z)], [((), np.float64)])
                self.inner = inner
            def apply(self, grads):
                _thread.interrupt_main()
                gate.wait(5)
                run(self.inner, np.ones(()), engine)
                return [grads[0]]

        class O(pyengine.Node):
            def __init__(self, inner):
                super().__init__([pyengine.gradient_edge(x)], [((), np.float64)])
                self.inner = inner
            def apply(self, grads):
                run(self.inner, np.ones(()), engine)
                return [grads[0]]

        class OnDevice(pyengine.Node):
            """On fake:0: lets I go on, then waits (at most 2 s) for J."""
            def __init__(self):
                super().__init__([pyengine.gradient_edge(x)],
                                 [pyengine.InputMetadata((), np.float64, fd.device(0))])
            def apply(self, grads):
                gate.set()
                j_ran.wait(2)
                return [np.ones(())]

        # Pool thread 2 starts late: the caller, waiting in pop, would pop
        # J's task first if it still served that queue.
        real_thread = threading.Thread
        class LateThread(real_thread):
            def start(self):
                if self.name == "pyengine-reentrant" and gate.is_set():
                    time.sleep(0.3)
                super().start()
        threading.Thread = LateThread

        j = J()
        try:
            run(O(I(j)), np.ones(()), engine)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        # The caller's next backward waits in pop for its device node.
        x.grad = None
        run(OnDevice(), fd.to_fake(np.ones(()), fd.device(0)), engine)
        assert x.grad == 1.0, x.grad
        assert j_ran.wait(5)
        print("J ran on", j.ran_on, flush=True)
        time.sleep(0.2)
        assert z.grad == 1.0, z.grad   # J's AccumulateGrad; I's was cancelled
        check_clean_runs(engine)
        check_pool_threads_end(engine)
    ''', timeout=60)
    assert "interrupted" in lines
    assert "J ran on pyengine-reentrant" in lines, lines
    assert lines[-2:] == ["clean 20", "all pool threads ended"], lines


def test_ctrl_c_while_a_pool_thread_is_made_gives_its_slot_back():
    # See Note [A slot taken for a pool thread]: the one slot of a pool of
    # one must be free again, else every later hand-off finds the pool full.
    lines = run_scenario('''
        engine = pyengine.Engine(max_recursion_depth=0, max_pool_threads=1)
        real_thread = threading.Thread
        class InterruptedThread(real_thread):
            def __init__(self, *args, **kwargs):
                if kwargs.get("name") == "pyengine-reentrant":
                    threading.Thread = real_thread
                    raise KeyboardInterrupt
                super().__init__(*args, **kwargs)
        threading.Thread = InterruptedThread
        try:
            run(Reenter(1, engine), np.ones(()), engine)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        assert threading.Thread is real_thread
        x.grad = None
        run(Reenter(1, engine), np.ones(()), engine)
        assert x.grad == 2.0, x.grad
        print("after", x.grad, flush=True)
    ''')
    assert lines == ["interrupted", "after 2.0"]


# -- the twin: KeyboardInterrupt at each place of the main thread's Python engine --

INJECT = textwrap.dedent('''
    import inspect
    from pyengine._pure import engine as engine_module, ready_queue, thread_pool

    def interrupt_at(function, marker, hit=1):
        """Raise KeyboardInterrupt in ``function`` on this thread just before
        the ``hit``-th run of its first line that contains ``marker``, as a signal
        handler would there."""
        lines, first = inspect.getsourcelines(function)
        matches = [first + i for i, line in enumerate(lines) if marker in line]
        assert matches, marker
        target = matches[0]
        code = function.__code__
        seen = [0]
        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == target:
                seen[0] += 1
                if seen[0] == hit:
                    sys.settrace(None)
                    raise KeyboardInterrupt(marker)
            return local
        def tracer(frame, event, arg):
            return local if frame.f_code is code else None
        sys.settrace(tracer)

    def expect_interrupt(call):
        try:
            call()
        except KeyboardInterrupt:
            sys.settrace(None)
            return
        raise AssertionError("no KeyboardInterrupt: the marker's line never ran")

    def check_thread_restored():
        worker = engine_module._worker_state
        assert worker.worker_device == engine_module.NO_DEVICE, worker.worker_device
        assert worker.current_depth == worker.total_depth == 0
        assert worker.next_task is None
        assert pyengine.is_grad_enabled()
        assert pyengine.is_checkpoint_valid()
        assert engine_module.state.get_current_graph_task() is None
''')

WINDOWS = [
    # 1. Between the pop and the node's try in thread_main: the per-node state.
    ("engine_module.Engine.thread_main", "previous_checkpoint_valid = state.swap_checkpoint_valid(", 1),
    ("engine_module.Engine.thread_main", "local_graph_task.decrement_outstanding_tasks()", 2),
    # 2. In ReadyQueue.push and push_pop, between counting a task and queueing it.
    ("ready_queue.ReadyQueue.push", "heap_push(self._heap, task)", 1),
    ("ready_queue.ReadyQueue.push_pop",
     "if not self._heap and not self._woken and not self._shutdown_pending:", 2),
    # The outermost execute, before its loop: worker_device set.
    ("engine_module.Engine.execute_with_graph_task", "graph_task.owner = CPU_DEVICE", 1),
    # 3. The pool's slot, between taking it and the try that gives it back.
    ("thread_pool.add_thread_pool_task", "if refused is not None:", 1),
    ("thread_pool.start_pool_thread", "with pool.condition:", 1),
    ("thread_pool.start_pool_thread", "thread.start()", 1),
    # While start() waits for a thread that runs but has not set its ident.
    ("threading.Thread.start", "self._started.wait()", 1),
]


@twin_only
@pytest.mark.parametrize("function, marker, hit", WINDOWS)
def test_twin_interrupt_at_each_window(function, marker, hit):
    lines = run_scenario(INJECT + textwrap.dedent(f'''
        engine = pyengine.Engine(max_recursion_depth=2, max_pool_threads=6)
        interrupt_at({function}, {marker!r}, {hit})
        expect_interrupt(lambda: run(Reenter(12, engine), np.ones(()), engine))
        check_thread_restored()
        time.sleep(0.3)
        check_clean_runs(engine)
        check_pool_threads_end(engine)
    '''), timeout=60)
    assert lines[-2:] == ["clean 20", "all pool threads ended"], lines
