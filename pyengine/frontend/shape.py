"""Shape ops, each forward beside its backward node: ``reshape``,
``transpose`` / ``swapaxes``, ``broadcast_to``, indexing (``getitem``,
its backward ``scatter_add``, and ``index_put`` for ``x[i] = v``),
``concatenate`` and ``stack``.

``reshape`` (when numpy does not copy), ``transpose``, basic indexing and
``broadcast_to`` return views: they share the version counter of their
input (See Note [Views and the version counter]).

Indexing follows numpy: integers, slices, None and Ellipsis are basic
indexing (a view); integer arrays, lists and boolean masks are advanced
indexing (a copy). The backward of either adds the gradient into zeros of
the input's shape at the index, with ``np.add.at`` for advanced indices so
that a repeated index gets the sum of its gradients (scatter-add).

A lookup along the first axis (one integer array as the whole index, and
``embedding``) has an indexed backward instead: a
:class:`pyengine.IndexedGradient` of the rows looked up, which the engine
sums and adds into ``.grad`` without a dense array of the table's shape
(See Note [Where an indexed gradient goes] in ``pyengine/indexed.py``).
Under ``create_graph`` its backward is the dense scatter-add, a Tensor op.
"""

from __future__ import annotations

import numpy as np

import pyengine

from .graph import OpNode, mark_view, needs_graph, operand, raw, record
from .pointwise import where
from .tensor import Tensor, array_module

__all__ = ["reshape", "transpose", "swapaxes", "broadcast_to", "getitem", "embedding",
           "scatter_add", "index_put", "concatenate", "stack"]


def _shares_memory(out, x):
    return array_module(x).may_share_memory(out, x)


def reshape(x, shape):
    """``x`` with a new shape (one entry may be -1)."""
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    if not isinstance(x, Tensor):
        return x.reshape(shape)
    out = Tensor._make(x.data.reshape(shape))
    if _shares_memory(out.data, x.data):
        mark_view(out, x)
    if needs_graph(x):
        record(ReshapeBackward, (x,), out, input_shape=x.shape)
    return out


class ReshapeBackward(OpNode):
    def formula(self, grad):
        return [reshape(grad, self.input_shape)]


def transpose(x, axes=None):
    """``x`` with its axes permuted by ``axes`` (reversed by default), as numpy."""
    if not isinstance(x, Tensor):
        return x.transpose(axes)
    axes = tuple(range(x.ndim))[::-1] if axes is None else tuple(int(a) % x.ndim for a in axes)
    out = mark_view(Tensor._make(x.data.transpose(axes)), x)
    if needs_graph(x):
        record(TransposeBackward, (x,), out, inverse=tuple(np.argsort(axes).tolist()))
    return out


class TransposeBackward(OpNode):
    def formula(self, grad):
        return [transpose(grad, self.inverse)]


def swapaxes(x, axis1, axis2):
    """``x`` with two axes exchanged."""
    if not isinstance(x, Tensor):
        return x.swapaxes(axis1, axis2)
    axes = list(range(x.ndim))
    axes[axis1], axes[axis2] = axes[axis2], axes[axis1]
    return transpose(x, axes)


def broadcast_to(x, shape):
    """``x`` broadcast to ``shape`` (a read-only view)."""
    shape = tuple(shape)
    if not isinstance(x, Tensor):
        if np.shape(x) == shape:
            return x
        return array_module(x).broadcast_to(x, shape)
    out = mark_view(Tensor._make(array_module(x.data).broadcast_to(x.data, shape)), x)
    if needs_graph(x):
        record(BroadcastToBackward, (x,), out)
    return out


class BroadcastToBackward(OpNode):
    def formula(self, grad):
        # The engine sums the gradient back to the input's shape.
        return [grad]


# -- indexing --------------------------------------------------------------------------

_BASIC_INDEX_TYPES = (int, np.integer, slice, type(None), type(Ellipsis))


def _index_tensors(index):
    """The Tensors among ``index``'s items: a backward that keeps the index
    checks their versions (``record``'s ``checked``)."""
    items = index if isinstance(index, tuple) else (index,)
    return [item for item in items if isinstance(item, Tensor)]


