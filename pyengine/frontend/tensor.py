"""Tensor: an array (numpy, or cupy on a GPU) with PyTorch's autograd fields.

This module owns the :class:`Tensor` class and what lives on it: the version
counter, views, in-place operations, hooks, ``backward()``, the value
backend that lets the engine add, reduce and cast Tensor gradients under
``create_graph=True``, and the factory functions (``tensor``, ``zeros``,
``randn``, ...). The operators themselves, each forward beside its backward
Node, live in ``pointwise``, ``reduce``, ``shape``, ``linalg`` and ``loss``.

Where PyTorch and numpy differ, this frontend chose:

- dtypes follow numpy: Python floats make float64 tensors (PyTorch:
  float32), and type promotion is numpy 2's (NEP 50), which agrees with
  PyTorch where it matters here: a Python scalar never widens a float32
  tensor, and float32 with float64 gives float64. It parts from PyTorch
  where numpy's rules do: a numpy scalar (``np.float64(2.0)``, what
  ``array.mean()`` returns) and a 0-d float64 tensor widen a float32
  tensor to float64, and an integer tensor with a float32 one gives
  float64 (PyTorch keeps float32 in all three). Gradients are still cast
  back to each leaf's dtype. Errors that numpy raises (a shape mismatch,
  ``bool()`` of several elements, writing into a read-only broadcast view)
  keep numpy's type, ValueError, where PyTorch raises RuntimeError.
- a view taken under ``no_grad`` of a tensor that requires grad does not
  require grad here. PyTorch marks it a leaf that requires grad, but a
  backward through it reaches neither it nor its base (``.grad`` stays
  None on both) and an in-place op on it in grad mode raises; here that
  backward raises at once ("does not require grad"), and the in-place op
  records nothing.
- shape operations take numpy's names and meanings: ``transpose(axes)``
  permutes axes (reverses them by default, as ``.T``), ``sum(axis=,
  keepdims=)``, ``reshape``; ``max`` returns values only and shares the
  gradient evenly among ties (``torch.amax``).
- an index that is a list of sequences (``x[[[1, 0]]]``, ``x[[[]]]``,
  ``x[[[0, 1], [1, 2]]]``) is one array index, as numpy reads it and as
  PyTorch says it will: PyTorch 2.13 still reads it as a tuple of indices
  (``x[[1, 0]]``, ``x[[]]``, ``x[[0, 1], [1, 2]]``), with a deprecation
  warning. Write the tuple for that meaning.
- ``Tensor(array)`` wraps an array without copying (``torch.from_numpy``);
  :func:`tensor` copies (``torch.tensor``).
- ``.grad`` is a Tensor. The engine stores arrays there; the setter wraps
  them without a copy, so the engine still adds into the array it owns. A
  leaf that keeps indexed gradients (``embedding(..., sparse=True)``)
  holds a :class:`pyengine.IndexedGradient` there instead, as torch's
  ``.grad`` is then a sparse tensor.
- Hooks registered with ``register_hook`` see and return Tensors, as in
  PyTorch; hooks on Nodes (``grad_fn.register_hook``) are the engine's and
  see raw values.

Note [Views and the version counter]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every tensor has a version counter that each in-place operation bumps. A
view (``reshape`` without a copy, ``transpose``, basic indexing,
``broadcast_to``) and ``detach()`` share the counter of the tensor they
look into, because they share its memory. A node that saved a tensor
remembers its version; unpacking it in backward after the version moved
raises PyTorch's "one of the variables needed for gradient computation has
been modified by an inplace operation" error.

PyTorch also lets an in-place operation on a view rewrite the history of
its base (CopySlices) and regenerates the history of views whose base was
modified in place. This frontend does neither: it refuses an in-place
operation on a view when autograd is involved, and refuses to use a view
whose base got a new history from an in-place operation after the view was
taken: in an operation, as an output or input of ``backward`` or ``grad``
(PyTorch's regenerated history may not reach the output at all, where the
old one does), or for ``register_hook`` and ``retain_grad``. Each raises
instead of giving a silently wrong gradient; ``grad_fn`` read directly is
the old node.

Note [In-place operations]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``x.op_(args)`` runs the out-of-place ``op`` on an alias of ``x`` (same
array, same history), writes the result into ``x``'s array, bumps the
version and makes the node ``op`` recorded the new ``grad_fn`` of ``x``, as
PyTorch rebases an in-place op's output. If ``x`` retains its gradient
(``retain_grad()``), the retains-grad hook moves from the old ``grad_fn`` to
the new one, as torch's ``update_tensor_hooks_on_new_gradfn`` does, so that
``x.grad`` is the gradient of the value ``x`` now holds; hooks registered
with ``register_hook`` stay on the old node, as in torch. The node may have saved what it
needs: the old value of ``x`` (``mul_`` with an ``other`` that requires
grad) is copied first, as PyTorch saves ``original_self``; a saved output
(``exp_``) is re-pointed at ``x``'s array and version, so that a later
in-place change of ``x`` is caught.
"""

