"""Elementwise ops, each forward beside its backward node.

Arithmetic (``add sub mul div reciprocal neg pow``), functions (``exp log sqrt tanh
sigmoid relu abs clip``), ``maximum`` and ``where``, plus the few
non-differentiable helpers formulas need (comparisons, ``sign``) and the
copies (``clone``, ``astype``, ``to_device``, ``fill``, ``copy_from``).

Every function accepts Tensors, arrays and numbers. With no Tensor among its
arguments it is plain numpy (or cupy): that is how backward formulas run
outside create_graph (See Note [Formulas on arrays or tensors]). Binary ops
broadcast; their gradients come back in the broadcast shape and the engine
reduces them (See Note [Broadcast gradients]).

Derivatives at the kinks follow PyTorch: ``relu`` and ``clip`` pass the
gradient where the input is inside the closed interval (``relu``: where
the output is positive); ``abs`` uses ``sign`` (0 at 0); ``maximum`` splits
the gradient evenly between equal inputs; ``pow`` gives 0 for exponent 0
and, for the exponent's gradient, 0 where the base is 0 and the exponent
non-negative.
"""

from __future__ import annotations

import numpy as np

from pyengine import Device

from .graph import OpNode, needs_graph, operand, raw, record
from .tensor import Tensor, _as_array, array_module

__all__ = ["add", "sub", "mul", "div", "reciprocal", "neg", "pow", "exp", "log", "sqrt", "tanh", "sigmoid",
           "relu", "threshold_backward", "abs", "clip", "maximum", "where", "compare", "sign",
           "clone", "astype", "to_device", "fill", "copy_from", "zeros_like_value"]


def _is_tensor(*values):
    for value in values:
        if isinstance(value, Tensor):
            return True
    return False


def _requires(value):
    return isinstance(value, Tensor) and value._requires_grad


def zeros_like_value(value):
    """Zeros shaped like ``value`` (an array or a Tensor, then a constant Tensor)."""
    data = raw(value)
    zeros = array_module(data).zeros_like(data)
    return Tensor._make(zeros) if isinstance(value, Tensor) else zeros


# -- add, sub, neg ---------------------------------------------------------------------

def add(a, b):
    """``a + b``."""
    if not _is_tensor(a, b):
        return np.add(a, b)
    a, b = operand(a), operand(b)
    out = Tensor._make(raw(a) + raw(b))
    if needs_graph(a, b):
        record(AddBackward, (a, b), out)
    return out


class AddBackward(OpNode):
    def formula(self, grad):
        # None where the input takes no gradient, so that hooks see what
        # torch's AddBackward0 gives them.
        return [grad if self.needs(0) else None, grad if self.needs(1) else None]


def sub(a, b):
    """``a - b``."""
    if not _is_tensor(a, b):
        return np.subtract(a, b)
    a, b = operand(a), operand(b)
    out = Tensor._make(raw(a) - raw(b))
    if needs_graph(a, b):
        if isinstance(a, Tensor):
            record(SubBackward, (a, b), out)
        else:
            # A number minus a Tensor: torch's rsub(Tensor, Scalar), whose
            # node has the Tensor as its only input.
            record(RsubBackward, (b,), out)
    return out


class SubBackward(OpNode):
    def formula(self, grad):
        return [grad if self.needs(0) else None, -grad if self.needs(1) else None]


class RsubBackward(OpNode):
    def formula(self, grad):
        return [-grad]


def neg(x):
    """``-x``."""
    if not _is_tensor(x):
        return np.negative(x)
    out = Tensor._make(-x.data)
    if needs_graph(x):
        record(NegBackward, (x,), out)
    return out


class NegBackward(OpNode):
    def formula(self, grad):
        return [-grad]


# -- mul, div ---------------------------------------------------------------------------

def mul(a, b):
    """``a * b``."""
    if not _is_tensor(a, b):
        return np.multiply(a, b)
    a, b = operand(a), operand(b)
    out = Tensor._make(raw(a) * raw(b))
    if needs_graph(a, b):
        # Save each factor only if the other one's gradient needs it.
        record(MulBackward, (a, b), out,
               saved=(a if _requires(b) else None, b if _requires(a) else None))
    return out


