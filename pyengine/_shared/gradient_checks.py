"""The slow check of one gradient against the metadata of the slot it flows
into: ``validate_gradient``, what ``validate_outputs`` does for a gradient
that is not already a numpy array of the slot's shape, dtype and device.

Shared by the compiled core and the twin (See Note [Slow paths are
shared]): broadcast reductions, casts, moves, other value types and the
errors, in PyTorch's words, are written once.
"""

from ..backends import backend_of, is_expandable_to


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
