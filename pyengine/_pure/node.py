"""The engine's view of a backward-graph node: NodeBase, Edge, InputMetadata,
and the base of the two kinds of node the engine itself defines,
GradientFreeNodeBase and AccumulateGradBase.

Twin of ``pyengine/_node.pyx``. ``NodeBase`` holds exactly the per-node state
the engine reads while it runs (next edges, input metadata, sequence number,
hook lists, stream); the user-facing methods live on
:class:`pyengine.Node`, which subclasses it.
"""

import operator
import sys
import threading
import weakref

import numpy as np

from .. import backends
from .._shared import task_queries
from .._shared.gradient_checks import REDUCE, gradient_policy_of
from .._shared.hooks import call_post_accumulate_grad_hooks
from .._shared.messages import (
    MAX_INPUT_NR,
    _cannot_delete,
    _input_nr_error,
    _leaf_state_error,
    accumulate_grad_grads_message,
    cannot_pickle_message,
    grad_lock_not_held_message,
    grad_lock_taken_again_message,
    metadata_size,
    negative_size_message,
    no_value_backend_message,
    node_name,
    not_initialized_message,
    shape_not_sizes_message,
    uninitialized_metadata_message,
)
from .._shared.node_streams import _creation_stream
from ..backends import backend_of, backend_to_add, check_backend_result, no_backend_to_copy
from ..device import CPU, Device, as_device
from ..indexed import IndexedGradient
from . import state
from .static_types import (
    C_LONG_MAX,
    c_bint_attribute,
    c_type_name,
    check_argument,
    check_c_long,
    check_new,
    final,
    refuse_write,
)

# AccumulateGrad sorts before every other node: See Note [AccumulateGrad first].
ACCUMULATE_GRAD_SEQUENCE_NR = 2**64 - 1


class _SequenceCounter(threading.local):
    # Per thread, as PyTorch's at::sequence_number: no lock needed.
    next_value = 0


_sequence_counter = _SequenceCounter()


def _normalize_dtype(dtype):
    # numpy dtypes are kept as np.dtype objects (the compiled core compares
    # their descriptors by identity); other dtypes (a framework's) stay as given.
    if isinstance(dtype, np.dtype):
        return dtype
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtype


def _not_writable(self, name, value=None):
    # What writing a compiled class's readonly field, or a name it lacks, raises.
    refuse_write(self, name)


@final
class InputMetadata:
    """Shape, dtype and device of the forward output an input slot stands for.

    ``device`` is a :class:`pyengine.Device` or a str that names one
    (``"cpu"``, ``"cuda:1"``: See ``as_device`` in ``pyengine/device.py``).
    Immutable after construction.
    """

    __slots__ = ("shape", "dtype", "device", "is_cpu")

    def __new__(cls, *args, **kwargs):
        # The compiled class's fields before its __init__ (C's None and
        # False): one made by __new__ alone reads alike in both cores, and
        # __init__ asks ``shape`` without an AttributeError.
        if cls.__new__ is not InputMetadata.__new__:
            check_new(InputMetadata, cls)
        self = object.__new__(cls)
        set_field = object.__setattr__
        set_field(self, "shape", None)
        set_field(self, "dtype", None)
        set_field(self, "device", None)
        set_field(self, "is_cpu", False)
        return self

    def __init__(self, shape, dtype, device=CPU):
        if self.shape is not None:
            # Its fields and the compiled fast path's copy of them must agree.
            raise TypeError("InputMetadata is immutable: its __init__ ran already")
        # See Note [InputMetadata sizes] in pyengine/_shared/messages.py.
        if isinstance(shape, (str, bytes, bytearray)):
            raise TypeError(shape_not_sizes_message(shape))
        sizes = []
        for position, size in enumerate(shape):
            sizes.append(metadata_size(size, position))
        shape = tuple(sizes)
        dtype = _normalize_dtype(dtype)
        if type(device) is not Device:
            device = as_device(device)
        # The compiled core converts every size to a C size (its fast path
        # keeps them): each must fit, and none may be negative, checked in
        # order as the compiled core does.
        if shape and not (0 <= min(shape) and max(shape) <= C_LONG_MAX):
            for position, size in enumerate(shape):
                check_c_long(size)
                if size < 0:
                    raise ValueError(negative_size_message(shape, position))
        is_cpu = device == CPU
        # Set once nothing can fail, as the compiled core's: an __init__
        # that raised leaves the metadata uninitialized. The code above ran
        # Python code, which may have run this __init__ to its end already:
        # asked again.
        if self.shape is not None:
            raise TypeError("InputMetadata is immutable: its __init__ ran already")
        set_field = object.__setattr__
        set_field(self, "shape", shape)
        set_field(self, "dtype", dtype)
        set_field(self, "device", device)
        set_field(self, "is_cpu", is_cpu)

    __setattr__ = __delattr__ = _not_writable

    def __reduce__(self):
        return InputMetadata, (self.shape, self.dtype, self.device)

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
        shape = self.shape
        if shape is None:
            return False
        backend = backend_of(value)
        if backend is None:
            raise TypeError(no_value_backend_message(value))
        return tuple(backend.shape(value)) == shape

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
    if spec is None:
        return spec
    if isinstance(spec, InputMetadata):
        if getattr(spec, "shape", None) is None:
            raise TypeError(uninitialized_metadata_message("an input's metadata"))
        return spec
    if isinstance(spec, tuple) and 2 <= len(spec) <= 3:
        return InputMetadata(*spec)
    return InputMetadata.from_value(spec)


def _check_input_nr(node, input_nr):
    """``input_nr`` as an index of one of ``node``'s input slots: See Note
    [Edge input_nr]."""
    try:
        index = operator.index(input_nr)
    except TypeError:
        raise TypeError(_input_nr_error(node, input_nr)) from None
    if index < 0 or (index >= MAX_INPUT_NR and index >= len(node._input_metadata)):
        raise ValueError(_input_nr_error(node, index))
    return index


class _NoNode:
    """Edge.__new__'s node when none is given: See Edge.__new__."""

    def __repr__(self):
        return "<required>"


_NO_NODE = _NoNode()


