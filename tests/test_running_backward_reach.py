"""What Python code that a running backward runs can reach, and do to it.

A node's ``apply``, its hooks, a final callback or the profiler reach the
running graph task (``state.get_current_graph_task()``), its ready queue,
its root, the running node and its neighbours, the engine, and, through
``gc``, the InputBuffers the engine fills. Each test below is one thing
such code did that a core got wrong; the sweep at the end calls every
method and writes every field of each of those objects from each place,
on the caller's thread, a reentrant pool thread and a device thread, and
lets the backward go on.

Oracles: the analytic gradients of the small graphs built here, the other
core (the sweep compares both, each in its own interpreter, and a crash is
a finding, not a dead test run), and a good backward after each case.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyengine
import pyengine._core as core
from pyengine import Edge, Node

state = core.state_module


class Leaf:
    def __init__(self):
        self.data = np.ones(3)
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


class During(Node):
    """Passes ``grads[0] * 2`` on, after ``during()`` ran."""

    def __init__(self, next_edges, during):
        super().__init__(next_edges=next_edges, input_metadata=[((3,), np.float64)])
        self.during = during

    def apply(self, grads):
        self.during()
        return [grads[0] * 2] * len(self.next_edges)


def test_exec_info_a_running_node_changes_is_a_copy():
    # The twin gave its live exec_info dict and ExecInfo entries: a node
    # that cleared or filled it pruned every node after it, or captured
    # nothing. Both cores give copies.
    def clear():
        task = state.get_current_graph_task()
        task.exec_info.clear()
        for info in task.exec_info.values():
            info.captures.clear()
            info.captures.append((0, 7))
        found = task.find_exec_info(pyengine.grad_accumulator(a))
        found.captures.clear()
        found.captures.append((0, 7))

    def fill():
        task = state.get_current_graph_task()
        task.exec_info[id(pyengine.grad_accumulator(b))] = core.graph_task_module.ExecInfo()
        assert task.find_exec_info(pyengine.grad_accumulator(b)) is None

    a, b = Leaf(), Leaf()
    node = During([pyengine.gradient_edge(a), pyengine.gradient_edge(b)], clear)
    captured = pyengine.get_default_engine().execute(
        [Edge(node, 0)], [np.ones(3)], False, False, False,
        outputs=[pyengine.gradient_edge(a), pyengine.gradient_edge(b)])
    assert [value.tolist() for value in captured] == [[2.0] * 3, [2.0] * 3]
    node = During([pyengine.gradient_edge(a), pyengine.gradient_edge(b)], fill)
    pyengine.get_default_engine().execute([Edge(node, 0)], [np.ones(3)], False, False, True)
    assert (a.grad.tolist(), b.grad.tolist()) == ([2.0] * 3, [2.0] * 3)


def test_a_deleted_free_field_reads_none_in_both_cores():
    # Deleting a Cython ``public object`` field stores None; the twin's
    # slots were deleted, and the engine's next read of one was an
    # AttributeError in the twin alone (See Note [Fields Python code can
    # write] in pyengine/_pure/node.py).
    a, b = Leaf(), Leaf()
    accumulate = pyengine.grad_accumulator(a)
    pyengine.register_post_accumulate_grad_hook(a, lambda tensor: None)
    seen = {}

    def delete():
        task = state.get_current_graph_task()
        del task.graph_root
        seen["graph_root"] = task.graph_root
        for field in ("accumulator", "tensor_pre_hooks", "post_accumulate_grad_hooks"):
            delattr(accumulate.leaf_state, field)
            seen[field] = getattr(accumulate.leaf_state, field)
        for field in ("_stream", "_saved_values"):
            delattr(accumulate, field)
            seen[field] = getattr(accumulate, field)

    node = During([Edge(accumulate, 0), pyengine.gradient_edge(b)], delete)
    pyengine.get_default_engine().execute([Edge(node, 0)], [np.ones(3)], False, False, True)
    assert seen == dict.fromkeys(seen)
    assert (a.grad.tolist(), b.grad.tolist()) == ([2.0] * 3, [2.0] * 3)

    def delete_variable():
        del accumulate.variable

    node = During([Edge(accumulate, 0)], delete_variable)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'grad'"):
        pyengine.get_default_engine().execute([Edge(node, 0)], [np.ones(3)], False, False, True)
    assert accumulate.variable is None


class Owner:
    def __init__(self, *parents):
        self.parents = list(parents)
        self.grad = None


def test_an_owner_graph_is_initialized_once():
    # A parents reader or a backward that called __init__ again on the
    # graph being walked switched its mode mid-walk: the compiled walk ran
    # owners of a writes-mode search as returns-mode ones, and the twin
    # failed elsewhere, in other words. See Note [An owner graph is
    # initialized once] in pyengine/_pure/owner_graph.py.
    refused = ("TypeError: OwnerGraph.__init__ ran already: it runs once per instance (a second "
               "__init__ would change the mode, readers and hooks that a walk of the graph, "
               "which may be running, reads as it goes)")
    answers = []

    def again(graph, mode):
        try:
            graph.__init__(parents, backward, mode=mode)
        except TypeError as error:
            answers.append(f"TypeError: {error}")

    def parents(owner):
        again(graph, "returns" if graph.mode == "writes" else "writes")
        return owner.parents

    def backward(owner, grads=None):
        again(graph, "returns" if graph.mode == "writes" else "writes")
        return [grads[0] * 3 for _ in owner.parents] if graph.returns else None

    a, b = Owner(), Owner()
    root = Owner(Owner(a, b), a)
    graph = pyengine.OwnerGraph(parents, backward, mode="returns")
    graph.backward(root, np.ones(3))
    assert (a.grad.tolist(), b.grad.tolist()) == ([12.0] * 3, [9.0] * 3)
    graph = pyengine.OwnerGraph(parents, backward, mode="writes")
    graph.backward(root)
    assert graph.mode == "writes" and len(answers) == 12 and set(answers) == {refused}

    # One __init__ that runs another from inside (a gradient policy's
    # __ne__): the inner one is refused, and the outer one's fields stand.
    class Policy(str):
        def __ne__(self, other):
            again(graph, "writes")
            return str.__ne__(self, other)

        __hash__ = str.__hash__

    graph = pyengine.OwnerGraph.__new__(pyengine.OwnerGraph)
    graph.__init__(parents, backward, mode="returns", gradient_policy=Policy("reduce"))
    assert graph.returns and answers[-1] == refused and len(answers) == 13
    # A mode that is a str subclass: the compiled field takes a str only.
    with pytest.raises(TypeError, match="^Expected str, got Policy$"):
        pyengine.OwnerGraph(parents, backward, mode=Policy("returns"))
