"""Ctrl-C at random moments of fuzz programs, on both cores (marker ``fuzz``).

``interrupt_fuzz.py`` draws runs: programs of the fuzz's generator
(``fuzz_programs.py``: well-formed DAGs, and misuse), dressed with sleeps of
a few ms in ``apply``, fake-device nodes (worker threads that behave like a
GPU's), Engines with small bounds (reentrant backward on pool threads),
reentrant backward and final callbacks in ``apply``, hooks, the profiler and
anomaly mode; each run's call gets SIGINT at a random moment
(``signal.pthread_kill`` or ``_thread.interrupt_main``), and in the compiled
core sometimes a second one within a fifth of the call. A child process per
core (``interrupt_interpreter.py``) runs them and checks, per run: no crash,
no hang; the call gives its uninterrupted result (an error's type and
message; where none, the leaves' ``.grad`` and what grad/execute return) or
raises KeyboardInterrupt (or an error chained from one); every engine
thread leaves the program's code; for a well-formed program, each leaf's
``.grad`` after an interrupt is None or what the uninterrupted calls write
(AccumulateGrad writes a leaf's whole sum at once: never a part of it; with
two calls, the first one's too); in the twin, the pool's threads are idle
again; a pool engine still runs chains of reentrant backwards as a fresh
one does; the program's nodes die once dropped; the program run again
uninterrupted gives the same result; reference backwards on the CPU and on
each fake device are exact, with grad and anomaly mode restored and no
thread left.

Kept out of the runs, so that the fuzz is not flaky: in the twin, a second
interrupt (Note [Where the twin's main thread sees an interrupt] in
``pyengine/_pure/engine.py`` leaves it uncovered).

Half the programs' Engines start their device workers inside the interrupt
window ("cold" engines). That is where the fuzz found its one bug, in both
cores: Ctrl-C as a backward started a device's worker left the device a
queue without a worker, and ``Engine.stop`` raised for the graph task the
interrupted backward left (See Note [A device worker's claim] in
``pyengine/_shared/device_threads.py``; ``tests/test_device_worker_start.py``
interrupts each place in turn).

Each oracle can fail: ``test_a_planted_fault_fails_the_fuzz`` plants a fault
in the child (``PYENGINE_INTERRUPT_FUZZ_PLANT``: a KeyboardInterrupt
swallowed by backward/grad/execute, a hang, a crash, a thread left blocked in
a node, corrupted ``.grad``, the graph kept alive, grad mode left off, a
thread left running, the device workers stopped, a rerun that differs, in
the twin a pool slot never given back) and checks that the fuzz reports it.

Budget: ``PYENGINE_INTERRUPT_FUZZ_RUNS`` runs per core (default 100; the
two cores at once), seeded by ``PYENGINE_INTERRUPT_FUZZ_SEED`` (default 1):
29 s for the file on this two-core machine at load average 0.7, 37 s at
1.8 (other work running). ``python interrupt_fuzz.py
--runs 5000`` runs it widely.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import interrupt_fuzz  # noqa: E402
from interrupt_interpreter import PLANTS  # noqa: E402

pytestmark = [pytest.mark.fuzz,
              pytest.mark.skipif(not hasattr(__import__("signal"), "pthread_kill"),
                                 reason="needs pthread_kill")]

CORES = ("compiled", "pure")
RUNS = int(os.environ.get("PYENGINE_INTERRUPT_FUZZ_RUNS", "100"))
SEED = int(os.environ.get("PYENGINE_INTERRUPT_FUZZ_SEED", "1"))


def report(core, failures):
    lines = [f"{len(failures)} failing run(s) on the {core} core; replay one with "
             f"python tests/fuzz/interrupt_fuzz.py --core {core} --replay FILE "
             f"(FILE: a JSON list of the runs below)"]
    for failure in failures[:5]:
        lines.append(json.dumps({"problems": failure["problems"],
                                 "stderr": failure.get("stderr", "")[-3000:]}))
        lines.append("run: " + json.dumps(failure["run"]))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def fuzz_outcomes():
    """Both cores' runs, at once: ``{core: (runs, results, failures)}``."""
    runs = {core: interrupt_fuzz.draw_runs(SEED, RUNS, core) for core in CORES}
    with ThreadPoolExecutor(len(CORES)) as pool:
        futures = {core: pool.submit(interrupt_fuzz.run_children, core, runs[core])
                   for core in CORES}
        outcomes = {}
        for core in CORES:
            results, failures = futures[core].result()
            for failure in failures:
                failure["run"] = runs[core][failure["i"]]
            outcomes[core] = (runs[core], results, failures)
    return outcomes


