"""pyengine's API for DeZero Variables: ``grad``, ``grad_fn``,
``register_hook`` and ``register_post_accumulate_grad_hook``, with PyTorch's
semantics (see the package docstring for where they differ from DeZero's).

They serve DeZero through pyengine's own functions: :class:`_TensorView`
reads pyengine's tensor protocol from a DeZero Variable.
"""

from __future__ import annotations

import dezero.core as _dezero_core
from dezero.core import Config, Variable

import pyengine

from .nodes import (
    _dezero_backward,
    _grad_accumulator,
    _leaf_state,
    _node_of,
    _on_calling_thread,
    _output_nr,
)
from .owner_backward import leaf_hooked
from .variable_backend import _ones_like


class _TensorView:
    """pyengine's tensor protocol, read from a DeZero Variable, so that
    pyengine's own ``grad`` and hook functions serve DeZero.

    ``grad_fn`` and ``output_nr`` come from the creator's node;
    ``requires_grad`` is always true (DeZero differentiates every
    Variable); ``data`` is the Variable itself (gradients are Variables, and
    VariableBackend answers for them); ``grad`` is the Variable's;
    ``_pyengine_leaf``, where pyengine looks for a leaf's LeafState, is the
    Variable's entry in ``_leaf_states``.
    """

    __slots__ = ("variable",)
    requires_grad = True

    def __init__(self, variable):
        self.variable = variable

    @property
    def grad_fn(self):
        creator = self.variable.creator
        return None if creator is None else _node_of(creator)

    @property
    def output_nr(self):
        creator = self.variable.creator
        return 0 if creator is None else _output_nr(creator, self.variable)

    @property
    def data(self):
        return self.variable

    @property
    def grad(self):
        return self.variable.grad

    @grad.setter
    def grad(self, value):
        self.variable.grad = value

    @property
    def _pyengine_leaf(self):
        return _leaf_state(self.variable)

    @_pyengine_leaf.setter
    def _pyengine_leaf(self, state):
        raise AssertionError("a DeZero Variable's LeafState is made by _leaf_state")


def _variables(values, what):
    """``values`` (a Variable or a sequence of them) as a list, checked."""
    if isinstance(values, Variable):
        return [values]
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{what} must be a dezero.Variable or a list or tuple of them, got "
                        f"{type(values).__name__}")
    for index, value in enumerate(values):
        if not isinstance(value, Variable):
            raise TypeError(f"{what}[{index}] must be a dezero.Variable, got {type(value).__name__}")
    return list(values)


def _view(variable, what):
    if not isinstance(variable, Variable):
        raise TypeError(f"{what} must be a dezero.Variable, got {type(variable).__name__}")
    return _TensorView(variable)


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         allow_unused=None, materialize_grads=False):
    """``torch.autograd.grad`` for DeZero Variables: the gradients of
    ``outputs`` with respect to ``inputs``, as a tuple of Variables (or None
    for an unused input with ``allow_unused``); no ``.grad`` is read or
    written. Only the nodes on a path to an input run.

    ``grad_outputs``: Variables or arrays, one per output; None (or a None
    entry) is ``ones_like(output)`` whatever its shape, DeZero's seed. With
    ``create_graph=True`` the results have creators and can be
    differentiated again. ``retain_graph`` defaults to ``create_graph``: a
    released node raises if a later backward reaches it.
    """
    output_list = _variables(outputs, "outputs")
    input_list = _variables(inputs, "inputs")
    if not output_list:
        raise RuntimeError("grad requires non-empty outputs.")
    if not input_list:
        raise RuntimeError("grad requires non-empty inputs.")
    if grad_outputs is None:
        grad_list = [None] * len(output_list)
    elif isinstance(grad_outputs, (list, tuple)):
        grad_list = list(grad_outputs)
    else:
        grad_list = [grad_outputs]
    if len(grad_list) != len(output_list):
        raise RuntimeError(f"got {len(output_list)} outputs and {len(grad_list)} grad_outputs")
    seeds = []
    for index, (output, seed) in enumerate(zip(output_list, grad_list)):
        if seed is None:
            seed = _ones_like(output)
        elif not isinstance(seed, Variable):
            if not isinstance(seed, _dezero_core.array_types):
                raise TypeError(f"grad_outputs[{index}] must be a dezero.Variable, an array or None, "
                                f"got {type(seed).__name__}")
            seed = Variable(seed)
        seeds.append(seed)
    for output in output_list:
        if output.creator is None:
            # The root's sink must be ours, not the AccumulateGrad that
            # pyengine would make for a leaf it meets first.
            _grad_accumulator(output)
    previous_config = Config.enable_backprop
    previous_mode = _dezero_backward.get()
    try:
        # See Note [What an adapter sets around a backward] in
        # pyengine/adapters/__init__.py.
        _dezero_backward.set(None)
        Config.enable_backprop = bool(create_graph)
        with _on_calling_thread():
            return pyengine.grad([_TensorView(output) for output in output_list],
                                 [_TensorView(variable) for variable in input_list],
                                 grad_outputs=seeds, retain_graph=retain_graph,
                                 create_graph=create_graph, allow_unused=allow_unused,
                                 materialize_grads=materialize_grads)
    finally:
        Config.enable_backprop = previous_config
        _dezero_backward.set(previous_mode)


def grad_fn(variable):
    """The node that computes ``variable``'s gradient's successors: the
    FunctionNode of its creator, or None for a leaf. Its ``register_hook``,
    ``register_prehook``, ``name()``, ``next_functions`` and ``metadata``
    are pyengine's (PyTorch's) node API."""
    return _view(variable, "variable").grad_fn


def register_hook(variable, hook):
    """``hook(grad) -> new grad or None`` runs when the gradient for
    ``variable`` is computed (for a leaf: summed, before it is accumulated),
    as ``torch.Tensor.register_hook``. Returns a handle with ``remove()``.
    A replacement must keep the gradient's shape, dtype and device."""
    view = _view(variable, "variable")
    if variable.creator is None:
        leaf_hooked(variable)
    return pyengine.register_tensor_hook(view, hook)


def register_post_accumulate_grad_hook(variable, hook):
    """``hook(variable)`` runs after a gradient was accumulated into the
    leaf ``variable.grad``. Returns a handle with ``remove()``."""
    # DeZeroAccumulateGrad calls the hook with the Variable itself.
    view = _view(variable, "variable")
    if variable.creator is None:
        leaf_hooked(variable)
    return pyengine.register_post_accumulate_grad_hook(view, hook)
