"""NodeTask, CompareNodeTaskTime and ReadyQueue: what runs next on one thread.

A ReadyQueue is a C++ binary heap of NodeTaskRecords under a std::mutex and
a condition variable. Records own references to their graph task, node and
input buffer: taken (with the GIL) when a record is made, handed over
through the queue, and released (with the GIL) by whoever popped it.
``pop`` waits with the GIL released, in slices on the main thread (See
Note [Waits honour signals] in ``_locks.pxd``). The heap's push and pop
are nogil functions. The order is that of Note [Ready queue
order] in the twin, ``pyengine/_pure/ready_queue.py``, kept by the
comparator CompareNodeTaskTime and, among tasks that tie in it, by the heap
algorithms of libstdc++, both in ``_node_task.h`` (See Note [Ties in the
ready queue]).
"""

cimport cython
from cpython.object cimport PyObject
from cpython.ref cimport Py_XDECREF, Py_XINCREF
from libc.stdint cimport uint64_t
from libcpp.mutex cimport mutex, unique_lock
from libcpp.vector cimport vector

from pyengine._interrupts cimport WORK_BETWEEN_YIELDS, yield_keeping_interrupt
from pyengine._locks cimport (is_main_thread, lock_releasing_gil, wait_for_honouring_signals,
                             wait_honouring_signals)
from pyengine._node cimport NodeBase

from libc.math cimport ceil

from threading import TIMEOUT_MAX

from pyengine._shared.messages import (QUEUE_FULL_MESSAGE, cannot_pickle_message,
                                       no_ready_queue_message, task_field_message,
                                       wait_timeout_message)


cdef NodeTaskRecord make_record(object graph_task, object node, object inputs,
                                int reentrant_depth, uint64_t sequence_nr) noexcept:
    cdef NodeTaskRecord record
    record.graph_task = <PyObject*>graph_task if graph_task is not None else NULL
    record.node = <PyObject*>node if node is not None else NULL
    record.inputs = <PyObject*>inputs if inputs is not None else NULL
    Py_XINCREF(record.graph_task)
    Py_XINCREF(record.node)
    Py_XINCREF(record.inputs)
    record.reentrant_depth = reentrant_depth
    record.sequence_nr = sequence_nr
    record.is_shutdown = False
    return record


cdef void release_record(NodeTaskRecord* record) noexcept:
    """Drop a record's references; needs the GIL."""
    Py_XDECREF(record.inputs)
    Py_XDECREF(record.node)
    Py_XDECREF(record.graph_task)
    record.inputs = record.node = record.graph_task = NULL


cdef int release_dropped_tasks(vector[NodeTaskRecord]& records) except -1:
    """Release every record of ``records``, which a queue dropped, letting
    other threads run between slices of them. See Note [What a failed
    graph task leaves is let go of in slices] in the twin,
    ``pyengine/_pure/graph_task.py``."""
    cdef size_t start = 0
    cdef size_t end
    cdef size_t i
    interrupt = None
    while start < records.size():
        end = min(start + WORK_BETWEEN_YIELDS, records.size())
        for i in range(start, end):
            release_record(&records[i])
        start = end
        if start < records.size():
            interrupt = yield_keeping_interrupt(interrupt)
    # Raised once every record is released: the records own references
    # that nothing else would drop.
    if interrupt is not None:
        raise interrupt
    return 0


cdef inline size_t tasks_queued(ReadyQueue queue) noexcept nogil:
    """The tasks ``queue`` holds: its heap's, and those its flags stand for.
    The caller holds its mutex."""
    return queue.heap.size() + queue.woken + queue.shutdown_pending


cdef int push_or_release(ReadyQueue queue, NodeTaskRecord* record) except -1:
    """``queue.push_record(*record)``, raising MemoryError where the heap
    cannot grow, the record's references let go of."""
    if not queue.push_record(record[0]):
        release_record(record)
        raise MemoryError(QUEUE_FULL_MESSAGE)
    return 0


@cython.final
cdef class NodeTask:
    """One unit of work: run ``node`` of ``graph_task`` on ``inputs`` (the list
    of gradients its InputBuffer summed), as a Python object; the engine
    itself moves NodeTaskRecords.

    ``node is None`` marks an empty wake-up task; ``is_shutdown`` a task that
    stops the worker popping it. Immutable after construction.
    """

    def __init__(self, graph_task, node, inputs, is_shutdown=False):
        self.graph_task = graph_task
        self.node = node
        self.inputs = inputs
        self.is_shutdown = is_shutdown
        self.reentrant_depth = graph_task.reentrant_depth if graph_task is not None else 0
        self.sequence_nr = node._sequence_nr if node is not None else 0

    @classmethod
    def shutdown(cls):
        return cls(None, None, None, is_shutdown=True)

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))


# pyengine._graph_task.GraphTask, imported on first use: that module cimports
# this one.
cdef object _graph_task_type = None


cdef int check_task_to_run(NodeTask task) except -1:
    """Refuse a task with a node whose fields the engine could not run: the
    engine casts them unchecked. See Note [A task pushed from Python is
    checked] in the twin."""
    global _graph_task_type
    if task.node is None:
        return 0
    if _graph_task_type is None:
        from pyengine._graph_task import GraphTask
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
    return 0


