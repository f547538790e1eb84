# The engine's view of a node; see _node.pyx.

cimport cython
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from libcpp.vector cimport vector

cimport numpy as cnp
from libc.string cimport memcmp

from pyengine._locks cimport GILGuardedLock


cdef class InputMetadata:
    cdef readonly tuple shape
    cdef readonly object dtype
    cdef readonly object device
    cdef readonly bint is_cpu
    # For validate_outputs' numpy fast path: set when dtype is a numpy dtype
    # and device is the CPU; immutable after construction.
    cdef cnp.dtype numpy_dtype
    cdef vector[cnp.npy_intp] dims


cdef class NodeBase:
    # Checked when set, through the properties of the same names: Edges or
    # None, and InputMetadata or None; immutable tuples, so that no Python
    # code can change them in place. See Note [Fields Python code can write]
    # in pyengine/_pure/node.py.
    cdef tuple _next_edges
    cdef tuple _input_metadata
    cdef readonly uint64_t _sequence_nr
    # The count, the search and the routing read these (and the reference
    # count) of every node, so they lie within the object's first 64 bytes
    # (benchmarks/RESULTS.md, "The fields the count reads, together"); no
    # vtable pointer comes before them, as NodeBase has no cdef methods. The
    # flags are bytes, behind properties of the names without the trailing
    # underscore (as the twin's slots), so that the only next edge fits
    # without growing the object. See Note [A node's only next edge] in
    # pyengine/_pure/node.py. _only_next_node and _only_input_nr are set
    # with _next_edges, never alone.
    cdef uint8_t _initialized_
    cdef uint8_t _released_
    # Whether the node's class overrides release_variables, when the node
    # was made; immutable after construction. See Note [Overriding release
    # variables] in pyengine/_pure/node.py.
    cdef uint8_t _overrides_release_variables_
    # Whether every input slot with metadata is on the CPU: on_cpu of
    # _input_metadata, kept with it (the InputMetadata are immutable), so
    # that routing a task reads one byte. It fills the byte before
    # _only_input_nr that alignment left free.
    cdef uint8_t _on_cpu_
    cdef readonly int32_t _only_input_nr
    # Where the count last put the node in a DependencyMap: a hint that
    # the map checks before it trusts it. See Note [A node keeps its
    # slot's index] in pyengine/_dependency_map.h.
    cdef uint32_t _dependency_slot_
    cdef readonly NodeBase _only_next_node
    cdef public list _pre_hooks
    cdef public list _post_hooks
    cdef public list _tensor_pre_hooks
    cdef public dict _retains_grad_hooks
    cdef public object _saved_values
    cdef public object _stream
    cdef public dict _metadata
    cdef object __weakref__


cdef class GradientFreeNodeBase(NodeBase):
    # Immutable after construction.
    cdef readonly object owner
    cdef readonly str method


@cython.final
cdef class GradLock:
    cdef GILGuardedLock lock_
    cdef int lock(self) except -1
    cdef void unlock(self) noexcept


cdef class LeafState:
    # Immutable after construction.
    cdef readonly GradLock lock
    # Guarded by lock: None or a weak reference to the .grad pyengine stored.
    cdef object _owned_grad
    # Replaced (never edited) under the GIL.
    cdef public object accumulator
    cdef public object tensor_pre_hooks
    cdef public object post_accumulate_grad_hooks
    # Set by the framework (read under lock): keep an indexed .grad indexed.
    cdef public bint keep_indexed

    cpdef object owned_grad(self)
    cpdef set_owned_grad(self, grad)


cdef class AccumulateGradBase(NodeBase):
    # Set once by the subclass's __init__. leaf_state is never None: a fresh
    # LeafState until then, and checked when set (by the property of the
    # same name).
    cdef public object variable
    cdef LeafState leaf_state


cdef class Edge:
    cdef readonly NodeBase node
    cdef readonly Py_ssize_t input_nr


cdef bint is_numpy_array(object value) noexcept
cdef bint has_numpy_backend(object value) noexcept
cdef bint numpy_scalars(object value, object other) noexcept


cdef inline bint same_dims(int ndim, const cnp.npy_intp* dims,
                           const vector[cnp.npy_intp]& expected_dims) noexcept nogil:
    """Whether an array's ndim and dims are a slot's (``InputMetadata.dims``,
    kept for the numpy fast path)."""
    if <size_t>ndim != expected_dims.size():
        return False
    return ndim == 0 or memcmp(dims, expected_dims.data(), ndim * sizeof(cnp.npy_intp)) == 0
