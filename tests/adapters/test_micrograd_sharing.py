"""What the micrograd adapter shares between nodes to make fewer objects
per forward operation (See Note [Few objects per operation] in
``pyengine/adapters/micrograd.py``), and that sharing changes no result.

- Nodes made without input metadata share one empty list (See Note [Shared
  empty input metadata] in ``pyengine/_pure/node.py``): giving one node
  metadata must not give it to another. Oracle: the shapes the engine hands
  to each node (``validate_outputs`` reduces a broadcast gradient only for
  a slot with metadata). Needs no micrograd; runs on both cores.
- A Value whose only non-leaf child is ``c`` uses the ``(edge,)`` shared by
  ``c``'s consumers. Oracle: micrograd's own ``Value.backward`` on the same
  programs, and the node structure itself.
- How many objects the cyclic GC tracks and counts per forward operation.
"""

from __future__ import annotations

import copy
import gc
import random

import numpy as np
import pytest

import pyengine
from pyengine import Edge, GradientFreeNode, Node

# -- shared empty input metadata (no micrograd needed) -------------------------------------------


class Sink(Node):
    """Records the shape of each gradient it receives; passes nothing on."""

    def __init__(self, log, name):
        super().__init__()
        self.log = log
        self.tag = name

    def apply(self, grads):
        self.log.append((self.tag, tuple(None if g is None else g.shape for g in grads),
                         [None if g is None else g.tolist() for g in grads]))
        return []


class Producer(Node):
    """Hands a (2, 3) array of ones to each next edge."""

    def apply(self, grads):
        return [np.ones((2, 3)) for _ in self.next_edges]


def test_metadata_added_to_one_node_is_not_anothers():
    log = []
    x, y = Sink(log, "x"), Sink(log, "y")
    assert x.input_metadata == () and y.input_metadata == ()
    assert x.add_input_metadata(((3,), np.float64)) == 0
    assert x.num_inputs() == 1 and x.input_metadata[0].shape == (3,)
    assert y.num_inputs() == 0 and y.input_metadata == ()
    later = Sink(log, "later")
    assert later.input_metadata == ()
    # And the other way round: metadata added to y later leaves x as it was.
    assert y.add_input_metadata(None) == 0
    assert y.input_metadata == (None,)
    assert x.add_input_metadata(((3,), np.float64)) == 1
    assert x.num_inputs() == 2 and y.num_inputs() == 1 and later.num_inputs() == 0

    # The engine sees each node's own slots: x's gradient is reduced to its
    # slot's shape (3,) (two rows of ones sum to twos), y's slot has no
    # metadata and takes the (2, 3) gradient as it comes.
    producer = Producer(next_edges=[Edge(x, 0), Edge(y, 0)])
    pyengine.get_default_engine().execute([Edge(producer, 0)], [np.array(1.0)], False, False, True)
    assert sorted(log) == [("x", ((3,), None), [[2.0, 2.0, 2.0], None]),
                           ("y", ((2, 3),), [[[1.0] * 3] * 2])]


@pytest.mark.parametrize("make", [tuple, list, lambda: iter(()), lambda: (m for m in ())],
                         ids=["tuple", "list", "iterator", "generator"])
def test_empty_metadata_of_any_kind_then_added(make):
    others = [Node(), Sink([], "o")]
    node = Node(next_edges=(), input_metadata=make())
    assert node.num_inputs() == 0
    assert node.add_input_metadata(((2,), np.float32)) == 0
    assert node.input_metadata[0].shape == (2,) and node.input_metadata[0].dtype == np.float32
    assert [other.num_inputs() for other in others] == [0, 0]
    assert Node().num_inputs() == 0


def test_gradient_free_nodes_share_no_metadata_either():
    class Owner:
        def run(self):
            pass

    a, b = GradientFreeNode(Owner(), "run"), GradientFreeNode(Owner(), "run")
    a.add_input_metadata(None)
    assert a.num_inputs() == 1 and b.num_inputs() == 0


def test_metadata_given_at_creation_is_the_nodes_own():
    spec = [((4,), np.float64)]
    a, b = Node(input_metadata=spec), Node(input_metadata=spec)
    a.add_input_metadata(None)
    assert a.num_inputs() == 2 and b.num_inputs() == 1
    assert spec == [((4,), np.float64)]  # the caller's list is not the node's


# -- micrograd: shared (edge,) tuples ------------------------------------------------------------

