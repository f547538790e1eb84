"""Ctrl-C at every place where CPython can raise it in pyengine's Python code
during a call, one place per run: the interrupt sweep.

From Python 3.10 on, the main thread runs signal handlers (and so raises
what Python's SIGINT handler raises, KeyboardInterrupt) at three kinds of
places in Python code: a Python function's entry, the end of a call
instruction (once the callee returned), and a loop's back edge (and in a
blocking lock acquire or wait, which the engine's own tests cover). A
random SIGINT (``RandomInterrupts`` in ``conftest.py``) hits a few of these
per run; this sweep hits each in turn.

``sweep(scenario, check)`` runs ``scenario()`` once per place, each time in
a forked child of a process that runs no scenario itself (so that whatever
an interrupt leaves behind, a held lock or a changed mode, cannot spill
into the next run, and a hang ends the child, not the sweep). In run ``k``
a profile function and a trace function count the places as the scenario
reaches them, and raise KeyboardInterrupt at the ``k``-th, as the signal
handler would there:

- ``call`` of a frame of pyengine's code, or of any Python frame that
  pyengine's code called (``threading``'s, a weak reference callback's):
  the function's entry;
- ``return`` of a Python callee, or ``c_return`` of a C one, that a call
  instruction of pyengine's code called: raised there, the error comes
  out of that call instruction, as the signal check at the call's end
  makes it. A call made by another instruction (``with``'s ``__enter__``,
  a property's getter) has no check after it, nor has a callback that C
  code made while the call ran (a weak reference callback, a ``__del__``),
  so their returns are no place (their entries are);
- an ``opcode`` event at a backward jump in pyengine's code.

A generator's resumption is not its entry (a close or a throw resumes it
with no check; a ``next()`` call's end is a place of its own), nor is its
``yield`` a return.

After the interrupt, ``check()`` (in the child) returns what is wrong: the
state that must be back, and a clean run's exact result. A run that
reached its place but ended without KeyboardInterrupt is reported too: the
interrupt was swallowed. The sweep ends at the first run that reaches no
place, having tried every one.

A call whose callee makes no return event (a Cython function, a C type's
call) has its place at the instruction after it, where an error is handled
as one the call raised (the same exception table entry); where it is not
(``return f()`` in a ``try``), the place is not tried. A return place of
a Python callee that C code called back while the call ran is tried too
where C gives no way to tell it from a direct one (the engine calling a
node's ``apply``): a place that CPython would not check, which can only
find more.

The places are CPython 3.11's: where its eval loop checks for signals,
in its bytecode, read through its exception table (3.12 moved calls'
inline caches and the events that ``sys.settrace`` gives; before 3.10
CPython checked between almost any two bytecodes, bpo-29988). So the
sweeps run on 3.11 only, the Python of ``.ci/run``'s stress runs. They
run on the main thread only, where signal handlers run.
"""

from __future__ import annotations

import dis
import faulthandler
import json
import os
import sys

from thread_state import thread_state_problems as state_problems  # noqa: F401 (the sweeps' check)

import pyengine

SWEEP_PYTHON = "the sweep's places are CPython 3.11's (See tests/interrupt_sweep.py)"

PACKAGE = os.path.dirname(os.path.abspath(pyengine.__file__)) + os.sep
# The benchmark graphs' own code is not the engine's.
NOT_SWEPT = (PACKAGE + "bench" + os.sep,)

_CALLS = {dis.opmap[name] for name in ("CALL", "CALL_FUNCTION_EX", "CALL_FUNCTION",
                                       "CALL_METHOD", "CALL_FUNCTION_KW") if name in dis.opmap}
_BACKWARD_JUMPS = {dis.opmap[name] for name in ("JUMP_BACKWARD", "JUMP_ABSOLUTE")
                   if name in dis.opmap}
_GENERATORS = 0x20 | 0x80 | 0x100 | 0x200  # CO_GENERATOR, CO_COROUTINE, the two async ones


# Files swept besides pyengine's (the sweep's own oracle adds one).
ALSO_SWEPT: set = set()


def swept(frame) -> bool:
    """Whether ``frame`` runs pyengine's own code (or a file in ALSO_SWEPT)."""
    if frame is None:
        return False
    filename = frame.f_code.co_filename
    return ((filename.startswith(PACKAGE) and not filename.startswith(NOT_SWEPT))
            or filename in ALSO_SWEPT)


def at_a_call(frame) -> bool:
    """Whether ``frame``'s current instruction is a call instruction (while
    a Python callee runs, ``f_lasti`` is the call's last inline cache entry)."""
    return frame.f_lasti in _call_ranges(frame.f_code)


_after_calls: dict = {}


def after_calls(code) -> dict:
    """For each call instruction of ``code``: the offset of the instruction
    after it, and whether an error raised there is handled as one raised
    by the call (the same exception table entry, or none for both)."""
    found = _after_calls.get(code)
    if found is None:
        bytecode = dis.Bytecode(code)
        entries = getattr(bytecode, "exception_entries", [])

        def handler(offset):
            for entry in entries:
                if entry.start <= offset < entry.end:
                    return entry.target, entry.depth, entry.lasti
            return None

        instructions = list(bytecode)
        found = {}
        for instruction, following in zip(instructions, instructions[1:]):
            if instruction.opcode in _CALLS:
                found[instruction.offset] = (following.offset,
                                             handler(instruction.offset) == handler(following.offset))
        _after_calls[code] = found
    return found


_call_range_cache: dict = {}