@final
class Edge:
    """Which input slot (``input_nr``) of which ``node`` a gradient flows into.

    Immutable after construction; equal when both node (by identity) and
    slot are. See Note [Edge input_nr] in ``pyengine/_shared/messages.py``
    for the values ``input_nr`` may take.
    """

    __slots__ = ("node", "input_nr")

    def __new__(cls, node=_NO_NODE, input_nr=0):
        # In __new__, not __init__: no Edge exists without a checked node
        # (Edge.__new__(Edge) is a TypeError), and none changes after.
        if cls.__new__ is not Edge.__new__:
            check_new(Edge, cls)
        if node is _NO_NODE:
            # Python's words, after the check of cls as the compiled class's.
            raise TypeError("Edge.__new__() missing 1 required positional argument: 'node'")
        if not isinstance(node, NodeBase):
            raise TypeError(f"Edge needs a Node, got {type(node).__name__}")
        if not getattr(node, "_initialized", False):
            raise RuntimeError(not_initialized_message(node))
        self = object.__new__(cls)
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "input_nr", _check_input_nr(node, input_nr))
        return self

    __setattr__ = __delattr__ = _not_writable

    def __eq__(self, other):
        if not isinstance(other, Edge):
            return NotImplemented
        return self.node is other.node and self.input_nr == other.input_nr

    def __hash__(self):
        return hash((id(self.node), self.input_nr))

    def __iter__(self):
        # Unpacks like PyTorch's next_functions pairs: ``node, input_nr = edge``.
        yield self.node
        yield self.input_nr

    def __repr__(self):
        return f"Edge({node_name(self.node)}, {self.input_nr})"

    def __reduce__(self):
        # copy, deepcopy and pickle: See Note [Copying a GradientFreeNode].
        return Edge, (self.node, self.input_nr)


def _check_next_edges(next_edges):
    next_edges = tuple(next_edges)
    for i, edge in enumerate(next_edges):
        if edge is not None and not isinstance(edge, Edge):
            raise TypeError(f"next_edges[{i}] must be an Edge or None, got {type(edge).__name__}")
    return next_edges


# The largest input_nr the compiled core keeps for a node's only next edge
# (a 32-bit field); an edge past it is read from the tuple, in both cores.
ONLY_INPUT_NR_MAX = (1 << 31) - 1


def _set_next_edges(node, next_edges):
    """``node``'s ``_next_edges``, checked, and with them its only next
    edge (See Note [A node's only next edge])."""
    edges = _check_next_edges(next_edges)
    only_edge = edges[0] if len(edges) == 1 else None
    if only_edge is not None and only_edge.input_nr > ONLY_INPUT_NR_MAX:
        only_edge = None
    # The old values are let go of only when all three fields are set: a
    # node freed with them may run Python code (a __del__), which must not
    # find the fields half set, nor set them in between.
    old_values = (getattr(node, "_next_edges_", None), getattr(node, "_only_next_node_", None))
    set_field = object.__setattr__
    set_field(node, "_next_edges_", edges)
    set_field(node, "_only_next_node_", None if only_edge is None else only_edge.node)
    set_field(node, "_only_input_nr_", -1 if only_edge is None else only_edge.input_nr)
    del old_values


def _check_input_metadata(input_metadata):
    input_metadata = tuple(input_metadata)
    for i, metadata in enumerate(input_metadata):
        if metadata is not None and not isinstance(metadata, InputMetadata):
            raise TypeError(f"input_metadata[{i}] must be an InputMetadata or None, got "
                            f"{type(metadata).__name__}")
        if metadata is not None and getattr(metadata, "shape", None) is None:
            raise TypeError(uninitialized_metadata_message(f"input_metadata[{i}]"))
    return input_metadata


# Note [Shared empty input metadata]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A node made without input metadata (a gradient-free node, one per value
# a forward makes) gets no container of its own: its ``_input_metadata`` is
# the empty tuple, which every such node shares, which saves an allocation
# per node, and one object per node for the cyclic GC to count and
# traverse. ``_input_metadata`` is a tuple for every node, never changed in
# place (See Note [Fields Python code can write]): ``add_input_metadata``
# makes a new one, one slot longer (a copy per slot added: nodes have few).


# Note [A node's only next edge]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Most nodes have one next edge (a unary op, a chain). A node keeps that
# edge's node and input_nr beside ``_next_edges`` (``_only_next_node``,
# ``_only_input_nr``; None and -1 for any other node), set with
# ``_next_edges`` and never alone, so both change together. The dependency
# count, the dependency search (a frame holds the only next node in place of
# the tuple), the routing of a node's gradients and the compiled core's
# validate_outputs read the next node from the node itself, not through the
# edges tuple and the Edge: two objects fewer per node, which is most of what
# a graph too large for the caches costs those passes (benchmarks/RESULTS.md,
# "Issue 19: a node's only next edge in the node"). In the compiled core the
# node is a C field in the object's first cache line, and the node's three
# flags are bytes, so the object does not grow. The engine reads the pair
# with ``_next_edges``, once, before the node runs (See Note [Next edges while
# a node runs] in ``pyengine/_pure/engine.py``). The hooks' ``call_function``
# reads the tuple: hooks are the slow path. The twin's validate_outputs has
# no numpy fast path, so it reads the tuple too. Both fields are read only
# to Python code.


# Note [Fields Python code can write]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The compiled core reads a node's fields in C and trusts their types (it
# casts each of ``_next_edges`` to an Edge, each of ``_input_metadata`` to
# an InputMetadata), yet Python code can write every field it can read,
# private ones included. So each field is, in both cores, with the same
# error for the same bad write:
#
# - checked when set: ``_next_edges`` (Edges or None, TypeError naming the
#   index) and ``_input_metadata`` (InputMetadata or None), stored as
#   tuples, which no Python code can change in place; the public
#   ``next_edges`` setter and ``add_input_metadata`` go through the same
#   checks. ``_pre_hooks``, ``_post_hooks``, ``_tensor_pre_hooks`` (a list
#   or None), ``_retains_grad_hooks`` and ``_metadata`` (a dict or None) are
#   typed C fields in the compiled core, so a value of another type is a
#   TypeError when set; the twin checks the same. Deleting one of these
#   sets it to None, as Cython does. Their contents are read only by Python
#   code (the hooks' ``call_function``), which raises on a bad entry.
#   AccumulateGrad's ``leaf_state`` must be a LeafState (never None: a
#   fresh one until the subclass sets its own), as the compiled ``apply``
#   reads it in C;
# - read only: ``_sequence_nr``, ``_initialized``, ``_only_next_node`` and
#   ``_only_input_nr`` (set with ``_next_edges``),
#   ``_overrides_release_variables``, ``_gradient_policy``, a GradientFreeNode's
#   ``owner`` and ``method``, a LeafState's ``lock``, every field of an Edge
#   and of an InputMetadata (AttributeError when written). An Edge checks
#   its node and input_nr in ``__new__`` (no Edge without a node exists),
#   and an InputMetadata's ``__init__`` runs once;
# - free: ``_saved_values``, ``_stream``, ``_released`` (its truth value),
#   AccumulateGrad's ``variable``, a LeafState's ``accumulator`` and hook
#   lists: the engine hands them to Python code only, never to C. Deleting
#   one stores None, as deleting a Cython ``public object`` field does (the
#   twin's are properties over slots, ``_free_field``: a deleted slot was an
#   AttributeError at the engine's next read, where the compiled core read
#   None). A
#   LeafState's ``keep_indexed`` is a C bint: stored as its truth value (an
#   array's is a ValueError), and deleting it is NotImplementedError.
#
# The engine also copies what it must not see change while a node runs:
# See Note [Next edges while a node runs] in ``pyengine/_pure/engine.py``.
# The checks cost nothing per node in the compiled engine: they run when a
# field is set, and the engine reads the C fields directly.


