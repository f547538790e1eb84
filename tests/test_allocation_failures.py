"""Each C++ allocation of a backward fails in turn: MemoryError, never a
crash, a hang, a held lock or a wrong gradient. See Note [C++ allocations
that fail] in ``pyengine/_engine.pyx``.

The compiled core's tables, queues and stacks are C++ containers, whose
allocations throw std::bad_alloc where memory runs out (under ``ulimit -v``
long before the machine's memory is gone). Such an exception ended the
process where it met a constructor run by CPython (a GraphTask's table, an
owner walk's), a container's ``operator[]``, or a method not declared
``except +``; in a ready queue's push it left the queue's mutex held and the
task lost, and the backward, or the next one, waited forever.

``tests/fail_new.cpp``, built here and preloaded into a child interpreter,
makes the n-th ``operator new`` call throw. ``allocation_failure_cases.py``
runs each scenario's backward once per n, each on a new thread and Engine
(``cold``: no table or queue kept from before) and then one after the
other (``warm``), with a good backward after each.

Oracles: each failing backward either gives the reference gradients (a
Python walk of the graph: every node passes on twice its gradient) or
raises MemoryError; the good backward after it gives the reference
gradients; the child exits within the timeout. Each scenario must see a
MemoryError at least once, so that the failures are known to reach the
engine.
"""

from __future__ import annotations

import ast
import faulthandler
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

import pyengine

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ["chain", "lattice", "lattice_grad", "fan", "devices", "reentrant", "pool",
             "owner_writes", "owner_returns", "made"]

compiled_only = [
    pytest.mark.skipif(pyengine.IMPLEMENTATION != "compiled",
                       reason="the twin makes no C++ allocation (the test below fails its "
                              "ready queue's growth instead)"),
    pytest.mark.skipif(any(runtime in os.environ.get("LD_PRELOAD", "")
                           for runtime in ("libasan", "libtsan")),
                       reason="a sanitizer's runtime replaces operator new, so no allocation "
                              "can be made to fail here"),
]


def compiler():
    for candidate in ((sysconfig.get_config_var("CXX") or "").split()[:1]
                      + ["c++", "g++", "clang++"]):
        if candidate and shutil.which(candidate):
            return candidate
    return None


@pytest.fixture(scope="module")
def fail_new(tmp_path_factory):
    cxx = compiler()
    if cxx is None:
        pytest.skip("no C++ compiler to build tests/fail_new.cpp")
    library = str(tmp_path_factory.mktemp("fail_new") / "libfail_new.so")
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-o", library,
                    os.path.join(HERE, "fail_new.cpp")], check=True)
    return library


def child_env(fail_new):
    """The checkout's root, and the environment of a child interpreter that
    runs allocation_failure_cases.py on this compiled core with
    tests/fail_new.cpp preloaded."""
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(pyengine.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))
    env.pop("PYENGINE_PURE", None)
    env["FAIL_NEW"] = fail_new
    env["LD_PRELOAD"] = " ".join(filter(None, [fail_new, os.environ.get("LD_PRELOAD")]))
    return repo_root, env


@pytest.mark.parametrize("scenario", SCENARIOS)
@compiled_only[0]
@compiled_only[1]
def test_each_cpp_allocation_of_a_backward_may_fail(fail_new, scenario):
    repo_root, env = child_env(fail_new)
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "allocation_failure_cases.py"),
                               scenario], env=env, capture_output=True, text=True, timeout=240,
                              cwd=repo_root)
    except subprocess.TimeoutExpired as error:
        begun = [line for line in (error.stdout or b"").decode().splitlines()
                 if line.startswith("BEGIN")]
        pytest.fail(f"no exit within 240 s (a hang) at {begun[-1:] or 'the start'}")
    lines = proc.stdout.splitlines()
    begun = [line for line in lines if line.startswith("BEGIN")]
    assert proc.returncode == 0, (f"the child ended with status {proc.returncode} at "
                                  f"{begun[-1:] or 'the start'}: {proc.stderr[-2000:]}")
    cases = [line for line in lines if line.startswith(("cold ", "warm "))]
    end = [line for line in lines if line.startswith("END")]
    assert len(end) == 1, proc.stdout[-2000:]
    counts = dict(item.split("=") for item in end[0].split()[1:])
    assert int(counts["cold"]) > 0 and int(counts["warm"]) > 0, end
    assert len(cases) == int(counts["cold"]) + int(counts["warm"])
    wrong = [line for line in cases
             if line.split(" ", 3)[3] not in ("exact | after exact", "MemoryError | after exact")]
    assert wrong == [], f"{len(wrong)} cases went wrong, the first: {wrong[:5]}"
    assert any("MemoryError" in line for line in cases), cases


