# Per-thread and global engine state, readable from C without a Python call.
# See _state.pyx.

from cpython.object cimport PyObject

cdef extern from "_thread_state.h":
    ctypedef struct ThreadState "pyengine_ThreadState":
        bint grad_enabled
        bint checkpoint_valid
        PyObject* current_graph_task
        bint multithreading_enabled
        PyObject* current_node
        PyObject* current_node_graph_task
        PyObject* worker_state

cdef ThreadState* thread_state() noexcept nogil
cdef PyObject* profiler() noexcept nogil
cdef bint anomaly_enabled() noexcept nogil
cdef bint anomaly_check_nan() noexcept nogil
