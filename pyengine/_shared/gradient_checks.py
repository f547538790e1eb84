"""The slow checks of one gradient against the metadata of the slot it flows
into, for a gradient that is not already a numpy array of the slot's
shape, dtype and device: ``validate_gradient`` (``gradient_policy="reduce"``,
PyTorch's ``validate_outputs``) and ``validate_gradient_exact``
(``gradient_policy="exact"``, Chainer's rule).

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


def validate_gradient_exact(i, grad, metadata, format_error):
    """Gradient ``i`` checked against its slot's ``metadata`` by Chainer's
    rule (``gradient_policy="exact"``): a value that already has the slot's
    shape, dtype and device, returned as it is; nothing is reduced, cast or
    moved. An integer dtype passes only where the slot's dtype is that very
    dtype. Without metadata, only that it is a value."""
    backend = backend_of(grad)
    if backend is None:
        raise TypeError(format_error(
            f"invalid gradient at index {i} - expected an array, but got {type(grad).__name__}"))
    if metadata is None:
        return grad
    shape = tuple(backend.shape(grad))
    if shape != metadata.shape:
        raise RuntimeError(format_error(
            f"invalid gradient at index {i} - got shape {shape} but expected shape "
            f"{metadata.shape} (gradient_policy='exact' reduces no broadcast)"))
    dtype = backend.dtype(grad)
    if dtype != metadata.dtype:
        raise RuntimeError(format_error(
            f"invalid gradient at index {i} - expected dtype {metadata.dtype} but got {dtype} "
            "(gradient_policy='exact' casts no gradient)"))
    device = backend.device(grad)
    if device != metadata.device:
        raise RuntimeError(format_error(
            f"invalid gradient at index {i} - expected device {metadata.device} but got {device} "
            "(gradient_policy='exact' moves no gradient)"))
    return grad
