"""The slow checks of one gradient against the metadata of the slot it flows
into, for a gradient that is not already a numpy array of the slot's
shape, dtype and device: ``validate_gradient`` (``gradient_policy="reduce"``,
PyTorch's ``validate_outputs``) and ``validate_gradient_exact``
(``gradient_policy="exact"``, Chainer's rule).

Shared by the compiled core and the twin (See Note [Slow paths are
shared]): broadcast reductions, casts, moves, other value types and the
errors, in PyTorch's words, are written once.
"""

from ..backends import backend_label, backend_of, backend_result_problem, is_expandable_to

# The values of ``gradient_policy``: checked_gradient_policy returns one of
# these very objects, which the compiled core compares by identity.
REDUCE = "reduce"
EXACT = "exact"
GRADIENT_POLICIES = (REDUCE, EXACT)
# The dtype kinds a gradient may be cast from: floating, complex, integer
# and bool, as PyTorch's dtypes.
NUMERIC_KINDS = ("f", "c", "i", "u", "b")


def checked_gradient_policy(policy, owner):
    """``policy`` as one of GRADIENT_POLICIES (the constant itself);
    ``owner`` names where it was read, for the error: TypeError for a value
    that is not a str, ValueError for another str."""
    if policy is REDUCE or policy is EXACT:
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"{owner}: gradient_policy must be a str, 'reduce' or 'exact', got "
                        f"{type(policy).__name__}")
    for known in GRADIENT_POLICIES:
        if str.__eq__(policy, known):
            return known
    raise ValueError(f"{owner}: gradient_policy must be 'reduce' or 'exact', got {policy!r}")


def gradient_policy_of(node):
    """The ``gradient_policy`` of ``node``'s class, checked: read only
    where a gradient takes validate_outputs' slow path (See Note [Gradient
    policy] in ``pyengine/_pure/node.py``)."""
    node_class = type(node)
    policy = node_class.gradient_policy
    if policy is REDUCE or policy is EXACT:
        return policy
    return checked_gradient_policy(policy, f"Node class {node_class.__qualname__}")


def value_backend(i, grad, format_error):
    """The backend of gradient ``i``; TypeError where no backend handles it."""
    backend = backend_of(grad)
    if backend is None:
        raise TypeError(format_error(
            f"invalid gradient at index {i} - expected an array, but got {type(grad).__name__}"))
    return backend


def result_backend(i, result, backend, method, format_error):
    """The backend of ``result``, which ``backend.<method>()`` returned for
    gradient ``i``; TypeError naming the backend, the method and what it
    returned where no backend handles it (See Note [What a backend returns]
    in pyengine/backends.py)."""
    found = backend_of(result)
    if found is None:
        raise TypeError(format_error(
            f"invalid gradient at index {i} - {backend_result_problem(result, backend, method)}"))
    return found


def value_shape(i, grad, backend, format_error):
    """``backend.shape(grad)`` as a tuple, for gradient ``i``; TypeError
    naming the backend and what its shape() returned where that is no
    sequence of sizes (None, an int, a str), where ``tuple()`` said only
    "'NoneType' object is not iterable" and a str passed as its
    characters."""
    shape = backend.shape(grad)
    if type(shape) is tuple:
        return shape
    if not isinstance(shape, (str, bytes, bytearray)):
        try:
            return tuple(shape)
        except TypeError:
            pass  # worded below, without the iteration's error as its cause
    what = "None" if shape is None else f"{shape!r} of type {type(shape).__name__}"
    raise TypeError(format_error(
        f"invalid gradient at index {i} - shape() of {backend_label(backend)} returned {what}: "
        "expected a tuple of ints"))


def validate_gradient(i, grad, metadata, format_error):
    """Gradient ``i`` checked against its slot's ``metadata`` (None: only
    that it is a value), reduced, cast or moved where that is allowed."""
    backend = value_backend(i, grad, format_error)
    if metadata is None:
        return grad
    shape = value_shape(i, grad, backend, format_error)
    if shape != metadata.shape:
        if not is_expandable_to(metadata.shape, shape):
            raise RuntimeError(format_error(
                f"invalid gradient at index {i} - got {shape} but expected shape "
                f"compatible with {metadata.shape}"))
        grad = backend.sum_to(grad, metadata.shape)
        # sum_to may return another type (an IndexedGradient reduces to a
        # dense array): the checks below ask the backend of what it returned.
        backend = result_backend(i, grad, backend, "sum_to", format_error)
        shape = metadata.shape
    dtype = backend.dtype(grad)
    if dtype != metadata.dtype:
        # PyTorch's rule: a floating gradient casts to any slot; another one
        # (integer, bool, complex) only to a slot that is complex as it is.
        # PyTorch has no other kinds: a datetime, str, structured or object
        # gradient casts to none (numpy would make a datetime a float).
        kind = backend.dtype_kind(dtype)
        if kind not in NUMERIC_KINDS:
            raise RuntimeError(format_error(
                f"invalid gradient at index {i} - expected dtype {metadata.dtype} but got {dtype} "
                "(only a numeric gradient casts)"))
        if kind != "f" and (kind == "c") != (backend.dtype_kind(metadata.dtype) == "c"):
            raise RuntimeError(format_error(
                f"invalid gradient at index {i} - expected dtype {metadata.dtype} but got {dtype} "
                f"(a {'complex' if kind == 'c' else 'real'} gradient casts only to a "
                f"{'complex' if kind == 'c' else 'real'} dtype)"))
        grad = backend.cast(grad, metadata.dtype)
        # As after sum_to: the device is asked of the backend of what came back.
        backend = result_backend(i, grad, backend, "cast", format_error)
    device = backend.device(grad)
    if device != metadata.device:
        # PyTorch moves only a 0-dim gradient, and asks the dim of the
        # gradient as reduced above (grad.dim() after reduce_grad in
        # validate_outputs), not of the one the node returned.
        if len(shape) != 0:
            raise RuntimeError(format_error(
                f"invalid gradient at index {i} - expected device {metadata.device} but got {device}"))
        grad = backend.to_device(grad, metadata.device)
        result_backend(i, grad, backend, "to_device", format_error)
    return grad


def validate_gradient_exact(i, grad, metadata, format_error):
    """Gradient ``i`` checked against its slot's ``metadata`` by Chainer's
    rule (``gradient_policy="exact"``): a value that already has the slot's
    shape, dtype and device, returned as it is; nothing is reduced, cast or
    moved. An integer dtype passes only where the slot's dtype is that very
    dtype. Without metadata, only that it is a value."""
    backend = value_backend(i, grad, format_error)
    if metadata is None:
        return grad
    shape = value_shape(i, grad, backend, format_error)
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


def validate_node_gradient(i, grad, metadata, format_error, node):
    """Gradient ``i`` that ``node`` returned, checked by its class's
    ``gradient_policy``: ``validate_gradient`` or
    ``validate_gradient_exact``. The policy is read only for a gradient
    that is not already its slot's value (shape, dtype and device), which
    both rules pass as it is (See Note [Gradient policy] in
    ``pyengine/_pure/node.py``)."""
    if metadata is not None:
        backend = backend_of(grad)
        if backend is not None and not (
                value_shape(i, grad, backend, format_error) == metadata.shape
                and backend.dtype(grad) == metadata.dtype
                and backend.device(grad) == metadata.device):
            if gradient_policy_of(node) is EXACT:
                return validate_gradient_exact(i, grad, metadata, format_error)
    return validate_gradient(i, grad, metadata, format_error)
