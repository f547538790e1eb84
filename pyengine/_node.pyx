"""The engine's view of a backward-graph node: NodeBase, Edge, InputMetadata,
and the base of the two kinds of node the engine itself defines,
GradientFreeNodeBase and AccumulateGradBase.

``NodeBase`` holds, in C fields, exactly the per-node state the engine reads
while it runs (next edges, input metadata, sequence number, hook lists,
stream); the user-facing methods live on :class:`pyengine.Node`, which
subclasses it. Twin: ``pyengine/_pure/node.py``, whose docstrings state the
fields' guards (all guarded by the GIL).
"""

cimport cython
cimport numpy as cnp
from cpython.dict cimport PyDict_GetItemWithError
from cpython.exc cimport PyErr_Clear
from cpython.list cimport PyList_GET_SIZE
from cpython.number cimport PyNumber_Add, PyNumber_Index, PyNumber_InPlaceAdd
from cpython.object cimport PyObject, PyObject_TypeCheck, PyTypeObject, Py_TYPE
from cpython.pystate cimport PyThreadState_Get
from cpython.ref cimport Py_INCREF, Py_REFCNT, Py_XDECREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.weakref cimport PyWeakref_GET_OBJECT, PyWeakref_NewRef
from libc.stdint cimport INT32_MAX, int32_t, uint64_t, UINT64_MAX

from pyengine._interrupts cimport WORK_BETWEEN_YIELDS, let_others_run
from pyengine._state cimport ThreadState, anomaly_enabled, thread_state

import operator
import numpy as np

from pyengine import backends as _backends
from pyengine.backends import backend_of, backend_to_add, check_backend_result, no_backend_to_copy
from pyengine.device import CPU, Device, as_device
from pyengine.indexed import IndexedGradient

from pyengine._shared import task_queries as _task_queries
from pyengine._shared.gradient_checks import REDUCE, gradient_policy_of
from pyengine._shared.hooks import call_post_accumulate_grad_hooks
from pyengine._shared.messages import (MAX_INPUT_NR, _cannot_delete, _input_nr_error, _leaf_state_error,
                                       accumulate_grad_grads_message, cannot_pickle_message,
                                       grad_lock_not_held_message, grad_lock_taken_again_message,
                                       metadata_size, negative_size_message,
                                       no_value_backend_message, node_name,
                                       not_initialized_message, shape_not_sizes_message,
                                       uninitialized_metadata_message)
from pyengine._shared.node_streams import _creation_stream
from pyengine._state import get_current_node

cnp.import_array()

# AccumulateGrad sorts before every other node: See Note [AccumulateGrad first].
ACCUMULATE_GRAD_SEQUENCE_NR = UINT64_MAX

cdef extern from "_sequence_nr.h":
    uint64_t pyengine_next_sequence_nr


def _normalize_dtype(dtype):
    # numpy dtypes are kept as np.dtype objects so that the fast path can
    # compare descriptors by identity; other dtypes (a framework's) stay as given.
    if isinstance(dtype, np.dtype):
        return dtype
    normalized = dtype
    try:
        normalized = np.dtype(dtype)
    except TypeError:
        # No return in here: See Note [Python allocations that fail] in
        # pyengine/_engine.pyx (a return in an except clause).
        pass
    return normalized


