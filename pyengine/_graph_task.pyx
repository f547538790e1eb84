"""GraphTask: the state of one backward or grad call.

A GraphTask lives from ``execute`` until its caller has read its result;
NodeTask records point back to it. Twin: ``pyengine/_pure/graph_task.py``,
the specification of ``init_to_execute`` and of the fields.
"""

cimport cython
from cpython.dict cimport PyDict_GetItemWithError, PyDict_Next, PyDict_SetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsVoidPtr, PyLong_FromVoidPtr
from cpython.object cimport PyObject
from cpython.ref cimport Py_XDECREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libcpp.mutex cimport mutex, unique_lock
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from pyengine._graph_task cimport NodePtr
from pyengine._locks cimport lock_releasing_gil
from pyengine._node cimport Edge, NodeBase
from pyengine._ready_queue cimport ReadyQueue
from pyengine._state cimport ThreadState, thread_state

from pyengine import streams as _streams
from pyengine._pure import graph_task as _twin

# The stream runtimes by device type. The same dict as streams._runtimes,
# which registering a runtime fills in place: while it is empty,
# current_streams() is {} and need not be called.
cdef dict _stream_runtimes = _streams._runtimes


@cython.final
cdef class ExecInfo:
    """Whether a node runs under ``grad(inputs=)`` / ``backward(inputs=)``
    pruning, and which of its inputs to capture as results: see the twin's
    docstring."""

    def __cinit__(self):
        self.captures = []

    cpdef bint should_execute(self) noexcept:
        return self.needed or PyList_GET_SIZE(self.captures) != 0

    def __repr__(self):
        return f"ExecInfo(needed={self.needed}, captures={self.captures})"


cdef ExecInfo exec_info_entry(dict exec_info, object key):
    """``exec_info[key]``, made empty first if absent."""
    cdef PyObject* found = PyDict_GetItemWithError(exec_info, key)
    if found != NULL:
        return <ExecInfo?>found
    return new_exec_info_entry(exec_info, key)


cdef ExecInfo new_exec_info_entry(dict exec_info, object key):
    """A new, empty ``exec_info[key]``."""
    cdef ExecInfo info = ExecInfo.__new__(ExecInfo)
    PyDict_SetItem(exec_info, key, info)
    return info


# init_to_execute's state of a node, as bits: reached once already (the
# twin's ``seen``), runs or captures (ExecInfo.should_execute), marked
# needed by this traversal (its ExecInfo is written after it), and has an
# ExecInfo already.
cdef enum:
    SEEN = 1
    EXECUTES = 2
    MARKED = 4
    HAS_ENTRY = 8

ctypedef unordered_map[NodePtr, int] NodeStates

# A node of the traversal's path and the index of its next edge to visit.
cdef struct Frame:
    NodePtr node
    Py_ssize_t next_edge


cdef inline int mark_needed(NodeStates& states, vector[NodePtr]& marked, NodePtr node) except -1:
    cdef int* state = &states[node]
    if not state[0] & MARKED:
        state[0] |= MARKED | EXECUTES
        marked.push_back(node)
    return 0


cdef GraphTask new_graph_task(bint keep_graph, bint grad_mode, int reentrant_depth,
                              ReadyQueue cpu_ready_queue, bint exit_on_error,
                              bint multithreading):
    """GraphTask(...) for the engine, without parsing Python arguments."""
    cdef GraphTask graph_task = GraphTask.__new__(GraphTask)
    graph_task._init_fields(keep_graph, grad_mode, reentrant_depth, cpu_ready_queue,
                            exit_on_error, multithreading)
    return graph_task


