"""Each Python allocation of a backward fails in turn: MemoryError, never a
crash, a hang, a swallowed error or a wrong gradient. See Note [Python allocations
that fail] in ``pyengine/_engine.pyx``.

``tests/fail_pymem.c``, built here and loaded with ctypes into a child
interpreter, wraps the PYMEM_DOMAIN_MEM and PYMEM_DOMAIN_OBJ allocators and
makes the n-th malloc, calloc or realloc return NULL, as where the address
space runs out (``ulimit -v``). ``allocation_failure_cases.py`` runs each
scenario's backward once per n, as tests/test_allocation_failures.py does
with C++ allocations: ``cold`` (a new thread and Engine each, the
allocations of the caller's thread failing) and ``warm`` (one after the
other; in the scenarios whose nodes run on device or pool threads, the
allocations of every thread failing). Python allocations are many: in
``fan`` (a ready queue of 300 tasks, some 2,500 allocations a backward)
each of the first FAN_EACH fails, then every FAN_STRIDE-th. In ``made``
the graph's nodes and metadata are made while allocations fail, too; in
``devices_raise`` a node on a device raises, which the engine's stream
guard must pass on even where its traceback cannot be made.

Oracles: each failing backward either gives the reference gradients or
raises MemoryError; the good backward after it gives the reference
gradients; the child exits 0 within the timeout; and no function of the
compiled core had an error that it could only print ("Exception ignored
in: 'pyengine...'"). Two other errors stand for a MemoryError, raised
where it is known: RuntimeError from MemoryError where a pool thread
could not start (start_pool_thread words every failed start so), and
CPython's SystemError "Couldn't get thread-state dictionary", which
threading.local raises where the dictionary of a new thread cannot be
allocated (get_worker_state's first look on a thread). Errors that
CPython's own threading prints where a new thread's bootstrap fails
(``_bootstrap``'s KeyError) are CPython's and pass.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

import pyengine

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ["chain", "lattice", "lattice_grad", "fan", "devices", "devices_raise", "reentrant",
             "pool", "owner_writes", "owner_returns", "made"]
FAN_EACH, FAN_STRIDE = 400, 7
TIMEOUT_S = 120

ACCEPTED = {
    "exact | after exact",
    "MemoryError | after exact",
    "MemoryError via RuntimeError | after exact",
    "SystemError: Couldn't get thread-state dictionary | after exact",
}
# Where a node raises (devices_raise), CPython's own raise may lose the error
# it raises where one of its allocations fails, and the caller gets
# "error return without exception set": a Python method that calls a
# function that raises does so without pyengine (3.11.7, the 5th allocation
# of the raise failing).
ACCEPTED_WHERE_A_NODE_RAISES = ACCEPTED | {
    "SystemError: error return without exception set | after exact"}
# CPython 3.9's and 3.10's own: at a code object's 1024th run their eval
# loop builds the object's opcache (_PyCode_InitOpcache,
# Objects/codeobject.c), whose PyMem_Calloc failing returns -1 with no error
# set, and the frame is left with NULL and no exception before its first
# instruction (3.11 has no such cache). Seen in `pool` (CI's wheel stages:
# 3.10 at warm 60 of 79, 3.9 at warm 61 of 80; here on 3.10 at warm 56 and
# 57, half the runs), and traced with gdb on 3.10: the SystemError made for
# the frame of the test's own Twice.apply on a pool thread, its f_lasti -1
# and its code's co_opcache_flag 1024. Any scenario may meet it; 3.9 words
# it "error", 3.10 "exception". A pyengine function that swallowed an
# error would print "Exception ignored in 'pyengine...'", which the test
# refuses below.
if sys.version_info[:2] in ((3, 9), (3, 10)):
    ACCEPTED = ACCEPTED | {
        "SystemError: _PyEval_EvalFrameDefault returned NULL without setting an "
        f"{'error' if sys.version_info[:2] == (3, 9) else 'exception'} | after exact"}
    ACCEPTED_WHERE_A_NODE_RAISES = ACCEPTED_WHERE_A_NODE_RAISES | ACCEPTED

pytestmark = [
    pytest.mark.skipif(pyengine.IMPLEMENTATION != "compiled",
                       reason="the compiled core's C paths: the twin is Python code "
                              "throughout, whose allocations fail in CPython's own threading "
                              "and with statements as often as in the engine"),
    pytest.mark.skipif(any(runtime in os.environ.get("LD_PRELOAD", "")
                           for runtime in ("libasan", "libtsan")),
                       reason="under a sanitizer's runtime the allocations it intercepts "
                              "are not the ones counted here, and a failing one is "
                              "reported, not returned"),
    # Found in CI's wheel stages: on 3.12.1 (devices, cold 44; pool, warm
    # 67; made, cold 227) and 3.13.0 (devices, cold 43; made, cold 225) the
    # child crashes. On 3.13.0, traced: gdb puts the segfault in
    # PyFunction_NewWithQualName under the eval loop's MAKE_FUNCTION, and
    # valgrind the first bad read on a code object of the test's own script
    # that the eval loop's error path freed; no pyengine frame at either
    # fault. On 3.12.1 (devices, cold 44), gdb shows the same: the segfault
    # in PyFunction_NewWithQualName under MAKE_FUNCTION, in a node's apply,
    # with a garbage qualname read from the code object. 3.9, 3.10 and 3.11
    # pass every case.
    pytest.mark.skipif(sys.version_info[:2] in ((3, 12), (3, 13)),
                       reason="CPython 3.12 and 3.13 crash themselves where a function "
                              "object cannot be allocated (MAKE_FUNCTION's error path frees "
                              "its code object; seen on 3.12.1 and 3.13.0)"),
]


def c_compiler():
    for candidate in ((sysconfig.get_config_var("CC") or "").split()[:1]
                      + ["cc", "gcc", "clang"]):
        if candidate and shutil.which(candidate):
            return candidate
    return None


@pytest.fixture(scope="module")
def fail_pymem(tmp_path_factory):
    cc = c_compiler()
    include = sysconfig.get_paths()["include"]
    if cc is None or not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip("no C compiler or no Python.h to build tests/fail_pymem.c")
    library = str(tmp_path_factory.mktemp("fail_pymem") / "libfail_pymem.so")
    # Python's symbols resolve in the interpreter that loads it.
    flags = ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-std=c11", "-I", include, *flags,
                    "-o", library, os.path.join(HERE, "fail_pymem.c")], check=True)
    return library


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_python_allocation_of_a_backward_may_fail(fail_pymem, scenario):
    from allocation_failure_cases import steps

    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(pyengine.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))
    env.pop("PYENGINE_PURE", None)
    env.pop("FAIL_NEW", None)
    env["FAIL_PYMEM"] = fail_pymem
    if scenario == "fan":
        env["FAIL_PYMEM_EACH"], env["FAIL_PYMEM_STRIDE"] = str(FAN_EACH), str(FAN_STRIDE)
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "allocation_failure_cases.py"),
                               scenario], env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S, cwd=repo_root)
    except subprocess.TimeoutExpired as error:
        begun = [line for line in (error.stdout or b"").decode().splitlines()
                 if line.startswith("BEGIN")]
        pytest.fail(f"no exit within {TIMEOUT_S} s (a hang) at {begun[-1:] or 'the start'}")
    lines = proc.stdout.splitlines()
    begun = [line for line in lines if line.startswith("BEGIN")]
    assert proc.returncode == 0, (f"the child ended with status {proc.returncode} at "
                                  f"{begun[-1:] or 'the start'}: {proc.stderr[-2000:]}")
    end = [line for line in lines if line.startswith("END")]
    assert len(end) == 1, proc.stdout[-2000:]
    counts = {key: int(value) for key, value in (item.split("=") for item in end[0].split()[1:])}
    assert counts["cold"] > 0 and counts["warm"] > 0, end
    stepping = (FAN_EACH, FAN_STRIDE) if scenario == "fan" else ()
    expected_cases = len(steps(counts["cold"], *stepping)) + len(steps(counts["warm"], *stepping))
    cases = [line for line in lines if line.startswith(("cold ", "warm "))]
    # A case's line that does not start a line (another thread's output
    # before it), or a line of no kind.
    odd = [line for line in lines
           if re.search(r".(cold|warm) \d+ calls=", line)
           or not line.startswith(("cold ", "warm ", "BEGIN ", "END ", "UNRAISABLE "))]
    assert len(cases) == expected_cases, f"{len(cases)} case lines; odd lines: {odd[:5]}"
    accepted = ACCEPTED_WHERE_A_NODE_RAISES if scenario == "devices_raise" else ACCEPTED
    wrong = [line for line in cases if line.split(" ", 3)[3] not in accepted]
    assert wrong == [], f"{len(wrong)} cases went wrong, the first: {wrong[:5]}"
    assert any("MemoryError" in line for line in cases), cases
    # An error the compiled core swallowed: the case is the BEGIN line before.
    swallowed = []
    case = "the start"
    for line in lines:
        if line.startswith("BEGIN"):
            case = line
        elif line.startswith("UNRAISABLE") and "'pyengine." in line:
            swallowed.append(f"{case}: {line}")
    assert swallowed == [], swallowed[:5]
    assert not re.search(r"Exception ignored in: '?<?pyengine\.", proc.stderr), proc.stderr[-2000:]
