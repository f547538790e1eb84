"""Custom ops, as ``torch.autograd.Function``: subclass :class:`Function`
and write ``forward(ctx, *args)`` and ``backward(ctx, *grads)`` as static
methods; call ``YourFunction.apply(*args)``.

- ``forward`` runs with grad mode off, on the arguments as given (Tensors
  and anything else). It returns a Tensor or a tuple of them.
- ``ctx`` is the backward node itself (a :class:`BackwardFunction`). In
  forward: ``ctx.save_for_backward(*tensors)``,
  ``ctx.mark_non_differentiable(*outputs)``,
  ``ctx.set_materialize_grads(False)``, and any attribute you set. In
  backward: ``ctx.saved_tensors``, ``ctx.needs_input_grad`` (one bool per
  forward argument).
- ``backward`` gets one gradient Tensor per output (zeros for an output
  that received none, unless ``set_materialize_grads(False)``: then None)
  and returns one gradient per forward argument: a Tensor, or None (always
  None for an argument that is not a Tensor). Extra trailing Nones are
  allowed, as in PyTorch.
- Under ``create_graph=True`` backward runs with grad mode on, so what it
  computes with Tensor ops is recorded and can be differentiated again.
- Saved tensors are released after backward unless the graph is retained;
  ``ctx.saved_tensors`` then raises PyTorch's "Trying to backward through
  the graph a second time" error. A saved tensor modified in place raises
  the version-counter error (See Note [Views and the version counter]).

An output that is one of the inputs, returned as it is, becomes a new
tensor on the same memory (as PyTorch makes a view), so that the input
keeps its own history. ``mark_dirty`` (custom in-place ops) and
``setup_context`` are not supported.
"""

from __future__ import annotations

import pyengine
from pyengine import InputMetadata
from pyengine.node import RELEASED_ERROR

from .graph import SavedTensor, edge_of, needs_graph
from .tensor import Tensor, _device_of, array_module

__all__ = ["Function", "BackwardFunction"]


class BackwardFunction(pyengine.Node):
    """The node of one ``Function.apply`` call, and its ``ctx``."""

    def __init__(self, function, next_edges, needs_input_grad, tensor_inputs):
        super().__init__(next_edges=next_edges)
        self._function = function
        self.needs_input_grad = needs_input_grad
        self._tensor_inputs = tensor_inputs
        self._to_save = ()
        self._non_differentiable = ()
        self._materialize_grads = True

    def name(self) -> str:
        return f"{self._function.__name__}Backward"

    # -- the ctx API, in forward --

    def save_for_backward(self, *tensors):
        for i, value in enumerate(tensors):
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"save_for_backward can only save Tensors or None, but argument {i} "
                                f"is of type {type(value).__name__}")
        self._to_save = tensors

    def mark_non_differentiable(self, *tensors):
        self._non_differentiable = tensors

    def set_materialize_grads(self, value: bool):
        self._materialize_grads = bool(value)

    # -- the ctx API, in backward --

    @property
    def saved_tensors(self):
        # Read before the flag: See Note [A node is marked released before it
        # is cleared] in pyengine/_pure/engine.py.
        saved = self._saved_values
        if self._released:
            raise RuntimeError(RELEASED_ERROR)
        if saved is None:
            return ()
        return tuple(value.unpack_tensor(self) if isinstance(value, SavedTensor) else value
                     for value in saved)

    # -- the engine's side --

    def apply(self, grads):
        create_graph = pyengine.is_grad_enabled()
        wrapped = []
        for i, grad in enumerate(grads):
            if grad is None:
                metadata = self._input_metadata[i] if i < len(self._input_metadata) else None
                if self._materialize_grads and metadata is not None:
                    grad = array_module_for(metadata).zeros(metadata.shape, metadata.dtype)
                else:
                    wrapped.append(None)
                    continue
            wrapped.append(grad if isinstance(grad, Tensor) else Tensor._make(grad))
        result = self._function.backward(self, *wrapped)
        if not isinstance(result, tuple):
            result = (result,)
        expected = len(self._next_edges)
        if len(result) > expected and all(value is None for value in result[expected:]):
            result = result[:expected]
        if len(result) != expected:
            raise RuntimeError(f"function {self.name()} returned an incorrect number of gradients "
                               f"(expected {expected}, got {len(result)})")
        outputs = []
        for i, value in enumerate(result):
            if value is None:
                outputs.append(None)
                continue
            if not self._tensor_inputs[i]:
                raise RuntimeError(f"function {self.name()} returned a gradient different than None "
                                   f"at position {i + 1}, but the corresponding forward input was "
                                   "not a Tensor")
            if not isinstance(value, Tensor):
                value = Tensor._make(value)
            outputs.append(value if create_graph else value.data)
        return outputs


def array_module_for(metadata):
    """numpy, or cupy for metadata of a cuda slot."""
    if metadata.device.type == "cuda":  # pragma: no cover - needs cupy
        import cupy

        return cupy
    return array_module(None)


class Function:
    """Subclass with static ``forward(ctx, ...)`` and ``backward(ctx, ...)``;
    call ``apply``. See the module docstring."""

    @staticmethod
    def forward(ctx, *args):
        raise NotImplementedError("You must implement the forward function for custom "
                                  "autograd.Function.")

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("You must implement the backward function for custom "
                                  "autograd.Function.")

    @classmethod
    def apply(cls, *args):
        tensor_inputs = tuple(isinstance(arg, Tensor) for arg in args)
        needs_input_grad = tuple(isinstance(arg, Tensor) and arg.requires_grad for arg in args)
        recording = needs_graph(*args)
        ctx = BackwardFunction(cls, [edge_of(arg) if recording else None for arg in args],
                               needs_input_grad, tensor_inputs)
        with pyengine.no_grad():
            outputs = cls.forward(ctx, *args)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else tuple(outputs)
        outputs = tuple(_fresh_output(out, args) for out in outputs)
        if recording:
            _connect(ctx, outputs)
        return outputs[0] if single else outputs


def _fresh_output(out, args):
    """An output that is an input becomes a new tensor on the same memory."""
    if isinstance(out, Tensor) and any(out is arg for arg in args):
        return out.detach()
    return out


def _connect(ctx, outputs):
    """Make ``ctx`` the grad_fn of the outputs and save what forward asked for."""
    non_differentiable = ctx._non_differentiable
    for i, out in enumerate(outputs):
        if not isinstance(out, Tensor):
            ctx.add_input_metadata(None)
            continue
        data = out.data
        ctx.add_input_metadata(InputMetadata(data.shape, data.dtype, _device_of(data)))
        # An integer or bool output is not differentiable, as in torch,
        # marked or not.
        if data.dtype.kind not in "fc" or any(out is other for other in non_differentiable):
            continue
        out.grad_fn = ctx
        out.output_nr = i
        out._requires_grad = True
    saved = []
    for value in ctx._to_save:
        if value is None:
            saved.append(None)
        else:
            saved.append(SavedTensor(value, any(value is out for out in outputs)
                                     and value.grad_fn is ctx))
    ctx._to_save = ()
    if saved:
        pyengine.Node.save_for_backward(ctx, *saved)

