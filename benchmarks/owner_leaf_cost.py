"""What an owner leaf's accumulation costs, lock included: builds against
each other on a returns-mode OwnerGraph whose root has ``k`` leaves as its
parents (See Note [An owner leaf accumulates under a lock] in
pyengine/_pure/owner_graph.py).

Each tree is a checkout with its compiled core built in place (a ``git
worktree`` of the commit to compare with, and this checkout). One process
per tree per round, alternating; each times ``--calls`` backward calls of
the same graph (the leaves' gradients cleared before each) in ``--repeats``
repeats, checks the leaves' gradients against the root's, and reports the
median of its repeats in microseconds per backward. Over the rounds this
prints, per tree and leaf count, the median of the per-process medians and
their spread; the difference between two trees over the leaf count's
difference is the cost per leaf.

    python benchmarks/owner_leaf_cost.py --trees /tmp/base . --leaves 1 6 --rounds 4

With ``--instructions`` it counts instructions instead, under callgrind:
per tree and leaf count, one process with ``--calls`` and one with ten
times as many calls (``PYTHONHASHSEED=0``, the cyclic GC off, the
addresses fixed by ``setarch -R``), and the difference over the extra
calls per backward (about two minutes; needs valgrind and setarch).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

_ONE_PROCESS = """
import os, statistics, sys, timeit
import numpy as np
import pyengine

# The tree's own compiled core, not another checkout's.
assert pyengine.__file__.startswith(os.environ["PYTHONPATH"]), pyengine.__file__
assert pyengine.IMPLEMENTATION == "compiled"

class Value:
    def __init__(self, *parents):
        self.parents, self.grad = list(parents), None

def passes_on(owner, grads):
    return [grads[0]] * len(owner.parents)

graph = pyengine.OwnerGraph("parents", passes_on, mode="returns")
calls, repeats = int(sys.argv[1]), int(sys.argv[2])
for k in map(int, sys.argv[3:]):
    leaves = [Value() for _ in range(k)]
    root = Value(*leaves)
    grad = np.ones(3)

    def run():
        for leaf in leaves:
            leaf.grad = None
        graph.backward(root, grad)

    if repeats == 0:  # counted under callgrind: the calls alone, no collection among them
        import gc
        gc.disable()
        for _ in range(calls):
            run()
        continue
    times = timeit.repeat(run, number=calls, repeat=repeats)
    assert all((leaf.grad == grad).all() for leaf in leaves)
    print(k, statistics.median(times) / calls * 1e6)
"""


def instructions(tree, calls, leaves):
    """Instructions callgrind counted in one process of ``calls`` backward
    calls with ``leaves`` leaves, on ``tree``."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), PYTHONHASHSEED="0")
    env.pop("PYENGINE_PURE", None)
    with tempfile.TemporaryDirectory() as folder:
        # setarch -R: the same addresses in every process, so that the
        # tables keyed by address probe alike.
        out = subprocess.run(["setarch", "-R", "valgrind", "--tool=callgrind",
                              f"--callgrind-out-file={os.path.join(folder, 'out')}",
                              sys.executable, "-c", _ONE_PROCESS, str(calls), "0", str(leaves)],
                             # In the tree: ``-c`` puts the working directory first on sys.path.
                             cwd=tree, env=env, check=True, capture_output=True,
                             text=True).stderr
    return int(re.search(r"Collected : (\d+)", out).group(1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=["."])
    parser.add_argument("--leaves", type=int, nargs="+", default=[1, 6])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under callgrind instead of timing")
    args = parser.parse_args(argv)
    if args.instructions:
        for tree in args.trees:
            for k in args.leaves:
                few = instructions(tree, args.calls, k)
                many = instructions(tree, 10 * args.calls, k)
                print(f"{tree}: {k} leaves: {(many - few) / (9 * args.calls):,.0f} "
                      "instructions per backward")
        return 0
    medians = {(tree, k): [] for tree in args.trees for k in args.leaves}
    for _ in range(args.rounds):
        for tree in args.trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            env.pop("PYENGINE_PURE", None)
            # In the tree: ``-c`` puts the working directory first on sys.path.
            out = subprocess.run([sys.executable, "-c", _ONE_PROCESS, str(args.calls),
                                  str(args.repeats), *map(str, args.leaves)],
                                 cwd=tree, env=env, check=True, capture_output=True,
                                 text=True).stdout
            for line in out.splitlines():
                k, microseconds = line.split()
                medians[(tree, int(k))].append(float(microseconds))
    for tree in args.trees:
        for k in args.leaves:
            values = medians[(tree, k)]
            print(f"{tree}: {k} leaves: median {statistics.median(values):.3f} us per backward "
                  f"({min(values):.3f}-{max(values):.3f} over {len(values)} processes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
