"""A fuzz of the public API, misuse included, on both cores (marker ``fuzz``).

Hypothesis generates batches of 20 programs as plain data
(``fuzz_programs.py``): random DAGs of ``pyengine.Node`` subclasses with
float64 gradients, and misuse mixed in: edges with odd ``input_nr``, into
wrong slots or not edges at all, ``next_edges`` set through the setter
(cycles included), private fields written (``_next_edges``,
``_input_metadata``, and the running graph task's ``captured_vars``,
``leaf_streams`` and exception), hooks of every kind and ``apply`` / ``release_variables``
that return odd values (indexed gradients too), raise or change the graph while it runs, queue
final callbacks, call backward reentrantly, ask the running graph task
``task_should_compute_output`` / ``task_buffered_gradient`` (from the
wrong node too), remove hook handles twice, or turn grad mode off, odd
arguments to ``backward`` / ``grad`` / ``Engine.execute`` (``create_graph``,
``backward(inputs=)``), calls under anomaly mode or the profiler, through an
``Engine`` with small or odd bounds, with ``retain_grad`` on a node's outputs, and owner graphs
(``execute_owner_graph``) whose collections are odd or change during the
walk. Each batch runs in two child processes (``fuzz_interpreter.py``), one
per core (``PYENGINE_PURE=0`` and ``1``), at once. The oracles:

- no child crashes or hangs (a negative status, a timeout, or a missing
  line): the program it stopped at is run again alone, and named;
- for every program, both cores raise the same exception type with the same
  message (object addresses aside: ``normalized``), or neither;
- where neither raises, both give the same gradients (and, for a
  well-formed program, the exact gradients of its linear maps), and log
  the same events: callbacks run, queries' answers, retained gradients, the
  profile's node names;
- after every program, a reference backward on a fresh graph gives its
  exact gradient, with global state restored and no thread left behind.

Budget: ``PYENGINE_FUZZ_EXAMPLES`` batches (default 20: 400 programs per
core, about a minute on two cores), derandomized so that CI is
reproducible; ``PYENGINE_FUZZ_SEED`` picks another fixed sequence, ``PYENGINE_FUZZ_SHRINK=1`` lets hypothesis
shrink a failing batch (slow: each step starts two interpreters).

Selection: the main runs (``pytest``, ``PYENGINE_PURE=1 pytest``) leave
the fuzz out, since each run of it tests both cores; it runs when selected
by marker: ``pytest -m fuzz tests/fuzz`` (``.ci/run``'s fuzz stage, ``tox -e
fuzz``). See ``conftest.py`` here.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings

HERE = os.path.dirname(os.path.abspath(__file__))
# The child processes run fuzz_interpreter.py as a script from this folder;
# the parent imports the programs from here too.
sys.path.insert(0, HERE)

import fuzz_interpreter  # noqa: E402
import fuzz_programs  # noqa: E402

pytestmark = pytest.mark.fuzz

INTERPRETER = os.path.join(HERE, "fuzz_interpreter.py")
CORES = ("compiled", "pure")
PROGRAM_TIMEOUT = 20.0
EXAMPLES = int(os.environ.get("PYENGINE_FUZZ_EXAMPLES", "20"))
SHRINK = os.environ.get("PYENGINE_FUZZ_SHRINK", "") not in ("", "0")


def _env(core):
    return fuzz_interpreter.child_env(core, PROGRAM_TIMEOUT)


def start(core, programs):
    # From this folder, not the repository root: there "-c"/a script would
    # import the source tree instead of the installed package.
    process = subprocess.Popen([sys.executable, INTERPRETER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=HERE, env=_env(core))
    return process


def finish(process, programs):
    """``(results by index, return code or None for a timeout, stderr)``."""
    timeout = 30.0 + PROGRAM_TIMEOUT * 2 + 2.0 * len(programs)
    try:
        out, err = process.communicate(json.dumps(programs), timeout=timeout)
        code = process.returncode
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        code = None
    results = {}
    for line in out.splitlines():
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if isinstance(result, dict) and "i" in result:
            results[result["i"]] = result
    return results, code, err


def run_batch(programs):
    """Both cores on ``programs`` at once: ``{core: (results by index, crashes)}``,
    a crash being ``(index, return code or None for a timeout, stderr)``.
    After a crash, a new child runs the rest of the batch (at most 5 times)."""
    processes = {core: start(core, programs) for core in CORES}
    outcome = {}
    for core, process in processes.items():
        results, code, stderr = finish(process, programs)
        crashes, offset = [], 0
        while True:
            missing = [i for i in range(offset, len(programs)) if i not in results]
            if not missing and code == 0:
                break
            index = missing[0] if missing else len(programs) - 1
            crashes.append((index, code, stderr))
            offset = index + 1
            if offset >= len(programs) or len(crashes) > 5:
                break
            rest, code, stderr = finish(start(core, programs[offset:]), programs[offset:])
            results.update({offset + i: result for i, result in rest.items()})
        outcome[core] = (results, crashes)
    return outcome


def close(a, b):
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or a.get("type") != b.get("type"):
            return False
        return close(a.get("value"), b.get("value"))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) and math.isnan(b):
            return True
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def normalized(message):
    """``message`` with what may differ between two processes made alike:
    only object addresses (``<... object at 0x7f...>``), which each process
    picks for itself."""
    if message is None:
        return None
    return re.sub(r" at 0x[0-9a-fA-F]+", " at 0x...", message)


def describe_crash(core, program, index, code, stderr):
    """Run ``program`` alone on ``core`` to name it as the one that crashed or hung."""
    process = start(core, [program])
    results, alone_code, alone_err = finish(process, [program])
    alone = ("crashes alone too" if 0 not in results else "does not crash when run alone")
    return (f"{core} core: the child {'timed out' if code is None else f'exited with {code}'} "
            f"at program {index} ({alone}, status {alone_code}):\n{json.dumps(program)}\n"
            f"stderr tail:\n{(alone_err or stderr)[-3000:]}")


def problems_of(programs, outcome):
    problems = []
    for core in CORES:
        for index, code, stderr in outcome[core][1]:
            problems.append(describe_crash(core, programs[index], index, code, stderr))
    for i, program in enumerate(programs):
        if any(i not in outcome[core][0] for core in CORES):
            continue
        compiled, pure = (outcome[core][0][i] for core in CORES)
        where = f"program {i}: {json.dumps(program)}\n"
        for core, result in (("compiled", compiled), ("pure", pure)):
            if result["check"] != "ok":
                problems.append(f"{where}after it, on the {core} core: {result['check']}")
        if compiled["exc"] != pure["exc"]:
            problems.append(f"{where}compiled raised {compiled['exc']} at {compiled['stage']} "
                            f"({compiled.get('message')}); pure raised {pure['exc']} at "
                            f"{pure['stage']} ({pure.get('message')})")
            continue
        if compiled["exc"] is not None:
            if normalized(compiled.get("message")) != normalized(pure.get("message")):
                problems.append(f"{where}both raised {compiled['exc']}, in other words: "
                                f"compiled {compiled.get('message')!r} at {compiled['stage']}; "
                                f"pure {pure.get('message')!r} at {pure['stage']}")
            continue
        for field in ("grads", "captured", "owner", "log"):
            if not close(compiled[field], pure[field]):
                problems.append(f"{where}{field}: compiled {compiled[field]} != pure {pure[field]}")
        if fuzz_programs.is_well_formed(program):
            expected = fuzz_programs.analytic(program)
            for field, value in expected.items():
                for core, result in (("compiled", compiled), ("pure", pure)):
                    if not close(result[field], value):
                        problems.append(f"{where}{field} on the {core} core: {result[field]}, "
                                        f"exactly {value}")
    return problems


_phases = (Phase.explicit, Phase.generate) + ((Phase.shrink,) if SHRINK else ())


@seed(int(os.environ.get("PYENGINE_FUZZ_SEED", "15")))
@settings(max_examples=EXAMPLES, derandomize="PYENGINE_FUZZ_SEED" not in os.environ,
          deadline=None, database=None, phases=_phases, print_blob=False, verbosity=Verbosity.quiet,
          suppress_health_check=list(HealthCheck))
@given(fuzz_programs.batches)
def test_both_cores_agree_and_survive(programs):
    problems = problems_of(programs, run_batch(programs))
    assert not problems, "\n\n".join(problems)


def test_the_oracles_can_fail():
    # A batch that the cores agree on but whose well-formed program is
    # declared to give another gradient must fail; so must a program that
    # makes a child exit.
    program = {"leaves": 1, "hooks": [], "mutations": [],
               "nodes": [{"n_in": 1, "meta": [True], "w": [[2.0]], "apply": "linear",
                          "release": None, "edges": [{"to": ["leaf", 0], "nr": ["int", 0]}]}],
               "call": {"api": "backward", "roots": [{"to": ["node", 0], "nr": ["int", 0]}],
                        "grads": [["ok", [1.0, 1.0]]], "retain": False, "repeat": 1}}
    outcome = run_batch([program])
    assert problems_of([program], outcome) == []
    assert outcome["compiled"][0][0]["grads"] == [[2.0, 2.0]]
    wrong = dict(program, nodes=[dict(program["nodes"][0], w=[[3.0]])])
    assert fuzz_programs.analytic(wrong)["grads"] == [[3.0, 3.0]]
    assert problems_of([wrong], outcome), "a wrong exact gradient went unnoticed"
    broken = dict(outcome, pure=({}, [(0, -11, "")]))
    assert any("exited with -11" in problem for problem in problems_of([program], broken))
    # The same exception type in other words must fail; the same words with
    # another object's address must not.
    raised = {"i": 0, "exc": "TypeError", "stage": "call0", "grads": [None], "captured": None,
              "owner": None, "check": "ok", "message": "<object object at 0x7f00aa> is odd"}
    for message, fails in (("<object object at 0x7f11bb> is odd", False),
                           ("<object object at 0x7f11bb> is wrong", True)):
        worded = {"compiled": ({0: raised}, []), "pure": ({0: dict(raised, message=message)}, [])}
        assert bool(problems_of([program], worded)) == fails, message
