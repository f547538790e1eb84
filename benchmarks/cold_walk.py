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
- ``walk``: the bare walk (``benchmarks/bare_walk.pyx``, built by this
  script): each node's only next edge followed from C, reading the fields
  the count reads first and nothing else. A chain gives each node's
  address only in the node before it;
- ``prefetched walk``: the same with the count's prefetch along the
  stride, which guesses the address eight nodes on. No count can cost
  less than the cheaper of the two walks;
- ``cold backward`` (only with ``--evict-mb``): the backward after a pass
  over a buffer of that many megabytes, so that the graph starts out of
  the caches (only the backward is timed).
- ``backward after`` and ``count after`` (only with ``--after-chain``):
  one backward, and one count, each timed alone just after the backward of
  another chain of that many nodes, as a sample of ``python -m pyengine
  bench`` follows the samples of the other workloads.

Prints, per size, the median (min-max) of each in microseconds per node,
and each size's excess over the smallest size. Every backward's gradient is
checked against the analytic one (ones) after timing, and every walk's node
count against the chain's.

Then, for the largest size (L) against the smallest (S), what their
ratio of backward costs can be for an engine that counts every node
before it runs any (PyTorch's ``compute_dependencies``). Such an engine
calls every ``apply`` and walks the graph at least once, so it costs at
least ``apply + walk`` per node (``walk`` the cheaper of the two walks),
plus its own work ``E``, which a graph out
of the caches can only make dearer. So its ratio is at least
``(apply_L + walk_L + E) / (apply_S + walk_S + E)``, which falls as ``E``
grows. The script prints that bound at ``E = 0`` (no engine work at all)
and at this engine's own work on S (its backward less its apply and
walk), and the least ``E`` at which the bound reaches ``--goal``: an
engine cheaper than that per node cannot reach the goal on these graphs.
See benchmarks/RESULTS.md, "Issue 19: the least 1M / 10k ratio".

    PYTHONPATH=. python benchmarks/cold_walk.py --sizes 10000 100000 1000000 --repeats 7 --evict-mb 256
    PYTHONPATH=. python benchmarks/cold_walk.py --sizes 10000 100000 --repeats 7 --after-chain 1000000

``PYTHONPATH`` selects the build.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import tempfile
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


def build_bare_walk(build_dir):
    """``benchmarks/bare_walk.pyx`` compiled against the imported pyengine's
    declarations (Cython and a C++ compiler, as pyengine's own build), and
    imported."""
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    package_dir = os.path.dirname(pyengine.__file__)
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bare_walk.pyx")
    extension = Extension("bare_walk", [source], language="c++",
                          include_dirs=[package_dir, np.get_include()])
    distribution = Distribution({"ext_modules": cythonize(
        [extension], include_path=[os.path.dirname(package_dir)], build_dir=build_dir,
        quiet=True)})
    command = distribution.get_command_obj("build_ext")
    command.build_lib = command.build_temp = build_dir
    command.ensure_finalized()
    command.run()
    spec = importlib.util.spec_from_file_location("bare_walk", command.get_ext_fullpath("bare_walk"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _per_node_us(call, calls, nodes):
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / (calls * nodes) * 1e6


def measure(n, repeats, evict_mb, bare_walk, other=None):
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

    def after_other(call):
        # Timed alone: the other chain's backward is what comes before.
        other.reset()
        other.run()
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) / n * 1e6

    root = graph.root_edge.node
    walked = []

    def walk():
        walked.append(bare_walk.walk(root)[0])

    def prefetched_walk():
        walked.append(bare_walk.walk_prefetched(root)[0])

    calls = max(1, 500_000 // n)
    gc.collect()
    gc.freeze()
    times = {"backward": [], "count": [], "search": [], "apply": [], "walk": [],
             "prefetched walk": [], "cold backward": [], "backward after": [],
             "count after": []}
    for _ in range(repeats):
        times["backward"].append(_per_node_us(backward, calls, n))
        times["count"].append(_per_node_us(count, calls, n))
        times["search"].append(_per_node_us(search, calls, n))
        times["apply"].append(_per_node_us(floor.run, calls, n))
        times["walk"].append(_per_node_us(walk, calls, n))
        times["prefetched walk"].append(_per_node_us(prefetched_walk, calls, n))
        if buffer is not None:
            times["cold backward"].append(cold_backward())
        if other is not None:
            times["backward after"].append(after_other(backward))
            times["count after"].append(after_other(count))
    gc.unfreeze()
    if other is not None:
        other.check()
    graph.check()
    floor.check()
    if set(walked) != {n + 1}:  # the chain's nodes and the leaf's AccumulateGrad
        raise AssertionError(f"the bare walk met {sorted(set(walked))} nodes on a chain of {n}")
    return {kind: samples for kind, samples in times.items() if samples}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--evict-mb", type=int, default=0,
                        help="also time a backward after a pass over this many MB (0: not)")
    parser.add_argument("--after-chain", type=int, default=0,
                        help="also time a backward and a count just after the backward of a "
                             "chain of this many nodes (0: not)")
    parser.add_argument("--goal", type=float, default=1.2,
                        help="the largest / smallest ratio the last line's bound is for (issue 19's 1.2)")
    args = parser.parse_args(argv)
    print(f"{pyengine.IMPLEMENTATION} ({pyengine.__file__})")
    if pyengine.IMPLEMENTATION != "compiled":
        parser.error("the bare walk reads the compiled core's nodes: run it without PYENGINE_PURE")
    with tempfile.TemporaryDirectory() as build_dir:
        bare_walk = build_bare_walk(build_dir)
    other = None
    if args.after_chain:
        other = chain(args.after_chain)
        other.run_checked()
    first = medians = None
    for n in args.sizes:
        medians = {}
        cells = []
        for kind, samples in measure(n, args.repeats, args.evict_mb, bare_walk, other).items():
            medians[kind] = statistics.median(samples)
            cells.append(f"{kind} {medians[kind]:.4f} ({min(samples):.4f}-{max(samples):.4f})")
        first = first or medians
        excess = ", ".join(f"{kind} {medians[kind] - first[kind]:+.4f}" for kind in medians)
        print(f"chain {n:>9,}: " + ", ".join(cells) + f" us/node; over the smallest: {excess}")
        sys.stdout.flush()
    if len(args.sizes) > 1:
        print_least_ratio(args.sizes[0], first, args.sizes[-1], medians, args.goal)


def print_least_ratio(small, first, large, last, goal):
    """The bounds of the module docstring for ``large`` over ``small``,
    beside the measured ratio."""
    floor_small = first["apply"] + min(first["walk"], first["prefetched walk"])
    floor_large = last["apply"] + min(last["walk"], last["prefetched walk"])
    own_work = first["backward"] - floor_small
    least_own_work = (floor_large - goal * floor_small) / (goal - 1)
    if least_own_work > 0:
        reach = f"{goal}x needs at least {least_own_work:.4f} us per node of engine work"
    else:
        reach = f"{goal}x is within reach of any engine"
    print(f"{large:,} / {small:,}: measured {last['backward'] / first['backward']:.2f}x; "
          f"least for an engine with no work of its own {floor_large / floor_small:.2f}x, "
          f"with this engine's own work ({own_work:.4f} us per node) "
          f"{(floor_large + own_work) / first['backward']:.2f}x; {reach}")


if __name__ == "__main__":
    main()
