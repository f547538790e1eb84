"""The engine's per-node shortcuts keep what a node sees.

See Note [The next task skips the queue], Note [A held task takes over its
maker's count] and Note [Reusing a task's gradients list] in
``pyengine/_pure/engine.py``. Oracles: analytic
gradients of chains whose nodes double their gradient; the lists a node
kept, which must still hold what that node received after the backward
(a reused list would have been overwritten); the order nodes ran in,
against the ready queue's order (higher sequence_nr first). The suite runs
on both cores.
"""

import numpy as np
import pytest

import pyengine
from pyengine import Edge, InputMetadata, Node

SHAPE = (3,)


class Leaf:
    def __init__(self):
        self.data = np.zeros(SHAPE)
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


class Keep(Node):
    """Keeps the list it ran on and passes on twice its gradient, in a new list."""

    def apply(self, grads):
        self.kept = grads
        return [grads[0] * 2]


class Same(Node):
    """Returns the very list it ran on (as the bench's Pass does)."""

    def apply(self, grads):
        return grads


def chain(node_class, length):
    leaf = Leaf()
    edge = pyengine.gradient_edge(leaf)
    nodes = []
    for _ in range(length):
        node = node_class(next_edges=(edge,), input_metadata=(InputMetadata(SHAPE, np.float64),))
        nodes.append(node)
        edge = Edge(node, 0)
    return leaf, edge, nodes


def test_a_kept_gradients_list_still_holds_what_the_node_received():
    length = 40
    leaf, root_edge, nodes = chain(Keep, length)
    pyengine.get_default_engine().execute([root_edge], [np.ones(SHAPE)], True, False, True)
    np.testing.assert_array_equal(leaf.grad, np.full(SHAPE, 2.0 ** length))
    # nodes[-1] ran first, on the root gradient; each node below got twice its parent's.
    for depth, node in enumerate(reversed(nodes)):
        assert type(node.kept) is list and len(node.kept) == 1
        np.testing.assert_array_equal(node.kept[0], np.full(SHAPE, 2.0 ** depth))
    assert len({id(node.kept) for node in nodes}) == length


@pytest.mark.parametrize("runs", [1, 3])
def test_a_node_returning_its_own_list(runs):
    leaf, root_edge, _ = chain(Same, 25)
    for _ in range(runs):
        pyengine.get_default_engine().execute([root_edge], [np.full(SHAPE, 3.0)], True, False, True)
    np.testing.assert_array_equal(leaf.grad, np.full(SHAPE, 3.0 * runs))


def test_lists_a_hook_keeps_are_not_reused():
    # A tensor pre-hook sees the node's list before apply; it keeps it.
    leaf, root_edge, nodes = chain(Same, 10)
    seen = []
    for node in nodes:
        node.register_prehook(lambda grads, seen=seen: seen.append(grads))
    pyengine.get_default_engine().execute([root_edge], [np.full(SHAPE, 5.0)], True, False, True)
    assert len(seen) == 10 and len({id(grads) for grads in seen}) == 10
    for grads in seen:
        np.testing.assert_array_equal(grads[0], np.full(SHAPE, 5.0))


def test_a_slot_refilled_while_the_slots_are_cleared_is_never_handed_on():
    # Clearing a list's slots drops its gradients, and a __del__ may reach
    # the list (here through gc.get_referrers) and fill a slot already
    # cleared, then let the list go. Such a list must not be reused: the
    # nodes after ``mid`` get None in the slots no edge feeds.
    import gc

    marker = object()
    seen = {}

    class Refills:
        def __del__(self):
            for referrer in gc.get_referrers(marker):
                if type(referrer) is list and len(referrer) == 2 and referrer[1] is marker:
                    referrer[0] = "stale"

    class TwoSlots(Node):
        def __init__(self, name, next_edges=()):
            super().__init__(next_edges=next_edges,
                             input_metadata=[InputMetadata(SHAPE, np.float64)] * 2)
            self.label = name

        def apply(self, grads):
            seen[self.label] = [None if g is None else g if isinstance(g, str) else g.tolist()
                                for g in grads]
            if self.label == "mid":
                gradient = grads[0]
                grads[0], grads[1] = Refills(), marker
                return [gradient * 2]
            return [grads[1] * 3] * len(self.next_edges)

    sink = TwoSlots("sink")
    after = TwoSlots("after", [Edge(sink, 1)])
    mid = TwoSlots("mid", [Edge(after, 1)])
    # mid runs on a list the engine made (the root's is its InputBuffer's).
    root = Same(next_edges=[Edge(mid, 0)], input_metadata=[InputMetadata(SHAPE, np.float64)])
    pyengine.get_default_engine().execute([Edge(root, 0)], [np.ones(SHAPE)], False, False, True)
    assert seen == {"mid": [[1.0] * 3, None], "after": [None, [2.0] * 3],
                    "sink": [None, [6.0] * 3]}


class Log(Node):
    """Passes its gradient to every next edge and logs its name."""

    def __init__(self, label, log, next_edges=()):
        super().__init__(next_edges=next_edges, input_metadata=(InputMetadata(SHAPE, np.float64),))
        self.label = label
        self.log = log

    def apply(self, grads):
        self.log.append(self.label)
        return [grads[0]] * len(self.next_edges)


