# validate_outputs; see _validate_outputs.pyx.

from cpython.object cimport PyObject
from libcpp.vector cimport vector

cimport numpy as cnp

from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

from pyengine._node cimport InputMetadata, NodeBase, is_numpy_array, same_dims


cdef inline bint numpy_gradient_matches(InputMetadata metadata, object grad) noexcept:
    """The fast path of validate_outputs: a numpy array that the built-in
    numpy backend handles (See Note [Replacing the numpy backend] in
    pyengine/backends.py), whose dtype, shape and device are the slot's.
    Reads the array's fields, then compares them in ``numpy_fields_match``."""
    if not is_numpy_array(grad):
        return False
    cdef cnp.ndarray array = <cnp.ndarray>grad
    return numpy_fields_match(<PyObject*>metadata.numpy_dtype, metadata.dims,
                              <PyObject*>cnp.PyArray_DESCR(array), cnp.PyArray_NDIM(array),
                              cnp.PyArray_DIMS(array))


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
