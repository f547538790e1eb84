"""ReadyQueue: pop order against a sorted reference, blocking pop, len/empty,
discard_graph_task. See Note [Ready queue order].

The reference model keeps every queued task with the key
``(class, -reentrant_depth, -sequence_nr, push counter)`` where class is 0 for
shutdown, 1 for an empty wake-up task, 2 for a node task, and pops the
smallest: shutdown first, then wake-ups, then the deeper reentrant task, then
the higher sequence number, first in first out among equals.
"""

import faulthandler
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyengine
from pyengine._core import (
    ACCUMULATE_GRAD_SEQUENCE_NR,
    GraphTask,
    InputBuffer,
    NodeTask,
    ReadyQueue,
    set_sequence_nr,
)

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

# Sequence numbers with ties and the extremes of the unsigned 64-bit range.
SEQUENCE_NRS = (0, 1, 2, 2, 7, 2**31, 2**63 - 1, 2**63, 2**64 - 2, ACCUMULATE_GRAD_SEQUENCE_NR)
DEPTHS = (0, 0, 1, 2, 3, 1000)


class Leaf:
    def __init__(self):
        self.data = np.zeros(2)
        self.grad = None
        self.grad_fn = None
        self.requires_grad = True


class Dummy(pyengine.Node):
    def apply(self, grads):  # pragma: no cover - never run
        raise AssertionError("a ReadyQueue test node ran")


def _node(sequence_nr):
    node = Dummy()
    set_sequence_nr(node, sequence_nr)
    return node


def _graph_task(depth, queue=None):
    return GraphTask(False, False, depth, queue)


class Model:
    """The reference: a list of (key, expected) sorted on pop."""

    def __init__(self):
        self.entries = []
        self.counter = 0

    def push(self, kind, expected, depth=0, sequence_nr=0):
        key = {"shutdown": (0, 0, 0), "wakeup": (1, 0, 0),
               "node": (2, -depth, -sequence_nr)}[kind] + (self.counter,)
        self.counter += 1
        self.entries.append((key, expected))

    def pop(self):
        self.entries.sort(key=lambda entry: entry[0])
        return self.entries.pop(0)[1]

    def discard(self, graph_task):
        kept = [entry for entry in self.entries if entry[1][1] is not graph_task]
        dropped = len(self.entries) - len(kept)
        self.entries = kept
        return dropped

    def __len__(self):
        return len(self.entries)


class World:
    """Queue, model, and the objects tasks are made of."""

    def __init__(self):
        self.queue = ReadyQueue()
        self.model = Model()
        self.graph_tasks = [_graph_task(depth, self.queue) for depth in DEPTHS]
        self.nodes = [_node(sequence_nr) for sequence_nr in SEQUENCE_NRS]

    def push(self, op):
        kind = op[0]
        if kind == "node":
            graph_task, node = self.graph_tasks[op[1]], self.nodes[op[2]]
            inputs = InputBuffer(0)
            self.queue.push(NodeTask(graph_task, node, inputs))
            self.model.push("node", ("node", graph_task, node, inputs),
                            graph_task.reentrant_depth, SEQUENCE_NRS[op[2]])
        elif kind == "wakeup":
            graph_task = self.graph_tasks[op[1]]
            self.queue.push(NodeTask(graph_task, None, None))
            self.model.push("wakeup", ("wakeup", graph_task, None, None))
        else:
            self.queue.push_shutdown()
            self.model.push("shutdown", ("shutdown", None, None, None))

    def pop_and_check(self):
        expected = self.model.pop()
        task = self.queue.pop()
        assert describe(task) == describe_expected(expected)


def describe(task):
    if task.is_shutdown:
        return ("shutdown",)
    if task.node is None:
        return ("wakeup", id(task.graph_task))
    return ("node", id(task.graph_task), id(task.node), id(task.inputs))


def describe_expected(expected):
    kind, graph_task, node, inputs = expected
    if kind == "shutdown":
        return ("shutdown",)
    if kind == "wakeup":
        return ("wakeup", id(graph_task))
    return ("node", id(graph_task), id(node), id(inputs))


PUSH = st.one_of(
    st.tuples(st.just("node"), st.integers(0, len(DEPTHS) - 1),
              st.integers(0, len(SEQUENCE_NRS) - 1)),
    st.tuples(st.just("node"), st.integers(0, len(DEPTHS) - 1),
              st.integers(0, len(SEQUENCE_NRS) - 1)),
    st.tuples(st.just("wakeup"), st.integers(0, len(DEPTHS) - 1)),
    st.just(("shutdown",)),
)
OPS = st.lists(st.one_of(PUSH, PUSH, st.just(("pop",))), max_size=60)


def test_nodetask_reads_depth_and_sequence_nr():
    queue = ReadyQueue()
    graph_task = _graph_task(7, queue)
    node = _node(12345)
    inputs = InputBuffer(1)
    task = NodeTask(graph_task, node, inputs)
    assert task.graph_task is graph_task and task.node is node and task.inputs is inputs
    assert not task.is_shutdown
    assert task.reentrant_depth == 7
    assert task.sequence_nr == 12345
    assert NodeTask.shutdown().is_shutdown


@SETTINGS
@given(st.lists(PUSH, max_size=60))
def test_pops_in_reference_order(pushes):
    world = World()
    for op in pushes:
        world.push(op)
    assert len(world.queue) == len(pushes)
    while len(world.model):
        world.pop_and_check()
    assert len(world.queue) == 0 and world.queue.empty()


@SETTINGS
@given(OPS)
def test_interleaved_pushes_and_pops_follow_the_reference(ops):
    world = World()
    for op in ops:
        if op[0] == "pop":
            if len(world.model):
                world.pop_and_check()
        else:
            world.push(op)
        assert len(world.queue) == len(world.model)
        assert world.queue.empty() == (len(world.model) == 0)
    while len(world.model):
        world.pop_and_check()
    assert world.queue.empty()


