"""Backward graphs whose work in C is long though their nodes are few (one
node with a million edges, a million root edges, a million leaves, whose
AccumulateGrad nodes run with no Python code), and what a failed graph
task leaves let go of: other threads run, and Ctrl-C comes out, while it
goes. See Note [Long passes let other threads run] in
``pyengine/_interrupts.pxd`` and Note [What a failed graph task leaves is
let go of in slices] in ``pyengine/_pure/graph_task.py``.

Oracles:

- other threads: a pure-Python counter thread never waits longer than a
  fraction of the backward, as it would if the engine held the GIL
  throughout (the measure of ``test_graph_passes.py``'s count);
- Ctrl-C: a SIGALRM that a root node's ``apply`` starts raises
  KeyboardInterrupt out of the backward (an engine frame in its
  traceback) before the leaves all have their gradients, which they would
  if the engine only honoured it once it returned; afterwards the thread's
  state is as it was, and the same graph gives every leaf exactly one
  more gradient of ones;
- a failed graph task's tasks: the counter thread's measure while a queue
  drops them; a SIGALRM while they are let go of comes out of the discard
  with every one of them let go of (weak references to their inputs dead)
  and the other graph task's tasks still queued; and the loops that
  discard several graph tasks' tasks fail every one of them though a
  discard raises (the twin's, whose discard a test can replace);
- a failed graph task's gradients, waiting in not_ready (a node raised
  before the second gradient of each of many two-input nodes came) or
  captured by ``grad()`` (a node raised once many were): a SIGALRM that
  the raising node starts comes out of the backward through
  ``release_leftovers``, with weak references to every one of them dead,
  and the graph fails alike once more.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
import traceback
import types
import weakref

import numpy as np
import pytest
from conftest import signals_not_swallowed
from minitensor import leaf
from stalls import longest_stall_while
from test_graph_passes import interrupt_after, stop_interrupts
from thread_state import thread_state_problems

import pyengine
from pyengine import Edge, Node

COMPILED = pyengine.IMPLEMENTATION == "compiled"
# Leaves or edges: a backward of about 0.1 s on either core (the twin runs
# a node about 30 times slower).
WIDTH = 100_000 if COMPILED else 5_000
ENGINE_FILES = os.path.dirname(os.path.abspath(pyengine.__file__)) + os.sep


def engine():
    return pyengine.get_default_engine()


class Split(Node):
    """Its one gradient to each of its next edges."""

    def apply(self, grads):
        return [grads[0]] * len(self.next_edges)


class Sink(Node):
    """A node with no next edges."""

    def apply(self, grads):
        return []


def leaves(n):
    return [leaf([1.0]) for _ in range(n)]


def split_into_leaves():
    xs = leaves(WIDTH)
    root = Split(next_edges=[pyengine.gradient_edge(x) for x in xs], input_metadata=[xs[0].data])
    return xs, lambda: engine().execute([Edge(root, 0)], [np.ones(1)], False, False, True)


def root_edges_of_leaves():
    xs = leaves(WIDTH)
    roots = [pyengine.gradient_edge(x) for x in xs]
    grads = [np.ones(1)] * WIDTH
    return xs, lambda: engine().execute(roots, grads, False, False, True)


def grad_of_leaves():
    xs = leaves(WIDTH)
    edges = [pyengine.gradient_edge(x) for x in xs]
    root = Split(next_edges=edges, input_metadata=[xs[0].data])

    def run():
        got = engine().execute([Edge(root, 0)], [np.ones(1)], False, False, False, outputs=edges)
        assert len(got) == WIDTH and all(np.array_equal(g, [1.0]) for g in got[:: WIDTH // 100])

    return [], run


def split_into_one_sink():
    sink = Sink(input_metadata=[np.ones(1)])
    root = Split(next_edges=[Edge(sink, 0)] * WIDTH, input_metadata=[np.ones(1)])
    return [], lambda: engine().execute([Edge(root, 0)], [np.ones(1)], False, False, True)


@pytest.mark.parametrize("build", [split_into_leaves, root_edges_of_leaves, grad_of_leaves,
                                   split_into_one_sink])
def test_other_threads_run_during_a_long_backward(build):
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    xs, run = build()
    try:
        tries = []
        # A stall of the OS's own can make one try fail: the best of three.
        for runs in range(1, 4):
            tries.append(longest_stall_while(run))
            # Every leaf got its gradient, once a run.
            assert all(np.array_equal(x.grad, [float(runs)]) for x in xs[:: WIDTH // 100])
    finally:
        sys.setswitchinterval(interval)
    stall, elapsed = min(tries)
    # An engine that held the GIL would stall the counter for nearly all of
    # the backward, which must last many switch intervals (1 ms) to show it.
    assert elapsed > 0.01, tries
    assert stall < min(0.5, elapsed / 4), tries


def raised_in_the_engine(error):
    return any(frame.filename.startswith(ENGINE_FILES)
               for frame in traceback.extract_tb(error.__traceback__))


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_ctrl_c_while_nodes_of_c_run():
    xs = leaves(WIDTH)
    started = []

    class StartsTheAlarm(Split):
        def apply(self, grads):
            if not started:
                started.append(interrupt_after(0.005))
            return super().apply(grads)

    root = StartsTheAlarm(next_edges=[pyengine.gradient_edge(x) for x in xs],
                          input_metadata=[xs[0].data])
    error = None
    try:
        engine().execute([Edge(root, 0)], [np.ones(1)], False, False, True)
    except KeyboardInterrupt as interrupt:
        error = interrupt
    finally:
        if started:
            stop_interrupts(started[0])
    assert error is not None, "Ctrl-C was not honoured during backward"
    assert raised_in_the_engine(error), traceback.format_tb(error.__traceback__)
    had = [x.grad is not None for x in xs]
    assert not all(had), "the backward ran to its end before Ctrl-C came out"
    error = None
    assert thread_state_problems() == []
    # Nothing left behind: the same graph gives each leaf one more gradient.
    started.append(None)  # no alarm this time
    engine().execute([Edge(root, 0)], [np.ones(1)], False, False, True)
    for x, before in zip(xs, had):
        np.testing.assert_array_equal(x.grad, [2.0] if before else [1.0])


# -- a failed graph task's queued tasks --

# A graph task's queued tasks, dropped at once: about 0.1 s of letting go
# of them on either core.
QUEUED = 200_000 if COMPILED else 50_000


def queue_of_two_graph_tasks():
    """A ReadyQueue holding QUEUED tasks of one graph task, each with an input
    of its own, between ten of another's. Returns the queue, the two graph
    tasks, weak references to the first's inputs and the second's tasks."""
    from pyengine._core import GraphTask, NodeTask, ReadyQueue

    queue = ReadyQueue()
    failed = GraphTask(False, False, 0, queue)
    other = GraphTask(False, False, 0, queue)
    node = Sink(input_metadata=[np.ones(1)])
    inputs = []
    others = []
    for i in range(QUEUED):
        gradient = np.ones(1)
        inputs.append(weakref.ref(gradient))
        queue.push(NodeTask(failed, node, [gradient]))
        if i % (QUEUED // 10) == 0:
            others.append(NodeTask(other, node, [np.ones(1)]))
            queue.push(others[-1])
    return queue, failed, other, inputs, others


def assert_only_tasks_of(queue, graph_task, count):
    assert len(queue) == count
    for _ in range(count):
        assert queue.pop().graph_task is graph_task


def discard_measured():
    """The counter thread's measure (``longest_stall_while``) of one discard
    of QUEUED tasks, checked."""
    queue, failed, other, inputs, others = queue_of_two_graph_tasks()
    dropped = []
    measure = longest_stall_while(lambda: dropped.append(queue.discard_graph_task(failed)))
    assert dropped == [QUEUED]
    assert all(ref() is None for ref in inputs)
    assert_only_tasks_of(queue, other, len(others))
    return measure


def test_other_threads_run_while_a_failed_graph_task_drops_its_tasks():
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        # A stall of the OS's own can make one try fail: the best of three.
        tries = [discard_measured() for _ in range(3)]
    finally:
        sys.setswitchinterval(interval)
    stall, elapsed = min(tries)
    # Letting go of them in one C step stalled the counter for all of it.
    assert elapsed > 0.01, tries
    assert stall < elapsed / 4, tries


def interrupted_by_alarm(work, delay=None):
    """Run ``work()`` while a SIGALRM raises KeyboardInterrupt, as Ctrl-C
    would: one set ``delay`` seconds ahead here, or by ``work`` itself.
    Returns the KeyboardInterrupt where it came out of ``work``; None where
    ``work`` ended first (the alarm is then awaited, up to a second)."""
    fired = []

    def handler(signum, frame):
        fired.append(True)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, handler)
    ended = False
    try:
        with signals_not_swallowed():
            try:
                if delay is not None:
                    signal.setitimer(signal.ITIMER_REAL, delay)
                work()
                ended = True
                deadline = time.monotonic() + 1.0
                while not fired and time.monotonic() < deadline:
                    pass
            except KeyboardInterrupt as error:
                return None if ended else error
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return None


def raised_in(error, function):
    """Whether ``error`` came out through a function named ``function``."""
    # The compiled core's frames are named with their module.
    return error is not None and any(frame.name.rsplit(".", 1)[-1] == function
                                     for frame in traceback.extract_tb(error.__traceback__))


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_ctrl_c_while_a_failed_graph_task_drops_its_tasks():
    # How long a discard takes here; the alarm comes at fractions of that
    # until it comes while the tasks are let go of (it may come before,
    # while they are looked for, or after, on a busy machine).
    queue, failed, other, inputs, others = queue_of_two_graph_tasks()
    begin = time.perf_counter()
    queue.discard_graph_task(failed)
    duration = time.perf_counter() - begin
    landed = []
    for fraction in (0.6, 0.8, 0.4, 0.9, 0.2):
        queue, failed, other, inputs, others = queue_of_two_graph_tasks()
        error = interrupted_by_alarm(functools.partial(queue.discard_graph_task, failed),
                                     duration * fraction)
        if not raised_in(error, "release_dropped_tasks"):
            landed.append(None if error is None else traceback.format_tb(error.__traceback__))
            continue
        # It came out once every task was let go of, though its traceback
        # holds the discard's frames.
        assert all(ref() is None for ref in inputs)
        assert_only_tasks_of(queue, other, len(others))
        # Nothing of the failed graph task is left to drop.
        assert queue.discard_graph_task(failed) == 0
        return
    pytest.fail(f"the alarm never came while the tasks were let go of: {landed}")


def raising_discard(monkeypatch):
    """The twin's discards raise KeyboardInterrupt, as one whose letting go
    of its tasks a Ctrl-C interrupted; returns the graph tasks they were
    called for."""
    from pyengine._pure.ready_queue import ReadyQueue

    called = []

    def discard_graph_task(self, graph_task):
        called.append(graph_task)
        raise KeyboardInterrupt

    monkeypatch.setattr(ReadyQueue, "discard_graph_task", discard_graph_task)
    return called


def twin_graph_tasks(n):
    from pyengine._pure.graph_task import GraphTask
    from pyengine._pure.ready_queue import ReadyQueue

    return [GraphTask(False, False, 1, ReadyQueue()) for _ in range(n)]


# The compiled core's loops are cdef functions, or take their graph tasks
# from a C++ queue: twin only.
@pytest.mark.skipif(COMPILED, reason="the compiled loops are cdef")
def test_an_interrupted_hand_off_fails_every_driven_graph_task_though_a_discard_raises(
        monkeypatch):
    from pyengine._pure.engine import fail_driven_graph_tasks

    graph_tasks = twin_graph_tasks(3)
    called = raising_discard(monkeypatch)
    worker = types.SimpleNamespace(handoff_interrupted=False, driven_graph_tasks=list(graph_tasks))
    error = RuntimeError("the hand-off's interrupt")
    with pytest.raises(KeyboardInterrupt):
        fail_driven_graph_tasks(worker, error)
    assert called == graph_tasks[:1]
    assert worker.handoff_interrupted
    assert all(g.future_completed_ and g.exception_ is error for g in graph_tasks)


@pytest.mark.skipif(COMPILED, reason="the compiled pool's queue of graph tasks is C++")
def test_stopping_the_pool_fails_every_orphan_though_a_discard_raises(monkeypatch):
    from pyengine._pure import thread_pool

    graph_tasks = twin_graph_tasks(3)
    called = raising_discard(monkeypatch)
    pool = thread_pool._ThreadPoolShared()
    pool.graph_tasks.extend(graph_tasks)  # handed off, taken by no thread yet
    with pytest.raises(KeyboardInterrupt):
        thread_pool.stop_thread_pool(pool)
    # Every orphan's discard ran, and each one failed with the pool's error.
    assert called == graph_tasks
    for graph_task in graph_tasks:
        assert graph_task.future_completed_
        assert "stopped" in str(graph_task.exception_), graph_task.exception_
    assert pool.graph_tasks == []


# -- a failed graph task's gradients: waiting in not_ready, or captured --


class Distinct(Node):
    """A gradient of its own (ones) to each of its next edges, each noted
    weakly in ``sent``."""

    sent: list

    def apply(self, grads):
        gradients = [np.ones(1) for _ in self.next_edges]
        self.sent.extend(weakref.ref(gradient) for gradient in gradients)
        return gradients


class AlarmThenRaise(Node):
    """Starts a SIGALRM (``delay`` seconds) that raises KeyboardInterrupt, then
    raises ValueError."""

    delay: float = 0.0

    def apply(self, grads):
        if self.delay:
            signal.setitimer(signal.ITIMER_REAL, self.delay)
        raise ValueError("fails the graph task")


def half_filled_pairs():
    """A root whose gradients go to input 0 of WIDTH two-input nodes and to a
    node that raises before input 1 of each could come (from a node after
    it): the failed task's not_ready holds WIDTH buffers."""
    pairs = [Sink(input_metadata=[np.ones(1), np.ones(1)]) for _ in range(WIDTH)]
    second = Split(next_edges=[Edge(pair, 1) for pair in pairs], input_metadata=[np.ones(1)])
    raiser = AlarmThenRaise(next_edges=[Edge(second, 0)], input_metadata=[np.ones(1)])
    root = Distinct(next_edges=[Edge(pair, 0) for pair in pairs] + [Edge(raiser, 0)],
                    input_metadata=[np.ones(1)])
    return root, raiser, lambda: engine().execute([Edge(root, 0)], [np.ones(1)], False, False,
                                                  True)