class MulBackward(OpNode):
    def formula(self, grad, a, b):
        # b's gradient first: See Note [Backward formulas in PyTorch's order].
        grad_b = grad * a if self.needs(1) else None
        grad_a = grad * b if self.needs(0) else None
        return [grad_a, grad_b]


def div(a, b):
    """``a / b``."""
    if not _is_tensor(a, b):
        return np.true_divide(a, b)
    a, b = operand(a), operand(b)
    out = Tensor._make(raw(a) / raw(b))
    if needs_graph(a, b):
        record(DivBackward, (a, b), out, saved=(a if _requires(b) else None, b))
    return out


class DivBackward(OpNode):
    def formula(self, grad, a, b):
        # b's gradient first: See Note [Backward formulas in PyTorch's order].
        grad_b = -grad * ((a / b) / b) if self.needs(1) else None
        grad_a = grad / b if self.needs(0) else None
        return [grad_a, grad_b]


def reciprocal(x):
    """``1 / x``, a float for integer ``x`` (true division, as torch's)."""
    if not _is_tensor(x):
        return np.true_divide(1, x)
    out = Tensor._make(np.true_divide(1, x.data))
    if needs_graph(x):
        record(ReciprocalBackward, (x,), out, saved=(out,))
    return out


class ReciprocalBackward(OpNode):
    def formula(self, grad, out):
        return [-grad * (out * out)]


# -- pow ----------------------------------------------------------------------------------

def pow(a, b):  # noqa: A001 (the operator's name)
    """``a ** b``; either may be a number.

    As torch's three overloads, the node has an input per Tensor operand:
    ``x ** c`` and ``c ** x`` have one (torch's PowBackward0 and
    PowBackward2), ``x ** y`` two (PowBackward1)."""
    if not _is_tensor(a, b):
        return np.power(a, b)
    a, b = operand(a), operand(b)
    out = Tensor._make(raw(a) ** raw(b))
    if needs_graph(a, b):
        tensor_base, tensor_exponent = isinstance(a, Tensor), isinstance(b, Tensor)
        inputs = (a, b) if tensor_base and tensor_exponent else (a,) if tensor_base else (b,)
        record(PowBackward, inputs, out, saved=(a, b, out if _requires(b) else None),
               tensor_base=tensor_base, tensor_exponent=tensor_exponent)
    return out


class PowBackward(OpNode):
    def formula(self, grad, a, b, out):
        # The inputs: the base if it is a Tensor, then the exponent if it is one.
        base_index = 0 if self.tensor_base else None
        exponent_index = (1 if self.tensor_base else 0) if self.tensor_exponent else None
        grads = [None] * len(self._next_edges)
        # b's gradient first: See Note [Backward formulas in PyTorch's order].
        if exponent_index is not None and self.needs(exponent_index):
            # PyTorch's pow_backward_exponent: the mask is applied to
            # out * log(a) and the incoming gradient multiplies the result,
            # so a NaN or inf in ``grad`` (or, under create_graph, a second
            # order gradient through log(0)) still reaches b as NaN.
            base_is_zero = (a == 0) & (b >= 0)
            grads[exponent_index] = grad * where(base_is_zero, 0.0, out * log(a))
        if base_index is not None and self.needs(base_index):
            if not self.tensor_exponent:
                grads[base_index] = zeros_like_value(grad) if b == 0 else grad * b * a ** (b - 1)
            else:
                grads[base_index] = where(b == 0, 0.0, grad * b * a ** (b - 1))
        return grads


# -- functions of one tensor ------------------------------------------------------------

def exp(x):
    """``e ** x``."""
    if not _is_tensor(x):
        return np.exp(x)
    out = Tensor._make(np.exp(x.data))
    if needs_graph(x):
        record(ExpBackward, (x,), out, saved=(out,))
    return out


class ExpBackward(OpNode):
    def formula(self, grad, out):
        return [grad * out]


def log(x):
    """Natural logarithm."""
    if not _is_tensor(x):
        return np.log(x)
    out = Tensor._make(np.log(x.data))
    if needs_graph(x):
        record(LogBackward, (x,), out, saved=(x,))
    return out


class LogBackward(OpNode):
    def formula(self, grad, x):
        return [grad / x]


