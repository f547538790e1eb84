"""A device worker outlives an error of its own loop, outside any node: the
graph task of the task it ran fails with it, an error of no backward's is
reported through ``threading.excepthook``, and the device serves on. See
Note [A device worker outlives its loop's errors] in
``pyengine/_pure/engine.py``.

Before, such an error ended the worker's thread, and every later backward
on its device waited for good: its queue stayed registered with no thread
to serve it.

Oracles: the gradients of each backward, worked by hand (a chain of
factors 2, 3 and 5 gives 30); the error each backward raises, by type; the
error the hook reports, the one planted; the worker thread, the same one
before and after.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest
from test_devices import F0, F1, Leaf, Scale, cross_device_chain, host, on

import pyengine
from pyengine._shared.engine_registry import IDLE_CHECK_S

WORK_S = 20.0


class PlantedError(Exception):
    """What the tests raise in a device worker's own loop."""


def worker_thread(before, device):
    """The worker thread for ``device`` that was not alive at ``before``
    (a set of threads)."""
    threads = [thread for thread in threading.enumerate()
               if thread.name == f"pyengine-{device}" and thread not in before]
    assert len(threads) == 1, threads
    return threads[0]


def raise_in_thread(thread, error_type):
    """Have ``error_type`` raised in ``thread`` at its next Python
    instruction (CPython's PyThreadState_SetAsyncExc, a public C API)."""
    set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async.argtypes = [ctypes.c_ulong, ctypes.py_object]
    assert set_async(thread.ident, error_type) == 1


def backward_within(engine, root, seconds=WORK_S):
    """Run a backward from ``root`` (gradient ones on fake:1) on another
    thread; fail the test, rather than hang it, if it takes over
    ``seconds``. Returns what it raised, or None."""
    outcome = []

    def run():
        try:
            engine.execute([pyengine.Edge(root, 0)], [on(np.ones(3), root.device)], False,
                           False, True)
        except BaseException as error:
            outcome.append(error)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"the backward did not end within {seconds} s (a hang)"
    return outcome[0]


@pytest.fixture
def reported(monkeypatch):
    """The errors reported through threading.excepthook while a test runs."""
    errors = []
    monkeypatch.setattr(threading, "excepthook",
                        lambda args: errors.append((args.exc_value, args.thread)))
    return errors


def planted_in_chain(error):
    """Whether ``error`` is a PlantedError or was raised while handling one
    (the twin's queue may be in a lock's release when it lands there)."""
    while error is not None:
        if isinstance(error, PlantedError):
            return True
        error = error.__context__
    return False


def started_worker(device):
    """A new Engine, after one exact backward on the cross-device chain,
    and its worker thread for ``device``; and the threads before it."""
    before = set(threading.enumerate())
    engine = pyengine.Engine()
    x, root = cross_device_chain()
    assert backward_within(engine, root) is None
    np.testing.assert_array_equal(host(x.grad), np.full(3, 30.0))
    return engine, worker_thread(before, device), before


def assert_serves_on(engine, worker, before, device):
    """The device's worker is the same thread, alive, and the next backward
    is exact; then the engine stops."""
    assert worker.is_alive()
    x, root = cross_device_chain()
    assert backward_within(engine, root) is None
    np.testing.assert_array_equal(host(x.grad), np.full(3, 30.0))
    assert worker_thread(before, device) is worker and worker.is_alive()
    engine.stop()


def test_an_error_between_tasks_is_reported_and_the_device_serves_on(reported):
    engine, worker, before = started_worker(F0)
    # Idle, the worker waits without the GIL and wakes every IDLE_CHECK_S;
    # the error lands in its loop's Python code when the wait returns.
    raise_in_thread(worker, PlantedError)
    deadline = time.monotonic() + IDLE_CHECK_S + WORK_S
    while not reported and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(reported) == 1, "the worker's error was not reported"
    error, thread = reported[0]
    assert planted_in_chain(error), repr(error)
    assert thread is worker
    assert_serves_on(engine, worker, before, F0)


@pytest.mark.skipif(pyengine.IMPLEMENTATION != "pure",
                    reason="the twin's bookkeeping is Python, which may raise after a node; the "
                           "compiled core's is C, which raises only where a C++ allocation fails")
