# GraphTask; see _graph_task.pyx.

from cpython.object cimport PyObject
from libcpp.atomic cimport atomic
from libcpp.condition_variable cimport condition_variable
from libcpp.mutex cimport mutex
from libcpp.unordered_map cimport unordered_map

from pyengine._ready_queue cimport ReadyQueue

ctypedef PyObject* NodePtr
ctypedef PyObject* InputBufferPtr

cdef extern from "_dependency_map.h" nogil:
    cppclass DependencyMap "pyengine_DependencyMap":
        DependencyMap()
        bint add(PyObject* node)
        int remove(PyObject* node)


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
    cdef public object graph_root
    cdef public dict exec_info

    # Guarded by mutex_. Keys are borrowed node pointers: the graph keeps its
    # nodes alive while the task runs. not_ready's values own their buffers.
    cdef mutex mutex_
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

    # Device threads keep weak references to graph tasks that sent them work.
    cdef object __weakref__

    cdef void clear_not_ready(self) noexcept
