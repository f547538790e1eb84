"""validate_outputs: check and fix the gradients a node returns.

A numpy gradient whose dtype, shape and device are its slot's passes in C
(``numpy_gradient_matches``, inlined where it is cimported); everything else
(broadcast reductions, casts, moves, other value types, errors in PyTorch's
words) goes through the shared ``validate_gradient``. See Note [Slow paths
are shared]. Twin: ``pyengine/_pure/validate_outputs.py``.
"""

from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

cimport numpy as cnp

from pyengine._node cimport Edge, InputMetadata

from pyengine._shared.gradient_checks import validate_gradient
from pyengine._shared.messages import node_name

cnp.import_array()


class NodeErrorFormat:
    """``format_error`` for gradients returned by ``node``, as PyTorch words it."""

    def __init__(self, node):
        self.node = node

    def __call__(self, message):
        return f"Function {node_name(self.node)} returned an {message}"


def plain_error_format(message):
    return message


cdef int validate_outputs_impl(tuple edges, list grads, object format_error) except -1:
    """See the twin's ``validate_outputs``; ``grads`` is edited in place."""
    cdef Py_ssize_t num_edges = PyTuple_GET_SIZE(edges)
    cdef Edge edge
    cdef tuple slots
    if PyList_GET_SIZE(grads) != num_edges:
        raise RuntimeError(format_error(
            f"invalid number of gradients - expected {num_edges}, but got {len(grads)}"))
    for i in range(num_edges):
        edge_object = <object>PyTuple_GET_ITEM(edges, i)
        grad = <object>PyList_GET_ITEM(grads, i)
        if edge_object is None or grad is None:
            continue
        edge = <Edge>edge_object
        # Tuples of checked types: See Note [Fields Python code can write] in
        # pyengine/_pure/node.py.
        slots = edge.node._input_metadata
        metadata = (<object>PyTuple_GET_ITEM(slots, edge.input_nr)
                    if edge.input_nr < PyTuple_GET_SIZE(slots) else None)
        if metadata is not None and numpy_gradient_matches(<InputMetadata>metadata, grad):
            continue
        grads[i] = validate_gradient(i, grad, metadata, format_error)
    return 0


def validate_outputs(edges, list grads, format_error):
    """Check and fix ``grads`` against ``edges``; see the twin's docstring."""
    edges = tuple(edges)
    # Only a caller from Python: the engine passes a node's checked edges.
    for i, edge in enumerate(edges):
        if edge is not None and not isinstance(edge, Edge):
            raise TypeError(f"edges[{i}] must be an Edge or None, got {type(edge).__name__}")
    validate_outputs_impl(edges, grads, format_error)