def _normalize_index(index):
    """An index as a tuple of ints, slices, None, Ellipsis and arrays."""
    items = index if isinstance(index, tuple) else (index,)
    normalized = []
    for item in items:
        if isinstance(item, Tensor):
            item = item.data
        elif isinstance(item, (list, tuple)):
            item = np.asarray(item)
            if item.size == 0:
                # numpy reads [] as a float array, which no index takes;
                # torch reads it as an empty index.
                item = item.astype(np.intp)
        normalized.append(item)
    return tuple(normalized)


def _is_basic(index):
    for item in index:
        if not isinstance(item, _BASIC_INDEX_TYPES) or isinstance(item, (bool, np.bool_)):
            return False
    return True


def getitem(x, index):
    """``x[index]`` with numpy's rules."""
    if not isinstance(x, Tensor):
        return x[index]
    index_tensors = _index_tensors(index)
    index = _normalize_index(index)
    basic = _is_basic(index)
    if basic and Ellipsis not in index:
        # A trailing Ellipsis makes numpy return a 0-d view, not a scalar copy.
        data = x.data[index + (Ellipsis,)]
    else:
        data = x.data[index]
    out = Tensor._make(data)
    if basic:
        mark_view(out, x)
    if needs_graph(x):
        # An advanced index is saved for backward, as torch's IndexBackward0
        # saves its index tensors: a second backward after the graph was
        # freed raises. A basic one is kept as an attribute, as torch's
        # SliceBackward0 and SelectBackward0 keep theirs: such a backward
        # runs again.
        if _is_row_lookup(index, x):
            record(RowLookupBackward, (x,), out, saved=(index[0],), checked=index_tensors,
                   input_shape=x.shape)
        elif basic:
            record(BasicIndexBackward, (x,), out, index=index, input_shape=x.shape)
        else:
            record(IndexBackward, (x,), out, saved=(index,), checked=index_tensors,
                   input_shape=x.shape)
    return out


def _is_row_lookup(index, x):
    """Whether ``x[index]`` picks whole rows: one integer array as the index."""
    if len(index) != 1 or x.ndim == 0:
        return False
    rows = index[0]
    return (hasattr(rows, "dtype") and not isinstance(rows, np.generic)
            and rows.dtype.kind in "iu")


class BasicIndexBackward(OpNode):
    """The backward of ``x[index]`` with integers, slices, None and Ellipsis
    (a view)."""

    def formula(self, grad):
        return [scatter_add(grad, self.index, self.input_shape)]


class IndexBackward(OpNode):
    """The backward of ``x[index]`` with arrays or masks in the index (a copy)."""

    def formula(self, grad, index):
        return [scatter_add(grad, index, self.input_shape)]


class RowLookupBackward(OpNode):
    """The backward of ``x[rows]`` (``rows`` an integer array): the rows'
    gradients as an IndexedGradient, without a dense array of ``x``'s shape;
    a dense scatter-add under ``create_graph``, where the gradient is a Tensor
    op that records a graph."""

    def formula(self, grad, rows):
        if isinstance(grad, Tensor):
            return [scatter_add(grad, (rows,), self.input_shape)]
        xp = array_module(grad)
        rows = xp.asarray(rows).reshape(-1)
        values = grad.reshape((rows.shape[0],) + tuple(self.input_shape[1:]))
        return [pyengine.IndexedGradient(rows, values, tuple(self.input_shape))]


def embedding(weight, indices, sparse=False):
    """``weight[indices]``: one row of ``weight`` per index, as
    ``torch.nn.functional.embedding`` (no padding index or max norm).

    The backward is an IndexedGradient of the rows looked up (See Note
    [Where an indexed gradient goes] in ``pyengine/indexed.py``), summed
    over lookups and added into ``weight.grad`` in place. ``sparse=True``
    also keeps ``weight.grad`` an IndexedGradient (it marks the leaf
    ``weight`` with :func:`pyengine.keep_indexed_grad`, as torch's
    ``sparse=True`` gives it a sparse ``.grad``); ``sparse=False`` leaves a
    dense ``.grad``.
    """
    if not isinstance(weight, Tensor):
        raise TypeError(f"embedding weight must be a Tensor, got {type(weight).__name__}")
    if weight.ndim != 2:
        raise ValueError(f"embedding weight must be 2-D (rows, features), got shape {weight.shape}")
    index_tensors = _index_tensors(indices)
    if isinstance(indices, Tensor):
        indices = indices.data
    indices = array_module(weight.data).asarray(indices)
    if indices.dtype.kind not in "iu":
        raise TypeError(f"embedding indices must be integers, got dtype {indices.dtype}")
    rows = weight.shape[0]
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= rows):
        bad = int(indices.min()) if int(indices.min()) < 0 else int(indices.max())
        raise IndexError(f"embedding index {bad} is out of range for a weight of {rows} rows")
    if sparse and weight.is_leaf and weight.requires_grad:
        pyengine.keep_indexed_grad(weight)
    out = Tensor._make(weight.data[indices])
    if needs_graph(weight):
        record(RowLookupBackward, (weight,), out, saved=(indices,), checked=index_tensors,
               input_shape=weight.shape)
    return out


