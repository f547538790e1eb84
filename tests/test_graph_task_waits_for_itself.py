"""A graph task's ``wait()`` from code the task itself runs: refused, not a
hang. See Note [A graph task waits for itself] in
``pyengine/_pure/graph_task.py``.

A node, a hook or a final callback reaches its running graph task
(``get_current_graph_task()``). ``wait()`` there waited forever in both
cores: the task waits for the node or callback that waits for it. So did
``mark_as_completed_and_run_post_processing()`` from a final callback,
which waits for the completion already under way (its own). Each place
is tried on the caller's thread, on a fake device's worker thread, and
under ``grad(inputs=)``.

Oracles: the refusal's words, raised out of the backward as the node's or
callback's own error; a wait on a completed task still returns; the exact
gradients of a good backward on the same graph afterwards (x2 per node on
ones); and an exit within the timeout (each scenario runs in a child
process, for a hang is the failure).
"""

from __future__ import annotations

import textwrap

import pytest
from conftest import run_on_this_core

SCENARIO = textwrap.dedent('''
    import sys
    import numpy as np
    import pyengine
    import pyengine._core as core
    from pyengine import fake_device as fd

    state = core.state_module
    PLACE, API, DEVICE = sys.argv[1], sys.argv[2], sys.argv[3]
    SHAPE = (2,)
    device = pyengine.CPU if DEVICE == "cpu" else fd.device(0)

    class Leaf:
        def __init__(self):
            self.data, self.grad, self.grad_fn = np.zeros(SHAPE), None, None
            self.output_nr, self.requires_grad = 0, True

    def host(value):
        return value.numpy() if isinstance(value, fd.FakeArray) else value

    armed = [True]

    def misuse(what):
        if armed[0]:
            task = state.get_current_graph_task()
            getattr(task, what)()

    class Twice(pyengine.Node):
        def apply(self, grads):
            if PLACE == "apply":
                misuse("wait")
            if PLACE in ("callback_wait", "callback_complete"):
                pyengine.queue_callback(lambda: misuse(
                    "wait" if PLACE == "callback_wait" else
                    "mark_as_completed_and_run_post_processing"))
            return [host(grads[0]) * 2.0]

    x = Leaf()
    node = Twice(next_edges=[pyengine.gradient_edge(x)],
                 input_metadata=[pyengine.InputMetadata(SHAPE, np.float64, device)])
    if PLACE == "pre_hook":
        node.register_prehook(lambda grads: misuse("wait"))
    root_grad = np.ones(SHAPE) if DEVICE == "cpu" else fd.to_fake(np.ones(SHAPE), device)

    def run():
        if API == "backward":
            pyengine.backward([pyengine.Edge(node, 0)], [root_grad], retain_graph=True)
            return x.grad.tolist()
        (grad,) = pyengine.grad([pyengine.Edge(node, 0)], [x], [root_grad], retain_graph=True)
        return grad.tolist()

    try:
        run()
    except RuntimeError as error:
        print("refused:", error)
    else:
        print("ran")
    armed[0] = False
    x.grad = None
    print("then:", run())
''')

REFUSED = ("refused: a graph task cannot wait for itself: this thread runs one of its nodes, "
           "hooks or final callbacks, which the task waits for, so the wait would never end (a "
           "node or final callback called wait() or mark_as_completed_and_run_post_processing() "
           "on the running graph task)")


@pytest.mark.parametrize("device", ["cpu", "fake"])
@pytest.mark.parametrize("api", ["backward", "grad"])
@pytest.mark.parametrize("place", ["apply", "pre_hook", "callback_wait", "callback_complete"])
def test_a_wait_for_the_running_graph_task_is_refused(place, api, device):
    code = f"import sys; sys.argv[1:] = {[place, api, device]!r}\n" + SCENARIO
    lines = run_on_this_core(code, timeout=60)
    assert lines == [REFUSED, "then: [2.0, 2.0]"]


def test_a_wait_for_a_completed_graph_task_returns():
    # The refusal is only where the task waits for this thread: a task kept
    # past its backward waits for nothing, and both calls return at once.
    lines = run_on_this_core(textwrap.dedent('''
        import numpy as np
        import pyengine
        import pyengine._core as core
        from pyengine import Node

        kept = []

        class Keep(Node):
            def apply(self, grads):
                kept.append(core.state_module.get_current_graph_task())
                return [None]

        pyengine.backward([pyengine.Edge(Keep(next_edges=[None]), 0)], [np.ones(2)])
        kept[0].wait()
        kept[0].mark_as_completed_and_run_post_processing()
        print(kept[0].future_completed, kept[0].exception)
    '''), timeout=60)
    assert lines == ["True None"]


def test_a_wait_for_a_running_owner_walk_is_refused():
    # An owner graph's backward method runs inside the walk's graph task.
    lines = run_on_this_core(textwrap.dedent('''
        import numpy as np
        import pyengine
        import pyengine._core as core

        armed = [True]

        class Value:
            def __init__(self, *parents):
                self.parents, self.grad = list(parents), None

            def backward_writes(self):
                if armed[0]:
                    core.state_module.get_current_graph_task().wait()
                for parent in self.parents:
                    parent.grad = (0 if parent.grad is None else parent.grad) + self.grad * 2

        leaf = Value()
        top = Value(leaf)
        top.grad = np.ones(2)
        try:
            pyengine.execute_owner_graph(top, "parents", "backward_writes")
        except RuntimeError as error:
            print("refused:", error)
        armed[0] = False
        leaf.grad = None
        pyengine.execute_owner_graph(top, "parents", "backward_writes")
        print("then:", leaf.grad.tolist())
    '''), timeout=60)
    assert lines == [REFUSED, "then: [2.0, 2.0]"]


