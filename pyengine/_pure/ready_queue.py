"""NodeTask, CompareNodeTaskTime and ReadyQueue: what runs next on one thread.

Twin of ``pyengine/_ready_queue.pyx``. The queue is a binary heap kept by
the algorithms of libstdc++, written out below, so that both cores (and
PyTorch) pop tasks that tie in CompareNodeTaskTime in the same order: See
Note [Ties in the ready queue].

Note [Ready queue order]
~~~~~~~~~~~~~~~~~~~~~~~~
A ReadyQueue pops, in this order (PyTorch's CompareNodeTaskTime):

1. shutdown tasks, so that a worker stops promptly;
2. empty wake-up tasks (no node), so that an owner blocked in ``pop`` sees
   promptly that its graph task completed elsewhere;
3. tasks of a deeper reentrant backward, so that a nested backward finishes
   before its parent's queued work (See Note [Reentrant backward]);
4. the node with the higher ``sequence_nr``: the node created later in the
   forward pass runs first, which frees its gradients early and makes the
   order deterministic; AccumulateGrad has the highest sequence number of
   all (See Note [AccumulateGrad first]);
5. among equals, the order PyTorch's binary heap gives (See Note [Ties in
   the ready queue]).

Depth and sequence number are copied into the task when it is made, so
comparing two tasks never touches a node.

Note [Ties in the ready queue]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Tasks tie when they have the same reentrant depth and sequence number; in
practice these are AccumulateGrad nodes, which all share the largest
sequence number, so ties decide the order in which leaf tensor hooks and
post-accumulate-grad hooks fire. PyTorch's ReadyQueue is a
``std::priority_queue`` with CompareNodeTaskTime and no tiebreak, so ties
pop in whatever order the standard library's binary-heap algorithms leave
them, which is not first in first out: ``stack([x0, x1, x2, x3])`` fires
the hooks of its leaves as 0, 2, 1, 3. PyTorch's Linux wheels are
built against libstdc++, so both cores run libstdc++'s algorithms
(``bits/stl_heap.h``), step for step and on every platform (libc++, for
one, pops with Floyd's method and would give another order):

- push (``push_heap``, ``__push_heap``): append the task, leaving a hole
  at the end; while the hole's parent runs after the task
  (``compare(parent, task)``), move the parent down into the hole; the task
  fills the hole.
- pop (``pop_heap``, ``__adjust_heap``): the front is the task popped. Take
  the last task out and move the hole left at the root down to a leaf,
  always to the right child unless it runs after the left one
  (``compare(right, left)``), an even length's lone left child included;
  then push the last task in from there as above, no higher than the root.
- make (``__make_heap``), which ``discard_graph_task`` uses to rebuild the
  heap (PyTorch never removes queued tasks): ``__adjust_heap`` from each
  parent in turn, the last parent first.

Each comparison is made in the same order and with the same arguments as in
libstdc++: CompareNodeTaskTime is not symmetric among equals (``compare(t,
t)`` is true for a shutdown task), and which of two equal children the hole
takes decides the order of ties. The compiled core has the same functions
in ``_node_task.h``; ``tests/test_ready_queue.py`` checks both against a
hand-worked example and against each other, and the frontend tests check
hook order against PyTorch.
"""

import threading
import time

from .._shared.messages import (
    QUEUE_FULL_MESSAGE,
    cannot_pickle_message,
    no_ready_queue_message,
    task_field_message,
    wait_timeout_message,
)
from .condition import Condition
from .node import NodeBase, _not_writable
from .static_types import as_c_double, check_argument, check_new, final

# See Note [Waits honour signals] in pyengine/_locks.pxd: the compiled
# core's WAIT_SLICE_MS, in seconds.
WAIT_SLICE = 0.020


def wait_honouring_signals(condition, on_main_thread):
    """``condition.wait()``, as the compiled core waits (See Note [Waits honour
    signals] in ``pyengine/_locks.pxd``): on the main thread, one slice of it,
    after which signal handlers run and what they raise ends the wait, with
    the condition's lock held again (``Condition.wait`` re-takes it however
    it ends), so that the ``with`` around the wait releases it."""
    if on_main_thread:
        condition.wait(WAIT_SLICE)
    else:
        condition.wait()


def is_main_thread():
    """Whether this thread runs signal handlers."""
    return threading.current_thread() is threading.main_thread()