def _not_list(value):
    return value is not None and type(value) is not list


def _not_dict(value):
    return value is not None and type(value) is not dict


def _checked_field(name, storage, wrong_type, expected):
    """A property ``name`` over slot ``storage`` that refuses, with the
    TypeError of a typed Cython field, a value for which ``wrong_type`` is
    true; deleting it stores None. See Note [Fields Python code can write]."""
    get_field = operator.attrgetter(storage)

    def set_field(self, value):
        if wrong_type(value):
            raise TypeError(f"Expected {expected}, got {c_type_name(type(value))}")
        object.__setattr__(self, storage, value)

    def delete_field(self):
        object.__setattr__(self, storage, None)

    return property(get_field, set_field, delete_field,
                    doc=f"{name}: See Note [Fields Python code can write].")


def _free_field(name, storage):
    """A property ``name`` over slot ``storage`` that takes any value, and
    stores None when deleted, as a Cython ``public object`` field does:
    a free field of Note [Fields Python code can write]."""
    def set_field(self, value):
        object.__setattr__(self, storage, value)

    def delete_field(self):
        object.__setattr__(self, storage, None)

    return property(operator.attrgetter(storage), set_field, delete_field,
                    doc=f"{name}: See Note [Fields Python code can write].")


def _read_only_property(name, getter):
    """A property ``name`` read by ``getter`` that Python code cannot write,
    as a readonly Cython field."""

    def set_field(self, value):
        _not_writable(self, name)

    def delete_field(self):
        _not_writable(self, name)

    return property(getter, set_field, delete_field)


def _metadata_made_on_first_use(node):
    if node._metadata is None:
        node._metadata = {}
    return node._metadata


def _read_only_field(name, storage):
    """A property ``name`` over slot ``storage`` that Python code cannot
    write, as a readonly Cython field."""
    return _read_only_property(name, operator.attrgetter(storage))


def new_node_base(cls):
    """A ``cls`` with the fields the compiled NodeBase has before any
    ``__init__`` runs (its ``__cinit__``'s and C's zeroes): a node whose
    class's ``__init__`` skipped NodeBase's reads alike in both cores, and
    both refuse to run it (not initialized). The twin's subclasses of
    NodeBase start from it: See Note [A class's __new__ called with another
    class] in pyengine/_pure/static_types.py."""
    self = object.__new__(cls)
    set_field = object.__setattr__
    set_field(self, "_next_edges_", ())
    # As _keep_input_metadata(self, ()) would: no slot, so on the CPU.
    set_field(self, "_input_metadata_", ())
    set_field(self, "_on_cpu_", True)
    set_field(self, "_sequence_nr_", 0)
    set_field(self, "_overrides_release_variables_", False)
    set_field(self, "_pre_hooks_", None)
    set_field(self, "_post_hooks_", None)
    set_field(self, "_tensor_pre_hooks_", None)
    set_field(self, "_retains_grad_hooks_", None)
    set_field(self, "_metadata_", None)
    set_field(self, "_only_next_node_", None)
    set_field(self, "_only_input_nr_", -1)
    set_field(self, "_released_", False)
    set_field(self, "_initialized_", False)
    set_field(self, "_saved_values_", None)
    set_field(self, "_stream_", None)
    return self


