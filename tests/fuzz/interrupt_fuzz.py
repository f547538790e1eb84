"""The interrupt fuzz's parent side: draws runs and runs them in child processes.

A *run* is a program of ``fuzz_programs.py`` (drawn by hypothesis from a
fixed seed), dressed with what widens the engine's waits (the extras below),
and one or two interrupts at random moments of its call. ``interrupt_interpreter.py``
runs a list of them on one core in a child process and checks each (see its
docstring); here a child that crashes (a negative status) or hangs (a
missing line: its per-program timeout, or the batch's) is a failure of the
run it stopped at, and a new child runs the rest.

The extras: a well-formed program gets sleeps of 0 to 4 ms in its nodes'
``apply``, and at random its nodes on fake devices (whose worker threads
behave like a GPU's), an ``Engine`` with small bounds (reentrant backward
handed to pool threads), the profiler or anomaly mode, and nodes whose
``apply`` runs a reentrant backward or queues a final callback (those runs
are then judged against their uninterrupted run, not the analytic
gradient). Misuse programs come as drawn, with sleeps.

``python interrupt_fuzz.py --core compiled --runs 2000 --seed 1`` runs the
fuzz widely from the command line and prints a summary and every failure,
with the run as JSON to replay (``--replay FILE``, runs saved by ``--save
FILE``). ``--second-interrupts`` draws second interrupts in the twin too,
``--cold-engines`` lets every program's Engine start its device workers
inside the interrupt window (by default, half of them do).

In the twin, a second interrupt while the first is handled is a window
that Note [Where the twin's main thread sees an interrupt]
(``pyengine/_pure/engine.py``) leaves uncovered: by default it is not drawn
there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fuzz_interpreter  # noqa: E402
import fuzz_programs  # noqa: E402

INTERPRETER = os.path.join(HERE, "interrupt_interpreter.py")
PROGRAM_TIMEOUT = 20.0
HOWS = ("pthread_kill", "interrupt_main")
SIDE_ACTIONS = ("reentrant", "reentrant_grad", "reentrant_same", "callback", "callback_backward")


def draw_programs(seed_value, count):
    """``count`` programs of the fuzz's generator, the same for the same seed."""
    drawn = []
    strategy = fuzz_programs.well_formed() | fuzz_programs.misuse()

    @seed(seed_value)
    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(program):
        drawn.append(program)

    collect()
    while len(drawn) < count:  # hypothesis may stop early on a small space
        drawn.extend(drawn[: count - len(drawn)])
    return drawn[:count]


def dress(program, rng):
    """Adds the extras (see the module docstring) to a drawn program."""
    program = json.loads(json.dumps(program))
    nodes = program["nodes"]
    program["sleep_ms"] = [rng.choice([0, 1, 2, 4]) for _ in nodes]
    well_formed = fuzz_programs.is_well_formed(program)
    if not well_formed:
        return program
    call = program["call"]
    if rng.random() < 0.5:
        program["devices"] = [rng.choice([-1, -1, 0, 1]) for _ in nodes]
    if rng.random() < 0.4:
        call["engine"] = rng.choice(fuzz_programs.ENGINE_BOUNDS[:4])
    if rng.random() < 0.3:
        call["mode"] = rng.choice(["profile", "anomaly"])
    # Not reentrant_same beside device nodes: the interpreter bounds its
    # nesting with one counter that device workers running at once both
    # change, so an uninterrupted run's result would vary.
    side_actions = SIDE_ACTIONS
    if any(device >= 0 for device in program.get("devices", ())):
        side_actions = tuple(action for action in SIDE_ACTIONS if action != "reentrant_same")
    if rng.random() < 0.5:
        for node in nodes:
            if rng.random() < 0.4:
                node["apply"] = rng.choice(side_actions)
    program["well_formed"] = fuzz_programs.is_well_formed(program)
    if program["well_formed"]:
        program["expected"] = fuzz_programs.analytic(program)
    return program


