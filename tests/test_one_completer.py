"""One thread completes a graph task: the one whose task took its count of
outstanding tasks to zero (found by the thread fuzz, ``tests/fuzz/thread_fuzz.py``,
in the twin).

A device worker ran the graph task's last device task, and the caller its
last CPU task, at once. In the twin a thread can be switched out between
any two bytecodes: the worker counted its task done (one left), and before
it looked at the count again the caller counted its own (none left) and
began the final callbacks. The worker then also saw none left, and waited
for the caller to finish them, while a callback ran a backward that needs
that device's worker: a deadlock. Now each thread goes by the count its own
decrement left (See Note [One thread completes a graph task] in
``pyengine/_pure/engine.py``): the worker, left with one, goes back to its
queue and serves the callback's backward.

Here a trace function holds the worker right after its decrement until the
caller is in the callback (the twin's code is Python; the compiled core's
decrement and check are C with the GIL held, where no other thread runs in
between, so there the scenario runs straight through). Oracle: an exit
within the timeout, and the exact gradient of the callback's backward.
"""

from __future__ import annotations

import textwrap

from conftest import run_on_this_core

SCENARIO = textwrap.dedent('''
    import threading
    import numpy as np
    import pyengine
    from pyengine import fake_device as fd

    SHAPE = (2,)
    TWIN = pyengine.IMPLEMENTATION == "pure"
    armed = []                        # set by D on the worker: hold its next decrement
    held = threading.Event()          # the worker is held after its decrement
    in_callback = threading.Event()   # the caller runs the final callback

    def no_op(frame, event, arg):
        return no_op

    def trace(frame, event, arg):
        # A no-op local trace function for other frames, not None: See
        # tests/test_device_worker_start.py.
        if frame.f_code.co_name != "decrement_outstanding_tasks":
            return no_op

        def on_return(frame, event, arg):
            if event == "return" and armed and threading.current_thread().name == "pyengine-fake:0":
                armed.clear()
                held.set()
                in_callback.wait(10)
            return on_return
        return on_return

    threading.settrace(trace)  # for the device worker, started below

    class Leaf:
        def __init__(self):
            self.data, self.grad, self.grad_fn = np.zeros(SHAPE), None, None
            self.output_nr, self.requires_grad = 0, True

    def metadata(device):
        return [pyengine.InputMetadata(SHAPE, np.float64, device)]

    class D(pyengine.Node):
        """On fake:0, the graph task's last device task."""
        def apply(self, grads):
            armed.append(True)
            return [None]

    class C(pyengine.Node):
        """On the CPU, the graph task's last CPU task, once the worker is held."""
        def apply(self, grads):
            if TWIN:
                held.wait(10)
            return [None]

    class N(pyengine.Node):
        """On fake:0, in the callback's backward: x3 into y."""
        def apply(self, grads):
            return [grads[0].numpy() * 3.0]

    y = Leaf()
    n = N([pyengine.gradient_edge(y)], metadata(fd.device(0)))

    def callback():
        in_callback.set()
        pyengine.backward([pyengine.Edge(n, 0)], [fd.to_fake(np.ones(SHAPE), fd.device(0))])

    class R(pyengine.Node):
        """The root: its gradient to D and C; queues the final callback."""
        def apply(self, grads):
            pyengine.queue_callback(callback)
            return [fd.to_fake(grads[0], fd.device(0)), grads[0]]

    d = D([None], metadata(fd.device(0)))
    c = C([None], metadata(pyengine.CPU))
    r = R([pyengine.Edge(d, 0), pyengine.Edge(c, 0)], metadata(pyengine.CPU))
    pyengine.backward([pyengine.Edge(r, 0)], [np.ones(SHAPE)])
    threading.settrace(None)
    print(y.grad.tolist(), held.is_set() == TWIN)
''')


def test_only_the_thread_that_counts_the_last_task_completes_the_graph_task():
    lines = run_on_this_core(SCENARIO, timeout=30)
    assert lines == ["[3.0, 3.0] True"], lines
