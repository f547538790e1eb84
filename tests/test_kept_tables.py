"""Counts of many sizes on one thread, back to back, after an error, and
one inside another: each thread keeps the largest tables its dependency
maps gave back and the next count doubles into them (See Note [Tables kept
between backward calls] in ``pyengine/_table_growth.h``), so no count may
see another's slots. A writes-mode owner-graph search keeps its states in
a DependencyMap too, which doubles into the tables the engine's counts
kept (the owner tables, kept the same way, are tested in
``tests/test_owner_graph_protocol.py``).

Oracle: every node of a chain passes its gradient on unchanged, so the
leaf's gradient is the root's (analytic); a count that saw stale slots
would run a node early or never (a wrong sum, or "could not compute
gradients"). A writes-mode owner adds 1 to its gradient, so a chain of n
owners gives its leaf n (analytic); a search that saw stale slots would
skip owners or call one a cycle.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyengine

METADATA = pyengine.InputMetadata((2,), np.float64)


class Leaf:
    """A leaf tensor with the protocol pyengine reads."""

    def __init__(self):
        self.data = np.zeros(2)
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


class Pass(pyengine.Node):
    def __init__(self, next_edges, action=None):
        super().__init__(next_edges, (METADATA,))
        self.action = action

    def apply(self, grads):
        if self.action is not None:
            self.action()
        return grads


def chain(n, top_action=None):
    """n Pass nodes over a new leaf: the root's edge and the leaf."""
    leaf = Leaf()
    edge = pyengine.gradient_edge(leaf)
    for i in range(n):
        edge = pyengine.Edge(Pass((edge,), top_action if i == n - 1 else None), 0)
    return edge, leaf


def backward(n, top_action=None, grad=None):
    root_edge, leaf = chain(n, top_action)
    grad = np.full(2, float(n)) if grad is None else grad
    pyengine.get_default_engine().execute([root_edge], [grad], False, False, True)
    return leaf.grad


def grad_of(n):
    root_edge, leaf = chain(n)
    (captured,) = pyengine.get_default_engine().execute(
        [root_edge], [np.full(2, float(n))], False, False, False,
        outputs=[pyengine.gradient_edge(leaf)])
    return captured


@pytest.mark.parametrize("sizes", [(5_000, 3, 70_000, 5_000, 1, 140_000, 20)])
def test_counts_of_many_sizes_back_to_back(sizes):
    for n in sizes:
        np.testing.assert_array_equal(backward(n), np.full(2, float(n)))
        np.testing.assert_array_equal(grad_of(n), np.full(2, float(n)))


def test_a_count_after_an_error_and_one_inside_another():
    def fail():
        raise ValueError("a node's apply")

    with pytest.raises(ValueError, match="a node's apply"):
        backward(30_000, fail)
    np.testing.assert_array_equal(backward(30_000), np.full(2, 30_000.0))

    inner = []
    outer = backward(3_000, lambda: inner.append(backward(40_000)))
    np.testing.assert_array_equal(outer, np.full(2, 3_000.0))
    np.testing.assert_array_equal(inner[0], np.full(2, 40_000.0))
    np.testing.assert_array_equal(backward(40_000), np.full(2, 40_000.0))


class WritesOwner:
    """A micrograd-like owner: its backward writes its parents' gradients,
    each its own plus 1."""

    def __init__(self, parents=(), action=None):
        self.parents, self.action, self.grad = list(parents), action, None

    def write_grads(self):
        if self.action is not None:
            self.action()
        for parent in self.parents:
            parent.grad = self.grad + 1.0 if parent.grad is None else parent.grad + self.grad + 1.0


WRITES_GRAPH = pyengine.OwnerGraph("parents", "write_grads")


def owner_walk(n, top_action=None):
    """The leaf's gradient after a writes-mode walk of a chain of n owners."""
    leaf = WritesOwner()
    owner = leaf
    for i in range(n):
        owner = WritesOwner([owner], top_action if i == n - 1 else None)
    owner.grad = np.zeros(2)
    WRITES_GRAPH.backward(owner)
    return leaf.grad


def test_owner_walks_and_counts_back_to_back_one_inside_another():
    for n in (140_000, 3, 70_000, 5_000, 1, 40_000):
        np.testing.assert_array_equal(backward(n), np.full(2, float(n)))
        np.testing.assert_array_equal(owner_walk(n), np.full(2, float(n)))

    # A count inside an owner's backward, and a walk inside a node's apply.
    inner = []
    outer = owner_walk(20_000, lambda: inner.append(backward(70_000)))
    np.testing.assert_array_equal(outer, np.full(2, 20_000.0))
    np.testing.assert_array_equal(inner.pop(), np.full(2, 70_000.0))
    outer = backward(20_000, lambda: inner.append(owner_walk(70_000)))
    np.testing.assert_array_equal(outer, np.full(2, 20_000.0))
    np.testing.assert_array_equal(inner.pop(), np.full(2, 70_000.0))

    def fail():
        raise ValueError("an owner's backward")

    with pytest.raises(ValueError, match="an owner's backward"):
        owner_walk(40_000, fail)
    np.testing.assert_array_equal(backward(40_000), np.full(2, 40_000.0))
    np.testing.assert_array_equal(owner_walk(40_000), np.full(2, 40_000.0))
