"""Ctrl-C while a backward starts a device's worker thread: See Note [A
device worker's claim] in ``pyengine/_shared/device_threads.py``.

The first task an engine sends a device starts that device's worker, on the
thread that routes the task (here the main thread, in ``execute``), in
Python code shared by both cores, where KeyboardInterrupt can come between
any two steps and inside ``threading.Thread.start``. A trace function raises
it at each of those places in turn, one per backward, each on a fresh
``Engine`` (found by the interrupt fuzz: a queue registered without its
worker made every later backward on that device wait forever, and
``Engine.stop`` then raised IndexError for the graph task the interrupted
backward left, which the caller still held through the error).

Oracles, after each interrupted backward: it raised KeyboardInterrupt
exactly where the trace function raised one; the next backward on the same
engine and device gives the exact gradient (2.0 per element) within a
timeout; ``Engine.stop`` returns while the first error is still held; and
then no worker thread of the device is left alive (neither the registered
one nor one its interrupted starter gave up).
"""

from __future__ import annotations

import textwrap

from conftest import run_on_this_core

SCENARIO = textwrap.dedent('''
    import inspect, sys, threading, time
    import numpy as np
    import pyengine
    from pyengine import fake_device as fd
    from pyengine._shared import device_threads

    DEVICE = fd.device(0)

    class Leaf:
        def __init__(self):
            self.data = np.zeros(2); self.grad = None; self.grad_fn = None
            self.output_nr = 0; self.requires_grad = True

    class Double(pyengine.Node):
        def apply(self, grads):
            return [grads[0].numpy() * 2.0]

    def backward(engine, x):
        node = Double([pyengine.gradient_edge(x)],
                      [pyengine.InputMetadata((2,), np.float64, DEVICE)])
        engine.execute([pyengine.Edge(node, 0)], [fd.to_fake(np.ones(2), DEVICE)],
                       False, False, True)

    START = threading.Thread.start.__code__
    QUEUE_FOR = device_threads._DeviceThreads.queue_for.__code__

    class InterruptAt:
        """A trace function that raises KeyboardInterrupt at the ``target``-th
        place queue_for may see one: each of its lines, and the entry to and
        the return from the Thread.start it calls."""

        def __init__(self, target):
            self.target, self.seen, self.fired = target, 0, False
            self.lines_seen = set()

        def place(self):
            self.seen += 1
            if self.seen - 1 == self.target:
                self.fired = True
                sys.settrace(None)
                raise KeyboardInterrupt(f"place {self.target}")

        def __call__(self, frame, event, arg):
            if frame.f_code is QUEUE_FOR:
                return self.local
            if frame.f_code is START and frame.f_back.f_code is QUEUE_FOR:
                self.place()  # before start() does anything
                return self.local
            # Not None: a debug build's Cython frames (line tracing) call
            # their frame's trace function without checking it for None.
            return self.ignore

        def ignore(self, frame, event, arg):
            return self.ignore

        def local(self, frame, event, arg):
            if event == "line" and frame.f_code is QUEUE_FOR:
                if frame.f_lineno not in TRY_LINES and frame.f_lineno not in self.lines_seen:
                    self.lines_seen.add(frame.f_lineno)
                    self.place()
            elif event == "return" and frame.f_code is START:
                self.place()
            return self.local

    # Places no signal reaches, where a trace function's error escapes the
    # enclosing `with` from CPython 3.11 (leaving its lock held): a `try:`
    # line, a NOP, and the `with` line seen again as the block ends, which
    # calls the lock's __exit__ (CPython looks for a signal after that
    # call, once the lock is released). queue_for has no loop: a line seen
    # again is that exit.
    _lines, _first = inspect.getsourcelines(device_threads._DeviceThreads.queue_for)
    TRY_LINES = {_first + i for i, line in enumerate(_lines) if line.strip() == "try:"}

    def workers_alive():
        return [t for t in threading.enumerate() if t.name == f"pyengine-{DEVICE}"]

    def interrupt_each_place():
        target = 0
        while True:
            engine = pyengine.Engine()
            x = Leaf()
            tracer = InterruptAt(target)
            kept = None
            sys.settrace(tracer)
            try:
                backward(engine, x)
            except KeyboardInterrupt as error:
                kept = error  # held, as a REPL holds sys.last_value
            finally:
                sys.settrace(None)
            assert (kept is not None) == tracer.fired, (target, kept, tracer.fired)
            # The next backward on this engine and device, on a thread of its
            # own so that a hang fails here instead of hanging the child.
            result = []
            def again():
                x.grad = None
                backward(engine, x)
                result.append(x.grad.tolist())
            thread = threading.Thread(target=again, daemon=True)
            thread.start()
            thread.join(10.0)
            assert result == [[2.0, 2.0]], f"place {target}: next backward gave {result}"
            engine.stop(timeout=2.0)
            del kept
            deadline = time.monotonic() + 5.0
            while workers_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not workers_alive(), f"place {target}: {len(workers_alive())} workers left"
            if not tracer.fired:
                break
            target += 1
        return target

    try:
        print("places", interrupt_each_place())
    except BaseException:
        # Fail fast: a lock left held would hang the exit's Engine.stop.
        import os, traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
''')


def test_ctrl_c_at_each_place_a_device_worker_starts():
    lines = run_on_this_core(SCENARIO, timeout=180)
    # queue_for's lines on the way to a started worker, and start()'s entry
    # and return: more than a handful, each interrupted once.
    places = int(lines[-1].split()[1])
    assert places >= 10, lines


def test_stop_wakes_no_thread_for_a_graph_task_no_thread_drives():
    # A graph task that a device queue was handed out for, which no thread
    # ever drove (its owner still NO_DEVICE, -2), as an interrupted
    # backward leaves it: stop fails it and wakes no one (it indexed the
    # device queues from the end). An owner that names no device thread (a
    # public int) indexes nothing either: stop wakes the owner through the
    # graph task's own queue (See Note [The owner's queue is the graph
    # task's] in pyengine/_pure/engine.py).
    lines = run_on_this_core(textwrap.dedent('''
        import pyengine
        from pyengine import _core
        from pyengine import fake_device as fd

        for owner in (None, 5, -3):
            engine = pyengine.Engine()
            graph_task = _core.GraphTask(False, False, 0, _core.ReadyQueue())
            engine.ready_queue(graph_task, fd.device(0))
            if owner is not None:
                graph_task.owner = owner
            try:
                engine.stop()
                print(owner, "| stopped;", type(graph_task.exception).__name__)
            except ValueError as error:
                print(owner, "|", error)
    '''), timeout=60)
    assert lines == [
        "None | stopped; RuntimeError",
        "5 | stopped; RuntimeError",
        "-3 | stopped; RuntimeError",
    ]
