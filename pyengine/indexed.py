"""Indexed gradients: the gradient of a lookup, as the rows it touches.

The backward of a lookup (an embedding, a gather, ``x[indices]`` with an
integer array) touches a few rows of a large table. Materializing it as a
dense array of the table's shape costs the whole table per lookup; an
:class:`IndexedGradient` keeps only ``indices`` (one row number per looked
up row, along the first axis) and ``values`` (those rows' gradients), plus
the dense ``shape`` it stands for. The dense gradient it means is
``zeros(shape)`` with ``values[k]`` added into row ``indices[k]`` for every
``k`` (repeated rows add up), which is what ``to_dense()`` returns; this is
PyTorch's sparse COO gradient (``nn.Embedding(sparse=True)``) restricted to
whole rows.

It is a value like any other: :class:`IndexedBackend` is registered for it
in :mod:`pyengine.backends`, and it asks the backend of its ``values``
(numpy or cupy) for the three operations it needs beyond the usual ones:
``index_add_`` (``np.add.at``, ``cupyx.scatter_add``), ``concatenate`` and
``unique_inverse``. See Note [Where an indexed gradient goes] for how the
engine treats it.

Note [Where an indexed gradient goes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
- InputBuffer: two indexed gradients sum by concatenation (no dense array);
  once the concatenation holds more rows than the table has, it is
  coalesced (one row per distinct index), so it never outgrows the dense
  array. A dense gradient plus an indexed one is dense: ``np.add.at`` into
  the dense array, in place where the buffer owns it, into a copy where it
  does not (See Note [InputBuffer ownership]).
- validate_outputs checks its shape, dtype and device as any value's, and
  casts its values.
- A node receives indexed gradients only if its class says
  ``accepts_indexed_gradients = True`` (AccumulateGrad does); for every
  other node the engine densifies them after the node's pre-hooks (which
  see the indexed value) and before ``apply``.
- AccumulateGrad adds it into an existing ``.grad`` in place (where pyengine
  owns that ``.grad``); where ``.grad`` is None it stores ``to_dense()``,
  or a copy of the indexed gradient itself when the leaf asks for it with
  ``LeafState.keep_indexed`` (:func:`keep_indexed_grad`), as PyTorch's
  ``sparse=True`` leaves a sparse ``.grad``. Two indexed gradients into a
  kept indexed ``.grad`` concatenate.
- ``grad(inputs=)`` returns what reached the input, indexed or not; call
  :func:`densify` (or ``.to_dense()``) on the result for an array.

Indices are checked when the gradient is made (integers, one dimension,
each within the first axis, negative ones counted from the end as numpy
does, and rewritten as non-negative), so that a bad index is an error that
names the lookup, not an error deep in a sum.
"""

from __future__ import annotations

import operator

import numpy as np

from . import backends

__all__ = ["IndexedGradient", "IndexedBackend", "densify", "keep_indexed_grad"]


def _backend_for(value, what):
    backend = backends.backend_of(value)
    if backend is None or isinstance(value, IndexedGradient):
        raise TypeError(f"IndexedGradient {what} must be an array some backend handles "
                        f"(numpy, cupy), got {type(value).__name__}")
    return backend