from __future__ import annotations

import numpy as np

import pyengine
from pyengine import CPU, Device

__all__ = [
    "Tensor",
    "Parameter",
    "VersionCounter",
    "tensor",
    "as_tensor",
    "from_numpy",
    "zeros",
    "ones",
    "full",
    "zeros_like",
    "ones_like",
    "arange",
    "randn",
    "rand",
    "manual_seed",
    "array_module",
    "is_tensor",
]

try:  # cupy is optional: without it every tensor lives on the CPU.
    import cupy as _cupy
except ImportError:  # pragma: no cover - depends on the machine
    _cupy = None

_ARRAY_TYPES = (np.ndarray,) if _cupy is None else (np.ndarray, _cupy.ndarray)


def array_module(value):
    """numpy, or cupy for a cupy array: the module whose functions handle ``value``."""
    if _cupy is not None and isinstance(value, _cupy.ndarray):
        return _cupy
    return np


def _device_of(array) -> Device:
    if _cupy is not None and isinstance(array, _cupy.ndarray):
        return Device("cuda", array.device.id)
    return CPU


def _as_array(value, dtype=None, device=None, copy=False):
    """``value`` as an array on ``device`` (a Device, a string or None: keep)."""
    if isinstance(value, Tensor):
        value = value.data
    device = None if device is None else Device.parse(device)
    if device is not None and device.type == "cuda":
        if _cupy is None:
            raise RuntimeError("device 'cuda' needs cupy, which is not installed")
        with _cupy.cuda.Device(device.index):
            return _cupy.array(value, dtype=dtype, copy=copy) if copy else _cupy.asarray(value, dtype)
    if device is not None and device != CPU:
        raise ValueError(f"the reference frontend supports the cpu and cuda devices, not {device}")
    if _cupy is not None and isinstance(value, _cupy.ndarray):
        value = value.get()
    if copy:
        return np.array(value, dtype=dtype)
    return np.asarray(value, dtype=dtype)


