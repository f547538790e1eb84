"""minitensor: a tiny tensor library on numpy, wired to pyengine.

A worked example of plugging a framework into pyengine, and the frontend all
tests use. It needs three things:

1. A tensor class with the tensor protocol: ``data`` (the numpy value),
   ``grad``, ``grad_fn``, ``output_nr`` and ``requires_grad``.
2. One :class:`pyengine.Node` subclass per backward formula. Each forward op
   makes one node, with one ``next_edge`` per forward input
   (``pyengine.gradient_edge(input)``, None for inputs that don't require
   grad) and one ``input_metadata`` entry per forward output.
3. A value backend for the tensor class (``pyengine.register_backend``), so
   that under ``create_graph=True`` the engine can add, reduce and cast
   gradients that are tensors themselves.

Backward formulas are written once, for both numpy arrays and ``T`` values:
the helpers below (``exp``, ``transpose``, ``split``, ``cat``, ...) accept
either. ``Backward.apply`` runs a formula on plain numpy arrays normally, and
on ``T`` values when grad mode is on inside ``apply`` (the engine turns it on
only under ``create_graph=True``), so that the gradients record a graph of
their own and can be differentiated again.
"""

from __future__ import annotations

import numpy as np

import pyengine

__all__ = ["T", "leaf", "const", "as_tensor", "add", "mul", "matmul", "exp", "transpose",
           "sum_", "sum_to", "split", "cat", "clone", "cast", "Backward"]


class T:
    """A tensor: a numpy array plus the autograd protocol fields."""

    def __init__(self, data, requires_grad=False):
        self.data = np.asarray(data)
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = requires_grad

    # numpy defers ``array + T`` and ``np.add(array, T)`` to us: keep the graph.
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method == "__call__" and not kwargs and len(inputs) == 2:
            if ufunc is np.add:
                return add(*inputs)
            if ufunc is np.multiply:
                return mul(*inputs)
        return NotImplemented

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    is_leaf = property(lambda self: self.grad_fn is None)

    def __repr__(self):
        suffix = f", grad_fn={self.grad_fn.name()}" if self.grad_fn is not None else ""
        return f"T({self.data!r}{suffix})"

    def __add__(self, other):
        return add(self, other)

    def __radd__(self, other):
        return add(other, self)

    def __mul__(self, other):
        return mul(self, other)

    def __rmul__(self, other):
        return mul(other, self)

    def __sub__(self, other):
        return add(self, mul(other, -1.0))

    def __neg__(self):
        return mul(self, -1.0)

    def __matmul__(self, other):
        return matmul(self, other)

    @property
    def T(self):  # noqa: N802 (numpy's name)
        return transpose(self)

    def sum(self):
        return sum_(self)

    def exp(self):
        return exp(self)

    def detach(self):
        return T(self.data)

    # -- autograd, as torch.Tensor spells it --

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        pyengine.backward(self, gradient, retain_graph, create_graph, inputs)

    def register_hook(self, fn):
        return pyengine.register_tensor_hook(self, fn)

    def register_post_accumulate_grad_hook(self, fn):
        return pyengine.register_post_accumulate_grad_hook(self, fn)

    def retain_grad(self):
        pyengine.retain_grad(self)


def leaf(data, dtype=np.float64):
    """A leaf tensor that requires grad."""
    return T(np.array(data, dtype=dtype), requires_grad=True)


def const(data, dtype=np.float64):
    """A tensor that does not require grad."""
    return T(np.array(data, dtype=dtype))


def as_tensor(value, like=None):
    """``value`` as a T; a Python number takes ``like``'s dtype."""
    if isinstance(value, T):
        return value
    if isinstance(value, (int, float)) and like is not None:
        return T(np.asarray(value, dtype=like.dtype))
    return T(np.asarray(value))


# -- recording the backward graph ---------------------------------------------------

