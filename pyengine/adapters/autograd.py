"""pyengine as the backward engine of HIPS autograd (``autograd`` 1.9.1).

    from pyengine.adapters import autograd as pyengine_autograd
    pyengine_autograd.install()   # autograd.grad & co. now run backward on pyengine

``install()`` replaces ``autograd.core.backward_pass``, the one function that
runs reverse mode for ``make_vjp`` and so for ``grad``,
``elementwise_grad``, ``jacobian``, ``hessian``, ``value_and_grad``,
``checkpoint``, ``fixed_point``, ``odeint`` and the rest; ``uninstall()``
puts the very same function back; ``installed()`` is the context manager.
Installing twice is harmless.

autograd keeps no backward graph apart from its values: each ``VJPNode``
records its ``parents`` (the nodes of the boxed arguments) and a ``vjp``
closure that maps the node's gradient to one gradient per parent. That is
an owner graph in returns mode (See Note [Owner graphs] in
``pyengine/_pure/owner_graph.py``), so the replacement runs
``pyengine.OwnerGraph("parents", ..., mode="returns")`` from the end node:
no pyengine Node per op, nothing added to autograd's classes, and the
traversal is pyengine's iterative one. The graph's only leaf is the start
node of the trace; its gradient is what ``backward_pass`` returns.

Gradients are autograd's values: numpy arrays and scalars, Python floats
and complex numbers, tuples, lists, dicts and namedtuples of them,
``SparseObject`` s (from indexing), and ``Box`` es of an outer trace under
higher-order derivatives. While installed, the adapter registers a value
backend (:class:`AutogradBackend`) for ``Box``, ``SparseObject`` and every
other non-numpy type in autograd's ``VSpace.mappings`` (types registered
later are picked up at the next backward), and wraps numpy's backend in
:class:`AutogradNumpyBackend`, which is numpy's for numpy gradients and
autograd's for a Box or a sparse gradient added to an array. ``uninstall()``
puts every previous backend back (``pyengine.unregister_backend``).

Where pyengine and autograd differ, autograd's semantics are kept:

- Gradients are summed as ``add_outgrads`` sums them: the first gradient
  reaching a node is kept as it is; the second is added out of place with
  ``vspace(g).add``; later ones in place with ``vspace(g).mut_add`` into
  that sum (the InputBuffer's ownership rule is the same). A sparse
  gradient is added with ``sparse_add`` (into a fresh dense array when it
  comes first), so every vjp and the result see dense values, as in
  autograd. Under higher-order derivatives these additions are autograd
  primitives, so they are recorded on the outer trace.
- No shape, dtype or count is checked or fixed: autograd gives no metadata
  and checks nothing (a ``vjp`` returning the wrong shape is passed on as
  autograd would pass it). pyengine does check that a vjp returns one
  gradient per parent (autograd's ``zip`` would silently drop extra ones).
- The leaf's gradient is returned as the sum, not written anywhere.

What differs from native autograd, by design of the engine:

- The order: nodes run in the reverse of the owner graph's depth-first
  post-order, autograd's in the order of its ``toposort``. Both run a node
  only once every consumer has run, so every gradient is the same sum;
  where three or more gradients meet at a node they are added in another
  order, so float results may differ from autograd's in the last bits.
- A node no gradient reached (every consumer's vjp gave None) does not run,
  and None flows on; autograd would call its vjp with None (which most
  vjps reject). A sparse gradient passed by a caller straight into
  ``vjp(g)`` is made dense before the end node's vjp sees it (autograd
  would pass the SparseObject itself, which most vjps reject).
- While installed, numpy arrays' backend is :class:`AutogradNumpyBackend`
  for every user of pyengine in the process: it is numpy's own for two
  numpy arrays, so it keeps the numpy fast paths of both cores on
  (``numpy_fast_paths``: See Note [Replacing the numpy backend] in
  ``pyengine/backends.py``) where the backend it wraps is the built-in
  one, and only sums with a Box or a sparse gradient go through it; tuples,
  lists, dicts, floats and complex numbers are accepted as gradient values
  (with autograd's addition) instead of being refused. The owner-graph
  protocol sums with the backend of the gradient already in a slot, and a
  numpy array there cannot take a Box in place or a SparseObject at all:
  that is why numpy's backend is wrapped rather than left alone.

Each backward is one owner-graph run on the calling thread: vjps that run
a backward of their own (``checkpoint``, ``fixed_point``, ``odeint``) run
it reentrantly, one graph task deeper, as a PyTorch node would.
"""

from __future__ import annotations

import os
import threading

import numpy as np