@pytest.mark.parametrize("core", CORES)
def test_random_interrupts(fuzz_outcomes, core):
    runs, results, failures = fuzz_outcomes[core]
    assert not failures, report(core, failures)
    kinds = {}
    for result in results.values():
        kinds[result["outcome"]] = kinds.get(result["outcome"], 0) + 1
    print(f"{core}: {len(runs)} runs, outcomes {kinds}", file=sys.stderr)
    # The fuzz interrupts: a run whose call ends before its SIGINT tests less.
    assert kinds.get("interrupted", 0) >= len(runs) // 4, kinds


def gives_a_gradient(program):
    """Whether the well-formed ``program``'s exact result has a number other
    than zero: a run whose roots' gradients change then changes it."""
    def numbers(value):
        if isinstance(value, list):
            for item in value:
                yield from numbers(item)
        elif isinstance(value, (int, float)):
            yield value

    expected = program.get("expected") or {}
    return any(number != 0 for key in ("grads", "captured") for number in numbers(expected.get(key)))


def plant_runs(gradient=False):
    """A few well-formed runs with fake-device nodes, interrupted a third
    into their call: the interrupt lands in the call. With ``gradient``,
    only runs that give a gradient other than zero (``gives_a_gradient``):
    which runs hypothesis draws differs between its versions, and a plant
    that changes only gradients must be seen whichever they are."""
    runs = [run for run in interrupt_fuzz.draw_runs(7, 60, "compiled", cold_engines=False)
            if run["program"].get("well_formed") and run["program"].get("devices")
            and (not gradient or gives_a_gradient(run["program"]))]
    assert runs, "no run to plant the fault in"
    for run in runs:
        run["interrupts"] = [["pthread_kill", 0.3]]
    return runs


# What the fuzz must report for each planted fault (a part of the problem's words).
PLANT_REPORTS = {
    "swallow": "interrupted call (returned",
    "hang": "a hang",
    "crash": "a crash",
    "stuck": "engine thread stuck after the call",
    "corrupt_grad": "after the interrupt; allowed",
    "keep_alive": "still alive once dropped",
    "grad_mode": "grad mode left off",
    "thread_left": "thread(s) left running",
    "stop_devices": "device 0 reference raised",
    "again": "run again uninterrupted gave",
    "pool_count": "pool not idle after the call",
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_fault_fails_the_fuzz(plant):
    # One run where the fault stays (a blocked thread, a hang) and every
    # later run would wait for it; four otherwise (an interrupt may come
    # after a short call ends).
    # "again" doubles the roots' gradients in the rerun.
    runs = plant_runs(gradient=plant == "again")[: 1 if plant in ("stuck", "hang") else 4]
    core = "compiled"
    if plant == "pool_count":
        # The pool's counts are Python only in the twin; an Engine of its own.
        core = "pure"
        for run in runs:
            run["program"]["call"]["engine"] = [0, 1, 1]
    # Waits for threads and objects that a planted fault never lets go cut
    # short (0.5 s); a hang ends at 2 s.
    timeout = 2.0 if plant == "hang" else 8.0
    _, failures = interrupt_fuzz.run_children(core, runs, plant=plant, program_timeout=timeout,
                                              quiesce_s=0.5)
    problems = [problem for failure in failures for problem in failure["problems"]]
    assert any(PLANT_REPORTS[plant] in problem for problem in problems), (plant, problems)
