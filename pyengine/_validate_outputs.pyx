"""validate_outputs: check and fix the gradients a node returns.

The engine's ``call_function`` runs ``validate_outputs_impl`` for every
node. A numpy gradient whose dtype, shape and device are its slot's passes
in C (``numpy_gradient_matches``, inlined where it is cimported), as does a
numpy scalar of a 0-d slot's dtype (``numpy_scalar_matches``) and any value
a backend handles for a slot without metadata; everything else
(broadcast reductions, casts, moves, other value types, errors in PyTorch's
words) goes through the shared ``validate_gradient``, or, for a node whose
``gradient_policy`` is ``"exact"``, ``validate_gradient_exact``: the fast
path is the same for both policies, since a gradient that takes it needs
nothing reduced, cast or moved (See Note [Gradient policy] in
pyengine/_pure/node.py). See Note [Slow paths are shared]. Twin:
``pyengine/_pure/validate_outputs.py``.
"""

from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

cimport numpy as cnp

from pyengine._interrupts cimport WORK_BETWEEN_YIELDS, let_others_run
from pyengine._node cimport Edge, InputMetadata, NodeBase

from pyengine import backends as _backends
from pyengine._shared.gradient_checks import (EXACT, checked_gradient_policy, validate_gradient,
                                               validate_gradient_exact, validate_node_gradient)
from pyengine._shared.messages import gradients_changed_message, node_name

cnp.import_array()


class NodeErrorFormat:
    """``format_error`` for gradients returned by ``node``, as PyTorch words it."""

    def __init__(self, node):
        self.node = node

    def __call__(self, message):
        return f"Function {node_name(self.node)} returned an {message}"


def plain_error_format(message):
    return message


# backend_of's cache, type -> backend or None; register_backend clears it in
# place, so this reference stays the live cache.
cdef dict _backend_cache = _backends._backend_cache


cdef bint known_value_type(object value_type) noexcept:
    """A type ``backend_of`` has already resolved to a backend: a value of it
    passes a slot without metadata as it is."""
    if value_type is cnp.ndarray:
        return True
    cdef PyObject* backend = PyDict_GetItem(_backend_cache, value_type)
    return backend != NULL and backend != <PyObject*>None


cdef object _EXACT = EXACT


cdef int validate_outputs_impl(tuple edges, list grads, object format_error,
                               object node, bint exact) except -1:
    """See the twin's ``validate_outputs``; ``grads`` is edited in place.
    ``format_error`` None: the gradients ``node`` returned, worded as
    PyTorch words them (``NodeErrorFormat(node)``, made only for a gradient
    that needs the slow path: the engine calls this for every node).
    The slow path: ``validate_gradient_exact`` where ``exact``, else, with
    a ``node``, ``validate_node_gradient`` (its class's ``gradient_policy``,
    read only there), else ``validate_gradient``."""
    cdef Py_ssize_t num_edges = PyTuple_GET_SIZE(edges)
    cdef NodeBase next_node
    if PyList_GET_SIZE(grads) != num_edges:
        raise RuntimeError(error_format(format_error, node)(
            f"invalid number of gradients - expected {num_edges}, but got {len(grads)}"))
    # See Note [Long passes let other threads run] in _interrupts.pxd.
    cdef Py_ssize_t work_left = WORK_BETWEEN_YIELDS
    for i in range(num_edges):
        let_others_run(&work_left)
        # The node may keep ``grads``, and the slow path runs Python code
        # (a cast, a backend, a replaced gradient's __del__; other threads,
        # at let_others_run), which may shorten it: each read and write
        # looks at its size again.
        if i >= PyList_GET_SIZE(grads):
            raise RuntimeError(gradients_changed_message(node))
        edge_object = <object>PyTuple_GET_ITEM(edges, i)
        grad = <object>PyList_GET_ITEM(grads, i)
        if edge_object is None:
            continue
        next_node = (<Edge>edge_object).node
        input_nr = (<Edge>edge_object).input_nr
        if gradient_passes_as_is(next_node, input_nr, grad):
            continue
        metadata = slot_metadata(next_node, input_nr)
        if exact:
            checked = validate_gradient_exact(i, grad, metadata, error_format(format_error, node))
        elif node is not None:
            checked = validate_node_gradient(i, grad, metadata, error_format(format_error, node),
                                             node)
        else:
            checked = validate_gradient(i, grad, metadata, error_format(format_error, node))
        if i >= PyList_GET_SIZE(grads):
            raise RuntimeError(gradients_changed_message(node))
        grads[i] = checked
    return 0


cdef object error_format(object format_error, object node):
    return NodeErrorFormat(node) if format_error is None else format_error


def validate_outputs(edges, list grads not None, format_error, gradient_policy="reduce", node=None):
    """Check and fix ``grads`` against ``edges``; see the twin's docstring."""
    # Called where an error is found: checked before, in both cores (the
    # compiled engine's own calls pass None for a node's words, made lazily).
    if not callable(format_error):
        raise TypeError(f"format_error must be a callable, got {type(format_error).__name__}")
    cdef bint exact = checked_gradient_policy(gradient_policy, "validate_outputs") is _EXACT
    edges = tuple(edges)
    # Only a caller from Python: the engine passes a node's checked edges.
    for i, edge in enumerate(edges):
        if edge is not None and not isinstance(edge, Edge):
            raise TypeError(f"edges[{i}] must be an Edge or None, got {type(edge).__name__}")
    if node is not None and not isinstance(node, NodeBase):
        raise TypeError(f"node must be a Node or None, got {type(node).__name__}")
    validate_outputs_impl(edges, grads, format_error, node, exact)
