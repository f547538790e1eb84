"""Backward and grad(inputs=) on chains of 10k, 100k and 1M nodes, one
sample of each in turn as ``python -m pyengine bench`` interleaves them:
µs per node (median) and minor page faults per call (mean) of each.

Which pages a call's tables get (mapped already, or fresh ones the kernel
faults in and zeroes) depends on what the calls before it allocated and
freed: See Note [Tables kept between backward calls] in
pyengine/_table_growth.h. Every result is checked against the analytic
gradient (ones).

    PYTHONPATH=. python benchmarks/interleaved_faults.py --rounds 5
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np

import pyengine
from pyengine.bench import graphs

SIZES = (10_000, 100_000, 1_000_000)
NODES_PER_SAMPLE = 100_000


def workloads():
    execute = pyengine.get_default_engine().execute
    for kind in ("backward", "grad"):
        for n in SIZES:
            graph = graphs.chain(n)
            if kind == "backward":
                def run(graph=graph):
                    graph.leaf.grad = None
                    execute([graph.root_edge], [graph.grad], False, False, True)
                    return graph.leaf.grad
            else:
                def run(graph=graph):
                    return pyengine.grad(graph.root_edge, graph.leaf, graph.grad)[0]
            yield f"{kind} {n:,}", run, n, graph.expected


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    work = list(workloads())
    times = {name: [] for name, *_ in work}
    faults = {name: 0.0 for name, *_ in work}
    for _ in range(args.rounds):
        for name, run, n, expected in work:
            calls = max(1, NODES_PER_SAMPLE // n)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            for _ in range(calls):
                result = run()
            times[name].append((time.perf_counter() - start) / (calls * n) * 1e6)
            faults[name] += (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
            np.testing.assert_array_equal(result, expected)
    for name in times:
        print(f"{name:>17}: {statistics.median(times[name]):.3f} us/node, "
              f"{faults[name] / args.rounds:,.0f} faults per call")


if __name__ == "__main__":
    main()
