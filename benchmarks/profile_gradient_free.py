"""A process for a native profiler: a graph of gradient-free nodes, then backward on it.

    # instruction counts of the backward calls only (valgrind):
    valgrind --tool=callgrind --callgrind-out-file=/tmp/free.cg \\
        --collect-atstart=no --toggle-collect='*Engine_3execute*' \\
        python benchmarks/profile_gradient_free.py --kind chain --n 20000 --calls 5
    callgrind_annotate /tmp/free.cg

Each node is the core's ``GradientFreeNodeBase`` (See Note
[GradientFreeNode] in ``pyengine/_pure/node.py``) whose owner's method is a
C call that does next to nothing (``pop`` of one shared list, filled
with a None per node run), so a backward measures the engine's share of a
gradient-free graph, as the micrograd adapter's translated graphs have
them. Graphs, built in forward order (the nodes nearest the leaves first):

- ``chain``: ``n`` nodes in a line;
- ``mlp``: a micrograd-like graph of ``n`` nodes, each with edges to the
  two nodes made just before it (a sum of products: fan-in and fan-out 2).

The script checks that every node ran once per backward (the list is
empty at the end), outside the region callgrind counts.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import pyengine
from pyengine import _core


def build(kind, n, owner, method):
    nodes = []
    for _ in range(n):
        if kind == "chain":
            targets = nodes[-1:]
        else:
            targets = nodes[-2:]
        edges = tuple(_core.Edge(target, 0) for target in targets)
        nodes.append(_core.GradientFreeNodeBase(owner, method, edges))
    return nodes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="chain", choices=["chain", "mlp"])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    engine = pyengine.get_default_engine()
    pops = [None] * (args.n * (args.calls + 1))
    nodes = build(args.kind, args.n, pops, "pop")
    root = [_core.Edge(nodes[-1], 0)]
    engine.execute(root, [None], True, False, True)
    gc.collect()
    start = time.perf_counter()
    for _ in range(args.calls):
        engine.execute(root, [None], True, False, True)
    elapsed = time.perf_counter() - start
    if pops:
        raise SystemExit(f"{len(pops)} of the expected node runs did not happen")
    print(f"{pyengine.IMPLEMENTATION} gradient-free {args.kind} {args.n}: {args.calls} backward "
          f"calls, {elapsed / (args.calls * args.n) * 1e6:.3f} us/node", file=sys.stderr)


if __name__ == "__main__":
    main()
