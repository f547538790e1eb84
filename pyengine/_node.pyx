"""The engine's view of a backward-graph node: NodeBase, Edge, InputMetadata.

``NodeBase`` holds, in C fields, exactly the per-node state the engine reads
while it runs (next edges, input metadata, sequence number, hook lists,
stream); the user-facing methods live on :class:`pyengine.Node`, which
subclasses it. Twin: ``pyengine/_pure/node.py``, whose docstrings state the
fields' guards (all guarded by the GIL).
"""

cimport cython
cimport numpy as cnp
from libc.stdint cimport uint64_t, UINT64_MAX

from pyengine._state cimport anomaly_enabled

import numpy as np

from pyengine.backends import backend_of
from pyengine.device import CPU

from pyengine._pure.node import _creation_stream, not_initialized_message

cnp.import_array()

# AccumulateGrad sorts before every other node: See Note [AccumulateGrad first].
ACCUMULATE_GRAD_SEQUENCE_NR = UINT64_MAX

cdef extern from *:
    """
    /* Per thread, as PyTorch's at::sequence_number. */
    static thread_local uint64_t pyengine_next_sequence_nr = 0;
    """
    uint64_t pyengine_next_sequence_nr


def _normalize_dtype(dtype):
    # numpy dtypes are kept as np.dtype objects so that the fast path can
    # compare descriptors by identity; other dtypes (a framework's) stay as given.
    if isinstance(dtype, np.dtype):
        return dtype
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtype


@cython.final
cdef class InputMetadata:
    """Shape, dtype and device of the forward output an input slot stands for.

    Immutable after construction.
    """

    def __init__(self, shape, dtype, device=CPU):
        self.shape = tuple([int(size) for size in shape])
        self.dtype = _normalize_dtype(dtype)
        self.device = device
        self.is_cpu = device == CPU
        # Only a floating or complex slot may take the fast path: any gradient
        # for another kind of slot is an error that the slow path reports.
        if isinstance(self.dtype, np.dtype) and self.dtype.kind in "fc" and device == CPU:
            self.numpy_dtype = self.dtype
            for size in self.shape:
                self.dims.push_back(size)

    @classmethod
    def from_value(cls, value):
        """Metadata of an array or framework value, read through its backend."""
        backend = backend_of(value)
        if backend is None:
            raise TypeError(f"no value backend for {type(value).__name__}; register one with "
                            "pyengine.register_backend")
        return cls(backend.shape(value), backend.dtype(value), backend.device(value))

    def __eq__(self, other):
        if not isinstance(other, InputMetadata):
            return NotImplemented
        return (self.shape, self.dtype, self.device) == (other.shape, other.dtype, other.device)

    __hash__ = None

    def __repr__(self):
        return f"InputMetadata(shape={self.shape}, dtype={self.dtype}, device={self.device})"


def as_input_metadata(spec):
    """An InputMetadata from an InputMetadata, ``None``, a ``(shape, dtype[, device])``
    tuple or a value to read it from."""
    if spec is None or isinstance(spec, InputMetadata):
        return spec
    if isinstance(spec, tuple) and 2 <= len(spec) <= 3:
        return InputMetadata(*spec)
    return InputMetadata.from_value(spec)


@cython.final
@cython.trashcan(True)
cdef class Edge:
    """Which input slot (``input_nr``) of which ``node`` a gradient flows into.

    Immutable after construction; equal when both node (by identity) and
    slot are.
    """

    def __init__(self, node, input_nr=0):
        if not isinstance(node, NodeBase):
            raise TypeError(f"Edge needs a Node, got {type(node).__name__}")
        if not (<NodeBase>node)._initialized:
            raise RuntimeError(not_initialized_message(node))
        self.node = node
        self.input_nr = input_nr

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
        return f"Edge({self.node.name()}, {self.input_nr})"


cdef bint on_cpu(list input_metadata) noexcept:
    """Whether every input slot with metadata is on the CPU."""
    for metadata in input_metadata:
        if metadata is not None and not (<InputMetadata>metadata).is_cpu:
            return False
    return True


cdef tuple _check_next_edges(next_edges):
    next_edges = tuple(next_edges)
    for i, edge in enumerate(next_edges):
        if edge is not None and not isinstance(edge, Edge):
            raise TypeError(f"next_edges[{i}] must be an Edge or None, got {type(edge).__name__}")
    return next_edges


# trashcan: dropping a long chain of nodes must not recurse in C.
@cython.trashcan(True)
cdef class NodeBase:
    """The per-node state the engine reads; see :class:`pyengine.Node`."""

    def __cinit__(self, *args, **kwargs):
        self._next_edges = ()
        self._input_metadata = []

    def __init__(self, next_edges=(), input_metadata=()):
        self._initialize(next_edges, input_metadata)

    cdef int _initialize(self, next_edges, input_metadata) except -1:
        global pyengine_next_sequence_nr
        self._next_edges = _check_next_edges(next_edges)
        self._input_metadata = [as_input_metadata(spec) for spec in input_metadata]
        self._sequence_nr = pyengine_next_sequence_nr
        pyengine_next_sequence_nr += 1
        if not on_cpu(self._input_metadata):
            self._stream = _creation_stream(self._input_metadata)
        self._initialized = True
        if anomaly_enabled():
            _record_forward_traceback(self)
        return 0

    @property
    def sequence_nr(self):
        return self._sequence_nr

    @property
    def next_edges(self):
        return self._next_edges

    @next_edges.setter
    def next_edges(self, next_edges):
        self._next_edges = _check_next_edges(next_edges)

    @property
    def input_metadata(self):
        return tuple(self._input_metadata)

    def num_inputs(self):
        return len(self._input_metadata)

    def add_input_metadata(self, spec):
        """Append an input slot described by ``spec``; return its index."""
        self._input_metadata.append(as_input_metadata(spec))
        if self._stream is None and not on_cpu(self._input_metadata):
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

    cpdef release_variables(self):
        """Drop what the node saved for backward. Override to free more."""
        self._saved_values = None


cdef class GradientFreeNodeBase(NodeBase):
    """A node that passes no gradients: running it calls ``owner.<method>()``.
    See Note [Gradient-free nodes] in the twin, ``pyengine/_pure/node.py``,
    which states the fields' guards."""

    def __init__(self, owner, method, next_edges=(), input_metadata=()):
        if not isinstance(method, str):
            raise TypeError(f"method must be a str (a method name), got {type(method).__name__}")
        self._initialize(next_edges, input_metadata)
        self.owner = owner
        self.method = method

    def apply(self, grads):
        getattr(self.owner, self.method)()
        return [None] * len(self._next_edges)


def _record_forward_traceback(node):
    import traceback

    # Compiled functions have no frames: the stack ends in user code.
    node.metadata["traceback_"] = "".join(traceback.format_stack())


def _set_sequence_nr(NodeBase node, uint64_t sequence_nr):
    """Give ``node`` a fixed sequence number (AccumulateGrad); engine use only."""
    node._sequence_nr = sequence_nr