try:
    import autograd.core as _autograd_core
    import autograd.numpy  # noqa: F401  (registers numpy's vspaces and ArrayBox)
    from autograd.core import SparseObject, sparse_add, sparse_object_types, vspace
    from autograd.tracer import Box, getval
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("pyengine.adapters.autograd needs autograd: pip install autograd") from error

import pyengine
from pyengine.adapters import Patches, installed_while
from pyengine.backends import NUMPY, ArrayBackend, NumpyBackend, backend_of
from pyengine.device import CPU

__all__ = ["install", "uninstall", "is_installed", "installed", "backward_pass",
           "AutogradBackend", "AutogradNumpyBackend"]


# -- summing autograd's values --------------------------------------------------------------

def _add(a, b):
    """``add_outgrads((a, False), b)``: ``b`` added to a gradient the engine
    does not own, out of place."""
    if type(a) in sparse_object_types:
        # autograd makes the first gradient dense when it is sparse.
        return _mut_add(sparse_add(vspace(a), None, a), b)
    vs = vspace(b)
    if type(b) in sparse_object_types:
        return sparse_add(vs, vs.mut_add(None, a), b)
    return vs.add(a, b)


def _mut_add(a, b):
    """``add_outgrads((a, True), b)``: ``b`` added into a sum the engine
    made (never sparse), in place where the value type allows."""
    vs = vspace(b)
    if type(b) in sparse_object_types:
        return sparse_add(vs, a, b)
    return vs.mut_add(a, b)


def _dense(gradient):
    """A gradient as autograd hands it to a vjp: a sparse one made dense."""
    if type(gradient) in sparse_object_types:
        return sparse_add(vspace(gradient), None, gradient)
    return gradient


def _has_nan(value):
    value = getval(value)
    if type(value) in sparse_object_types:
        value = _dense(value)
    if isinstance(value, (tuple, list)):
        return any(_has_nan(item) for item in value)
    if isinstance(value, dict):
        return any(_has_nan(item) for item in value.values())
    return bool(np.isnan(getval(value)).any())


class AutogradBackend(ArrayBackend):
    """The value backend of autograd's non-numpy gradients while the
    adapter is installed: Boxes, SparseObjects, Python scalars and
    containers. It sums with autograd's vector spaces (See the module
    docstring) and lives on the CPU. autograd gives the engine no metadata,
    so nothing asks it to reshape, cast or move a value."""

    name = "autograd"

    def device(self, value):
        return CPU

    def dtype_kind(self, dtype):
        return np.dtype(dtype).kind

    def shape(self, value):
        return np.shape(getval(value))

    def dtype(self, value):
        return np.result_type(getval(value))

    def add(self, a, b):
        return _add(a, b)

    def add_(self, a, b):
        return _mut_add(a, b)

    def ones_like(self, value):
        return vspace(value).ones()

    def has_nan(self, value):
        return _has_nan(value)

    def _unsupported(self, what):
        raise NotImplementedError(f"the autograd adapter's values cannot be {what}: autograd "
                                  "gives the engine no metadata to check them against")

    def sum_to(self, value, shape):
        self._unsupported("reduced to a shape")

    def cast(self, value, dtype):
        self._unsupported("cast")

    def copy(self, value):
        self._unsupported("copied")

    def to_device(self, value, device):
        self._unsupported("moved to a device")

    def zeros(self, shape, dtype, device):
        self._unsupported("made from a shape")


class AutogradNumpyBackend(NumpyBackend):
    """numpy's backend while the adapter is installed: the backend it
    replaced (``previous``) for every numpy sum, autograd's addition where
    a Box (higher-order derivatives) or a sparse gradient is added to a
    numpy array, which numpy itself cannot do in place (a Box refuses
    ``out=``) or at all (a SparseObject)."""

    name = "numpy (autograd adapter)"

    def __init__(self, previous):
        self.previous = previous
        # For two numpy arrays this is previous's: the fast paths of both
        # cores may stay on where previous is the built-in backend.
        self.numpy_fast_paths = previous is NUMPY or previous.numpy_fast_paths is True

    def add(self, a, b):
        if isinstance(b, _AUTOGRAD_VALUES):
            return _add(a, b)
        return self.previous.add(a, b)

    def add_(self, a, b):
        if isinstance(b, _AUTOGRAD_VALUES):
            return _mut_add(a, b)
        return self.previous.add_(a, b)


_AUTOGRAD_VALUES = (Box, SparseObject)
_NUMPY_TYPES = (np.ndarray, np.generic)
_BACKEND = AutogradBackend()


# -- the backward pass ----------------------------------------------------------------------