cdef NodeTask task_of_record(NodeTaskRecord* record):
    """A popped record as a NodeTask, the record's references released."""
    cdef NodeTask task = NodeTask.__new__(NodeTask)
    task.graph_task = <object>record.graph_task if record.graph_task != NULL else None
    task.node = <object>record.node if record.node != NULL else None
    task.inputs = <object>record.inputs if record.inputs != NULL else None
    task.is_shutdown = record.is_shutdown
    task.reentrant_depth = record.reentrant_depth
    task.sequence_nr = record.sequence_nr
    release_record(record)
    return task


@cython.final
cdef class ReadyQueue:
    """A priority queue of tasks under a mutex and a condition variable."""

    def __init__(self):
        # Without it the type would take any arguments; the twin's takes none.
        pass

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))

    def __dealloc__(self):
        for i in range(self.heap.size()):
            release_record(&self.heap[i])
        self.heap.clear()

    cdef bint push_record(self, NodeTaskRecord record) noexcept:
        """Queue ``record``, taking over its references; needs the GIL (it
        never blocks with it: See Note [Locks and the GIL]). False where the
        heap cannot grow: nothing queued, the record still the caller's. A
        wake-up or shutdown task is never refused: where the heap cannot
        take it, a flag stands for it (See Note [C++ allocations that fail]
        in pyengine/_engine.pyx)."""
        lock_releasing_gil(self.mutex_)
        cdef bint pushed = heap_push(self.heap, record)
        cdef bint flagged = not pushed and record.node == NULL
        if flagged:
            if record.is_shutdown:
                self.shutdown_pending = True
            else:
                self.woken = True
        self.queued.store(tasks_queued(self))
        self.mutex_.unlock()
        if flagged:
            # Outside the lock: dropping a reference can run arbitrary code.
            release_record(&record)
        if pushed or flagged:
            self.not_empty.notify_one()
        return pushed or flagged

    cdef void push_pop_record(self, NodeTaskRecord* record) noexcept:
        """Queue ``*record`` and pop the next record into it, in one step:
        what ``push_record`` and then a pop give, with no other push or pop
        between them. While nothing is queued that is ``*record`` itself,
        and it takes no lock: a push another thread makes at that moment
        comes after this pop. Needs the GIL. See Note [The next task skips
        the queue] in ``pyengine/_pure/engine.py``. Where the heap cannot
        grow, ``*record`` comes back as it went in, to run before the queued
        tasks: See Note [C++ allocations that fail] in pyengine/_engine.pyx."""
        if self.queued.load() == 0:
            return
        lock_releasing_gil(self.mutex_)
        if tasks_queued(self) != 0 and heap_push(self.heap, record[0]):
            record[0] = pop_next(self.heap, self.woken, self.shutdown_pending)
            self.queued.store(tasks_queued(self))
        self.mutex_.unlock()

    cpdef void wake(self) noexcept:
        """Wake the thread that waits in ``pop``, as an empty wake-up task
        does, without a place in the heap: what the engine does where its
        wake-up task finds no memory to be queued (See Note [C++ allocations
        that fail] in pyengine/_engine.pyx). Pops as one wake-up task,
        however many calls came before."""
        lock_releasing_gil(self.mutex_)
        self.woken = True
        self.queued.store(tasks_queued(self))
        self.mutex_.unlock()
        self.not_empty.notify_one()

    cdef int pop_record(self, NodeTaskRecord* record, bint on_main_thread) except -1 nogil:
        """Pop the next record into ``record``, its references now the
        caller's; waits while empty. Call it without the GIL. On the main
        thread (``on_main_thread``), signal handlers run while it waits and
        what they raise ends the wait, with nothing popped (See Note [Waits
        honour signals])."""
        cdef unique_lock[mutex] lock = unique_lock[mutex](self.mutex_)
        while tasks_queued(self) == 0:
            wait_honouring_signals(self.not_empty, lock, on_main_thread)
        record[0] = pop_next(self.heap, self.woken, self.shutdown_pending)
        self.queued.store(tasks_queued(self))
        return 0

    cdef bint try_pop_record(self, NodeTaskRecord* record) noexcept nogil:
        """Pop into ``record`` if the lock is free and a task is queued; never
        waits, so the engine loop may call it holding the GIL."""
        if not self.mutex_.try_lock():
            return False
        if tasks_queued(self) == 0:
            self.mutex_.unlock()
            return False
        record[0] = pop_next(self.heap, self.woken, self.shutdown_pending)
        self.queued.store(tasks_queued(self))
        self.mutex_.unlock()
        return True

    cdef Py_ssize_t discard_graph_task_records(self, object graph_task) except -1:
        """Drop every queued task of ``graph_task``; return how many."""
        cdef vector[NodeTaskRecord] kept
        cdef vector[NodeTaskRecord] taken
        cdef size_t keep = 0
        cdef size_t dropped = 0
        cdef size_t i
        lock_releasing_gil(self.mutex_)
        try:
            for i in range(self.heap.size()):
                keep += self.heap[i].graph_task != <PyObject*>graph_task
            # Made before the heap changes: where it raises MemoryError, the
            # heap, which still owns every record, is as it was. No more:
            # the million records of a failed graph task would cost their
            # new pages under the lock.
            kept.reserve(keep)
            for i in range(self.heap.size()):
                if self.heap[i].graph_task != <PyObject*>graph_task:
                    kept.push_back(self.heap[i])
            taken.swap(self.heap)
            self.heap.swap(kept)
            make_heap(self.heap.begin(), self.heap.end(), CompareNodeTaskTime())
            self.queued.store(tasks_queued(self))
        finally:
            self.mutex_.unlock()
        # The dropped records to the front of the old heap, whose others the
        # new heap owns now.
        for i in range(taken.size()):
            if taken[i].graph_task == <PyObject*>graph_task:
                taken[dropped] = taken[i]
                dropped += 1
        taken.resize(dropped)
        # Release outside the lock: dropping a reference can run arbitrary code.
        release_dropped_tasks(taken)
        return dropped

    def push(self, NodeTask task not None, increment_outstanding_tasks=True):
        """Queue ``task``; count it as outstanding in its graph task unless it is
        a wake-up or shutdown task or ``increment_outstanding_tasks`` is false."""
        check_task_to_run(task)
        cdef bint counted = increment_outstanding_tasks and task.node is not None
        if counted:
            task.graph_task.increment_outstanding_tasks()
        cdef NodeTaskRecord record = make_record(task.graph_task, task.node, task.inputs,
                                                 task.reentrant_depth, task.sequence_nr)
        record.is_shutdown = task.is_shutdown
        try:
            push_or_release(self, &record)
        except MemoryError:
            # Not queued: not outstanding either.
            if counted:
                task.graph_task.decrement_outstanding_tasks()
            raise

    def push_pop(self, NodeTask task not None, increment_outstanding_tasks=True):
        """What ``push(task)`` and then ``pop()`` return, in one step, never
        waiting: ``task`` itself while nothing is queued."""
        check_task_to_run(task)
        if increment_outstanding_tasks and task.node is not None:
            task.graph_task.increment_outstanding_tasks()
        cdef NodeTaskRecord record = make_record(task.graph_task, task.node, task.inputs,
                                                 task.reentrant_depth, task.sequence_nr)
        record.is_shutdown = task.is_shutdown
        cdef NodeTaskRecord pushed = record
        self.push_pop_record(&record)
        if (record.node == pushed.node and record.inputs == pushed.inputs
                and record.graph_task == pushed.graph_task
                and record.is_shutdown == pushed.is_shutdown):
            # Its own task back (or one no pop could tell from it).
            release_record(&record)
            return task
        return task_of_record(&record)

    def push_shutdown(self):
        """Queue a shutdown task, which ends a device thread's loop. Never
        fails for want of memory: See ``push_record``."""
        cdef NodeTaskRecord record = make_record(None, None, None, 0, 0)
        record.is_shutdown = True
        push_or_release(self, &record)

    def pop(self, on_main_thread=None):
        """The next task; waits (without the GIL) while the queue is empty. On
        the main thread (``on_main_thread``, found out when None), signal
        handlers run while it waits and what they raise ends the wait, with
        nothing popped (See Note [Waits honour signals])."""
        cdef NodeTaskRecord record
        cdef bint main = is_main_thread() if on_main_thread is None else on_main_thread
        with nogil:
            self.pop_record(&record, main)
        return task_of_record(&record)

    def wait_for_task(self, double timeout, on_main_thread=None):
        """Wait (without the GIL) at most ``timeout`` seconds for a task to be
        queued, and pop nothing; return whether one is. How a device worker
        idles without its engine (See Note [An engine's threads hold it
        weakly] in pyengine/_shared/engine_registry.py). Signals as ``pop``.
        A push wakes one waiter: this one passes that wake-up on, since the
        task it saw is still there for another."""
        if not 0 <= timeout <= TIMEOUT_MAX:
            raise ValueError(wait_timeout_message(timeout))
        cdef bint main = is_main_thread() if on_main_thread is None else on_main_thread
        cdef long long left_ms = <long long>ceil(timeout * 1000)
        cdef bint queued
        cdef unique_lock[mutex] lock
        with nogil:
            lock = unique_lock[mutex](self.mutex_)
            while tasks_queued(self) == 0 and left_ms > 0:
                left_ms = wait_for_honouring_signals(self.not_empty, lock, main, left_ms)
            queued = tasks_queued(self) != 0
            lock.unlock()
            if queued:
                self.not_empty.notify_one()
        return queued

    def discard_graph_task(self, graph_task):
        """Drop every queued task of ``graph_task`` (after it failed); return how many."""
        return self.discard_graph_task_records(graph_task)

    def __len__(self):
        lock_releasing_gil(self.mutex_)
        size = tasks_queued(self)
        self.mutex_.unlock()
        return size

    def empty(self):
        return len(self) == 0
