"""Backward of a chain at 10k, 100k and 1M nodes: µs per node and the minor
page faults per backward (the pages the DependencyMap's fresh tables touch).

Run it as is, and with glibc told to keep freed memory (no table then comes
from fresh pages), to see what the faults cost:

    PYTHONPATH=. python benchmarks/faults_per_backward.py
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967295 \
        PYTHONPATH=. python benchmarks/faults_per_backward.py
"""

from __future__ import annotations

import resource
import time

import numpy as np

import pyengine
from pyengine.bench import graphs


def main():
    execute = pyengine.get_default_engine().execute
    for n in (10_000, 100_000, 1_000_000):
        graph = graphs.chain(n)

        def run(graph=graph):
            graph.leaf.grad = None
            execute([graph.root_edge], [graph.grad], False, False, True)

        run()
        repeats = max(3, 1_000_000 // n)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        seconds = time.perf_counter() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        np.testing.assert_array_equal(graph.leaf.grad, graph.expected)
        print(f"chain {n:>9,}: {seconds / (repeats * n) * 1e6:.4f} us/node, "
              f"{faults / repeats:,.0f} page faults per backward")


if __name__ == "__main__":
    main()
