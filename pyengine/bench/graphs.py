"""The engine's benchmark graphs: pass-through Python Nodes, no arithmetic.

Every graph is built outside the timed region and described by a
:class:`Graph`: the root edge and root gradient to hand to
``Engine.execute``, the leaf whose ``.grad`` receives the result, and the
analytic value that ``.grad`` must equal afterwards. Nodes do no arithmetic
(``apply`` returns its input list), so a backward measures the engine: the
ready queue, dependency counting, InputBuffers, ``validate_outputs`` (every
slot carries ``InputMetadata((3,), float64)``, so the shape/dtype check runs
for every gradient) and the call into Python ``apply``.

Graphs:

- :func:`chain`: ``n`` Pass nodes in a line, ending in one leaf
  (``n`` nodes + its AccumulateGrad). Gradient: ones.
- :func:`wide`: a root ``Fan`` (the backward of an n-ary add) with
  ``branches`` next edges, each to a chain of ``depth`` Pass nodes that all
  end at the same leaf, so the leaf's AccumulateGrad has ``branches``
  incoming edges and its InputBuffer sums them. ``1 + branches * depth``
  nodes + AccumulateGrad. Gradient: ``branches * ones``.
- :func:`wide_scaled`: :func:`wide` with depth 10 and ``n // 10`` branches.
- :func:`lattice`: a diamond lattice ``width`` wide and ``depth`` deep: in
  every layer above the first, node ``i`` is the backward of an add of
  nodes ``i`` and ``i + 1`` (mod ``width``) of the layer below, so every
  node has two consumers and sums two gradients; a root ``Fan`` over the
  top layer, the bottom layer's Pass nodes into one leaf.
  ``1 + width * depth`` nodes. Gradient: ``width * 2**(depth - 1) * ones``
  (powers of two: exact in float64 up to a depth of about 1,000).
- :func:`fan_in`: a root ``Fan`` to ``n`` Pass nodes that all feed one
  ``sink`` Pass node above the leaf: the sink's InputBuffer sums ``n``
  gradients and its dependency count is ``n``. ``n + 2`` nodes. Gradient:
  ``n * ones``.
- :func:`single`: one Pass node -> leaf, for the fixed cost of a backward.
- :func:`scalar_chain`: :func:`chain` on 0-d slots (``InputMetadata((),
  float64)``) with an ``np.float64`` root gradient, so that every gradient
  is a numpy scalar: what numpy gives for arithmetic on 0-d arrays, and so
  what a framework of scalar values passes. Gradient: ``np.float64(1.0)``.

Nodes are created in forward order (nearest the leaf first), so sequence
numbers grow towards the root, as a framework's forward would number them.

Both builds work: the graph is built from whichever core ``PYENGINE_PURE``
selected when ``pyengine`` was imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import pyengine

from .workload import size_label

SHAPE = (3,)
DTYPE = np.dtype(np.float64)


class Leaf:
    """A leaf tensor with the tensor protocol pyengine reads."""

    def __init__(self, data):
        self.data = data
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


class Pass(pyengine.Node):
    """Identity backward: one gradient in, the same gradient out."""

    def apply(self, grads):
        return grads


class Fan(pyengine.Node):
    """Backward of an n-ary add: the incoming gradient goes to every input."""

    def __init__(self, next_edges, input_metadata):
        super().__init__(next_edges=next_edges, input_metadata=input_metadata)
        self.fan_out = len(next_edges)

    def apply(self, grads):
        return [grads[0]] * self.fan_out


@dataclass
class Graph:
    """A built benchmark graph. ``nodes`` counts the Python nodes the engine
    runs besides the leaf's AccumulateGrad (the per-node denominator)."""

    name: str
    nodes: int
    root_edge: object
    grad: np.ndarray
    leaf: Leaf
    expected: np.ndarray

    def reset(self) -> None:
        """Forget the gradient of the previous backward (``zero_grad(set_to_none=True)``)."""
        self.leaf.grad = None

    def run(self) -> None:
        """One backward: exactly what the benchmarks time."""
        pyengine.get_default_engine().execute([self.root_edge], [self.grad], False, False, True)

    def check(self) -> None:
        """Raise unless the last backward left the analytic gradient in the leaf."""
        got = self.leaf.grad
        if got is None or not np.array_equal(got, self.expected):
            raise AssertionError(f"{self.name}: leaf.grad is {got!r}, expected {self.expected!r}")

    def run_checked(self) -> None:
        """reset, run, check: once per benchmark, before timing."""
        self.reset()
        self.run()
        self.check()
        self.reset()


def _metadata():
    # One object for the whole graph: validate_outputs reads it, never copies it.
    return pyengine.InputMetadata(SHAPE, DTYPE)


def _leaf_and_edge(metadata):
    leaf = Leaf(np.zeros(SHAPE, DTYPE))
    return leaf, pyengine.gradient_edge(leaf)


def _chain_onto(edge, length, metadata):
    """``length`` Pass nodes above ``edge``; the edge into the topmost one."""
    Edge = pyengine.Edge
    for _ in range(length):
        edge = Edge(Pass(next_edges=(edge,), input_metadata=(metadata,)), 0)
    return edge


