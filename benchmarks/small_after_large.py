"""A small grad(inputs=) right after a large one, per node.

The dependency search's frames once lived in a ``std::deque``, whose
blocks a large search freed by the hundred thousand; the next small search
then got blocks scattered through that memory, cold in cache. This times
ten grads of a small chain after each grad of a large chain (``--large``,
or none with ``--large 0``), for ``--rounds`` rounds, and prints the small
grads' median µs per node and the minor page faults per small grad. The
gradient is checked against the analytic one (ones).

    PYTHONPATH=. python benchmarks/small_after_large.py --small 10000 --large 1000000
    PYTHONPATH=. python benchmarks/small_after_large.py --small 10000 --large 0
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np

import pyengine
from pyengine.bench.graphs import chain


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    large = chain(args.large) if args.large else None
    small = chain(args.small)
    samples, faults = [], 0
    for _ in range(args.rounds):
        if large is not None:
            pyengine.grad(large.root_edge, large.leaf, large.grad)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        for _ in range(10):
            (result,) = pyengine.grad(small.root_edge, small.leaf, small.grad)
        samples.append((time.perf_counter() - start) / (10 * args.small) * 1e6)
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    np.testing.assert_array_equal(result, small.expected)
    print(f"{pyengine.IMPLEMENTATION}: small chain {args.small:,} after large {args.large:,}: "
          f"{statistics.median(samples):.4f} us/node (median of {args.rounds}), "
          f"{faults / (10 * args.rounds):.1f} page faults per small grad")


if __name__ == "__main__":
    main()
