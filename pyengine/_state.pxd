# Per-thread and global engine state, readable from C without a Python call.
# See _state.pyx.

from cpython.object cimport PyObject

cdef extern from *:
    """
    /* The engine's per-thread state, one struct per thread (see _state.pyx). */
    struct pyengine_ThreadState {
        int grad_enabled;
        /* False while a node of a pruning graph task (grad, inputs=) runs. */
        int checkpoint_valid;
        /* Borrowed: the graph task whose node runs on this thread, or NULL. */
        PyObject *current_graph_task;
        /* Whether device work goes to device threads (else all on the caller). */
        int multithreading_enabled;
    };
    """
    ctypedef struct ThreadState "pyengine_ThreadState":
        bint grad_enabled
        bint checkpoint_valid
        PyObject* current_graph_task
        bint multithreading_enabled

cdef ThreadState* thread_state() noexcept nogil
cdef PyObject* profiler() noexcept nogil
cdef bint anomaly_enabled() noexcept nogil
cdef bint anomaly_check_nan() noexcept nogil
