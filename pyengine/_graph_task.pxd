# GraphTask and ExecInfo; see _graph_task.pyx.

cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport int32_t
from libcpp.atomic cimport atomic
from libcpp.condition_variable cimport condition_variable
from libcpp.mutex cimport mutex
from libcpp.unordered_map cimport unordered_map
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from pyengine._locks cimport GILGuardedLock
from pyengine._ready_queue cimport ReadyQueue
from pyengine._state cimport ThreadState, thread_state

ctypedef PyObject* NodePtr
ctypedef PyObject* InputBufferPtr
# What grad(inputs=) takes from a node's gradients: (input_nr, output_idx),
# the gradient of the node's input slot input_nr is output output_idx.
ctypedef pair[Py_ssize_t, Py_ssize_t] Capture

cdef extern from "_dependency_map.h" nogil:
    # A node's state in compute_dependencies' depth-first search.
    enum SearchState "pyengine_DependencyMap::State":
        SEARCH_NOT_SEEN "pyengine_DependencyMap::NOT_SEEN"
        SEARCH_ON_PATH "pyengine_DependencyMap::ON_PATH"
        SEARCH_FINISHED "pyengine_DependencyMap::FINISHED"

    cppclass DependencyMap "pyengine_DependencyMap":
        DependencyMap()
        void use_kept_table() except +
        bint full()
        bint grow_step() except +
        void release()
        size_t table_bytes()
        void reset() except +
        int remove(PyObject* node, size_t hint)
        size_t enter(PyObject* root)
        SearchState add_edge(PyObject* node, size_t* index)
        void finish(PyObject* node, size_t index)
        void mark_needed(PyObject* node, size_t index)
        bint needed(PyObject* node, size_t hint)
        bint needed_at(size_t index)
        size_t size()

cdef extern from "_exec_info_map.h" nogil:
    cppclass ExecInfoEntry "pyengine_ExecInfo":
        PyObject* node
        # An index into GraphTask.exec_captures, or -1.
        int32_t captures
        bint needed
    cppclass ExecInfoMap "pyengine_ExecInfoMap":
        ExecInfoMap()
        bint full()
        bint grow_step() except +
        void release()
        size_t table_bytes()
        bint empty()
        Py_ssize_t size()
        PyObject* entry_node(Py_ssize_t i)
        const ExecInfoEntry* find(PyObject* node)
        bint should_execute(PyObject* node)
        ExecInfoEntry& make_entry(PyObject* node) except +
        void record_marked(PyObject* node) except +


@cython.final
cdef class ExecInfo:
    # A copy of one node's exec_info entry, for tests and debugging (the
    # engine reads GraphTask.exec_info_); immutable after construction.
    cdef readonly bint needed
    # (input_nr, output_idx) pairs.
    cdef readonly list captures

    cpdef bint should_execute(self) noexcept