@cython.final
cdef class InputMetadata:
    """Shape, dtype and device of the forward output an input slot stands for.

    ``device`` is a :class:`pyengine.Device` or a str that names one
    (``"cpu"``, ``"cuda:1"``: See ``as_device`` in ``pyengine/device.py``).
    Immutable after construction.
    """

    def __init__(self, shape, dtype, device=CPU):
        if self.shape is not None:
            # Its fields and the fast path's copy of them must agree.
            raise TypeError("InputMetadata is immutable: its __init__ ran already")
        # See Note [InputMetadata sizes] in pyengine/_shared/messages.py.
        if isinstance(shape, (str, bytes, bytearray)):
            raise TypeError(shape_not_sizes_message(shape))
        # A loop, not a list comprehension: See Note [Python allocations
        # that fail] in pyengine/_engine.pyx.
        sizes = []
        cdef Py_ssize_t position = 0
        for size in shape:
            sizes.append(metadata_size(size, position))
            position += 1
        shape = tuple(sizes)
        dtype = _normalize_dtype(dtype)
        if type(device) is not Device:
            device = as_device(device)
        cdef bint is_cpu = device == CPU
        # A numeric slot may take the fast path, which passes only a gradient
        # of the slot's very dtype and shape; the slow path casts the others.
        cdef bint fast_path = is_cpu and isinstance(dtype, np.dtype) and dtype.kind in "biufc"
        # Every size must fit a C size (OverflowError, as the twin's), though
        # only the fast path keeps them.
        cdef vector[cnp.npy_intp] dims
        for size in shape:
            dims.push_back(size)
            if dims.back() < 0:
                raise ValueError(negative_size_message(shape, dims.size() - 1))
        if not fast_path:
            dims.clear()
        # Set once nothing can fail: an __init__ that raised leaves no field
        # set, not a fast path whose sizes disagree with the shape. The code
        # above ran Python code (an __index__, a device's __eq__), which may
        # have run this __init__ to its end already: asked again, and no
        # Python code runs from here on.
        if self.shape is not None:
            raise TypeError("InputMetadata is immutable: its __init__ ran already")
        # A swap, not a copy: it allocates nothing, so it cannot fail (See
        # Note [C++ allocations that fail] in pyengine/_engine.pyx).
        self.dims.swap(dims)
        self.numpy_dtype = dtype if fast_path else None
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.is_cpu = is_cpu

    @classmethod
    def from_value(cls, value):
        """Metadata of an array or framework value, read through its backend."""
        backend = backend_of(value)
        if backend is None:
            raise TypeError(no_value_backend_message(value))
        return cls(backend.shape(value), backend.dtype(value), backend.device(value))

    def is_same_shape(self, value):
        """Whether ``value`` has this slot's shape (PyTorch's
        ``InputMetadata::is_same_shape``), read through its backend
        (TypeError where none handles it); False for a metadata whose
        ``__init__`` never ran, which has no shape."""
        cdef cnp.ndarray array
        if self.numpy_dtype is not None and is_numpy_array(value):
            # The dimensions the fast path keeps, compared in C: this is
            # part of every backward's fixed cost (See Note [The frontend's
            # fixed cost] in pyengine/autograd.py).
            array = <cnp.ndarray>value
            return same_dims(cnp.PyArray_NDIM(array), cnp.PyArray_DIMS(array), self.dims)
        if self.shape is None:
            return False
        backend = backend_of(value)
        if backend is None:
            raise TypeError(no_value_backend_message(value))
        return tuple(backend.shape(value)) == self.shape

    def __eq__(self, other):
        if not isinstance(other, InputMetadata):
            return NotImplemented
        return (self.shape, self.dtype, self.device) == (other.shape, other.dtype, other.device)

    __hash__ = None

    def __repr__(self):
        return f"InputMetadata(shape={self.shape}, dtype={self.dtype}, device={self.device})"

    def __reduce__(self):
        return InputMetadata, (self.shape, self.dtype, self.device)


def as_input_metadata(spec):
    """An InputMetadata from an InputMetadata, ``None``, a ``(shape, dtype[, device])``
    tuple or a value to read it from."""
    if spec is None:
        return spec
    if isinstance(spec, InputMetadata):
        if (<InputMetadata>spec).shape is None:
            raise TypeError(uninitialized_metadata_message("an input's metadata"))
        return spec
    if isinstance(spec, tuple) and 2 <= len(spec) <= 3:
        return InputMetadata(*spec)
    return InputMetadata.from_value(spec)


