"""init_to_execute (the pruning pass of ``grad(inputs=)``) lets other threads
run and honours Ctrl-C. See Note [Long passes let other threads run] in
``pyengine/_interrupts.pxd``.

Oracles:

- a counter thread, a pure-Python loop that timestamps each of its
  iterations, runs while the pass runs: with the GIL held from start to end
  (the compiled pass before this fix), it has no timestamp in the middle
  half of the pass, and its longest stall is the whole pass;
- SIGINT sent during the pass raises KeyboardInterrupt out of the pass
  itself (its traceback runs through ``init_to_execute``), not after it
  returned;
- afterwards ``grad`` returns the analytic gradient of the chain (ones:
  every node passes its gradient on).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
import pytest
from conftest import signals_not_swallowed

import pyengine
from pyengine._core import graph_task_module

COMPILED = pyengine.IMPLEMENTATION == "compiled"
# About 50 ms of the compiled pass; the twin's is slower per node.
CHAIN = 300_000 if COMPILED else 30_000
METADATA = pyengine.InputMetadata((3,), np.float64)


class Pass(pyengine.Node):
    def apply(self, grads):
        return grads


class Leaf:
    """A leaf tensor with the protocol pyengine reads."""

    def __init__(self):
        self.data = np.zeros(3)
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


def build_chain(n):
    """``n`` Pass nodes in a line into a leaf: the root node, the leaf, and the
    leaf's edge (what ``grad(inputs=[leaf])`` captures)."""
    leaf = Leaf()
    leaf_edge = pyengine.gradient_edge(leaf)
    edge = leaf_edge
    for _ in range(n):
        edge = pyengine.Edge(Pass(next_edges=(edge,), input_metadata=(METADATA,)), 0)
    return edge.node, leaf, leaf_edge


@pytest.fixture(scope="module")
def chain():
    root, leaf, leaf_edge = build_chain(CHAIN)
    # Out of the cyclic GC's reach: a full collection of a large graph holds
    # the GIL as long as the pass does.
    gc.collect()
    gc.freeze()
    yield root, leaf, leaf_edge
    gc.unfreeze()


def grad_through(root, leaf_edge):
    return pyengine.get_default_engine().execute([pyengine.Edge(root, 0)], [np.ones(3)], False,
                                                 False, False, outputs=[leaf_edge])


class Counter:
    """A thread that timestamps its iterations until stopped."""

    def __init__(self):
        self.stamps = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        stamps, stop, clock = self.stamps, self.stop, time.perf_counter
        while not stop.is_set():
            stamps.append(clock())

    def __enter__(self):
        self.thread.start()
        while len(self.stamps) < 100:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)

    def longest_stall(self, start, end):
        """The longest time between two iterations, over [start, end]."""
        stamps = [stamp for stamp in self.stamps if start <= stamp <= end]
        stamps = [start] + stamps + [end]
        return max(b - a for a, b in zip(stamps, stamps[1:]))


@pytest.fixture
def short_switch_interval():
    # Threads that ask for the GIL get it within a millisecond of a release.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    yield
    sys.setswitchinterval(previous)


def test_a_counter_thread_runs_during_the_pass(chain, short_switch_interval):
    root, _, leaf_edge = chain
    with Counter() as counter:
        graph_task = graph_task_module.GraphTask(False, False, 0, None)
        start = time.perf_counter()
        graph_task.init_to_execute(root, [leaf_edge], False)
        end = time.perf_counter()
    quarter = (end - start) / 4
    during = [stamp for stamp in counter.stamps if start + quarter < stamp < end - quarter]
    assert during, (f"the counter thread did not run in the middle half of a "
                    f"{(end - start) * 1e3:.0f} ms pass")
    # The pass did its work: every node of the chain runs, the leaf captures.
    assert len(graph_task.exec_info) == CHAIN + 1
    assert graph_task.find_exec_info(leaf_edge.node).captures == [(0, 0)]