class NodeBase:
    """The per-node state the engine reads; see :class:`pyengine.Node`.

    Fields, all guarded by the GIL (how each is checked when Python code
    writes it: See Note [Fields Python code can write]):
      _next_edges: tuple of Edge or None, one per gradient ``apply`` returns.
      _input_metadata: tuple of InputMetadata or None, one per input slot
        (See Note [Shared empty input metadata]).
      _on_cpu_: whether every slot with metadata is on the CPU; set with
        ``_input_metadata``, never alone, for the routing of a task.
      _sequence_nr: immutable after construction.
      _pre_hooks, _post_hooks, _tensor_pre_hooks: None or a list of
        ``(handle_id, fn)`` (tensor pre-hooks: ``(handle_id, input_nr, fn)``).
      _retains_grad_hooks: None or a dict ``input_nr -> fn``.
      _saved_values: what ``save_for_backward`` stored; cleared on release.
      _released: set by the engine once ``release_variables`` ran.
      _overrides_release_variables: whether the node's class overrides
        ``release_variables``, when the node was made; immutable after
        construction (See Note [Overriding release variables]).
      _stream: the stream current at creation on a device, else None.
      _metadata: None or a dict, created on first access.
      _initialized: set by ``__init__``; the engine refuses a node without it.
      _only_next_node, _only_input_nr: the node's only next edge's node and
        input_nr, else None and -1; set with ``_next_edges`` (See Note [A
        node's only next edge]).
      _gradient_policy: the class's ``gradient_policy``, checked, read when
        asked (See Note [Gradient policy]).
    """

    # The fields Python code may not write as it likes live in slots with a
    # trailing underscore, behind properties: See Note [Fields Python code
    # can write].
    __slots__ = (
        "_next_edges_", "_input_metadata_", "_sequence_nr_", "_pre_hooks_", "_post_hooks_",
        "_tensor_pre_hooks_", "_retains_grad_hooks_", "_saved_values_", "_released_",
        "_overrides_release_variables_", "_on_cpu_", "_stream_", "_metadata_", "_initialized_",
        "_only_next_node_", "_only_input_nr_", "__weakref__",
    )

    # Read from the node's class when a gradient takes validate_outputs' slow
    # path: See Note [Gradient policy].
    gradient_policy = REDUCE

    _sequence_nr = _read_only_field("_sequence_nr", "_sequence_nr_")
    _initialized = _read_only_field("_initialized", "_initialized_")
    _only_next_node = _read_only_field("_only_next_node", "_only_next_node_")
    _only_input_nr = _read_only_field("_only_input_nr", "_only_input_nr_")
    _overrides_release_variables = _read_only_field("_overrides_release_variables",
                                                    "_overrides_release_variables_")

    # The class's gradient_policy, checked (See Note [Gradient policy]).
    _gradient_policy = _read_only_property("_gradient_policy", gradient_policy_of)

    _pre_hooks = _checked_field("_pre_hooks", "_pre_hooks_", _not_list, "list")
    _post_hooks = _checked_field("_post_hooks", "_post_hooks_", _not_list, "list")
    _tensor_pre_hooks = _checked_field("_tensor_pre_hooks", "_tensor_pre_hooks_", _not_list, "list")
    _retains_grad_hooks = _checked_field("_retains_grad_hooks", "_retains_grad_hooks_", _not_dict,
                                         "dict")
    _metadata = _checked_field("_metadata", "_metadata_", _not_dict, "dict")
    _saved_values = _free_field("_saved_values", "_saved_values_")
    _stream = _free_field("_stream", "_stream_")

    def __new__(cls, *args, **kwargs):
        if cls.__new__ is not NodeBase.__new__:
            check_new(NodeBase, cls)
        return new_node_base(cls)

    def __reduce__(self):
        # A node is neither copied nor pickled (nor are torch's), but a
        # GradientFreeNode: See Note [Copying and pickling the engine's objects].
        raise TypeError(cannot_pickle_message(self))

    def __init__(self, next_edges=(), input_metadata=()):
        set_field = object.__setattr__
        _set_next_edges(self, next_edges)
        # See Note [Shared empty input metadata]. _keep_input_metadata's two
        # fields, set here without its call: Node() is the twin's hot path in
        # a forward.
        metadata = tuple(as_input_metadata(spec) for spec in input_metadata)
        set_field(self, "_input_metadata_", metadata)
        set_field(self, "_on_cpu_", on_cpu(metadata))
        set_field(self, "_sequence_nr_", _sequence_counter.next_value)
        _sequence_counter.next_value += 1
        # See Note [Overriding release variables].
        set_field(self, "_overrides_release_variables_",
                  type(self).release_variables is not NodeBase.release_variables)
        # The hooks, saved values, metadata and stream are __new__'s: a
        # second __init__ keeps them, as the compiled core's does.
        if not self._on_cpu_:
            self._stream_ = _creation_stream(self._input_metadata_)
        set_field(self, "_initialized_", True)
        if state.is_anomaly_enabled():
            _record_forward_traceback(self)

    sequence_nr = _read_only_field("sequence_nr", "_sequence_nr")

    @property
    def next_edges(self):
        return self._next_edges_

    @next_edges.setter
    def next_edges(self, next_edges):
        _set_next_edges(self, next_edges)

    @next_edges.deleter
    def next_edges(self):
        _cannot_delete("next_edges")

    # The engine's fields, for Python code: checked when set, as next_edges
    # is. See Note [Fields Python code can write].
    _next_edges = property(operator.attrgetter("_next_edges_"), next_edges.fset,
                           lambda self: _cannot_delete("_next_edges"))

    @property
    def _input_metadata(self):
        return self._input_metadata_

    @_input_metadata.setter
    def _input_metadata(self, input_metadata):
        _keep_input_metadata(self, _check_input_metadata(input_metadata))
        if self._stream_ is None and not self._on_cpu_:
            self._stream_ = _creation_stream(self._input_metadata_)

    @_input_metadata.deleter
    def _input_metadata(self):
        _cannot_delete("_input_metadata")

    @property
    def _released(self):
        return self._released_

    @_released.setter
    def _released(self, released):
        # A C flag: its truth value.
        self._released_ = bool(released)

    @_released.deleter
    def _released(self):
        _cannot_delete("_released")

    input_metadata = _read_only_field("input_metadata", "_input_metadata_")

    def num_inputs(self):
        return len(self._input_metadata_)

    def add_input_metadata(self, spec):
        """Append an input slot described by ``spec``; return its index."""
        # A new tuple: See Note [Shared empty input metadata].
        _keep_input_metadata(self, self._input_metadata_ + (as_input_metadata(spec),))
        if self._stream_ is None and not self._on_cpu_:
            self._stream_ = _creation_stream(self._input_metadata_)
        return len(self._input_metadata_) - 1

    metadata = _read_only_property("metadata", _metadata_made_on_first_use)
    stream = _read_only_field("stream", "_stream_")

    def apply(self, grads):
        raise NotImplementedError(f"{type(self).__name__} must override apply(grads)")

    def task_should_compute_output(self, output_edge_index):
        """Whether the gradient ``apply`` returns for next edge
        ``output_edge_index`` will be used, as PyTorch's Node method: False
        for a missing edge (None) or an edge into a node that
        ``grad(inputs=)`` / ``backward(inputs=)`` prunes (it neither runs
        nor captures), True otherwise. Call it from the node's ``apply`` or
        hooks while the engine runs this node: anywhere else it raises
        RuntimeError; an index outside the node's next edges raises
        IndexError. See Note [Queries a running node makes] in
        ``pyengine/_shared/task_queries.py``."""
        return running_graph_task(self, "task_should_compute_output").should_compute_output(
            self, output_edge_index)

    def task_buffered_gradient(self, output_edge_index):
        """What the InputBuffer of the node that next edge
        ``output_edge_index`` leads to has summed so far at that edge's
        ``input_nr``: the gradients the producers that ran before this
        node sent there, in the engine's order, as a copy this caller
        owns; None where nothing arrived yet, the edge is None, or the node
        it leads to has a single producer (this one). Only while the engine
        runs this node, as ``task_should_compute_output``. See Note
        [Queries a running node makes] in ``pyengine/_shared/task_queries.py``."""
        return task_queries.buffered_gradient(
            self, running_graph_task(self, "task_buffered_gradient"), output_edge_index)

    def release_variables(self):
        """Drop what the node saved for backward. Override it in a subclass to
        free more: the engine calls the method of the node's class, as C++
        calls a virtual method, where the class overrode it when the node was
        made. See Note [Overriding release variables]."""
        self._saved_values_ = None


def running_graph_task(node, query):
    """The graph task running ``node`` on this thread, read from the thread
    state; RuntimeError where none does. See Note [Queries a running node
    makes] in ``pyengine/_shared/task_queries.py``."""
    running_node = state.get_current_node()
    if running_node is node:
        return state.get_current_graph_task()
    raise RuntimeError(task_queries.not_running_message(node, query, running_node))