class VersionCounter:
    """How many in-place operations changed a tensor's memory; shared by the
    tensor, its views and its detached aliases. Guarded by the GIL."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = 0


class Tensor:
    """An array plus the fields pyengine's tensor protocol reads.

    ``Tensor(data, requires_grad=False)`` wraps ``data`` (an array, or
    anything numpy turns into one) without copying it. Fields:

      data: the numpy or cupy array.
      grad: None or a Tensor (see the module docstring).
      grad_fn: the Node that made this tensor, or None for a leaf.
      output_nr: which output of ``grad_fn`` this tensor is.
      requires_grad: whether gradients flow to or through this tensor.
    """

    __slots__ = ("data", "_grad", "grad_fn", "output_nr", "_requires_grad", "_version_counter",
                 "_base", "_base_grad_fn", "_pyengine_leaf", "__weakref__")

    # ``ndarray + Tensor`` defers to Tensor.__radd__ instead of broadcasting
    # the Tensor as an object array.
    __array_ufunc__ = None

    def __init__(self, data, requires_grad=False):
        if not isinstance(data, _ARRAY_TYPES):
            data = _as_array(data)
        self.data = data
        self._grad = None
        self.grad_fn = None
        self.output_nr = 0
        self._requires_grad = False
        self._version_counter = VersionCounter()
        self._base = None
        self._base_grad_fn = None
        if requires_grad:
            self.requires_grad = True

    @classmethod
    def _make(cls, data, counter=None):
        """A constant tensor around ``data`` (no checks); ops' fast constructor."""
        if not isinstance(data, _ARRAY_TYPES):
            data = np.asarray(data)
        self = cls.__new__(cls)
        self.data = data
        self._grad = None
        self.grad_fn = None
        self.output_nr = 0
        self._requires_grad = False
        self._version_counter = VersionCounter() if counter is None else counter
        self._base = None
        self._base_grad_fn = None
        return self

    # -- the autograd fields --------------------------------------------------

    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value):
        value = bool(value)
        if self.grad_fn is not None:
            if value:
                return
            raise RuntimeError("you can only change requires_grad flags of leaf variables. If you "
                               "want to use a computed variable in a subgraph that doesn't require "
                               "differentiation use var_no_grad = var.detach().")
        if value and self.data.dtype.kind not in "fc":
            raise RuntimeError("only Tensors of floating point and complex dtype can require "
                               f"gradients, got {self.data.dtype}")
        self._requires_grad = value

    def requires_grad_(self, requires_grad=True):
        self.requires_grad = requires_grad
        return self

    @property
    def grad(self):
        return self._grad

    @grad.setter
    def grad(self, value):
        """Set ``.grad``: None, a Tensor, an array (wrapped without a copy) or
        an IndexedGradient (stored as it is). As torch's setter, it refuses
        a value of another shape, dtype or device than the tensor, which the
        next backward would otherwise broadcast into or cast; the engine's
        own writes pass the check (validate_outputs already made them fit),
        at the cost of two comparisons per leaf."""
        if value is not None:
            if type(value) is np.ndarray:  # the engine's writes: first
                data = value
                value = Tensor._make(value)
            elif isinstance(value, Tensor):
                if value is self:
                    raise RuntimeError("can't assign Variable as its own grad")
                data = value.data
            elif isinstance(value, pyengine.IndexedGradient):
                data = value
            else:
                if getattr(value, "dtype", None) is None or getattr(value, "shape", None) is None:
                    raise TypeError("assigned grad expected to be a Tensor, an array or None but "
                                    f"got grad of type {type(value).__name__}")
                data = value
                value = Tensor._make(value)
            mine = self.data
            dtype = data.dtype
            if data.shape != mine.shape or (dtype is not mine.dtype and dtype != mine.dtype) or (
                    type(mine) is not np.ndarray and _device_of(data) != _device_of(mine)):
                _refuse_grad(self, data)
        self._grad = value

    @property
    def is_leaf(self) -> bool:
        return self.grad_fn is None

    @property
    def _version(self) -> int:
        return self._version_counter.value

    @property
    def retains_grad(self) -> bool:
        hooks = self.grad_fn._retains_grad_hooks if self.grad_fn is not None else None
        return bool(hooks) and self.output_nr in hooks

    # -- array facts ------------------------------------------------------------

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    device = property(lambda self: _device_of(self.data))

    def __len__(self):
        return len(self.data)

    def numel(self) -> int:
        return self.data.size

    def numpy(self):
        """The values as a numpy array (a copy from the GPU); refuses a tensor
        that requires grad, as PyTorch does."""
        if self._requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use "
                               "tensor.detach().numpy() instead.")
        return _as_array(self.data)

    def item(self):
        return self.data.item()

    def tolist(self):
        return self.data.tolist()

    def __float__(self):
        return float(self.data)

    def __int__(self):
        return int(self.data)

    def __bool__(self):
        return bool(self.data)

    __hash__ = object.__hash__

    def __repr__(self):
        body = np.array2string(_as_array(self.data), separator=", ", prefix="tensor(")
        extra = ""
        if self.data.dtype != np.float64:
            extra += f", dtype={self.data.dtype}"
        if self.device != CPU:
            extra += f", device='{self.device}'"
        if self.grad_fn is not None:
            extra += f", grad_fn=<{self.grad_fn.name()}>"
        elif self._requires_grad:
            extra += ", requires_grad=True"
        return f"tensor({body}{extra})"

    # -- autograd, as torch.Tensor spells it -------------------------------------

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        # A view taken before its base's in-place operation: See Note
        # [Views and the version counter]. Asked only of a view and of given
        # inputs: loss.backward() is part of every step's fixed cost.
        if self._base is not None:
            _graph.refuse_stale_view(self)
        if inputs is not None:
            _graph.refuse_stale_views(inputs)
        pyengine.backward(self, gradient, retain_graph, create_graph, inputs)

    def register_hook(self, fn):
        """``fn(grad) -> new grad or None`` with Tensors; returns a handle."""
        _graph.refuse_stale_view(self)
        return pyengine.register_tensor_hook(self, _tensor_hook(fn))

    def register_post_accumulate_grad_hook(self, fn):
        """``fn(tensor)`` after a gradient was accumulated into this leaf's ``.grad``."""
        return pyengine.register_post_accumulate_grad_hook(self, fn)

    def retain_grad(self):
        _graph.refuse_stale_view(self)
        pyengine.retain_grad(self)

    def detach(self):
        """A tensor on the same memory and version counter, outside the graph."""
        out = Tensor._make(self.data, self._version_counter)
        return out

    def detach_(self):
        if self._base is not None and self._requires_grad:
            raise RuntimeError("Can't detach views in-place. Use detach() instead.")
        self.grad_fn = None
        self.output_nr = 0
        self._requires_grad = False
        return self

    def _alias(self):
        """Same array, version counter and history: the input an in-place op reads."""
        out = Tensor._make(self.data, self._version_counter)
        out.grad_fn = self.grad_fn
        out.output_nr = self.output_nr
        out._requires_grad = self._requires_grad
        out._base = self._base
        out._base_grad_fn = self._base_grad_fn
        return out

    def _bump_version(self):
        self._version_counter.value += 1

    # -- in-place operations: See Note [In-place operations] ------------------------

    def _inplace(self, op, *args):
        grad_mode = pyengine.is_grad_enabled()
        if grad_mode:
            if self._requires_grad and self.grad_fn is None:
                raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                                   "operation.")
            involved = self._requires_grad or any(
                isinstance(arg, Tensor) and arg._requires_grad for arg in args)
            if involved and self._base is not None:
                raise RuntimeError(
                    "an in-place operation on a view that takes part in autograd is not supported "
                    "by the reference frontend (PyTorch rewrites the base's history with "
                    "CopySlices); apply the operation out of place. See Note [Views and the "
                    "version counter].")
        source = self._alias()
        result = op(source, *args)
        if result.shape != self.shape:
            raise RuntimeError(f"output with shape {list(self.shape)} doesn't match the broadcast "
                               f"shape {list(result.shape)}")
        node = result.grad_fn
        if node is not None:
            _detach_saved_source(node, source)
        if result.dtype != self.dtype:
            if not np.can_cast(result.dtype, self.dtype, "same_kind"):
                raise RuntimeError(f"result type {result.dtype} can't be cast to the desired output "
                                   f"type {self.dtype}")
            result = result.astype(self.dtype)
            node = result.grad_fn
        array_module(self.data).copyto(self.data, result.data)
        self._version_counter.value += 1
        if node is not None:
            _repoint_saved_output(node, result, self)
            _move_retains_grad_hook(self, node)
            self.grad_fn = node
            self.output_nr = 0
            self._requires_grad = True
        return self

    def add_(self, other, alpha=1):
        return self._inplace(lambda s, o: s + (o if alpha == 1 else o * alpha), other)

    def sub_(self, other, alpha=1):
        return self._inplace(lambda s, o: s - (o if alpha == 1 else o * alpha), other)

    def mul_(self, other):
        return self._inplace(_ops.mul, other)

    def div_(self, other):
        return self._inplace(_ops.div, other)

    def pow_(self, exponent):
        return self._inplace(_ops.pow, exponent)

    def neg_(self):
        return self._inplace(_ops.neg)

    def exp_(self):
        return self._inplace(_ops.exp)

    def relu_(self):
        return self._inplace(_ops.relu)

    def clip_(self, min=None, max=None):  # noqa: A002 (numpy's and torch's names)
        return self._inplace(_ops.clip, min, max)

    clamp_ = clip_

    def fill_(self, value):
        return self._inplace(_ops.fill, value)

    def zero_(self):
        return self._inplace(_ops.fill, 0)

    def copy_(self, src):
        return self._inplace(_ops.copy_from, src)

    def __iadd__(self, other):
        return self.add_(other)

    def __isub__(self, other):
        return self.sub_(other)

    def __imul__(self, other):
        return self.mul_(other)

    def __itruediv__(self, other):
        return self.div_(other)

    def __setitem__(self, index, value):
        self._inplace(_ops.index_put, index, value)

    # -- operators (each in its module, forward beside backward) ------------------

    def __add__(self, other):
        return _ops.add(self, other)

    # The reflected sum and product put self first, as torch's do: the
    # node's first input is the Tensor, the number's slot second.
    def __radd__(self, other):
        return _ops.add(self, other)

    def __sub__(self, other):
        return _ops.sub(self, other)

    def __rsub__(self, other):
        return _ops.sub(other, self)

    def __mul__(self, other):
        return _ops.mul(self, other)

    def __rmul__(self, other):
        return _ops.mul(self, other)

    def __truediv__(self, other):
        return _ops.div(self, other)

    def __rtruediv__(self, other):
        # torch's reflected division: the reciprocal times the number.
        return _ops.mul(_ops.reciprocal(self), other)

    def __neg__(self):
        return _ops.neg(self)

    def __pos__(self):
        return self

    def __pow__(self, exponent):
        return _ops.pow(self, exponent)

    def __rpow__(self, base):
        return _ops.pow(base, self)

    def __matmul__(self, other):
        return _ops.matmul(self, other)

    def __rmatmul__(self, other):
        return _ops.matmul(other, self)

    def __abs__(self):
        return _ops.abs(self)

    def __getitem__(self, index):
        return _ops.getitem(self, index)

    # Comparisons and logic: not differentiable, they return bool tensors.
    def __eq__(self, other):
        return _ops.compare(np.equal, self, other)

    def __ne__(self, other):
        return _ops.compare(np.not_equal, self, other)

    def __lt__(self, other):
        return _ops.compare(np.less, self, other)

    def __le__(self, other):
        return _ops.compare(np.less_equal, self, other)

    def __gt__(self, other):
        return _ops.compare(np.greater, self, other)

    def __ge__(self, other):
        return _ops.compare(np.greater_equal, self, other)

    def __and__(self, other):
        return _ops.compare(np.logical_and, self, other)

    __rand__ = __and__

    def __or__(self, other):
        return _ops.compare(np.logical_or, self, other)

    __ror__ = __or__

    def __invert__(self):
        return Tensor._make(~self.data)

    def exp(self):
        return _ops.exp(self)

    def reciprocal(self):
        return _ops.reciprocal(self)

    def log(self):
        return _ops.log(self)

    def sqrt(self):
        return _ops.sqrt(self)

    def tanh(self):
        return _ops.tanh(self)

    def sigmoid(self):
        return _ops.sigmoid(self)

    def relu(self):
        return _ops.relu(self)

    def abs(self):
        return _ops.abs(self)

    def clip(self, min=None, max=None):  # noqa: A002
        return _ops.clip(self, min, max)

    clamp = clip

    def maximum(self, other):
        return _ops.maximum(self, other)

    def sum(self, axis=None, keepdims=False):
        return _ops.sum(self, axis, keepdims)

    def mean(self, axis=None, keepdims=False):
        return _ops.mean(self, axis, keepdims)

    def max(self, axis=None, keepdims=False):
        return _ops.max(self, axis, keepdims)

    def reshape(self, *shape):
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = shape[0]
        return _ops.reshape(self, shape)

    def transpose(self, *axes):
        if len(axes) == 1 and not isinstance(axes[0], (int, np.integer)):
            axes = axes[0]
        return _ops.transpose(self, axes or None)

    def swapaxes(self, axis1, axis2):
        return _ops.swapaxes(self, axis1, axis2)

    @property
    def T(self):  # noqa: N802 (numpy's name)
        return _ops.transpose(self)

    def broadcast_to(self, shape):
        return _ops.broadcast_to(self, shape)

    def softmax(self, axis=-1):
        return _ops.softmax(self, axis)

    def log_softmax(self, axis=-1):
        return _ops.log_softmax(self, axis)

    def astype(self, dtype):
        return _ops.astype(self, dtype)

    def clone(self):
        return _ops.clone(self)

    def to(self, device):
        return _ops.to_device(self, device)

    def cpu(self):
        return _ops.to_device(self, CPU)

    def cuda(self, index=0):
        return _ops.to_device(self, Device("cuda", index))


