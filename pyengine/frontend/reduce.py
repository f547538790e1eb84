"""Reductions, each forward beside its backward node: ``sum``, ``mean``,
``max`` over an axis, a tuple of axes or everything (numpy's ``axis`` and
``keepdims``), and ``sum_to``, the reduction the engine applies to
broadcast gradients.

``max`` is numpy's ``max`` (PyTorch's ``amax``): values only, and the
gradient is shared evenly among the elements equal to the maximum, as
``torch.amax`` and the full ``torch.max(x)`` do. ``torch.max(x, dim)``
instead sends all of it to one index; with distinct values the two agree.
Where the maximum is NaN, the NaNs share the gradient, as in the full
``torch.max(x)`` (``torch.amax`` gives NaN everywhere there).

A reduction's backward broadcasts the gradient back with ``broadcast_to``,
so that under create_graph it is itself recorded.
"""

from __future__ import annotations

import numpy as np

from pyengine.backends import sum_to_shape_axes

from .graph import OpNode, needs_graph, raw, record
from .pointwise import where
from .shape import broadcast_to, reshape
from .tensor import Tensor, array_module

__all__ = ["sum", "mean", "max", "sum_to", "normalize_axes"]


def normalize_axes(axis, ndim) -> tuple:
    """``axis`` (None, an int or a tuple, negatives allowed) as a sorted tuple."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    normalized = []
    extent = ndim if ndim else 1  # a 0-d tensor takes axis 0 or -1, as in PyTorch
    for a in axes:
        if not -extent <= a < extent:
            raise ValueError(f"axis {a} is out of bounds for a tensor of dimension {ndim}")
        normalized.append(int(a) % extent)
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"duplicate axis in {axis}")
    if ndim == 0:
        # ...and reducing a 0-d tensor over it reduces over no axis (numpy,
        # which knows no axis 0 there, would refuse it).
        return ()
    return tuple(sorted(normalized))


def _kept_shape(shape, axes):
    """``shape`` with the reduced ``axes`` kept as size 1."""
    return tuple(1 if i in axes else size for i, size in enumerate(shape))


def _restore(grad, kept_shape, keepdims):
    """The gradient of a reduction's output, reshaped to keep the reduced axes."""
    return grad if keepdims else reshape(grad, kept_shape)


def sum(x, axis=None, keepdims=False):  # noqa: A001
    """Sum over ``axis`` (all axes by default)."""
    if not isinstance(x, Tensor):
        return array_module(x).sum(x, axis=axis, keepdims=keepdims)
    axes = normalize_axes(axis, x.ndim)
    out = Tensor._make(x.data.sum(axis=axes, keepdims=keepdims))
    if needs_graph(x):
        record(SumBackward, (x,), out, input_shape=x.shape, kept_shape=_kept_shape(x.shape, axes),
               keepdims=keepdims)
    return out


class SumBackward(OpNode):
    def formula(self, grad):
        return [broadcast_to(_restore(grad, self.kept_shape, self.keepdims), self.input_shape)]


def mean(x, axis=None, keepdims=False):
    """Mean over ``axis`` (all axes by default)."""
    if not isinstance(x, Tensor):
        return array_module(x).mean(x, axis=axis, keepdims=keepdims)
    axes = normalize_axes(axis, x.ndim)
    out = Tensor._make(x.data.mean(axis=axes, keepdims=keepdims))
    count = 1
    for a in axes:
        count *= x.shape[a]
    if needs_graph(x):
        record(MeanBackward, (x,), out, input_shape=x.shape,
               kept_shape=_kept_shape(x.shape, axes), keepdims=keepdims, count=count)
    return out


class MeanBackward(OpNode):
    def formula(self, grad):
        grad = _restore(grad, self.kept_shape, self.keepdims) / self.count
        return [broadcast_to(grad, self.input_shape)]


def max(x, axis=None, keepdims=False):  # noqa: A001
    """Largest value over ``axis`` (all axes by default); see the module docstring."""
    if not isinstance(x, Tensor):
        return array_module(x).max(x, axis=axis, keepdims=keepdims)
    axes = normalize_axes(axis, x.ndim)
    out = Tensor._make(x.data.max(axis=axes, keepdims=keepdims))
    if needs_graph(x):
        record(MaxBackward, (x,), out, saved=(x, out), axes=axes,
               kept_shape=_kept_shape(x.shape, axes), keepdims=keepdims)
    return out


class MaxBackward(OpNode):
    def formula(self, grad, x, out):
        # The mask takes no gradient: built on the arrays. Where the maximum
        # is NaN, the NaNs share the gradient, as torch.max(x)'s backward
        # (evenly_distribute_backward) gives it.
        x_data, out_data = raw(x), _restore(raw(out), self.kept_shape, self.keepdims)
        xp = array_module(x_data)
        is_max = (x_data == out_data) | (xp.isnan(x_data) & xp.isnan(out_data))
        count = sum(is_max, self.axes, keepdims=True)
        share = _restore(grad, self.kept_shape, self.keepdims) / count
        return [where(is_max, share, 0.0)]


def sum_to(x, shape):
    """Sum a broadcast ``x`` down to ``shape``: what the engine does to a
    gradient of a broadcast shape (See Note [Broadcast gradients])."""
    shape = tuple(shape)
    if not isinstance(x, Tensor):
        return _sum_to_array(x, shape)
    if x.shape == shape:
        return x
    out = Tensor._make(_sum_to_array(x.data, shape))
    if needs_graph(x):
        record(SumToBackward, (x,), out, input_shape=x.shape)
    return out


def _sum_to_array(value, shape):
    axes = sum_to_shape_axes(value.shape, shape)
    if axes:
        value = value.sum(axis=axes, keepdims=True)
    return value.reshape(shape)


class SumToBackward(OpNode):
    def formula(self, grad):
        return [broadcast_to(grad, self.input_shape)]