# Note [Gradient policy]
# ~~~~~~~~~~~~~~~~~~~~~~
# validate_outputs checks the gradients a node returns by one of two
# rules, chosen by the node's class attribute ``gradient_policy``:
#
# - ``"reduce"`` (NodeBase's, the default): PyTorch's. A gradient whose
#   shape broadcasts to its slot's is summed to it, a dtype is cast by
#   PyTorch's rule, a 0-d gradient is moved to the slot's device;
# - ``"exact"``: Chainer's. The gradient must have its slot's shape, dtype
#   and device already (an integer gradient into a slot of that very
#   integer dtype is fine); any mismatch is an error naming the node, the
#   index, expected and got (``validate_gradient_exact`` in
#   ``pyengine/_shared/gradient_checks.py``).
#
# Both policies share validate_outputs' fast path: a numpy gradient of its
# slot's very dtype and shape on the CPU passes either rule as it is. So
# the policy is read, from the node's class, only where a gradient takes
# the slow path (``gradient_policy_of``), and checked there (TypeError for
# a value that is not a str, ValueError for another str, naming the class)
# before the compiled core compares it by identity with the two constants:
# making a node costs nothing for it, and Python code cannot hand the core
# a value it did not check. ``Node.__init_subclass__`` checks a class's own
# value when the class is made, so a typo fails early; a value set on the
# class later is checked where it is read. A slot without metadata takes
# any value a backend handles, under both.


# Note [Overriding release variables]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# After a node ran, unless the graph is retained, the engine's
# ``release_variables(node)`` lets the node drop what it saved. A class may
# override ``NodeBase.release_variables`` to free more; most do not, and
# for them the engine only clears ``_saved_values``, without looking a
# method up on the node's class when it releases the node. So a node
# records, when it is made, whether its class overrides the method (its
# read-only ``_overrides_release_variables``: the class, or a base class
# below NodeBase, defines it), as a C++ object gets its virtual table from
# its constructor: the lookup moves out of the backward pass, into the
# node's construction (``benchmarks/RESULTS.md`` counts both). Then:
#
# - a node whose class overrode the method when the node was made gets
#   ``type(node).release_variables(node)``, looked up on the class at each
#   release: replacing the override on the class later takes effect for
#   those nodes at once, and removing it leaves them NodeBase's;
# - a node whose class did not override it gets NodeBase's, even if the
#   class is given a ``release_variables`` after the node was made (nodes
#   made afterwards get the new method);
# - a function set on the node itself is never an override, as in C++;
#   assigning a node's ``__class__`` does not change its flag.
#
# Both cores compute the flag when a node is initialized (``NodeBase.__init__``;
# the compiled core's ``_initialize``, which GradientFreeNodeBase's
# ``__init__`` calls too) and read it in their ``release_variables``.


# Note [GradientFreeNode]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Some frameworks pass no gradients from node to node: micrograd's closures
# read their own Value's ``.grad`` and add into their children's. There the
# engine's only job is the order: a node runs once every node that feeds it
# has run. A GradientFreeNodeBase says so. Running it calls
# ``owner.<method>()`` (the result is ignored), and no gradient flows along
# any of its edges: its ``apply`` makes that call and returns one None per
# edge. The method is named, not passed: the node is made before the
# framework knows what will run (micrograd assigns ``_backward`` after
# making the Value), so it is looked up when the node runs.
#
# The engine runs such a node as any other, in both cores: from the ready
# queue, in its order, through ``apply`` (a subclass's override of
# ``apply`` runs), with its hooks around it, which see the Nones. Its
# Nones take the general path, so a graph of gradient-free nodes runs in
# the same order as the same graph of plain Nodes whose ``apply`` returns
# Nones, wherever its nodes were made: nodes made on several threads share
# sequence numbers (the counter is per thread), and only the ready queue's
# order (See Note [Ties in the ready queue] in
# ``pyengine/_pure/ready_queue.py``) settles which of them runs first.


class GradientFreeNodeBase(NodeBase):
    """A node that passes no gradients: running it calls ``owner.<method>()``.
    See Note [GradientFreeNode].

    Fields, immutable after construction: ``owner``, any object; ``method``,
    the name (a str) of the method of ``owner`` to call, looked up when the
    node runs.
    """

    __slots__ = ("owner_", "method_")

    owner = _read_only_field("owner", "owner_")
    method = _read_only_field("method", "method_")

    def __new__(cls, *args, **kwargs):
        # As the compiled class's fields before __init__: See new_node_base.
        if cls.__new__ is not GradientFreeNodeBase.__new__:
            check_new(GradientFreeNodeBase, cls)
        self = new_node_base(cls)
        object.__setattr__(self, "owner_", None)
        object.__setattr__(self, "method_", None)
        return self

    def __init__(self, owner, method, next_edges=(), input_metadata=()):
        if not isinstance(method, str):
            raise TypeError(f"method must be a str (a method name), got {type(method).__name__}")
        super().__init__(next_edges, input_metadata)
        object.__setattr__(self, "owner_", owner)
        object.__setattr__(self, "method_", method)

    def apply(self, grads):
        getattr(self.owner, self.method)()
        return [None] * len(self._next_edges)

    def __reduce__(self):
        # See Note [Copying a GradientFreeNode].
        return type(self), (self.owner, self.method, self._next_edges)


# Note [Copying and pickling the engine's objects]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What copies and pickles, in both cores, by ``__reduce__`` of each class:
#
# - an InputMetadata, an Edge, a GradientFreeNode (See Note [Copying a
#   GradientFreeNode]), a LeafState (fresh engine state) and an OwnerGraph
#   (its fields, given again to ``OwnerGraph.__init__``, with its checks,
#   and a subclass's ``__dict__``, not its own ``__slots__``) are made again
#   by their constructors;
# - a node of any other kind, a graph task and its ExecInfo, a ready queue,
#   a task, an InputBuffer, an engine, its reentrant pool and a thread's
#   WorkerState raise TypeError (``cannot_pickle_message``): as torch's,
#   they hold a backward's state, locks and threads, which a copy could
#   only share or lose.
#
# Cython would write a ``__reduce_cython__`` and a ``__setstate_cython__``
# for a compiled class without a ``__cinit__`` and with no ``__reduce__`` of
# its own: the second sets every C field from a tuple it indexes without a
# bound check in the release build (a short tuple read past its end:
# ``Engine().__setstate_cython__(())`` crashed the interpreter), and skips
# the checks ``__init__`` makes. setup.py turns that off (``auto_pickle``).


