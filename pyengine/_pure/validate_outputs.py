"""validate_outputs: check and fix the gradients a node returns.

Twin of ``pyengine/_validate_outputs.pyx``. The compiled core
checks a numpy gradient of the right shape, dtype and device in C and
calls :func:`validate_gradient` here for everything else (broadcast
reductions, casts, other value types, errors), so that the slow path is
written once. See Note [Slow paths are shared].
"""

from ..backends import backend_of, is_expandable_to


def validate_outputs(edges, grads, format_error):
    """Check and fix ``grads`` (a list, edited in place) against ``edges``.

    For each gradient that flows along an edge into a slot with metadata:
    reduce a broadcast shape with ``sum_to``, cast to the slot's dtype (as
    PyTorch: any real gradient to a real slot, a floating one to any slot),
    move a 0-d value to the slot's device; any other mismatch raises with
    ``format_error(message)``, naming the index, expected and got.
    """
    if len(grads) != len(edges):
        raise RuntimeError(format_error(
            f"invalid number of gradients - expected {len(edges)}, but got {len(grads)}"))
    for i, edge in enumerate(edges):
        grad = grads[i]
        if edge is None or grad is None:
            continue
        all_metadata = edge.node._input_metadata
        metadata = all_metadata[edge.input_nr] if edge.input_nr < len(all_metadata) else None
        grads[i] = validate_gradient(i, grad, metadata, format_error)


def validate_gradient(i, grad, metadata, format_error):
    """Gradient ``i`` checked against its slot's ``metadata`` (None: only
    that it is a value), reduced, cast or moved where that is allowed."""
    backend = backend_of(grad)
    if backend is None:
        raise TypeError(format_error(
            f"invalid gradient at index {i} - expected an array, but got {type(grad).__name__}"))
    if metadata is None:
        return grad
    shape = tuple(backend.shape(grad))
    if shape != metadata.shape:
        if not is_expandable_to(metadata.shape, shape):
            raise RuntimeError(format_error(
                f"invalid gradient at index {i} - got {shape} but expected shape "
                f"compatible with {metadata.shape}"))
        grad = backend.sum_to(grad, metadata.shape)
    dtype = backend.dtype(grad)
    if dtype != metadata.dtype:
        # PyTorch's rule: a floating gradient casts to any slot; another one
        # (integer, bool, complex) only to a slot that is complex as it is.
        kind = backend.dtype_kind(dtype)
        if kind != "f" and (kind == "c") != (backend.dtype_kind(metadata.dtype) == "c"):
            raise RuntimeError(format_error(
                f"invalid gradient at index {i} - expected dtype {metadata.dtype} but got {dtype} "
                f"(a {'complex' if kind == 'c' else 'real'} gradient casts only to a "
                f"{'complex' if kind == 'c' else 'real'} dtype)"))
        grad = backend.cast(grad, metadata.dtype)
    device = backend.device(grad)
    if device != metadata.device:
        if len(shape) != 0:
            raise RuntimeError(format_error(
                f"invalid gradient at index {i} - expected device {metadata.device} but got {device}"))
        grad = backend.to_device(grad, metadata.device)
    return grad