@cython.final
@cython.trashcan(True)
cdef class Edge:
    """Which input slot (``input_nr``) of which ``node`` a gradient flows into.

    Immutable after construction; equal when both node (by identity) and
    slot are. See Note [Edge input_nr] in ``pyengine/_shared/messages.py``
    for the values ``input_nr`` may take.
    """

    def __cinit__(self, node, input_nr=0):
        # In __cinit__, not __init__: no Edge exists without a checked node
        # (Edge.__new__(Edge) is a TypeError), and none changes after.
        if not isinstance(node, NodeBase):
            raise TypeError(f"Edge needs a Node, got {type(node).__name__}")
        if not (<NodeBase>node)._initialized_:
            raise RuntimeError(not_initialized_message(node))
        self.node = node
        self.input_nr = _check_input_nr(<NodeBase>node, input_nr)

    def __eq__(self, other):
        if not isinstance(other, Edge):
            return NotImplemented
        return self.node is (<Edge>other).node and self.input_nr == (<Edge>other).input_nr

    def __hash__(self):
        return hash((id(self.node), self.input_nr))

    def __iter__(self):
        # Unpacks like PyTorch's next_functions pairs: ``node, input_nr = edge``.
        yield self.node
        yield self.input_nr

    def __repr__(self):
        return f"Edge({node_name(self.node)}, {self.input_nr})"

    def __reduce__(self):
        # copy, deepcopy and pickle: See Note [Copying a GradientFreeNode]
        # in the twin.
        return Edge, (self.node, self.input_nr)


cdef Py_ssize_t _check_input_nr(NodeBase node, object input_nr) except -1:
    """``input_nr`` as an index of one of ``node``'s input slots: See Note
    [Edge input_nr] in the twin."""
    try:
        index = PyNumber_Index(input_nr)
    except TypeError:
        raise TypeError(_input_nr_error(node, input_nr)) from None
    if index < 0 or (index >= MAX_INPUT_NR and index >= PyTuple_GET_SIZE(node._input_metadata)):
        raise ValueError(_input_nr_error(node, index))
    return index


cdef bint on_cpu(tuple input_metadata) noexcept:
    """Whether every input slot with metadata is on the CPU."""
    cdef PyObject* metadata
    if input_metadata is None:
        return True
    # Borrowed items: the tuple holds them while this loop runs no Python code.
    for i in range(PyTuple_GET_SIZE(input_metadata)):
        metadata = PyTuple_GET_ITEM(input_metadata, i)
        # The tuple was checked when set: See Note [Fields Python code can write].
        if metadata != <PyObject*>None and not (<InputMetadata>metadata).is_cpu:
            return False
    return True


cdef tuple _check_next_edges(next_edges):
    next_edges = tuple(next_edges)
    # A node of a million edges (a GraphRoot of a million roots): See Note
    # [Long passes let other threads run] in _interrupts.pxd.
    cdef Py_ssize_t work_left = WORK_BETWEEN_YIELDS
    for i, edge in enumerate(next_edges):
        let_others_run(&work_left)
        if edge is not None and not isinstance(edge, Edge):
            raise TypeError(f"next_edges[{i}] must be an Edge or None, got {type(edge).__name__}")
    return next_edges


cdef tuple _check_input_metadata(input_metadata):
    input_metadata = tuple(input_metadata)
    cdef Py_ssize_t work_left = WORK_BETWEEN_YIELDS
    for i, metadata in enumerate(input_metadata):
        let_others_run(&work_left)
        if metadata is not None and not isinstance(metadata, InputMetadata):
            raise TypeError(f"input_metadata[{i}] must be an InputMetadata or None, got "
                            f"{type(metadata).__name__}")
        if metadata is not None and (<InputMetadata>metadata).shape is None:
            raise TypeError(uninitialized_metadata_message(f"input_metadata[{i}]"))
    return input_metadata


cdef object running_graph_task(NodeBase node, str query):
    """The graph task running ``node`` on this thread, read from the
    thread state; RuntimeError where none does. See Note [Queries a
    running node makes] in pyengine/_shared/task_queries.py."""
    cdef ThreadState* thread = thread_state()
    if (thread.current_node == <PyObject*>node and thread.current_graph_task != NULL
            and thread.current_node_graph_task == thread.current_graph_task):
        return <object>thread.current_graph_task
    raise RuntimeError(_task_queries.not_running_message(node, query, get_current_node()))