@SETTINGS
@given(st.lists(PUSH, max_size=50), st.integers(0, len(DEPTHS) - 1))
def test_discard_graph_task_drops_exactly_its_tasks(pushes, victim):
    world = World()
    for op in pushes:
        world.push(op)
    graph_task = world.graph_tasks[victim]
    dropped = world.queue.discard_graph_task(graph_task)
    assert dropped == world.model.discard(graph_task)
    assert len(world.queue) == len(world.model)
    # The remaining tasks keep their order, FIFO ties included.
    while len(world.model):
        world.pop_and_check()
    assert world.queue.empty()
    # The queue still works.
    assert world.queue.discard_graph_task(graph_task) == 0
    world.push(("node", victim, 0))
    world.model.pop()
    task = world.queue.pop()
    assert task.graph_task is graph_task


def test_fifo_among_equal_tasks_of_one_node():
    queue = ReadyQueue()
    graph_task = _graph_task(0, queue)
    node = _node(5)
    buffers = [InputBuffer(0) for _ in range(50)]
    for buffer in buffers:
        queue.push(NodeTask(graph_task, node, buffer))
    assert [queue.pop().inputs for _ in buffers] == buffers


def test_fifo_among_wakeups_and_distinct_nodes_with_equal_keys():
    queue = ReadyQueue()
    graph_tasks = [_graph_task(2, queue) for _ in range(4)]
    nodes = [_node(9) for _ in range(4)]
    for graph_task, node in zip(graph_tasks, nodes):
        queue.push(NodeTask(graph_task, node, InputBuffer(0)))
    for graph_task in reversed(graph_tasks):
        queue.push(NodeTask(graph_task, None, None))
    woken = [queue.pop().graph_task for _ in graph_tasks]
    assert woken == list(reversed(graph_tasks))
    assert [queue.pop().node for _ in nodes] == nodes


def test_accumulate_grad_sorts_before_other_nodes_at_equal_depth():
    queue = ReadyQueue()
    graph_task = _graph_task(0, queue)
    leaf = pyengine.AccumulateGrad(Leaf())
    assert leaf.sequence_nr == ACCUMULATE_GRAD_SEQUENCE_NR
    later = [_node(2**64 - 2), _node(3)]
    for node in later + [leaf]:
        queue.push(NodeTask(graph_task, node, InputBuffer(0)))
    assert [queue.pop().node for _ in range(3)] == [leaf] + later
    # ...but a deeper reentrant task comes first.
    deeper = _graph_task(1, queue)
    queue.push(NodeTask(graph_task, leaf, InputBuffer(0)))
    queue.push(NodeTask(deeper, _node(0), InputBuffer(0)))
    assert queue.pop().graph_task is deeper
    assert queue.pop().node is leaf


def test_push_counts_node_tasks_as_outstanding():
    queue = ReadyQueue()
    graph_task = _graph_task(0, queue)
    node = _node(1)
    assert graph_task.outstanding_tasks == 0
    queue.push(NodeTask(graph_task, node, InputBuffer(0)))
    queue.push(NodeTask(graph_task, node, InputBuffer(0)))
    assert graph_task.outstanding_tasks == 2
    queue.push(NodeTask(graph_task, node, InputBuffer(0)), increment_outstanding_tasks=False)
    queue.push(NodeTask(graph_task, None, None))
    queue.push_shutdown()
    assert graph_task.outstanding_tasks == 2
    assert len(queue) == 5


@pytest.fixture
def watchdog():
    """Turn a deadlock (a pop that holds the GIL while it waits) into a crash
    with tracebacks instead of a hung test run."""
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_pop_blocks_until_another_thread_pushes(watchdog):
    queue = ReadyQueue()
    graph_task = _graph_task(0, queue)
    node = _node(4)
    inputs = InputBuffer(0)
    got = []
    started = threading.Event()

    def consumer():
        started.set()
        got.append(queue.pop())

    thread = threading.Thread(target=consumer, daemon=True)
    thread.start()
    assert started.wait(10)
    # While the consumer waits this thread must run on (the wait must not hold
    # the GIL; if it did, the watchdog ends the run).
    time.sleep(0.2)
    assert thread.is_alive() and got == [], "pop returned from an empty queue"
    queue.push(NodeTask(graph_task, node, inputs))
    thread.join(10)
    assert not thread.is_alive(), "pop did not wake up after a push"
    assert len(got) == 1 and got[0].node is node and got[0].inputs is inputs
    assert queue.empty()


def test_each_blocked_consumer_gets_one_task(watchdog):
    queue = ReadyQueue()
    graph_task = _graph_task(0, queue)
    n = 6
    got = []
    lock = threading.Lock()

    def consumer():
        task = queue.pop()
        with lock:
            got.append(task)

    threads = [threading.Thread(target=consumer, daemon=True) for _ in range(n)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    assert got == []
    buffers = [InputBuffer(0) for _ in range(n)]
    for i, buffer in enumerate(buffers):
        queue.push(NodeTask(graph_task, _node(i), buffer))
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    assert sorted(id(task.inputs) for task in got) == sorted(id(b) for b in buffers)
    assert queue.empty()


def test_shutdown_wakes_a_blocked_consumer(watchdog):
    queue = ReadyQueue()
    got = []
    thread = threading.Thread(target=lambda: got.append(queue.pop()), daemon=True)
    thread.start()
    time.sleep(0.05)
    queue.push_shutdown()
    thread.join(10)
    assert not thread.is_alive() and got[0].is_shutdown