class Parameter(Tensor):
    """A leaf tensor that requires grad: what ``nn`` modules hold."""

    __slots__ = ()

    def __init__(self, data, requires_grad=True):
        super().__init__(data, requires_grad=requires_grad)

    def __repr__(self):
        return "Parameter containing:\n" + super().__repr__()


def _refuse_grad(tensor: Tensor, data) -> None:
    """Raise torch's error for a ``.grad`` whose shape, dtype or device is not
    ``tensor``'s (torch names a ``grad_dtype``, which this frontend lacks)."""
    if tuple(data.shape) != tuple(tensor.shape):
        raise RuntimeError(f"attempting to assign a gradient of size '{list(data.shape)}' to a "
                           f"tensor of size '{list(tensor.shape)}'. Please ensure that the "
                           "gradient and the tensor are the same size")
    if data.dtype != tensor.dtype:
        raise RuntimeError(f"attempting to assign a gradient with dtype '{data.dtype}' to a "
                           f"tensor with dtype '{tensor.dtype}'. Please ensure that the gradient "
                           "and the tensor have the same dtype")
    device = data.device if isinstance(data, pyengine.IndexedGradient) else _device_of(data)
    raise RuntimeError(f"attempting to assign a gradient with device '{device}' to a tensor "
                       f"with device '{tensor.device}'. Please ensure that the gradient and the "
                       "tensor are on the same device")


