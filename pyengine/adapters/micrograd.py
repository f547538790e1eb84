"""pyengine as the backward engine of micrograd.

    from pyengine.adapters import micrograd as pyengine_micrograd
    pyengine_micrograd.install()   # Value.backward() now runs on pyengine

``install()`` patches ``micrograd.engine.Value.__init__`` and
``Value.backward``; ``uninstall()`` puts the very same functions back;
``installed()`` is the context manager. Installing twice is harmless.

What this module owns: the node of each non-leaf Value, made when the Value
is made (so ``sequence_nr`` follows the forward order), with one next edge
per distinct non-leaf child, in the order of the ``_children`` tuple; and
the patched ``backward``, which runs the root's node on the default engine.

micrograd's gradients are not values passed from node to node: each Value's
``_backward`` closure adds into its children's ``.grad`` in place, reading
its own ``.grad``. So a Value's node is a gradient-free node (the core's
``GradientFreeNodeBase``, whose owner is the Value and whose method is
``"_backward"``; See Note [GradientFreeNode] in ``pyengine/_pure/node.py``):
the engine passes no gradients at all and does what micrograd's topological
sort is for: a node runs once every consumer of its Value has run, that is,
once its ``.grad`` is complete, and running it calls ``value._backward()``
(looked up then: micrograd assigns the closure after making the Value).
Leaves need no node: only closures write their ``.grad``. The traversal is
pyengine's iterative one, so a graph of any depth works where micrograd's
recursive ``build_topo`` raises RecursionError (about a thousand levels deep
by default).

Each Value made while installed gets one attribute, which micrograd never
reads: ``_pyengine_edge``, None for a leaf, else the Edge into its node, or
the tuple ``(edge,)`` once a consumer shares it (See Note [Few objects per
operation]). ``node_of(value)`` and ``edge_of(value)`` read it.

Where micrograd and PyTorch differ, micrograd's semantics are kept:

- ``Value.backward()`` sets the root's ``.grad`` to 1 and adds into every
  other ``.grad`` without clearing it first, so gradients (non-leaves'
  included, which then flow on) accumulate over calls, as in micrograd.
- The graph is never released: ``backward`` can be called again.
- micrograd orders its closures by a depth-first search over ``_prev``, a
  set, so the order in which three or more gradients are added into one
  ``.grad`` depends on the memory addresses of the Values; pyengine's order
  (dependency counting, then the later Value first) depends only on the
  program. Sums of one or two terms are identical; sums of more may differ
  from micrograd's in the last bits, as micrograd's differ between runs.
- ``Value`` s made before ``install()`` get their nodes at their first
  backward, or when an operation uses them; their children come from
  ``_prev`` (a set), so for those graphs the order is micrograd's kind, not
  the program's.
- ``copy.deepcopy`` of a Value copies its nodes with it (a gradient-free
  node copies as a new node of the copied owner, with the copied edges).

What it costs: backward is faster than micrograd's (its sort is Python, and
the engine runs a graph of gradient-free nodes in a loop of its own: See
Note [GradientFreeNode graphs] in ``pyengine/_engine.pyx``), but a forward
operation makes two or three more objects (the node, the Edge into it, and
the tuple of its edges where it has two non-leaf children: See Note [Few
objects per operation]), which the cyclic GC counts and traverses.
micrograd's Values are reference cycles (each closure refers to its Value),
so freeing a graph is the cyclic GC's work, and a training step that makes
a new graph each time spends most of its time there; the extra objects make
that part longer (more objects to visit in each full collection), and such
a step is slower than micrograd's. ``benchmarks/RESULTS.md`` has the
figures.
"""

from __future__ import annotations

try:
    import micrograd.engine as _micrograd_engine
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("pyengine.adapters.micrograd needs micrograd: pip install micrograd") from error

import pyengine
from pyengine import _core
from pyengine.adapters import Patches

__all__ = ["install", "uninstall", "is_installed", "installed", "node_of", "edge_of"]

Value = _micrograd_engine.Value

