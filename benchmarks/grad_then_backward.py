"""Backward and grad(inputs=) of one chain, alternating: µs per node and the
minor page faults per call of each.

What allocations a grad's dependency search leaves behind decides where
glibc puts the next call's tables: reused pages, or fresh ones the kernel
must fault in and zero (See pyengine/_frame_stack.h). This alternates
``--calls`` backward calls and as many grad(inputs=leaf) calls on one chain,
``--repeats`` times, and prints the medians and the faults per call. The
results are checked against the analytic gradient (ones).

    PYTHONPATH=. python benchmarks/grad_then_backward.py --size 100000
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np

import pyengine
from pyengine.bench.graphs import chain


def timed(call, calls, nodes):
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(calls):
        call()
    seconds = time.perf_counter() - start
    return (seconds / (calls * nodes) * 1e6,
            (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / calls)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=0, help="per repeat (default: 500,000 nodes' worth)")
    args = parser.parse_args()
    graph = chain(args.size)
    leaf_edge = pyengine.gradient_edge(graph.leaf)
    execute = pyengine.get_default_engine().execute
    calls = args.calls or max(1, 500_000 // args.size)

    def backward():
        graph.leaf.grad = None
        execute([graph.root_edge], [graph.grad], False, False, True)

    def grad():
        return execute([graph.root_edge], [graph.grad], False, False, False, outputs=[leaf_edge])

    rows = {"backward": [], "grad": []}
    for _ in range(args.repeats):
        rows["backward"].append(timed(backward, calls, args.size))
        rows["grad"].append(timed(grad, calls, args.size))
    np.testing.assert_array_equal(graph.leaf.grad, graph.expected)
    np.testing.assert_array_equal(grad()[0], graph.expected)
    print(f"{pyengine.IMPLEMENTATION}, chain {args.size:,}: " + "; ".join(
        f"{name} {statistics.median(t for t, _ in samples):.4f} us/node, "
        f"{statistics.mean(f for _, f in samples):,.0f} faults per call"
        for name, samples in rows.items()))


if __name__ == "__main__":
    main()
