"""Where a large chain's extra cost per node goes: the count over a graph
the caches no longer hold.

For each size, one chain of pass-through nodes (``pyengine.bench.graphs.chain``)
is built outside the timed region; then, alternately, repeats of:

- ``backward``: the whole backward (``graph.run()``, what ``python -m
  pyengine bench`` times), the graph warm from the call before;
- ``count``: the count alone. A root node whose ``apply`` raises sits above
  the chain, so a call counts the dependencies of every node, runs the root
  and stops: its time is ``compute_dependencies`` plus one node and the
  task's teardown;
- ``search``: the same under ``grad(inputs=)`` (``outputs=[leaf edge]``):
  ``init_to_execute``'s depth-first search, which marks the nodes that run
  as it counts (one frame per node on a chain's path);
- ``apply``: each node's ``apply`` called from C with no engine (the bench's
  floor, ``pyengine.bench.subjects._apply_floor``), from a list of the nodes;
- ``cold backward`` (only with ``--evict-mb``): the backward after a pass
  over a buffer of that many megabytes, so that the graph starts out of
  the caches (only the backward is timed).

Prints, per size, the median (min-max) of each in microseconds per node,
and each size's excess over the smallest size. Every backward's gradient is
checked against the analytic one (ones) after timing.

    PYTHONPATH=. python benchmarks/cold_walk.py --sizes 10000 100000 1000000 --repeats 7 --evict-mb 256

``PYTHONPATH`` selects the build.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import numpy as np

import pyengine
from pyengine.bench.graphs import _metadata, chain, chain_nodes
from pyengine.bench.subjects import _apply_floor


class _StopHere(Exception):
    pass


class _Raise(pyengine.Node):
    """A root whose backward fails at once: the backward ends after the count."""

    def apply(self, grads):
        raise _StopHere


def _per_node_us(call, calls, nodes):
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / (calls * nodes) * 1e6


def measure(n, repeats, evict_mb):
    graph = chain(n)
    graph.run_checked()
    engine = pyengine.get_default_engine()
    stop_root = pyengine.Edge(_Raise(next_edges=(graph.root_edge,), input_metadata=(_metadata(),)), 0)
    floor = _apply_floor(graph, chain_nodes)
    buffer = np.zeros(evict_mb << 17) if evict_mb else None  # float64: 8 bytes each

    def backward():
        graph.reset()
        graph.run()

    leaf_edge = pyengine.gradient_edge(graph.leaf)

    def count():
        try:
            engine.execute([stop_root], [graph.grad], False, False, True)
        except _StopHere:
            return
        raise AssertionError("the root above the chain did not raise")

    def search():
        try:
            engine.execute([stop_root], [graph.grad], False, False, False, outputs=[leaf_edge])
        except _StopHere:
            return
        raise AssertionError("the root above the chain did not raise")

    def cold_backward():
        # Timed alone: the pass over the buffer only pushes the graph out.
        total = 0.0
        for _ in range(max(1, 20_000 // n)):
            np.add(buffer, 1.0, out=buffer)
            graph.reset()
            start = time.perf_counter()
            graph.run()
            total += time.perf_counter() - start
        return total / (max(1, 20_000 // n) * n) * 1e6

    calls = max(1, 500_000 // n)
    gc.collect()
    gc.freeze()
    times = {"backward": [], "count": [], "search": [], "apply": [], "cold backward": []}
    for _ in range(repeats):
        times["backward"].append(_per_node_us(backward, calls, n))
        times["count"].append(_per_node_us(count, calls, n))
        times["search"].append(_per_node_us(search, calls, n))
        times["apply"].append(_per_node_us(floor.run, calls, n))
        if buffer is not None:
            times["cold backward"].append(cold_backward())
    gc.unfreeze()
    graph.check()
    floor.check()
    return {kind: samples for kind, samples in times.items() if samples}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--evict-mb", type=int, default=0,
                        help="also time a backward after a pass over this many MB (0: not)")
    args = parser.parse_args(argv)
    print(f"{pyengine.IMPLEMENTATION} ({pyengine.__file__})")
    first = None
    for n in args.sizes:
        medians = {}
        cells = []
        for kind, samples in measure(n, args.repeats, args.evict_mb).items():
            medians[kind] = statistics.median(samples)
            cells.append(f"{kind} {medians[kind]:.4f} ({min(samples):.4f}-{max(samples):.4f})")
        first = first or medians
        excess = ", ".join(f"{kind} {medians[kind] - first[kind]:+.4f}" for kind in medians)
        print(f"chain {n:>9,}: " + ", ".join(cells) + f" us/node; over the smallest: {excess}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