# Note [A task pushed from Python is checked]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A NodeTask holds any objects (the queue orders tasks by the numbers copied
# into them, and its tests carry a push number in ``inputs``). But a task
# with a node is one the engine runs once popped, and the compiled engine
# reads its graph task, node and inputs as the types it made them with,
# unchecked: a task a user made and pushed (on the queue of the graph task
# ``get_current_graph_task()`` returns, say) could hand it None or a str
# in their place. So ``push`` and ``push_pop``, the queue's doors from
# Python, refuse a task with a node unless its node is a Node, its graph
# task a GraphTask and its inputs a list (TypeError naming the field), by
# the objects' types (``isinstance`` would take a ``__class__`` property's
# word), and unless that graph task has a CPU queue, through which the
# worker that runs the task wakes the task's owner (ValueError). The
# engine's own tasks enter in C, already of those types. A wake-up or
# shutdown task (no node) is not run: anything goes.


def release_dropped_tasks(tasks):
    """Let go of ``tasks``, which a queue dropped, emptying the list. See
    Note [What a failed graph task leaves is let go of in slices] in
    ``pyengine/_pure/graph_task.py``."""
    try:
        while tasks:
            tasks.pop()
    finally:
        tasks.clear()


# pyengine._pure.graph_task.GraphTask, imported on first use: that module
# imports this one.
_graph_task_type = None


def check_task_to_run(task):
    """TypeError for a task with a node whose fields the engine could not
    run: See Note [A task pushed from Python is checked]."""
    global _graph_task_type
    if task.node is None:
        return
    if _graph_task_type is None:
        from .graph_task import GraphTask
        _graph_task_type = GraphTask
    # By the objects' types, which a __class__ property cannot fake.
    if not issubclass(type(task.node), NodeBase):
        raise TypeError(task_field_message("node", "a Node", task.node))
    if not issubclass(type(task.graph_task), _graph_task_type):
        raise TypeError(task_field_message("graph_task", "a GraphTask", task.graph_task))
    if type(task.inputs) is not list:
        raise TypeError(task_field_message("inputs", "a list", task.inputs))
    if task.graph_task.cpu_ready_queue is None:
        # The worker that runs the task wakes its owner through that queue.
        raise ValueError(no_ready_queue_message())


@final
class NodeTask:
    """One unit of work: run ``node`` of ``graph_task`` on ``inputs``, the list
    of gradients its InputBuffer summed (one per input slot).

    ``node is None`` marks an empty wake-up task; ``is_shutdown`` a task that
    stops the worker popping it. Immutable after construction.
    """

    __slots__ = ("graph_task", "node", "inputs", "is_shutdown", "reentrant_depth", "sequence_nr")

    def __new__(cls, *args, **kwargs):
        # See Note [A class's __new__ called with another class] in
        # pyengine/_pure/static_types.py.
        if cls.__new__ is not NodeTask.__new__:
            check_new(NodeTask, cls)
        return object.__new__(cls)

    def __init__(self, graph_task, node, inputs, is_shutdown=False):
        # Python code cannot write the fields (AttributeError), as the
        # compiled class's readonly ones: only __init__ sets them.
        set_field = object.__setattr__
        set_field(self, "graph_task", graph_task)
        set_field(self, "node", node)
        set_field(self, "inputs", inputs)
        set_field(self, "is_shutdown", is_shutdown)
        set_field(self, "reentrant_depth",
                  graph_task.reentrant_depth if graph_task is not None else 0)
        set_field(self, "sequence_nr", node._sequence_nr if node is not None else 0)

    __setattr__ = __delattr__ = _not_writable

    @classmethod
    def shutdown(cls):
        return cls(None, None, None, is_shutdown=True)

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))


_allocate_task = object.__new__
_initialize_task = NodeTask.__init__


def make_record(graph_task, node, inputs):
    """A task the engine makes, where the compiled core makes its C record
    (``make_record``): a NodeTask built by its two steps called directly.
    ``NodeTask(...)`` would take them through CPython's slots for a class
    whose ``__new__`` and ``__init__`` are Python, two calls from C per
    task; the check in ``__new__`` is for a class Python code passes, and
    here the class is NodeTask."""
    task = _allocate_task(NodeTask)
    _initialize_task(task, graph_task, node, inputs)
    return task


def compare_node_task_time(task1, task2):
    """True when ``task1`` runs after ``task2`` (the comparator of a max-heap).

    See Note [Ready queue order]. No tiebreak, as in PyTorch: See Note [Ties
    in the ready queue].
    """
    if task2.is_shutdown:
        return True
    if task1.node is None or task1.is_shutdown:
        return False
    if task2.node is None:
        return True
    if task1.reentrant_depth == task2.reentrant_depth:
        return task1.sequence_nr < task2.sequence_nr
    return task1.reentrant_depth < task2.reentrant_depth