# trashcan: dropping a long chain of nodes must not recurse in C.
@cython.trashcan(True)
cdef class NodeBase:
    """The per-node state the engine reads; see :class:`pyengine.Node`."""

    # Read from the node's class when a gradient takes validate_outputs'
    # slow path: See Note [Gradient policy] in the twin.
    gradient_policy = REDUCE

    @property
    def _gradient_policy(self):
        """The class's ``gradient_policy``, checked (See Note [Gradient
        policy] in the twin)."""
        return gradient_policy_of(self)

    def __cinit__(self, *args, **kwargs):
        self._next_edges = ()
        _keep_input_metadata(self, ())
        self._only_input_nr = -1

    def __init__(self, next_edges=(), input_metadata=()):
        _initialize_node(self, next_edges, input_metadata)

    def __reduce__(self):
        # A node is neither copied nor pickled (nor are torch's), but a
        # GradientFreeNode: See Note [Copying and pickling the engine's
        # objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))

    @property
    def _initialized(self):
        return bool(self._initialized_)

    @property
    def _overrides_release_variables(self):
        return bool(self._overrides_release_variables_)

    @property
    def _released(self):
        return bool(self._released_)

    @_released.setter
    def _released(self, released):
        # Its truth value, as the bint it was.
        self._released_ = bool(released)

    @_released.deleter
    def _released(self):
        _cannot_delete("_released")

    @property
    def sequence_nr(self):
        return self._sequence_nr

    @property
    def next_edges(self):
        return self._next_edges

    @next_edges.setter
    def next_edges(self, next_edges):
        _set_next_edges(self, next_edges)

    @next_edges.deleter
    def next_edges(self):
        _cannot_delete("next_edges")

    # The engine's fields, for Python code: checked when set, as next_edges
    # is. See Note [Fields Python code can write] in the twin.
    @property
    def _next_edges(self):
        return self._next_edges

    @_next_edges.setter
    def _next_edges(self, next_edges):
        _set_next_edges(self, next_edges)

    @_next_edges.deleter
    def _next_edges(self):
        _cannot_delete("_next_edges")

    @property
    def _input_metadata(self):
        return self._input_metadata

    @_input_metadata.setter
    def _input_metadata(self, input_metadata):
        _keep_input_metadata(self, _check_input_metadata(input_metadata))
        if self._stream is None and not self._on_cpu_:
            self._stream = _creation_stream(self._input_metadata)

    @_input_metadata.deleter
    def _input_metadata(self):
        _cannot_delete("_input_metadata")

    @property
    def input_metadata(self):
        return self._input_metadata

    def num_inputs(self):
        return len(self._input_metadata)

    def add_input_metadata(self, spec):
        """Append an input slot described by ``spec``; return its index."""
        # A new tuple: See Note [Shared empty input metadata].
        _keep_input_metadata(self, self._input_metadata + (as_input_metadata(spec),))
        if self._stream is None and not self._on_cpu_:
            self._stream = _creation_stream(self._input_metadata)
        return len(self._input_metadata) - 1

    @property
    def metadata(self):
        if self._metadata is None:
            self._metadata = {}
        return self._metadata

    @property
    def stream(self):
        return self._stream

    def apply(self, grads):
        raise NotImplementedError(f"{type(self).__name__} must override apply(grads)")

    def task_should_compute_output(self, output_edge_index):
        """Whether the gradient ``apply`` returns for next edge
        ``output_edge_index`` will be used: False for a missing edge or one
        into a node that ``grad(inputs=)`` / ``backward(inputs=)`` prunes.
        Only while the engine runs this node; see the twin's docstring and
        Note [Queries a running node makes] in pyengine/_shared/task_queries.py."""
        return running_graph_task(self, "task_should_compute_output").should_compute_output(
            self, output_edge_index)

    def task_buffered_gradient(self, output_edge_index):
        """A copy of the sum that the InputBuffer of next edge
        ``output_edge_index``'s node holds so far at that edge's slot, or
        None. Only while the engine runs this node; see the twin's
        docstring and Note [Queries a running node makes] in
        pyengine/_shared/task_queries.py."""
        return _task_queries.buffered_gradient(
            self, running_graph_task(self, "task_buffered_gradient"), output_edge_index)

    def release_variables(self):
        """Drop what the node saved for backward. Override it in a subclass to
        free more: the engine calls the method of the node's class, as C++
        calls a virtual method, where the class overrode it when the node was
        made. See Note [Overriding release variables] in the twin."""
        self._saved_values = None