# The core's (compiled or pure) node and edge types. A node is exactly a
# GradientFreeNodeBase, not a subclass defined here: See Note [Few objects
# per operation].
_GradientFreeNode = _core.GradientFreeNodeBase
_Edge = _core.Edge


def _edge_in(slot):
    """The Edge a Value's ``_pyengine_edge`` holds: the Edge itself, or the
    one-edge tuple its consumers share. See Note [Few objects per
    operation]."""
    return slot[0] if type(slot) is tuple else slot


def _shared_edges_to(value, slot):
    """``(edge,)`` for the non-leaf ``value`` whose ``_pyengine_edge`` is
    ``slot``: the tuple every consumer whose only next edge it is shares,
    made (and kept on ``value``) by the first of them."""
    if type(slot) is tuple:
        return slot
    edges = value._pyengine_edge = (slot,)
    return edges


def _make_node(value, children):
    """Make the node of ``value``, whose distinct non-leaf children (all
    with nodes) are ``children``, in order; return the Edge into it."""
    if len(children) == 1:
        edges = _shared_edges_to(children[0], children[0]._pyengine_edge)
    else:
        edges = tuple(_edge_in(child._pyengine_edge) for child in children)
    edge = value._pyengine_edge = _Edge(_GradientFreeNode(value, "_backward", edges), 0)
    return edge


def _slot_of(value):
    """A non-leaf Value's ``_pyengine_edge``, made (with the nodes below it
    that are missing) if it has none."""
    slot = getattr(value, "_pyengine_edge", None)
    return slot if slot is not None else _build_nodes(value)


def _build_nodes(value):
    """Nodes for ``value`` and every non-leaf below it that has none (Values
    made before ``install()``), children first; returns the Edge into
    ``value``'s node. Iterative version of::

        def build(v):
            for child in v._prev:
                if child._prev and not has_node(child):
                    build(child)
            make_node(v, [child for child in v._prev if child._prev])
    """
    stack = [(value, False)]
    while stack:
        current, children_done = stack.pop()
        if getattr(current, "_pyengine_edge", None) is not None:
            continue
        # _prev is a set: its order is micrograd's, fixed for this Value.
        children = [child for child in current._prev if child._prev]
        if children_done:
            _make_node(current, children)
            continue
        stack.append((current, True))
        for child in children:
            if getattr(child, "_pyengine_edge", None) is None:
                stack.append((child, False))
    return value._pyengine_edge


def _check_value(value):
    if not isinstance(value, Value):
        raise TypeError(f"expected a micrograd Value, got {type(value).__name__}")


def edge_of(value):
    """The Edge into a non-leaf Value's node (made now if it has none), or
    None for a leaf."""
    _check_value(value)
    if not value._prev:
        return None
    return _edge_in(_slot_of(value))


def node_of(value):
    """The node of a non-leaf Value (made now if it has none; a
    ``GradientFreeNodeBase`` whose owner is the Value), or None for a leaf."""
    edge = edge_of(value)
    return None if edge is None else edge.node


# Note [Few objects per operation]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# micrograd's Values are reference cycles, so only the cyclic GC frees a
# graph, and in a training step that builds a new graph each time the GC
# takes most of the time. Each object an operation makes costs it twice:
# CPython (3.11) runs a full collection about every 85,000 allocations of
# tracked objects that are still alive (11 middle-generation collections,
# each after 11 young ones, each after ~700), and each full collection
# visits every tracked object. micrograd makes about 7 per operation (the
# Value, its set ``_prev``, the closure, its cells and their tuple); the
# adapter adds as few as it can:
#
# - the node, and the Edge into it (one, shared by all consumers). The node
#   is the core's own GradientFreeNodeBase, made and visited by the GC
#   without the costs of a class defined in Python (construction through
#   the type's slots, a ``__dict__``): 5% of a training step's
#   instructions;
# - a tuple of next edges only for two distinct non-leaf children. With
#   one (``y.relu()``, ``w * y`` with a leaf ``w``, ``y * y``) the next
#   edges are ``(edge,)`` for the child's Edge, made by its first such
#   consumer, kept in the child's ``_pyengine_edge`` in place of the Edge,
#   and shared by the others; with none, ``()``;
# - no list: a node made without input metadata shares one empty list (See
#   Note [Shared empty input metadata] in ``pyengine/_pure/node.py``);
# - one attribute on the Value, no more: with micrograd's five, six
#   attributes stay in the object's inline values, where CPython (3.11)
#   makes a seventh materialize a dict, one more tracked object per Value.
#
# The floor is the node and the Edge: the engine needs both. A leaf made
# while installed gets ``_pyengine_edge = None``, so that finding a child's
# Edge is one attribute load (a Value made before install() has no such
# attribute: its ``_prev`` tells whether it needs a node). The figures are
# in ``benchmarks/RESULTS.md``.


