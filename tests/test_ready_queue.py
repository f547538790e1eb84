"""ReadyQueue: pop order, blocking pop, len/empty, discard_graph_task. See
Note [Ready queue order] and Note [Ties in the ready queue].

Oracles for the order:

- the comparator's rank, ``(class, -reentrant_depth, -sequence_nr)`` with
  class 0 for shutdown, 1 for an empty wake-up task and 2 for a node task:
  no task pops while a task of a smaller rank is queued. It leaves ties
  open.
- ``std::priority_queue`` itself: ``tests/std_priority_queue.cpp``, built at
  test time where a C++ compiler with libstdc++ is found (as PyTorch's
  Linux wheels are), pops ties as PyTorch does; both cores must pop in
  exactly its order.
- hand-worked examples of libstdc++'s algorithms, for where it is not.
- the compiled and pure queues pop alike (where both are importable).

The order of leaf hooks is checked against PyTorch itself in
``tests/frontend``.
"""

import _thread
import faulthandler
import importlib
import os
import re
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
from conftest import signals_not_swallowed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyengine
from pyengine._core import (
    ACCUMULATE_GRAD_SEQUENCE_NR,
    GraphTask,
    InputBuffer,
    NodeTask,
    ReadyQueue,
    ready_queue_module,
    set_sequence_nr,
)

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

# Sequence numbers with ties and the extremes of the unsigned 64-bit range.
SEQUENCE_NRS = (0, 1, 2, 2, 7, 2**31, 2**63 - 1, 2**63, 2**64 - 2, ACCUMULATE_GRAD_SEQUENCE_NR)
DEPTHS = (0, 0, 1, 2, 3, 1000)
SHUTDOWN_GROUP = -1


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
    # A CPU queue of its own by default: a queue refuses a task whose graph
    # task has none (See Note [A task pushed from Python is checked]).
    return GraphTask(False, False, depth, ReadyQueue() if queue is None else queue)


def _other_core_objects(module):
    """Graph tasks of DEPTHS and nodes of SEQUENCE_NRS made by the core that
    ``module`` (a ready queue module) belongs to."""
    package = module.__name__.rsplit(".", 1)[0]
    pure = package.endswith("_pure")
    node_module = importlib.import_module(package + (".node" if pure else "._node"))
    graph_task_module = importlib.import_module(package + (".graph_task" if pure else "._graph_task"))

    class OtherCoreNode(node_module.NodeBase):
        def apply(self, grads):  # pragma: no cover - never run
            raise AssertionError("a ReadyQueue test node ran")

    nodes = []
    for sequence_nr in SEQUENCE_NRS:
        node = OtherCoreNode()
        node_module._set_sequence_nr(node, sequence_nr)
        nodes.append(node)
    graph_tasks = [graph_task_module.GraphTask(False, False, depth, module.ReadyQueue())
                   for depth in DEPTHS]
    return graph_tasks, nodes