def _call_ranges(code) -> set:
    """Every offset within a call instruction of ``code``, its inline cache
    entries included."""
    found = _call_range_cache.get(code)
    if found is None:
        found = set()
        for offset, (following, _) in after_calls(code).items():
            found.update(range(offset, following))
        _call_range_cache[code] = found
    return found


class Injector:
    """Counts the places a run reaches and raises KeyboardInterrupt at the
    ``target``-th (``target`` 0: never, to count them)."""

    def __init__(self, target: int):
        self.target = target
        self.count = 0
        self.fired = None  # where it raised: "file:line function: kind"
        self._started = set()  # generator frames seen once
        # Frames (by id) called by a call instruction of pyengine's code, as
        # opposed to called back from C while that call ran (a weak
        # reference callback, a __del__) or as it tore its callee's frame
        # down; and the frames of pyengine's code in a C call, or whose
        # callee has returned while the call instruction is not done.
        self._direct = set()
        self._in_c_call = set()
        self._callee_returned = set()
        # Frames (by id) at a call instruction whose end no return event
        # marked (a Cython function, a C type's call): its place is then the
        # next instruction, where that raises as the call would.
        self._call_unmarked = {}

    def start(self):
        sys.settrace(self._trace)
        sys.setprofile(self._profile)

    def stop(self):
        sys.setprofile(None)
        sys.settrace(None)

    def _place(self, frame, kind):
        self.count += 1
        if self.count == self.target:
            self.stop()
            where = os.path.basename(frame.f_code.co_filename) if frame.f_code.co_filename in ALSO_SWEPT \
                else frame.f_code.co_filename.replace(PACKAGE, "")
            self.fired = f"{where}:{frame.f_lineno} {frame.f_code.co_name}: {kind}"
            raise KeyboardInterrupt(f"the interrupt sweep's place {self.target}")

    def _profile(self, frame, event, arg):
        code = frame.f_code
        caller = frame.f_back
        if event == "call":
            if code.co_flags & _GENERATORS:
                if id(frame) in self._started:
                    return
                self._started.add(id(frame))
            elif (swept(caller) and at_a_call(caller) and id(caller) not in self._in_c_call
                    and id(caller) not in self._callee_returned):
                self._direct.add(id(frame))
            # Any entry is a place, a callback's too: CPython drops what a
            # weak reference callback or __del__ raises, so an interrupt
            # there is lost.
            if swept(frame):
                self._place(frame, "entry")
            elif swept(caller):
                self._place(frame, f"entry of {code.co_name}")
        elif event == "return":
            if id(frame) in self._direct:
                self._direct.discard(id(frame))
                self._callee_returned.add(id(caller))
                self._call_unmarked.pop(id(caller), None)
                self._place(caller, f"return of {code.co_name}")
        elif event == "c_call":
            if swept(frame):
                self._in_c_call.add(id(frame))
        elif event in ("c_return", "c_exception"):
            self._in_c_call.discard(id(frame))
            if event == "c_return" and swept(frame) and at_a_call(frame):
                self._call_unmarked.pop(id(frame), None)
                self._place(frame, f"return of {getattr(arg, '__qualname__', arg)}")

    def _trace(self, frame, event, arg):
        if not swept(frame):
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return self._opcode

    def _opcode(self, frame, event, arg):
        if event == "opcode":
            # The call instruction that called the callee is done.
            self._callee_returned.discard(id(frame))
            offset = frame.f_lasti
            unmarked = self._call_unmarked.pop(id(frame), None)
            if unmarked is not None:
                following, handled_alike = unmarked
                if offset == following:  # the call returned, raising nothing
                    if handled_alike:
                        self._place(frame, "after a call")
            opcode = frame.f_code.co_code[offset]
            if opcode in _CALLS:
                self._call_unmarked[id(frame)] = after_calls(frame.f_code)[offset]
            elif opcode in _BACKWARD_JUMPS:
                self._place(frame, "backward jump")
        return self._opcode


def _run_one(target, scenario, check, timeout):
    """Run ``target`` in a forked child; its report as a dict."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            faulthandler.dump_traceback_later(timeout, exit=True)
            injector = Injector(target)
            problems = []
            interrupted = False
            injector.start()
            try:
                scenario()
            except KeyboardInterrupt:
                interrupted = True
            except BaseException as error:  # reported, never lost
                problems.append(f"raised {type(error).__name__}: {error}"[:300])
            finally:
                injector.stop()
            if injector.fired is not None:
                if not interrupted and not problems:
                    problems.append("no KeyboardInterrupt came out: it was swallowed")
                try:
                    problems += check()
                except BaseException as error:
                    problems.append(f"the check raised {type(error).__name__}: {error}"[:300])
            with os.fdopen(write_end, "w") as out:
                json.dump({"fired": injector.fired, "places": injector.count,
                           "problems": problems}, out)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as report:
        data = report.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"fired": f"place {target}", "places": None,
                "problems": [f"the child ended with status {status}, no report: it hung "
                             f"(its stacks are above) or crashed"]}
    return json.loads(data)


def sweep(scenario, check, timeout: float = 20.0, limit: int = 20000):
    """Interrupt ``scenario()`` at each place in turn (see the module
    docstring); return ``(places, failures)``, where ``failures`` lists
    ``(place, problems)`` for each run with problems. The caller must be a
    process's main thread with no other thread running (it forks)."""
    failures = []
    for target in range(1, limit + 1):
        report = _run_one(target, scenario, check, timeout)
        if report["problems"]:
            failures.append((report["fired"], report["problems"]))
        if report["fired"] is None:
            return target - 1, failures
    raise AssertionError(f"more than {limit} places: the scenario never ends?")
