"""GraphTask: the state of one backward or grad call.

A GraphTask lives from ``execute`` until its caller has read its result;
NodeTask records point back to it. Twin: ``pyengine/_pure/graph_task.py``,
the specification of the fields.
"""

cimport cython
from cpython.list cimport PyList_GET_SIZE
from cpython.long cimport PyLong_FromVoidPtr
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_REFCNT, Py_XDECREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.weakref cimport PyWeakref_NewRef
from cython.operator cimport dereference as deref
from cython.operator cimport preincrement as inc
from libcpp.mutex cimport mutex, unique_lock
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from pyengine._graph_task cimport ExecInfoEntry, InputBufferPtr, NodePtr, task_should_execute
from pyengine._interrupts cimport WORK_BETWEEN_YIELDS, yield_keeping_interrupt
from pyengine._locks cimport is_main_thread, lock_releasing_gil, wait_honouring_signals
from pyengine._node cimport Edge, NodeBase
from pyengine._ready_queue cimport ReadyQueue
from pyengine._state cimport ThreadState, thread_state

from pyengine import streams as _streams
from pyengine._shared import node_streams as _node_streams
from pyengine._shared import task_queries as _task_queries
from pyengine._shared.messages import (GRAPH_TASK_INITIALIZED_WHY, cannot_pickle_message,
                                       initialized_once_message, lock_taken_again_message,
                                       node_name, not_ready_message, waits_for_itself_message)

cdef extern from "Python.h":
    # exc NULL: an int beyond a Py_ssize_t is clipped to its range.
    Py_ssize_t PyNumber_AsSsize_t(object o, PyObject* exc) except? -1

# Tables up to this size are given back with the GIL held: See
# GraphTask.__dealloc__. Freeing a block below 1 MiB takes microseconds.
cdef enum:
    TABLE_BYTES_RELEASED_WITH_THE_GIL = 1 << 20

# The stream runtimes by device type. The same dict as streams._runtimes,
# which registering a runtime fills in place: while it is empty,
# current_streams() is {} and need not be called.
cdef dict _stream_runtimes = _streams._runtimes


@cython.final
cdef class ExecInfo:
    """Whether a node runs under ``grad(inputs=)`` / ``backward(inputs=)``
    pruning, and which of its inputs to capture as results: see the twin's
    docstring. Here, a copy of an entry of ``GraphTask.exec_info_``, made
    for Python (``GraphTask.exec_info``, ``GraphTask.find_exec_info``)."""

    def __cinit__(self):
        self.captures = []

    cpdef bint should_execute(self) noexcept:
        return self.needed or PyList_GET_SIZE(self.captures) != 0

    def __repr__(self):
        return f"ExecInfo(needed={self.needed}, captures={self.captures})"

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))



cdef int lock_failed(int result) except -1:
    """Raise for a ``mutex_.lock()`` that did not lock: ``result`` 1, this
    thread holds it (it would wait for itself); -1, a signal handler raised
    while it waited (its exception is set)."""
    if result > 0:
        raise RuntimeError(lock_taken_again_message())
    return -1


cdef int check_not_ready_empty(GraphTask graph_task) except -1:
    """Raise RuntimeError if a node's gradients wait in ``not_ready_`` when the
    task completes. See Note [Gradients left in not ready] in the twin."""
    lock_mutex(graph_task)
    cdef size_t count = graph_task.not_ready_.size()
    graph_task.mutex_.unlock()
    if count:
        raise RuntimeError(not_ready_message(count))
    return 0


cdef GraphTask new_graph_task(bint keep_graph, bint grad_mode, int reentrant_depth,
                              ReadyQueue cpu_ready_queue, bint exit_on_error,
                              bint multithreading):
    """GraphTask(...) for the engine, without parsing Python arguments."""
    cdef GraphTask graph_task = GraphTask.__new__(GraphTask)
    graph_task._init_fields(keep_graph, grad_mode, reentrant_depth, cpu_ready_queue,
                            exit_on_error, multithreading)
    return graph_task


cdef int link_enclosing_graph_task(GraphTask graph_task, ThreadState* thread) except -1:
    """Record in ``graph_task``, made by a backward that ``thread`` starts,
    the graph task whose node or final callback that thread runs, if any:
    See Note [A graph task waits for itself] in pyengine/_pure/graph_task.py."""
    if thread.current_graph_task != NULL:
        graph_task.enclosing_graph_task = PyWeakref_NewRef(<object>thread.current_graph_task, None)
    return 0