# Note [Copying a GradientFreeNode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A framework may keep a value's node and Edge among the value's attributes
# (one that makes its nodes at forward), and then ``copy.deepcopy`` of a
# value copies them too. So an Edge copies as ``Edge(node, input_nr)`` and a
# gradient-free node as ``type(node)(owner, method, next_edges)``, each
# argument copied along: a deep copy of a value is a value whose node's
# owner is the copy, with copies of the nodes below it (the copy module's
# memo makes each object's copy once). A copy is a new node, made by its
# class's constructor: its sequence number is new, and hooks, metadata and
# input metadata are not copied (a gradient-free node has no input slots
# that matter: no gradient arrives). A subclass whose constructor takes
# other arguments defines ``__reduce__`` itself. pickle works the same way
# where the owner can be pickled.


# Note [Accumulating into .grad]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# AccumulateGrad writes a leaf's ``.grad`` by PyTorch's rules, under the
# leaf's lock (its LeafState's, shared by every AccumulateGrad of that leaf):
#
# - no ``.grad`` yet: take the incoming array if nothing else can see it (a
#   fresh numpy array that only the engine references: PyTorch's use_count
#   test), else store a copy. Under ``create_graph`` always a copy, made by
#   the value's backend (a framework's differentiable clone, as PyTorch
#   clones there too);
# - ``.grad`` is an array pyengine stored there itself (the LeafState's
#   ``owned_grad``), outside ``create_graph``: add in place, with the
#   value's backend ``add_``. That includes a ``.grad`` stored under
#   ``create_graph`` (a copy or a sum the engine made): PyTorch's plain
#   backward then adds into it in place too, so that it keeps the history
#   the first backward gave it;
# - otherwise (under ``create_graph``, or the user assigned ``.grad``): add
#   out of place and store the sum. Here PyTorch differs once: outside
#   ``create_graph`` it adds into a ``.grad`` the user assigned too. pyengine
#   never writes into an array it did not allocate (DESIGN.md), so the
#   user's array stays as it was and ``.grad`` becomes a new one.
#
# Then the leaf's post-accumulate-grad hooks run, ``fn(variable)`` (See Note
# [Post accumulate grad hooks]). ``.grad``
# changes in one step, so after a backward that failed, each leaf's gradient
# is either as it was or holds that backward's full contribution (a leaf's
# AccumulateGrad runs once per backward, after all of its gradient arrived).
# The engine's buffer lets go of the gradient before the test, so that a
# fresh array is seen as stealable.


def on_cpu(input_metadata):
    """Whether every input slot with metadata is on the CPU."""
    for metadata in input_metadata:
        if metadata is not None and not metadata.is_cpu:
            return False
    return True


def _keep_input_metadata(node, input_metadata):
    """``_input_metadata_``, checked by the caller, and with it ``_on_cpu_``:
    whether every slot with metadata is on the CPU, kept so that routing a
    task reads one field (the InputMetadata are immutable)."""
    set_field = object.__setattr__
    set_field(node, "_input_metadata_", input_metadata)
    set_field(node, "_on_cpu_", on_cpu(input_metadata))


def copy_value(value):
    if is_numpy_array(value):
        return np.array(value, copy=True)  # the numpy backend's copy
    backend = backend_of(value)
    if backend is None:
        # validate_outputs found one; Python code run since (a backend's
        # method, a hook) may have unregistered it.
        raise no_backend_to_copy(value, "the variable's .grad")
    # See Note [What a backend returns] in pyengine/backends.py.
    return check_backend_result(backend.copy(value), backend, "copy", "the variable's .grad")


def add_arrays(grad, new_grad):
    """The numpy backend's ``add`` of two numpy arrays: an array at every
    rank (numpy's own sum of 0-d arrays is a scalar)."""
    total = grad + new_grad
    if type(total) is not np.ndarray:
        total = np.asarray(total)
    return total


def add_in_place(grad, new_grad):
    if is_numpy_array(grad) and type(new_grad) is np.ndarray:
        if grad.flags.writeable:
            grad += new_grad  # np.add(grad, new_grad, out=grad), the numpy backend's add_
            return grad
        return add_arrays(grad, new_grad)
    backend = backend_to_add(grad, "the variable's .grad")
    # See Note [What a backend returns] in pyengine/backends.py.
    return check_backend_result(backend.add_(grad, new_grad), backend, "add_",
                                "the variable's .grad")


def add_values(grad, new_grad):
    if is_numpy_array(grad) and type(new_grad) is np.ndarray:
        return add_arrays(grad, new_grad)
    backend = backend_to_add(grad, "the variable's .grad")
    # See Note [What a backend returns] in pyengine/backends.py.
    return check_backend_result(backend.add(grad, new_grad), backend, "add",
                                "the variable's .grad")


# Note [The lock of a leaf's .grad]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A leaf's gradient is accumulated under its LeafState's lock: every
# AccumulateGrad of the tensor (one per graph; several graphs may run at
# once, on several threads) and retain_grad's hook read, add and write
# ``.grad`` as one step. Python code runs under it (the tensor's ``.grad``
# property, a backend's add or copy; numpy lets go of the GIL in a large
# add), so the lock does two things a plain threading.Lock does not, as
# the graph task's lock does (See Note [A lock the GIL guards] in
# pyengine/_gil_guarded_lock.h):
# - a thread that asks for it while it holds it (that Python code started
#   another accumulation into the same leaf: a backward from the ``.grad``
#   setter) gets RuntimeError, where a threading.Lock waits for itself
#   forever;
# - a release by a thread that does not hold it is refused (RuntimeError),
#   so Python code cannot open it under another thread's accumulation.
# Both cores' locks wait letting other threads run and honouring Ctrl-C.
# The compiled core's is a GILGuardedLock, which AccumulateGrad takes in C,
# where a threading.Lock's acquire and release were Python method calls at
# every accumulation (benchmarks/RESULTS.md, "Issue 19: the fixed cost of
# one call", has what they cost). The twin's is a threading.RLock asked
# its owner (See Note [An interrupt in the twin's GradLock]).