def chain(n: int) -> Graph:
    """``n`` Pass nodes in a line, ending in one leaf."""
    if n < 1:
        raise ValueError("a chain needs at least one node")
    metadata = _metadata()
    leaf, leaf_edge = _leaf_and_edge(metadata)
    root_edge = _chain_onto(leaf_edge, n, metadata)
    return Graph(f"chain {size_label(n)}", n, root_edge, np.ones(SHAPE, DTYPE), leaf,
                 np.ones(SHAPE, DTYPE))


def scalar_chain(n: int) -> Graph:
    """``n`` Pass nodes in a line on 0-d slots, ending in one 0-d leaf; the
    root gradient a numpy scalar."""
    if n < 1:
        raise ValueError("a chain needs at least one node")
    metadata = pyengine.InputMetadata((), DTYPE)
    leaf = Leaf(np.zeros((), DTYPE))
    root_edge = _chain_onto(pyengine.gradient_edge(leaf), n, metadata)
    return Graph(f"scalar chain {size_label(n)}", n, root_edge, DTYPE.type(1.0), leaf,
                 DTYPE.type(1.0))


def wide(branches: int = 1000, depth: int = 10) -> Graph:
    """A root fanning out to ``branches`` chains of ``depth`` that share one leaf."""
    if branches < 1 or depth < 1:
        raise ValueError("a wide graph needs at least one branch of depth one")
    metadata = _metadata()
    leaf, leaf_edge = _leaf_and_edge(metadata)
    ends = [_chain_onto(leaf_edge, depth, metadata) for _ in range(branches)]
    root = Fan(next_edges=tuple(ends), input_metadata=(metadata,))
    return Graph(f"wide {branches}x{depth}", 1 + branches * depth, pyengine.Edge(root, 0),
                 np.ones(SHAPE, DTYPE), leaf, np.full(SHAPE, float(branches), DTYPE))


def wide_scaled(n: int, depth: int = 10) -> Graph:
    """:func:`wide` with ``n // depth`` branches of ``depth``: about ``n`` nodes."""
    return wide(max(1, n // depth), depth)


def lattice(width: int, depth: int) -> Graph:
    """A diamond lattice ``width`` x ``depth`` under a root Fan (See the module docstring)."""
    if width < 1 or depth < 1:
        raise ValueError("a lattice needs a width and a depth of at least one")
    if depth > 1000:
        raise ValueError(f"a lattice deeper than 1000 layers overflows its exact gradient: {depth}")
    metadata = _metadata()
    leaf, leaf_edge = _leaf_and_edge(metadata)
    Edge = pyengine.Edge
    layer = [_chain_onto(leaf_edge, 1, metadata) for _ in range(width)]
    for _ in range(depth - 1):
        layer = [Edge(Fan(next_edges=(layer[i], layer[(i + 1) % width]),
                          input_metadata=(metadata,)), 0)
                 for i in range(width)]
    root = Fan(next_edges=tuple(layer), input_metadata=(metadata,))
    expected = np.full(SHAPE, float(width) * 2.0 ** (depth - 1), DTYPE)
    return Graph(f"lattice {width}x{depth}", 1 + width * depth, Edge(root, 0),
                 np.ones(SHAPE, DTYPE), leaf, expected)


def lattice_scaled(n: int) -> Graph:
    """A square :func:`lattice` of about ``n`` nodes."""
    side = max(1, round(n ** 0.5))
    return lattice(side, side)


def fan_in(n: int) -> Graph:
    """``n`` Pass nodes between a root Fan and one sink node (See the module docstring)."""
    if n < 1:
        raise ValueError("a fan-in needs at least one branch")
    metadata = _metadata()
    leaf, leaf_edge = _leaf_and_edge(metadata)
    sink = _chain_onto(leaf_edge, 1, metadata)
    branches = tuple(_chain_onto(sink, 1, metadata) for _ in range(n))
    root = Fan(next_edges=branches, input_metadata=(metadata,))
    return Graph(f"fan-in {size_label(n)}", n + 2, pyengine.Edge(root, 0),
                 np.ones(SHAPE, DTYPE), leaf, np.full(SHAPE, float(n), DTYPE))


def single() -> Graph:
    """One Pass node above one leaf: the fixed cost of a backward."""
    graph = chain(1)
    graph.name = "single"
    return graph


def chain_nodes(graph: Graph) -> list:
    """The Python nodes of a :func:`chain`, root first (its AccumulateGrad
    left out): what the apply floor calls (See ``apply_floor``)."""
    nodes = []
    node = graph.root_edge.node
    while isinstance(node, Pass):
        nodes.append(node)
        node = node.next_edges[0].node
    return nodes


BUILDERS = {"chain": chain, "wide": wide_scaled, "lattice": lattice_scaled, "fan-in": fan_in,
            "single": lambda n: single(), "scalar-chain": scalar_chain}


def build(kind: str, n: int) -> Graph:
    """``kind`` in :data:`BUILDERS`: ``chain``, ``wide`` (``n // 10`` branches of
    depth 10), ``lattice`` (square, about ``n`` nodes), ``fan-in``, ``single``,
    ``scalar-chain``."""
    try:
        builder = BUILDERS[kind]
    except KeyError:
        raise ValueError(f"unknown graph kind {kind!r}; expected one of {sorted(BUILDERS)}") from None
    return builder(n)
