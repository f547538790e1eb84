"""pyengine as the backward engine of micrograd.

    from pyengine.adapters import micrograd as pyengine_micrograd
    pyengine_micrograd.install()   # Value.backward() now runs on pyengine

``install()`` patches ``micrograd.engine.Value.backward``; ``uninstall()``
puts the very same function back; ``installed()`` is the context manager.
Installing twice is harmless.

micrograd's gradients are not values passed from node to node: each Value's
``_backward`` closure adds into its children's ``.grad`` in place, reading
its own ``.grad``, and a Value's children are its ``_prev``. That is an
owner graph (See Note [Owner graphs] in ``pyengine/_pure/owner_graph.py``),
and the patched ``backward`` sets the root's ``.grad`` to 1 and runs it
with one ``pyengine.OwnerGraph("_prev", "_backward")`` in writes mode:
every non-leaf Value's ``_backward`` runs once every Value made from it has
run, that is, once its ``.grad`` is complete. The
traversal is pyengine's iterative one, so a graph of any depth works where
micrograd's recursive ``build_topo`` raises RecursionError (about a
thousand levels deep by default).

Nothing is added to micrograd's forward: no node, no attribute, no patched
``__init__``. The graph is read when backward runs, and the compiled engine
runs it without making an object per Value. That is what makes the swap
free for a training step: micrograd's Values are reference cycles (each
closure refers to its Value), so the cyclic GC frees every graph, and each
object made per Value would make its collections more frequent and longer.
``benchmarks/RESULTS.md`` has the figures.

Where micrograd and PyTorch differ, micrograd's semantics are kept:

- ``Value.backward()`` sets the root's ``.grad`` to 1 and adds into every
  other ``.grad`` without clearing it first, so gradients (non-leaves'
  included, which then flow on) accumulate over calls, as in micrograd.
- The graph is never released: ``backward`` can be called again.
- The closures run in micrograd's own order (the reverse of a depth-first
  post-order over the ``_prev`` sets: See Note [Owner graphs]), so every
  ``.grad`` is bitwise what micrograd computes, sums of many terms
  included. Leaves' closures are not called: micrograd's are no-ops.

``node_of(value)`` and ``edge_of(value)`` translate the graph under a Value
into pyengine nodes (gradient-free nodes, one per non-leaf Value), for
looking at it (``pyengine.graph_to_dot``) or running it with the engine's
hooks; each call makes a new translation.
"""

from __future__ import annotations

try:
    import micrograd.engine as _micrograd_engine
except Exception as error:  # pragma: no cover - depends on the environment
    if isinstance(error, ModuleNotFoundError) and error.name == "micrograd":
        raise ImportError("pyengine.adapters.micrograd needs micrograd: pip install micrograd") from error
    raise ImportError(f"pyengine.adapters.micrograd: micrograd is installed but does not import "
                      f"({type(error).__name__}: {error})") from error

import pyengine
from pyengine.adapters import Patches

__all__ = ["install", "uninstall", "is_installed", "installed", "node_of", "edge_of"]

Value = _micrograd_engine.Value

# The names of micrograd's owner graph: See Note [Owner graphs].
_CHILDREN = "_prev"
_METHOD = "_backward"
_GRAPH = pyengine.OwnerGraph(_CHILDREN, _METHOD)


def _check_value(value):
    if not isinstance(value, Value):
        raise TypeError(f"expected a micrograd Value, got {type(value).__name__}")


def edge_of(value):
    """The Edge into the node of ``value`` in a new translation of the graph
    under it into nodes (``pyengine.GradientFreeNode`` s, whose owners are
    the Values and whose method is ``"_backward"``: See
    ``pyengine.translate_owner_graph``), or None for a leaf."""
    _check_value(value)
    return pyengine.translate_owner_graph(value, _CHILDREN, _METHOD)


def node_of(value):
    """The node of ``value`` in a new translation of the graph under it (See
    ``edge_of``), or None for a leaf."""
    edge = edge_of(value)
    return None if edge is None else edge.node


def _value_backward(self):
    """micrograd's ``Value.backward``, run by pyengine (installed by
    ``pyengine.adapters.micrograd``): the same ``.grad`` values, and no
    recursion."""
    self.grad = 1
    _GRAPH.backward(self)


_PATCHES = Patches("pyengine.adapters.micrograd", ((Value, "backward", _value_backward),),
                   lambda: "this micrograd version is not supported")


def install():
    """Make micrograd's ``Value.backward`` run on pyengine. Idempotent."""
    _PATCHES.install()


def uninstall():
    """Put micrograd's own ``Value.backward`` back (the very object).
    Idempotent."""
    _PATCHES.uninstall()


def is_installed() -> bool:
    return _PATCHES.is_installed()


def installed():
    """``with installed():`` runs its block with the adapter installed and
    then restores the previous state (it stays installed if it was)."""
    return _PATCHES.installed()
