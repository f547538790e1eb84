"""Value backends: the few operations the engine needs on a gradient value.

A gradient flowing through the engine is a *value*: a numpy array, a cupy
array, or (under ``create_graph=True``) a framework tensor. The engine never
does arithmetic itself; it asks the backend registered for the value's type
for: shape, dtype, device, out-of-place ``add``, in-place ``add_`` (used only
on arrays the engine allocated itself), ``sum_to`` (reduce a broadcast
gradient), ``cast``, ``copy``, ``to_device``, ``zeros``, ``ones_like`` and a
NaN check. A backend whose arrays may hold the rows of an
:class:`pyengine.IndexedGradient` also gives ``index_add_``,
``concatenate``, ``unique_inverse`` and ``index_range`` (numpy and cupy do).

Every sum keeps the type of its operands: two numpy arrays sum to a numpy
array at every rank, 0-d included (numpy's own ``a + b`` gives a scalar
there), so that a framework may keep the sum as ``.grad`` and update it in
place. A dense array plus an IndexedGradient is a dense array.

numpy is built in (and the compiled core has a fast path for it that never
comes here on the common path). Another array type or a framework's tensor
type plugs in with :func:`register_backend`; lookups walk the type's MRO, so
registering a base class covers its subclasses. ``register_backend`` returns
the backend it replaced and :func:`unregister_backend` removes one, so that
an adapter can undo what it registered.

Note [Replacing the numpy backend]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``register_backend(np.ndarray, backend)`` replaces the built-in numpy
backend, and from then on every numpy gradient goes through ``backend``, in
both cores: the InputBuffer's sums, validate_outputs' checks, AccumulateGrad's
copies and sums. The numpy fast paths (the compiled core's, and the twin's
counterpart of each) are taken only for a value that ``is_numpy_array``
(pyengine/_pure/node.py, pyengine/_node.pyx): an exact ndarray while
``numpy_backend_is_builtin``, which ``register_backend`` keeps up to date
(the backend found for ``np.ndarray`` is the built-in ``NUMPY``, or one
whose ``numpy_fast_paths`` is True: it sums, checks and copies exact numpy
arrays as ``NUMPY`` does, and differs only for other operands). The
compiled core keeps a C copy of that flag, which register_backend's (and
unregister_backend's) listener refreshes, so that the check costs no
dictionary lookup. Routing (``node_device``) still takes a numpy array to be
on the CPU whatever backend handles it, in both cores. A numpy scalar (or
any other value) takes a fast path only where ``backend_of``'s cache maps
its type to ``NUMPY`` itself (``has_numpy_backend`` in
pyengine/_pure/node.py, pyengine/_node.pyx), so that a backend registered
for its type or a base is always asked.
"""

from __future__ import annotations

import numpy as np

from .device import CPU, Device

__all__ = [
    "ArrayBackend",
    "NumpyBackend",
    "register_backend",
    "unregister_backend",
    "register_device_type",
    "backend_of",
    "is_expandable_to",
    "sum_to_shape_axes",
]