def sqrt(x):
    if not _is_tensor(x):
        return np.sqrt(x)
    out = Tensor._make(np.sqrt(x.data))
    if needs_graph(x):
        record(SqrtBackward, (x,), out, saved=(out,))
    return out


class SqrtBackward(OpNode):
    def formula(self, grad, out):
        return [grad / (2 * out)]


def tanh(x):
    if not _is_tensor(x):
        return np.tanh(x)
    out = Tensor._make(np.tanh(x.data))
    if needs_graph(x):
        record(TanhBackward, (x,), out, saved=(out,))
    return out


class TanhBackward(OpNode):
    def formula(self, grad, out):
        return [grad * (1 - out * out)]


def sigmoid(x):
    """``1 / (1 + e ** -x)``, computed without overflow."""
    if not _is_tensor(x):
        return _sigmoid_array(x)
    out = Tensor._make(_sigmoid_array(x.data))
    if needs_graph(x):
        record(SigmoidBackward, (x,), out, saved=(out,))
    return out


def _sigmoid_array(x):
    xp = array_module(x)
    # e ** -|x| never overflows; pick the formula that uses it on each side.
    z = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + z), z / (1 + z))


class SigmoidBackward(OpNode):
    def formula(self, grad, out):
        return [grad * (1 - out) * out]


def relu(x):
    """``max(x, 0)``."""
    if not _is_tensor(x):
        return np.maximum(x, 0)
    out = Tensor._make(np.maximum(x.data, 0))
    if needs_graph(x):
        record(ReluBackward, (x,), out, saved=(out,))
    return out


class ReluBackward(OpNode):
    def formula(self, grad, out):
        return [threshold_backward(grad, out)]


def threshold_backward(grad, out):
    """``grad`` where ``out > 0``, else 0: relu's backward. As in PyTorch it is
    an op of both arguments, the second with a zero gradient, so that a
    double backward reaches relu's input (with zeros) as PyTorch's does."""
    if not _is_tensor(grad, out):
        return array_module(out).where(out > 0, grad, 0)
    grad, out = operand(grad), operand(out)
    result = Tensor._make(array_module(out.data).where(out.data > 0, raw(grad), 0))
    if needs_graph(grad, out):
        record(ThresholdBackwardBackward, (grad, out), result, saved=(out,))
    return result


class ThresholdBackwardBackward(OpNode):
    def formula(self, grad, out):
        return [threshold_backward(grad, out) if self.needs(0) else None,
                zeros_like_value(grad) if self.needs(1) else None]


def abs(x):  # noqa: A001
    if not _is_tensor(x):
        return np.abs(x)
    out = Tensor._make(np.abs(x.data))
    if needs_graph(x):
        record(AbsBackward, (x,), out, saved=(x,))
    return out


class AbsBackward(OpNode):
    def formula(self, grad, x):
        return [grad * sign(x)]


def clip(x, min=None, max=None):  # noqa: A002 (numpy's and torch's names)
    """``x`` clipped to ``[min, max]`` (numbers or None)."""
    if min is None and max is None:
        raise ValueError("clip needs min or max")
    if not _is_tensor(x):
        return np.clip(x, min, max)
    out = Tensor._make(np.clip(x.data, min, max))
    if needs_graph(x):
        record(ClipBackward, (x,), out, saved=(x,), low=min, high=max)
    return out


class ClipBackward(OpNode):
    def formula(self, grad, x):
        if self.low is None:
            inside = x <= self.high
        elif self.high is None:
            inside = x >= self.low
        else:
            inside = (x >= self.low) & (x <= self.high)
        return [where(inside, grad, 0.0)]


def maximum(a, b):
    """The elementwise larger of ``a`` and ``b``."""
    if not _is_tensor(a, b):
        return np.maximum(a, b)
    a, b = operand(a), operand(b)
    out = Tensor._make(np.maximum(raw(a), raw(b)))
    if needs_graph(a, b):
        record(MaximumBackward, (a, b), out, saved=(a, b))
    return out


class MaximumBackward(OpNode):
    def formula(self, grad, a, b):
        shared = where(a == b, grad / 2, grad)
        # b's gradient first: See Note [Backward formulas in PyTorch's order].
        grad_b = where(a > b, 0.0, shared) if self.needs(1) else None
        grad_a = where(a < b, 0.0, shared) if self.needs(0) else None
        return [grad_a, grad_b]