def _record(node_type, inputs, outputs, saved=(), **attrs):
    """Attach a ``node_type`` node to ``outputs`` when grad mode is on and an
    input requires grad."""
    if not (pyengine.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return None
    node = node_type(next_edges=[pyengine.gradient_edge(t) for t in inputs],
                     input_metadata=[out.data for out in outputs])
    if saved:  # a node that saved nothing can run again after release
        node.save_for_backward(*saved)
    node.__dict__.update(attrs, saves=bool(saved))
    for i, out in enumerate(outputs):
        out.grad_fn, out.output_nr, out.requires_grad = node, i, True
    return node


class Backward(pyengine.Node):
    """A node that runs ``formula(grads, *saved)``: on numpy arrays, or on T
    values (recording a graph) when grad mode is on, i.e. under create_graph."""

    def apply(self, grads):
        if all(g is None for g in grads):
            return [None] * len(self.next_edges)
        saved = self.saved_values if self.saves else ()  # raises once released
        if pyengine.is_grad_enabled():
            grads = [None if g is None else as_tensor(g) for g in grads]
        else:
            saved = [value.data for value in saved]
        return self.formula(grads, *saved)

    def formula(self, grads, *saved):
        raise NotImplementedError


# Broadcasting ops return gradients of the broadcast shape: the engine's
# validate_outputs reduces them to each input's shape with sum_to.

class AddBackward(Backward):
    def formula(self, grads):
        (g,) = grads
        return [g, g]


class MulBackward(Backward):
    def formula(self, grads, a, b):
        (g,) = grads
        return [g * b, g * a]


class MatmulBackward(Backward):
    def formula(self, grads, a, b):
        (g,) = grads
        return [g @ transpose(b), transpose(a) @ g]


class TransposeBackward(Backward):
    def formula(self, grads):
        return [transpose(grads[0])]


class ExpBackward(Backward):
    def formula(self, grads, a):
        return [grads[0] * exp(a)]


class SumBackward(Backward):
    def formula(self, grads):
        return [grads[0] * np.ones(self.input_shape, self.input_dtype)]


class SumToBackward(Backward):
    def formula(self, grads):
        return [grads[0] * np.ones(self.input_shape, self.input_dtype)]


class SplitBackward(Backward):
    """Two input slots (the two outputs of split); either may get no gradient."""

    def formula(self, grads):
        parts = [np.zeros(shape, self.input_dtype) if g is None else g
                 for g, shape in zip(grads, self.part_shapes)]
        return [cat(*parts)]


class CatBackward(Backward):
    def formula(self, grads):
        return list(split(grads[0], self.split_at))


class CloneBackward(Backward):
    """Passes the gradient through unchanged: the very same object."""

    def formula(self, grads):
        return [grads[0]]


class CastBackward(Backward):
    def formula(self, grads):
        return [cast(grads[0], self.input_dtype)]


# -- ops: each takes T (records a node) or numpy (plain numpy, for formulas) ---------

def _pair(a, b):
    a = as_tensor(a, like=b if isinstance(b, T) else None)
    return a, as_tensor(b, like=a)


def add(a, b):
    a, b = _pair(a, b)
    out = T(a.data + b.data)
    _record(AddBackward, [a, b], [out])
    return out


def mul(a, b):
    a, b = _pair(a, b)
    out = T(a.data * b.data)
    _record(MulBackward, [a, b], [out], saved=(a, b))
    return out


def matmul(a, b):
    a, b = _pair(a, b)
    out = T(a.data @ b.data)
    _record(MatmulBackward, [a, b], [out], saved=(a, b))
    return out


def transpose(x):
    if not isinstance(x, T):
        return np.swapaxes(x, -1, -2)
    out = T(np.swapaxes(x.data, -1, -2))
    _record(TransposeBackward, [x], [out])
    return out


def exp(x):
    if not isinstance(x, T):
        return np.exp(x)
    out = T(np.exp(x.data))
    _record(ExpBackward, [x], [out], saved=(x,))
    return out


def sum_(x):
    out = T(x.data.sum())
    _record(SumBackward, [x], [out], input_shape=x.shape, input_dtype=x.dtype)
    return out


def sum_to(x, shape):
    """Sum a broadcast value down to ``shape`` (as the engine's backend needs)."""
    if not isinstance(x, T):
        return pyengine.backend_of(x).sum_to(x, shape)
    out = T(pyengine.backend_of(x.data).sum_to(x.data, tuple(shape)))
    _record(SumToBackward, [x], [out], input_shape=x.shape, input_dtype=x.dtype)
    return out


def split(x, at):
    """``(x[:at], x[at:])`` along the first axis: an op with two outputs."""
    if not isinstance(x, T):
        return x[:at], x[at:]
    outs = [T(x.data[:at]), T(x.data[at:])]
    _record(SplitBackward, [x], outs, part_shapes=[o.shape for o in outs], input_dtype=x.dtype)
    return tuple(outs)


def cat(a, b):
    """Concatenate along the first axis."""
    if not isinstance(a, T) and not isinstance(b, T):
        return np.concatenate([a, b])
    a, b = _pair(a, b)
    out = T(np.concatenate([a.data, b.data]))
    _record(CatBackward, [a, b], [out], split_at=a.shape[0])
    return out


def clone(x):
    """A copy of ``x``; its backward passes the gradient through as it is."""
    out = T(np.array(x.data, copy=True))
    _record(CloneBackward, [x], [out])
    return out


def cast(x, dtype):
    if not isinstance(x, T):
        return np.asarray(x).astype(dtype)
    out = T(x.data.astype(dtype))
    _record(CastBackward, [x], [out], input_dtype=x.dtype)
    return out


# -- the value backend: what the engine may do with a T gradient -------------------

class TBackend(pyengine.ArrayBackend):
    """Gradients that are T values (under create_graph): every operation is a
    T op, so that what the engine does to a gradient is recorded too."""

    name = "minitensor"

    def shape(self, value):
        return value.data.shape

    def dtype(self, value):
        return value.data.dtype

    def device(self, value):
        return pyengine.CPU

    def dtype_kind(self, dtype):
        return np.dtype(dtype).kind

    def add(self, a, b):
        return add(a, b)

    def sum_to(self, value, shape):
        return sum_to(value, shape)

    def cast(self, value, dtype):
        return cast(value, dtype)

    def copy(self, value):
        return clone(value)

    def to_device(self, value, device):
        if device != pyengine.CPU:
            raise ValueError(f"minitensor lives on the cpu, not on {device}")
        return value

    def zeros(self, shape, dtype, device):
        return T(np.zeros(shape, dtype=dtype))

    def ones_like(self, value):
        return T(np.ones_like(value.data))

    def has_nan(self, value):
        return bool(np.isnan(value.data).any())


pyengine.register_backend(T, TBackend())
