"""GraphTask.init_to_execute (the pruning of ``grad(inputs=)`` and
``backward(inputs=)``), and the GraphTask the engine makes for a call.

Oracles:

- ``expected_exec_info``: the rule init_to_execute implements, written
  independently of both cores over a plain graph spec (node k's edges point
  to higher indices, node 0 is the root): an output node gets an entry, with
  a capture per output edge (``grad``) or ``needed`` (``accumulate_grad``);
  the root gets an entry; a node reachable from the root is needed when one
  of its edges leads to a node that is needed or captures, and then gets an
  entry too. Both cores are checked against it, each on its own Nodes.
- the twin is the executable specification: the compiled ``exec_info``
  lists its entries in the same order.
- ``grad`` results against analytic derivatives.
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from minitensor import const, leaf, mul

import pyengine
from pyengine import streams
from pyengine._core import state_module

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

CORES = ("compiled", "pure")


def load_core(name):
    """The node, edge and GraphTask classes of one core; skips where the
    compiled core is not built."""
    if name == "compiled":
        node_module = pytest.importorskip("pyengine._node")
        graph_task_module = pytest.importorskip("pyengine._graph_task")
    else:
        node_module = importlib.import_module("pyengine._pure.node")
        graph_task_module = importlib.import_module("pyengine._pure.graph_task")
    return SimpleNamespace(NodeBase=node_module.NodeBase, Edge=node_module.Edge,
                           GraphTask=graph_task_module.GraphTask)


@pytest.fixture(params=CORES)
def core(request):
    return load_core(request.param)


# -- graph specs -----------------------------------------------------------------------

def build(core, spec):
    """One node per entry of ``spec``; ``spec[k]`` lists node k's next edges as
    ``(target, input_nr)`` with ``target > k``, or None."""
    nodes = [None] * len(spec)
    for k in reversed(range(len(spec))):
        nodes[k] = core.NodeBase(tuple(
            None if edge is None else core.Edge(nodes[edge[0]], edge[1]) for edge in spec[k]))
    return nodes


def run_init_to_execute(core, spec, outputs, accumulate_grad):
    """``exec_info`` as ``[(node index, needed, captures)]`` in the dict's
    order, and ``captured_vars``."""
    nodes = build(core, spec)
    graph_task = core.GraphTask(False, False, 0, None)
    graph_task.init_to_execute(nodes[0], [core.Edge(nodes[k], input_nr) for k, input_nr in outputs],
                               accumulate_grad)
    index = {id(node): k for k, node in enumerate(nodes)}
    for info in graph_task.exec_info.values():
        assert info.should_execute() == (bool(info.needed) or bool(info.captures))
    entries = [(index[key], bool(info.needed), list(info.captures))
               for key, info in graph_task.exec_info.items()]
    return entries, graph_task.captured_vars


def expected_exec_info(spec, outputs, accumulate_grad):
    """``{node index: (needed, captures)}``: see the module docstring."""
    entries = {}
    for output_idx, (k, input_nr) in enumerate(outputs):
        needed, captures = entries.get(k, (False, []))
        if accumulate_grad:
            needed = True
        else:
            captures = captures + [(input_nr, output_idx)]
        entries[k] = (needed, captures)
    entries.setdefault(0, (False, []))

    reachable = {0}
    for k in range(len(spec)):  # targets have higher indices: one pass in order
        if k in reachable:
            reachable.update(edge[0] for edge in spec[k] if edge is not None)

    @functools.cache
    def executes(k):
        needed, captures = entries.get(k, (False, []))
        return needed or bool(captures) or (k in reachable and needed_by_a_child(k))

    def needed_by_a_child(k):
        return any(executes(edge[0]) for edge in spec[k] if edge is not None)

    # Children before parents, so that the recursion stays shallow.
    for k in reversed(range(len(spec))):
        if k in reachable and needed_by_a_child(k):
            entries[k] = (True, entries.get(k, (False, []))[1])
    return entries


def check_against_oracle(core, spec, outputs, accumulate_grad):
    entries, captured_vars = run_init_to_execute(core, spec, outputs, accumulate_grad)
    assert {k: (needed, captures) for k, needed, captures in entries} == expected_exec_info(
        spec, outputs, accumulate_grad)
    assert len(entries) == len({k for k, _, _ in entries})
    assert captured_vars == [None] * len(outputs)
    return entries


# -- named graphs ----------------------------------------------------------------------

DIAMOND = [[(1, 0), (2, 0)], [(3, 0)], [(3, 1)], []]

NAMED = {
    # Both branches lead to the output: everything above it runs.
    "diamond": (DIAMOND, [(3, 0)]),
    # Node 2's branch ends in a leaf that is no output: pruned, no entry.
    "diamond-with-a-dead-branch": ([[(1, 0), (2, 0)], [(3, 0)], [(4, 0)], [], []], [(3, 0)]),
    # Node 2 is no edge's target: nothing is needed for it.
    "unreachable-output": ([[(1, 0)], [], []], [(2, 0)]),
    "output-is-the-root": ([[(1, 0)], []], [(0, 0)]),
    "chain": ([[(1, 0)], [(2, 0)], [(3, 0)], []], [(3, 0)]),
    # Node 1 captures and is needed, for node 2 below it.
    "capture-above-another-capture": ([[(1, 0)], [(2, 0)], []], [(1, 0), (2, 0)]),
    "same-output-twice": (DIAMOND, [(3, 1), (3, 1)]),
    "none-edges": ([[None, (1, 0), None], [None, (2, 0)], []], [(2, 0)]),
    # Node 3 is reached twice; the second time it is already known to run.
    "shared-node-seen-after-it-ran": ([[(1, 0), (2, 0)], [(3, 0)], [(3, 0)], [(4, 0)], []],
                                      [(4, 0)]),
}


@pytest.mark.parametrize("accumulate_grad", [False, True], ids=["grad", "accumulate"])
@pytest.mark.parametrize("name", list(NAMED))
def test_init_to_execute_marks_exactly_the_nodes_on_a_path_to_an_output(core, name,
                                                                      accumulate_grad):
    spec, outputs = NAMED[name]
    check_against_oracle(core, spec, outputs, accumulate_grad)


def test_diamond_runs_every_node_above_the_captured_one(core):
    # The oracle's answer, spelled out for one graph.
    entries, _ = run_init_to_execute(core, DIAMOND, [(3, 0)], False)
    assert sorted(entries) == [(0, True, []), (1, True, []), (2, True, []), (3, False, [(0, 0)])]


def test_unreachable_output_prunes_every_node(core):
    entries, captured_vars = run_init_to_execute(core, [[(1, 0)], [], []], [(2, 0)], False)
    assert sorted(entries) == [(0, False, []), (2, False, [(0, 0)])]
    assert captured_vars == [None]


@st.composite
def graphs(draw):
    """A random DAG spec with outputs anywhere (reachable or not)."""
    size = draw(st.integers(1, 12))
    spec = []
    for k in range(size):
        if k + 1 < size:
            # Mostly edges, many to the next node, so that paths are long.
            target = st.one_of(st.just(k + 1), st.integers(k + 1, size - 1))
            edge = st.tuples(target, st.integers(0, 1))
            spec.append(draw(st.lists(st.one_of(edge, edge, edge, st.none()), max_size=3)))
        else:
            spec.append(draw(st.lists(st.none(), max_size=1)))
    # Often the last node: the one with the longest paths to it.
    output_node = st.one_of(st.just(size - 1), st.integers(0, size - 1))
    outputs = draw(st.lists(st.tuples(output_node, st.integers(0, 1)), min_size=1, max_size=4))
    return spec, outputs, draw(st.booleans())


@SETTINGS
@given(graphs())
def test_init_to_execute_follows_the_rule_on_random_graphs(graph):
    spec, outputs, accumulate_grad = graph
    for name in CORES:
        try:
            core = load_core(name)
        except pytest.skip.Exception:
            continue
        check_against_oracle(core, spec, outputs, accumulate_grad)


def check_same_order_as_the_twin(spec, outputs, accumulate_grad):
    compiled = load_core("compiled")
    assert (run_init_to_execute(compiled, spec, outputs, accumulate_grad)
            == run_init_to_execute(load_core("pure"), spec, outputs, accumulate_grad))


@pytest.mark.parametrize("accumulate_grad", [False, True], ids=["grad", "accumulate"])
@pytest.mark.parametrize("name", list(NAMED))
def test_compiled_exec_info_lists_its_entries_in_the_twins_order(name, accumulate_grad):
    spec, outputs = NAMED[name]
    check_same_order_as_the_twin(spec, outputs, accumulate_grad)


@SETTINGS
@given(graphs())
def test_compiled_exec_info_lists_its_entries_in_the_twins_order_on_random_graphs(graph):
    check_same_order_as_the_twin(*graph)


def test_init_to_execute_walks_a_100k_deep_chain_without_recursion(core):
    # The output is the bottom node: every node above it is needed.
    depth = 100_000
    spec = [[(k + 1, 0)] for k in range(depth)] + [[]]
    entries, _ = run_init_to_execute(core, spec, [(depth, 0)], False)
    assert len(entries) == depth + 1
    assert all(needed for k, needed, _ in entries if k != depth)
    assert entries[0] == (depth, False, [(0, 0)])


def test_exec_info_starts_empty_and_answers_should_execute(core):
    nodes = build(core, [[]])
    graph_task = core.GraphTask(False, False, 0, None)
    assert graph_task.exec_info == {} and graph_task.can_checkpoint()
    graph_task.init_to_execute(nodes[0], [core.Edge(nodes[0], 0)], False)
    (info,) = graph_task.exec_info.values()
    assert (info.needed, info.captures, info.should_execute()) == (False, [(0, 0)], True)
    assert not graph_task.can_checkpoint()


# -- through the public API ------------------------------------------------------------

def test_grad_on_a_10_node_chain_is_the_product_of_its_factors():
    x = leaf([1.0, -2.0])
    y = x
    for factor in (2.0, 3.0, 0.5, -1.0, 4.0, 2.0, 1.5, -2.0, 0.25, 3.0):
        y = mul(y, const(factor))
    # dy/dx = 2 * 3 * 0.5 * -1 * 4 * 2 * 1.5 * -2 * 0.25 * 3 = 54
    (dx,) = pyengine.grad(y, x, np.ones(2))
    np.testing.assert_array_equal(dx, [54.0, 54.0])
    assert x.grad is None


def test_grad_on_a_chain_whose_exec_info_is_sized_in_several_steps():
    # 40k nodes, each marked needed by the dependency search (See Note
    # [Marking exec info in the dependency search] in
    # pyengine/_pure/dependencies.py); an input the graph does not reach
    # has an entry that no node marks, and a second call of the same graph
    # starts afresh.
    depth = 40_000
    x = leaf([1.0, 2.0])
    unused = leaf([3.0])
    y = x
    middle = None
    for k in range(depth):
        y = mul(y, const(-1.0 if k % 3 == 0 else 1.0))
        if k == depth // 2 - 1:
            middle = y
    # y = (-1)^(number of k < depth with k % 3 == 0) x; middle is y after
    # the first depth/2 factors.
    sign_all = (-1.0) ** len(range(0, depth, 3))
    sign_below_middle = (-1.0) ** len(range(0, depth // 2, 3))
    for _ in range(2):
        dx, dmiddle, dunused = pyengine.grad(y, [x, middle, unused], np.ones(2),
                                             retain_graph=True, allow_unused=True)
        np.testing.assert_array_equal(dx, [sign_all, sign_all])
        expected_middle = sign_all * sign_below_middle
        np.testing.assert_array_equal(dmiddle, [expected_middle, expected_middle])
        assert dunused is None
    assert x.grad is None


def test_grad_captures_a_node_that_also_runs_for_an_input_below_it():
    x = leaf([1.0, 2.0])
    h = mul(x, const(3.0))
    y = mul(h, const(2.0)) + mul(h, const(5.0))
    # y = 7 h, h = 3 x
    dh, dx = pyengine.grad(y, [h, x], np.ones(2))
    np.testing.assert_array_equal(dh, [7.0, 7.0])
    np.testing.assert_array_equal(dx, [21.0, 21.0])


def test_backward_inputs_runs_only_the_branch_of_the_input():
    x, z = leaf([1.0]), leaf([2.0])
    y = mul(x, const(3.0)) + mul(z, const(5.0))
    pyengine.backward(y, np.ones(1), inputs=[z])
    np.testing.assert_array_equal(z.grad, [5.0])
    assert x.grad is None


class RecordGraphTask(pyengine.Node):
    """Passes its gradient on and keeps the graph task it ran in."""

    def apply(self, grads):
        self.graph_task = state_module.get_current_graph_task()
        return grads


def run_recording(**kwargs):
    x = leaf([1.0])
    node = RecordGraphTask([pyengine.gradient_edge(x)], [pyengine.InputMetadata((1,), np.float64)])
    pyengine.get_default_engine().execute([pyengine.Edge(node, 0)], [np.ones(1)], **kwargs)
    return node.graph_task, x


@pytest.mark.parametrize("keep_graph, create_graph", [(False, False), (True, False), (True, True)])
def test_the_engines_graph_task_has_the_fields_of_the_call(keep_graph, create_graph):
    graph_task, x = run_recording(keep_graph=keep_graph, create_graph=create_graph,
                                  accumulate_grad=True)
    assert (graph_task.keep_graph, graph_task.grad_mode) == (keep_graph, create_graph)
    assert graph_task.reentrant_depth == 0 and not graph_task.exit_on_error
    assert graph_task.multithreading == pyengine.is_multithreading_enabled()
    assert graph_task.exec_info == {} and graph_task.captured_vars == []
    assert graph_task.future_completed and not graph_task.has_error
    np.testing.assert_array_equal(x.grad, [1.0])


class OneStreamRuntime(streams.DeviceRuntime):
    """A runtime that knows one device, whose current stream is a string."""

    def known_devices(self):
        return ["dev:0"]

    def current_stream(self, device):
        return f"stream of {device}"


def test_the_engines_graph_task_stashes_the_callers_streams_of_every_runtime(monkeypatch):
    # Registered after pyengine was imported: the engine must still see it.
    monkeypatch.setitem(streams._runtimes, "dev", OneStreamRuntime())
    graph_task, _ = run_recording(keep_graph=False, create_graph=False, accumulate_grad=True)
    assert graph_task.caller_current_streams["dev:0"] == "stream of dev:0"
    assert graph_task.caller_current_streams == streams.current_streams()


def test_the_engines_graph_task_stashes_no_streams_without_a_runtime(monkeypatch):
    for device_type in list(streams._runtimes):
        monkeypatch.delitem(streams._runtimes, device_type)
    graph_task, _ = run_recording(keep_graph=False, create_graph=False, accumulate_grad=True)
    assert graph_task.caller_current_streams == {}


def test_a_second_init_to_execute_is_refused_and_leaves_the_first_plan(core):
    # A graph task is planned once: a second call would count the
    # dependencies again over the first plan's marks.
    spec = [[(1, 0), (2, 0)], [(3, 0)], [(4, 0)], [], []]
    nodes = build(core, spec)
    graph_task = core.GraphTask(False, False, 0, None)
    graph_task.init_to_execute(nodes[0], [core.Edge(nodes[3], 0)], False)
    before = {key: (info.needed, info.captures) for key, info in graph_task.exec_info.items()}
    with pytest.raises(RuntimeError, match="already called on this graph task"):
        graph_task.init_to_execute(nodes[0], [core.Edge(nodes[4], 0)], True)
    assert {key: (info.needed, info.captures)
            for key, info in graph_task.exec_info.items()} == before
    # The first plan, against the rule: 0 and 1 run, 3 captures, 2 and 4 are pruned.
    assert set(before) == {id(nodes[k]) for k in (0, 1, 3)}
    assert before[id(nodes[3])] == (False, [(0, 0)])


def test_init_to_execute_is_refused_on_a_graph_task_that_has_started(core):
    nodes = build(core, [[(1, 0)], []])
    graph_task = core.GraphTask(False, False, 0, None)
    graph_task.increment_outstanding_tasks()  # what queueing its first task does
    with pytest.raises(RuntimeError, match="has started"):
        graph_task.init_to_execute(nodes[0], [core.Edge(nodes[1], 0)], False)
    assert graph_task.exec_info == {}


def test_a_node_planning_its_running_graph_task_is_refused_and_grad_works():
    # A node that plans its own graph task while it runs: refused, and the
    # grad it runs in is unharmed (the oracle: the analytic gradient, 2 * 3).
    errors = []

    class Planner(pyengine.Node):
        def apply(self, grads):
            try:
                state_module.get_current_graph_task().init_to_execute(self, [], False)
            except RuntimeError as error:
                errors.append(str(error))
            return (2 * grads[0],)

    x = leaf(np.array([1.0, 2.0]))
    y = mul(x, const(np.array([3.0, 3.0])))
    planner = Planner((pyengine.gradient_edge(y),), (pyengine.InputMetadata((2,), np.float64),))
    (grad_x,) = pyengine.get_default_engine().execute(
        [pyengine.Edge(planner, 0)], [np.ones(2)], False, False, False,
        outputs=[pyengine.gradient_edge(x)])
    np.testing.assert_array_equal(grad_x, np.full(2, 6.0))
    assert len(errors) == 1 and "already called" in errors[0]


def test_a_second_init_is_refused_and_an_uninitialized_task_reads_zeroes():
    # The compiled GraphTask's __init__ sets the fields of a backward's
    # start (flags, counts, the result lists); its plan, tables, locks and
    # error are made with the object, as the twin's __new__ makes them. A
    # second __init__ once reset a running task's counts and queue (the
    # compiled core then pushed to None: a segfault), and in the twin
    # dropped a planned task's plan: now both refuse it, and the task keeps
    # its fields and its plan.
    core = pyengine._core

    class Sink(pyengine.Node):
        def __init__(self):
            super().__init__(input_metadata=[((3,), np.float64)])

        def apply(self, grads):
            return ()

    sink = Sink()
    task = core.GraphTask(False, False, 0, core.ReadyQueue())
    task.init_to_execute(sink, [pyengine.Edge(sink, 0), pyengine.Edge(sink, 0)], False)
    with pytest.raises(TypeError, match=r"^GraphTask.__init__ ran already: it runs once per"):
        task.__init__(True, True, 1, core.ReadyQueue())
    assert task.find_exec_info(sink).captures == [(0, 0), (0, 1)]
    assert (task.keep_graph, task.reentrant_depth, task.owner, task.captured_vars) == (
        False, 0, -2, [None, None])
    with pytest.raises(RuntimeError, match="^init_to_execute was already called"):
        task.init_to_execute(sink, [pyengine.Edge(sink, 0)], False)

    bare = core.GraphTask.__new__(core.GraphTask)
    assert [getattr(bare, name) for name in (
        "keep_graph", "grad_mode", "reentrant_depth", "cpu_ready_queue", "exit_on_error",
        "multithreading", "caller_current_streams", "owner", "graph_root", "captured_vars",
        "leaf_streams", "final_callbacks", "outstanding_tasks", "has_error", "exception",
        "future_completed", "exec_info")] == [
        False, False, 0, None, False, False, None, 0, None, None, None, None, 0, False, None,
        False, {}]
