"""Reentrant activation checkpointing, as ``torch.utils.checkpoint`` with
``use_reentrant=True``.

``checkpoint(fn, *args)`` runs ``fn(*args)`` without recording a graph and
keeps only its inputs. In backward it runs ``fn`` again on detached copies
of the inputs, with grad mode on, and runs a backward of its own on that
new graph from inside the engine (See Note [Reentrant backward] in the
engine): the gradients reach every leaf ``fn`` used (parameters included)
and the copies of the inputs, whose ``.grad`` flow on to the inputs.

As in PyTorch:

- the inner backward needs the whole graph, so ``grad()`` and
  ``backward(inputs=...)`` through a checkpoint raise (the engine tells it
  with ``is_checkpoint_valid()``);
- if no Tensor argument requires grad, the output does not either, and a
  warning says so; pass an input that requires grad (or the parameters).
- it supports ``backward()`` only, not ``create_graph``: the inner backward
  is first order.

This frontend has no random ops, so there is no RNG state to preserve.
"""

from __future__ import annotations

import warnings

import pyengine

from .function import Function
from .tensor import Tensor

__all__ = ["checkpoint", "CheckpointFunction"]

_REENTRANT_ERROR = (
    "When use_reentrant=True, checkpoint is incompatible with .grad() or passing an `inputs` "
    "parameter to .backward(). To resolve this error, call .backward() without passing the "
    "`inputs` argument.")


class CheckpointFunction(Function):
    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        # Tensors go through save_for_backward (version checks, release);
        # the rest is kept as it is.
        ctx.tensor_positions = [i for i, arg in enumerate(args) if isinstance(arg, Tensor)]
        ctx.other_args = [None if isinstance(arg, Tensor) else arg for arg in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_positions])
        with pyengine.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        if not pyengine.is_checkpoint_valid():
            raise RuntimeError(_REENTRANT_ERROR)
        inputs = list(ctx.other_args)
        for position, saved in zip(ctx.tensor_positions, ctx.saved_tensors):
            detached = saved.detach()
            detached.requires_grad = saved.requires_grad
            inputs[position] = detached
        with pyengine.enable_grad():
            outputs = ctx.run_function(*inputs)
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        roots, root_grads = [], []
        for output, grad in zip(outputs, grads):
            if isinstance(output, Tensor) and output.requires_grad and grad is not None:
                roots.append(output)
                root_grads.append(grad)
        if not roots:
            raise RuntimeError("none of output has requires_grad=True, this checkpoint() is not "
                               "necessary")
        pyengine.backward(roots, root_grads)
        return (None,) + tuple(arg.grad if isinstance(arg, Tensor) else None for arg in inputs)


def checkpoint(function, *args):
    """``function(*args)``, recomputed in backward instead of kept; see the
    module docstring."""
    if pyengine.is_grad_enabled() and not any(
            isinstance(arg, Tensor) and arg.requires_grad for arg in args):
        warnings.warn("None of the inputs have requires_grad=True. Gradients will be None",
                      stacklevel=2)
    return CheckpointFunction.apply(function, *args)
