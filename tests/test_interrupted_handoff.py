"""Ctrl-C in a reentrant hand-off that a node catches: See Note [A backward
that raises leaves its ready queue] in pyengine/_pure/engine.py.

The main thread T runs graph task G0 on its ReadyQueue Q; a node N of G0
runs a reentrant backward G1 past ``max_recursion_depth``, so a pool thread
P runs it on Q while T waits. Ctrl-C cancels G1 and raises
KeyboardInterrupt into N, but P finishes the node M it is in, and a
backward nested in M (G2, gated on a fake device) keeps a pool thread
serving Q. N catches the KeyboardInterrupt and returns normally.

Before the fix, T went on serving Q for G0 beside that pool thread: each
took one of N's two next nodes (X and Y meet at a barrier, so they run at
once on two threads), T finished its one and slept in ``pop``, the pool
thread finished G0 and, both loops being the CPU's, woke nobody: the
user's backward hung (a watchdog signal ends the wait, and the test fails
on it). Now every backward that T drives ends with the interruption:
oracles are the KeyboardInterrupt raised by the outermost backward, no node
of G0 run after it, nothing of G0 kept alive (a weak reference to N's
gradients dies), a new backward refused while the old ones unwind, and,
once the nested backward ends, exact gradients from the same graph again
with the pool capped at the threads it needs (a pool thread left asleep in
``pop`` would make the hand-off refused), and every pool thread ends on
``stop``.
"""

from __future__ import annotations

import _thread
import gc
import os
import signal
import sys
import threading
import weakref

import numpy as np
import pytest
from conftest import signals_not_swallowed

import pyengine
from pyengine import fake_device as fd
from pyengine.device import CPU

pytestmark = [
    pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill"),
]

F0 = fd.device(0)
# How long a gated node or a barrier waits before it gives up (a hang guard).
WORK_S = 3.0
# How long the backward may take before the watchdog calls it hung; it
# takes well under a second.
HANG_S = 4.0

HOW = ["pthread_kill", "interrupt_main"]


class BackwardHung(Exception):
    """What the watchdog raises into a backward that slept past HANG_S."""


def run_guarded(call):
    """Run ``call`` on the main thread; return what it raised (None if it
    returned). A call still running after HANG_S gets BackwardHung raised
    into it (the engine's waits on the main thread run signal handlers)."""
    def hung(signum, frame):
        raise BackwardHung(f"the backward still ran {HANG_S} s after it started")

    previous = signal.signal(signal.SIGUSR1, hung)
    watchdog = threading.Timer(HANG_S, signal.pthread_kill,
                               (threading.main_thread().ident, signal.SIGUSR1))
    watchdog.start()
    try:
        with signals_not_swallowed():
            try:
                call()
            except BaseException as error:  # noqa: BLE001 - the test judges it
                return error
            return None
    finally:
        watchdog.cancel()
        watchdog.join()
        signal.signal(signal.SIGUSR1, previous)


def interrupt_main_when(event, how):
    """Send SIGINT to the main thread once ``event`` is set."""
    def run():
        assert event.wait(WORK_S), "the nested backward never reached its gated node"
        if how == "pthread_kill":
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        elif sys.version_info >= (3, 10):
            _thread.interrupt_main(signal.SIGINT)
        else:
            _thread.interrupt_main()

    thread = threading.Thread(target=run, name="interrupter", daemon=True)
    thread.start()
    return thread


def backward_from(node, grad):
    pyengine.get_default_engine().execute([pyengine.Edge(node, 0)], [grad], False, False, True)


