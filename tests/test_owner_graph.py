"""Owner graphs (See Note [Owner graphs] in ``pyengine/_pure/owner_graph.py``):
``pyengine.execute_owner_graph`` and ``pyengine.translate_owner_graph``.

Oracles:

- the order: a recursive depth-first topological sort, written here the way
  micrograd writes its own (``build_topo``), on random graphs whose
  children are sets, tuples, lists or other iterables; the walk (plain,
  reentrant, profiled, in anomaly mode) and its translation run by the
  engine must all call the methods in its reverse order;
- the gradients: a tiny scalar framework in the style of micrograd whose
  closures add into their children's ``.grad``, against analytic
  derivatives.
"""

from __future__ import annotations

import gc
import random
import sys

import numpy as np
import pytest

import pyengine
from pyengine import Edge, GradientFreeNode, Node

# -- a recording owner and the oracle --------------------------------------------------------------


class Owner:
    """A value of an owner graph: ``children`` is its collection, and
    ``backward()`` records that it ran."""

    def __init__(self, tag, children=(), log=None):
        self.tag = tag
        self.children = children
        self.log = log

    def backward(self):
        self.log.append(self.tag)

    def __repr__(self):
        return f"Owner({self.tag})"


def reference_order(root):
    """micrograd's order: the reverse of a recursive depth-first post-order
    over the collections, leaves left out."""
    topo, visited = [], set()

    def build_topo(owner):
        if id(owner) not in visited:
            visited.add(id(owner))
            for child in owner.children:
                build_topo(child)
            topo.append(owner)

    build_topo(root)
    return [owner.tag for owner in reversed(topo) if owner.children]


class ChildrenView:
    """An iterable collection that is no set, tuple or list."""

    def __init__(self, items):
        self.items = list(items)

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)


COLLECTIONS = {"set": set, "tuple": tuple, "list": list, "frozenset": frozenset,
               "view": ChildrenView}