@pytest.mark.parametrize("device", ["fake:0", "fake:1"])
def test_an_error_after_a_node_fails_its_backward_and_the_device_serves_on(
        monkeypatch, reported, device):
    from pyengine._pure import engine as twin_engine

    engine, worker, before = started_worker(device)
    keep_spare_list = twin_engine.keep_spare_list
    planted = []

    def fails_once_on_the_worker(worker_state, task):
        keep_spare_list(worker_state, task)
        if threading.current_thread() is worker and not planted:
            planted.append(PlantedError("the worker's bookkeeping after a node"))
            raise planted[0]

    monkeypatch.setattr(twin_engine, "keep_spare_list", fails_once_on_the_worker)
    x, root = cross_device_chain()
    error = backward_within(engine, root)
    assert planted and error is planted[0], repr(error)
    # It failed its backward, whose caller raised it: not reported again.
    assert reported == []
    assert_serves_on(engine, worker, before, device)


class FailsUnnoted(Scale):
    """A Scale whose ``apply`` raises a NodeError that takes no note: its
    ``__notes__`` is not a list, so anomaly mode's note on it, which the
    worker's loop adds outside the node, fails (TypeError)."""

    def apply(self, grads):
        error = NodeError("the node fails")
        error.__notes__ = "not a list"
        raise error


class FailsUnnamed(Scale):
    """A Scale whose ``apply`` raises NodeError and whose ``name()`` raises
    PlantedError."""

    def apply(self, grads):
        raise NodeError("the node fails")

    def name(self):
        raise PlantedError("the node's name() fails")


class NodeError(Exception):
    """What FailsUnnoted.apply and FailsUnnamed.apply raise."""


def failing_cross_device_chain(device, failing_type):
    """leaf <- cpu node <- fake:0 node <- fake:1 node, the one on ``device``
    of ``failing_type``; the root."""
    n_cpu = Scale(pyengine.gradient_edge(Leaf(np.ones(3))), pyengine.CPU, 2.0, pyengine.CPU)
    if device == "fake:0":
        n0 = failing_type(pyengine.Edge(n_cpu, 0), F0, 3.0, pyengine.CPU)
        return Scale(pyengine.Edge(n0, 0), F1, 5.0, F0)
    n0 = Scale(pyengine.Edge(n_cpu, 0), F0, 3.0, pyengine.CPU)
    return failing_type(pyengine.Edge(n0, 0), F1, 5.0, F0)


@pytest.mark.parametrize("device", ["fake:0", "fake:1"])
def test_an_error_in_the_loop_while_a_node_fails_fails_its_backward_and_the_device_serves_on(
        no_anomaly_warning, reported, device):
    # The worker's loop adds anomaly mode's note to a failing node's error
    # (its error handler, outside the node), and that fails there, before
    # the graph task has the node's error: the graph task of the task in
    # flight fails with the TypeError, the node's error its context, as
    # Python chains an error raised while another is handled. The only
    # route to the compiled core's fail_in_flight_graph_task that no
    # allocation failure takes: the TypeError comes out of the device
    # worker's loop, outside every node, so only that function can hand it
    # to the caller.
    engine, worker, before = started_worker(device)
    root = failing_cross_device_chain(device, FailsUnnoted)
    with pyengine.detect_anomaly():
        error = backward_within(engine, root)
    assert type(error) is TypeError and "__notes__" in str(error), repr(error)
    assert type(error.__context__) is NodeError, repr(error.__context__)
    # It failed its backward, whose caller raised it: not reported again.
    assert reported == []
    assert_serves_on(engine, worker, before, device)


@pytest.mark.parametrize("device", ["fake:0", "fake:1"])
def test_a_name_that_raises_leaves_the_nodes_error_to_its_backward(
        no_anomaly_warning, reported, device):
    # Anomaly mode's note names the node by its type where its name()
    # raises, and the backward fails with the node's own error: See Note [A
    # name() that raises] in pyengine/_shared/messages.py.
    engine, worker, before = started_worker(device)
    root = failing_cross_device_chain(device, FailsUnnamed)
    with pyengine.detect_anomaly():
        error = backward_within(engine, root)
    assert type(error) is NodeError and str(error).startswith("the node fails"), repr(error)
    notes = getattr(error, "__notes__", [])
    assert len(notes) == 1, notes
    assert notes[0].startswith("Error detected in FailsUnnamed (its name() raised PlantedError)."), notes
    assert reported == []
    assert_serves_on(engine, worker, before, device)
