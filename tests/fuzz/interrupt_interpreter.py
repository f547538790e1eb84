"""The interrupt fuzz's child process: runs fuzz programs on one core and
interrupts each call at random moments.

``python interrupt_interpreter.py`` reads a JSON object on stdin, ``{"runs":
[run, ...]}``, a run being ``{"program": spec, "seed": n, "interrupts":
[[how, delay_fraction], ...]}`` (``how`` ``pthread_kill`` or
``interrupt_main``; a delay as a fraction of the program's uninterrupted
call time; a second interrupt's delay is counted from the first), and
prints one JSON line per run: ``{"i": index, "outcome": "returned" |
"interrupted" | "raised", "problems": [what an oracle found wrong, ...]}``.

``spec`` is a program of ``fuzz_programs.py`` with the extras of
``interrupt_programs.py``: ``devices`` (per node: -1 for the CPU, or the
index of the ``fake`` device whose worker thread runs it), ``sleep_ms``
(per node: how long its ``apply`` sleeps, to widen the windows where the
engine waits).

Each run, in this process:

1. *baseline*: the program uninterrupted, fresh; its result (exception type
   and message, leaves' gradients, what grad/execute returned) is the right
   answer, and for a pool engine a reference chain of reentrant backwards on
   it;
2. *interrupted*: the program fresh again; SIGINT reaches the main thread
   (``signal.pthread_kill`` or ``_thread.interrupt_main``) at the drawn
   moments of its call. The call must give the baseline's result, or raise
   KeyboardInterrupt or an error chained from one. Then, once every engine
   thread has left the program's code (a thread still in it after
   ``QUIESCE_S`` is stuck): each leaf's ``.grad`` is None or a value the
   baseline shows it can take (a leaf's gradient is written once, whole,
   by its AccumulateGrad: never half a sum), the pool engine still runs the
   reference chain as on the baseline, the program's objects die once
   dropped (nothing keeps a cancelled graph alive), and no thread is left;
3. *again*: the program fresh, uninterrupted, gives the baseline's result;
4. the reference backwards: a fresh CPU graph, one through a fake device
   worker, exact, and the fuzz's global-state and thread checks.

``PYENGINE_INTERRUPT_FUZZ_PLANT`` names a fault to plant (test-only: it
shows that each oracle can fail; see ``PLANTS``);
``PYENGINE_INTERRUPT_FUZZ_QUIESCE_S`` (default 3) bounds the waits for
engine threads to leave the program's code and for its objects to die.

Programs run with ``PYENGINE_FUZZ_PROGRAM_TIMEOUT`` (default 20 s) each: a
hang makes faulthandler print every thread's stack and end the process
with status 1, so the parent sees a missing line.
"""

from __future__ import annotations

import _thread
import faulthandler
import gc
import json
import os
import random
import re
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fuzz_interpreter as fi  # noqa: E402

import pyengine  # noqa: E402
from pyengine import fake_device as fd  # noqa: E402

SHAPE = fi.SHAPE
# How long engine threads may take to leave the program's code after the
# call, and the program's objects to die once dropped (shorter where a
# planted fault makes every run wait them out).
QUIESCE_S = float(os.environ.get("PYENGINE_INTERRUPT_FUZZ_QUIESCE_S", "3"))
RELEASE_S = min(QUIESCE_S, 2.0)
# Frames of these files on an engine thread's stack mean it still runs the program.
PROGRAM_FILES = {os.path.join(HERE, name) for name in
                 ("fuzz_interpreter.py", "interrupt_interpreter.py")}


# A planted fault, what it breaks once a call was interrupted (or, for
# "swallow", in the API), and the oracle that must catch it.
PLANTS = {
    "swallow": "backward/grad/execute swallow KeyboardInterrupt: the call's result",
    "hang": "the interrupted call never returns: the per-program timeout",
    "crash": "the process aborts: a negative status",
    "stuck": "an engine thread left blocked in the program's code: quiesce",
    "corrupt_grad": "every leaf's .grad overwritten: the leaf gradient check",
    "keep_alive": "the program's nodes kept in a global: the weak references",
    "grad_mode": "grad mode left off: the reference check",
    "thread_left": "an extra thread left running: the thread count",
    "stop_devices": "the default engine's device workers stopped: the device reference",
    "again": "root gradients doubled from then on: the uninterrupted rerun",
    "pool_count": "(twin) a pool slot taken and never given back: the pool's counts",
}
PLANT = os.environ.get("PYENGINE_INTERRUPT_FUZZ_PLANT", "")
KEPT_BY_PLANT = []
DOUBLE_ROOT_GRADS = False  # set by the "again" plant


