"""An engine whose device and pool threads started is collected once nothing
else refers to it, and its threads end; a live engine's threads serve on.
See Note [An engine's threads hold it weakly] in
``pyengine/_shared/engine_registry.py``.

Before, each thread ran a method of its engine: an Engine made and dropped
kept its idle threads, and itself, until interpreter exit.

Oracles: the gradients of each backward, worked by hand (a chain of
factors 2, 3 and 5 gives 30); the engine's weak reference, dead once the
test lets go of it; the engine's threads (the ``pyengine-`` threads that
appeared while it ran), ended within a bound after it was collected.
"""

from __future__ import annotations

import gc
import glob
import os
import threading
import time
import weakref

import numpy as np
import pytest
from test_devices import F0, F1, cross_device_chain, host, on

import pyengine
from pyengine._shared.engine_registry import IDLE_CHECK_S
from pyengine.device import CPU

# An idle thread looks at its engine every IDLE_CHECK_S; the rest is slack
# for a loaded machine.
ENDED_WITHIN_S = IDLE_CHECK_S + 10.0
WORK_S = 10.0


def engine_threads(before):
    """The pyengine threads alive now that were not alive at ``before``."""
    return {thread for thread in threading.enumerate()
            if thread.name.startswith("pyengine-") and thread not in before}


def wait_until(condition, within, what):
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {within} s"
        time.sleep(0.01)


def cpu_metadata():
    return [pyengine.InputMetadata((3,), np.float64, CPU)]


def backward_through_devices_and_the_pool(engine):
    """A backward on ``engine`` across two fake devices, and one nested in a
    node, which the engine hands off to its pool (max_recursion_depth=0).
    Checks both gradients."""
    x, root = cross_device_chain()
    engine.execute([pyengine.Edge(root, 0)], [on(np.ones(3), F1)], False, False, True)
    np.testing.assert_array_equal(host(x.grad), np.full(3, 30.0))
    nested = []

    class Nest(pyengine.Node):
        def apply(self, grads):
            y, inner_root = cross_device_chain()
            engine.execute([pyengine.Edge(inner_root, 0)], [on(grads[0], F1)], False, False, True)
            nested.append(host(y.grad))
            return []

    engine.execute([pyengine.Edge(Nest([], cpu_metadata()), 0)], [np.full(3, 2.0)], False,
                   False, True)
    np.testing.assert_array_equal(nested[0], np.full(3, 60.0))


def test_a_dropped_engine_is_collected_and_its_device_and_pool_threads_end():
    before = set(threading.enumerate())
    engines = [pyengine.Engine(max_recursion_depth=0) for _ in range(3)]
    for engine in engines:
        backward_through_devices_and_the_pool(engine)
    started = engine_threads(before)
    names = sorted(thread.name for thread in started)
    assert names == sorted(["pyengine-fake:0", "pyengine-fake:1", "pyengine-reentrant"] * 3), names
    refs = [weakref.ref(engine) for engine in engines]
    del engines, engine
    gc.collect()
    assert [ref() for ref in refs] == [None] * 3, "an engine whose threads started was kept alive"
    wait_until(lambda: not any(thread.is_alive() for thread in started), ENDED_WITHIN_S,
               "the collected engines' threads did not end")


def test_the_threads_of_a_live_engine_serve_on_after_their_idle_checks():
    before = set(threading.enumerate())
    engine = pyengine.Engine(max_recursion_depth=0)
    backward_through_devices_and_the_pool(engine)
    first = engine_threads(before)
    assert len(first) == 3
    # Past two idle checks: the engine is alive, so its threads wait on.
    time.sleep(2.5 * IDLE_CHECK_S)
    assert all(thread.is_alive() for thread in first)
    backward_through_devices_and_the_pool(engine)
    # The same three threads ran it: the idle pool thread took the second
    # hand-off, each device worker its device's nodes.
    assert engine_threads(before) == first
    engine.stop()
    for thread in first:
        thread.join(WORK_S)
        assert not thread.is_alive()


@pytest.mark.parametrize("device", [F0, F1])
def test_an_engine_dropped_while_its_device_worker_runs_a_node_lives_until_the_node_ends(device):
    # The caller leaves first: a CPU node fails while a node on a device
    # still runs, and the failed backward returns without waiting for it
    # (PyTorch's engine does the same). Dropped then, the engine lives on
    # while its device worker runs the node, and is collected after.
    running, release = threading.Event(), threading.Event()
    ran = []

    class Gated(pyengine.Node):
        def apply(self, grads):
            running.set()
            assert release.wait(WORK_S), "the test never released the device node"
            ran.append(threading.current_thread().name)
            return []

    class Fails(pyengine.Node):
        def apply(self, grads):
            assert running.wait(WORK_S), "the device node never started"
            raise ValueError("a CPU node fails")

    before = set(threading.enumerate())
    engine = pyengine.Engine()
    sink = Fails([], cpu_metadata())
    gated = Gated([], [pyengine.InputMetadata((3,), np.float64, device)])

    class Root(pyengine.Node):
        def apply(self, grads):
            return [on(grads[0], device), grads[0]]

    root = Root([pyengine.Edge(gated, 0), pyengine.Edge(sink, 0)], cpu_metadata())
    with pytest.raises(ValueError, match="a CPU node fails"):
        engine.execute([pyengine.Edge(root, 0)], [np.ones(3)], False, False, True)
    ref = weakref.ref(engine)
    del engine, root, gated, sink
    gc.collect()
    assert ref() is not None, "the engine was collected while its device worker ran its node"
    release.set()
    wait_until(lambda: ref() is None, WORK_S, "the engine was not collected after the node ran")
    assert ran == [f"pyengine-{device}"]
    started = engine_threads(before)
    wait_until(lambda: not any(thread.is_alive() for thread in started), ENDED_WITHIN_S,
               "the collected engine's device thread did not end")


def test_no_engine_thread_takes_the_gil_with_gilstate_ensure():
    # A source check, for what no test process can time: an idle engine
    # thread that wakes late in the interpreter's finalization crashed in
    # CPython's new_threadstate where it took the GIL with Cython's
    # ``with gil`` (PyGILState_Ensure). Only the main thread's waits may
    # (_locks.pxd's, behind their test of on_main_thread). See Note [An
    # engine's threads hold it weakly].
    package = os.path.dirname(os.path.abspath(pyengine.__file__))
    sources = sorted(glob.glob(os.path.join(package, "*.pyx"))
                     + glob.glob(os.path.join(package, "*.pxd")))
    if not sources:
        pytest.skip("no Cython sources next to the package: an installed wheel")
    found = []
    for path in sources:
        with open(path) as source:
            lines = source.read().splitlines()
        for number, line in enumerate(lines):
            if line.strip().startswith("with gil"):
                function = max(i for i in range(number)
                               if lines[i].startswith(("cdef ", "cpdef ", "def ")))
                body = "\n".join(lines[function:number])
                found.append((os.path.basename(path), number + 1, "on_main_thread:" in body))
    assert [(name, main_only) for name, _, main_only in found] == [("_locks.pxd", True)] * 2, found