# The heap algorithms of libstdc++ (bits/stl_heap.h), with PyTorch's
# comparator: See Note [Ties in the ready queue]. The compiled core has the
# same functions in _node_task.h, where push_heap and pop_heap leave the
# append and the removal to their caller, as the std:: ones do, and
# heap_push and heap_pop, as here, do both.

def push_heap_hole(heap, hole, top, task):
    """libstdc++'s ``__push_heap``: move the hole up towards ``top`` while its
    parent runs after ``task``; ``task`` fills it."""
    parent = (hole - 1) // 2
    while hole > top and compare_node_task_time(heap[parent], task):
        heap[hole] = heap[parent]
        hole = parent
        parent = (hole - 1) // 2
    heap[hole] = task


def adjust_heap(heap, hole, length, task):
    """libstdc++'s ``__adjust_heap`` over ``heap[:length]``: walk the hole down
    to a leaf, always to the child that runs first, then push ``task`` in
    from there, no higher than where the hole started."""
    top = hole
    second_child = hole
    while second_child < (length - 1) // 2:
        second_child = 2 * (second_child + 1)
        if compare_node_task_time(heap[second_child], heap[second_child - 1]):
            second_child -= 1
        heap[hole] = heap[second_child]
        hole = second_child
    # An even length leaves one parent with a left child only.
    if length % 2 == 0 and second_child == (length - 2) // 2:
        second_child = 2 * (second_child + 1)
        heap[hole] = heap[second_child - 1]
        hole = second_child - 1
    push_heap_hole(heap, hole, top, task)


def heap_push(heap, task):
    """``heap.append(task)`` and ``std::push_heap``."""
    heap.append(task)
    push_heap_hole(heap, len(heap) - 1, 0, task)


def heap_pop(heap):
    """``std::pop_heap`` and ``heap.pop()``: remove and return the front."""
    last = heap.pop()
    if not heap:
        return last
    front = heap[0]
    adjust_heap(heap, 0, len(heap), last)
    return front


