"""pytest-benchmark suites for the engine.

    python -m pytest benchmarks --benchmark-only                  # all
    python -m pytest benchmarks --benchmark-only -m "not slow"    # skip the 1M chain
    PYENGINE_PURE=1 python -m pytest benchmarks --benchmark-only  # the pure twin

They run against whichever core ``PYENGINE_PURE`` selected; the
implementation is recorded in each benchmark's ``extra_info`` and in its
name's ``[compiled]``/``[pure]`` suffix. Each benchmark builds its graph
outside the timed region, runs one backward and checks the leaf's gradient
against the analytic value, then times
``Engine.execute([root_edge], [grad], False, False, True)`` only; the leaf's
``.grad`` is reset to None between rounds (untimed). ``extra_info`` holds
``nodes`` and, after the run, ``us_per_node`` (from the median).
For the side-by-side table of both cores and PyTorch, use
``python -m pyengine bench``.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import pyengine  # noqa: E402
from pyengine.bench.graphs import Graph, build  # noqa: E402

IMPL = pyengine.IMPLEMENTATION


def _bench(benchmark, graph: Graph, rounds: int, iterations: int = 1):
    graph.run_checked()  # the oracle: a broken engine fails here, before any timing
    benchmark.group = f"{graph.name.split()[0]} [{IMPL}]"
    benchmark.extra_info.update(implementation=IMPL, nodes=graph.nodes, graph=graph.name)
    gc.collect()

    if iterations == 1:
        def setup():
            graph.reset()

        benchmark.pedantic(graph.run, setup=setup, rounds=rounds, iterations=1, warmup_rounds=1)
    else:
        # Many backward calls per round (tiny graphs): .grad is reset inside
        # the timed loop, one attribute store per call.
        def many():
            for _ in range(iterations):
                graph.leaf.grad = None
                graph.run()

        benchmark.pedantic(many, rounds=rounds, iterations=1, warmup_rounds=1)
    graph.run_checked()  # still right after the timed runs
    if benchmark.stats is not None:
        median = benchmark.stats.stats.median
        benchmark.extra_info["us_per_node"] = median / (graph.nodes * iterations) * 1e6
        benchmark.extra_info["us_per_backward"] = median / iterations * 1e6


@pytest.mark.parametrize("n", [10_000, 100_000], ids=lambda n: f"{n // 1000}k-{IMPL}")
def test_chain(benchmark, n):
    """A chain of ``n`` pass-through nodes ending in one leaf."""
    _bench(benchmark, build("chain", n), rounds=10 if n <= 10_000 else 5)


@pytest.mark.slow
def test_chain_1m(benchmark):
    """The chain at 1M nodes: per-node cost should stay flat with size."""
    _bench(benchmark, build("chain", 1_000_000), rounds=3)


def test_wide_1000x10(benchmark):
    """A root fanning out to 1,000 branches of depth 10 joined at one leaf."""
    _bench(benchmark, build("wide", 10_000), rounds=10)


@pytest.mark.parametrize("n", [100_000], ids=lambda n: f"{n // 1000}k-{IMPL}")
def test_wide_scaled(benchmark, n):
    """The wide graph scaled to ``n`` nodes: ``n // 10`` branches of depth 10."""
    _bench(benchmark, build("wide", n), rounds=5)


def test_lattice_100x100(benchmark):
    """A diamond lattice 100 wide and 100 deep: every node sums two gradients."""
    _bench(benchmark, build("lattice", 10_000), rounds=10)


def test_fan_in_1000(benchmark):
    """1,000 branches into one sink node, whose InputBuffer sums them."""
    _bench(benchmark, build("fan-in", 1_000), rounds=20, iterations=10)


def test_fixed_cost(benchmark):
    """One node above one leaf: the fixed cost of a backward (per round: 1,000 calls)."""
    _bench(benchmark, build("single", 1), rounds=20, iterations=1000)


def test_fixed_cost_public_api(benchmark):
    """The same one-node graph through ``pyengine.backward`` (argument handling included)."""
    graph = build("single", 1)
    graph.run_checked()
    benchmark.group = f"single [{IMPL}]"
    benchmark.extra_info.update(implementation=IMPL, nodes=1, graph="single via backward()")
    root_edge, grad, leaf = graph.root_edge, graph.grad, graph.leaf
    backward = pyengine.backward

    def many():
        for _ in range(1000):
            leaf.grad = None
            backward(root_edge, grad)

    benchmark.pedantic(many, rounds=20, iterations=1, warmup_rounds=1)
    graph.check()