def _blocked_forever():
    threading.Event().wait()


def plant_after_interrupt(program, setup):
    """The planted fault (PYENGINE_INTERRUPT_FUZZ_PLANT), once a call was interrupted."""
    global DOUBLE_ROOT_GRADS
    if PLANT == "hang":
        _blocked_forever()
    elif PLANT == "crash":
        os.abort()
    elif PLANT == "stuck":
        threading.Thread(target=_blocked_forever, name="pyengine-planted", daemon=True).start()
    elif PLANT == "corrupt_grad":
        for leaf in program.leaves:
            leaf.grad = np.full(SHAPE, 0.25)
    elif PLANT == "keep_alive":
        KEPT_BY_PLANT.append(list(program.nodes))
    elif PLANT == "grad_mode":
        pyengine.set_grad_enabled(False)
    elif PLANT == "thread_left":
        threading.Thread(target=time.sleep, args=(60,), name="planted", daemon=True).start()
    elif PLANT == "stop_devices":
        GLOBAL_DEFAULT_ENGINE[0].stop()
    elif PLANT == "again":
        DOUBLE_ROOT_GRADS = True
    elif PLANT == "pool_count" and hasattr(getattr(setup.engine, "_pool", None), "num_idle"):
        with setup.engine._pool.condition:
            setup.engine._pool.num_threads += 1


GLOBAL_DEFAULT_ENGINE = []


