"""Matrix products, each forward beside its backward node: ``matmul``
(numpy's ``@``: vectors, matrices and broadcast batches of matrices) and
``linear`` (``x @ w.T + b``, one node for a 2-D ``w``, as
``torch.nn.functional.linear``).

A 1-D operand of ``matmul`` is treated as numpy does: a row vector on the
left, a column vector on the right, the added axis then removed. The
backward works on the 2-D (or batched) forms and returns gradients with
the broadcast batch axes still there; the engine sums them away (See Note
[Broadcast gradients]).
"""

from __future__ import annotations

import math

import numpy as np

from .graph import OpNode, needs_graph, operand, raw, record
from .shape import reshape, swapaxes
from .tensor import Tensor

__all__ = ["matmul", "linear"]


def _requires(value):
    return isinstance(value, Tensor) and value._requires_grad


def matmul(a, b):
    """``a @ b`` with numpy's rules."""
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):
        return a @ b
    a, b = operand(a), operand(b)
    a_ndim, b_ndim = np.ndim(raw(a)), np.ndim(raw(b))
    if a_ndim == 0 or b_ndim == 0:
        raise ValueError("matmul: both operands need at least one dimension")
    out = Tensor._make(raw(a) @ raw(b))
    if needs_graph(a, b):
        record(MatmulBackward, (a, b), out,
               saved=(a if _requires(b) else None, b if _requires(a) else None),
               a_ndim=a_ndim, b_ndim=b_ndim)
    return out


class MatmulBackward(OpNode):
    def formula(self, grad, a, b):
        grad_a = grad_b = None
        if self.a_ndim == 1 and self.b_ndim == 1:
            return [grad * b if self.needs(0) else None, grad * a if self.needs(1) else None]
        # Restore the axes numpy added and removed for 1-D operands.
        if self.a_ndim == 1:
            grad = reshape(grad, grad.shape[:-1] + (1, grad.shape[-1]))
        if self.b_ndim == 1:
            grad = reshape(grad, grad.shape + (1,))
        if self.needs(0):
            b2 = reshape(b, (1, b.shape[0])) if self.b_ndim == 1 else swapaxes(b, -1, -2)
            grad_a = grad @ b2
            if self.a_ndim == 1:
                grad_a = reshape(grad_a, grad_a.shape[:-2] + grad_a.shape[-1:])
        if self.needs(1):
            a2 = reshape(a, (a.shape[0], 1)) if self.a_ndim == 1 else swapaxes(a, -1, -2)
            grad_b = a2 @ grad
            if self.b_ndim == 1:
                grad_b = reshape(grad_b, grad_b.shape[:-1])
        return [grad_a, grad_b]


def linear(x, weight, bias=None):
    """``x @ weight.T + bias``: ``weight`` is ``(out_features, in_features)``,
    or ``(in_features,)``, where, as in torch, the product is ``matmul(x,
    weight)``, its own node, and the bias is added by another.

    The bias must broadcast to the product's shape without growing it
    (ValueError naming both shapes). torch's rule depends on the kernel it
    picks: with a 2-D weight it refuses some such biases (``(3, 1)`` for a
    3-D ``x`` of 3 rows) and shrinks others (``(1, 5)`` for a 1-D ``x``
    gives a ``(5,)`` result); with a 1-D weight it takes only a 0-d bias,
    and none for a 2-D ``x``. Where torch gives a result, it is this one."""
    x, weight = operand(x), operand(weight)
    weight_ndim = np.ndim(raw(weight))
    if weight_ndim not in (1, 2):
        raise ValueError(f"linear: weight must be 1-D or 2-D, got shape {np.shape(raw(weight))}")
    if bias is not None:
        bias = operand(bias)
    if weight_ndim == 1:
        out = matmul(x, weight)
        if bias is None:
            return out
        _check_bias(out.shape, bias)
        return out + bias
    out_data = raw(x) @ raw(weight).T
    if bias is not None:
        _check_bias(out_data.shape, bias)
        out_data = out_data + raw(bias)
    out = Tensor._make(out_data)
    if needs_graph(x, weight, bias):
        record(LinearBackward, (x, weight, bias), out,
               saved=(x if _requires(weight) else None, weight if _requires(x) else None))
    return out


def _check_bias(product_shape, bias):
    bias_shape = np.shape(raw(bias))
    try:
        grows = np.broadcast_shapes(product_shape, bias_shape) != tuple(product_shape)
    except ValueError:
        grows = True
    if grows:
        raise ValueError(f"linear: a bias of shape {bias_shape} does not broadcast to the "
                         f"product's shape {tuple(product_shape)}")


class LinearBackward(OpNode):
    def formula(self, grad, x, weight):
        grad_x = grad @ weight if self.needs(0) else None
        grad_w = None
        if self.needs(1):
            # The batch size spelled out: numpy cannot infer a -1 for an
            # empty array (Linear(0, n) or Linear(n, 0)).
            batch = math.prod(grad.shape[:-1])
            rows = reshape(grad, (batch, grad.shape[-1]))
            grad_w = swapaxes(rows, 0, 1) @ reshape(x, (batch, x.shape[-1]))
        # The bias gradient keeps the batch axes; the engine sums them.
        return [grad_x, grad_w, grad if self.needs(2) else None]