# Note [An interrupt in the twin's GradLock]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On the main thread, Ctrl-C's KeyboardInterrupt comes out of Python code
# between its steps (See Note [Where the twin's main thread sees an
# interrupt] in pyengine/_pure/engine.py), and a lock is two steps of
# state: taken, and known taken. The twin's GradLock was a threading.Lock
# and a holder field that ``acquire`` wrote after the lock's acquire
# returned, and that ``__exit__`` cleared before its release: an interrupt
# between the two, or at ``__exit__``'s entry, left the lock taken, and
# every later accumulation into that leaf waited for it (honouring Ctrl-C,
# but for good). So:
# - the lock is a threading.RLock, whose C acquire and release record its
#   owner as they take and let go of it: ``held()`` asks it
#   (``_is_owned``, as the twin's graph task mutex is asked), and no holder
#   field lags behind the lock;
# - ``acquire`` (and so ``__enter__``) takes it inside a ``try``, and
#   returns on that line: an interrupt that comes out as the RLock's
#   acquire returns finds the lock taken, and the ``except`` lets go of it
#   before the error goes on;
# - ``__exit__`` is the RLock's own, a C method: a with block lets go of
#   the lock with no Python frame of the twin's first.
# What it changes: a with block whose body released the lock itself ends
# with the RLock's RuntimeError ("cannot release un-acquired lock") where
# the compiled core's names the leaf's lock; both refuse. Left: a second
# interrupt while the ``except`` runs (Note [Where the twin's main thread
# sees an interrupt] leaves second interrupts out), and an interrupt at the
# entry of an explicit ``release()``, a Python method (the engine and the
# adapters take the lock with ``with``).
# tests/test_grad_lock.py raises KeyboardInterrupt at each line the twin's
# GradLock runs in a with block and an accumulation, and checks that the
# lock is free after each.

@final
class GradLock:
    """The lock of a leaf's ``.grad``: See Note [The lock of a leaf's .grad].
    Python code takes it with ``with`` or ``acquire``/``release``."""

    __slots__ = ("_lock",)

    def __new__(cls, *args, **kwargs):
        # Fields in __new__, as the compiled class has its lock from its
        # allocation on: one made by __new__ alone works in both cores.
        if cls.__new__ is not GradLock.__new__:
            check_new(GradLock, cls)
        self = object.__new__(cls)
        # An RLock only to be asked its owner, which its C acquire and
        # release record as they take and let go of it; no thread takes it
        # twice (acquire refuses). See Note [An interrupt in the twin's
        # GradLock].
        self._lock = threading.RLock()
        return self

    def __init__(self):
        # Takes no arguments, as the compiled class's.
        pass

    def acquire(self):
        """Wait for the lock (letting other threads run, and honouring
        Ctrl-C) and take it; RuntimeError where this thread holds it."""
        lock = self._lock
        if lock._is_owned():
            raise RuntimeError(grad_lock_taken_again_message())
        try:
            # One line, a return: nothing runs between the lock's acquire and
            # this function's return where an interrupt could come out
            # beyond the except.
            return lock.acquire()
        except BaseException:
            # An interrupt that came out as the lock's acquire returned:
            # the lock is taken, and no one would let go of it.
            if lock._is_owned():
                lock.release()
            raise

    def release(self):
        """Let go of the lock; RuntimeError where this thread does not hold it."""
        lock = self._lock
        if not lock._is_owned():
            raise RuntimeError(grad_lock_not_held_message())
        lock.release()

    def held(self):
        """Whether this thread holds the lock."""
        return self._lock._is_owned()

    # acquire itself: a Python __enter__ around it returned after the
    # lock's acquire, where an interrupt could come out with the lock taken
    # and no with block begun to let go of it (See Note [An interrupt in the
    # twin's GradLock]).
    __enter__ = acquire

    @property
    def __exit__(self):
        # The RLock's own, C: a with block lets go of the lock with no
        # Python frame first, at whose entry an interrupt could come out.
        return self._lock.__exit__

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects].
        raise TypeError(cannot_pickle_message(self))


@final
class LeafState:
    """What pyengine keeps on a leaf tensor (a framework keeps it where it
    likes; :func:`pyengine.node.leaf_state` puts it in ``_pyengine_leaf``).

    Fields:
      lock: a ``GradLock``; guards the tensor's ``.grad`` and the owned
        ``.grad`` while a gradient is accumulated, across every
        AccumulateGrad of this tensor, and while ``retain_grad``'s hook adds
        into a non-leaf's ``.grad`` (See Note [The lock of a leaf's
        .grad]). Immutable after construction.
      accumulator: weak reference to the current AccumulateGrad (the graph,
        not the tensor, keeps it alive, as in PyTorch), or None.
      _owned_grad: None or a weak reference to the ``.grad`` array pyengine
        stored, the only one it may add into in place (``owned_grad()``,
        ``set_owned_grad()``); guarded by ``lock``.
      keep_indexed: whether an IndexedGradient reaching a ``.grad`` that is
        None is stored as it is (copied) rather than densified; set by the
        framework (:func:`pyengine.keep_indexed_grad`), read under ``lock``.
      tensor_pre_hooks, post_accumulate_grad_hooks: None or lists of
        ``(handle_id, ...)`` entries, replaced (never edited) under the GIL.
        The AccumulateGrad runs ``tensor_pre_hooks`` as its tensor pre-hooks.
    """

    __slots__ = ("lock_", "accumulator_", "_owned_grad", "tensor_pre_hooks_",
                 "post_accumulate_grad_hooks_", "keep_indexed_")

    lock = _read_only_field("lock", "lock_")
    accumulator = _free_field("accumulator", "accumulator_")
    tensor_pre_hooks = _free_field("tensor_pre_hooks", "tensor_pre_hooks_")
    post_accumulate_grad_hooks = _free_field("post_accumulate_grad_hooks",
                                             "post_accumulate_grad_hooks_")
    # A C bint in the compiled class: stored as its truth value.
    keep_indexed = c_bint_attribute("keep_indexed_")

    def __new__(cls, *args, **kwargs):
        # In __new__, as the compiled class makes its lock in __cinit__
        # (which ignores arguments): one made by __new__ alone has its
        # fields in both cores.
        if cls.__new__ is not LeafState.__new__:
            check_new(LeafState, cls)
        self = object.__new__(cls)
        object.__setattr__(self, "lock_", GradLock())
        self.accumulator_ = None
        self._owned_grad = None
        self.tensor_pre_hooks_ = None
        self.post_accumulate_grad_hooks_ = None
        self.keep_indexed_ = False
        return self

    def __init__(self):
        # Takes no arguments, as the compiled class's.
        pass

    def __reduce__(self):
        # A copied or pickled tensor starts with fresh engine state: a lock
        # cannot be copied, and the accumulator, hooks and owned .grad belong
        # to the original tensor.
        return (LeafState, ())

    def owned_grad(self):
        """The ``.grad`` array pyengine stored, if it is still alive, else None."""
        return None if self._owned_grad is None else self._owned_grad()

    def set_owned_grad(self, grad):
        try:
            self._owned_grad = None if grad is None else weakref.ref(grad)
        except TypeError:
            # Not weakly referenceable: never add into it in place.
            self._owned_grad = None