def make_heap(heap):
    """``std::make_heap`` (libstdc++'s ``__make_heap``)."""
    length = len(heap)
    if length < 2:
        return
    for parent in range((length - 2) // 2, -1, -1):
        adjust_heap(heap, parent, length, heap[parent])


@final
class ReadyQueue:
    """A priority queue of NodeTasks under a lock and a condition variable.

    ``_heap`` is guarded by ``_not_empty``'s lock, and so are ``_woken``
    and ``_shutdown_pending``, a wake-up task and a shutdown task that the
    heap could not take, for want of memory (See Note [C++ allocations that
    fail] in pyengine/_engine.pyx).
    """

    # No __dict__, as the compiled class has none.
    __slots__ = ("_not_empty", "_heap", "_woken", "_shutdown_pending")

    def __new__(cls, *args, **kwargs):
        # See Note [A class's __new__ called with another class] in
        # pyengine/_pure/static_types.py.
        if cls.__new__ is not ReadyQueue.__new__:
            check_new(ReadyQueue, cls)
        self = object.__new__(cls)
        # Made here, as the compiled class's C++ heap, mutex and condition
        # variable are made with the object: a second __init__ (a node's,
        # on its running graph task's queue) leaves the queued tasks and
        # the waiting thread's condition as they are. It emptied the heap
        # before, and the backward waited forever for the tasks it dropped.
        self._not_empty = Condition()
        self._heap = []
        self._woken = False
        self._shutdown_pending = False
        return self

    def __init__(self):
        # Takes no arguments, as the compiled class's; sets nothing (See
        # ReadyQueue.__new__).
        pass

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))

    def push(self, task, increment_outstanding_tasks=True):
        """Queue ``task``; count it as outstanding in its graph task unless it is
        a wake-up or shutdown task or ``increment_outstanding_tasks`` is false."""
        check_argument("task", task, NodeTask)
        check_task_to_run(task)
        with self._not_empty:
            counted = increment_outstanding_tasks and task.node is not None
            if counted:
                task.graph_task.increment_outstanding_tasks()
            try:
                heap_push(self._heap, task)
            except MemoryError:
                # See Note [C++ allocations that fail] in
                # pyengine/_engine.pyx: a flag stands for a wake-up or a
                # shutdown; a node task is not queued, nor outstanding.
                if task.node is not None:
                    if counted:
                        task.graph_task.decrement_outstanding_tasks()
                    raise MemoryError(QUEUE_FULL_MESSAGE) from None
                if task.is_shutdown:
                    self._shutdown_pending = True
                else:
                    self._woken = True
            self._not_empty.notify()

    def push_pop(self, task, increment_outstanding_tasks=True):
        """What ``push(task)`` and then ``pop()`` return, in one step, never
        waiting: ``task`` itself while nothing is queued, without the lock (a
        push another thread makes at that moment comes after this pop). See
        Note [The next task skips the queue] in ``pyengine/_pure/engine.py``."""
        check_argument("task", task, NodeTask)
        check_task_to_run(task)
        if increment_outstanding_tasks and task.node is not None:
            task.graph_task.increment_outstanding_tasks()
        if not self._heap and not self._woken and not self._shutdown_pending:
            return task
        with self._not_empty:
            if not self._heap and not self._woken and not self._shutdown_pending:
                return task
            try:
                heap_push(self._heap, task)
            except MemoryError:
                # It runs before the queued tasks: See Note [C++ allocations
                # that fail] in pyengine/_engine.pyx.
                return task
            return self._pop_next()

    def wake(self):
        """Wake the thread that waits in ``pop``, as an empty wake-up task
        does, without a place in the heap: what the engine does where its
        wake-up task finds no memory to be queued (See Note [C++ allocations
        that fail] in pyengine/_engine.pyx). Pops as one wake-up task,
        however many calls came before."""
        with self._not_empty:
            self._woken = True
            self._not_empty.notify()

    def _pop_next(self):
        """The next task, under the lock, the queue not empty: the heap's
        front, but where a flag stands for a task, that task in its place,
        as CompareNodeTaskTime would order it: the shutdown
        ``_shutdown_pending`` stands for first, the wake-up ``_woken`` stands
        for after any shutdown (the compiled core's ``pop_next``)."""
        if self._shutdown_pending:
            self._shutdown_pending = False
            return NodeTask.shutdown()
        if self._woken and not (self._heap and self._heap[0].is_shutdown):
            self._woken = False
            return make_record(None, None, None)  # a wake-up
        return heap_pop(self._heap)

    def push_shutdown(self):
        """Queue a shutdown task, which ends a device thread's loop. Never
        fails for want of memory: See ``push``."""
        self.push(NodeTask.shutdown())

    def pop(self, on_main_thread=None):
        """The next task; waits (without the GIL) while the queue is empty. On
        the main thread (``on_main_thread``, found out when None), signal
        handlers run while it waits and what they raise ends the wait, with
        nothing popped (See Note [Waits honour signals])."""
        if on_main_thread is None:
            on_main_thread = is_main_thread()
        with self._not_empty:
            while not self._heap and not self._woken and not self._shutdown_pending:
                wait_honouring_signals(self._not_empty, on_main_thread)
            return self._pop_next()

    def wait_for_task(self, timeout, on_main_thread=None):
        """Wait (without the GIL) at most ``timeout`` seconds for a task to be
        queued, and pop nothing; return whether one is. How a device worker
        idles without its engine (See Note [An engine's threads hold it
        weakly] in pyengine/_shared/engine_registry.py). Signals as ``pop``.
        A push wakes one waiter: this one passes that wake-up on, since the
        task it saw is still there for another."""
        timeout = as_c_double(timeout)
        if not 0 <= timeout <= threading.TIMEOUT_MAX:
            raise ValueError(wait_timeout_message(timeout))
        if on_main_thread is None:
            on_main_thread = is_main_thread()
        deadline = time.monotonic() + timeout
        with self._not_empty:
            while not self._heap and not self._woken and not self._shutdown_pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # In slices on the main thread: See Note [Waits honour
                # signals] in pyengine/_locks.pxd.
                self._not_empty.wait(min(left, WAIT_SLICE) if on_main_thread else left)
            self._not_empty.notify()
            return True

    def discard_graph_task(self, graph_task):
        """Drop every queued task of ``graph_task`` (after it failed); return how many."""
        with self._not_empty:
            kept = [task for task in self._heap if task.graph_task is not graph_task]
            make_heap(kept)
            taken, self._heap = self._heap, kept
        # The dropped tasks to the front of the old heap, whose others the
        # new heap holds now.
        taken[:] = [task for task in taken if task.graph_task is graph_task]
        dropped = len(taken)
        # Release outside the lock: dropping a reference can run arbitrary code.
        release_dropped_tasks(taken)
        return dropped

    def __len__(self):
        with self._not_empty:
            return len(self._heap) + self._woken + self._shutdown_pending

    def empty(self):
        return len(self) == 0
