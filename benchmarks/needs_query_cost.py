"""What the frontend pays for asking the engine which gradients a node
should compute (``OpNode.needs`` calls ``task_should_compute_output``), on
the bench's MLP training step, against the answer it gave before (whether
the input has an edge at all), in one process, alternating.

Prints the median time per step of each answer over ``--rounds`` rounds of
``--steps`` steps and their ratio; then what the difference should be:
the ``needs`` calls of one backward times the time of one call while the
engine runs its node (the ratio of two medians on a shared machine moves
by more than that). Three workloads:

- a training step (forward, ``backward()``, SGD), where nothing is pruned
  and the query only costs;
- ``grad`` of the loss with respect to the first layer's parameters, where
  the query lets the later layers' formulas skip the gradients of the
  weights nobody asked for;
- a chain of ``--chain`` ops on 4-element tensors (forward and
  ``backward()``, a twentieth of ``--steps``), where each formula costs
  least beside the query.

    python benchmarks/needs_query_cost.py --rounds 15 --steps 200

``--probe-only N`` runs nothing but N ``needs`` calls in a running node,
for an instruction count that does not depend on the machine's load: the
difference of two callgrind runs divided by N,

    valgrind --tool=callgrind python benchmarks/needs_query_cost.py --probe-only 0
    valgrind --tool=callgrind python benchmarks/needs_query_cost.py --probe-only 20000

and ``--only query`` / ``--only edge-only`` runs ``--steps`` training steps
with that answer alone, for the instructions of a step (with ``--steps 0``
for the runs' common part).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pyengine.frontend as F
from pyengine.frontend import graph, nn


def edge_only(self, index):
    """``OpNode.needs`` before it asked the engine: does the input take a gradient?"""
    return self._next_edges[index] is not None


def probe(calls):
    """Seconds that ``calls`` calls of ``needs(0)`` take inside a running node."""

    class Probe(graph.OpNode):
        def formula(self, grad):
            start = time.perf_counter()
            for _ in range(calls):
                self.needs(0)
            Probe.seconds = time.perf_counter() - start
            return [grad]

    leaf = F.tensor([1.0], requires_grad=True)
    out = F.Tensor._make(np.array([1.0]))
    graph.record(Probe, (leaf,), out)
    out.sum().backward()
    return Probe.seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--chain", type=int, default=3000,
                        help="ops in the small-node chain (forward and backward per step)")
    parser.add_argument("--probe-only", type=int, metavar="N",
                        help="only make N needs() calls in a running node")
    parser.add_argument("--only", choices=["query", "edge-only"],
                        help="only run --steps training steps with this answer")
    args = parser.parse_args()
    if args.probe_only is not None:
        probe(args.probe_only)
        return

    rng = np.random.default_rng(0)
    model = nn.MLP([2, 64, 64, 2], activation="relu")
    optimizer = F.optim.SGD(model.parameters(), lr=0.01)
    x = F.tensor(rng.standard_normal((64, 2)))
    y = F.tensor(rng.integers(0, 2, 64))
    first_layer = list(model.parameters())[:2]

    def training_step():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    def first_layer_grad():
        F.grad(F.cross_entropy(model(x), y), first_layer)

    small = F.tensor(rng.standard_normal(4), requires_grad=True)

    def small_node_chain():
        # Where a formula costs least beside the query: 4-element ops.
        value = small
        for _ in range(args.chain // 3):
            value = F.tanh(value * 0.5 + 0.1)
        value.sum().backward()

    query = graph.OpNode.needs
    if args.only is not None:
        graph.OpNode.needs = query if args.only == "query" else edge_only
        for _ in range(args.steps):
            training_step()
        return
    # The chain's step is some thousand ops: a twentieth of the steps.
    workloads = [("training step", training_step, args.steps),
                 ("grad of the first layer", first_layer_grad, args.steps),
                 (f"chain of {args.chain // 3 * 3} small ops", small_node_chain, max(1, args.steps // 20))]
    for name, step, steps in workloads:
        times = {"query": [], "edge only": []}
        for round_number in range(args.rounds):
            # Each answer goes first in every other round: the first of a
            # pair pays for what the other left (caches, the collector).
            order = [("query", query), ("edge only", edge_only)]
            for label, needs in order if round_number % 2 == 0 else order[::-1]:
                graph.OpNode.needs = needs
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                times[label].append((time.perf_counter() - start) / steps * 1e6)
        graph.OpNode.needs = query
        asked, before = statistics.median(times["query"]), statistics.median(times["edge only"])
        print(f"{name}: query {asked:.1f} us, edge only {before:.1f} us per step "
              f"(medians of {args.rounds}), ratio {asked / before:.3f}")

    calls = 20_000
    per_call = probe(calls) / calls
    counted = []

    def counting(self, index):
        counted.append(index)
        return query(self, index)

    graph.OpNode.needs = counting
    try:
        F.cross_entropy(model(x), y).backward()
    finally:
        graph.OpNode.needs = query
    print(f"one needs() call while its node runs: {per_call * 1e9:.0f} ns; a training step's "
          f"backward makes {len(counted)}: {len(counted) * per_call * 1e6:.1f} us per step")


if __name__ == "__main__":
    main()