def plant_swallow():
    """Backward, grad and execute that return normally on KeyboardInterrupt."""
    def swallowing(function):
        def call(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except KeyboardInterrupt:
                return None
        return call

    class SwallowingEngine:
        def __init__(self, engine):
            self.engine = engine

        def __getattr__(self, name):
            attribute = getattr(self.engine, name)
            return swallowing(attribute) if name == "execute" else attribute

    get_default_engine = pyengine.get_default_engine
    pyengine.backward = swallowing(pyengine.backward)
    pyengine.grad = swallowing(pyengine.grad)
    pyengine.get_default_engine = lambda: SwallowingEngine(get_default_engine())


def device_of(index):
    return pyengine.device.CPU if index < 0 else fd.device(index)


class DeviceProgram(fi.Program):
    """A fuzz program whose nodes may live on fake devices and sleep in apply."""

    def __init__(self, spec):
        super().__init__(spec)
        self.devices = spec.get("devices") or [-1] * len(spec["nodes"])
        self.sleeps = spec.get("sleep_ms") or [0] * len(spec["nodes"])
        self.pending_root_devices = []

    def build(self):
        if not any(d >= 0 for d in self.devices):
            return super().build()
        # Every slot of a node has metadata on the node's device: the engine
        # routes its task to that device's worker.
        for index, node_spec in enumerate(self.spec["nodes"]):
            device = device_of(self.devices[index])
            edges = [self.edge(edge) for edge in node_spec["edges"]]
            metadata = [pyengine.InputMetadata(SHAPE, np.float64, device)
                        for _ in node_spec["meta"]]
            self.nodes.append(fi.FuzzNode(self, index, edges, metadata))
        self.stage = "hooks"
        for hook_spec in self.spec.get("hooks", ()):
            self.add_hook(hook_spec)
        self.stage = "mutations"

    def to_consumer(self, value, edge_spec):
        """A node's output moved to the device of the slot it flows into."""
        if not isinstance(value, np.ndarray) or not isinstance(edge_spec, dict):
            return value
        if edge_spec["to"][0] == "node":
            device = self.devices[edge_spec["to"][1] % len(self.devices)]
            if device >= 0:
                return fd.to_fake(value, fd.device(device))
        return value

    def apply(self, node, grads):
        delay = self.sleeps[node.index % len(self.sleeps)]
        if delay:
            time.sleep(delay / 1000.0)
        if not any(d >= 0 for d in self.devices):
            return super().apply(node, grads)
        host = [g.numpy() if isinstance(g, fd.FakeArray) else g for g in grads]
        outs = super().apply(node, host)
        if isinstance(outs, list):
            edges = self.spec["nodes"][node.index]["edges"]
            outs = [self.to_consumer(v, edges[k]) if k < len(edges) else v
                    for k, v in enumerate(outs)]
        return outs

    def roots(self, call):
        roots = super().roots(call)
        # root_grad is called once per root, in order, right after this.
        self.pending_root_devices = [
            self.devices[r["to"][1] % len(self.devices)]
            if isinstance(r, dict) and r["to"][0] == "node" and self.devices else -1
            for r in call["roots"]]
        return roots

    def root_grad(self, spec):
        value = super().root_grad(spec)
        device = self.pending_root_devices.pop(0) if self.pending_root_devices else -1
        if DOUBLE_ROOT_GRADS and isinstance(value, np.ndarray):
            value = value * 2.0
        if device >= 0 and isinstance(value, np.ndarray):
            return fd.to_fake(value, fd.device(device))
        return value


class Setup:
    """What ``Program.run`` sets up around its calls, entered before the
    interrupt window opens and left after it closed: an interrupt there
    would test this harness, not the engine."""

    def __init__(self, program):
        self.program = program
        self.engine = None
        self.previous = None
        self.contexts = []
        self.retained = []

    def __enter__(self):
        try:
            return self.set_up()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def set_up(self):
        program, call = self.program, self.program.spec["call"]
        if call.get("mode") == "anomaly_build":
            self.enter(pyengine.detect_anomaly())
        program.build()
        program.stage = "retain_grad"
        self.retained = program.retained_tensors(call.get("retain_grad", ()))
        if call.get("engine") is not None:
            program.stage = "engine"
            self.engine = pyengine.Engine(*call["engine"])
            self.previous = pyengine.set_default_engine(self.engine)
            if not self.program.spec.get("cold_engine"):
                # Its device workers started before the interrupt window: a
                # KeyboardInterrupt while a backward starts one is a known
                # bug (see test_interrupt_fuzz.py), kept out of the fuzz.
                fi.device_reference()
        if call.get("mode") == "anomaly":
            self.enter(pyengine.detect_anomaly())
        elif call.get("mode") == "profile":
            self.enter(pyengine.profile())
        return self

    def enter(self, context):
        context.__enter__()
        self.contexts.append(context)

    def __exit__(self, *exc_info):
        for context in reversed(self.contexts):
            context.__exit__(None, None, None)
        self.contexts.clear()
        if self.engine is not None:
            pyengine.set_default_engine(self.previous)
            self.engine.stop()
        for handle in self.program.handles:
            handle.remove()
        return False


def same(a, b):
    """Equal as the JSON lines say (nan equals nan)."""
    return json.dumps(a) == json.dumps(b)


def outcome_of(program, returned=None, error=None):
    """What a run gives, in words the runs compare."""
    result = {"exc": None, "message": None, "captured": None,
              "grads": [fi._encode(leaf.grad) for leaf in program.leaves]}
    if error is not None:
        result["exc"] = type(error).__name__
        # Object addresses aside, and anomaly mode's forward traceback, whose
        # lines are this file's, different for each run of the program.
        message = re.sub(r"0x[0-9a-fA-F]+", "0x?", fi.message_of(error))
        result["message"] = message.split("Traceback of forward call")[0]
    elif returned is not None:
        result["captured"] = [fi._encode(value) for value in returned]
    return result


def run_plain(spec):
    """The program, fresh and uninterrupted: ``(outcome, program)``."""
    program = DeviceProgram(spec)
    error = returned = None
    try:
        with Setup(program):
            try:
                returned = program.calls(program.spec["call"])
            finally:
                quiesce()
    except Exception as caught:
        error = caught
    outcome = outcome_of(program, returned, error)
    del error, returned
    return outcome, program


def compared_keys(baseline):
    """What two runs of a program must agree on. Where it raised, not the
    leaves' gradients: which AccumulateGrads ran before the error stopped
    the graph task is a race between the caller and the device workers."""
    if baseline["exc"] is not None:
        return ("exc", "message")
    return ("exc", "message", "captured", "grads")


def chained_from_interrupt(error):
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class Interrupter:
    """Sends SIGINT to the main thread at the drawn moments."""

    def __init__(self, interrupts, call_s):
        self.interrupts = interrupts
        self.call_s = call_s
        self.thread = threading.Thread(target=self._run, name="interrupter", daemon=True)
        self.main_ident = threading.main_thread().ident
        self.sent_all = False  # set by the interrupter thread once, read by the main thread

    def _run(self):
        for how, fraction in self.interrupts:
            time.sleep(fraction * self.call_s)
            if how == "pthread_kill":
                signal.pthread_kill(self.main_ident, signal.SIGINT)
            elif sys.version_info >= (3, 10):
                _thread.interrupt_main(signal.SIGINT)
            else:  # no signal argument before 3.10: it simulates SIGINT
                _thread.interrupt_main()
        self.sent_all = True


def drain(interrupter):
    """Waits until every interrupt was sent and its handler ran: a late
    KeyboardInterrupt comes out here, not in the checks that follow. True
    if one did.

    Not ``Thread.join``: a join that a KeyboardInterrupt cuts short marks the
    thread stopped (CPython 3.11's ``_wait_for_tstate_lock`` releases the
    thread's lock on any exception), and the next join returns at once,
    before the second interrupt was sent."""
    late = False
    while True:
        try:
            while not interrupter.sent_all:
                time.sleep(0.0005)
            for _ in range(1000):  # bytecodes, where a pending handler runs
                pass
            time.sleep(0.002)
            return late
        except KeyboardInterrupt:
            late = True


def engine_threads():
    return [t for t in threading.enumerate() if t.name.startswith("pyengine")]


def busy_threads():
    """Engine threads with a frame of the program's code on their stack."""
    frames = sys._current_frames()
    busy = []
    for thread in engine_threads():
        frame = frames.get(thread.ident)
        while frame is not None:
            if frame.f_code.co_filename in PROGRAM_FILES:
                busy.append(thread)
                break
            frame = frame.f_back
    return busy


def quiesce():
    """Waits until no engine thread runs the program's code; the stacks of
    those that still do after QUIESCE_S."""
    deadline = time.monotonic() + QUIESCE_S
    while True:
        busy = busy_threads()
        if not busy:
            return None
        if time.monotonic() > deadline:
            frames = sys._current_frames()
            return "; ".join(f"{t.name} stuck in: " + "".join(
                traceback.format_stack(frames[t.ident])[-4:]) for t in busy if t.ident in frames)
        time.sleep(0.002)


class Reenter(pyengine.Node):
    """A chain of reentrant backwards, one level per node: each adds 1 to x."""

    def __init__(self, x, depth):
        super().__init__([pyengine.gradient_edge(x)], [(SHAPE, np.float64)])
        self.x, self.depth = x, depth

    def apply(self, grads):
        if self.depth > 0:
            pyengine.backward([pyengine.Edge(Reenter(self.x, self.depth - 1), 0)],
                              [np.ones(SHAPE)])
        return [grads[0]]


def pool_idle(engine):
    """In the twin, whose pool is Python: every pool thread of ``engine``
    idle again, none of its slots taken, no hand-off left queued (None), or
    what is not. The compiled pool's counts are C fields: there
    ``pool_reference`` and the threads' ending on stop stand for this."""
    pool = getattr(engine, "_pool", None)
    if pool is None or not hasattr(pool, "num_idle"):
        return None
    deadline = time.monotonic() + QUIESCE_S
    while True:
        with pool.condition:
            counts = (pool.num_idle, pool.num_threads, len(pool.graph_tasks))
        if counts[0] == counts[1] and not counts[2]:
            return None
        if time.monotonic() > deadline:
            return f"pool not idle after the call: idle {counts[0]}, threads {counts[1]}, " \
                   f"queued {counts[2]}"
        time.sleep(0.002)


def pool_reference(engine):
    """Chains of 1 to 4 reentrant backwards on ``engine`` (its pool, when its
    recursion depth is small): per depth, the gradient or the error's type."""
    if engine is None:
        return None
    answers = []
    previous = pyengine.set_default_engine(engine)
    try:
        for depth in range(1, 5):
            x = fi.Leaf(np.zeros(SHAPE))
            try:
                pyengine.backward([pyengine.Edge(Reenter(x, depth), 0)], [np.ones(SHAPE)])
                answers.append(fi._encode(x.grad))
            except Exception as error:
                answers.append(type(error).__name__)
    finally:
        pyengine.set_default_engine(previous)
    return answers


def allowed_leaf_grads(baseline):
    """Per leaf, the values an interrupted call may leave: None, or what the
    baseline's calls wrote (with ``repeat`` 2, the first call's half too)."""
    allowed = []
    repeat = baseline["spec_repeat"]
    for grad in baseline["grads"]:
        values = [None, grad]
        if repeat == 2 and isinstance(grad, list):
            values.append([v / 2 for v in grad])
        allowed.append(values)
    return allowed


def interrupted_run(spec, interrupts, call_s, baseline, engine_answers):
    """The program with interrupts in its call: ``(outcome kind, problems)``."""
    problems = []
    program = DeviceProgram(spec)
    setup = Setup(program)
    try:
        setup.__enter__()
    except Exception as caught:
        # Misuse that fails before the call: nothing to interrupt.
        if type(caught).__name__ != baseline["exc"]:
            problems.append(f"setup raised {type(caught).__name__}, uninterrupted {baseline['exc']}")
        return "setup", problems
    interrupter = Interrupter(interrupts, call_s)
    returned = error = None
    kind = None
    try:
        try:
            interrupter.thread.start()
            returned = program.calls(program.spec["call"])
            kind = "returned"
        except BaseException as caught:
            error, kind = caught, "raised"
    except KeyboardInterrupt as caught:  # in the except clause itself
        error, kind = caught, "raised"
    late = False
    while True:  # a KeyboardInterrupt may come as drain is entered
        try:
            late = drain(interrupter) or late
            break
        except KeyboardInterrupt:
            late = True
    if PLANT and (late or chained_from_interrupt(error)):
        plant_after_interrupt(program, setup)
    stuck = quiesce()
    if stuck:
        problems.append(f"engine thread stuck after the call: {stuck}")
    outcome = outcome_of(program, returned, error if not isinstance(error, KeyboardInterrupt)
                         else None)
    if kind == "raised" and chained_from_interrupt(error):
        kind = "interrupted"
    else:
        for key in compared_keys(baseline):
            if not same(outcome[key], baseline[key]):
                problems.append(f"interrupted call ({kind}, {type(error).__name__ if error else ''}) "
                                f"gave {key} {outcome[key]!r}, uninterrupted {baseline[key]!r}")
    if kind == "interrupted" and baseline["well_formed"]:
        for leaf, (grad, allowed) in enumerate(zip(outcome["grads"],
                                                  allowed_leaf_grads(baseline))):
            if not any(same(grad, value) for value in allowed):
                problems.append(f"leaf {leaf} grad {grad!r} after the interrupt; "
                                f"allowed {allowed!r}")
    idle = pool_idle(setup.engine)
    if idle:
        problems.append(idle)
    answers = pool_reference(setup.engine)
    if answers != engine_answers:
        problems.append(f"pool reference after the interrupt gave {answers}, "
                        f"on a fresh engine {engine_answers}")
    refs = [weakref.ref(node) for node in program.nodes]
    try:
        setup.__exit__(None, None, None)
    except Exception as caught:
        problems.append(f"leaving the setup raised {type(caught).__name__}: {caught}\n"
                        f"{traceback.format_exc()}")
    del program, setup, returned, error, interrupter
    # A worker that ran the program's last node may still be on its way
    # out of the engine's code, its locals not yet dropped: give it time.
    deadline = time.monotonic() + RELEASE_S
    while True:
        gc.collect()
        if all(ref() is None for ref in refs) or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    alive = [ref() for ref in refs if ref() is not None]
    if alive and not baseline["leaks"]:
        problems.append(f"{len(alive)} node(s) of the interrupted program still alive once "
                        f"dropped; what holds one: {holders(alive[0])}")
    del alive
    return kind, problems


def holders(obj, depth=5):
    """What keeps ``obj`` alive: a chain of its referrers' types, outward
    (the first referrer at each step that is not this function's)."""
    chain = []
    mine = sys._getframe()
    for _ in range(depth):
        referrers = [ref for ref in gc.get_referrers(obj)
                     if ref is not mine and not (isinstance(ref, list) and obj in ref
                                                 and ref is chain)]
        if not referrers:
            break
        described = []
        for ref in referrers[:3]:
            name = type(ref).__name__
            if isinstance(ref, dict):
                name += "{" + ",".join(map(str, list(ref)[:6])) + "}"
            elif hasattr(ref, "f_code"):
                name += f"({ref.f_code.co_name}:{ref.f_lineno})"
            described.append(name)
        chain.append(" | ".join(described))
        obj = referrers[0]
    return " <- ".join(chain)


def baseline_of(spec):
    start = time.perf_counter()
    outcome, program = run_plain(spec)
    call_s = time.perf_counter() - start
    refs = [weakref.ref(node) for node in program.nodes]
    del program
    gc.collect()
    outcome["leaks"] = any(ref() is not None for ref in refs)
    outcome["spec_repeat"] = spec["call"].get("repeat", 1)
    outcome["well_formed"] = bool(spec.get("well_formed"))
    engine_answers = None
    if spec["call"].get("engine") is not None:
        try:
            engine = pyengine.Engine(*spec["call"]["engine"])
        except Exception:
            engine = None
        engine_answers = pool_reference(engine)
        if engine is not None:
            engine.stop()
    return outcome, max(call_s, 0.001), engine_answers


def run_one(index, run, baseline_threads):
    spec = run["program"]
    problems = []
    baseline, call_s, engine_answers = baseline_of(spec)
    if baseline["well_formed"] and baseline["exc"] is not None:
        problems.append(f"well-formed program raised {baseline['exc']}: {baseline['message']}")
    exact = spec.get("expected")
    if exact and baseline["exc"] is None:
        for key in ("grads", "captured"):
            if not same(baseline[key], exact[key]):
                problems.append(f"well-formed program gave {key} {baseline[key]}, "
                                f"exact {exact[key]}")
    kind, found = interrupted_run(spec, run["interrupts"], call_s, baseline, engine_answers)
    problems += found
    again, program = run_plain(spec)
    del program
    for key in compared_keys(baseline):
        if not same(again[key], baseline[key]):
            problems.append(f"run again uninterrupted gave {key} {again[key]!r}, "
                            f"first {baseline[key]!r}")
    gc.collect()
    problems += fi.device_reference()
    check = fi.reference_check(baseline_threads)
    if check != "ok":
        problems.append(check)
    return {"i": index, "outcome": kind, "problems": problems}


def warm_up():
    """Starts each fake device's worker, so that the baseline count of
    threads includes them."""
    fi.device_reference()


def main():
    if not fi.imported_the_expected_core():
        return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.enable()
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    timeout = float(os.environ.get("PYENGINE_FUZZ_PROGRAM_TIMEOUT", "20"))
    runs = json.load(sys.stdin)["runs"]
    GLOBAL_DEFAULT_ENGINE.append(pyengine.get_default_engine())
    if PLANT == "swallow":
        plant_swallow()
    warm_up()
    baseline_threads = threading.active_count()
    for index, run in enumerate(runs):
        random.seed(run.get("seed", index))
        faulthandler.dump_traceback_later(timeout, exit=True)
        try:
            result = run_one(index, run, baseline_threads)
        except BaseException as error:  # the harness itself: reported, never lost
            result = {"i": index, "outcome": "harness", "problems": [
                f"harness raised {type(error).__name__}: {error}\n{traceback.format_exc()}"]}
        faulthandler.cancel_dump_traceback_later()
        print(json.dumps(result), flush=True)
        if result["problems"]:
            # One run's leftovers (threads) are its failure, not the next run's.
            baseline_threads = threading.active_count()
    return 0


if __name__ == "__main__":
    sys.exit(main())