@cython.final
cdef class GraphTask:
    # Immutable after execute() pushed the first task.
    cdef readonly bint keep_graph
    cdef readonly bint grad_mode
    cdef readonly int reentrant_depth
    cdef readonly ReadyQueue cpu_ready_queue
    cdef readonly bint exit_on_error
    cdef readonly bint multithreading
    cdef readonly dict caller_current_streams
    cdef public int owner
    # Set by _init_fields: a second __init__ is refused.
    cdef bint initialized_
    cdef public object graph_root
    # Whether a reentrant pool thread runs this task and has not gone back
    # to idle yet. Guarded by the engine's pool mutex once the task is
    # handed to the pool. See Note [A pool thread is back before its caller].
    cdef bint on_pool_thread
    # Guarded by the GIL: written only by init_to_execute
    # (pyengine/_dependencies.pyx), before any task runs; planning is set
    # while it runs. exec_info_ is empty when every node runs; an entry's
    # captures index exec_captures, a node's Captures. In C, which Python
    # code cannot reach (it could reach a list through gc.get_referents, and
    # shorten it under the engine's unchecked reads). The nodes the search
    # marks needed are marked in dependencies_: See _exec_info_map.h and
    # task_should_execute.
    cdef ExecInfoMap exec_info_
    cdef vector[vector[Capture]] exec_captures
    cdef bint planning

    # Guarded by mutex_. Keys are borrowed node pointers: the graph keeps its
    # nodes alive while the task runs. not_ready's values own their buffers.
    cdef GILGuardedLock mutex_
    cdef DependencyMap dependencies_
    cdef unordered_map[NodePtr, InputBufferPtr] not_ready_
    cdef public list captured_vars
    cdef public list leaf_streams

    # Atomic.
    cdef atomic[Py_ssize_t] outstanding_tasks_
    cdef atomic[int] has_error_
    cdef atomic[int] future_completed_

    # Guarded by completion_mutex; completed_cv is signalled under it.
    cdef mutex completion_mutex
    cdef condition_variable completed_cv
    cdef bint completing
    cdef object exception_

    # Appended and iterated under the GIL.
    cdef public list final_callbacks
    # A weak reference to the graph task whose node or final callback
    # started this one (the thread's current graph task when it was made),
    # or None: See Note [A graph task waits for itself].
    cdef object enclosing_graph_task

    # Device threads keep weak references to graph tasks that sent them work.
    cdef object __weakref__

    cdef int _init_fields(self, bint keep_graph, bint grad_mode, int reentrant_depth,
                          ReadyQueue cpu_ready_queue, bint exit_on_error,
                          bint multithreading) except -1
    cdef void clear_not_ready(self) noexcept
    cdef ExecInfo exec_info_copy(self, NodePtr node)

    # What the engine calls once per backward, called in C. The ones that
    # return None to Python report errors as exceptions (a NULL return).
    cpdef void set_exception(self, exception) noexcept
    cpdef mark_as_completed_and_run_post_processing(self)
    cpdef exec_post_processing(self)
    cpdef wait(self)


cdef GraphTask new_graph_task(bint keep_graph, bint grad_mode, int reentrant_depth,
                              ReadyQueue cpu_ready_queue, bint exit_on_error,
                              bint multithreading)

cdef int cancel_graph_task(GraphTask graph_task, object error) except -1

cdef int release_leftovers(GraphTask graph_task) except -1

cdef int link_enclosing_graph_task(GraphTask graph_task, ThreadState* thread) except -1


cdef inline ThreadState running_thread_state(GraphTask graph_task) noexcept:
    """This thread's state as thread_main sets it while a node of
    ``graph_task`` runs (PyTorch's ThreadLocalStateGuard), for a graph task
    that runs every node (no ``exec_info``): what the engine's own loop
    for owner graphs sets around each call."""
    cdef ThreadState running = thread_state()[0]
    running.current_graph_task = <PyObject*>graph_task
    running.grad_enabled = graph_task.grad_mode
    # checkpoint_valid stays as it is: can_checkpoint() is True without
    # exec_info, and ANDed with the enclosing task's value it is that value
    # (See Note [Checkpoint valid in nested backward] in pyengine/_pure/state.py).
    return running


cdef inline bint task_should_execute(GraphTask graph_task, NodePtr node,
                                     size_t slot_hint) noexcept nogil:
    """Whether ``node`` runs or captures in ``graph_task``: every node does
    without exec_info; else it is marked needed (in the DependencyMap's
    slot, looked for first at ``slot_hint``: See Note [A node keeps its
    slot's index] in pyengine/_dependency_map.h), or an entry of exec_info
    runs or captures. Call it under the graph task's mutex, or before any
    task runs."""
    return (graph_task.exec_info_.empty() or graph_task.dependencies_.needed(node, slot_hint)
            or graph_task.exec_info_.should_execute(node))


cdef int lock_failed(int result) except -1


cdef inline int lock_mutex(GraphTask graph_task) except -1:
    """``graph_task.mutex_.lock()``, raising where it did not lock: See
    Note [A lock the GIL guards] in _gil_guarded_lock.h."""
    cdef int result = graph_task.mutex_.lock()
    if result != 0:
        return lock_failed(result)
    return 0
