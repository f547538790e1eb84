"""Ctrl-C while the engine waits: See Note [Waits honour signals] and Note
[Cancelling a graph task].

SIGINT goes to the main thread (which runs the tests) from a helper thread
while the main thread waits, either as a real signal to that thread
(``pthread_kill``, which may also cut its system call short) or as
``_thread.interrupt_main`` (the handler's flag alone, as when the signal
lands on another thread, so only the slices of the wait notice it): for a node on a fake device (whose worker
thread is like a GPU's), for a reentrant pool thread, in GraphTask.wait and
in ReadyQueue.pop. Oracles: the wait raises KeyboardInterrupt, well before
the work it waited for ends (the bound of 1 s is a hang guard; the target is
100 ms and the latency is printed); the work left over is skipped and
nothing keeps the cancelled graph alive (a weak reference to a gradient it
made dies); afterwards the device worker and the pool still serve, with
exact gradients (products of the factors).
"""

from __future__ import annotations

import _thread
import gc
import signal
import sys
import threading
import time
import weakref

import numpy as np
import pytest
from conftest import signals_not_swallowed

import pyengine
from pyengine import fake_device as fd
from pyengine._core import GraphTask, ReadyQueue
from pyengine.backends import NumpyBackend
from pyengine.device import CPU

pytestmark = pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")

F0 = fd.device(0)
# A hang guard, not the target (100 ms): the latency is printed.
BOUND_S = 1.0
# How long the work a test interrupts would run if nothing interrupted it.
WORK_S = 3.0


HOW = ["pthread_kill", "interrupt_main"]