def _move_retains_grad_hook(tensor: Tensor, node) -> None:
    """Move ``tensor``'s retains-grad hook from its current ``grad_fn`` to
    ``node``, its ``grad_fn`` after an in-place operation (output 0). See
    Note [In-place operations]."""
    old = tensor.grad_fn
    hooks = old._retains_grad_hooks if old is not None else None
    if not hooks or tensor.output_nr not in hooks:
        return
    hook = hooks[tensor.output_nr]
    old.set_retains_grad_hook(tensor.output_nr, None)
    node.set_retains_grad_hook(0, hook)


def _zero_grad(parameter: Tensor, set_to_none: bool) -> None:
    """``parameter.grad`` set to None, or zeroed, for ``zero_grad``.

    As ``torch.optim.Optimizer.zero_grad`` and ``torch.nn.Module.zero_grad``:
    a ``.grad`` made under ``create_graph=True`` (it has a ``grad_fn``) is
    detached in place first, otherwise it stops requiring grad; then it is
    zeroed in place, which bumps its version. A graph that saved the old
    gradient then refuses to run backward ("Trying to use a saved tensor
    that has been detached in-place") instead of using the zeros. An
    indexed gradient is set to None (torch would zero its sparse tensor).
    """
    grad = parameter._grad
    if grad is None:
        return
    if set_to_none or not isinstance(grad, Tensor):
        parameter._grad = None
        return
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    with pyengine.no_grad():
        grad.zero_()