# Each backward makes one GraphTask and frees it. Larger than what
# CPython's small-object allocator serves, it came from malloc and went back
# to free at every call; a few freed ones are kept for the next calls.
@cython.freelist(8)
@cython.final
cdef class GraphTask:
    """See the twin's docstring for each field; the .pxd says how each is guarded."""

    def __init__(self, bint keep_graph, bint grad_mode, int reentrant_depth,
                 ReadyQueue cpu_ready_queue, bint exit_on_error=False, bint multithreading=True):
        if self.initialized_:
            raise TypeError(initialized_once_message(self, GRAPH_TASK_INITIALIZED_WHY))
        self._init_fields(keep_graph, grad_mode, reentrant_depth, cpu_ready_queue, exit_on_error,
                          multithreading)

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))

    cdef int _init_fields(self, bint keep_graph, bint grad_mode, int reentrant_depth,
                          ReadyQueue cpu_ready_queue, bint exit_on_error,
                          bint multithreading) except -1:
        self.initialized_ = True
        self.keep_graph = keep_graph
        self.grad_mode = grad_mode
        self.reentrant_depth = reentrant_depth
        self.cpu_ready_queue = cpu_ready_queue
        self.exit_on_error = exit_on_error
        self.multithreading = multithreading
        self.caller_current_streams = _streams.current_streams() if _stream_runtimes else {}
        self.owner = -2
        self.on_pool_thread = False
        self.captured_vars = []
        self.leaf_streams = []
        self.final_callbacks = []
        self.outstanding_tasks_.store(0)
        self.has_error_.store(0)
        self.future_completed_.store(0)
        return 0

    def __dealloc__(self):
        self.clear_not_ready()
        # Tables of millions of slots take milliseconds to unmap: without the
        # GIL (See Note [Long passes let other threads run]). A small
        # backward's tables go back in less time than letting go of the GIL
        # and taking it again costs, which is a tenth of its engine's work.
        if (self.dependencies_.table_bytes() + self.exec_info_.table_bytes()
                <= TABLE_BYTES_RELEASED_WITH_THE_GIL):
            self.dependencies_.release()
            self.exec_info_.release()
        else:
            with nogil:
                self.dependencies_.release()
                self.exec_info_.release()

    cdef void clear_not_ready(self) noexcept:
        for entry in self.not_ready_:
            Py_XDECREF(entry.second)
        self.not_ready_.clear()

    # -- read-only views, for tests and debugging --

    @property
    def outstanding_tasks(self):
        return self.outstanding_tasks_.load()

    @property
    def has_error(self):
        return bool(self.has_error_.load())

    @property
    def future_completed(self):
        return bool(self.future_completed_.load())

    @property
    def exception(self):
        return self.exception_


    # -- outstanding tasks --

    def increment_outstanding_tasks(self):
        self.outstanding_tasks_.fetch_add(1)

    def decrement_outstanding_tasks(self):
        """One task fewer; returns how many are left: See Note [One thread
        completes a graph task] in pyengine/_pure/engine.py."""
        return self.outstanding_tasks_.fetch_sub(1) - 1

    def completed(self):
        """All tasks ran (or failed, when the task exits on the first error)."""
        return self.outstanding_tasks_.load() == 0 or (self.exit_on_error and self.has_error_.load())

    def add_leaf_stream(self, stream):
        """Remember a stream a leaf gradient was written on (under ``mutex_``)."""
        lock_mutex(self)
        try:
            if stream not in self.leaf_streams:
                self.leaf_streams.append(stream)
        finally:
            self.mutex_.unlock()

    def can_checkpoint(self):
        """A reentrant checkpoint needs every node to run: no pruning."""
        return self.exec_info_.empty()

    # -- exec_info, for Python --

    @property
    def exec_info(self):
        """``{id(node): ExecInfo}`` in the order the entries were made, as the
        twin's dict: a copy, for tests and debugging."""
        cdef dict copy = {}
        cdef NodePtr node
        for i in range(self.exec_info_.size()):
            node = self.exec_info_.entry_node(i)
            copy[PyLong_FromVoidPtr(<void*>node)] = self.exec_info_copy(node)
        return copy

    def find_exec_info(self, node):
        """A copy of ``node``'s entry of exec_info, or None."""
        return self.exec_info_copy(<NodePtr>node)

    # -- what a running node asks: Node.task_should_compute_output and
    # Node.task_buffered_gradient (See Note [Queries a running node makes]
    # in pyengine/_shared/task_queries.py) --

    def should_execute(self, node):
        """Whether ``node`` runs or captures in this task: every node does
        without exec_info."""
        lock_mutex(self)
        try:
            # Any hint will do: a query, not the engine's path.
            return task_should_execute(self, <NodePtr>node, 0)
        finally:
            self.mutex_.unlock()

    def should_compute_output(self, NodeBase node not None, output_edge_index):
        """``node.task_should_compute_output(output_edge_index)``, ``node``
        being a node this task runs: whether next edge ``output_edge_index``
        leads to a node that runs or captures (every node does without
        exec_info), False for a missing edge. Same name, same steps in the
        twin."""
        cdef tuple edges = node._next_edges
        cdef Py_ssize_t index = -1
        cdef object edge
        cdef NodeBase next_node
        cdef bint answer
        if type(output_edge_index) is int:
            # The usual call: a frontend's formulas ask once per input of
            # every node they run. An int beyond a Py_ssize_t is clipped
            # (out of range either way), not an error.
            index = PyNumber_AsSsize_t(output_edge_index, NULL)
        if not 0 <= index < PyTuple_GET_SIZE(edges):
            # The index's __index__ may run Python code that sets the
            # node's edges: read them again after it, and check the index
            # against them here too, as no unchecked index reaches
            # PyTuple_GET_ITEM.
            index = _task_queries.checked_output_edge_index(
                node, "task_should_compute_output", output_edge_index)
            edges = node._next_edges
            if not 0 <= index < PyTuple_GET_SIZE(edges):
                raise RuntimeError(f"{node_name(node)}'s next edges changed during "
                                   "task_should_compute_output")
        edge = <object>PyTuple_GET_ITEM(edges, index)
        if edge is None:
            return False
        next_node = (<Edge>edge).node
        lock_mutex(self)
        answer = task_should_execute(self, <NodePtr>next_node, next_node._dependency_slot_)
        self.mutex_.unlock()
        return answer

    def buffered_gradient(self, node, Py_ssize_t input_nr):
        """A copy of what ``node``'s InputBuffer in not_ready holds at
        ``input_nr``, made under the mutex; None where it holds nothing."""
        cdef unordered_map[NodePtr, InputBufferPtr].iterator found
        lock_mutex(self)
        try:
            found = self.not_ready_.find(<NodePtr>node)
            if found == self.not_ready_.end():
                return None
            return _task_queries.buffered_copy((<object>deref(found).second).buffer, input_nr)
        finally:
            self.mutex_.unlock()

    cdef ExecInfo exec_info_copy(self, NodePtr node):
        lock_mutex(self)
        # The search's mark: See _exec_info_map.h.
        cdef bint marked = self.dependencies_.needed(node, 0)  # any hint will do
        self.mutex_.unlock()
        # Found after the lock, which may have let other threads run.
        cdef const ExecInfoEntry* entry = self.exec_info_.find(node)
        if entry == NULL and not marked:
            return None
        cdef ExecInfo info = ExecInfo.__new__(ExecInfo)
        info.needed = marked or (entry != NULL and entry.needed)
        cdef Capture capture
        if entry != NULL and entry.captures >= 0:
            for capture in self.exec_captures[entry.captures]:
                info.captures.append((capture.first, capture.second))
        return info

    # -- execution plan --

    def init_to_execute(self, graph_root, outputs, accumulate_grad):
        """Mark the nodes on a path from ``graph_root`` to an edge of
        ``outputs`` (a sequence of Edges) in exec_info, counting the
        dependencies in the same search: ``init_to_execute`` in
        ``pyengine/_dependencies.pyx``, which the engine calls in C."""
        from pyengine._dependencies import init_to_execute
        init_to_execute(graph_root, self, outputs, accumulate_grad)

    # -- completion --

    cpdef void set_exception(self, exception) noexcept:
        """Record the first error and complete the task's future with it."""
        lock_releasing_gil(self.completion_mutex)
        self.has_error_.store(1)
        if not self.future_completed_.load():
            self.exception_ = exception
            # No final callback runs after an error.
            self.completing = True
            self.future_completed_.store(1)
            self.completed_cv.notify_all()
        self.completion_mutex.unlock()

    cpdef mark_as_completed_and_run_post_processing(self):
        """Run the final callbacks and complete the future, once, on one thread;
        another thread that gets here waits until that is done."""
        lock_releasing_gil(self.completion_mutex)
        if self.completing:
            self.completion_mutex.unlock()
            self.wait()
            return
        self.completing = True
        self.completion_mutex.unlock()
        try:
            self.exec_post_processing()
        except BaseException as error:
            # No return in here: See Note [Python allocations that fail] in
            # pyengine/_engine.pyx (a return in an except clause).
            self.set_exception(error)
        else:
            lock_releasing_gil(self.completion_mutex)
            if not self.future_completed_.load():
                self.future_completed_.store(1)
                self.completed_cv.notify_all()
            self.completion_mutex.unlock()

    cpdef exec_post_processing(self):
        """Make the caller's streams wait on the leaf streams, then run final
        callbacks, under the graph task's grad mode, as the twin does; a
        callback may queue more, which run too. First, a node that got some
        of its gradients but never ran fails the task: See Note [Gradients
        left in not ready] in the twin."""
        check_not_ready_empty(self)
        if self.leaf_streams:
            _node_streams.sync_leaf_streams(self)
        cdef ThreadState* thread = thread_state()
        cdef PyObject* previous = thread.current_graph_task
        cdef bint previous_grad_mode = thread.grad_enabled
        thread.current_graph_task = <PyObject*>self
        thread.grad_enabled = self.grad_mode
        cdef Py_ssize_t i = 0
        try:
            while i < len(self.final_callbacks):
                self.final_callbacks[i]()
                i += 1
        finally:
            thread.grad_enabled = previous_grad_mode
            thread.current_graph_task = previous

    cpdef wait(self):
        """Block, without the GIL, until the future completed. On the main
        thread a signal handler's exception (KeyboardInterrupt) ends the
        wait: See Note [Waits honour signals] in ``_locks.pxd``; the caller
        cancels what it waited for. Refused where the task waits for this
        thread: See Note [A graph task waits for itself] in
        pyengine/_pure/graph_task.py."""
        cdef unique_lock[mutex] lock
        if self.future_completed_.load():
            return
        cdef PyObject* current = thread_state().current_graph_task
        # The engine sets current_graph_task from GraphTasks only.
        cdef GraphTask running = <GraphTask>current if current != NULL else None
        while running is not None:
            if running is self:
                raise RuntimeError(waits_for_itself_message(
                    nested=current != <PyObject*>self))
            # A reference that died ends the chain: what it named completed.
            running = (running.enclosing_graph_task()
                       if running.enclosing_graph_task is not None else None)
        cdef bint on_main_thread = is_main_thread()
        with nogil:
            lock = unique_lock[mutex](self.completion_mutex)
            while not self.future_completed_.load():
                wait_honouring_signals(self.completed_cv, lock, on_main_thread)


