"""pyengine as the backward engine of micrograd.

    from pyengine.adapters import micrograd as pyengine_micrograd
    pyengine_micrograd.install()   # Value.backward() now runs on pyengine

``install()`` patches ``micrograd.engine.Value.__init__`` and
``Value.backward``; ``uninstall()`` puts the very same functions back;
``installed()`` is the context manager. Installing twice is harmless.

What this module owns: :class:`ValueNode`, the Node of one non-leaf Value,
made when the Value is made (so ``sequence_nr`` follows the forward order),
with one next edge per distinct non-leaf child, in the order of the
``_children`` tuple; and the patched ``backward``, which runs the root's
node on the default engine.

micrograd's gradients are not values passed from node to node: each Value's
``_backward`` closure adds into its children's ``.grad`` in place, reading
its own ``.grad``. So a ValueNode is a :class:`pyengine.GradientFreeNode`:
the engine passes no gradients at all and does what micrograd's topological
sort is for: a node runs once every consumer of its Value has run, that is,
once its ``.grad`` is complete, and running it calls ``value._backward()``
(looked up then: micrograd assigns the closure after making the Value).
Leaves need no node: only closures write their ``.grad``. The traversal is
pyengine's iterative one, so a graph of any depth works where micrograd's
recursive ``build_topo`` raises RecursionError (about a thousand levels deep
by default).

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
- ``Value`` s made before ``install()`` (and copies made with
  ``copy.deepcopy``, whose nodes copy as None) get their nodes at their
  first backward, or when an operation uses them; their children come from
  ``_prev`` (a set), so for those graphs the order is micrograd's kind, not
  the program's.
- A leaf made while installed gets ``_pyengine_node = None`` (an attribute
  micrograd never reads; See Note [Few objects per operation]).

What it costs: backward is faster than micrograd's (its sort is Python, and
the engine runs a graph of gradient-free nodes in a loop of its own: See
Note [Gradient-free graphs] in ``pyengine/_engine.pyx``), but a forward
operation makes two or three more objects (the node, the Edge into it, and
the tuple of its edges where it has two non-leaf children: See Note [Few
objects per operation]), which the cyclic GC counts and traverses.
micrograd's Values are reference cycles (each closure refers to its Value),
so freeing a graph is the cyclic GC's work, and a training step that makes
a new graph each time spends most of its time there; the extra objects make
that part longer (more full collections, each visiting more objects), and
such a step is slower than micrograd's. ``benchmarks/RESULTS.md`` has the
figures.
"""

from __future__ import annotations

import threading

try:
    import micrograd.engine as _micrograd_engine
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("pyengine.adapters.micrograd needs micrograd: pip install micrograd") from error

import pyengine
from pyengine.adapters import installed_while

from ..node import Edge, GradientFreeNode

__all__ = ["install", "uninstall", "is_installed", "installed", "ValueNode", "node_of"]

Value = _micrograd_engine.Value


class ValueNode(GradientFreeNode):
    """The Node of one non-leaf micrograd Value: running it calls the
    Value's ``_backward`` closure, which adds into its children's ``.grad``;
    no gradient flows along its edges (See Note [Gradient-free nodes]).

    Fields, immutable after construction: ``owner`` (also ``value``), the
    Value, held strongly (the Value holds this node as ``_pyengine_node``: a
    cycle like the one micrograd makes itself, each Value's closure
    referring to the Value); ``method``, ``"_backward"``, looked up when the
    node runs (micrograd assigns the closure after making the Value);
    ``edge``, the Edge into this node, one shared by all its consumers
    (fewer objects for the cyclic GC, which micrograd's graphs keep busy).
    ``edges_to``: None, then ``(edge,)`` once a consumer has this node as
    its only next edge, one tuple shared by all such consumers; written
    once, under the GIL. See Note [Few objects per operation].

    Copied (``copy.deepcopy``) or pickled, a node becomes None: the copy of
    a Value gets a node of its own at its first backward, or when an
    operation uses it.
    """

    __slots__ = ("edge", "edges_to")

    # No __init__: GradientFreeNodeBase's (compiled) takes the Value, the
    # method name and the edges; a Python __init__ here would cost a third
    # of a forward op.

    @property
    def value(self):
        return self.owner

    def name(self) -> str:
        op = self.owner._op
        return f"ValueBackward({op})" if op else "ValueBackward"

    def __reduce__(self):
        # copy, deepcopy and pickle all go through here.
        return _no_node, ()


def _no_node():
    return None


def _make_node(value, edges):
    """Make ``value``'s node, with ``edges`` (a tuple), and return the Edge
    into it."""
    if len(edges) == 1:
        edges = _edges_to(edges[0].node)
    node = ValueNode(value, "_backward", edges)
    edge = node.edge = Edge(node, 0)
    node.edges_to = None
    value._pyengine_node = node
    return edge


def _edges_to(node):
    """``(node.edge,)``, one tuple shared by every consumer whose only next
    edge it is. See Note [Few objects per operation]."""
    edges = node.edges_to
    if edges is None:
        edges = node.edges_to = (node.edge,)
    return edges


def _edge_of(value):
    """The Edge into a non-leaf Value's node, made (with the nodes below it
    that are missing) if it has none."""
    node = getattr(value, "_pyengine_node", None)
    return node.edge if node is not None else _build_nodes(value)