class ArrayBackend:
    """The operations of one value type. Subclass it and override them all.

    ``dtype_kind`` returns ``"f"`` (floating), ``"c"`` (complex) or anything
    else (not differentiable); the engine refuses gradients of other kinds.
    ``add``, ``add_``, ``copy``, ``cast``, ``sum_to`` and ``to_device``
    return a value of a registered backend, never None: the engine refuses
    anything else with a TypeError (See Note [What a backend returns]).
    """

    name = "abstract"
    # True on a backend registered for np.ndarray that does for exact numpy
    # arrays what the built-in NUMPY does (it differs only for operands of
    # other types), so that the numpy fast paths stay on while it is
    # registered: See Note [Replacing the numpy backend].
    numpy_fast_paths = False

    def shape(self, value) -> tuple:
        raise NotImplementedError

    def dtype(self, value):
        raise NotImplementedError

    def device(self, value) -> Device:
        raise NotImplementedError

    def dtype_kind(self, dtype) -> str:
        raise NotImplementedError

    def add(self, a, b):
        """``a + b`` in a new value; neither argument is modified."""
        raise NotImplementedError

    def add_(self, a, b):
        """Add ``b`` into ``a`` in place and return ``a``; may return a new value
        where the type has no in-place add."""
        return self.add(a, b)

    def sum_to(self, value, shape: tuple):
        """Sum a gradient of a broadcast shape down to ``shape``."""
        raise NotImplementedError

    def cast(self, value, dtype):
        raise NotImplementedError

    def copy(self, value):
        """A new value equal to ``value`` that shares no memory with it."""
        raise NotImplementedError

    def to_device(self, value, device: Device):
        raise NotImplementedError

    def zeros(self, shape: tuple, dtype, device: Device):
        raise NotImplementedError

    def ones_like(self, value):
        raise NotImplementedError

    def has_nan(self, value) -> bool:
        raise NotImplementedError

    # What an IndexedGradient asks of the backend of its rows.

    def index_add_(self, dense, indices, values):
        """Add ``values[k]`` into ``dense[indices[k]]`` for every ``k`` (repeated
        indices add up), in place; return ``dense``."""
        raise NotImplementedError(f"the {self.name} backend cannot hold indexed gradients")

    def concatenate(self, arrays):
        """The arrays joined along their first axis."""
        raise NotImplementedError(f"the {self.name} backend cannot hold indexed gradients")

    def unique_inverse(self, indices):
        """``(unique, inverse)``: the sorted distinct ``indices``, and for each
        index its position in ``unique``."""
        raise NotImplementedError(f"the {self.name} backend cannot hold indexed gradients")

    def index_range(self, indices) -> tuple:
        """``(min, max)`` of a non-empty integer array, as Python ints."""
        raise NotImplementedError(f"the {self.name} backend cannot hold indexed gradients")


def sum_to_shape_axes(value_shape: tuple, shape: tuple) -> tuple:
    """The axes of ``value_shape`` to sum (keeping dims) to reach ``shape``.

    ``shape`` must be expandable to ``value_shape`` (see :func:`is_expandable_to`).
    """
    lead = len(value_shape) - len(shape)
    axes = list(range(lead))
    for i, size in enumerate(shape):
        if size == 1 and value_shape[lead + i] != 1:
            axes.append(lead + i)
    return tuple(axes)


