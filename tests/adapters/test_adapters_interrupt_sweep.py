"""Ctrl-C at every place where CPython can raise it in pyengine's Python code
(``tests/interrupt_sweep.py``) while micrograd and DeZero run their backward
on pyengine: the state each adapter sets around a backward must come back
(See Note [What an adapter sets around a backward] in
pyengine/adapters/__init__.py).

Oracles, after each interrupted run: KeyboardInterrupt came out; the
engine's state as before (``interrupt_sweep.state_problems``); the
adapter uninstalled again (the scenario installs it in a with block);
DeZero's ``Config.enable_backprop`` on and the adapter's per-call mode
unset; and a clean run's gradients equal to the framework's own engine's
(micrograd) or to the analytic ones (DeZero, first and second order).
Left open, and allowed here: the start of ``installed()``'s uninstall (See
Note [Patches under an interrupt]).
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
    pytest.mark.stress,
    pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason=SWEEP_PYTHON),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="the sweep forks a child per place"),
]

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SWEEP = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, {tests!r})
    import interrupt_sweep

    def check():
        problems = interrupt_sweep.state_problems() + adapter_problems()
        try:
            got = scenario()
            if got != expected:
                problems.append(f"the clean run gave {{got!r}}, expected {{expected!r}}")
        except BaseException as error:
            problems.append(f"the clean run raised {{type(error).__name__}}: {{error}}"[:300])
        return problems + adapter_problems()

    places, failures = interrupt_sweep.sweep(scenario, check)
    print(json.dumps({{"places": places, "failures": failures}}))
''')


# Left open, as documented in Note [Patches under an interrupt]: an interrupt at
# the start of the uninstall that ``installed()`` runs as its block ends,
# before the uninstall changed anything, leaves the adapter installed.
UNINSTALL_NOT_BEGUN = re.compile(r"^adapters/__init__\.py:\d+ uninstall: ")
# And the twin's: its set_multithreading_enabled, which the DeZero adapter
# restores its switch with, is Python (See Note [A mode context under an
# interrupt] in pyengine/grad_mode.py).
TWIN_RESTORE = re.compile(r"^_pure/state\.py:\d+ set_multithreading_enabled: (entry|after a call)$")


def is_open(place, problems):
    place = place or ""
    if UNINSTALL_NOT_BEGUN.search(place):
        return set(problems) == {"the adapter left installed"}
    if pyengine.IMPLEMENTATION == "pure" and TWIN_RESTORE.search(place):
        return set(problems) == {"multithreading left off"}
    return False


def sweep(setup, minimum_places):
    lines = run_on_this_core(setup + SWEEP.format(tests=TESTS), timeout=900)
    report = json.loads(lines[-1])
    assert report["places"] >= minimum_places, report["places"]
    failures = [(place, problems) for place, problems in report["failures"]
                if not is_open(place, problems)]
    assert not failures, "\n".join(f"{place}: {problems}" for place, problems in failures[:20])


def test_micrograd_backward_interrupted_at_each_place():
    pytest.importorskip("micrograd")
    sweep(textwrap.dedent('''
        from micrograd.engine import Value
        from pyengine.adapters import micrograd as adapter

        def expression():
            a, b = Value(1.5), Value(-2.0)
            c = (a * b + b ** 2).relu() + a * a - b / a
            return a, b, c

        def scenario():
            a, b, c = expression()
            with adapter.installed():
                c.backward()
            # Rounded: the engines may sum a leaf's gradients in another order.
            return [round(a.grad, 12), round(b.grad, 12)]

        def adapter_problems():
            return ["the adapter left installed"] if adapter.is_installed() else []

        a, b, c = expression()
        c.backward()  # micrograd's own engine: the oracle
        expected = [round(a.grad, 12), round(b.grad, 12)]
    '''), minimum_places=30)


def test_dezero_backward_interrupted_at_each_place():
    pytest.importorskip("dezero")
    if pyengine.IMPLEMENTATION == "pure":
        # Minutes on the twin's Python engine, whose places the engine's
        # own sweeps (tests/test_interrupt_sweep.py) cover; the adapter's
        # code is the same on both cores.
        pytest.skip("DeZero's sweep runs on the compiled core")
    sweep(textwrap.dedent('''
        import math
        import numpy as np
        import dezero
        import dezero.functions as F
        from dezero import Variable
        from pyengine.adapters import dezero as adapter
        from pyengine.adapters.dezero import nodes

        def scenario():
            with adapter.installed():
                x = Variable(np.array([0.5, 1.0]))
                y = F.sum(F.exp(x * x))
                y.backward(create_graph=True)
                first = x.grad
                x.cleargrad()
                first.backward()
                return [round(float(v), 9) for v in first.data] + [
                    round(float(v), 9) for v in x.grad.data]

        def adapter_problems():
            problems = []
            if adapter.is_installed():
                problems.append("the adapter left installed")
            if not dezero.Config.enable_backprop:
                problems.append("DeZero's Config.enable_backprop left off")
            if nodes._dezero_backward.get() is not None:
                problems.append("the adapter's per-call mode left set")
            return problems

        # d/dx sum(exp(x^2)) = 2x exp(x^2); its derivative (2 + 4x^2) exp(x^2).
        expected = [round(2 * v * math.exp(v * v), 9) for v in (0.5, 1.0)] + [
            round((2 + 4 * v * v) * math.exp(v * v), 9) for v in (0.5, 1.0)]
    '''), minimum_places=150)