class IndexedGradient:
    """``IndexedGradient(indices, values, shape)``: the gradient that is zero
    everywhere but in rows ``indices`` of a ``shape`` array, where it is
    ``values`` (``values.shape == (len(indices),) + shape[1:]``; repeated rows
    add up). The fields are read-only; the arrays are the caller's (not
    copied), so do not change them after handing the gradient over.

    ``+`` with another IndexedGradient of the same shape gives an
    IndexedGradient; with a dense array, a dense array.
    """

    __slots__ = ("_indices", "_values", "_shape", "__weakref__")

    # numpy hands ``array + indexed`` to __radd__ instead of broadcasting.
    __array_ufunc__ = None

    def __init__(self, indices, values, shape):
        try:
            shape = tuple(operator.index(size) for size in shape)
        except TypeError:
            raise TypeError(f"IndexedGradient shape must be a tuple of ints, got {shape!r}") from None
        if len(shape) == 0 or any(size < 0 for size in shape):
            raise ValueError(f"IndexedGradient shape must have at least one axis and no "
                             f"negative size, got {shape}")
        for what, array in (("indices", indices), ("values", values)):
            if isinstance(array, np.ma.MaskedArray):
                # Its min() and max() skip the masked entries, which np.add.at
                # and densify would use all the same.
                raise TypeError(f"IndexedGradient {what} must not be a masked array: every "
                                "entry is used, masked or not")
        values_backend = _backend_for(values, "values")
        indices_backend = _backend_for(indices, "indices")
        if indices_backend is not values_backend:
            raise TypeError(f"IndexedGradient indices ({type(indices).__name__}) and values "
                            f"({type(values).__name__}) must be arrays of one kind")
        if type(values_backend).index_add_ is backends.ArrayBackend.index_add_:
            raise TypeError(f"the {values_backend.name} backend cannot hold indexed gradients "
                            f"(it has no index_add_)")
        if indices_backend.dtype_kind(indices_backend.dtype(indices)) not in ("i", "u"):
            raise TypeError(f"IndexedGradient indices must be integers, got dtype "
                            f"{indices_backend.dtype(indices)}")
        index_shape = tuple(indices_backend.shape(indices))
        if len(index_shape) != 1:
            raise ValueError(f"IndexedGradient indices must be one-dimensional, got shape "
                             f"{index_shape}")
        expected = index_shape + shape[1:]
        got = tuple(values_backend.shape(values))
        if got != expected:
            raise ValueError(f"IndexedGradient values must have shape {expected} "
                             f"(one row of {shape[1:]} per index), got {got}")
        if index_shape[0]:
            rows = shape[0]
            low, high = values_backend.index_range(indices)
            if low < -rows or high >= rows:
                bad = low if low < -rows else high
                raise IndexError(f"IndexedGradient index {bad} is out of bounds for axis 0 "
                                 f"with size {rows}")
            if low < 0:
                # In int64: the index dtype may not hold ``rows`` (int8
                # indices of a 300-row table).
                indices = indices_backend.cast(indices, np.int64) % rows
        self._indices = indices
        self._values = values
        self._shape = shape

    @classmethod
    def _trusted(cls, indices, values, shape):
        """One made from checked parts (a sum, a cast, a copy): no checks."""
        self = cls.__new__(cls)
        self._indices = indices
        self._values = values
        self._shape = shape
        return self

    indices = property(lambda self: self._indices, doc="Row numbers, one per row of values.")
    values = property(lambda self: self._values, doc="The rows' gradients.")
    shape = property(lambda self: self._shape, doc="The dense shape this gradient stands for.")

    @property
    def dtype(self):
        return backends.backend_of(self._values).dtype(self._values)

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def nnz(self) -> int:
        """How many rows it holds (repeated rows counted each time)."""
        return len(self._indices)

    def to_dense(self):
        """A new dense array of ``shape`` (on the values' device)."""
        backend = backends.backend_of(self._values)
        dense = backend.zeros(self._shape, backend.dtype(self._values), backend.device(self._values))
        return backend.index_add_(dense, self._indices, self._values)

    def add_to_(self, dense):
        """Add this gradient into ``dense`` in place and return ``dense``."""
        backend = backends.backend_of(dense)
        shape = tuple(backend.shape(dense))
        if shape != self._shape:
            raise ValueError(f"cannot add an IndexedGradient of shape {self._shape} into an "
                             f"array of shape {shape}")
        return backend.index_add_(dense, self._indices, self._values)

    def coalesce(self) -> IndexedGradient:
        """The same gradient with each row once, rows in increasing order."""
        backend = backends.backend_of(self._values)
        unique, inverse = backend.unique_inverse(self._indices)
        rows = backend.zeros((len(unique),) + self._shape[1:], backend.dtype(self._values),
                             backend.device(self._values))
        return IndexedGradient._trusted(unique, backend.index_add_(rows, inverse, self._values),
                                        self._shape)

    def __add__(self, other):
        if isinstance(other, IndexedGradient):
            return concatenate_indexed(self, other)
        backend = backends.backend_of(other)
        if backend is None:
            return NotImplemented
        return backend.add(other, self)

    __radd__ = __add__

    def __repr__(self):
        return (f"IndexedGradient(shape={self._shape}, nnz={len(self._indices)}, "
                f"dtype={self.dtype})")


def concatenate_indexed(a: IndexedGradient, b: IndexedGradient) -> IndexedGradient:
    """``a + b`` as one IndexedGradient, coalesced once it holds more rows than
    the table has (See Note [Where an indexed gradient goes])."""
    if a._shape != b._shape:
        raise ValueError(f"cannot add IndexedGradients of shapes {a._shape} and {b._shape}")
    backend = backends.backend_of(a._values)
    total = IndexedGradient._trusted(backend.concatenate((a._indices, b._indices)),
                                     backend.concatenate((a._values, b._values)), a._shape)
    if len(total._indices) > a._shape[0]:
        total = total.coalesce()
    return total


def densify(value):
    """``value`` as a dense array: ``value.to_dense()`` for an
    IndexedGradient, ``value`` itself for anything else (None included)."""
    if type(value) is IndexedGradient:
        return value.to_dense()
    return value


def keep_indexed_grad(tensor, keep: bool = True) -> None:
    """Let ``tensor`` (a leaf) keep an indexed gradient indexed in ``.grad``
    (PyTorch's ``sparse=True``) instead of densifying the first one to
    arrive. Later gradients are added into whatever ``.grad`` holds."""
    from .node import leaf_state

    leaf_state(tensor).keep_indexed = bool(keep)


class IndexedBackend(backends.ArrayBackend):
    """The value backend of :class:`IndexedGradient`: metadata and arithmetic
    read from, and done by, the backend of its values."""

    name = "indexed"

    def shape(self, value):
        return value._shape

    def dtype(self, value):
        return value.dtype

    def device(self, value):
        return backends.backend_of(value._values).device(value._values)

    def dtype_kind(self, dtype):
        return backends.NUMPY.dtype_kind(dtype)

    def add(self, a, b):
        if type(b) is IndexedGradient:
            return concatenate_indexed(a, b)
        # dense + indexed: a dense sum that the dense side's backend makes.
        return backends.backend_of(b).add(b, a)

    def sum_to(self, value, shape):
        shape = tuple(shape)
        if shape == value._shape:
            return value
        dense = value.to_dense()
        return backends.backend_of(dense).sum_to(dense, shape)

    def cast(self, value, dtype):
        values_backend = backends.backend_of(value._values)
        return IndexedGradient._trusted(value._indices, values_backend.cast(value._values, dtype),
                                        value._shape)

    def copy(self, value):
        values_backend = backends.backend_of(value._values)
        return IndexedGradient._trusted(values_backend.copy(value._indices),
                                        values_backend.copy(value._values), value._shape)

    def to_device(self, value, device):
        values_backend = backends.backend_of(value._values)
        return IndexedGradient._trusted(values_backend.to_device(value._indices, device),
                                        values_backend.to_device(value._values, device),
                                        value._shape)

    def zeros(self, shape, dtype, device):
        return backends.NUMPY.zeros(shape, dtype, device)

    def ones_like(self, value):
        dense = value.to_dense()
        return backends.backend_of(dense).ones_like(dense)

    def has_nan(self, value):
        return backends.backend_of(value._values).has_nan(value._values)