def draw_runs(seed_value, count, core, cold_engines=None, second_interrupts=None):
    """``count`` runs: dressed programs, each with its interrupts. With
    ``cold_engines``, a program's Engine starts its device workers inside
    the interrupt window (See Note [A device worker's claim] in
    pyengine/_shared/device_threads.py); by default, half of them do.
    ``second_interrupts`` (default: in the compiled core only) lets a
    quarter of the runs have a second interrupt."""
    if second_interrupts is None:
        second_interrupts = core == "compiled"
    rng = random.Random(seed_value)
    runs = []
    for index, program in enumerate(draw_programs(seed_value, count)):
        interrupts = [[rng.choice(HOWS), rng.uniform(0.0, 1.2)]]
        if second_interrupts and rng.random() < 0.25:
            interrupts.append([rng.choice(HOWS), rng.uniform(0.0, 0.2)])
        program = dress(program, rng)
        program["cold_engine"] = rng.random() < 0.5 if cold_engines is None else cold_engines
        runs.append({"program": program, "seed": seed_value * 100003 + index,
                     "interrupts": interrupts})
    return runs


def env_for(core, plant=None, program_timeout=PROGRAM_TIMEOUT, quiesce_s=None):
    env = fuzz_interpreter.child_env(core, program_timeout)
    env.pop("PYENGINE_INTERRUPT_FUZZ_PLANT", None)
    if plant:
        env["PYENGINE_INTERRUPT_FUZZ_PLANT"] = plant
    if quiesce_s is not None:
        env["PYENGINE_INTERRUPT_FUZZ_QUIESCE_S"] = str(quiesce_s)
    return env


def run_children(core, runs, plant=None, program_timeout=PROGRAM_TIMEOUT, quiesce_s=None):
    """Runs ``runs`` on ``core``: ``(results by index, failures)``; a failure
    is ``{"i", "why", "stderr"}`` for a crash or a hang, and for a result
    with problems, the result itself."""
    results, crashes = fuzz_interpreter.run_in_children(
        INTERPRETER, runs, env_for(core, plant, program_timeout, quiesce_s), program_timeout,
        payload=lambda batch: {"runs": batch})
    failures = [result for result in results.values() if result["problems"]]
    failures += [dict(crash, problems=[crash["why"]]) for crash in crashes]
    return results, sorted(failures, key=lambda failure: failure["i"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", choices=("compiled", "pure"), default="compiled")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=200, help="runs per child process")
    parser.add_argument("--cold-engines", action="store_true",
                        help="let every program's Engine start its device workers in the window")
    parser.add_argument("--second-interrupts", action="store_true",
                        help="second interrupts in the twin too (a window its Note leaves open)")
    parser.add_argument("--replay", help="a JSON file with a list of runs to run as they are")
    parser.add_argument("--save", help="write failing runs to this JSON file")
    args = parser.parse_args(argv)
    if args.replay:
        with open(args.replay) as handle:
            runs = json.load(handle)
    else:
        runs = []
        for chunk_seed in range(args.seed, args.seed + (args.runs + args.chunk - 1) // args.chunk):
            runs += draw_runs(chunk_seed, min(args.chunk, args.runs - len(runs)), args.core,
                              args.cold_engines or None, args.second_interrupts or None)
    started = time.monotonic()
    results, failures = {}, []
    for offset in range(0, len(runs), args.chunk):
        part = runs[offset: offset + args.chunk]
        got, failed = run_children(args.core, part)
        for failure in failed:
            failure["i"] += offset
            failure["run"] = runs[failure["i"]]
        failures += failed
        results.update({i + offset: r for i, r in got.items()})
    kinds = {}
    for result in results.values():
        kinds[result["outcome"]] = kinds.get(result["outcome"], 0) + 1
    print(f"{args.core}: {len(runs)} runs in {time.monotonic() - started:.0f} s, "
          f"outcomes {kinds}, {len(failures)} failures", flush=True)
    for failure in failures:
        print(json.dumps({k: failure[k] for k in failure if k != "run"})[:4000])
    if args.save and failures:
        with open(args.save, "w") as handle:
            json.dump([failure["run"] for failure in failures], handle)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