@cython.final
cdef class GraphTask:
    """See the twin's docstring for each field; the .pxd says how each is guarded."""

    def __init__(self, bint keep_graph, bint grad_mode, int reentrant_depth,
                 ReadyQueue cpu_ready_queue, bint exit_on_error=False, bint multithreading=True):
        self._init_fields(keep_graph, grad_mode, reentrant_depth, cpu_ready_queue, exit_on_error,
                          multithreading)

    cdef int _init_fields(self, bint keep_graph, bint grad_mode, int reentrant_depth,
                          ReadyQueue cpu_ready_queue, bint exit_on_error,
                          bint multithreading) except -1:
        self.keep_graph = keep_graph
        self.grad_mode = grad_mode
        self.reentrant_depth = reentrant_depth
        self.cpu_ready_queue = cpu_ready_queue
        self.exit_on_error = exit_on_error
        self.multithreading = multithreading
        self.caller_current_streams = _streams.current_streams() if _stream_runtimes else {}
        self.owner = -2
        self.exec_info = {}
        self.captured_vars = []
        self.leaf_streams = []
        self.final_callbacks = []
        self.outstanding_tasks_.store(0)
        self.has_error_.store(0)
        self.future_completed_.store(0)
        return 0

    def __dealloc__(self):
        self.clear_not_ready()

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
        self.outstanding_tasks_.fetch_sub(1)

    def completed(self):
        """All tasks ran (or failed, when the task exits on the first error)."""
        return self.outstanding_tasks_.load() == 0 or (self.exit_on_error and self.has_error_.load())

    def add_leaf_stream(self, stream):
        """Remember a stream a leaf gradient was written on (under ``mutex_``)."""
        lock_releasing_gil(self.mutex_)
        try:
            if stream not in self.leaf_streams:
                self.leaf_streams.append(stream)
        finally:
            self.mutex_.unlock()

    def can_checkpoint(self):
        """A reentrant checkpoint needs every node to run: no pruning."""
        return not self.exec_info

    # -- execution plan --

    cpdef init_to_execute(self, graph_root, outputs, bint accumulate_grad):
        """Mark the nodes on a path from ``graph_root`` to an edge of ``outputs``
        (a sequence of Edges): the twin's algorithm, in C.

        The traversal keeps each node's state in a C++ map keyed by node
        pointer and writes the ExecInfo of the nodes it marked needed after
        it ends: it allocates no Python object, so no Python code (a
        collection, a finalizer) can run and change the graph while it holds
        borrowed pointers to nodes, which the graph keeps alive."""
        cdef list output_list = outputs if type(outputs) is list else list(outputs)
        cdef dict exec_info = self.exec_info
        cdef Py_ssize_t output_idx
        cdef Edge edge
        cdef ExecInfo info
        for output_idx in range(PyList_GET_SIZE(output_list)):
            edge = <Edge?>PyList_GET_ITEM(output_list, output_idx)
            info = exec_info_entry(exec_info, PyLong_FromVoidPtr(<void*>edge.node))
            if accumulate_grad:
                info.needed = True
            else:
                info.captures.append((edge.input_nr, output_idx))
        self.captured_vars = [None] * PyList_GET_SIZE(output_list)
        cdef NodeBase root = <NodeBase?>graph_root
        exec_info_entry(exec_info, PyLong_FromVoidPtr(<void*>root))

        cdef NodeStates states
        cdef Py_ssize_t position = 0
        cdef PyObject* key
        cdef PyObject* value
        while PyDict_Next(exec_info, &position, &key, &value):
            states[<NodePtr>PyLong_AsVoidPtr(<object>key)] = (
                HAS_ENTRY | EXECUTES if (<ExecInfo?>value).should_execute() else HAS_ENTRY)

        cdef vector[Frame] stack
        cdef vector[NodePtr] marked
        cdef Frame* frame
        cdef NodePtr node
        cdef NodePtr child
        cdef int* child_state
        cdef tuple edges
        cdef PyObject* next_edge
        # One allocation each for graphs of up to this many nodes.
        stack.reserve(32)
        marked.reserve(32)
        stack.push_back(Frame(<NodePtr>root, 0))
        while not stack.empty():
            frame = &stack.back()
            node = frame.node
            edges = (<NodeBase>node)._next_edges
            child = NULL
            while frame.next_edge < PyTuple_GET_SIZE(edges):
                next_edge = PyTuple_GET_ITEM(edges, frame.next_edge)
                frame.next_edge += 1
                if next_edge == <PyObject*>None:
                    continue
                child = <NodePtr>(<Edge>next_edge).node
                child_state = &states[child]
                if child_state[0] & SEEN:                                  # (1)
                    if child_state[0] & EXECUTES:
                        mark_needed(states, marked, node)
                    child = NULL
                    continue
                child_state[0] |= SEEN
                break
            if child != NULL:
                stack.push_back(Frame(child, 0))                           # (2)
            else:
                stack.pop_back()                                           # (3)
                if not stack.empty() and states[node] & EXECUTES:
                    mark_needed(states, marked, stack.back().node)

        # In the order the twin makes them, so that exec_info iterates alike.
        for node in marked:
            key_object = PyLong_FromVoidPtr(<void*>node)
            if states[node] & HAS_ENTRY:
                info = <ExecInfo?>exec_info[key_object]
            else:
                info = new_exec_info_entry(exec_info, key_object)
            info.needed = True

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
            self.set_exception(error)
            return
        lock_releasing_gil(self.completion_mutex)
        if not self.future_completed_.load():
            self.future_completed_.store(1)
            self.completed_cv.notify_all()
        self.completion_mutex.unlock()

    cpdef exec_post_processing(self):
        """Make the caller's streams wait on the leaf streams, then run final
        callbacks, under the graph task's grad mode, as the twin does; a
        callback may queue more, which run too."""
        if self.leaf_streams:
            _twin.sync_leaf_streams(self)
        cdef ThreadState* thread = thread_state()
        cdef PyObject* previous = thread.current_graph_task
        cdef bint previous_grad_mode = thread.grad_enabled
        thread.current_graph_task = <PyObject*>self
        thread.grad_enabled = self.grad_mode
        try:
            i = 0
            while i < len(self.final_callbacks):
                self.final_callbacks[i]()
                i += 1
        finally:
            thread.grad_enabled = previous_grad_mode
            thread.current_graph_task = previous

    cpdef void wait(self) noexcept:
        """Block, without the GIL, until the future completed."""
        cdef unique_lock[mutex] lock
        if self.future_completed_.load():
            return
        with nogil:
            lock = unique_lock[mutex](self.completion_mutex)
            while not self.future_completed_.load():
                self.completed_cv.wait(lock)