def random_owner_graph(seed, kind, size=60):
    """A random DAG of Owners over a few leaves; returns ``(root, log)``.
    An owner's children are earlier owners, sometimes one twice (a tuple
    or list keeps both)."""
    rng = random.Random(seed)
    log = []
    make = COLLECTIONS[kind]
    owners = [Owner(f"leaf{i}", make(()), log) for i in range(3)]
    for i in range(size):
        picks = [rng.choice(owners[max(0, len(owners) - 8):]) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.4:
            picks.append(rng.choice(owners))
        if rng.random() < 0.2:
            picks.append(picks[0])
        owners.append(Owner(f"v{i}", make(picks), log))
    root = Owner("root", make(rng.sample(owners[3:], k=6) + [owners[-1]]), log)
    return root, log


def run_owner_graph(root):
    pyengine.execute_owner_graph(root, "children", "backward")


def run_translation(root):
    edge = pyengine.translate_owner_graph(root, "children", "backward")
    pyengine.get_default_engine().execute([edge], [None], False, False, True)


@pytest.mark.parametrize("kind", sorted(COLLECTIONS))
@pytest.mark.parametrize("seed", range(8))
def test_methods_run_in_micrograds_order(seed, kind):
    root, log = random_owner_graph(seed, kind)
    expected = reference_order(root)
    assert len(expected) > 30
    run_owner_graph(root)
    assert log == expected
    log.clear()
    run_translation(root)
    assert log == expected


@pytest.mark.parametrize("seed", range(4))
def test_profiled_anomaly_and_reentrant_runs_keep_the_order(seed, no_anomaly_warning):
    """With a profiler, in anomaly mode and inside another backward the walk
    runs in the same order; the profiler gets one event per owner run, whose
    sequence_nr is its place in the post-order."""
    root, log = random_owner_graph(seed, "set")
    expected = reference_order(root)
    with pyengine.profile() as prof:
        run_owner_graph(root)
    assert log == expected
    assert [event.sequence_nr for event in prof.events] == sorted(
        (event.sequence_nr for event in prof.events), reverse=True)
    assert len(prof.events) == len(expected)
    assert {event.name for event in prof.events} == {"Owner"}
    assert len({event.run for event in prof.events}) == 1 and prof.events[0].run >= 0
    assert prof.backward_spans == []  # no call of the engine's execute
    log.clear()
    with pyengine.detect_anomaly():
        run_owner_graph(root)
    assert log == expected
    log.clear()

    class Outer(Node):
        def apply(self, grads):
            run_owner_graph(root)  # reentrant: inside this backward
            return []

    pyengine.get_default_engine().execute([Edge(Outer(), 0)], [np.ones(1)], False, False, True)
    assert log == expected


def test_an_owner_graph_does_not_go_through_the_default_engine():
    """An owner graph runs on the core's walk: an engine swapped in is not
    called, and the order stays micrograd's."""
    root, log = random_owner_graph(0, "set")
    default = pyengine.get_default_engine()
    calls = []

    class ExecuteOnly:
        def execute(self, roots, grads, *args):
            calls.append([type(edge.node) for edge in roots])
            return default.execute(roots, grads, *args)

        def queue_callback(self, callback):
            return default.queue_callback(callback)

    previous = pyengine.set_default_engine(ExecuteOnly())
    try:
        run_owner_graph(root)
    finally:
        pyengine.set_default_engine(previous)
    assert calls == []
    assert log == reference_order(root)


def test_a_leaf_root_runs_nothing():
    log = []
    leaf = Owner("leaf", (), log)
    assert run_owner_graph(leaf) is None
    assert pyengine.translate_owner_graph(leaf, "children", "backward") is None
    assert log == []


# -- gradients: a micrograd-style framework ----------------------------------------------------


class Scalar:
    """Values whose closures add into their children's .grad in place."""

    def __init__(self, data, children=()):
        self.data = data
        self.grad = 0.0
        self._prev = set(children)
        self._backward = lambda: None

    def __add__(self, other):
        out = Scalar(self.data + other.data, (self, other))

        def _backward():
            self.grad += out.grad
            other.grad += out.grad
        out._backward = _backward
        return out

    def __mul__(self, other):
        out = Scalar(self.data * other.data, (self, other))

        def _backward():
            self.grad += other.data * out.grad
            other.grad += self.data * out.grad
        out._backward = _backward
        return out

    def backward(self):
        self.grad = 1.0
        pyengine.execute_owner_graph(self, "_prev", "_backward")


def test_gradients_against_the_analytic_ones():
    a, b = Scalar(1.5), Scalar(-2.0)
    c = a * b
    d = c * c  # one child twice: its set holds it once
    e = d + c * a + a
    e.backward()
    # e = a^2 b^2 + a^2 b + a
    assert a.grad == pytest.approx(2 * 1.5 * 4.0 + 2 * 1.5 * -2.0 + 1)
    assert b.grad == pytest.approx(2 * 2.25 * -2.0 + 2.25)
    assert c.grad == pytest.approx(2 * -3.0 + 1.5)


def test_a_chain_deeper_than_the_recursion_limit():
    x = Scalar(1.0)
    y = x
    depth = 20 * sys.getrecursionlimit()
    one = Scalar(1.0)
    for _ in range(depth):
        y = y * one
    y.backward()
    assert x.grad == 1.0 and one.grad == depth


# -- what the methods see ----------------------------------------------------------------------


def test_methods_run_without_grad_mode_and_can_queue_callbacks():
    log = []
    seen = []

    class Recording(Owner):
        def backward(self):
            seen.append(pyengine.is_grad_enabled())
            pyengine.queue_callback(lambda: log.append(f"callback after {self.tag}"))
            super().backward()

    leaf = Owner("leaf", (), log)
    middle = Recording("middle", (leaf,), log)
    root = Recording("root", [middle, leaf], log)
    run_owner_graph(root)
    assert seen == [False, False]
    assert log == ["root", "middle", "callback after root", "callback after middle"]
    assert pyengine.is_grad_enabled()
    with pytest.raises(RuntimeError, match="only be installed during backward"):
        pyengine.queue_callback(lambda: None)


def test_a_nested_owner_graph_inside_a_method():
    log = []
    inner_leaf = Owner("inner leaf", (), log)
    inner = Owner("inner", (inner_leaf,), log)

    class Nesting(Owner):
        def backward(self):
            super().backward()
            run_owner_graph(inner)

    leaf = Owner("leaf", (), log)
    root = Owner("root", (Nesting("nesting", (leaf,), log),), log)
    run_owner_graph(root)
    assert log == ["root", "nesting", "inner"]


def test_hooks_on_translated_nodes():
    log = []
    leaf = Owner("leaf", (), log)
    middle = Owner("middle", (leaf,), log)
    root = Owner("root", (middle,), log)
    edge = pyengine.translate_owner_graph(root, "children", "backward")
    node = edge.node
    assert type(node) is GradientFreeNode and node.owner is root and node.method == "backward"
    (middle_edge,) = node.next_edges
    assert middle_edge.node.owner is middle and middle_edge.node.next_edges == ()
    assert middle_edge.node.sequence_nr < node.sequence_nr  # children first
    middle_edge.node.register_prehook(lambda grads: log.append("prehook") or None)
    pyengine.get_default_engine().execute([edge], [None], False, False, True)
    assert log == ["root", "prehook", "middle"]
    # Each call makes new nodes.
    assert pyengine.translate_owner_graph(root, "children", "backward").node is not node


def test_distinct_children_by_identity():
    """Owners that compare equal are still different owners."""
    log = []

    class EqualToAll(Owner):
        def __eq__(self, other):
            return True

        __hash__ = object.__hash__

    leaf = Owner("leaf", (), log)
    a, b = EqualToAll("a", (leaf,), log), EqualToAll("b", (leaf,), log)
    root = Owner("root", [a, b, a], log)
    run_owner_graph(root)
    assert log == ["root", "b", "a"]
    edges = pyengine.translate_owner_graph(root, "children", "backward").node.next_edges
    assert [edge.node.owner.tag for edge in edges] == ["a", "b"]


# -- bad input: a clear error, and nothing left behind ---------------------------------------------


def assert_engine_still_works():
    assert pyengine.is_grad_enabled()
    log = []
    root = Owner("root", (Owner("child", (Owner("leaf", ()),), log),), log)
    run_owner_graph(root)
    assert log == ["root", "child"]


def test_a_cycle_is_an_error():
    log = []
    a = Owner("a", [], log)
    b = Owner("b", (a,), log)
    a.children.append(b)
    root = Owner("root", (a,), log)
    with pytest.raises(RuntimeError, match="owner graph has a cycle: a Owner is among its own "
                                           "descendants through 'children'"):
        run_owner_graph(root)
    with pytest.raises(RuntimeError, match="cycle"):
        pyengine.translate_owner_graph(root, "children", "backward")
    assert log == []
    assert_engine_still_works()


def test_an_error_in_a_method_stops_the_backward():
    log = []

    class Failing(Owner):
        def backward(self):
            pyengine.set_grad_enabled(True)  # left on: the engine restores the mode
            raise ArithmeticError(f"{self.tag} failed")

    leaf = Owner("leaf", (), log)
    below = Owner("below", (leaf,), log)
    root = Owner("root", (Failing("failing", (below,), log),), log)
    for run in (run_owner_graph, run_translation):
        log.clear()
        with pytest.raises(ArithmeticError, match="failing failed"):
            run(root)
        assert log == ["root"]
        assert_engine_still_works()


@pytest.mark.parametrize("children, method, error, match", [
    (1, "backward", TypeError, r"parents must be a str \(an attribute or method name\) or a "
                               "callable, got int"),
    ("children", None, TypeError, "backward must be a str .* or a callable, got NoneType"),
    ("missing", "backward", AttributeError, "missing"),
])
def test_bad_arguments(children, method, error, match):
    root = Owner("root", (Owner("leaf", ()),), [])
    with pytest.raises(error, match=match):
        pyengine.execute_owner_graph(root, children, method)
    with pytest.raises(error, match=match):
        pyengine.translate_owner_graph(root, children, method)
    assert_engine_still_works()


def test_a_child_without_the_collection():
    log = []
    root = Owner("root", (Owner("child", (3.0,), log),), log)
    with pytest.raises(AttributeError, match="'float' object has no attribute 'children'"):
        run_owner_graph(root)
    assert log == []
    assert_engine_still_works()


def test_a_missing_method():
    log = []
    root = Owner("root", (Owner("child", (Owner("leaf", ()),), log),), log)
    with pytest.raises(AttributeError, match="no attribute 'forward'"):
        pyengine.execute_owner_graph(root, "children", "forward")
    assert_engine_still_works()


def test_the_owners_are_held_while_the_methods_run():
    """A method that drops its children's references does not free owners
    the backward has still to run."""
    log = []
    leaf = Owner("leaf", (), log)
    below = Owner("below", [leaf], log)

    class Dropping(Owner):
        def backward(self):
            super().backward()
            self.children.clear()
            gc.collect()

    root = Owner("root", (Dropping("dropping", [below], log),), log)
    del below
    run_owner_graph(root)
    assert log == ["root", "dropping", "below"]


@pytest.mark.parametrize("input_nr", [-1, 1 << 16, 1 << 64])
def test_a_parent_item_naming_a_slot_no_owner_can_have(input_nr):
    # Writes mode reads no slot, but a slot no owner can have is a mistake
    # in the graph all the same, and both cores say so in the same words.
    log = []
    root = Owner("root", ((Owner("leaf", (), log), input_nr),), log)
    message = f"a parent item of a Owner names slot {input_nr}: a slot is at least 0 and below 65536"
    for run in (run_owner_graph, run_translation):
        with pytest.raises(IndexError, match=message):
            run(root)
    assert log == []
    assert_engine_still_works()
