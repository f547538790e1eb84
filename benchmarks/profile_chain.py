"""A process for a native profiler: build a graph, then run backward on it.

    # sampled time, user space (perf_event_paranoid <= 2 is enough), of the
    # backward calls only: perf starts disabled and this script enables it
    # through a control fifo around the timed loop.
    mkfifo /tmp/perf.ctl /tmp/perf.ack
    perf record -e cpu-clock -F 20000 -D -1 --control fifo:/tmp/perf.ctl,/tmp/perf.ack \\
        -o /tmp/chain.perf -- python benchmarks/profile_chain.py --n 100000 --calls 20 \\
        --perf-ctl /tmp/perf.ctl --perf-ack /tmp/perf.ack
    perf report -i /tmp/chain.perf --no-children --sort dso,symbol

    # instruction counts of the backward calls only (valgrind):
    valgrind --tool=callgrind --callgrind-out-file=/tmp/chain.cg \\
        --collect-atstart=no --toggle-collect='*Engine_3execute*' \\
        python benchmarks/profile_chain.py --n 20000 --calls 5
    callgrind_annotate /tmp/chain.cg

cProfile cannot see inside the compiled core; these can (function level:
the extension is built without debug info). Build and the gradient check
run outside ``Engine.execute``, so ``--toggle-collect`` leaves them out.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pyengine  # noqa: E402
from pyengine.bench.graphs import build  # noqa: E402


def _perf(args, command):
    if not args.perf_ctl:
        return
    with open(args.perf_ctl, "w") as ctl:
        ctl.write(command + "\n")
    if args.perf_ack:
        with open(args.perf_ack) as ack:
            ack.readline()


class _GradInputs:
    """A chain run as ``grad(root, inputs=leaf)``: exec_info's path, which
    a backward into the leaf never takes."""

    def __init__(self, chain):
        self.chain = chain
        self.name = f"grad(inputs=), {chain.name}"
        self.nodes = chain.nodes
        self.result = None

    def reset(self):
        pass

    def run(self):
        self.result = pyengine.grad(self.chain.root_edge, self.chain.leaf, self.chain.grad)

    def check(self):
        import numpy as np

        np.testing.assert_array_equal(self.result[0], self.chain.expected)

    def run_checked(self):
        self.run()
        self.check()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="chain",
                        choices=["chain", "scalar-chain", "wide", "single", "grad-inputs"],
                        help="grad-inputs: grad(root, inputs=leaf) on a chain, the bench's row of "
                             "that name")
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--perf-ctl", help="perf --control fifo: enabled around the backward calls")
    parser.add_argument("--perf-ack", help="perf's ack fifo, waited on after each command")
    args = parser.parse_args(argv)
    if args.kind == "grad-inputs":
        graph = _GradInputs(build("chain", args.n))
    else:
        graph = build(args.kind, args.n)
    graph.run_checked()
    gc.collect()
    _perf(args, "enable")
    start = time.perf_counter()
    for _ in range(args.calls):
        graph.reset()
        graph.run()
    elapsed = time.perf_counter() - start
    _perf(args, "disable")
    graph.check()
    print(f"{pyengine.IMPLEMENTATION} {graph.name}: {args.calls} backward calls, "
          f"{elapsed / (args.calls * graph.nodes) * 1e6:.3f} us/node", file=sys.stderr)


if __name__ == "__main__":
    main()
