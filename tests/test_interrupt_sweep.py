"""Ctrl-C at every place where CPython can raise it in pyengine's Python code,
one place per run, across backward, grad, hooks, profiling, reentrant
backward, device threads, the mode contexts and the frontend: See
``tests/interrupt_sweep.py`` for the places and how each is reached.

Oracles, after each interrupted run: the call raised KeyboardInterrupt (not
another error, and not nothing); grad mode, anomaly mode, the checkpoint
flag and the multithreading switch are as before; no graph task is left
current; no leaf's ``.grad`` lock is held; and a clean run right after
gives the analytic result (the frontend's training step: an uninterrupted
run's). Every scenario runs in a fresh interpreter on the core under test,
which forks once per place.

Allowed, and documented where they are (each an entry in ``OPEN``): a
context that sets its mode in the call that makes it (torch's semantics)
leaves it set where the interrupt comes out before the with statement
enters it; and the twin's ``RestoreOnExit.__exit__``, a Python frame, can
be interrupted before it restores (See Note [A mode context under an interrupt]
in pyengine/grad_mode.py).
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import pytest
from conftest import run_on_this_core
from interrupt_sweep import SWEEP_PYTHON

import pyengine

pytestmark = [
    # A few minutes on each core: a child per place.
    pytest.mark.stress,
    pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason=SWEEP_PYTHON),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="the sweep forks a child per place"),
]

TESTS = os.path.dirname(os.path.abspath(__file__))

# Where an interrupt may leave a mode changed, as documented (a regular
# expression over "file:line function: kind", and why).
SETS_AT_ONCE = "a context that sets its mode in the call that makes it"
OPEN_IN_BOTH = [
    (r"^grad_mode\.py:\d+ __enter__: entry$", SETS_AT_ONCE + " (set_grad_enabled)"),
    (r"^engine\.py:\d+ __enter__: entry$", SETS_AT_ONCE + " (set_multithreading_enabled)"),
    (r"^anomaly_mode\.py:\d+ __enter__: entry$", SETS_AT_ONCE + " (set_detect_anomaly)"),
]
OPEN_IN_THE_TWIN = [
    (r"^_pure/state\.py:\d+ __exit__: entry$", "the twin's RestoreOnExit.__exit__ is Python"),
    (r"^_pure/state\.py:\d+ set_(grad|anomaly|multithreading)_enabled: (entry|after a call)$",
     "the twin's restore, called by its Python RestoreOnExit.__exit__"),
]
MODE_PROBLEMS = {"grad mode left off", "anomaly mode left on", "multithreading left off"}

# The scenarios, and the least number of places each must reach in the
# compiled core (the twin reaches more: its engine is Python): a sweep that
# reaches none tests nothing.
SCENARIOS = {
    "backward with hooks": 100,
    "grad of inputs": 80,
    "profiled": 150,
    "reentrant": 40,
    "devices": 150,
    "modes": 80,
    "frontend training step": 1000,
    "frontend checkpoint and second order": 800,
}


def is_open(place, problems):
    """Whether ``problems`` at ``place`` are a window documented as open."""
    windows = OPEN_IN_BOTH + (OPEN_IN_THE_TWIN if pyengine.IMPLEMENTATION == "pure" else [])
    return (set(problems) <= MODE_PROBLEMS
            and any(re.search(pattern, place or "") for pattern, _ in windows))


# The frontend's Python code is the same on both cores, and the twin's
# engine under it multiplies the places (minutes): the frontend is swept on
# the compiled core, the twin's engine by the scenarios above it.
FRONTEND = {"frontend training step", "frontend checkpoint and second order"}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_an_interrupt_at_each_place_leaves_nothing_behind(name):
    if name in FRONTEND and pyengine.IMPLEMENTATION == "pure":
        pytest.skip("the frontend is swept on the compiled core")
    lines = run_on_this_core(textwrap.dedent(f'''
        import json, sys
        sys.path.insert(0, {TESTS!r})
        import interrupt_sweep_scenarios
        print(json.dumps(interrupt_sweep_scenarios.run({name!r})))
    '''), timeout=600)
    report = json.loads(lines[-1])
    assert report["places"] >= SCENARIOS[name], report["places"]
    failures = [(place, problems) for place, problems in report["failures"]
                if not is_open(place, problems)]
    assert not failures, "\n".join(f"{place}: {problems}" for place, problems in failures[:20])


def test_the_sweep_finds_the_windows_of_a_mode_context_written_as_torchs():
    """The oracle itself: the sweep reports the two places where a Python
    mode context without ``RestoreOnExit`` (``tests/torch_like_modes.py``)
    leaves grad mode off: as its ``__enter__``'s set returns, and at its
    ``__exit__``'s entry; in the twin also in its Python
    ``set_grad_enabled`` called from that ``__exit__``."""
    lines = run_on_this_core(textwrap.dedent(f'''
        import json, sys
        sys.path.insert(0, {TESTS!r})
        import interrupt_sweep, torch_like_modes

        interrupt_sweep.ALSO_SWEPT.add(torch_like_modes.__file__)

        def scenario():
            with torch_like_modes.TorchLikeNoGrad():
                pass

        places, failures = interrupt_sweep.sweep(scenario, interrupt_sweep.state_problems)
        print(json.dumps({{"places": places, "failures": failures}}))
    '''), timeout=120)
    report = json.loads(lines[-1])
    failures = {re.sub(r":\d+ ", " ", place): problems for place, problems in report["failures"]}
    # The compiled set_grad_enabled is a Cython function, which makes no
    # return event: its call's place is the instruction after it.
    after_the_set = ("return of set_grad_enabled" if pyengine.IMPLEMENTATION == "pure"
                     else "after a call")
    expected = {
        f"torch_like_modes.py __enter__: {after_the_set}": ["grad mode left off"],
        "torch_like_modes.py __exit__: entry": ["grad mode left off"],
    }
    if pyengine.IMPLEMENTATION == "pure":
        # Its set_grad_enabled is Python: an entry, and a call (bool) before the set.
        expected["_pure/state.py set_grad_enabled: entry"] = ["grad mode left off"]
        expected["_pure/state.py set_grad_enabled: after a call"] = ["grad mode left off"]
    assert failures == expected, failures