def is_expandable_to(shape: tuple, target: tuple) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (numpy's rules, one way)."""
    if len(shape) > len(target):
        return False
    lead = len(target) - len(shape)
    for i, size in enumerate(shape):
        if size != 1 and size != target[lead + i]:
            return False
    return True


def sums_in_place(total, value):
    """Whether numpy array ``value`` may be added into array ``total`` in
    place: where it has ``total``'s dtype and shape, so that the in-place
    sum is the one ``total + value`` would make. See Note [InputBuffer
    ownership] in pyengine/_pure/input_buffer.py."""
    return total.dtype == value.dtype and total.shape == value.shape


class NumpyBackend(ArrayBackend):
    """numpy arrays and numpy scalars; always on the CPU."""

    name = "numpy"

    def shape(self, value):
        return value.shape

    def dtype(self, value):
        return value.dtype

    def device(self, value):
        return CPU

    def dtype_kind(self, dtype):
        # A dtype answers itself, without np.dtype()'s conversion (See
        # benchmarks/RESULTS.md, "Issue 19: the fixed cost of one call, the
        # second pass").
        return dtype.kind if isinstance(dtype, np.dtype) else np.dtype(dtype).kind

    def add(self, a, b):
        if type(b) is IndexedGradient:
            dense = np.array(a, dtype=np.result_type(a, b.dtype), copy=True)
            return b.add_to_(dense)
        if isinstance(a, np.generic) and isinstance(b, np.generic):
            # numpy's scalar arithmetic: np.add's value and type for two
            # numpy scalars (tests/test_sum_types.py checks every pair of
            # numeric types), without the ufunc's dispatch (See
            # benchmarks/RESULTS.md, "Issue 19: gradients that are numpy
            # scalars"). The InputBuffers' fast path calls it too.
            return a + b
        total = np.add(a, b)
        if isinstance(total, np.generic) and (isinstance(a, np.ndarray)
                                              or isinstance(b, np.ndarray)):
            # numpy gives a scalar for 0-d operands: keep the array type.
            total = np.asarray(total)
        return total

    def add_(self, a, b):
        if isinstance(a, np.ndarray) and a.flags.writeable:
            if type(b) is IndexedGradient:
                if np.can_cast(b.dtype, a.dtype, "same_kind"):
                    return b.add_to_(a)
                return self.add(a, b)
            if isinstance(b, np.ndarray) and sums_in_place(a, b):
                np.add(a, b, out=a)
                return a
        return self.add(a, b)

    def sum_to(self, value, shape):
        value = np.asarray(value)
        axes = sum_to_shape_axes(value.shape, shape)
        if axes:
            value = value.sum(axis=axes, keepdims=True)
        return value.reshape(shape)

    def cast(self, value, dtype):
        return np.asarray(value).astype(dtype)

    def copy(self, value):
        return np.array(value, copy=True)

    def to_device(self, value, device):
        if device == CPU:
            return value
        from_host = _from_host.get(device.type)
        if from_host is None:
            raise ValueError(f"cannot move a numpy value to {device}: no device type "
                             f"{device.type!r} is registered")
        return from_host(value, device)

    def zeros(self, shape, dtype, device):
        return self.to_device(np.zeros(shape, dtype=dtype), device)

    def ones_like(self, value):
        if type(value) is np.ndarray:
            # An empty array filled, without np.ones_like's Python (its
            # dispatch, then copyto): loss.backward() makes one per call
            # (See benchmarks/RESULTS.md, "Issue 19: the fixed cost of one
            # call, the second pass").
            ones = np.empty_like(value)
            ones.fill(1)
            return ones
        return np.ones_like(value)

    def has_nan(self, value):
        return bool(np.isnan(value).any())

    def index_add_(self, dense, indices, values):
        # See Note [Adding rows at indices].
        if values.ndim < 2 or len(indices) < _ROWS_FOR_SORTED_ADD:
            np.add.at(dense, indices, values)
            return dense
        count = len(indices)
        if indices.min() < 0:  # -1 and rows - 1 must meet as one row
            indices = indices % dense.shape[0]
        if dense.shape[0] * count < 2 ** 62:
            # Sorting (index, position) keys: a plain sort, faster than a
            # stable argsort, in the same order.
            keys = indices.astype(np.int64) * count + np.arange(count)
            keys.sort()
            sorted_indices, order = np.divmod(keys, count)
        else:
            order = np.argsort(indices, kind="stable")
            sorted_indices = indices[order]
        first = np.empty(len(sorted_indices), dtype=bool)
        first[0] = True
        np.not_equal(sorted_indices[1:], sorted_indices[:-1], out=first[1:])
        distinct = sorted_indices[first]
        rows = np.take(dense, distinct, axis=0)
        rows += np.take(values, order[first], axis=0)
        dense[distinct] = rows
        repeated = ~first
        if repeated.any():
            np.add.at(dense, sorted_indices[repeated], np.take(values, order[repeated], axis=0))
        return dense

    def concatenate(self, arrays):
        return np.concatenate(arrays)

    def unique_inverse(self, indices):
        unique, inverse = np.unique(indices, return_inverse=True)
        return unique, inverse.reshape(-1)

    def index_range(self, indices):
        return int(indices.min()), int(indices.max())


# Note [Adding rows at indices]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``np.add.at(dense, indices, rows)`` adds one row at a time through
# ufunc.at's general loop, several times slower than a fancy-indexed add.
# But ``dense[indices] += rows`` is wrong where an index repeats (the last
# write wins). So the indices are sorted, stably (as keys index * count +
# position, which a plain sort orders as a stable one would): the first occurrence of
# each distinct index is added with a gather, an add and a scatter (no index
# repeats among them), and only the repeated occurrences go through
# ``np.add.at``. Each row of ``dense`` receives its rows in the order they
# came, as ``np.add.at`` adds them, so the result is the same to the bit.
# Few rows (or 1-d values, where ufunc.at has a fast loop) take
# ``np.add.at`` directly.

_ROWS_FOR_SORTED_ADD = 128

_backends: dict[type, ArrayBackend] = {}
# device type -> function(numpy value, Device) -> value on that device.
_from_host: dict = {}
# Lookups by exact type, filled lazily from the MRO; cleared on registration,
# and when it reaches BACKEND_CACHE_LIMIT types: a program that makes value
# types on the fly (a class per call) must not keep every one alive.
_backend_cache: dict[type, ArrayBackend | None] = {}
BACKEND_CACHE_LIMIT = 4096

# Whether exact numpy arrays go to the built-in NUMPY backend, so that the
# numpy fast paths may skip the backend: See Note [Replacing the numpy
# backend]. Written by register_backend and unregister_backend, under the GIL.
numpy_backend_is_builtin = True
# Functions register_backend and unregister_backend call, without arguments,
# after every change: the compiled core copies numpy_backend_is_builtin into C.
_registration_listeners: list = []


def register_backend(value_type: type, backend: ArrayBackend) -> ArrayBackend | None:
    """Make ``backend`` handle values of ``value_type`` and its subclasses.
    Returns the backend registered for ``value_type`` itself before (None if
    none was), so that a caller can put it back."""
    if not isinstance(backend, ArrayBackend):
        raise TypeError(f"backend must be an ArrayBackend, got {type(backend).__name__}")
    previous = _backends.get(value_type)
    _backends[value_type] = backend
    _registrations_changed()
    return previous


def unregister_backend(value_type: type) -> ArrayBackend | None:
    """Remove the backend registered for ``value_type`` itself and return it
    (None if there was none); values of that type then find the backend of
    a base class, if any."""
    previous = _backends.pop(value_type, None)
    _registrations_changed()
    return previous


def _registrations_changed():
    global numpy_backend_is_builtin
    _backend_cache.clear()
    found = _find_backend(np.ndarray)
    numpy_backend_is_builtin = found is NUMPY or (found is not None
                                                  and found.numpy_fast_paths is True)
    for listener in _registration_listeners:
        listener()


def register_device_type(device_type: str, from_host) -> None:
    """Let numpy values move to devices of ``device_type``:
    ``from_host(array, device)`` returns the array's copy on ``device``."""
    _from_host[device_type] = from_host


def backend_of(value) -> ArrayBackend | None:
    """The backend for ``value``'s type, or ``None`` if no backend handles it."""
    value_type = type(value)
    try:
        return _backend_cache[value_type]
    except KeyError:
        pass
    found = _find_backend(value_type)
    if len(_backend_cache) >= BACKEND_CACHE_LIMIT:
        _backend_cache.clear()
    _backend_cache[value_type] = found
    return found


def backend_to_add(value, holder):
    """``backend_of(value)``, for a sum into ``value``; TypeError where no
    backend handles it. ``holder`` names where ``value`` was found (a
    ``.grad`` or a buffer slot, which Python code can set to anything)."""
    backend = backend_of(value)
    if backend is None:
        raise no_backend_to_add(value, holder)
    return backend


def no_backend_to_add(value, holder):
    """``backend_to_add``'s error, for a caller that builds ``holder``'s
    name only once it is needed (an InputBuffer names its slot)."""
    return TypeError(f"{holder} holds a {type(value).__name__}, which no registered backend "
                     "adds a gradient to: expected a value of a registered backend (see "
                     "pyengine.register_backend)")


def backend_label(backend):
    """``backend``'s ``name`` and class, as an error names it: "the backend
    't' (TBackend)". A ``name`` that cannot be read (a property that raises
    an Exception) is said so, and the class still names the backend: See
    Note [A name() that raises] in pyengine/_shared/messages.py."""
    try:
        name = repr(backend.name)
    except Exception as error:
        name = f"(its name raised {type(error).__name__})"
    return f"the backend {name} ({type(backend).__name__})"


def backend_result_problem(result, backend, method):
    """What is wrong with ``result``, which ``backend.<method>()`` returned
    for the engine to keep: the words of ``check_backend_result``'s error
    (See Note [What a backend returns])."""
    if result is None:
        what = "None"
    else:
        what = f"a {type(result).__name__}, which no registered backend handles"
    hint = " (an add_ must return the sum: its first argument, or a new value)" if (
        method == "add_") else ""
    return (f"{method}() of {backend_label(backend)} returned {what}: expected a value of a "
            f"registered backend{hint}")


def check_backend_result(result, backend, method, holder):
    """``result``, which ``backend.<method>()`` returned for the engine to
    store into ``holder`` (a buffer slot, a ``.grad``), where it is a value
    of a registered backend; TypeError (the value is of the wrong type) that
    names ``holder``, the backend, the method and what came back, where it is
    not: See Note [What a backend returns]."""
    if backend_of(result) is None:
        raise bad_backend_result(result, backend, method, holder)
    return result


def bad_backend_result(result, backend, method, holder):
    """``check_backend_result``'s error, for a caller that builds
    ``holder``'s name only once it is needed (an InputBuffer names its
    slot)."""
    return TypeError(f"{holder}: {backend_result_problem(result, backend, method)}")


# Note [What a backend returns]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The engine keeps what a backend's ``add``, ``add_``, ``copy``, ``cast``,
# ``sum_to`` and ``to_device`` return: as an InputBuffer's sum, as a leaf's
# ``.grad``, as the gradient validate_outputs passes on. A backend is
# Python code of a framework's, and one that returns None (an ``add_``
# written without ``return a``) or a value no registered backend handles
# would, stored as it is, make ``.grad`` None (losing every gradient
# summed into it) or hand a node None for a gradient, without a word. So
# each result the engine keeps is checked, in both cores, before it is
# stored: where ``backend_of`` finds no backend for it, a TypeError (the
# result is of the wrong type) names where it was going (the InputBuffer
# slot, the variable's ``.grad``; validate_outputs' errors name the node
# and the gradient's index), the backend (its ``name`` and class), the
# method and what it returned. Nothing is stored then: the slot and
# ``.grad`` still hold what they held before the sum (what an in-place
# ``add_`` did to its first argument before it returned is the backend's
# doing). The numpy fast paths, where the engine sums numpy arrays itself
# (with numpy's operators, in C in the compiled core), call no backend and
# check nothing.


def no_backend_to_copy(value, holder):
    """The TypeError for a gradient that no registered backend copies, on
    its way into ``holder`` (a ``.grad``): validate_outputs found its
    backend, and Python code the engine ran since (a backend's method, a
    hook) unregistered it."""
    return TypeError(f"the gradient for {holder} is a {type(value).__name__}, which no "
                     "registered backend copies: expected a value of a registered backend "
                     "(see pyengine.register_backend)")


def check_same_device(holder, value, other):
    """Before a sum of ``value`` and ``other`` (of two array types) into
    ``holder``, or after one failed: a RuntimeError where the two are on
    different devices (a slot without metadata checks no device before
    the sum); else nothing."""
    backend, other_backend = backend_of(value), backend_of(other)
    if backend is None or other_backend is None:
        return
    device, other_device = backend.device(value), other_backend.device(other)
    if device != other_device:
        raise RuntimeError(f"{holder}: gradients on two devices ({device} and {other_device}) "
                           "cannot be summed; give the slot metadata (its device) so that "
                           "each gradient is checked, or send them from one device")


def _find_backend(value_type):
    """The backend registered for ``value_type`` or its nearest base, or None."""
    for base in value_type.__mro__:
        if base in _backends:
            return _backends[base]
    return None


NUMPY = NumpyBackend()
register_backend(np.ndarray, NUMPY)
register_backend(np.generic, NUMPY)

# Last: indexed.py builds on the classes above.
from .indexed import IndexedBackend, IndexedGradient  # noqa: E402

register_backend(IndexedGradient, IndexedBackend())