def test_several_ready_children_run_in_sequence_nr_order():
    # a, b, c become ready at once when root runs; the last one made (the
    # highest sequence_nr) runs first whatever the order of root's edges, and
    # a child made ready later (d, below c) still runs before the older ones.
    log = []
    a = Log("a", log)
    b = Log("b", log)
    d = Log("d", log)
    c = Log("c", log, next_edges=(Edge(d, 0),))
    root = Log("root", log, next_edges=(Edge(c, 0), Edge(a, 0), Edge(b, 0)))
    pyengine.get_default_engine().execute([Edge(root, 0)], [np.ones(SHAPE)], False, False, True)
    # Sequence numbers: a < b < d < c < root. d was made before c but only
    # becomes ready when c has run; it then outranks a and b.
    assert log == ["root", "c", "d", "b", "a"]


class Rewire(Node):
    """Gives ``target`` one more next edge, into ``extra``, then passes its gradient on."""

    def __init__(self, target, extra, next_edges):
        super().__init__(next_edges=next_edges, input_metadata=(InputMetadata(SHAPE, np.float64),))
        self.target = target
        self.extra = extra

    def apply(self, grads):
        self.target.next_edges = tuple(self.target.next_edges) + (Edge(self.extra, 0),)
        return [grads[0]]


def test_an_error_after_a_child_was_held_leaves_nothing_behind():
    # root -> b -> c -> leaf. While root runs it gives b an edge into x,
    # which compute_dependencies never counted: b makes c ready (the task
    # held back for the next pop), then fails on x ("dependency not found",
    # as in PyTorch). c must never run, and nothing may keep it afterwards.
    import gc
    import weakref

    log = []
    leaf = Leaf()
    c = Log("c", log, next_edges=(pyengine.gradient_edge(leaf),))
    x = Log("x", log)
    b = Log("b", log, next_edges=(Edge(c, 0),))
    root = Rewire(b, x, next_edges=(Edge(b, 0),))
    with pytest.raises(RuntimeError, match="dependency not found for"):
        pyengine.get_default_engine().execute([Edge(root, 0)], [np.ones(SHAPE)], False, False,
                                              True)
    assert log == ["b"] and leaf.grad is None
    c_alive = weakref.ref(c)
    del c, b, root
    gc.collect()
    assert c_alive() is None, "a task of the failed backward still holds its node"
    # Another backward on this thread runs as usual, and still not c.
    other_leaf, other_edge, _ = chain(Same, 3)
    pyengine.get_default_engine().execute([other_edge], [np.ones(SHAPE)], False, False, True)
    np.testing.assert_array_equal(other_leaf.grad, np.ones(SHAPE))
    assert log == ["b"]


class NestsABackward(np.ndarray):
    """A gradient whose first sum runs a whole backward (on ``nested``, a
    chain's root edge) before it adds: Python code in the middle of a
    node's routing."""

    nested = None

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        nested, NestsABackward.nested = NestsABackward.nested, None
        if nested is not None:
            root_edge, leaf = nested
            pyengine.get_default_engine().execute([root_edge], [np.full(SHAPE, 7.0)], False, False,
                                                  True)
            np.testing.assert_array_equal(leaf.grad, np.full(SHAPE, 7.0))
        plain = [np.asarray(value) if isinstance(value, NestsABackward) else value
                 for value in inputs]
        return getattr(ufunc, method)(*plain, **kwargs)


class Nesting(Log):
    """Passes on its gradient as a NestsABackward."""

    def apply(self, grads):
        self.log.append(self.label)
        return [grads[0].view(NestsABackward)]


def test_a_held_child_is_counted_when_a_nested_backward_pushes_it():
    # top -> (p, r); p -> b; r -> (a, b); a and b -> leaves. p (made after r,
    # so run first) leaves a NestsABackward in b's buffer. r then makes a
    # ready (held back, not counted yet: See Note [A held task takes over
    # its maker's count]) and adds into b's buffer, which runs a backward
    # on another chain in the middle of r's routing. That backward's root
    # push pushes the held a, which must be counted then: else b, the task
    # r's count passes to, would complete the graph task with a still
    # queued, and a's leaf would get nothing.
    log = []
    leaf_a, leaf_b = Leaf(), Leaf()
    a = Log("a", log, next_edges=(pyengine.gradient_edge(leaf_a),))
    b = Log("b", log, next_edges=(pyengine.gradient_edge(leaf_b),))
    r = Log("r", log, next_edges=(Edge(a, 0), Edge(b, 0)))
    p = Nesting("p", log, next_edges=(Edge(b, 0),))
    top = Log("top", log, next_edges=(Edge(p, 0), Edge(r, 0)))
    nested_leaf, nested_edge, _ = chain(Same, 5)
    NestsABackward.nested = (nested_edge, nested_leaf)
    pyengine.get_default_engine().execute([Edge(top, 0)], [np.ones(SHAPE)], False, False, True)
    assert NestsABackward.nested is None, "the nested backward did not run"
    assert sorted(log) == ["a", "b", "p", "r", "top"]
    np.testing.assert_array_equal(leaf_a.grad, np.ones(SHAPE))
    np.testing.assert_array_equal(leaf_b.grad, np.full(SHAPE, 2.0))
