# validate_outputs; see _validate_outputs.pyx.

from cpython.object cimport PyObject, Py_TYPE
from libcpp.vector cimport vector

cimport numpy as cnp

from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

from pyengine._node cimport InputMetadata, NodeBase, has_numpy_backend, is_numpy_array, same_dims


cdef inline bint numpy_gradient_matches(InputMetadata metadata, object grad) noexcept:
    """The fast path of validate_outputs: a numpy array that the built-in
    numpy backend handles (See Note [Replacing the numpy backend] in
    pyengine/backends.py), whose dtype, shape and device are the slot's.
    Reads the array's fields, then compares them in ``numpy_fields_match``."""
    if not is_numpy_array(grad):
        return numpy_scalar_matches(metadata, grad)
    cdef cnp.ndarray array = <cnp.ndarray>grad
    return numpy_fields_match(<PyObject*>metadata.numpy_dtype, metadata.dims,
                              <PyObject*>cnp.PyArray_DESCR(array), cnp.PyArray_NDIM(array),
                              cnp.PyArray_DIMS(array))


cdef inline bint numpy_scalar_matches(InputMetadata metadata, object grad) noexcept:
    """The fast path of validate_outputs for a numpy scalar (numpy's result
    of arithmetic on 0-d arrays: ``np.ones(()) * 2.0`` is an np.float64)
    that ``has_numpy_backend``, flowing into a 0-d slot with the fast path's
    dtype: the shared slow path passes it as it is where its dtype equals
    the slot's, which holds for the dtype's own scalar type in native byte
    order (a swapped slot dtype takes the slow path, which casts)."""
    cdef cnp.dtype expected_dtype = metadata.numpy_dtype
    if expected_dtype is None or metadata.dims.size() != 0:
        return False
    if (<PyObject*>Py_TYPE(grad) != <PyObject*>expected_dtype.typeobj
            or not cnp.PyDataType_ISNOTSWAPPED(expected_dtype)):
        return False
    return has_numpy_backend(grad)


cdef inline bint numpy_fields_match(PyObject* expected_dtype, const vector[cnp.npy_intp]& expected_dims,
                                    PyObject* dtype, int ndim,
                                    const cnp.npy_intp* dims) noexcept nogil:
    """Whether an array's dtype (its descriptor), ndim and dims are a slot's
    (``InputMetadata.numpy_dtype``, None unless the slot is a floating or
    complex numpy dtype on the CPU, and ``InputMetadata.dims``)."""
    if expected_dtype == <PyObject*>None or dtype != expected_dtype:
        return False
    return same_dims(ndim, dims, expected_dims)


cdef bint known_value_type(object value_type) noexcept


cdef inline object slot_metadata(NodeBase node, Py_ssize_t input_nr):
    """The InputMetadata of ``node``'s slot ``input_nr``, or None (no
    metadata, or a slot past them)."""
    # A tuple of checked types: See Note [Fields Python code can write] in
    # pyengine/_pure/node.py.
    cdef tuple slots = node._input_metadata
    if input_nr < PyTuple_GET_SIZE(slots):
        return <object>PyTuple_GET_ITEM(slots, input_nr)
    return None


cdef inline bint gradient_passes_as_is(NodeBase next_node, Py_ssize_t input_nr,
                                       object grad) noexcept:
    """Whether ``grad``, flowing into slot ``input_nr`` of ``next_node``,
    passes validate_outputs as it is: None; a numpy array of the slot's
    dtype, shape and device; for a slot without metadata, a value of a type
    some backend handles. Anything else takes the shared slow path."""
    if grad is None:
        return True
    cdef object metadata = slot_metadata(next_node, input_nr)
    if metadata is None:
        return known_value_type(type(grad))
    return numpy_gradient_matches(<InputMetadata>metadata, grad)


cdef int validate_outputs_impl(tuple edges, list grads, object format_error,
                               object node, bint exact) except -1