def is_tensor(value) -> bool:
    return isinstance(value, Tensor)


def _tensor_hook(fn):
    """Wrap ``fn`` so that it sees and returns Tensors while the engine sees
    values: arrays, or Tensors under create_graph. An IndexedGradient is
    handed over as it is (as torch hands a hook a sparse tensor)."""

    def hook(grad):
        if isinstance(grad, pyengine.IndexedGradient):
            result = fn(grad)
            return result.data if isinstance(result, Tensor) else result
        result = fn(grad if isinstance(grad, Tensor) else Tensor._make(grad))
        if result is None:
            return None
        if not isinstance(result, Tensor):
            return _as_array(result)
        if isinstance(grad, Tensor) or pyengine.is_grad_enabled():
            return result
        return result.data

    hook.__name__ = getattr(fn, "__name__", "hook")
    return hook


def _detach_saved_source(node, source):
    """Before an in-place write: a node that saved the old value of the tensor
    keeps a copy of it. See Note [In-place operations]."""
    saved = node._saved_values
    if not saved:
        return
    for value in saved:
        if isinstance(value, _graph.SavedTensor) and value.tensor is source:
            value.keep_copy()


def _repoint_saved_output(node, result, target):
    """After an in-place write: a saved output of ``node`` is ``target`` now."""
    saved = node._saved_values
    if not saved:
        return
    for value in saved:
        if isinstance(value, _graph.SavedTensor) and value.tensor is None and value.data is result.data:
            value.repoint(target)


# -- factories ----------------------------------------------------------------------

_rng = np.random.default_rng(0)


def manual_seed(seed: int) -> None:
    """Seed the generator behind ``randn``, ``rand`` and ``nn`` initialization."""
    global _rng
    _rng = np.random.default_rng(seed)


def default_generator() -> np.random.Generator:
    return _rng


def tensor(data, dtype=None, device=None, requires_grad=False) -> Tensor:
    """A new tensor with a copy of ``data`` (``torch.tensor``)."""
    return Tensor(_as_array(data, dtype, device, copy=True), requires_grad=requires_grad)


