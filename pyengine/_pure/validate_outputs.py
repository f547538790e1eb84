"""validate_outputs: check and fix the gradients a node returns.

Twin of ``pyengine/_validate_outputs.pyx``. Both cores call the shared
:func:`validate_gradient` for a gradient (the compiled core only for one
that is not a numpy array of the right shape, dtype and device, which it
checks in C), or :func:`validate_gradient_exact` for a node whose
``gradient_policy`` is ``"exact"`` (See Note [Gradient policy] in
``pyengine/_pure/node.py``), so that the slow path is written once. See
Note [Slow paths are shared].
"""

import numpy as np

from .. import backends
from .._shared.gradient_checks import (
    EXACT,
    checked_gradient_policy,
    validate_gradient,
    validate_gradient_exact,
    validate_node_gradient,
)
from .._shared.messages import gradients_changed_message
from .node import Edge, NodeBase
from .static_types import c_type_name


def validate_outputs(edges, grads, format_error, gradient_policy="reduce", node=None):
    """Check and fix ``grads`` (a list, edited in place) against ``edges``.

    For each gradient that flows along an edge into a slot with metadata,
    under ``gradient_policy="reduce"`` (PyTorch's rule): reduce a broadcast
    shape with ``sum_to``, cast to the slot's dtype (as PyTorch: any real
    gradient to a real slot, a floating one to any slot), move a value that is 0-d once reduced
    to the slot's device; under ``"exact"`` (Chainer's rule) the gradient
    must have the slot's shape, dtype and device already. Any other
    mismatch raises with ``format_error(message)``, naming the index,
    expected and got. With ``node`` (the gradients it returned) and the
    default policy, the rule is ``node``'s class's ``gradient_policy``,
    read only for a gradient that is not already its slot's value.
    """
    # The compiled signature's ``list grads not None``, checked as Cython
    # checks it, before the body: a list, not a subclass, and not None (its
    # size is read in C, without a check).
    if type(grads) is not list:
        raise TypeError(f"Argument 'grads' has incorrect type (expected list, got "
                        f"{c_type_name(type(grads))})")
    # Called where an error is found: checked before, in both cores (the
    # compiled engine's own calls pass None for a node's words, made lazily).
    if not callable(format_error):
        raise TypeError(f"format_error must be a callable, got {type(format_error).__name__}")
    exact = checked_gradient_policy(gradient_policy, "validate_outputs") is EXACT
    edges = tuple(edges)
    # Only a caller from Python: the engine passes a node's checked edges.
    for i, edge in enumerate(edges):
        if edge is not None and not isinstance(edge, Edge):
            raise TypeError(f"edges[{i}] must be an Edge or None, got {type(edge).__name__}")
    if node is not None and not isinstance(node, NodeBase):
        raise TypeError(f"node must be a Node or None, got {type(node).__name__}")
    if len(grads) != len(edges):
        raise RuntimeError(format_error(
            f"invalid number of gradients - expected {len(edges)}, but got {len(grads)}"))
    for i, edge in enumerate(edges):
        # The node may keep ``grads``, and the checks run Python code (a
        # cast, a backend, a replaced gradient's __del__), which may
        # shorten it: each read and write looks at its size again.
        if i >= len(grads):
            raise RuntimeError(gradients_changed_message(node))
        grad = grads[i]
        if edge is None or grad is None:
            continue
        all_metadata = edge.node._input_metadata
        metadata = all_metadata[edge.input_nr] if edge.input_nr < len(all_metadata) else None
        if exact:
            checked = validate_gradient_exact(i, grad, metadata, format_error)
        elif node is not None:
            checked = validate_node_gradient(i, grad, metadata, format_error, node)
        else:
            checked = validate_gradient(i, grad, metadata, format_error)
        if i >= len(grads):
            raise RuntimeError(gradients_changed_message(node))
        grads[i] = checked


def known_value_type(value_type):
    """A type ``backend_of`` has already resolved to a backend (its cache):
    a value of it passes a slot without metadata as it is."""
    return value_type is np.ndarray or backends._backend_cache.get(value_type) is not None