# Each thread's backward passes under way, innermost last: a one-item list
# each, which the leaf's accumulate fills. A vjp may run a backward pass of
# its own (reentrant), which finishes before its caller's leaf is reached.
_results = threading.local()


def _accumulate(leaf, gradient):
    _results.stack[-1].append(gradient)


# Each node's own vjp is its backward, called from the core as node.vjp(g)
# (unpack_grads: one gradient, no list and no Python function around it);
# dense_gradient makes a sparse gradient dense before a vjp sees it, and the
# core reads the generator some vjps return.
_GRAPH = pyengine.OwnerGraph("parents", "vjp", mode="returns", accumulate=_accumulate,
                             unpack_grads=True, dense_gradient=_dense)


def backward_pass(g, end_node):
    """autograd's ``backward_pass(g, end_node)`` on pyengine (installed as
    ``autograd.core.backward_pass``): the gradient reaching the start node
    of the trace under ``end_node``, given ``g`` at ``end_node``. Called
    while the adapter is not installed, it runs too, but only gradients
    with a backend of their own (numpy's) can be summed."""
    if len(_vspace_types()) != _registered_count[0]:
        _register_vspace_types()
    stack = getattr(_results, "stack", None)
    if stack is None:
        stack = _results.stack = []
    result = []
    depth = len(stack)
    try:
        # Inside the try, and the stack cut back to its depth: Ctrl-C may
        # come out as append returns (See Note [What an adapter sets around
        # a backward] in pyengine/adapters/__init__.py).
        stack.append(result)
        _GRAPH.backward(end_node, g)
    finally:
        del stack[depth:]
    if not result:
        # No gradient reached the start node (every path gave None).
        return None
    gradient = result[-1]
    # autograd returns the end node's g as it is when it is the start node.
    return gradient if not end_node.parents else _dense(gradient)


# -- install --------------------------------------------------------------------------------

def _vspace_types():
    return _autograd_core.VSpace.mappings


_lock = threading.RLock()
# The backends the adapter replaced, value type -> previous (None: none was
# registered for that type itself), and how many vspace types it has seen;
# guarded by _lock. Empty while not installed.
_replaced: dict = {}
_registered_count = [0]


def _reset_lock_after_fork():
    # A backward takes it, for a vspace type met since the last one: See
    # Note [Locks after fork] in pyengine/node.py.
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)


def _register(value_type, backend):
    if value_type not in _replaced:
        _replaced[value_type] = pyengine.register_backend(value_type, backend)


def _register_vspace_types():
    with _lock:
        if not _PATCHES.is_installed():
            return
        types = list(_vspace_types())
        for value_type in types:
            if not issubclass(value_type, _NUMPY_TYPES):
                _register(value_type, _BACKEND)
        _registered_count[0] = len(types)


def _register_backends():
    for value_type, example in ((np.ndarray, np.zeros(0)), (np.generic, np.float64(0.0))):
        _register(value_type, AutogradNumpyBackend(backend_of(example)))
    _register(Box, _BACKEND)
    _register(SparseObject, _BACKEND)
    _register_vspace_types()


def _restore_backends():
    for value_type, previous in _replaced.items():
        current = pyengine.unregister_backend(value_type)
        if current is not _BACKEND and not isinstance(current, AutogradNumpyBackend):
            # Registered over by someone else since: theirs stays.
            pyengine.register_backend(value_type, current)
        elif previous is not None:
            pyengine.register_backend(value_type, previous)
    _replaced.clear()
    _registered_count[0] = 0


def _unsupported():
    return "this autograd version is not supported (pyengine.adapters.autograd needs 1.9)"


_PATCHES = Patches("pyengine.adapters.autograd",
                   ((_autograd_core, "backward_pass", backward_pass),), _unsupported)


def install():
    """Make autograd's reverse mode run on pyengine. Idempotent."""
    with _lock:
        if _PATCHES.is_installed():
            return
        if "backward_pass" not in vars(_autograd_core):
            raise RuntimeError(f"pyengine.adapters.autograd: autograd.core has no backward_pass; "
                               f"{_unsupported()}")
        _PATCHES.install()
        try:
            _register_backends()
        except BaseException:
            _restore_backends()
            _PATCHES.uninstall()
            raise


def uninstall():
    """Put autograd's own ``backward_pass`` and every replaced value backend
    back. Idempotent."""
    with _lock:
        if not _PATCHES.is_installed():
            return
        _PATCHES.uninstall()
        _restore_backends()


def is_installed() -> bool:
    return _PATCHES.is_installed()


def installed():
    """``with installed():`` runs its block with the adapter installed and
    then restores the previous state (it stays installed if it was)."""
    return installed_while(is_installed, install, uninstall)
