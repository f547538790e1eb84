"""Two builds of pyengine against each other on the frontend's 0-d tensors,
whose operations give numpy scalars as gradients (``np.ones(()) * 2.0`` is
an ``np.float64``): one process per build per round, alternating.

Two graphs, built with ``pyengine.frontend`` outside the timed region:

- ``chain``: a 0-d leaf multiplied by 1.0001, ``--n`` times; the leaf's
  gradient is ``1.0001 ** n``.
- ``layer``: micrograd's shape, a dense layer of scalars: 20 outputs, each
  the sum of 50 products ``w[r][i] * x[i]``, summed; each ``x[i]``'s
  gradient is ``sum(w[r][i] for r)``, summed in its InputBuffer from 20
  gradients. 1,999 operations.

Each process checks the gradients against those analytic values, then
reports the least time of ``--calls`` backward calls per operation; over
the rounds this prints, per tree and graph, the least and the median of
those minima (as ``ab_chain.py`` does, whose notes on a noisy machine
apply).

    python benchmarks/ab_frontend_scalars.py --trees /tmp/base . --rounds 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_ONE_PROCESS = """
import gc, sys, time
import numpy as np
import pyengine.frontend as F

n, calls = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)


def chain():
    x = F.Tensor(np.array(1.0), requires_grad=True)
    y = x
    for _ in range(n):
        y = y * 1.0001
    return y, n, lambda: np.isclose(x.grad.data, 1.0001 ** n, rtol=1e-12)


def layer():
    xs = [F.Tensor(np.array(v), requires_grad=True) for v in rng.random(50)]
    ws = rng.random((20, 50))
    out = None
    for row in ws:
        acc = None
        for w, x in zip(row, xs):
            product = x * float(w)
            acc = product if acc is None else acc + product
        out = acc if out is None else out + acc
    expected = ws.sum(axis=0)
    return out, 20 * 50 + 20 * 49 + 19, lambda: np.allclose(
        [x.grad.data for x in xs], expected, rtol=1e-12)


for name, build in (("chain", chain), ("layer", layer)):
    best = float("inf")
    for _ in range(calls):
        root, operations, correct = build()
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        root.backward()
        best = min(best, time.perf_counter() - start)
        gc.enable()
        if not correct():
            raise AssertionError(f"{name}: wrong gradient")
    print(name, best / operations * 1e6)
"""


def one_process(tree, n, calls):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    result = subprocess.run([sys.executable, "-c", _ONE_PROCESS, str(n), str(calls)],
                            cwd=tree, env=env, capture_output=True, text=True, check=True)
    return {name: float(t) for name, t in (line.split() for line in result.stdout.splitlines())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs=2, required=True, help="two checkouts, built in place")
    parser.add_argument("--n", type=int, default=2000, help="the chain's length")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=7, help="backward calls per process")
    args = parser.parse_args(argv)
    minima = {}
    for _ in range(args.rounds):
        for tree in args.trees:
            for name, t in one_process(tree, args.n, args.calls).items():
                minima.setdefault((tree, name), []).append(t)
    print(f"us per operation over {args.rounds} rounds: least / median of each process's least")
    for name in ("chain", "layer"):
        cells = [f"{min(minima[tree, name]):.3f} / {statistics.median(minima[tree, name]):.3f}"
                 for tree in args.trees]
        print(f"{name:<6}  " + "  ".join(f"{tree}: {cell}" for tree, cell in zip(args.trees, cells)))


if __name__ == "__main__":
    main()