def _micrograd():
    pytest.importorskip("micrograd")
    from micrograd.engine import Value

    from pyengine.adapters import micrograd as adapter

    return Value, adapter


@pytest.fixture
def micrograd():
    Value, adapter = _micrograd()
    yield Value, adapter
    installed = adapter.is_installed()
    adapter.uninstall()
    assert not installed, "the test left the adapter installed"


def fan_out_program(seed):
    """A random program rich in one-non-leaf-child operations (ReLU, powers,
    products and sums with leaves and constants), whose intermediates have
    many consumers, so that many nodes share one ``(edge,)``; a few binary
    operations of two intermediates join the branches. Returns ``(root,
    values)``."""
    from micrograd.engine import Value

    rng = random.Random(seed)
    leaves = [Value(rng.uniform(0.5, 1.5) * rng.choice([-1, 1])) for _ in range(3)]
    values = list(leaves)
    for _ in range(60):
        a = rng.choice(values[-6:]) if rng.random() < 0.7 else rng.choice(values)
        kind = rng.randrange(8)
        if kind == 0:
            out = a.relu()
        elif kind == 1:
            out = a ** 2
        elif kind == 2:
            out = a * rng.choice(leaves)
        elif kind == 3:
            out = rng.uniform(-1, 1) + a
        elif kind == 4:
            out = a * a
        elif kind == 5:
            out = -a
        elif kind == 6:
            out = rng.choice(leaves) + a
        else:
            out = a + rng.choice(values)
        if abs(out.data) > 1e3:
            out = out * 1e-3
        values.append(out)
    root = values[-1]
    for value in rng.sample(values[3:], 10):
        root = root + value
    return root, values


def grads_of(seed, on_pyengine, adapter):
    def program():
        root, values = fan_out_program(seed)
        root.backward()
        return [v.grad for v in values] + [root.grad]

    if not on_pyengine:
        return program()
    with adapter.installed():
        return program()


@pytest.mark.parametrize("seed", range(12))
def test_shared_single_edges_give_micrograds_gradients(micrograd, seed):
    _, adapter = micrograd
    native = grads_of(seed, False, adapter)
    ours = grads_of(seed, True, adapter)
    assert any(g != 0 for g in native)
    # Sums of three or more terms may differ in the last bits (see the
    # adapter's docstring): relative 1e-12.
    assert ours == pytest.approx(native, rel=1e-12, abs=1e-12)


def test_one_non_leaf_child_uses_the_childs_shared_tuple(micrograd):
    Value, adapter = micrograd
    with adapter.installed():
        w, b = Value(2.0), Value(-1.0)
        h = (w * b).relu()  # h's node: one next edge, to w * b's
        consumers = [h * w, b + h, h ** 2, h * h, -h, h.relu()]
        both = h + consumers[0]  # two distinct non-leaf children: a tuple of its own
        leaf_op = w * b  # no non-leaf child: no edges
        h_edge = adapter.edge_of(h)
    assert w._pyengine_edge is None and adapter.node_of(w) is None
    # h's first single consumer put (edge,) in place of its Edge.
    assert h._pyengine_edge == (h_edge,)
    for value in consumers:
        assert adapter.node_of(value).next_edges is h._pyengine_edge
    assert adapter.node_of(both).next_edges == (h_edge, adapter.edge_of(consumers[0]))
    assert adapter.node_of(both).next_edges is not h._pyengine_edge
    assert adapter.node_of(leaf_op).next_edges == ()
    assert leaf_op._pyengine_edge is adapter.edge_of(leaf_op)  # nothing consumed it
    # No input metadata: the shared empty list, seen as no slots.
    assert adapter.node_of(both).input_metadata == ()

    # The gradients, against micrograd's and analytic ones (integers: exact).
    def program():
        w, b = Value(2.0), Value(1.5)
        h = (w * b).relu()
        out = h * w + (b + h) + h ** 2 + h * h + (-h) + h.relu() + h
        out.backward()
        return w.grad, b.grad, h.grad

    native = program()
    with adapter.installed():
        assert program() == native
    # Analytic: out = h w + b + h + 2 h^2 - h + 2 h with h = w b (positive):
    # d/dh = w + 1 + 4h - 1 + 2 = w + 4h + 2 = 2 + 12 + 2 = 16.
    assert native[2] == 16.0
    assert native[0] == pytest.approx(3.0 + 16.0 * 1.5)  # h (direct) + dout/dh * b
    assert native[1] == pytest.approx(1.0 + 16.0 * 2.0)