# Functions, not cdef methods: NodeBase has no vtable pointer, so the fields
# the count and the routing read fit the object's first 64 bytes. See
# Note [A node keeps its slot's index] in pyengine/_dependency_map.h.

cdef int _initialize_node(NodeBase self, next_edges, input_metadata) except -1:
    """A node's fields as ``NodeBase.__init__`` sets them (a subclass's
    ``__init__`` of another signature calls it too)."""
    global pyengine_next_sequence_nr
    _set_next_edges(self, next_edges)
    # Nothing to make for the default (): See Note [Shared empty input metadata].
    if type(input_metadata) is tuple and PyTuple_GET_SIZE(input_metadata) == 0:
        _keep_input_metadata(self, ())
    else:
        # A loop, not a list comprehension: See Note [Python allocations
        # that fail] in pyengine/_engine.pyx.
        specs = []
        for spec in input_metadata:
            specs.append(as_input_metadata(spec))
        _keep_input_metadata(self, tuple(specs))
    self._sequence_nr = pyengine_next_sequence_nr
    pyengine_next_sequence_nr += 1
    # See Note [Overriding release variables] in the twin.
    self._overrides_release_variables_ = (
        getattr(type(self), "release_variables") is not _base_release_variables)
    if not self._on_cpu_:
        self._stream = _creation_stream(self._input_metadata)
    self._initialized_ = True
    if anomaly_enabled():
        _record_forward_traceback(self)
    return 0


cdef inline void _keep_input_metadata(NodeBase self, tuple input_metadata) noexcept:
    """``_input_metadata``, checked by the caller, and with it ``_on_cpu_``."""
    self._input_metadata = input_metadata
    self._on_cpu_ = on_cpu(input_metadata)


cdef int _set_next_edges(NodeBase self, next_edges) except -1:
    """``_next_edges``, checked, and with it the node's only next edge
    (See Note [A node's only next edge] in the twin)."""
    cdef tuple edges = _check_next_edges(next_edges)
    cdef object only_edge = None
    if PyTuple_GET_SIZE(edges) == 1:
        only_edge = <object>PyTuple_GET_ITEM(edges, 0)
        if only_edge is not None and (<Edge>only_edge).input_nr > INT32_MAX:
            only_edge = None
    # The old values are let go of only when all three fields are set:
    # a node freed with them may run Python code (a __del__), which must
    # not find the fields half set, nor set them in between.
    cdef tuple old_edges = self._next_edges
    cdef NodeBase old_only_next_node = self._only_next_node
    self._next_edges = edges
    if only_edge is None:
        self._only_next_node = None
        self._only_input_nr = -1
    else:
        self._only_next_node = (<Edge>only_edge).node
        self._only_input_nr = <int32_t>(<Edge>only_edge).input_nr
    return 0


# What NodeBase.release_variables is, looked up on a class that does not
# override it.
cdef object _base_release_variables = NodeBase.__dict__["release_variables"]


cdef extern from "Python.h":
    object PyObject_CallMethodNoArgs(object obj, object name)


cdef class GradientFreeNodeBase(NodeBase):
    """A node that passes no gradients: running it calls ``owner.<method>()``.
    See Note [GradientFreeNode] in the twin, ``pyengine/_pure/node.py``,
    which states the fields' guards."""

    def __init__(self, owner, method, next_edges=(), input_metadata=()):
        if not isinstance(method, str):
            raise TypeError(f"method must be a str (a method name), got {type(method).__name__}")
        _initialize_node(self, next_edges, input_metadata)
        self.owner = owner
        self.method = method

    def apply(self, grads):
        # getattr(owner, method)(), without the bound method in between.
        PyObject_CallMethodNoArgs(self.owner, self.method)
        return [None] * PyTuple_GET_SIZE(self._next_edges)

    def __reduce__(self):
        # See Note [Copying a GradientFreeNode] in the twin.
        return type(self), (self.owner, self.method, self._next_edges)


# A C copy of backends.numpy_backend_is_builtin, refreshed by register_backend
# (through _registration_listeners); written and read under the GIL.
cdef bint _numpy_backend_is_builtin = True