def _build_nodes(value):
    """Nodes for ``value`` and every non-leaf below it that has none (Values
    made before ``install()``), children first; returns the Edge into
    ``value``'s node. Iterative version of::

        def build(v):
            for child in v._prev:
                if child._prev and not has_node(child):
                    build(child)
            make_node(v, edges_to(child for child in v._prev if child._prev))
    """
    stack = [(value, False)]
    while stack:
        current, children_done = stack.pop()
        if getattr(current, "_pyengine_node", None) is not None:
            continue
        # _prev is a set: its order is micrograd's, fixed for this Value.
        children = [child for child in current._prev if child._prev]
        if children_done:
            _make_node(current, tuple(child._pyengine_node.edge for child in children))
            continue
        stack.append((current, True))
        for child in children:
            if getattr(child, "_pyengine_node", None) is None:
                stack.append((child, False))
    return value._pyengine_node.edge


def node_of(value):
    """The ValueNode of a non-leaf Value (made now if it has none), or None
    for a leaf."""
    if not isinstance(value, Value):
        raise TypeError(f"expected a micrograd Value, got {type(value).__name__}")
    if not value._prev:
        return None
    return _edge_of(value).node


# Note [Few objects per operation]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# micrograd's Values are reference cycles, so only the cyclic GC frees a
# graph, and in a training step that builds a new graph each time the GC
# takes most of the time. Each object an operation makes costs it twice:
# CPython (3.11) runs a full collection about every 85,000 allocations of
# tracked objects (11 middle-generation collections, each after 11 young
# ones, each after ~700), and each full collection visits every tracked
# object. micrograd makes about 7 per operation (the Value, its set
# ``_prev``, the closure, its cells and their tuple); the adapter adds as
# few as it can:
#
# - the node, and the Edge into it (one, shared by all consumers);
# - a tuple of next edges only for two distinct non-leaf children. With
#   one (``y.relu()``, ``w * y`` with a leaf ``w``, ``y * y``) the next
#   edges are the child node's ``edges_to``, ``(edge,)``, made by its first
#   such consumer and shared by the others; with none, ``()``;
# - no list: a node made without input metadata shares one empty list (See
#   Note [Shared empty input metadata] in ``pyengine/_pure/node.py``).
#
# On micrograd's MLP(2, [16, 16, 1]) over 20 points (12,860 operations a
# step) that is 124,511 tracked allocations a step instead of 142,171
# (micrograd alone: 91,374), 2.6 objects per operation instead of 4.0.
# The floor is the node and the Edge: the engine needs both. A leaf made
# while installed gets ``_pyengine_node = None``, so that finding a child's
# node is one attribute load (a Value made before install() has no such
# attribute, and a copy's is None: its ``_prev`` tells whether it needs one).


def _value_init(self, data, _children=(), _op=''):
    """micrograd's ``Value.__init__``, then the Value's node if it has
    children: one edge per distinct non-leaf child, in ``_children`` order
    (a leaf's .grad is written by the closure; nothing runs for it). This
    is ``_make_node`` inlined: it runs for every operation of a forward.
    See Note [Few objects per operation]."""
    _original_init(self, data, _children, _op)
    if not _children:
        self._pyengine_node = None  # a leaf: See Note [Few objects per operation]
        return
    first = None  # the node of the first non-leaf child
    edges = None  # the edges, once there are two distinct non-leaf children
    for child in _children:
        try:
            node = child._pyengine_node
        except AttributeError:  # made before install()
            node = None
        if node is None:
            if not child._prev:
                continue  # a leaf
            node = _edge_of(child).node  # made before install(), or a copy
        if first is None:
            first = node
        elif edges is None:
            if node is not first:  # x * x: one edge; the closure adds both terms
                edges = (first.edge, node.edge)
        elif node.edge not in edges:
            edges += (node.edge,)
    if edges is None:
        if first is None:
            edges = ()
        else:
            edges = first.edges_to
            if edges is None:
                edges = first.edges_to = (first.edge,)
    node = ValueNode(self, "_backward", edges)
    node.edge = Edge(node, 0)
    node.edges_to = None
    self._pyengine_node = node


def _value_backward(self):
    """micrograd's ``Value.backward``, run by pyengine (installed by
    ``pyengine.adapters.micrograd``): the same ``.grad`` values, and no
    recursion."""
    if not self._prev:
        self.grad = 1
        return  # a leaf: micrograd runs only its no-op closure
    edge = _edge_of(self)
    self.grad = 1
    # No gradient enters: see the module docstring. keep_graph: micrograd
    # never frees a graph.
    pyengine.get_default_engine().execute([edge], [None], True, False, True)


# Set by install(): micrograd's own __init__, called by ours.
_original_init = Value.__init__

_PATCHES = (("__init__", _value_init), ("backward", _value_backward))

# The attributes install() replaced, as (name, original); None when not
# installed. Guarded by _install_lock.
_originals = None
_install_lock = threading.Lock()


def install():
    """Make micrograd's ``Value.backward`` run on pyengine. Idempotent.
    Values made before ``install()`` work too."""
    global _originals, _original_init
    with _install_lock:
        if _originals is not None:
            return
        for name, _ in _PATCHES:
            if name not in Value.__dict__:
                raise RuntimeError(f"pyengine.adapters.micrograd: micrograd.engine.Value has no {name}; "
                                   "this micrograd version is not supported")
        originals = [(name, Value.__dict__[name]) for name, _ in _PATCHES]
        _original_init = Value.__dict__["__init__"]
        for name, replacement in _PATCHES:
            setattr(Value, name, replacement)
        _originals = originals


def uninstall():
    """Put micrograd's own methods back (the very objects). Idempotent.
    Values made while installed keep their nodes; micrograd ignores them."""
    global _originals
    with _install_lock:
        if _originals is None:
            return
        for name, original in _originals:
            setattr(Value, name, original)
        _originals = None


def is_installed() -> bool:
    return _originals is not None


def installed():
    """``with installed():`` runs its block with the adapter installed and
    then restores the previous state (it stays installed if it was)."""
    return installed_while(is_installed, install, uninstall)