cdef int release_leftovers(GraphTask graph_task) except -1:
    """Let go of what ``graph_task``, which failed, leaves: the InputBuffers
    that wait in its not_ready (their nodes will not run) and the gradients
    it captured for ``grad()``, letting other threads run between slices
    of them. See Note [What a failed graph task leaves is let go of in
    slices] in the twin."""
    cdef unordered_map[NodePtr, InputBufferPtr] taken
    cdef InputBufferPtr input_buffer
    cdef size_t slice_left
    cdef Py_ssize_t end
    captured = None
    if not graph_task.mutex_.try_lock():
        # Another thread holds it, in a node of this task still running
        # (an add that takes its time, or waits): what is left goes with
        # the task, rather than this error wait for it.
        return 0
    try:
        # A thread still running a node of it buffers into the task's new
        # map, and captures into its new list (a capture out of its range
        # fails that node, of a task that failed already).
        taken.swap(graph_task.not_ready_)
        captured = graph_task.captured_vars
        graph_task.captured_vars = []
    finally:
        graph_task.mutex_.unlock()
    interrupt = None
    cdef unordered_map[NodePtr, InputBufferPtr].iterator entry = taken.begin()
    while entry != taken.end():
        slice_left = WORK_BETWEEN_YIELDS
        while slice_left > 0 and entry != taken.end():
            input_buffer = deref(entry).second
            deref(entry).second = NULL
            Py_XDECREF(input_buffer)
            slice_left -= 1
            inc(entry)
        if entry != taken.end():
            interrupt = yield_keeping_interrupt(interrupt)
    # The map's own storage, without the GIL: See the Note.
    with nogil:
        taken.clear()
        taken.rehash(0)
    # Emptied only where nothing else holds it: Python code may have kept
    # the list (or put one of its own in its place).
    if type(captured) is list and Py_REFCNT(captured) == 1:
        end = PyList_GET_SIZE(captured)
        while end > 0:
            del captured[max(end - WORK_BETWEEN_YIELDS, 0):end]
            end = PyList_GET_SIZE(captured)
            if end > 0:
                interrupt = yield_keeping_interrupt(interrupt)
    # Raised once everything is let go of: the map owns references that
    # nothing else would drop.
    if interrupt is not None:
        raise interrupt
    return 0


cdef int cancel_graph_task(GraphTask graph_task, object error) except -1:
    """End ``graph_task`` with ``error``, which its caller raises itself: See
    Note [Cancelling a graph task] in pyengine/_pure/engine.py."""
    graph_task.set_exception(error)
    # The caller raises the error: the task must not keep it (and its traceback).
    if graph_task.exception_ is error:
        graph_task.exception_ = None
    graph_task.cpu_ready_queue.discard_graph_task_records(graph_task)
    return 0
