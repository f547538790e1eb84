"""Counts of many sizes on one thread, back to back, after an error, and
one inside another: each thread keeps the largest tables its dependency
maps gave back, a count starts on the largest of them as it was left, in a
later generation of its slots, and doubles into the others (See Notes
[Tables kept between backward calls] in ``pyengine/_table_growth.h`` and
[Generations of a DependencyMap] in ``pyengine/_dependency_map.h``), so no
count may see another's slots, even those of the same nodes counted
before. A writes-mode owner-graph search keeps its states in a
DependencyMap too, which doubles into the tables the engine's counts kept
(the owner tables, kept the same way, are tested in
``tests/test_owner_graph_protocol.py``). What Python cannot reach in
reasonable time (a table through its 2^24 generations, a map released on
another thread) ``tests/dependency_map_check.cpp`` checks on the map
itself.

Oracle: every node of a chain passes its gradient on unchanged, so the
leaf's gradient is the root's (analytic); a count that saw stale slots
would run a node early or never (a wrong sum, or "could not compute
gradients"). A writes-mode owner adds 1 to its gradient, so a chain of n
owners gives its leaf n (analytic); a search that saw stale slots would
skip owners or call one a cycle. The C++ check compares the map's counts
with a std::unordered_map's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig

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


class Fan(pyengine.Node):
    """The backward of an n-ary add: the gradient goes to every next edge."""

    def apply(self, grads):
        return [grads[0]] * len(self.next_edges)


def fan_in(width):
    """A root that fans out to ``width`` Pass nodes, all of whose edges meet
    in one more Pass node (a count of ``width``) above a new leaf: the
    root's edge, the leaf and its edge."""
    leaf = Leaf()
    leaf_edge = pyengine.gradient_edge(leaf)
    meet = pyengine.Edge(Pass((leaf_edge,)), 0)
    branches = tuple(pyengine.Edge(Pass((meet,)), 0) for _ in range(width))
    return pyengine.Edge(Fan(branches, (METADATA,)), 0), leaf, leaf_edge


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


def test_a_retained_graph_counted_again_among_other_counts():
    # The same nodes counted again, on tables whose stale slots hold those
    # very nodes: each count must start from nothing.
    root_edge, leaf, leaf_edge = fan_in(300)
    engine = pyengine.get_default_engine()
    for other in (140_000, 1, 3_000, 0, 70_000):
        if other:
            np.testing.assert_array_equal(backward(other), np.full(2, float(other)))
        (captured,) = engine.execute([root_edge], [np.ones(2)], True, False, False,
                                     outputs=[leaf_edge])
        np.testing.assert_array_equal(captured, np.full(2, 300.0))
        leaf.grad = None
        engine.execute([root_edge], [np.ones(2)], True, False, True)
        np.testing.assert_array_equal(leaf.grad, np.full(2, 300.0))


def test_a_graph_the_count_cannot_vouch_for_after_a_large_count():
    # An edge to a node made later, which has next edges: the count stops
    # and the search counts again (DependencyMap.reset: a new generation on
    # the same table), after a count that left a large table.
    leaf = Leaf()
    leaf_edge = pyengine.gradient_edge(leaf)
    made_first = Pass(())
    made_later = Fan((leaf_edge, leaf_edge, leaf_edge), (METADATA,))
    made_first.next_edges = (pyengine.Edge(made_later, 0),)
    assert made_later._sequence_nr > made_first._sequence_nr
    root_edge = pyengine.Edge(made_first, 0)
    engine = pyengine.get_default_engine()
    for other in (140_000, 20, 0):
        if other:
            np.testing.assert_array_equal(backward(other), np.full(2, float(other)))
        leaf.grad = None
        engine.execute([root_edge], [np.ones(2)], True, False, True)
        np.testing.assert_array_equal(leaf.grad, np.full(2, 3.0))


@pytest.fixture(scope="module")
def dependency_map_check(tmp_path_factory):
    """Build tests/dependency_map_check.cpp against pyengine's header and
    Python's include directory; skips where there is no C++ compiler."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the DependencyMap check")
    here = os.path.dirname(__file__)
    header_dir = os.path.join(here, os.pardir, "pyengine")
    if not os.path.exists(os.path.join(header_dir, "_dependency_map.h")):
        pytest.skip("pyengine's headers are not beside the tests (an installed copy)")
    program = str(tmp_path_factory.mktemp("dependency_map") / "dependency_map_check")
    build = subprocess.run(
        # libstdc++'s assertions: every std::vector index the map makes is
        # bounds-checked (an abort names the place).
        [compiler, "-std=c++17", "-O2", "-D_GLIBCXX_ASSERTIONS", "-pthread", "-I", header_dir,
         "-I", sysconfig.get_paths()["include"], "-o", program,
         os.path.join(here, "dependency_map_check.cpp")],
        capture_output=True, text=True)
    # A compiler that fails on the header is a defect of the header or of
    # the check, not a missing tool: it fails, as a skip would hide it.
    assert build.returncode == 0, f"the DependencyMap check did not build:\n{build.stderr}"
    return program


def test_dependency_map_generations(dependency_map_check):
    result = subprocess.run([dependency_map_check], capture_output=True, text=True,
                            timeout=300)
    assert (result.returncode, result.stdout) == (0, "ok\n"), result.stdout + result.stderr


def test_nodes_counted_again_by_a_nested_backward_before_the_outer_one_runs_them():
    # Each node keeps the index of its slot where the last count put it
    # (Note [A node keeps its slot's index]): a backward nested in a node's
    # apply counts nodes the outer task counted but has yet to run, in a
    # map of another size, and the outer task then looks them up with the
    # nested count's indices. Any index must do: the outer run finds every
    # node (a lookup that trusted a wrong index would miss the count and
    # fail with "dependency not found", or count down another node).
    shared_leaf = Leaf()
    edge = pyengine.gradient_edge(shared_leaf)
    for _ in range(300):
        edge = pyengine.Edge(Pass((edge,)), 0)
    shared_top = edge
    engine = pyengine.get_default_engine()
    nested = []

    def nested_backward():
        engine.execute([shared_top], [np.full(2, 5.0)], True, False, True)
        nested.append(True)

    over_shared = pyengine.Edge(Pass((shared_top,), nested_backward), 0)
    long_edge, long_leaf = chain(50_000)
    root = pyengine.Edge(Fan((over_shared, long_edge), (METADATA,)), 0)
    engine.execute([root], [np.full(2, 2.0)], False, False, True)
    assert nested == [True]
    np.testing.assert_array_equal(shared_leaf.grad, np.full(2, 7.0))
    np.testing.assert_array_equal(long_leaf.grad, np.full(2, 2.0))