@pytest.mark.slow
def test_a_counter_thread_stalls_less_than_half_a_second_during_grad_on_a_1m_chain():
    root, _, leaf_edge = build_chain(1_000_000 if COMPILED else 200_000)
    gc.collect()
    gc.freeze()
    try:
        with Counter() as counter:
            start = time.perf_counter()
            (captured,) = grad_through(root, leaf_edge)
            end = time.perf_counter()
        np.testing.assert_array_equal(captured, np.ones(3))
        # A hang guard: the goal is a few milliseconds.
        assert counter.longest_stall(start, end) < 0.5
    finally:
        gc.unfreeze()


def interrupt_a_pass(root, leaf_edge):
    """Run init_to_execute passes until SIGINT, sent from another thread
    10 ms into the first, raises; the KeyboardInterrupt."""
    started = threading.Event()

    def send_sigint():
        started.wait(10)
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=send_sigint, daemon=True)
    sender.start()
    deadline = time.monotonic() + 10
    try:
        with signals_not_swallowed():
            while time.monotonic() < deadline:
                graph_task = graph_task_module.GraphTask(False, False, 0, None)
                started.set()
                graph_task.init_to_execute(root, [leaf_edge], False)
    except KeyboardInterrupt as interrupt:
        return interrupt
    finally:
        sender.join(10)
    pytest.fail("no KeyboardInterrupt within 10 s of SIGINT")


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers run on the main thread")
def test_sigint_during_the_pass_raises_keyboard_interrupt_and_grad_works_after(
        chain, short_switch_interval):
    root, leaf, leaf_edge = chain
    # The tuples of next edges the pass walked: their references it owned
    # while it ran are dropped when it is interrupted.
    tuples, node = [], root
    while node is not leaf_edge.node and len(tuples) < 100:
        tuples.append(node._next_edges)
        node = node._next_edges[0].node
    references = [sys.getrefcount(edges) for edges in tuples]
    # A SIGINT that lands between two passes (rarely) is tried again.
    for _ in range(3):
        interrupt = interrupt_a_pass(root, leaf_edge)
        functions = [frame.name for frame in traceback.extract_tb(interrupt.__traceback__)]
        # The twin's frames, which the traceback keeps, hold a tuple.
        interrupt.__traceback__ = None
        del interrupt
        if any("init_to_execute" in name for name in functions):
            break
    else:
        pytest.fail(f"KeyboardInterrupt came after the pass, not from it: {functions}")
    assert [sys.getrefcount(edges) for edges in tuples] == references
    (captured,) = grad_through(root, leaf_edge)
    np.testing.assert_array_equal(captured, np.ones(3))
    assert leaf.grad is None
    pyengine.get_default_engine().execute([pyengine.Edge(root, 0)], [np.ones(3)], False, False,
                                          True)
    np.testing.assert_array_equal(leaf.grad, np.ones(3))


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers run on the main thread")
def test_a_grad_in_a_signal_handler_during_the_pass_gets_its_own_frames(chain):
    # The search borrows its thread's kept frame stack (pyengine/_frame_stack.h);
    # a handler that runs while the pass lets it starts a second search on the
    # same thread, which must not use the lent stack. The oracle: both chains
    # pass their gradient on unchanged (ones), and the handler ran mid-pass.
    root, leaf, leaf_edge = chain
    small_root, _, small_leaf_edge = build_chain(100)
    inner = []

    def handler(signum, frame):
        # The timer is off while the handler's own grad runs: on a loaded
        # machine the twin's grad takes longer than a tick, and the handler
        # would nest in itself until RecursionError.
        signal.setitimer(signal.ITIMER_REAL, 0)
        inner.append(grad_through(small_root, small_leaf_edge)[0])
        # Three are enough: then the pass must get on. Never armed again
        # once the pass is over, as the default SIGALRM action is to exit.
        if len(inner) < 3 and pass_running:
            signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)

    pass_running = True
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
        try:
            (captured,) = grad_through(root, leaf_edge)
        finally:
            pass_running = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    np.testing.assert_array_equal(captured, np.ones(3))
    assert inner, "the handler never ran during the pass"
    for gradient in inner:
        np.testing.assert_array_equal(gradient, np.ones(3))
