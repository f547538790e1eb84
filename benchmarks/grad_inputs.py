"""grad(inputs=) against backward, per node, on chains of Python nodes.

For each size, one chain of pass-through nodes (``pyengine.bench.graphs.chain``)
is built outside the timed region; then, alternately, repeats of:

- backward: ``Engine.execute([root], [grad], False, False, True)``, which
  runs every node and accumulates into the leaf (``graph.run()``, what
  ``python -m pyengine bench`` times);
- grad: ``Engine.execute([root], [grad], False, False, False,
  outputs=[leaf_edge])``, which is ``grad(outputs, inputs=[leaf])``: it
  runs ``init_to_execute`` and every node but the leaf's AccumulateGrad,
  whose input it captures.

Each repeat times ``calls`` calls (500,000 node runs, or one). Prints, per
size, the median and range of the time per node of each, and the ratio of
the medians. Both results are checked against the analytic gradient (ones)
before and after timing.

    PYTHONPATH=. python benchmarks/grad_inputs.py --sizes 10000 100000 1000000 --repeats 7

``PYTHONPATH`` selects the build: run it against another worktree's
package to compare two commits in one session, interleaved.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import numpy as np

import pyengine
from pyengine.bench.graphs import chain


def per_node_us(call, calls, nodes):
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / (calls * nodes) * 1e6


def measure(n, repeats):
    graph = chain(n)
    graph.run_checked()
    leaf_edge = pyengine.gradient_edge(graph.leaf)
    engine = pyengine.get_default_engine()

    def backward():
        graph.reset()
        graph.run()

    def grad():
        return engine.execute([graph.root_edge], [graph.grad], False, False, False,
                              outputs=[leaf_edge])

    (captured,) = grad()
    if not np.array_equal(captured, graph.expected) or graph.leaf.grad is not None:
        raise AssertionError(f"grad on {graph.name} returned {captured!r}")
    calls = max(1, 500_000 // n)
    gc.collect()
    gc.freeze()
    times = {"backward": [], "grad": []}
    for _ in range(repeats):
        times["backward"].append(per_node_us(backward, calls, n))
        times["grad"].append(per_node_us(grad, calls, n))
    graph.check()
    (captured,) = grad()
    if not np.array_equal(captured, graph.expected):
        raise AssertionError(f"grad on {graph.name} returned {captured!r}")
    gc.unfreeze()
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"{pyengine.IMPLEMENTATION} ({pyengine.__file__})")
    for n in args.sizes:
        times = measure(n, args.repeats)
        backward, grad = (statistics.median(times[k]) for k in ("backward", "grad"))
        print(f"chain {n:>9,}: backward {backward:.3f} us/node "
              f"({min(times['backward']):.3f}-{max(times['backward']):.3f}), "
              f"grad(inputs=) {grad:.3f} us/node "
              f"({min(times['grad']):.3f}-{max(times['grad']):.3f}), ratio {grad / backward:.2f}x")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