NESTED_SCENARIO = textwrap.dedent('''
    import sys
    import numpy as np
    import pyengine
    import pyengine._core as core
    from pyengine import fake_device as fd

    state = core.state_module
    PLACE, WHERE, LEVELS = sys.argv[1], sys.argv[2], int(sys.argv[3])
    SHAPE = (2,)
    if WHERE == "pool":
        # Every nested backward is handed off to a pool thread.
        pyengine.set_default_engine(pyengine.Engine(max_recursion_depth=0))
    outer_device = fd.device(0) if WHERE == "device" else pyengine.CPU

    class Leaf:
        def __init__(self):
            self.data, self.grad, self.grad_fn = np.zeros(SHAPE), None, None
            self.output_nr, self.requires_grad = 0, True

    def host(value):
        return value.numpy() if isinstance(value, fd.FakeArray) else value

    armed = [True]
    outermost = []

    def misuse():
        if armed[0]:
            outermost[0].wait()

    class Inner(pyengine.Node):
        """The innermost backward's node: it waits for the outermost task."""
        def apply(self, grads):
            if PLACE == "apply":
                misuse()
            if PLACE == "callback_wait":
                pyengine.queue_callback(misuse)
            return [grads[0] * 2.0]

    class Nest(pyengine.Node):
        """Runs a backward nested ``level`` deep before it passes twice its
        gradient on."""
        def __init__(self, level, leaf, device=pyengine.CPU):
            super().__init__(next_edges=[pyengine.gradient_edge(leaf)],
                             input_metadata=[pyengine.InputMetadata(SHAPE, np.float64, device)])
            self.level = level

        def apply(self, grads):
            if self.level == LEVELS:
                outermost[:] = [state.get_current_graph_task()]
            leaf = Leaf()
            if self.level > 1:
                nested = Nest(self.level - 1, leaf)
            else:
                nested = Inner(next_edges=[pyengine.gradient_edge(leaf)],
                               input_metadata=[pyengine.InputMetadata(SHAPE, np.float64)])
                if PLACE == "pre_hook":
                    nested.register_prehook(lambda grads: misuse())
            pyengine.backward([pyengine.Edge(nested, 0)], [np.ones(SHAPE)])
            return [host(grads[0]) * 2.0]

    x = Leaf()
    node = Nest(LEVELS, x, outer_device)
    root_grad = np.ones(SHAPE) if WHERE != "device" else fd.to_fake(np.ones(SHAPE), outer_device)

    def run():
        x.grad = None
        pyengine.backward([pyengine.Edge(node, 0)], [root_grad], retain_graph=True)
        return host(x.grad).tolist()

    try:
        run()
    except RuntimeError as error:
        print("refused:", error)
    else:
        print("ran")
    armed[0] = False
    print("then:", run())
    # The link lasts while the nested backward runs only.
    print("kept:", outermost[0].wait() is None)
''')

REFUSED_NESTED = (
    "refused: a graph task cannot wait for itself: this thread runs a backward nested in one of "
    "its nodes or final callbacks, which waits for that backward, so the wait would never end (a "
    "node, hook or final callback of the nested backward called wait() or "
    "mark_as_completed_and_run_post_processing() on an enclosing one)")


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("where", ["inline", "pool", "device"])
@pytest.mark.parametrize("place", ["apply", "pre_hook", "callback_wait"])
def test_a_wait_for_an_enclosing_graph_task_from_a_nested_backward_is_refused(place, where, levels):
    # The outer task waits for its node, which waits for the nested
    # backward, which would wait for the outer task: refused on whichever
    # thread runs the nested backward (this one, a pool thread, a device
    # thread), one or two levels of nesting down.
    code = f"import sys; sys.argv[1:] = {[place, where, str(levels)]!r}\n" + NESTED_SCENARIO
    lines = run_on_this_core(code, timeout=60)
    assert lines == [REFUSED_NESTED, "then: [2.0, 2.0]", "kept: True"]


def test_a_wait_for_an_enclosing_graph_task_from_a_nested_owner_walk_is_refused():
    # An owner graph's walk (the adapters' path) nested in a node: its
    # owners' backward methods run inside the walk's graph task, which the
    # node waits for.
    lines = run_on_this_core(textwrap.dedent('''
        import numpy as np
        import pyengine
        import pyengine._core as core

        state = core.state_module
        armed = [True]
        outer = []

        class Value:
            def __init__(self, *parents):
                self.parents, self.grad = list(parents), None

            def backward_writes(self):
                if armed[0]:
                    outer[0].wait()
                for parent in self.parents:
                    parent.grad = (0 if parent.grad is None else parent.grad) + self.grad * 2

        class Walks(pyengine.Node):
            def apply(self, grads):
                outer[:] = [state.get_current_graph_task()]
                top = Value(Value())
                top.grad = np.ones(2)
                pyengine.execute_owner_graph(top, "parents", "backward_writes")
                return [grads[0] * 2.0]

        class Leaf:
            def __init__(self):
                self.data, self.grad, self.grad_fn = np.zeros(2), None, None
                self.output_nr, self.requires_grad = 0, True

        x = Leaf()
        node = Walks(next_edges=[pyengine.gradient_edge(x)],
                     input_metadata=[pyengine.InputMetadata((2,), np.float64)])
        try:
            pyengine.backward([pyengine.Edge(node, 0)], [np.ones(2)], retain_graph=True)
        except RuntimeError as error:
            print("refused:", error)
        armed[0] = False
        x.grad = None
        pyengine.backward([pyengine.Edge(node, 0)], [np.ones(2)], retain_graph=True)
        print("then:", x.grad.tolist())
    '''), timeout=60)
    assert lines == [REFUSED_NESTED, "then: [2.0, 2.0]"]