def where(condition, a, b):
    """``a`` where ``condition`` holds, else ``b``; the condition takes no gradient."""
    condition_tensor = condition
    condition = raw(condition)
    if not _is_tensor(a, b):
        return array_module(condition).where(condition, a, b)
    a, b = operand(a), operand(b)
    out = Tensor._make(array_module(condition).where(condition, raw(a), raw(b)))
    if needs_graph(a, b):
        record(WhereBackward, (a, b), out, checked=(condition_tensor,), condition=condition)
    return out


class WhereBackward(OpNode):
    def formula(self, grad):
        # b's gradient first: See Note [Backward formulas in PyTorch's order].
        grad_b = where(self.condition, 0.0, grad) if self.needs(1) else None
        grad_a = where(self.condition, grad, 0.0) if self.needs(0) else None
        return [grad_a, grad_b]


# -- not differentiable ----------------------------------------------------------------

def compare(ufunc, a, b):
    """``ufunc(a, b)`` for a comparison or logical ufunc: a bool Tensor
    (outside the graph) if either is a Tensor, else an array."""
    result = ufunc(raw(a), raw(b))
    return Tensor._make(result) if _is_tensor(a, b) else result


def sign(x):
    """-1, 0 or 1 by the sign of ``x``. Differentiable with a zero derivative,
    as PyTorch's: abs's double backward reaches its input (with zeros)."""
    if not _is_tensor(x):
        return np.sign(x)
    out = Tensor._make(np.sign(x.data))
    if needs_graph(x):
        record(SignBackward, (x,), out)
    return out


class SignBackward(OpNode):
    def formula(self, grad):
        return [zeros_like_value(grad)]


# -- copies ------------------------------------------------------------------------------

def clone(x):
    """A copy of ``x`` in new memory; its gradient passes through."""
    if not _is_tensor(x):
        return x.copy()
    out = Tensor._make(x.data.copy())
    if needs_graph(x):
        record(CloneBackward, (x,), out)
    return out


class CloneBackward(OpNode):
    def formula(self, grad):
        return [grad]


def astype(x, dtype):
    """``x`` cast to ``dtype``; the gradient is cast back."""
    if not _is_tensor(x):
        return x.astype(dtype)
    out = Tensor._make(x.data.astype(dtype))
    # As torch, a cast to an integer or bool dtype leaves the graph.
    if needs_graph(x) and out.data.dtype.kind in "fc":
        record(AstypeBackward, (x,), out, input_dtype=x.dtype)
    return out


class AstypeBackward(OpNode):
    def formula(self, grad):
        return [astype(grad, self.input_dtype)]


def to_device(x, device):
    """``x`` on ``device`` (``"cpu"``, ``"cuda:0"`` or a Device)."""
    device = Device.parse(device)
    if not _is_tensor(x):
        return _as_array(x, device=device)
    if x.device == device:
        return x
    out = Tensor._make(_as_array(x.data, device=device))
    if needs_graph(x):
        record(ToDeviceBackward, (x,), out, input_device=x.device)
    return out


class ToDeviceBackward(OpNode):
    def formula(self, grad):
        return [to_device(grad, self.input_device)]


def fill(x, value):
    """A tensor like ``x`` filled with ``value``; ``x`` gets a zero gradient
    (what ``fill_`` and ``zero_`` record)."""
    xp = array_module(x.data)
    out = Tensor._make(xp.full_like(x.data, value))
    if needs_graph(x):
        record(FillBackward, (x,), out)
    return out


class FillBackward(OpNode):
    def formula(self, grad):
        return [zeros_like_value(grad)]


def copy_from(x, src):
    """``src`` broadcast to ``x``'s shape and cast to its dtype (what ``copy_``
    records): ``x`` gets a zero gradient, ``src`` the gradient."""
    src = operand(src)
    xp = array_module(x.data)
    data = xp.broadcast_to(xp.asarray(raw(src), dtype=x.dtype), x.shape).copy()
    out = Tensor._make(data)
    if needs_graph(x, src):
        record(CopyFromBackward, (x, src), out)
    return out


class CopyFromBackward(OpNode):
    def formula(self, grad):
        return [zeros_like_value(grad) if self.needs(0) else None, grad if self.needs(1) else None]