def captured_leaves():
    """``grad()`` of WIDTH leaves, whose gradients are all captured before a
    node on the path to the first raises: the failed task holds WIDTH
    captured gradients."""
    xs = leaves(WIDTH)
    edges = [pyengine.gradient_edge(x) for x in xs]
    raiser = AlarmThenRaise(next_edges=edges[:1], input_metadata=[np.ones(1)])
    root = Distinct(next_edges=edges + [Edge(raiser, 0)], input_metadata=[np.ones(1)])
    return root, raiser, lambda: engine().execute([Edge(root, 0)], [np.ones(1)], False, False,
                                                  False, outputs=edges)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
@pytest.mark.parametrize("build", [half_filled_pairs, captured_leaves])
def test_ctrl_c_while_a_failed_graph_tasks_gradients_are_let_go_of(build):
    root, raiser, run = build()

    def backward():
        with pytest.raises(ValueError, match="fails the graph task"):
            run()

    landed = []
    # The alarm may come before the gradients are let go of (in the twin's
    # Python code between) or after (on a busy machine): a few delays.
    for delay in (0.002, 0.001, 0.0005, 0.0002, 0.0001, 0.004, 0.008):
        root.sent = []
        raiser.delay = delay
        error = interrupted_by_alarm(backward)
        if not raised_in(error, "release_leftovers"):
            landed.append(None if error is None else traceback.format_tb(error.__traceback__))
            continue
        # It came out once every gradient was let go of (the root's are the
        # only references), though its traceback holds execute's frame.
        assert len(root.sent) == WIDTH + 1
        assert all(ref() is None for ref in root.sent)
        error = None
        assert thread_state_problems() == []
        # The engine works on: the same graph fails as before, with no alarm.
        raiser.delay = 0.0
        backward()
        return
    pytest.fail(f"the alarm never came while the gradients were let go of: {landed}")