def main_thread_sleeps_in_pop():
    """Whether the main thread is inside the engine's ReadyQueue.pop: in
    the twin, a ReadyQueue.pop frame on its stack; in the compiled core
    (whose functions have no frames), its innermost frame is
    ``backward_from``, which called the engine, and this thread holds the
    GIL, which the main thread gives up in the engine only to wait."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is not None and frame.f_code is backward_from.__code__:
        return True
    ready_queue = os.path.join("_pure", "ready_queue.py")
    while frame is not None:
        if frame.f_code.co_name == "pop" and frame.f_code.co_filename.endswith(ready_queue):
            return True
        frame = frame.f_back
    return False


class Leaf:
    def __init__(self):
        self.data = np.ones(3)
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


def cpu_metadata():
    return [pyengine.InputMetadata((3,), np.float64, CPU)]


class Fork(pyengine.Node):
    """N: runs ``nested`` (a reentrant backward) and, whether it raises
    KeyboardInterrupt or not, returns ``factors[i] * grad`` to edge ``i``.
    ``after_catch``: called once it caught the KeyboardInterrupt."""

    def __init__(self, edges, factors, nested, after_catch=None):
        super().__init__(edges, cpu_metadata())
        self.factors, self.nested, self.after_catch = factors, nested, after_catch
        self.caught = False
        self.made = []

    def apply(self, grads):
        try:
            self.nested(grads[0])
        except KeyboardInterrupt:
            self.caught = True
            if self.after_catch is not None:
                self.after_catch()
        out = [grads[0] * factor for factor in self.factors]
        self.made = [weakref.ref(gradient) for gradient in out]
        return out


class Meet(pyengine.Node):
    """X or Y: with a ``barrier``, waits there for the other, so the two run
    at once on two threads; the one on a pool thread then returns only
    once the main thread sleeps in pop. Passes its gradient on."""

    def __init__(self, edge, barrier=None):
        super().__init__([edge], cpu_metadata())
        self.barrier = barrier
        self.ran_on = None

    def apply(self, grads):
        self.ran_on = threading.current_thread()
        if self.barrier is not None:
            self.barrier.wait(WORK_S)
            if self.ran_on is not threading.main_thread():
                pause = threading.Event()  # never set: its wait is a pause
                for _ in range(int(WORK_S * 1000)):
                    if main_thread_sleeps_in_pop():
                        break
                    pause.wait(0.001)
        return [grads[0]]


class Scale(pyengine.Node):
    """``factor * grad`` to its one edge; ``device``: where its gradient
    comes in; ``to_device``: where the gradient it returns goes (a fake
    device's array); with a ``gate``, it sets ``started`` and waits for the
    gate first."""

    def __init__(self, edge, factor, device=CPU, to_device=None, gate=None, nested=None):
        super().__init__([edge], [pyengine.InputMetadata((3,), np.float64, device)])
        self.factor, self.to_device, self.gate, self.nested = factor, to_device, gate, nested
        self.started = threading.Event()

    def apply(self, grads):
        self.started.set()
        if self.gate is not None:
            self.gate.wait(WORK_S)
        grad = grads[0]
        host = grad.numpy() if isinstance(grad, fd.FakeArray) else np.asarray(grad)
        if self.nested is not None:
            self.nested(host)
        out = host * self.factor
        return [fd.to_fake(out, self.to_device) if self.to_device is not None else out]


class Handoff:
    """The graph of the module docstring. G0: N (Fork, x2 to X, x3 to Y)
    -> X -> leaf_x, Y -> leaf_y; N's nested backward G1: M (x5) ->
    leaf_m, and M's nested backward G2: A (x1, to fake:0) -> D (x7, on
    fake:0, gated) -> leaf_d."""

    def __init__(self, interrupted, after_catch=None):
        self.leaf_x, self.leaf_y, self.leaf_m, self.leaf_d = Leaf(), Leaf(), Leaf(), Leaf()
        self.gate = threading.Event()
        if not interrupted:
            self.gate.set()
        barrier = threading.Barrier(2) if interrupted else None
        self.d = Scale(pyengine.gradient_edge(self.leaf_d), 7.0, device=F0, gate=self.gate)
        self.a = Scale(pyengine.Edge(self.d, 0), 1.0, to_device=F0)
        self.m = Scale(pyengine.gradient_edge(self.leaf_m), 5.0,
                       nested=lambda grad: backward_from(self.a, grad))
        self.x = Meet(pyengine.gradient_edge(self.leaf_x), barrier)
        self.y = Meet(pyengine.gradient_edge(self.leaf_y), barrier)
        self.n = Fork([pyengine.Edge(self.x, 0), pyengine.Edge(self.y, 0)], [2.0, 3.0],
                      lambda grad: backward_from(self.m, grad), after_catch)

    def run(self):
        backward_from(self.n, np.ones(3))

    def check_gradients(self):
        for leaf, expected in ((self.leaf_x, 2.0), (self.leaf_y, 3.0), (self.leaf_m, 5.0),
                               (self.leaf_d, 7.0)):
            np.testing.assert_array_equal(leaf.grad, [expected] * 3)


def when_the_pool_is_free(run):
    """``run()``, tried again while the pool refuses it as busy: the pool
    threads of an interrupted backward go back to idle shortly after its
    nested backward ends, and only its caller would wait for that (See Note
    [A pool thread is back before its caller]). A pool thread left asleep
    in ``pop`` keeps it refused."""
    pause = threading.Event()  # never set: its wait is a pause
    for _ in range(int(WORK_S * 100)):
        try:
            return run()
        except RuntimeError as error:
            if "reentrant pool are busy" not in str(error):
                raise
            pause.wait(0.01)
    return run()


def pool_threads():
    return {thread for thread in threading.enumerate() if thread.name == "pyengine-reentrant"}


@pytest.fixture
def capped_engine():
    """An engine whose every reentrant backward goes to the pool
    (max_recursion_depth 0), with just the two pool threads the graph
    needs; stopped afterwards, and its pool threads must end."""
    threads_before = pool_threads()
    engine = pyengine.Engine(max_recursion_depth=0, max_pool_threads=2)
    previous = pyengine.set_default_engine(engine)
    try:
        yield engine
    finally:
        pyengine.set_default_engine(previous)
        engine.stop(timeout=WORK_S)
    left = [thread for thread in pool_threads() - threads_before if thread.is_alive()]
    assert not left, f"{len(left)} pool threads did not end on stop"


def check_nothing_kept(node):
    gc.collect()
    assert node.made and all(made() is None for made in node.made), \
        "a queue or a graph task kept the cancelled backward's gradients"


@pytest.mark.parametrize("how", HOW)
def test_a_node_that_catches_the_interrupt_of_its_handoff_ends_the_backward(capped_engine, how):
    graph = Handoff(interrupted=True)
    interrupter = interrupt_main_when(graph.d.started, how)
    try:
        error = run_guarded(graph.run)
    finally:
        graph.gate.set()
        interrupter.join()
    assert graph.n.caught, "the nested backward was not interrupted"
    assert not isinstance(error, BackwardHung), (
        "the backward hung: after N caught the KeyboardInterrupt, the main thread served its "
        f"ready queue beside a pool thread (X ran on {graph.x.ran_on}, Y on {graph.y.ran_on})")
    assert isinstance(error, KeyboardInterrupt), f"the backward raised {error!r}"
    assert graph.x.ran_on is None and graph.y.ran_on is None, "a node of G0 ran after the interrupt"
    assert graph.leaf_x.grad is None and graph.leaf_y.grad is None
    del error
    check_nothing_kept(graph.n)
    check_again(graph)


def check_again(interrupted):
    """Once the interrupted graph's nested backward G2 ended (its gate is
    open), the same graph again, uninterrupted: the pool (capped at the
    threads it needs) serves it, and the gradients are exact."""
    wait_for_gradient(interrupted.leaf_d)
    graph = Handoff(interrupted=False)
    when_the_pool_is_free(graph.run)
    graph.check_gradients()


def wait_for_gradient(leaf):
    pause = threading.Event()  # never set: its wait is a pause
    for _ in range(int(WORK_S * 1000)):
        if leaf.grad is not None:
            return
        pause.wait(0.001)
    raise AssertionError("the nested backward never ended")


def test_a_new_backward_is_refused_until_the_interrupted_one_raises(capped_engine):
    refused = []

    def backward_again():
        try:
            backward_from(Scale(pyengine.gradient_edge(Leaf()), 1.0), np.ones(3))
        except RuntimeError as error:
            refused.append(str(error))

    graph = Handoff(interrupted=True, after_catch=backward_again)
    interrupter = interrupt_main_when(graph.d.started, "pthread_kill")
    try:
        error = run_guarded(graph.run)
    finally:
        graph.gate.set()
        interrupter.join()
    assert graph.n.caught
    assert not isinstance(error, BackwardHung), "the backward hung"
    assert isinstance(error, KeyboardInterrupt), f"the backward raised {error!r}"
    del error
    assert len(refused) == 1 and "interrupted" in refused[0], refused
    check_again(graph)


class Reenter(pyengine.Node):
    """A node that runs ``nested`` (a reentrant backward) and passes its
    gradient on, catching a KeyboardInterrupt if ``catch``."""

    def __init__(self, edge, nested, catch):
        super().__init__([edge], cpu_metadata())
        self.nested, self.catch = nested, catch
        self.caught = False

    def apply(self, grads):
        try:
            self.nested(grads[0])
        except KeyboardInterrupt:
            if not self.catch:
                raise
            self.caught = True
        return [grads[0] * 2.0]


@pytest.mark.parametrize("catch_inner, catch_outer", [(True, True), (True, False), (False, True)])
def test_every_level_the_main_thread_drives_ends_with_the_interrupt(catch_inner, catch_outer):
    """Two levels inline on the main thread (max_recursion_depth 1), the
    inner one handing off: whichever of their nodes catch the
    KeyboardInterrupt, the outermost backward raises it."""
    threads_before = pool_threads()
    engine = pyengine.Engine(max_recursion_depth=1, max_pool_threads=1)
    previous = pyengine.set_default_engine(engine)
    try:
        gate = threading.Event()
        leaf_d, leaf_m, leaf_inner, leaf_outer = Leaf(), Leaf(), Leaf(), Leaf()
        d = Scale(pyengine.gradient_edge(leaf_d), 7.0, device=F0, gate=gate)
        a = Scale(pyengine.Edge(d, 0), 1.0, to_device=F0)
        # Runs on the pool thread; its nested backward runs inline there,
        # serving the main thread's queue while d waits for the gate.
        m = Scale(pyengine.gradient_edge(leaf_m), 5.0, nested=lambda grad: backward_from(a, grad))
        inner = Reenter(pyengine.gradient_edge(leaf_inner), lambda grad: backward_from(m, grad),
                        catch_inner)
        outer = Reenter(pyengine.gradient_edge(leaf_outer),
                        lambda grad: backward_from(inner, grad), catch_outer)
        interrupter = interrupt_main_when(d.started, "pthread_kill")
        try:
            error = run_guarded(lambda: backward_from(outer, np.ones(3)))
        finally:
            gate.set()
            interrupter.join()
        assert not isinstance(error, BackwardHung), "the backward hung"
        assert isinstance(error, KeyboardInterrupt), f"the backward raised {error!r}"
        del error
        assert inner.caught == catch_inner and outer.caught == catch_outer
        assert leaf_inner.grad is None and leaf_outer.grad is None
        # Again, uninterrupted, once the nested backward ended: the pool's
        # one thread serves it.
        wait_for_gradient(leaf_d)
        leaf_d.grad = None
        when_the_pool_is_free(lambda: backward_from(outer, np.ones(3)))
        np.testing.assert_array_equal(leaf_outer.grad, [2.0] * 3)
        np.testing.assert_array_equal(leaf_inner.grad, [2.0] * 3)
        np.testing.assert_array_equal(leaf_m.grad, [5.0] * 3)
        np.testing.assert_array_equal(leaf_d.grad, [7.0] * 3)
    finally:
        pyengine.set_default_engine(previous)
        engine.stop(timeout=WORK_S)
    left = [thread for thread in pool_threads() - threads_before if thread.is_alive()]
    assert not left, f"{len(left)} pool threads did not end on stop"