def _value_init(self, data, _children=(), _op=''):
    """micrograd's ``Value.__init__``, then the Value's node if it has
    children: one edge per distinct non-leaf child, in ``_children`` order
    (a leaf's .grad is written by the closure; nothing runs for it). This
    is ``_make_node`` inlined: it runs for every operation of a forward.
    See Note [Few objects per operation]."""
    _original_init(self, data, _children, _op)
    if not _children:
        self._pyengine_edge = None  # a leaf: See Note [Few objects per operation]
        return
    first = None  # the first non-leaf child
    first_slot = None  # its _pyengine_edge
    first_edge = None  # the Edge into its node
    edges = None  # the edges, once there are two distinct non-leaf children
    for child in _children:
        try:
            slot = child._pyengine_edge
        except AttributeError:  # made before install()
            slot = None
        if slot is None:
            if not child._prev:
                continue  # a leaf
            slot = _slot_of(child)  # made before install(), or a copy
        # _edge_in(slot), inlined.
        edge = slot[0] if type(slot) is tuple else slot
        if first is None:
            first, first_slot, first_edge = child, slot, edge
        elif edges is None:
            if edge is not first_edge:  # x * x: one edge; the closure adds both terms
                edges = (first_edge, edge)
        elif edge not in edges:
            edges += (edge,)
    if edges is None:
        if first is None:
            edges = ()
        else:
            edges = _shared_edges_to(first, first_slot)
    self._pyengine_edge = _Edge(_GradientFreeNode(self, "_backward", edges), 0)


def _value_backward(self):
    """micrograd's ``Value.backward``, run by pyengine (installed by
    ``pyengine.adapters.micrograd``): the same ``.grad`` values, and no
    recursion."""
    if not self._prev:
        self.grad = 1
        return  # a leaf: micrograd runs only its no-op closure
    edge = _edge_in(_slot_of(self))
    self.grad = 1
    # No gradient enters: see the module docstring. keep_graph: micrograd
    # never frees a graph.
    pyengine.get_default_engine().execute([edge], [None], True, False, True)


# micrograd's own __init__, called by ours; set again by install(), in case
# something replaced it since this module was imported.
_original_init = Value.__init__


def _keep_original_init(originals):
    global _original_init
    _original_init = originals[(Value, "__init__")]


_PATCHES = Patches("pyengine.adapters.micrograd",
                   ((Value, "__init__", _value_init), (Value, "backward", _value_backward)),
                   lambda: "this micrograd version is not supported",
                   on_install=_keep_original_init)


def install():
    """Make micrograd's ``Value.backward`` run on pyengine. Idempotent.
    Values made before ``install()`` work too."""
    _PATCHES.install()


def uninstall():
    """Put micrograd's own methods back (the very objects). Idempotent.
    Values made while installed keep their nodes; micrograd ignores them."""
    _PATCHES.uninstall()


def is_installed() -> bool:
    return _PATCHES.is_installed()


def installed():
    """``with installed():`` runs its block with the adapter installed and
    then restores the previous state (it stays installed if it was)."""
    return _PATCHES.installed()
