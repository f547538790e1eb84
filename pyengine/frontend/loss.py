"""Softmax and losses, each forward beside its backward node: ``softmax``,
``log_softmax``, ``nll_loss`` and ``cross_entropy``.

``cross_entropy(logits, target)`` is ``nll_loss(log_softmax(logits, 1),
target)``, two nodes as in PyTorch. ``target`` holds class indices (an
integer array or Tensor of shape ``(N,)``) for ``logits`` of shape ``(N,
C)``; ``reduction`` is ``"mean"`` (default), ``"sum"`` or ``"none"``.
Class weights, ``ignore_index``, label smoothing and probability targets
are not supported.
"""

from __future__ import annotations

from .graph import OpNode, needs_graph, raw, record
from .pointwise import exp
from .reduce import sum
from .shape import broadcast_to, scatter_add
from .tensor import Tensor, array_module

__all__ = ["softmax", "log_softmax", "nll_loss", "cross_entropy"]


def _shifted(data, axis):
    """``data`` minus its maximum along ``axis``: exp() of it cannot overflow.
    An empty ``data`` has no maximum and needs no shift: softmax of it is
    empty, as in torch."""
    if data.size == 0:
        return data
    return data - data.max(axis=axis, keepdims=True)


def softmax(x, axis=-1):
    """``exp(x) / sum(exp(x))`` along ``axis``."""
    xp = array_module(raw(x))
    e = xp.exp(_shifted(raw(x), axis))
    data = e / e.sum(axis=axis, keepdims=True)
    if not isinstance(x, Tensor):
        return data
    out = Tensor._make(data)
    if needs_graph(x):
        record(SoftmaxBackward, (x,), out, saved=(out,), axis=axis)
    return out


class SoftmaxBackward(OpNode):
    def formula(self, grad, out):
        return [out * (grad - sum(grad * out, self.axis, keepdims=True))]


def log_softmax(x, axis=-1):
    """``x - log(sum(exp(x)))`` along ``axis``, computed stably."""
    xp = array_module(raw(x))
    shifted = _shifted(raw(x), axis)
    if shifted.size == 0:  # empty, as in torch (and no log(0) on the way)
        data = xp.empty_like(shifted)
    else:
        data = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
    if not isinstance(x, Tensor):
        return data
    out = Tensor._make(data)
    if needs_graph(x):
        record(LogSoftmaxBackward, (x,), out, saved=(out,), axis=axis)
    return out


class LogSoftmaxBackward(OpNode):
    def formula(self, grad, out):
        return [grad - exp(out) * sum(grad, self.axis, keepdims=True)]


_REDUCTIONS = ("mean", "sum", "none")


def nll_loss(log_probs, target, reduction="mean"):
    """The negative log-likelihood of class indices ``target`` under
    ``log_probs`` of shape ``(N, C)``.

    Every target must be a class, ``0 <= target < C``: as PyTorch, an index
    out of that range raises ``IndexError("Target -1 is out of bounds.")``
    (naming the first such target) rather than counting from the end as
    numpy indexing would. There is no ``ignore_index``: a target of -100,
    which PyTorch ignores by default, is refused the same way."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    data = raw(log_probs)
    if data.ndim != 2:
        raise ValueError(f"nll_loss expects log_probs of shape (N, C), got {data.shape}")
    xp = array_module(data)
    target_tensor = target
    target = xp.asarray(raw(target))
    if target.shape != data.shape[:1] or target.dtype.kind not in "iu":
        raise ValueError(f"nll_loss expects integer class indices of shape {data.shape[:1]}, got "
                         f"{target.dtype} {target.shape}")
    out_of_bounds = (target < 0) | (target >= data.shape[1])
    if out_of_bounds.any():
        raise IndexError(f"Target {int(target[out_of_bounds][0])} is out of bounds.")
    index = (xp.arange(data.shape[0]), target)
    picked = -data[index]
    if reduction == "mean":
        picked = picked.mean()
    elif reduction == "sum":
        picked = picked.sum()
    if not isinstance(log_probs, Tensor):
        return picked
    out = Tensor._make(picked)
    if needs_graph(log_probs):
        # As torch's NllLossBackward0, which saves both: an in-place change
        # of either before backward raises.
        record(NllLossBackward, (log_probs,), out, checked=(log_probs, target_tensor), index=index,
               input_shape=data.shape, reduction=reduction)
    return out


class NllLossBackward(OpNode):
    def formula(self, grad):
        rows = self.input_shape[0]
        if self.reduction == "mean":
            grad = grad / rows
        values = broadcast_to(-grad, (rows,))
        return [scatter_add(values, self.index, self.input_shape)]


def cross_entropy(logits, target, reduction="mean"):
    """``nll_loss(log_softmax(logits, axis=1), target)``."""
    return nll_loss(log_softmax(logits, axis=1), target, reduction)

