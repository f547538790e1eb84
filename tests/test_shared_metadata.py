"""Nodes made without input metadata share one empty list (See Note [Shared
empty input metadata] in ``pyengine/_pure/node.py``): giving one node
metadata must not give it to another. Oracle: the shapes the engine hands to
each node (``validate_outputs`` reduces a broadcast gradient only for a slot
with metadata).
"""

from __future__ import annotations

import numpy as np
import pytest

import pyengine
from pyengine import Edge, GradientFreeNode, Node


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
