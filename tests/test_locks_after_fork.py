"""A forked child takes every process-wide lock a backward may take, even
one another thread of the parent held at the fork: See Note [Locks after
fork] in pyengine/node.py.

Before, a child whose parent forked while another thread registered a hook
(``HOOK_LISTS_LOCK``) waited for good at its own first registration.

Oracles: the child's own work, done within the deadline (a hook registered
and called once, a leaf's exact gradient); the child's exit status.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import in_a_fork_while_held

import pyengine
from pyengine import node as node_module
from pyengine.bench import graphs

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def hook_and_backward():
    """A tensor hook registered on a new leaf (HOOK_LISTS_LOCK), and a
    backward into it, which makes its LeafState (_leaf_state_lock): True
    where the hook ran once and the gradient is exact."""
    leaf = graphs.Leaf(np.zeros(graphs.SHAPE, graphs.DTYPE))
    seen = []
    pyengine.register_tensor_hook(leaf, lambda grad: seen.append(grad.copy()))
    metadata = pyengine.InputMetadata(graphs.SHAPE, graphs.DTYPE)
    root = graphs.Pass(next_edges=(pyengine.gradient_edge(leaf),), input_metadata=(metadata,))
    pyengine.backward([pyengine.Edge(root, 0)], [np.full(graphs.SHAPE, 2.0)])
    return len(seen) == 1 and bool((leaf.grad == 2.0).all())


@pytest.mark.parametrize("name", ["HOOK_LISTS_LOCK", "_leaf_state_lock"])
def test_a_child_takes_a_lock_another_thread_held_at_the_fork(name):
    assert in_a_fork_while_held(getattr(node_module, name), hook_and_backward) == 0
    # The parent's lock is its own again, and works.
    assert hook_and_backward()