class World:
    """A ReadyQueue of ``module`` (the core under test by default), the
    objects its tasks are made of, and what is queued.

    A queue never reads a task's ``inputs`` but for its type (a list, in a
    task with a node: See Note [A task pushed from Python is checked]): each
    task carries its push number there, in a list, to be told apart when it
    pops. Graph tasks are
    numbered by their index in DEPTHS (their "group").
    """

    def __init__(self, module=ready_queue_module):
        self.module = module
        self.queue = module.ReadyQueue()
        if module is ready_queue_module:
            self.graph_tasks = [_graph_task(depth) for depth in DEPTHS]
            self.nodes = [_node(sequence_nr) for sequence_nr in SEQUENCE_NRS]
        else:
            # The other core's queue runs only its own core's tasks (See Note
            # [A task pushed from Python is checked] in pyengine/_pure/ready_queue.py).
            self.graph_tasks, self.nodes = _other_core_objects(module)
        self.queued = {}  # push number -> (rank, group)
        self.pushes = 0
        # The same operations, for tests/std_priority_queue.cpp.
        self.oracle_ops = []

    def push(self, op, then_pop=False):
        """Push the task ``op`` describes; with ``then_pop``, pop at once in
        the same step (``ReadyQueue.push_pop``, the engine's Note [The next
        task skips the queue]) and return the push number popped."""
        number = self.pushes
        self.pushes += 1
        kind = op[0]
        if kind == "shutdown":
            task = self.module.NodeTask(None, None, [number], is_shutdown=True)
            group, depth, sequence_nr, rank = SHUTDOWN_GROUP, 0, 0, (0, 0, 0)
        else:
            group = op[1]
            graph_task = self.graph_tasks[group]
            depth = graph_task.reentrant_depth
            if kind == "wakeup":
                task = self.module.NodeTask(graph_task, None, [number])
                sequence_nr, rank = 0, (1, 0, 0)
            else:
                sequence_nr = SEQUENCE_NRS[op[2]]
                task = self.module.NodeTask(graph_task, self.nodes[op[2]], [number])
                rank = (2, -depth, -sequence_nr)
        self.queued[number] = (rank, group)
        self.oracle_ops.append(f"push {number} {group} {int(kind == 'shutdown')} "
                               f"{int(kind == 'node')} {depth} {sequence_nr}")
        if not then_pop:
            self.queue.push(task, increment_outstanding_tasks=False)
            return None
        was_empty = len(self.queue) == 0
        popped_task = self.queue.push_pop(task, increment_outstanding_tasks=False)
        if was_empty:
            assert popped_task is task, "push_pop on an empty queue returns its own task"
        return self._popped(popped_task.inputs[0])

    def pop(self):
        """Pop a task, check it against the comparator, return its push number."""
        return self._popped(self.queue.pop().inputs[0])

    def _popped(self, number):
        rank, _ = self.queued.pop(number)
        assert all(rank <= other for other, _ in self.queued.values()), \
            "a task popped while one that runs strictly before it was queued"
        self.oracle_ops.append("pop")
        return number

    def discard(self, group):
        dropped = self.queue.discard_graph_task(self.graph_tasks[group])
        victims = [number for number, (_, g) in self.queued.items() if g == group]
        assert dropped == len(victims)
        for number in victims:
            del self.queued[number]
        self.oracle_ops.append(f"discard {group}")

    def run(self, ops):
        """Apply ``ops``, then pop until empty; return the push numbers in the
        order they popped."""
        popped = []
        for op in ops:
            if op[0] == "pop":
                if self.queued:
                    popped.append(self.pop())
            elif op[0] == "push_pop":
                popped.append(self.push(op[1], then_pop=True))
            elif op[0] == "discard":
                self.discard(op[1])
            else:
                self.push(op)
            assert len(self.queue) == len(self.queued)
            assert self.queue.empty() == (not self.queued)
        while self.queued:
            popped.append(self.pop())
        assert len(self.queue) == 0 and self.queue.empty()
        return popped


GROUP = st.integers(0, len(DEPTHS) - 1)
NODE_PUSH = st.tuples(st.just("node"), GROUP, st.integers(0, len(SEQUENCE_NRS) - 1))
PUSH = st.one_of(NODE_PUSH, NODE_PUSH, st.tuples(st.just("wakeup"), GROUP),
                 st.just(("shutdown",)))
OPS = st.lists(st.one_of(PUSH, PUSH, PUSH, st.just(("pop",)), st.tuples(st.just("discard"), GROUP),
                         st.tuples(st.just("push_pop"), PUSH)),
               max_size=60)


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
def test_pushes_then_pops_respect_the_comparator(pushes):
    World().run(pushes)


@SETTINGS
@given(OPS)
def test_interleaved_pushes_pops_and_discards_respect_the_comparator(ops):
    World().run(ops)


@SETTINGS
@given(st.lists(PUSH, max_size=50), GROUP)
def test_discard_graph_task_drops_exactly_its_tasks(pushes, victim):
    world = World()
    for op in pushes:
        world.push(op)
    world.discard(victim)
    assert len(world.queue) == len(world.queued)
    assert world.queue.discard_graph_task(world.graph_tasks[victim]) == 0
    world.run([])
    # The queue still works.
    world.push(("node", victim, 0))
    assert world.queue.pop().graph_task is world.graph_tasks[victim]