class AccumulateGradBase(NodeBase):
    """The sink of a leaf: ``apply`` accumulates into ``variable.grad``. See
    Note [Accumulating into .grad]; :class:`pyengine.AccumulateGrad` is the
    class users meet.

    Fields, set once by the subclass's ``__init__``: ``variable``, the leaf
    tensor; ``leaf_state``, its :class:`LeafState` (the lock, the owned
    ``.grad``, the hooks).
    """

    __slots__ = ("variable_", "leaf_state_")

    variable = _free_field("variable", "variable_")

    def __new__(cls, *args, **kwargs):
        # apply reads leaf_state: it is never None, a fresh LeafState until
        # the subclass sets it (See Note [Fields Python code can write]),
        # from before __init__, as the compiled class's __cinit__ makes it.
        if cls.__new__ is not AccumulateGradBase.__new__:
            check_new(AccumulateGradBase, cls)
        self = new_node_base(cls)
        self.variable_ = None
        self.leaf_state_ = LeafState()
        return self

    @property
    def leaf_state(self):
        return self.leaf_state_

    @leaf_state.setter
    def leaf_state(self, leaf_state):
        if not isinstance(leaf_state, LeafState):
            raise TypeError(_leaf_state_error(leaf_state))
        self.leaf_state_ = leaf_state

    @leaf_state.deleter
    def leaf_state(self):
        _cannot_delete("leaf_state")

    def apply(self, grads):
        if type(grads) is not list:
            raise TypeError(accumulate_grad_grads_message(grads))
        if len(grads) == 0:
            raise ValueError(accumulate_grad_grads_message(grads))
        new_grad = grads[0]
        variable = self.variable_
        leaf_state = self.leaf_state
        if new_grad is not None:
            grads[0] = None
            create_graph = state.is_grad_enabled()
            with leaf_state.lock:
                old_grad = variable.grad
                if (old_grad is None and type(new_grad) is IndexedGradient
                        and not leaf_state.keep_indexed):
                    # See Note [Where an indexed gradient goes] in pyengine/indexed.py.
                    new_grad = new_grad.to_dense()
                if old_grad is None:
                    # See Note [Stealing with post hooks].
                    if create_graph or not can_steal(new_grad, 1 if self._post_hooks else 0):
                        new_grad = copy_value(new_grad)
                    variable.grad = new_grad
                elif old_grad is leaf_state.owned_grad() and not create_graph:
                    variable.grad = add_in_place(old_grad, new_grad)
                else:
                    variable.grad = add_values(old_grad, new_grad)
                leaf_state.set_owned_grad(variable.grad)
        hooks = leaf_state.post_accumulate_grad_hooks_
        if hooks:
            call_post_accumulate_grad_hooks(variable, hooks)
        # A list, which the engine takes as it is (it makes one of any other
        # sequence): an AccumulateGrad runs once per leaf per backward.
        return []


# The references to an array that only AccumulateGradBase.apply holds, seen
# from can_steal: apply's local, can_steal's argument, getrefcount's argument.
_STEALABLE_REFCOUNT = 3


# Note [Stealing with post hooks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# When the AccumulateGrad node has post hooks, the engine's call_function
# keeps the node's inputs for them (their ``grad_outputs``), one more
# reference to the incoming gradient. As PyTorch (``1 + !post_hooks().empty()``
# expected references in accumulate_grad.cpp), that reference does not stop
# the gradient from becoming ``.grad``: the post hooks then see ``.grad``
# itself as their ``grad_outputs``, in PyTorch as here, including what a
# backward nested in one of them adds into it in place.


def is_numpy_array(value) -> bool:
    """Whether ``value`` is an exact numpy array that the built-in numpy
    backend handles (no backend registered over it): only then may a numpy
    fast path skip the backend. See Note [Replacing the numpy backend] in
    pyengine/backends.py."""
    return type(value) is np.ndarray and backends.numpy_backend_is_builtin


def has_numpy_backend(value) -> bool:
    """Whether ``backend_of(value)`` is known to be the built-in ``NUMPY``:
    the entry of ``value``'s type in ``backend_of``'s cache, filled by the
    first lookup of a type (a numpy scalar, such as the ``np.float64``
    numpy gives for arithmetic on 0-d arrays, or an ndarray subclass).
    Such a value is on the CPU (``NUMPY.device``), so routing needs no
    ``node_device`` for it; the compiled core's validate_outputs passes a
    numpy scalar of a 0-d slot's dtype as it is, which is what the slow
    path does with it. A type not in the cache yet, or one a backend was
    registered for, takes the slow path. The compiled core also remembers
    the first few types it found (forgotten on every registration), which
    answers the same."""
    return backends._backend_cache.get(type(value)) is backends.NUMPY


def numpy_scalars(value, other) -> bool:
    """Whether ``value`` and ``other`` are both numpy scalars that
    ``has_numpy_backend``: their sum is then ``value + other``, as the
    built-in numpy backend's ``add`` computes it."""
    return (isinstance(value, np.generic) and isinstance(other, np.generic)
            and has_numpy_backend(value) and has_numpy_backend(other))


def can_steal(value, extra_references=0) -> bool:
    """Whether nothing outside the engine can see ``value``, so that it may
    become ``.grad`` without a copy; ``extra_references``: the engine's own
    other references (See Note [Stealing with post hooks])."""
    # Cheapest test first: a gradient someone else holds fails on the count.
    if (type(value) is not np.ndarray
            or sys.getrefcount(value) > _STEALABLE_REFCOUNT + extra_references):
        return False
    flags = value.flags
    return value.base is None and flags.owndata and flags.writeable


def _record_forward_traceback(node):
    import traceback

    # Drop this function's frame and NodeBase.__init__'s: the stack ends in user code.
    node.metadata["traceback_"] = "".join(traceback.format_stack()[:-2])


def _set_sequence_nr(node, sequence_nr):
    """Give ``node`` a fixed sequence number (AccumulateGrad); engine use only."""
    check_argument("node", node, NodeBase)
    # As the compiled field (a uint64_t) takes it.
    sequence_nr = operator.index(sequence_nr)
    if not 0 <= sequence_nr < 2**64:
        raise OverflowError(f"sequence_nr {sequence_nr} does not fit uint64_t")
    object.__setattr__(node, "_sequence_nr_", sequence_nr)
