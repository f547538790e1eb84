# Per-thread and global engine state, readable from C without a Python call.
# See _state.pyx.

from cpython.object cimport PyObject

cdef bint grad_enabled() noexcept nogil
cdef void set_grad_mode(bint enabled) noexcept nogil
cdef bint anomaly_enabled() noexcept nogil
cdef bint anomaly_check_nan() noexcept nogil
cdef bint checkpoint_valid() noexcept nogil
cdef bint swap_checkpoint_valid(bint valid) noexcept nogil
cdef PyObject* current_graph_task() noexcept nogil
cdef PyObject* swap_current_graph_task(PyObject* graph_task) noexcept nogil