def _scatter_add_array(values, index, shape):
    xp = array_module(values)
    result = xp.zeros(shape, dtype=values.dtype)
    if _is_basic(index):
        result[index] = values
    elif xp is np:
        np.add.at(result, index, values)
    else:  # pragma: no cover - needs cupy
        import cupyx

        cupyx.scatter_add(result, index, values)
    return result


def scatter_add(values, index, shape):
    """Zeros of ``shape`` with ``values`` added at ``index`` (repeated indices
    add up): the backward of ``x[index]``."""
    index = _normalize_index(index)
    if not isinstance(values, Tensor):
        return _scatter_add_array(array_module(values).asarray(values), index, shape)
    out = Tensor._make(_scatter_add_array(values.data, index, tuple(shape)))
    if needs_graph(values):
        record(ScatterAddBackward, (values,), out, index=index)
    return out


class ScatterAddBackward(OpNode):
    def formula(self, grad):
        return [getitem(grad, self.index)]


def index_put(x, index, value):
    """A copy of ``x`` with ``x[index] = value`` (what ``x[index] = value``
    records): ``x`` gets the gradient outside the index, ``value`` inside."""
    index_tensors = _index_tensors(index)
    index = _normalize_index(index)
    value = operand(value)
    data = x.data.copy()
    data[index] = raw(value)
    out = Tensor._make(data)
    if needs_graph(x, value):
        keep = array_module(data).ones(x.shape, dtype=bool)
        keep[index] = False
        record(IndexPutBackward, (x, value), out, checked=index_tensors, index=index, keep=keep)
    return out


class IndexPutBackward(OpNode):
    def formula(self, grad):
        return [where(self.keep, grad, 0.0) if self.needs(0) else None,
                getitem(grad, self.index) if self.needs(1) else None]


# -- joining -----------------------------------------------------------------------------

def concatenate(tensors, axis=0):
    """Join tensors along an existing ``axis``."""
    tensors = [operand(t) for t in tensors]
    if not any(isinstance(t, Tensor) for t in tensors):
        return array_module(tensors[0]).concatenate(tensors, axis=axis)
    arrays = [raw(t) for t in tensors]
    out = Tensor._make(array_module(arrays[0]).concatenate(arrays, axis=axis))
    if needs_graph(*tensors):
        axis = int(axis) % out.ndim
        bounds = np.cumsum([0] + [a.shape[axis] for a in arrays]).tolist()
        record(ConcatenateBackward, tensors, out, axis=axis, bounds=bounds)
    return out


class ConcatenateBackward(OpNode):
    def formula(self, grad):
        lead = (slice(None),) * self.axis
        bounds = self.bounds
        return [getitem(grad, lead + (slice(bounds[i], bounds[i + 1]),)) if self.needs(i) else None
                for i in range(len(bounds) - 1)]


def stack(tensors, axis=0):
    """Join tensors of one shape along a new ``axis``."""
    tensors = [operand(t) for t in tensors]
    if not any(isinstance(t, Tensor) for t in tensors):
        return array_module(tensors[0]).stack(tensors, axis=axis)
    arrays = [raw(t) for t in tensors]
    out = Tensor._make(array_module(arrays[0]).stack(arrays, axis=axis))
    if needs_graph(*tensors):
        record(StackBackward, tensors, out, axis=int(axis) % out.ndim)
    return out


class StackBackward(OpNode):
    def formula(self, grad):
        lead = (slice(None),) * self.axis
        return [getitem(grad, lead + (i,)) if self.needs(i) else None
                for i in range(len(self._next_edges))]