class Interrupter:
    """Sends SIGINT to the main thread ``delay`` seconds after ``start``."""

    def __init__(self, how, delay=0.2):
        self.how = how
        self.delay = delay
        self.sent_at = None
        self.thread = threading.Thread(target=self._run, name="interrupter", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def _run(self):
        time.sleep(self.delay)
        self.sent_at = time.monotonic()
        if self.how == "pthread_kill":
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        else:
            # Python 3.9's interrupt_main takes no signal number: SIGINT is its only one.
            _thread.interrupt_main(signal.SIGINT) if sys.version_info >= (3, 10) else _thread.interrupt_main()

    def latency(self, caught_at):
        self.thread.join()
        return caught_at - self.sent_at


def expect_interrupt(how, call, label):
    """Run ``call`` and return the latency of the KeyboardInterrupt it must raise."""
    label = f"{label} ({how})"
    interrupter = Interrupter(how).start()
    with pytest.raises(KeyboardInterrupt), signals_not_swallowed():
        call()
    latency = interrupter.latency(time.monotonic())
    print(f"{label}: KeyboardInterrupt {latency * 1000:.1f} ms after SIGINT", file=sys.stderr)
    assert latency < BOUND_S, f"{label}: KeyboardInterrupt came {latency:.3f} s after SIGINT"
    return latency


class Leaf:
    def __init__(self, data):
        self.data = data
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


class Scale(pyengine.Node):
    """Backward of ``y = factor * x``, y on ``device`` and x on the CPU. With
    ``gate``, its apply first waits for the gate (at most WORK_S), and keeps
    a weak reference to the gradient it returns in ``made``."""

    def __init__(self, edge, device, factor, gate=None):
        super().__init__([edge], [pyengine.InputMetadata((3,), np.float64, device)])
        self.device = device
        self.factor = factor
        self.gate = gate
        self.made = None
        self.finished = threading.Event()
        self.ran_on = None

    def apply(self, grads):
        self.ran_on = threading.current_thread()
        try:
            if self.gate is not None:
                self.gate.wait(WORK_S)
            grad = grads[0]
            host = grad.numpy() if isinstance(grad, fd.FakeArray) else np.asarray(grad)
            out = host * self.factor
            self.made = weakref.ref(out)
            return [out]
        finally:
            self.finished.set()


def device_chain(gate=None):
    """leaf (CPU) <- CPU node (x2) <- fake:0 node (x3, waits for ``gate``) <- root."""
    x = Leaf(np.ones(3))
    cpu = Scale(pyengine.gradient_edge(x), CPU, 2.0)
    dev = Scale(pyengine.Edge(cpu, 0), F0, 3.0, gate)
    return x, cpu, dev


def backward_from(node, grad):
    pyengine.get_default_engine().execute([pyengine.Edge(node, 0)], [grad], False, False, True)


def check_device_backward_still_works():
    x, cpu, dev = device_chain()
    backward_from(dev, fd.to_fake(np.ones(3), F0))
    np.testing.assert_array_equal(x.grad, [6.0, 6.0, 6.0])
    assert dev.ran_on.name == "pyengine-fake:0" and dev.ran_on.is_alive()
    assert cpu.ran_on is threading.current_thread()


# -- waiting for device work (the CPU thread's ReadyQueue pop) -----------------------

@pytest.mark.parametrize("how", HOW)
def test_ctrl_c_while_the_caller_waits_for_a_device_node(how):
    gate = threading.Event()
    x, cpu, dev = device_chain(gate)
    try:
        expect_interrupt(how, lambda: backward_from(dev, fd.to_fake(np.ones(3), F0)),
                         "waiting for a device node")
        assert not dev.finished.is_set(), "the interrupt waited for the device node"
    finally:
        gate.set()
    assert dev.finished.wait(WORK_S)
    # The device node's gradient for the CPU node went nowhere: the CPU node
    # never runs, and no queue keeps the gradient (or its graph task) alive.
    deadline = time.monotonic() + BOUND_S
    while dev.made is None or dev.made() is not None:
        gc.collect()
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert dev.made is not None and dev.made() is None, "a queue kept the cancelled task's gradient"
    assert cpu.ran_on is None and x.grad is None
    check_device_backward_still_works()
    check_device_backward_still_works()


@pytest.mark.parametrize("how", HOW)
def test_ctrl_c_then_the_same_graph_again_gives_the_right_gradient(how):
    gate = threading.Event()
    x, cpu, dev = device_chain(gate)
    try:
        expect_interrupt(how, lambda: pyengine.get_default_engine().execute(
            [pyengine.Edge(dev, 0)], [fd.to_fake(np.ones(3), F0)], True, False, True),
            "waiting for a device node, graph kept")
    finally:
        gate.set()
    assert dev.finished.wait(WORK_S)
    dev.finished.clear()
    backward_from(dev, fd.to_fake(np.ones(3), F0))
    np.testing.assert_array_equal(x.grad, [6.0, 6.0, 6.0])


# -- waiting for the graph task's lock ---------------------------------------------------

class HeldArray(np.ndarray):
    """A gradient whose backend's add holds its caller (a device thread,
    under the graph task's lock) until ``HeldBackend.gate`` opens."""


class HeldBackend(NumpyBackend):
    def __init__(self):
        self.entered = threading.Event()
        self.gate = threading.Event()

    def add(self, a, b):
        self.entered.set()
        self.gate.wait(WORK_S)  # gives the GIL away, the lock still held
        return np.asarray(a) + np.asarray(b)


class Step(pyengine.Node):
    """Hands ``make()`` to its one edge, once ``before`` (if any) ran."""

    def __init__(self, edge, device, make, before=None):
        super().__init__([edge], [pyengine.InputMetadata((3,), np.float64, device)])
        self.make, self.before = make, before

    def apply(self, grads):
        if self.before is not None:
            self.before()
        return [self.make()]


class Fork(pyengine.Node):
    def __init__(self, edges, gradients):
        super().__init__(edges, [pyengine.InputMetadata((3,), np.float64, CPU)])
        self.gradients = gradients

    def apply(self, grads):
        return [make() for make in self.gradients]


# Only a real signal: the twin waits for the lock in threading.RLock's C
# acquire, which a signal interrupts but interrupt_main's flag alone does
# not wake (it is seen once the lock is taken); the compiled core's wait
# has slices, and takes both.
def test_ctrl_c_while_waiting_for_the_graph_task_lock():
    backend = HeldBackend()
    pyengine.register_backend(HeldArray, backend)
    leaf = Leaf(np.zeros(3))
    try:
        # The main thread puts a HeldArray in the leaf's buffer (first); the
        # fake:0 thread then adds into it under the lock and is held there
        # (device); the main thread's next node (last) routes into the same
        # buffer and waits for the lock, where the SIGINT comes.
        last_started = threading.Event()
        last = Step(pyengine.gradient_edge(leaf), CPU, lambda: np.ones(3),
                    before=lambda: (last_started.set(), backend.entered.wait(WORK_S)))
        first = Step(pyengine.gradient_edge(leaf), CPU, lambda: np.ones(3).view(HeldArray))
        device = Step(pyengine.gradient_edge(leaf), F0, lambda: np.ones(3),
                      before=lambda: last_started.wait(WORK_S))
        root = Fork([pyengine.Edge(device, 0), pyengine.Edge(first, 0), pyengine.Edge(last, 0)],
                    [lambda: fd.to_fake(np.ones(3), F0), lambda: np.ones(3), lambda: np.ones(3)])
        try:
            expect_interrupt("pthread_kill", lambda: backward_from(root, np.ones(3)),
                             "waiting for the graph task lock")
            assert backend.entered.is_set() and not backend.gate.is_set(), \
                "the interrupt waited for the lock's holder"
        finally:
            backend.gate.set()
    finally:
        pyengine.unregister_backend(HeldArray)
    check_device_backward_still_works()


# -- waiting for a reentrant pool thread -----------------------------------------------

class Reenter(pyengine.Node):
    """A node whose apply runs a reentrant backward from ``inner`` (a CPU
    Scale node) and passes its gradient on."""

    def __init__(self, edge, inner):
        super().__init__([edge], [pyengine.InputMetadata((3,), np.float64, CPU)])
        self.inner = inner

    def apply(self, grads):
        backward_from(self.inner, grads[0])
        return [grads[0]]


@pytest.mark.parametrize("how", HOW)
def test_ctrl_c_while_blocked_on_a_reentrant_pool_thread(engine_with_depth, how):
    # max_recursion_depth 0: every reentrant backward runs on a pool thread,
    # while its caller waits for it.
    engine_with_depth(0)
    gate = threading.Event()
    inner_leaf = Leaf(np.ones(3))
    inner = Scale(pyengine.gradient_edge(inner_leaf), CPU, 5.0, gate)
    outer_leaf = Leaf(np.ones(3))
    outer = Reenter(pyengine.gradient_edge(outer_leaf), inner)
    try:
        expect_interrupt(how, lambda: backward_from(outer, np.ones(3)),
                         "blocked on a reentrant pool thread")
        assert not inner.finished.is_set(), "the interrupt waited for the pool thread"
        assert inner.ran_on.name == "pyengine-reentrant"
    finally:
        gate.set()
    assert inner.finished.wait(WORK_S)
    assert outer_leaf.grad is None
    # The inner graph task was cancelled: its AccumulateGrad never ran.
    time.sleep(0.05)
    assert inner_leaf.grad is None
    # The pool still serves: the same reentrant backward, uninterrupted.
    inner.finished.clear()
    backward_from(outer, np.ones(3))
    np.testing.assert_array_equal(inner_leaf.grad, [5.0, 5.0, 5.0])
    np.testing.assert_array_equal(outer_leaf.grad, [1.0, 1.0, 1.0])
    assert inner.ran_on.name == "pyengine-reentrant" and inner.ran_on.is_alive()


# -- the waits themselves --------------------------------------------------------------

@pytest.mark.parametrize("how", HOW)
def test_ctrl_c_in_graph_task_wait(how):
    graph_task = GraphTask(False, False, 0, ReadyQueue())
    # A wait that ignored the signal would end here, late.
    fallback = threading.Timer(WORK_S, graph_task.mark_as_completed_and_run_post_processing)
    fallback.start()
    try:
        expect_interrupt(how, graph_task.wait, "GraphTask.wait")
        assert not graph_task.future_completed
        # The wait left no lock held: completing the task and waiting again work.
        graph_task.mark_as_completed_and_run_post_processing()
        graph_task.wait()
        assert graph_task.future_completed
    finally:
        fallback.cancel()


@pytest.mark.parametrize("how", HOW)
def test_ctrl_c_in_ready_queue_pop(how):
    queue = ReadyQueue()
    # A wait that ignored the signal would end here, late.
    fallback = threading.Timer(WORK_S, queue.push_shutdown)
    fallback.start()
    try:
        expect_interrupt(how, queue.pop, "ReadyQueue.pop")
        # The wait left no lock held and took nothing.
        assert len(queue) == 0
        queue.push_shutdown()
        assert queue.pop().is_shutdown
    finally:
        fallback.cancel()