@pytest.fixture(scope="module")
def std_priority_queue(tmp_path_factory):
    """Build tests/std_priority_queue.cpp; return a function that runs it on a
    list of cases (lists of operations) and returns, per case, the push
    numbers in the order they popped. Skips where there is no C++ compiler,
    or where its standard library is not libstdc++ (not PyTorch's on Linux)."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the std::priority_queue oracle")
    source = os.path.join(os.path.dirname(__file__), "std_priority_queue.cpp")
    program = str(tmp_path_factory.mktemp("oracle") / "std_priority_queue")
    build = subprocess.run([compiler, "-std=c++11", "-O1", "-o", program, source],
                           capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"the std::priority_queue oracle did not build:\n{build.stderr}")

    def run(cases):
        lines = subprocess.run([program], input="".join(" ".join(ops) + "\n" for ops in cases),
                               capture_output=True, text=True, check=True).stdout.splitlines()
        if lines[0] != "libstdc++":
            pytest.skip("the C++ compiler's standard library is not libstdc++, PyTorch's on Linux")
        return [[int(number) for number in line.split()] for line in lines[1:]]

    return run


@SETTINGS
@given(OPS)
def test_pops_as_std_priority_queue(std_priority_queue, ops):
    world = World()
    popped = world.run(ops)
    assert popped == std_priority_queue([world.oracle_ops])[0]


@SETTINGS
@given(OPS)
def test_compiled_and_pure_queues_pop_alike(ops):
    compiled = pytest.importorskip("pyengine._ready_queue")
    pure = importlib.import_module("pyengine._pure.ready_queue")
    assert World(compiled).run(ops) == World(pure).run(ops)


# Hand-worked examples of libstdc++'s algorithms (See Note [Ties in the ready
# queue]), for where the std::priority_queue oracle cannot be built. "t" is a
# task that ties with the other t's; heaps are written as arrays. The same
# cases also run against std::priority_queue where it can be built.


def _ties(count, group=0):
    return [("node", group, 4)] * count  # sequence_nr 7


HAND_WORKED = [
    pytest.param(
        # stack([x0, x1, x2, x3]).sum().backward() makes its four
        # AccumulateGrad tasks ready at once (PyTorch fires their hooks 0, 2, 1, 3).
        # Pushes: no tie moves up (compare(parent, t) is false): [t0 t1 t2 t3].
        # Pop t0: t3 leaves the back, len 3; the hole goes from the root to
        #   the right child t2 (compare(t2, t1) is false), so [t2 t1 _]; t3
        #   fills the hole (compare(t2, t3) is false): [t2 t1 t3].
        # Pop t2: t3 leaves, len 2 (even: the root's lone left child t1
        #   moves up): [t1 _]; t3 fills the hole: [t1 t3]. Pop t1, pop t3.
        _ties(4), [0, 2, 1, 3], id="four-ties"),
    pytest.param(
        # Three ties, then x (a higher sequence_nr) moves up past t1 and t0:
        # [x t0 t2 t1]. Pop x: t1 leaves, len 3; the hole goes right (to t2):
        # [t2 t0 _], t1 fills it: [t2 t0 t1]. Pop t2: t1 leaves, len 2; t0
        # moves up: [t0 t1]. Pop t0, pop t1.
        _ties(3) + [("node", 0, 9)], [3, 2, 0, 1], id="a-higher-task-reorders-ties"),
    pytest.param(
        # Six ties, from graph tasks 0 (t0 t2 t4) and 1 (t1 t3 t5), both of
        # depth 0: [t0 t1 t2 t3 t4 t5].
        # Discarding graph task 1 keeps [t0 t2 t4]; make_heap adjusts its one
        # parent, index 0: t0 leaves, the hole goes right (to t4): [t4 t2 _],
        # t0 fills it: [t4 t2 t0]. Pop t4: t0 leaves, len 2; t2 moves up:
        # [t2 t0]. Pop t2, pop t0: last in, first out.
        [op for pair in zip(_ties(3, group=0), _ties(3, group=1)) for op in pair]
        + [("discard", 1)], [4, 2, 0], id="discard-rebuilds-with-make-heap"),
    pytest.param(
        # compare(s, s') is true for any two shutdown tasks, so each pushed one
        # moves up to the root: [s0], [s1 s0], [s2 s0 s1]. Pop s2: s1 leaves,
        # len 2; s0 moves up: [s0 _]; s1 moves up past it (compare(s0, s1)):
        # [s1 s0]. Pop s1, pop s0.
        [("shutdown",)] * 3, [2, 1, 0], id="shutdowns-last-in-first-out"),
    pytest.param(
        # push_pop is a push and a pop in one step: [t0 t1], push t2 (no
        # move): [t0 t1 t2]; pop t0: t2 leaves, len 2; t1 moves up, t2 fills
        # the hole: [t1 t2]. Pop t1, pop t2.
        _ties(2) + [("push_pop", ("node", 0, 4))], [0, 1, 2], id="push-pop-among-ties"),
    pytest.param(
        # On an empty queue push_pop hands back its own task; then x (a
        # higher sequence_nr) pushed into [t1] pops first.
        [("push_pop", ("node", 0, 4)), ("node", 0, 4), ("push_pop", ("node", 0, 9))], [0, 2, 1],
        id="push-pop-empty-then-higher"),
]


@pytest.mark.parametrize("ops, expected", HAND_WORKED)
def test_hand_worked_examples(ops, expected):
    assert World().run(ops) == expected


@pytest.mark.parametrize("ops, expected", HAND_WORKED)
def test_hand_worked_examples_are_what_std_priority_queue_gives(std_priority_queue, ops,
                                                               expected):
    world = World()
    world.run(ops)
    assert std_priority_queue([world.oracle_ops]) == [expected]


def test_accumulate_grad_sorts_before_other_nodes_at_equal_depth():
    queue = ReadyQueue()
    graph_task = _graph_task(0, queue)
    leaf = pyengine.AccumulateGrad(Leaf())
    assert leaf.sequence_nr == ACCUMULATE_GRAD_SEQUENCE_NR
    later = [_node(2**64 - 2), _node(3)]
    for node in later + [leaf]:
        queue.push(NodeTask(graph_task, node, []))
    assert [queue.pop().node for _ in range(3)] == [leaf] + later
    # ...but a deeper reentrant task comes first.
    deeper = _graph_task(1, queue)
    queue.push(NodeTask(graph_task, leaf, []))
    queue.push(NodeTask(deeper, _node(0), []))
    assert queue.pop().graph_task is deeper
    assert queue.pop().node is leaf


def test_push_counts_node_tasks_as_outstanding():
    queue = ReadyQueue()
    graph_task = _graph_task(0, queue)
    node = _node(1)
    assert graph_task.outstanding_tasks == 0
    queue.push(NodeTask(graph_task, node, []))
    queue.push(NodeTask(graph_task, node, []))
    assert graph_task.outstanding_tasks == 2
    queue.push(NodeTask(graph_task, node, []), increment_outstanding_tasks=False)
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
    inputs = []
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
    buffers = [[] for _ in range(n)]
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


def test_wake_pops_as_one_wake_up_task_in_its_place(watchdog):
    # wake() stands in for a wake-up task that no memory was left to queue
    # (See Note [C++ allocations that fail] in pyengine/_engine.pyx): it
    # pops after any shutdown and before any node task, as CompareNodeTaskTime
    # orders an empty wake-up task, however many calls came before it.
    queue = ReadyQueue()
    graph_task = _graph_task(0, queue)
    node = _node(3)
    queue.push(NodeTask(graph_task, node, [1]))
    queue.wake()
    queue.wake()
    queue.push_shutdown()
    assert len(queue) == 3
    popped = [queue.pop() for _ in range(3)]
    assert [(task.is_shutdown, task.node is None, task.graph_task) for task in popped[:2]] == [
        (True, True, None), (False, True, None)]
    assert popped[2].node is node and popped[2].inputs == [1]
    assert queue.empty()
    # push_pop gives the pending wake-up and queues its task, as a push and
    # then a pop would.
    queue.wake()
    task = NodeTask(graph_task, node, [2])
    got = queue.push_pop(task, increment_outstanding_tasks=False)
    assert got.node is None and not got.is_shutdown
    assert len(queue) == 1 and queue.pop().inputs == [2]
    # And it wakes a thread that waits in pop.
    woken = []
    thread = threading.Thread(target=lambda: woken.append(queue.pop()), daemon=True)
    thread.start()
    time.sleep(0.05)
    assert woken == []
    queue.wake()
    thread.join(10)
    assert not thread.is_alive() and woken[0].node is None and not woken[0].is_shutdown
    assert queue.empty()


# wait_for_task: how a device worker idles without its engine (See Note [An
# engine's threads hold it weakly] in pyengine/_shared/engine_registry.py).


def test_wait_for_task_pops_nothing_and_says_whether_a_task_is_queued(watchdog):
    queue = ReadyQueue()
    started = time.monotonic()
    assert queue.wait_for_task(0.05) is False
    assert time.monotonic() - started >= 0.04, "returned before its timeout with nothing queued"
    assert queue.wait_for_task(0) is False
    queue.push_shutdown()
    assert queue.wait_for_task(0) is True and queue.wait_for_task(30) is True
    assert len(queue) == 1 and queue.pop().is_shutdown
    queue.wake()
    assert queue.wait_for_task(0) is True and len(queue) == 1


def test_wait_for_task_wakes_when_another_thread_pushes(watchdog):
    queue = ReadyQueue()
    graph_task = _graph_task(0, queue)
    got = []
    thread = threading.Thread(target=lambda: got.append(queue.wait_for_task(30, False)),
                              daemon=True)
    thread.start()
    time.sleep(0.05)
    assert got == []
    queue.push(NodeTask(graph_task, _node(1), []))
    thread.join(10)
    assert not thread.is_alive() and got == [True]
    assert len(queue) == 1


def test_wait_for_task_passes_a_push_on_to_a_thread_waiting_in_pop(watchdog):
    # A push wakes one waiter. Where a thread waits in pop beside one in
    # wait_for_task, which pops nothing, a wake-up that only reached the
    # latter would leave the task to a pop that sleeps for good. Each round
    # gives either the wake-up: the pop must get the task either way.
    queue = ReadyQueue()
    graph_task = _graph_task(0, queue)
    for round_ in range(20):
        popped, seen = [], []
        popper = threading.Thread(target=lambda out=popped: out.append(queue.pop(False)),
                                  daemon=True)
        waiter = threading.Thread(
            target=lambda out=seen: out.append(queue.wait_for_task(30, False)), daemon=True)
        # The waiter first: the twin's Condition wakes its waiters in turn.
        waiter.start()
        time.sleep(0.01)
        popper.start()
        time.sleep(0.02)
        assert popped == [] and seen == []
        node = _node(round_)
        queue.push(NodeTask(graph_task, node, []), increment_outstanding_tasks=False)
        popper.join(10)
        assert not popper.is_alive(), f"round {round_}: the pop never got the task pushed"
        assert popped[0].node is node
        # The waiter saw the task before the pop took it, or waits on.
        queue.push_shutdown()
        waiter.join(10)
        assert not waiter.is_alive() and seen == [True]
        assert queue.pop(False).is_shutdown and queue.empty()


@pytest.mark.parametrize("timeout, error, words", [
    (-1.0, ValueError, "a wait's timeout must be a number of seconds from 0 to "
                       "threading.TIMEOUT_MAX, got -1.0"),
    (float("nan"), ValueError, "got nan"),
    (float("inf"), ValueError, "got inf"),
    (threading.TIMEOUT_MAX * 2, ValueError, "threading.TIMEOUT_MAX, got"),
    ("1", TypeError, "must be real number, not str"),
    (None, TypeError, "must be real number, not NoneType"),
])
def test_wait_for_task_refuses_a_timeout_out_of_range(timeout, error, words):
    queue = ReadyQueue()
    with pytest.raises(error, match=re.escape(words)):
        queue.wait_for_task(timeout)
    queue.push_shutdown()  # the lock is free: a push and a pop go through
    assert queue.pop().is_shutdown


def test_ctrl_c_ends_wait_for_task_on_the_main_thread(watchdog):
    queue = ReadyQueue()
    timer = threading.Timer(0.1, _thread.interrupt_main)
    started = time.monotonic()
    with signals_not_swallowed():
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            queue.wait_for_task(30)
    timer.join()
    assert time.monotonic() - started < 5, "the wait ran on after Ctrl-C"
    queue.push_shutdown()  # the lock is free after the interrupted wait
    assert queue.wait_for_task(0) and queue.pop().is_shutdown
