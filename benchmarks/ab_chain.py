"""Two builds of pyengine against each other on the bench's chain, on a
noisy machine: one process per build per round, alternating.

Each tree is a checkout with its compiled core built in place (``python
setup.py build_ext --inplace``): a ``git worktree`` of the commit to compare
with, and this checkout. Each process builds one chain per size
(``pyengine.bench.graphs.chain``), runs ``--calls`` backward calls on it,
checks the leaf's gradient against the analytic one, and reports the least
time per node of its calls. Over the rounds, this prints for each tree and
size the least and the median of those per-process minima.

Processes alternate so that a slow spell of the machine falls on both
builds; the least of many processes is what a build costs when nothing else
runs. Quote both figures, and the instruction counts (``callgrind``, see
``profile_chain.py``) beside them: on a shared machine a few percent is
within the spread of either.

    python benchmarks/ab_chain.py --trees /tmp/base . --sizes 10000 100000 --rounds 10

``--kind`` times another of the bench's graphs (``pyengine.bench.graphs.
BUILDERS``: ``scalar-chain``, the chain on numpy scalars), per node as
``Graph.nodes`` counts them; both trees must have it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_ONE_PROCESS = """
import gc, sys, time
from pyengine.bench.graphs import build
kind, calls = sys.argv[1], int(sys.argv[2])
for n in map(int, sys.argv[3:]):
    graph = build(kind, n)
    best = float("inf")
    for _ in range(calls):
        graph.reset()
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        graph.run()
        best = min(best, time.perf_counter() - start)
        gc.enable()
        graph.check()
    print(n, best / graph.nodes * 1e6)
"""


def one_process(tree, kind, calls, sizes):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    result = subprocess.run([sys.executable, "-c", _ONE_PROCESS, kind, str(calls),
                             *map(str, sizes)],
                            cwd=tree, env=env, capture_output=True, text=True, check=True)
    return {int(n): float(t) for n, t in (line.split() for line in result.stdout.splitlines())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs=2, required=True, help="two checkouts, built in place")
    parser.add_argument("--sizes", nargs="+", type=int, default=[10_000, 100_000])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=7, help="backward calls per process")
    parser.add_argument("--kind", default="chain", help="a graph kind of pyengine.bench.graphs")
    args = parser.parse_args(argv)
    minima = {(tree, n): [] for tree in args.trees for n in args.sizes}
    for _ in range(args.rounds):
        for tree in args.trees:
            for n, t in one_process(tree, args.kind, args.calls, args.sizes).items():
                minima[tree, n].append(t)
    print(f"us per node over {args.rounds} rounds: least / median of each process's least")
    for n in args.sizes:
        cells = [f"{min(minima[tree, n]):.4f} / {statistics.median(minima[tree, n]):.4f}"
                 for tree in args.trees]
        print(f"{args.kind} {n:>9,}  "
              + "  ".join(f"{tree}: {cell}" for tree, cell in zip(args.trees, cells)))


if __name__ == "__main__":
    main()
