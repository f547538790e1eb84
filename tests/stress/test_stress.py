"""The stress runner, within a bounded budget (marker ``stress``).

``python -m pyengine stress --minutes N`` runs the same for longer. The
oracle of every scenario is in :mod:`pyengine.stress`: exact gradients of
power-of-two scalings, thread counts, weak references, and a watchdog.
"""

from __future__ import annotations

import pytest

from pyengine import stress

pytestmark = pytest.mark.stress


def test_stress_batches_lose_nothing():
    report = stress.run(duration_s=15, seed=2026, watchdog_s=60)
    assert report.batches >= 3, report.summary()
    assert report.deadlocks == report.leaked_threads == report.leaked_graphs == 0
    assert report.faults_injected > 0 and report.per_scenario["devices"] > 0


def test_a_wrong_gradient_fails_the_run(monkeypatch):
    # The runner's checks can fail: a scaling that lies about its factor.
    original = stress.Scale.apply

    def off_by_one(self, grads):
        return [grad + 1.0 for grad in original(self, grads)]

    monkeypatch.setattr(stress.Scale, "apply", off_by_one)
    with pytest.raises(stress.StressFailure):
        stress.run(batches=1, seed=1)


def test_a_leaked_graph_fails_the_run(monkeypatch):
    kept = []
    original = stress.scenario_callbacks

    def keeps_its_graph(rng, report, graphs):
        calls = original(rng, report, graphs)
        kept.append(graphs[-1])
        return calls

    monkeypatch.setitem(stress._SCENARIO_FUNCTIONS, "callbacks", keeps_its_graph)
    with pytest.raises(stress.StressFailure, match="outlived"):
        stress.run(batches=1, seed=1)


def test_a_hang_is_reported_by_the_watchdog():
    import threading

    never = threading.Event()
    report = stress.StressReport()
    watchdog = stress.Watchdog(0.5, report)
    with pytest.raises(stress.StressFailure, match="did not finish"):
        watchdog.call(never.wait)
    never.set()
    assert report.deadlocks == 1