def as_tensor(data, dtype=None, device=None) -> Tensor:
    """``data`` if it is a Tensor already, else a tensor sharing its memory where it can."""
    if isinstance(data, Tensor):
        return data
    return Tensor(_as_array(data, dtype, device))


def from_numpy(array: np.ndarray) -> Tensor:
    """A tensor sharing ``array``'s memory."""
    return Tensor(array)


def zeros(*shape, dtype=np.float64, device=None, requires_grad=False) -> Tensor:
    return tensor(np.zeros(_shape(shape), dtype), device=device, requires_grad=requires_grad)


def ones(*shape, dtype=np.float64, device=None, requires_grad=False) -> Tensor:
    return tensor(np.ones(_shape(shape), dtype), device=device, requires_grad=requires_grad)


def full(shape, fill_value, dtype=np.float64, device=None, requires_grad=False) -> Tensor:
    return tensor(np.full(_shape((shape,)), fill_value, dtype), device=device,
                  requires_grad=requires_grad)


def zeros_like(x: Tensor, requires_grad=False) -> Tensor:
    return Tensor(array_module(x.data).zeros_like(x.data), requires_grad=requires_grad)


def ones_like(x: Tensor, requires_grad=False) -> Tensor:
    return Tensor(array_module(x.data).ones_like(x.data), requires_grad=requires_grad)


def arange(*args, dtype=None, device=None) -> Tensor:
    return tensor(np.arange(*args, dtype=dtype), device=device)


def randn(*shape, dtype=np.float64, device=None, requires_grad=False) -> Tensor:
    return tensor(_rng.standard_normal(_shape(shape)).astype(dtype), device=device,
                  requires_grad=requires_grad)


def rand(*shape, dtype=np.float64, device=None, requires_grad=False) -> Tensor:
    return tensor(_rng.random(_shape(shape)).astype(dtype), device=device,
                  requires_grad=requires_grad)


def _shape(shape):
    if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
        return tuple(shape[0])
    return tuple(shape)


# -- the value backend ---------------------------------------------------------------

class TensorBackend(pyengine.ArrayBackend):
    """What the engine may do with a Tensor gradient (under create_graph):
    every operation is a Tensor op, so that it is recorded and can be
    differentiated again. Arguments may mix Tensors and raw arrays."""

    name = "frontend"

    def shape(self, value):
        return value.data.shape

    def dtype(self, value):
        return value.data.dtype

    def device(self, value):
        return _device_of(value.data)

    def dtype_kind(self, dtype):
        return np.dtype(dtype).kind

    def add(self, a, b):
        if type(b) is pyengine.IndexedGradient:
            b = b.to_dense()
        return _ops.add(a, b)

    def add_(self, a, b):
        # Only ever called on a value the engine allocated (a gradient sum
        # or a .grad it stored), outside create_graph, so grad mode is off:
        # as torch's in-place add under no_grad, a tensor with a history
        # (a .grad a create_graph backward stored) keeps it.
        if isinstance(a, Tensor) and a.data.flags.writeable:
            if type(b) is pyengine.IndexedGradient:
                if b.shape == a.data.shape and np.can_cast(b.dtype, a.data.dtype, "same_kind"):
                    b.add_to_(a.data)
                    a._version_counter.value += 1
                    return a
                return self.add(a, b)
            b = b.data if isinstance(b, Tensor) else b
            if np.broadcast_shapes(a.data.shape, np.shape(b)) == a.data.shape:
                array_module(a.data).add(a.data, b, out=a.data, casting="same_kind")
                a._version_counter.value += 1
                return a
        return _ops.add(a, b)

    def sum_to(self, value, shape):
        return _ops.sum_to(value, tuple(shape))

    def cast(self, value, dtype):
        return _ops.astype(value, dtype)

    def copy(self, value):
        return _ops.clone(value)

    def to_device(self, value, device):
        return _ops.to_device(value, device)

    def zeros(self, shape, dtype, device):
        return Tensor._make(_as_array(np.zeros(shape, dtype), device=device))

    def ones_like(self, value):
        return Tensor._make(array_module(value.data).ones_like(value.data))

    def has_nan(self, value):
        return bool(array_module(value.data).isnan(value.data).any())


pyengine.register_backend(Tensor, TensorBackend())

# The ops modules import Tensor from here: bind them last.
from . import graph as _graph  # noqa: E402
from . import ops as _ops  # noqa: E402
