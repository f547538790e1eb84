# The reentrant thread pool; see _thread_pool.pyx.

cimport cython
from cpython.object cimport PyObject
from libcpp.condition_variable cimport condition_variable
from libcpp.deque cimport deque
from libcpp.mutex cimport mutex

from pyengine._graph_task cimport GraphTask


@cython.final
cdef class _ThreadPoolShared:
    cdef mutex mutex_
    # Idle pool threads wait on work, callers for their pool thread on
    # released: See Note [A hand-off wakes a pool thread] in the twin.
    cdef condition_variable work
    cdef condition_variable released
    cdef deque[PyObject*] graph_tasks
    cdef size_t num_idle
    cdef Py_ssize_t num_threads
    cdef bint stopping
    cdef list threads


cdef int add_thread_pool_task(_ThreadPoolShared pool, GraphTask graph_task,
                              Py_ssize_t max_pool_threads, object engine_ref) except -1
cdef int start_pool_thread(_ThreadPoolShared pool, GraphTask graph_task,
                           object engine_ref, list slot) except -1
cdef int withdraw_pool_task(_ThreadPoolShared pool, GraphTask graph_task) except -1