def _refresh_numpy_backend_is_builtin():
    global _numpy_backend_is_builtin
    _numpy_backend_is_builtin = _backends.numpy_backend_is_builtin
    forget_numpy_backend_types()


_backends._registration_listeners.append(_refresh_numpy_backend_is_builtin)
_refresh_numpy_backend_is_builtin()


cdef bint is_numpy_array(object value) noexcept:
    """Whether ``value`` is an exact numpy array that the built-in numpy
    backend handles (no backend registered over it): the twin's, reading
    the flag's C copy. See Note [Replacing the numpy backend] in
    pyengine/backends.py."""
    return type(value) is cnp.ndarray and _numpy_backend_is_builtin


# backend_of's cache, type -> backend or None; register_backend clears it in
# place, so this reference stays the live cache.
cdef dict _backend_cache = _backends._backend_cache
cdef object _NUMPY = _backends.NUMPY
cdef type _numpy_generic = np.generic


# The first few types has_numpy_backend found mapped to NUMPY (np.float64,
# np.float32, ...), so that a graph of numpy scalars pays a comparison or
# two per gradient, not a dict lookup. Held references: a type freed and
# another made at its address must not pass. A slot is only ever filled
# here, never replaced, so that no type is let go of (and no Python code
# runs) in the middle of the engine's loop; register_backend's listener
# empties them all, since any change of the registrations may change a
# type's backend.
DEF NUMPY_BACKEND_TYPES = 4
cdef PyObject* _numpy_backend_types[NUMPY_BACKEND_TYPES]


cdef bint has_numpy_backend(object value) noexcept:
    """Whether ``backend_of(value)`` is known to be the built-in ``NUMPY``:
    see the twin's. This core asks backend_of's cache only of a type whose
    metaclass is ``type``, whose hash and comparison run no Python code (a
    metaclass's ``__hash__`` or ``__eq__`` could, in the lookup); another
    takes the slow path, which finds the same backend. (A key already in
    the cache whose metaclass defines both could still run Python code in
    the lookup, should its hash collide with this type's: the type is held
    here, and ``value`` not read after.)"""
    cdef PyObject* value_type_pointer = <PyObject*>Py_TYPE(value)
    cdef int i
    for i in range(NUMPY_BACKEND_TYPES):
        if _numpy_backend_types[i] == value_type_pointer:
            return True
    value_type = type(value)
    if <PyObject*>Py_TYPE(value_type) != <PyObject*>type:
        return False
    cdef PyObject* backend = PyDict_GetItemWithError(_backend_cache, value_type)
    if backend == NULL:
        # Not in the cache, or a colliding key's __eq__ raised.
        PyErr_Clear()
        return False
    if backend != <PyObject*>_NUMPY:
        return False
    for i in range(NUMPY_BACKEND_TYPES):
        if _numpy_backend_types[i] == NULL:
            Py_INCREF(value_type)
            _numpy_backend_types[i] = <PyObject*>value_type
            break
    return True


cdef bint numpy_scalars(object value, object other) noexcept:
    """Whether ``value`` and ``other`` are both numpy scalars that
    ``has_numpy_backend``: see the twin's."""
    return (PyObject_TypeCheck(value, <PyTypeObject*>_numpy_generic)
            and PyObject_TypeCheck(other, <PyTypeObject*>_numpy_generic)
            and has_numpy_backend(value) and has_numpy_backend(other))


cdef void forget_numpy_backend_types():
    """Empties has_numpy_backend's slots (the types' references let go of
    last, once no slot holds them)."""
    cdef PyObject* held[NUMPY_BACKEND_TYPES]
    cdef int i
    for i in range(NUMPY_BACKEND_TYPES):
        held[i] = _numpy_backend_types[i]
        _numpy_backend_types[i] = NULL
    for i in range(NUMPY_BACKEND_TYPES):
        Py_XDECREF(held[i])


