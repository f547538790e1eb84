"""Two Engines at once: a node that one Engine's device worker runs calls
backward, which goes to the default engine (found by the thread fuzz,
``tests/fuzz/thread_fuzz.py``).

The nested backward is reentrant on that worker thread: it waits for its
graph task in the worker's own queue, which belongs to the other Engine.
The thread that completes the graph task (a device worker of the default
engine) must wake it up there. It used to find the owner by its device
index in its own engine's device table, an index that each engine hands
out in the order it first uses its devices: the owner's index named
another thread of the default engine (often the completing thread itself,
which then woke no one), and the nested backward waited forever. See Note
[The owner's queue is the graph task's] in ``pyengine/_pure/engine.py``.

Oracle: the exact gradients (x3 and x2 on ones), and an exit
within the timeout (the hang ran in a child process).
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

    class Leaf:
        def __init__(self):
            self.data, self.grad, self.grad_fn = np.zeros(SHAPE), None, None
            self.output_nr, self.requires_grad = 0, True

    def metadata(device):
        return [pyengine.InputMetadata(SHAPE, np.float64, device)]

    def host(value):
        return value.numpy() if isinstance(value, fd.FakeArray) else value

    class Scale(pyengine.Node):
        """x3, its gradient on the device of the node it flows into; keeps
        what it received in ``seen``."""
        def __init__(self, edges, device, to=None):
            super().__init__(next_edges=edges, input_metadata=metadata(device))
            self.to = to
            self.seen = []

        def apply(self, grads):
            self.seen.append(host(grads[0]).tolist())
            out = host(grads[0]) * 3.0
            return [out if self.to is None else fd.to_fake(out, self.to)]

    class Nested(pyengine.Node):
        """x2 into its leaf, after a backward (the default engine's) on ``root``."""
        def __init__(self, edges, device, root):
            super().__init__(next_edges=edges, input_metadata=metadata(device))
            self.root = root

        def apply(self, grads):
            pyengine.backward([pyengine.Edge(self.root, 0)], [np.ones(SHAPE)], retain_graph=True)
            return [host(grads[0]) * 2.0]

    def run(other_first_device, nested_device, inner_device, threads):
        x = Leaf()
        # The nested graph: a CPU node, then one on inner_device, the last
        # node of the nested graph task (its gradient goes nowhere): its
        # worker completes the graph task.
        inner = Scale([None], fd.device(inner_device))
        middle = Scale([pyengine.Edge(inner, 0)], pyengine.CPU, to=fd.device(inner_device))
        other = pyengine.Engine()
        if other_first_device is not None:
            # Another device first: the nested device gets index 1 in it.
            warm = Scale([None], fd.device(other_first_device))
            other.execute([pyengine.Edge(warm, 0)],
                          [fd.to_fake(np.ones(SHAPE), fd.device(other_first_device))],
                          False, False, True, None)
        outer = Nested([pyengine.gradient_edge(x)], fd.device(nested_device), middle)

        def call():
            other.execute([pyengine.Edge(outer, 0)],
                          [fd.to_fake(np.ones(SHAPE), fd.device(nested_device))],
                          True, False, True, None)

        workers = [threading.Thread(target=call) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        other.stop()
        print(other_first_device, nested_device, inner_device, threads,
              x.grad.tolist(), inner.seen == [[3.0, 3.0]] * threads)

    run(None, 1, 0, 1)   # both devices index 0 in their engines
    run(0, 1, 0, 1)      # the nested device index 1 in the other engine
    run(None, 0, 0, 1)   # one device, a worker of each engine
    run(None, 1, 0, 4)   # four threads at once
''')


def test_a_backward_nested_in_another_engines_device_worker_completes():
    lines = run_on_this_core(SCENARIO, timeout=30)
    assert lines == [
        "None 1 0 1 [2.0, 2.0] True",
        "0 1 0 1 [2.0, 2.0] True",
        "None 0 0 1 [2.0, 2.0] True",
        "None 1 0 4 [8.0, 8.0] True",
    ], lines