def test_three_children_made_by_hand(micrograd):
    """A Value made with three children (micrograd's ops make one or two):
    one edge per distinct non-leaf child, in order; a repeated child once."""
    Value, adapter = micrograd

    def program(check_nodes):
        x, y = Value(3.0), Value(-2.0)
        a, b = x * y, x + y
        out = Value(a.data + b.data + a.data, (a, b, a), "sum3")

        def _backward():
            a.grad += 2 * out.grad
            b.grad += out.grad
        out._backward = _backward
        out.backward()
        if check_nodes:
            node = adapter.node_of(out)
            assert node.next_edges == (adapter.edge_of(a), adapter.edge_of(b))
            single = Value(a.data, (x, a, y), "one")
            assert adapter.node_of(single).next_edges is a._pyengine_edge
            assert a._pyengine_edge == (adapter.edge_of(a),)
        return x.grad, y.grad

    native = program(False)
    with adapter.installed():
        assert program(True) == native
    assert native == (2 * -2.0 + 1, 2 * 3.0 + 1)


def test_copies_and_values_made_before_install_as_children(micrograd):
    """A deepcopy of a non-leaf (its nodes copy with it: See Note [Copying a
    GradientFreeNode] in ``pyengine/_pure/node.py``) and a Value made
    before install() (its node is made when an operation uses it) work as
    children."""
    Value, adapter = micrograd

    def program(install_midway):
        x = Value(1.5)
        before = (x * x).relu() + x  # made natively when install_midway
        if install_midway:
            adapter.install()
        try:
            after = before * 2.0 + before.relu()
            after.backward()
            first = (x.grad, before.grad, after.grad)
            # The copy's closures are micrograd's originals: they add into
            # the originals' .grad, reading the originals' .grad.
            copied = copy.deepcopy(after)
            root = copied * 3.0 + 1.0
            root.backward()
            return first, (x.grad, before.grad, after.grad, copied.grad, root.grad)
        finally:
            adapter.uninstall()

    native = program(False)
    assert program(True) == native
    # after = 2 before + relu(before), before = relu(x^2) + x = 3.75 > 0.
    assert native[0] == (12.0, 3.0, 1.0)
    # The copy's .grad was copied (1) and gets 3 more.
    assert native[1] == (66.0, 9.0, 1, 4.0, 1)


def test_an_operation_makes_few_gc_objects(micrograd):
    """The point of the sharing, on micrograd's MLP, against the same
    forward without the adapter: a forward operation adds 2 to 2.75
    GC-tracked objects to micrograd's own (node and Edge, plus a tuple only
    for two non-leaf children; before the sharing it added 4), counted two
    ways: the objects the GC tracks (what each full collection visits), and
    the GC's own allocation counter (what brings the next collection
    closer)."""
    Value, adapter = micrograd
    from micrograd.nn import MLP

    def count(install):
        random.seed(3)
        model = MLP(2, [8, 8, 1])
        points = [[random.uniform(-1, 1), random.uniform(-1, 1)] for _ in range(5)]
        if install:
            adapter.install()
        try:
            sum(model(point) ** 2 for point in points)  # warm up; garbage now
            gc.collect()
            enabled = gc.isenabled()
            gc.disable()
            try:
                allocations = gc.get_count()[0]
                tracked = len(gc.get_objects())
                loss = sum(model(point) ** 2 for point in points)
                allocations = gc.get_count()[0] - allocations
                tracked = len(gc.get_objects()) - tracked
            finally:
                if enabled:
                    gc.enable()
        finally:
            adapter.uninstall()
        operations, stack, seen = 0, [loss], set()
        while stack:
            value = stack.pop()
            if id(value) not in seen:
                seen.add(id(value))
                operations += bool(value._prev)
                stack.extend(value._prev)
        return tracked, allocations, operations

    native_tracked, native_allocations, operations = count(False)
    tracked, allocations, same_operations = count(True)
    assert same_operations == operations > 500
    extra_tracked = (tracked - native_tracked) / operations
    assert 2.0 <= extra_tracked <= 2.75, (tracked, native_tracked, operations)
    extra_allocations = (allocations - native_allocations) / operations
    assert 2.0 <= extra_allocations <= 2.75, (allocations, native_allocations, operations)