# The flags case's oracle: the wake-up and the shutdown stand as flags, the
# node task is refused, uncounted; they pop shutdown first, then the
# wake-up, then the one node task (CompareNodeTaskTime's order). Each push
# tried an allocation, which failed.
FLAGS_EXPECTED = {"wake-up": ("queued", True), "shutdown": ("queued", True),
                  "node task": ("MemoryError", True), "len": 3, "outstanding": 1,
                  "popped": ["shutdown", "wake-up", [1.0]]}


@compiled_only[0]
@compiled_only[1]
def test_a_wake_up_or_shutdown_task_is_never_refused(fail_new):
    # Engine.stop's shutdown tasks and the wake-up of an owner must reach
    # their threads even where the heap cannot grow: a device thread served
    # on, and an owner slept for good, where they were refused.
    repo_root, env = child_env(fail_new)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "allocation_failure_cases.py"), "flags"],
                          env=env, capture_output=True, text=True, timeout=60, cwd=repo_root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [line for line in proc.stdout.splitlines() if line.startswith("FLAGS ")]
    assert len(line) == 1, proc.stdout
    assert ast.literal_eval(line[0][len("FLAGS "):]) == FLAGS_EXPECTED


class FailingHeapPush:
    """The twin's analogue of tests/fail_new.cpp: its ready queues' heap
    grows in ``heap_push`` (a list's append), which raises MemoryError at
    the n-th call after ``arm(n)``."""

    def __init__(self, monkeypatch):
        from pyengine._pure import ready_queue
        self.heap_push = ready_queue.heap_push
        self.calls = 0
        self.failing_call = 0
        self.armed = False
        monkeypatch.setattr(ready_queue, "heap_push", self.push)

    def push(self, heap, task):
        if self.armed:
            self.calls += 1
            if self.calls == self.failing_call:
                raise MemoryError
        self.heap_push(heap, task)

    def arm(self, failing_call):
        self.calls, self.failing_call, self.armed = 0, failing_call, True

    def disarm(self):
        self.armed = False
        return self.calls


@pytest.mark.skipif(pyengine.IMPLEMENTATION != "pure", reason="the twin's own paths")
def test_the_twin_never_refuses_a_wake_up_or_shutdown_task(monkeypatch):
    import allocation_failure_cases as cases

    monkeypatch.setattr(cases, "failures", FailingHeapPush(monkeypatch))
    assert cases.flags_case() == FLAGS_EXPECTED


@pytest.mark.skipif(pyengine.IMPLEMENTATION != "pure", reason="the twin's own paths")
# An owner graph's walk queues no task (See Note [Owner graphs]).
@pytest.mark.parametrize("scenario", [name for name in SCENARIOS if not name.startswith("owner")])
def test_the_twin_takes_the_same_paths_where_its_ready_queue_cannot_grow(monkeypatch, scenario):
    # Each push of a backward fails in turn, as a C++ heap that cannot grow
    # does: the held task stays held, push_pop runs its task, a flag
    # stands for a wake-up, and a push that fails fails its node's graph task.
    import allocation_failure_cases as cases

    monkeypatch.setattr(cases, "failures", FailingHeapPush(monkeypatch))
    # A hang (an owner no wake-up reached) ends the run with tracebacks.
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        pushes = cases.on_new_thread(scenario, 0)[0]
        outcomes = [cases.on_new_thread(scenario, n)[1:] for n in range(1, pushes + 1)]
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert pushes > 0
    wrong = [(n + 1, outcome) for n, outcome in enumerate(outcomes)
             if outcome not in (("exact", "exact"), ("MemoryError", "exact"))]
    assert wrong == [], f"{len(wrong)} of {pushes} went wrong, the first: {wrong[:5]}"
