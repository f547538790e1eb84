# validate_outputs; see _validate_outputs.pyx.

from cpython.object cimport PyObject
from libc.string cimport memcmp

cimport numpy as cnp

from pyengine._node cimport InputMetadata


cdef inline bint numpy_gradient_matches(InputMetadata metadata, object grad) noexcept:
    """The fast path: a numpy array whose dtype, shape and device are the slot's."""
    if metadata.numpy_dtype is None or type(grad) is not cnp.ndarray:
        return False
    cdef cnp.ndarray array = <cnp.ndarray>grad
    if <PyObject*>cnp.PyArray_DESCR(array) != <PyObject*>metadata.numpy_dtype:
        return False
    cdef size_t ndim = <size_t>cnp.PyArray_NDIM(array)
    if ndim != metadata.dims.size():
        return False
    return ndim == 0 or memcmp(cnp.PyArray_DIMS(array), metadata.dims.data(),
                               ndim * sizeof(cnp.npy_intp)) == 0


cdef int validate_outputs_impl(tuple edges, list grads, object format_error) except -1
