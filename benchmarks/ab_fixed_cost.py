"""Two builds of pyengine against each other on the fixed cost of one call
(``Engine.execute``, ``backward`` and ``grad`` on a one-node chain), on a
noisy machine: one process per build per round, alternating.

As ``ab_chain.py`` does for the chain's per-node cost: each tree is a
checkout with its compiled core built in place; each process times each
call (``timeit``, the least of its repeats) after checking its result
against the analytic gradient; over the rounds this prints, per tree and
call, the least and the median of those per-process minima, and the
ratio of the second tree's to the first's. Quote both figures beside the
instruction counts: a few percent is within the spread.

``--instructions`` gives those counts instead (valgrind's callgrind, no
timing): per tree and call, each process runs the call 10 times, then
10 + ``--count`` times, and the difference of the two runs' instructions,
over ``--count``, is one call's, loop included (``PYTHONHASHSEED=0``, so
that the two runs differ only in the calls).

    python benchmarks/ab_fixed_cost.py --trees /tmp/base . --rounds 10
    python benchmarks/ab_fixed_cost.py --trees /tmp/base . --instructions
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

_ONE_PROCESS = """
import json, sys, timeit
import numpy as np
import pyengine
from pyengine.bench import graphs

graph = graphs.chain(1)
root, grad, leaf = graph.root_edge, graph.grad, graph.leaf
execute = pyengine.get_default_engine().execute
backward, grad_of = pyengine.backward, pyengine.grad


def run_execute():
    leaf.grad = None
    execute([root], [grad], False, False, True)


def run_backward():
    leaf.grad = None
    backward(root, grad)


def run_grad():
    return grad_of(root, leaf, grad)


RUNS = {"Engine.execute": run_execute, "backward": run_backward, "grad": run_grad}
for run in (run_execute, run_backward):
    run()
    if not np.array_equal(leaf.grad, graph.expected):
        sys.exit(f"{run.__name__}: leaf.grad is {leaf.grad!r}")
if not np.array_equal(run_grad()[0], graph.expected):
    sys.exit("run_grad: wrong gradient")
calls = int(sys.argv[1])
if len(sys.argv) > 2:  # under callgrind: one call, calls times
    run = RUNS[sys.argv[2]]
    for _ in range(calls):
        run()
else:
    print(json.dumps({name: min(timeit.repeat(run, number=calls, repeat=5)) / calls * 1e6
                      for name, run in RUNS.items()}))
"""

CALLS = ("Engine.execute", "backward", "grad")


def _instructions(tree: str, env: dict, call: str, calls: int) -> int:
    """The instructions of the process that makes ``calls`` calls of ``call``."""
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                          sys.executable, "-c", _ONE_PROCESS, str(calls), call],
                         cwd=tree, env=dict(env, PYTHONPATH=os.path.abspath(tree),
                                            PYTHONHASHSEED="0"),
                         capture_output=True, text=True, check=True).stderr
    return int(re.search(r"refs:\s+([\d,]+)", out).group(1).replace(",", ""))


def count_instructions(trees, env, count: int) -> None:
    first, second = trees
    print(f"instructions per call (callgrind, {count} calls less 10)")
    print(f"{'call':16} {first[-28:]:>30} {second[-28:]:>30}  ratio")
    for call in CALLS:
        per_call = [(_instructions(tree, env, call, 10 + count) - _instructions(tree, env, call, 10))
                    / count for tree in trees]
        print(f"{call:16} {per_call[0]:30,.0f} {per_call[1]:30,.0f}  {per_call[1] / per_call[0]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, required=True, help="two checkouts, built in place")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20_000, help="calls per timeit repeat")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under callgrind instead of timing")
    parser.add_argument("--count", type=int, default=20_000,
                        help="calls counted per tree and call with --instructions")
    args = parser.parse_args()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    if args.instructions:
        count_instructions(args.trees, env, args.count)
        return
    samples: dict[str, dict[str, list[float]]] = {tree: {} for tree in args.trees}
    for round_nr in range(args.rounds):
        # Alternate which tree goes first, so neither always follows the other.
        order = args.trees if round_nr % 2 == 0 else args.trees[::-1]
        for tree in order:
            out = subprocess.run([sys.executable, "-c", _ONE_PROCESS, str(args.calls)],
                                 cwd=tree, env=dict(env, PYTHONPATH=os.path.abspath(tree)),
                                 capture_output=True, text=True, check=True).stdout
            for name, us in json.loads(out).items():
                samples[tree].setdefault(name, []).append(us)
    first, second = args.trees
    print(f"us per call, least and median of {args.rounds} processes per tree")
    print(f"{'call':16} {first[-28:]:>30} {second[-28:]:>30}  ratio (least, median)")
    for name in samples[first]:
        a, b = samples[first][name], samples[second][name]
        print(f"{name:16} {min(a):10.3f} {statistics.median(a):8.3f}{'':12}"
              f"{min(b):10.3f} {statistics.median(b):8.3f}{'':12}"
              f"{min(b) / min(a):.3f} {statistics.median(b) / statistics.median(a):.3f}")


if __name__ == "__main__":
    main()
