#!/usr/bin/env python
"""What a task that crosses to a device worker and back costs: a chain whose
nodes alternate between the CPU and ``fake:0``.

    python benchmarks/device_hops.py [--hops 2000] [--calls 15] [--trees A B --rounds 6]

Every node passes its gradient through (``fake:0``'s nodes hand it back to
the CPU as numpy), so each pair of nodes is two hand-offs between the
caller's thread and the device worker: a push to the other thread's queue,
its wake-up, and the node. The device worker's queue runs dry after each of
its nodes, which is the case Note [An engine's threads hold it weakly]
(pyengine/_shared/engine_registry.py) made dearer: the worker goes back to
wait without its engine and takes it again for the next task.

Printed: µs per hop (one node run on the other thread), the least and the
median of ``--calls`` backward calls; the leaf's gradient is checked (the
chain passes the root's gradient through unchanged). With ``--trees``,
one process per tree per round, alternating (as ``ab_chain.py``), each
tree a checkout built in place.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_ONE_PROCESS = """
import gc, statistics, sys, time
import numpy as np
import pyengine
from pyengine import fake_device as fd
from pyengine.device import CPU

DEVICE = fd.device(0)


class Leaf:
    def __init__(self):
        self.data, self.grad, self.grad_fn = np.zeros(1), None, None
        self.output_nr, self.requires_grad = 0, True


class Hop(pyengine.Node):
    # The gradient, passed through to the next node's device.
    def __init__(self, edge, device, to_fake):
        super().__init__([edge], [pyengine.InputMetadata((1,), np.float64, device)])
        self.to_fake = to_fake

    def apply(self, grads):
        grad = grads[0].numpy() if isinstance(grads[0], fd.FakeArray) else grads[0]
        return [fd.to_fake(grad, DEVICE) if self.to_fake else grad]


hops, calls = int(sys.argv[1]), int(sys.argv[2])
leaf = Leaf()
edge = pyengine.gradient_edge(leaf)
previous = CPU  # the leaf's device
for i in range(hops):
    # Nodes alternate, the one nearest the leaf on the CPU; each passes its
    # gradient on to the device of the node it feeds.
    device = DEVICE if i % 2 else CPU
    node = Hop(edge, device, to_fake=previous == DEVICE)
    edge, previous = pyengine.Edge(node, 0), device
root_grad = fd.to_fake(np.ones(1), DEVICE) if previous == DEVICE else np.ones(1)
times = []
for _ in range(calls):
    leaf.grad = None
    gc.collect()
    gc.disable()
    start = time.perf_counter()
    pyengine.get_default_engine().execute([edge], [root_grad], True, False, True)
    times.append((time.perf_counter() - start) / hops * 1e6)
    gc.enable()
    assert np.array_equal(leaf.grad, np.ones(1)), leaf.grad
print(min(times), statistics.median(times))
"""


def one_process(tree, hops, calls):
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.path.abspath(tree)
    result = subprocess.run([sys.executable, "-c", _ONE_PROCESS, str(hops), str(calls)],
                            cwd=tree or os.getcwd(), env=env, capture_output=True, text=True,
                            check=True)
    least, median = map(float, result.stdout.split())
    return least, median


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hops", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--trees", nargs=2, help="two checkouts, built in place")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    trees = args.trees or [None]
    results = {tree: [] for tree in trees}
    for _ in range(args.rounds if args.trees else 1):
        for tree in trees:
            results[tree].append(one_process(tree, args.hops, args.calls))
    for tree, runs in results.items():
        least = min(run[0] for run in runs)
        median = statistics.median(run[1] for run in runs)
        print(f"{tree or 'this pyengine'}: {least:.2f} us per hop least, "
              f"{median:.2f} median ({len(runs)} processes x {args.calls} calls, "
              f"{args.hops} hops)")


if __name__ == "__main__":
    main()
