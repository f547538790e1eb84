"""How the data-parallel layer reaches a framework's parameters.

:class:`DataParallel` needs five things of each parameter: a name (for
errors), its array (to broadcast it and check its shape), its gradient as an
array (or None), a way to write an averaged gradient back into ``.grad``, and
a post-accumulate-grad hook. A :class:`ParameterAccess` says how, for one
framework. Two come built in:

- :class:`TensorAccess`: anything that follows pyengine's tensor protocol
  with a ``.data`` array and a ``.grad`` that is an array or a tensor with a
  ``.data`` array (``pyengine.frontend`` tensors, the tests' minitensor);
  hooks through ``pyengine.register_post_accumulate_grad_hook``.
- :class:`DeZeroAccess`: DeZero Variables run by pyengine's DeZero adapter
  (``.grad`` is a Variable); hooks through the adapter's
  ``register_post_accumulate_grad_hook``.

:func:`named_parameters` turns what the user hands ``DataParallel`` (a model
or a list of parameters) into ``(name, parameter)`` pairs in a deterministic
order that every rank shares, and picks the access.
"""

from __future__ import annotations

import re
import sys

import pyengine

__all__ = ["ParameterAccess", "TensorAccess", "DeZeroAccess", "named_parameters"]


class ParameterAccess:
    """Override these for a framework whose parameters pyengine runs."""

    def data(self, parameter):
        """The parameter's array (numpy or cupy); written in place by the
        broadcast from rank 0."""
        raise NotImplementedError

    def grad(self, parameter):
        """The parameter's gradient as an array, or None."""
        raise NotImplementedError

    def set_grad(self, parameter, array):
        """Make ``array`` (a fresh array nobody else holds) the parameter's ``.grad``."""
        raise NotImplementedError

    def register_post_accumulate_grad_hook(self, parameter, hook):
        """``hook(parameter)`` after each accumulation; returns a handle with ``remove()``."""
        raise NotImplementedError


class TensorAccess(ParameterAccess):
    """pyengine's tensor protocol: ``.data`` is the array, ``.grad`` an array
    or a tensor whose ``.data`` is one."""

    def data(self, parameter):
        return parameter.data

    def grad(self, parameter):
        grad = parameter.grad
        if grad is None:
            return None
        return getattr(grad, "data", grad)

    def set_grad(self, parameter, array):
        parameter.grad = array

    def register_post_accumulate_grad_hook(self, parameter, hook):
        return pyengine.register_post_accumulate_grad_hook(parameter, hook)


class DeZeroAccess(ParameterAccess):
    """DeZero Variables under pyengine's DeZero adapter (``install()`` it first)."""

    def __init__(self):
        import dezero

        from pyengine.adapters.dezero import autograd_api

        self._variable_type = dezero.Variable
        self._register = autograd_api.register_post_accumulate_grad_hook

    def data(self, parameter):
        return parameter.data

    def grad(self, parameter):
        grad = parameter.grad
        return None if grad is None else grad.data

    def set_grad(self, parameter, array):
        parameter.grad = self._variable_type(array)

    def register_post_accumulate_grad_hook(self, parameter, hook):
        return self._register(parameter, hook)


def _natural_key(name):
    """'l10/W' after 'l2/W': digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _is_dezero(value, kind):
    """Whether ``value`` is a DeZero ``kind`` ('Layer' or 'Variable'), without importing DeZero."""
    dezero = sys.modules.get("dezero")
    return dezero is not None and isinstance(value, getattr(dezero, kind))


def named_parameters(model_or_parameters):
    """``(pairs, access)``: the parameters as ``(name, parameter)`` pairs, in
    an order every rank computes alike, and the access for their framework.

    A frontend module gives its ``named_parameters()`` (creation order); a
    DeZero model its flattened ``'layer/param'`` names in natural order
    (DeZero keeps them in a set, whose order changes with the process's hash
    seed); a list or tuple of parameters is taken in its order, named by
    index; a dict as ``name -> parameter`` in its order."""
    value = model_or_parameters
    if hasattr(value, "named_parameters"):
        pairs = list(value.named_parameters())
    elif _is_dezero(value, "Layer"):
        flat = {}
        value._flatten_params(flat)
        pairs = sorted(flat.items(), key=lambda item: _natural_key(item[0]))
    elif isinstance(value, dict):
        pairs = [(str(name), parameter) for name, parameter in value.items()]
    elif isinstance(value, (list, tuple)):
        pairs = [(str(index), parameter) for index, parameter in enumerate(value)]
    else:
        raise TypeError("DataParallel expects a model (with named_parameters(), or a DeZero Model), "
                        f"or a list, tuple or dict of parameters; got {type(value).__name__}")
    if not pairs:
        raise ValueError("DataParallel got no parameters")
    seen = set()
    for name, parameter in pairs:
        if id(parameter) in seen:
            raise ValueError(f"parameter {name!r} is listed twice")
        seen.add(id(parameter))
    access = DeZeroAccess() if _is_dezero(pairs[0][1], "Variable") else TensorAccess()
    return pairs, access