cdef inline bint can_steal(object value, Py_ssize_t expected_references) noexcept:
    """Whether nothing outside the engine can see ``value``, so that it may
    become ``.grad`` without a copy. ``value`` is borrowed from the caller's
    reference; ``expected_references``: the engine's, the caller's included
    (the twin counts two more: its argument and getrefcount's)."""
    if type(value) is not cnp.ndarray or Py_REFCNT(value) > expected_references:
        return False
    cdef cnp.ndarray array = <cnp.ndarray>value
    return (cnp.PyArray_BASE(array) == NULL
            and cnp.PyArray_CHKFLAGS(array, cnp.NPY_ARRAY_OWNDATA)
            and cnp.PyArray_ISWRITEABLE(array))


cdef object copy_value(object value):
    if is_numpy_array(value):
        # np.array(value, copy=True), the numpy backend's copy.
        return cnp.PyArray_NewCopy(<cnp.ndarray>value, cnp.NPY_KEEPORDER)
    backend = backend_of(value)
    if backend is None:
        # validate_outputs found one; Python code run since (a backend's
        # method, a hook) may have unregistered it.
        raise no_backend_to_copy(value, "the variable's .grad")
    # See Note [What a backend returns] in pyengine/backends.py.
    return check_backend_result(backend.copy(value), backend, "copy", "the variable's .grad")


cdef object add_arrays(object grad, object new_grad):
    """The numpy backend's ``add`` of two numpy arrays: an array at every
    rank (numpy's own sum of 0-d arrays is a scalar)."""
    total = PyNumber_Add(grad, new_grad)
    if type(total) is not cnp.ndarray:
        total = cnp.PyArray_FROM_O(total)
    return total


cdef object add_in_place(object grad, object new_grad):
    if is_numpy_array(grad) and type(new_grad) is cnp.ndarray:
        if cnp.PyArray_ISWRITEABLE(<cnp.ndarray>grad):
            # np.add(grad, new_grad, out=grad), the numpy backend's add_.
            return PyNumber_InPlaceAdd(grad, new_grad)
        return add_arrays(grad, new_grad)
    backend = backend_to_add(grad, "the variable's .grad")
    # See Note [What a backend returns] in pyengine/backends.py.
    return check_backend_result(backend.add_(grad, new_grad), backend, "add_",
                                "the variable's .grad")


cdef object add_values(object grad, object new_grad):
    if is_numpy_array(grad) and type(new_grad) is cnp.ndarray:
        return add_arrays(grad, new_grad)
    backend = backend_to_add(grad, "the variable's .grad")
    # See Note [What a backend returns] in pyengine/backends.py.
    return check_backend_result(backend.add(grad, new_grad), backend, "add",
                                "the variable's .grad")


@cython.final
cdef class GradLock:
    """The lock of a leaf's ``.grad``: See Note [The lock of a leaf's .grad]
    in the twin, ``pyengine/_pure/node.py``. A GILGuardedLock (See Note [A
    lock the GIL guards] in _gil_guarded_lock.h), which AccumulateGrad takes
    in C; Python code takes it with ``with`` or ``acquire``/``release``."""

    cdef int lock(self) except -1:
        cdef int result = self.lock_.lock()
        if result == 0:
            return 0
        if result > 0:
            raise RuntimeError(grad_lock_taken_again_message())
        return -1  # a signal handler raised while it waited: its exception is set

    cdef void unlock(self) noexcept:
        self.lock_.unlock()

    def __init__(self):
        # Takes no arguments, as the twin's.
        pass

    def acquire(self):
        """Wait for the lock (letting other threads run, and honouring
        Ctrl-C) and take it; RuntimeError where this thread holds it."""
        self.lock()
        return True

    def release(self):
        """Let go of the lock; RuntimeError where this thread does not hold it."""
        if not self.lock_.held_by(PyThreadState_Get()):
            raise RuntimeError(grad_lock_not_held_message())
        self.lock_.unlock()

    def held(self):
        """Whether this thread holds the lock."""
        return self.lock_.held_by(PyThreadState_Get())

    def __enter__(self):
        self.lock()
        return True

    def __exit__(self, *exc_info):
        self.release()

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))


@cython.final
cdef class LeafState:
    """What pyengine keeps on a leaf tensor. See the twin's docstring for each
    field; the .pxd says how each is guarded."""

    def __cinit__(self):
        self.lock = GradLock()

    def __init__(self):
        # A __cinit__ of self alone ignores arguments; the twin's takes none.
        pass

    def __reduce__(self):
        # A copied or pickled tensor starts with fresh engine state (as the twin).
        return (LeafState, ())

    cpdef object owned_grad(self):
        """The ``.grad`` array pyengine stored, if it is still alive, else None."""
        if self._owned_grad is None:
            return None
        return <object>PyWeakref_GET_OBJECT(self._owned_grad)

    cpdef set_owned_grad(self, grad):
        if grad is None:
            self._owned_grad = None
            return
        try:
            self._owned_grad = PyWeakref_NewRef(grad, None)
        except TypeError:
            # Not weakly referenceable: never add into it in place.
            self._owned_grad = None


cdef LeafState _check_leaf_state(leaf_state):
    if not isinstance(leaf_state, LeafState):
        raise TypeError(_leaf_state_error(leaf_state))
    return <LeafState>leaf_state


cdef class AccumulateGradBase(NodeBase):
    """The sink of a leaf: ``apply`` accumulates into ``variable.grad``. See
    Note [Accumulating into .grad] in the twin, ``pyengine/_pure/node.py``,
    which states the fields. numpy arrays take C paths that do what the
    numpy backend's ``copy``, ``add_`` and ``add`` do; other values go
    through their backend."""

    def __cinit__(self, *args, **kwargs):
        # apply reads leaf_state in C: it is never None (See Note [Fields
        # Python code can write] in the twin).
        self.leaf_state = LeafState()

    @property
    def leaf_state(self):
        return self.leaf_state

    @leaf_state.setter
    def leaf_state(self, leaf_state):
        self.leaf_state = _check_leaf_state(leaf_state)

    @leaf_state.deleter
    def leaf_state(self):
        _cannot_delete("leaf_state")

    def apply(self, grads):
        if type(grads) is not list:
            raise TypeError(accumulate_grad_grads_message(grads))
        if PyList_GET_SIZE(<list>grads) == 0:
            raise ValueError(accumulate_grad_grads_message(grads))
        new_grad = grads[0]
        cdef object variable = self.variable
        cdef LeafState leaf_state = self.leaf_state
        # Taken in C: See Note [The lock of a leaf's .grad] in the twin.
        cdef GradLock lock = leaf_state.lock
        cdef bint create_graph
        if new_grad is not None:
            grads[0] = None
            create_graph = thread_state().grad_enabled
            lock.lock()
            try:
                old_grad = variable.grad
                if (old_grad is None and type(new_grad) is IndexedGradient
                        and not leaf_state.keep_indexed):
                    # See Note [Where an indexed gradient goes] in pyengine/indexed.py.
                    new_grad = new_grad.to_dense()
                if old_grad is None:
                    # See Note [Stealing with post hooks] in the twin.
                    if create_graph or not can_steal(new_grad, 2 if self._post_hooks else 1):
                        new_grad = copy_value(new_grad)
                    variable.grad = new_grad
                elif old_grad is leaf_state.owned_grad() and not create_graph:
                    variable.grad = add_in_place(old_grad, new_grad)
                else:
                    variable.grad = add_values(old_grad, new_grad)
                leaf_state.set_owned_grad(variable.grad)
            finally:
                lock.unlock()
        hooks = leaf_state.post_accumulate_grad_hooks
        if hooks:
            # See Note [Post accumulate grad hooks] in pyengine/_shared/hooks.py.
            call_post_accumulate_grad_hooks(variable, hooks)
        # A list, which the engine takes as it is (it makes one of any other
        # sequence): an AccumulateGrad runs once per leaf per backward.
        return []


def _record_forward_traceback(node):
    import traceback

    # Compiled functions have no frames: the stack ends in user code.
    node.metadata["traceback_"] = "".join(traceback.format_stack())


def _set_sequence_nr(NodeBase node not None, sequence_nr):
    """Give ``node`` a fixed sequence number (AccumulateGrad); engine use only."""
    # An int, as the twin asks: a uint64_t argument would take 1.5 as 1.
    node._sequence_nr = operator.index(sequence_nr)
