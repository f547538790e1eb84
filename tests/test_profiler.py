"""pyengine.profile: per-node events, the Chrome trace and the summary table.

Oracles: graphs built here whose nodes, execution order (the ready queue's
sequence-number order on a chain), devices and threads are known; nodes
that log the thread they ran on and when; the engine's own ``grad(inputs=)``
pruning; sums recomputed from the events.
"""

from __future__ import annotations

import gc
import io
import json
import threading
import time
import weakref
from collections import Counter

import numpy as np
import pytest
from minitensor import leaf

import pyengine
from pyengine import _core
from pyengine import fake_device as fd
from pyengine import profiler as profiler_module
from pyengine.device import CPU

F0, F1 = fd.device(0), fd.device(1)


class Leaf:
    def __init__(self, data):
        self.data = data
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


class Step(pyengine.Node):
    """Backward of ``y = factor * x``: ``x`` on ``input_device``, ``y`` on
    ``device``. Logs ``(self, thread name, time)`` when it runs."""

    log: list = []

    def __init__(self, edge, device=CPU, factor=2.0, input_device=CPU, label="Step", sleep=0.0):
        super().__init__([edge], [pyengine.InputMetadata((3,), np.float64, device)])
        self.factor, self.device, self.input_device = factor, device, input_device
        self.label, self.sleep = label, sleep

    def name(self):
        return self.label

    def apply(self, grads):
        started = time.perf_counter_ns()
        if self.sleep:
            time.sleep(self.sleep)
        Step.log.append((self, threading.current_thread().name, started))
        grad = grads[0] * self.factor
        if self.input_device != self.device:
            host = grad.numpy() if isinstance(grad, fd.FakeArray) else grad
            grad = host if self.input_device == CPU else fd.to_fake(host, self.input_device)
        return [grad]


@pytest.fixture(autouse=True)
def clean():
    Step.log = []
    yield
    # No profile left installed: the hook is off and the engine is the original.
    previous = _core.set_profiler(None)
    assert previous is None, f"a test left a profiler hook installed: {previous!r}"
    assert profiler_module._Registry.active == ()
    assert not isinstance(pyengine.get_default_engine(), profiler_module._TimedEngine)


def chain(n, label="Step", **kwargs):
    x = Leaf(np.ones(3))
    edge = pyengine.gradient_edge(x)
    nodes = []
    for i in range(n):
        node = Step(edge, label=f"{label}{i}", **kwargs)
        nodes.append(node)
        edge = pyengine.Edge(node, 0)
    return x, nodes


def run(root, grad=None):
    pyengine.backward(pyengine.Edge(root, 0), np.ones(3) if grad is None else grad,
                      retain_graph=True)


def node_events(prof):
    return [event for event in prof.events if event.name != "AccumulateGrad"]


# -- events ---------------------------------------------------------------------------

def test_every_node_of_a_chain_once_in_execution_order():
    x, nodes = chain(20)
    with pyengine.profile() as prof:
        run(nodes[-1])
    np.testing.assert_array_equal(x.grad, [2.0**20] * 3)
    events = prof.events
    # 20 nodes and the leaf's AccumulateGrad; the chain runs from its top.
    assert [event.name for event in events] == [f"Step{i}" for i in reversed(range(20))] + [
        "AccumulateGrad"]
    assert [event.sequence_nr for event in events[:-1]] == [n.sequence_nr for n in reversed(nodes)]
    assert [event.node_id for event in events[:-1]] == [id(n) for n in reversed(nodes)]
    assert events[-1].sequence_nr == 2**64 - 1
    caller = threading.current_thread()
    for event in events:
        assert event.end_ns >= event.start_ns
        assert event.device == "cpu" and event.run == 0 and event.executed
        assert event.thread.name == caller.name and event.thread.ident == caller.ident
    # Each node's event brackets the moment its apply started, and events do not overlap.
    for event, (node, _, started) in zip(events, Step.log):
        assert event.node_id == id(node) and event.start_ns <= started <= event.end_ns
    for before, after in zip(events, events[1:]):
        assert before.end_ns <= after.start_ns
    (span,) = prof.backward_spans
    assert span.thread.ident == caller.ident and span.roots == 1 and not span.failed
    assert span.start_ns <= events[0].start_ns and events[-1].end_ns <= span.end_ns
    assert prof.runs == 1


def test_each_backward_is_a_run_with_every_node_once():
    x, nodes = chain(5)
    y, others = chain(3, label="Other")
    with pyengine.profile() as prof:
        run(nodes[-1])
        run(others[-1])
        run(nodes[-1])
    assert prof.runs == 3 and len(prof.backward_spans) == 3
    by_run = {}
    for event in prof.events:
        by_run.setdefault(event.run, []).append(event.node_id)
    expected = [[id(n) for n in reversed(nodes)], [id(n) for n in reversed(others)],
                [id(n) for n in reversed(nodes)]]
    for run_index, ids in enumerate(expected):
        assert by_run[run_index][:-1] == ids  # then the AccumulateGrad
        assert len(set(by_run[run_index])) == len(by_run[run_index])


def test_nothing_is_recorded_outside_the_block():
    x, nodes = chain(4)
    run(nodes[-1])
    with pyengine.profile() as prof:
        pass
    run(nodes[-1])
    assert prof.events == [] and prof.backward_spans == []


def test_grad_inputs_marks_captured_nodes_as_not_executed():
    x, nodes = chain(6)
    middle = nodes[2]
    with pyengine.profile() as prof:
        (result,) = pyengine.grad(pyengine.Edge(nodes[-1], 0), [pyengine.Edge(middle, 0)],
                                  grad_outputs=[np.ones(3)], retain_graph=True)
    np.testing.assert_array_equal(result, [8.0] * 3)
    # nodes 5, 4, 3 ran; node 2 was reached only to capture its input.
    assert [(e.name, e.executed) for e in prof.events] == [
        ("Step5", True), ("Step4", True), ("Step3", True), ("Step2", False)]
    assert {node.label for node, _, _ in Step.log} == {"Step5", "Step4", "Step3"}


def test_several_roots_run_a_graph_root():
    x = leaf([1.0, 2.0])
    a, b = x * 2.0, x.exp()
    with pyengine.profile() as prof:
        pyengine.backward([a.sum(), b.sum()])
    names = Counter(event.name for event in prof.events)
    assert names == {"GraphRoot": 1, "SumBackward": 2, "MulBackward": 1, "ExpBackward": 1,
                     "AccumulateGrad": 1}
    assert prof.backward_spans[0].roots == 2


def test_a_failing_node_is_recorded_and_the_error_reaches_the_caller():
    class Boom(pyengine.Node):
        def apply(self, grads):
            raise ValueError("boom")

    x = Leaf(np.ones(3))
    boom = Boom([pyengine.gradient_edge(x)], [pyengine.InputMetadata((3,), np.float64)])
    top = Step(pyengine.Edge(boom, 0), label="Top")
    with pyengine.profile() as prof:
        with pytest.raises(ValueError, match="boom"):
            run(top)
    assert [event.name for event in prof.events] == ["Top", "Boom"]
    (span,) = prof.backward_spans
    assert span.failed
    assert "backward (failed)" in {e["name"] for e in prof.chrome_trace()["traceEvents"]}


def test_many_events_are_flushed_without_loss(monkeypatch):
    monkeypatch.setattr(profiler_module, "FLUSH_EVENTS", 7)
    x, nodes = chain(100)
    with pyengine.profile() as prof:
        run(nodes[-1])
        run(nodes[-1])
    events = node_events(prof)
    assert len(events) == 200
    assert Counter(event.node_id for event in events) == {id(n): 2 for n in nodes}


def test_nodes_are_not_kept_alive_after_the_profile():
    x, nodes = chain(3)
    refs = [weakref.ref(node) for node in nodes]
    with pyengine.profile() as prof:
        run(nodes[-1])
    del nodes
    Step.log = []
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert len(prof.events) == 4


class Value:
    """An owner of the OwnerGraph protocol: ``y = factor * x``."""

    def __init__(self, data, parents=(), factor=1.0, label="leaf"):
        self.data, self.parents, self.factor, self.label = data, parents, factor, label
        self.grad = None

    def backward(self, grads):
        return [grads[0] * self.factor]


def test_a_profiled_owner_graph_backward_lets_its_graph_go():
    # See Note [Profiled graphs go by refcount]: nothing but the profile
    # would keep the graph alive, and gc is off, so refcount alone must free it.
    graph = pyengine.OwnerGraph("parents", "backward", mode="returns")
    with pyengine.profile() as prof:
        gc.disable()
        try:
            value = Value(np.ones(3))
            for _ in range(3):
                value = Value(value.data * 2.0, (value,), factor=2.0)
            ref = weakref.ref(value)
            graph.backward(value, np.ones(3))
            del value
            assert ref() is None
        finally:
            gc.enable()
    # The records still name the owners run, one run, in walk order.
    assert [event.name for event in prof.events] == ["Value"] * 4
    assert [event.sequence_nr for event in prof.events] == [3, 2, 1, 0]
    assert prof.runs == 1


def test_a_profiled_backward_through_another_engine_lets_its_graph_go():
    engine = pyengine.Engine()
    try:
        with pyengine.profile() as prof:
            gc.disable()
            try:
                x, nodes = chain(3)
                ref = weakref.ref(nodes[0])
                engine.execute([pyengine.Edge(nodes[-1], 0)], [np.ones(3)], False, False, True)
                del x, nodes
                Step.log = []
                assert ref() is None
            finally:
                gc.enable()
    finally:
        engine.stop()
    assert [event.name for event in node_events(prof)] == ["Step2", "Step1", "Step0"]
    assert prof.backward_spans == []


def test_a_reentrant_owner_walk_on_another_thread_lets_both_graphs_go():
    graph = pyengine.OwnerGraph("parents", "backward", mode="returns")
    refs = []

    class Walks(Step):
        def apply(self, grads):
            value = Value(np.ones(3))
            value = Value(value.data, (value,), label="inner")
            refs.append(weakref.ref(value))
            graph.backward(value, np.ones(3))
            return super().apply(grads)

    def backward_on_a_thread():
        x = Leaf(np.ones(3))
        node = Walks(pyengine.gradient_edge(x), label="Walks")
        refs.append(weakref.ref(node))
        engine.execute([pyengine.Edge(node, 0)], [np.ones(3)], False, False, True)

    engine = pyengine.Engine()
    try:
        with pyengine.profile() as prof:
            gc.disable()
            try:
                thread = threading.Thread(target=backward_on_a_thread, name="caller")
                thread.start()
                thread.join()
                Step.log = []
                assert len(refs) == 2 and all(ref() is None for ref in refs)
            finally:
                gc.enable()
    finally:
        engine.stop()
    assert sorted(event.name for event in node_events(prof)) == ["Value", "Value", "Walks"]
    assert prof.runs == 2


def test_results_only_after_stop_and_a_profile_records_once():
    prof = pyengine.profile()
    prof.start()
    try:
        with pytest.raises(RuntimeError, match="recording"):
            prof.events  # noqa: B018
        with pytest.raises(RuntimeError, match="records once"):
            prof.start()
    finally:
        prof.stop()
    with pytest.raises(RuntimeError, match="records once"):
        prof.start()
    with pytest.raises(RuntimeError, match="not recording"):
        prof.stop()


# -- devices and threads ----------------------------------------------------------------

def cross_device_chain():
    """leaf (cpu) <- cpu node <- fake:0 node <- fake:1 node <- root, as in test_devices."""
    x = Leaf(np.ones(3))
    n_cpu = Step(pyengine.gradient_edge(x), CPU, 2.0, CPU, label="OnCpu")
    n0 = Step(pyengine.Edge(n_cpu, 0), F0, 3.0, CPU, label="OnFake0")
    n1 = Step(pyengine.Edge(n0, 0), F1, 5.0, F0, label="OnFake1")
    return x, n1


def test_threads_and_devices_match_the_routing():
    x, root = cross_device_chain()
    with pyengine.profile() as prof:
        pyengine.backward(pyengine.Edge(root, 0), fd.to_fake(np.ones(3), F1))
    np.testing.assert_array_equal(x.grad, [30.0] * 3)
    caller = threading.current_thread().name
    where = {event.name: (event.device, event.thread.name) for event in prof.events}
    assert where == {"OnFake1": ("fake:1", "pyengine-fake:1"),
                     "OnFake0": ("fake:0", "pyengine-fake:0"),
                     "OnCpu": ("cpu", caller), "AccumulateGrad": ("cpu", caller)}
    # The node's own log agrees with the thread recorded for it.
    logged = {node.label: thread for node, thread, _ in Step.log}
    assert all(where[name][1] == thread for name, thread in logged.items())
    # Dependencies order the events across threads.
    order = [event.name for event in prof.events]
    assert order == ["OnFake1", "OnFake0", "OnCpu", "AccumulateGrad"]
    assert {thread.name for thread in prof.threads} == {caller, "pyengine-fake:0",
                                                        "pyengine-fake:1"}


def test_multithreading_off_runs_and_records_everything_on_the_caller():
    x, root = cross_device_chain()
    with pyengine.set_multithreading_enabled(False), pyengine.profile() as prof:
        pyengine.backward(pyengine.Edge(root, 0), fd.to_fake(np.ones(3), F1))
    caller = threading.current_thread().name
    assert {event.thread.name for event in prof.events} == {caller}
    assert {event.name: event.device for event in prof.events}["OnFake0"] == "fake:0"


def test_backward_calls_from_two_threads_are_told_apart():
    graphs = [chain(30, label=f"T{t}-") for t in range(2)]
    barrier = threading.Barrier(2)

    def worker(t):
        barrier.wait()
        run(graphs[t][1][-1])

    threads = [threading.Thread(target=worker, args=(t,), name=f"caller-{t}") for t in range(2)]
    with pyengine.profile() as prof:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    for t in range(2):
        mine = [event for event in prof.events if event.thread.name == f"caller-{t}"]
        assert [event.name for event in mine] == [f"T{t}-{i}" for i in reversed(range(30))] + [
            "AccumulateGrad"]
        assert len({event.run for event in mine}) == 1
    assert len({event.run for event in prof.events}) == 2
    assert sorted(span.thread.name for span in prof.backward_spans) == ["caller-0", "caller-1"]


def test_reentrant_backward_is_a_nested_run_and_self_time_excludes_it():
    inner_x, inner = chain(5, label="Inner", sleep=0.002)

    class Reenter(pyengine.Node):
        def name(self):
            return "Reenter"

        def apply(self, grads):
            run(inner[-1])
            return grads

    x = Leaf(np.ones(3))
    outer = Reenter([pyengine.gradient_edge(x)], [pyengine.InputMetadata((3,), np.float64)])
    with pyengine.profile() as prof:
        run(outer)
    events = prof.events
    reenter = next(e for e in events if e.name == "Reenter")
    # Runs are numbered by when they started: the outer backward is run 0.
    children = [e for e in events if e.name.startswith("Inner")
                or (e.name == "AccumulateGrad" and e.start_ns < reenter.end_ns)]
    assert len(children) == 6 and {e.run for e in children} == {1} and reenter.run == 0
    assert all(reenter.start_ns <= e.start_ns and e.end_ns <= reenter.end_ns for e in children)
    self_ns = dict(zip([e.node_id for e in events], prof.self_times_ns()))
    assert self_ns[reenter.node_id] == reenter.duration_ns - sum(e.duration_ns for e in children)
    rows = {row.name: row for row in prof.summary()}
    assert rows["Reenter"].self_ns == self_ns[reenter.node_id]
    assert rows["Reenter"].total_ns == reenter.duration_ns
    # Two backward spans, the inner one inside the outer one.
    outer_span, inner_span = prof.backward_spans
    assert outer_span.start_ns < inner_span.start_ns and inner_span.end_ns < outer_span.end_ns


# -- nested and concurrent profiles ------------------------------------------------------

def test_nested_profiles_each_see_what_ran_while_they_were_active():
    x, nodes = chain(3)
    with pyengine.profile() as outer:
        run(nodes[-1])
        with pyengine.profile() as inner:
            run(nodes[-1])
        run(nodes[-1])
    assert len(outer.events) == 12 and outer.runs == 3
    assert len(inner.events) == 4 and inner.runs == 1
    inner_ids = [(e.node_id, e.start_ns) for e in inner.events]
    outer_ids = [(e.node_id, e.start_ns) for e in outer.events]
    assert outer_ids[4:8] == inner_ids


def test_profiles_on_two_threads_may_stop_in_any_order():
    x, nodes = chain(3)
    first = pyengine.profile().start()
    second = pyengine.profile()

    def other():
        second.start()
        run(nodes[-1])

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(30)
    first.stop()  # not the last one started: the second keeps recording
    run(nodes[-1])
    second.stop()
    assert len(first.events) == 4 and len(second.events) == 8


def test_a_foreign_hook_keeps_being_called_and_comes_back():
    seen = []

    def foreign(node, start, end):
        seen.append(node.name())

    x, nodes = chain(2)
    assert _core.set_profiler(foreign) is None
    try:
        with pyengine.profile() as prof:
            run(nodes[-1])
        assert seen == ["Step1", "Step0", "AccumulateGrad"] and len(prof.events) == 3
        run(nodes[-1])
        assert len(seen) == 6
    finally:
        assert _core.set_profiler(None) is foreign


def test_the_engine_is_put_back_and_forwarded():
    engine = pyengine.get_default_engine()
    with pyengine.profile():
        proxy = pyengine.get_default_engine()
        assert proxy is not engine and proxy.engine is engine
        assert proxy.max_recursion_depth == engine.max_recursion_depth
    assert pyengine.get_default_engine() is engine


# -- the Chrome trace -------------------------------------------------------------------

def test_chrome_trace_is_valid_trace_event_json(tmp_path):
    x, root = cross_device_chain()
    y, nodes = chain(4)
    with pyengine.profile() as prof:
        pyengine.backward(pyengine.Edge(root, 0), fd.to_fake(np.ones(3), F1))
        run(nodes[-1])
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(path)
    document = json.loads(path.read_text())
    assert set(document) >= {"traceEvents", "displayTimeUnit"}
    events = document["traceEvents"]
    for event in events:
        assert event["ph"] in ("X", "M")
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert isinstance(event["name"], str)
        if event["ph"] == "X":
            assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0
    slices = [e for e in events if e["ph"] == "X" and e["cat"].startswith("node")]
    assert len(slices) == len(prof.events) == 9
    # One track per thread, named; every slice is on a named track.
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    caller = threading.current_thread().name
    assert sorted(names.values()) == sorted([caller, "pyengine-fake:0", "pyengine-fake:1"])
    assert {e["tid"] for e in slices} == set(names)
    track_of = {e["name"]: names[e["tid"]] for e in slices}
    assert track_of["OnFake0"] == "pyengine-fake:0" and track_of["OnFake1"] == "pyengine-fake:1"
    assert track_of["OnCpu"] == caller
    # The calling thread's track comes first and carries one backward slice per call.
    order = sorted((e["args"]["sort_index"], names[e["tid"]]) for e in events
                   if e["name"] == "thread_sort_index")
    assert order[0][1] == caller
    backward = [e for e in events if e["ph"] == "X" and e["cat"] == "backward"]
    assert len(backward) == 2 and {names[e["tid"]] for e in backward} == {caller}
    # Slices keep the node's identity and times (microseconds from the start).
    first = prof.events[0]
    match = next(e for e in slices if e["name"] == first.name)
    assert match["args"]["sequence_nr"] == first.sequence_nr
    assert match["args"]["device"] == first.device
    assert match["ts"] == pytest.approx((first.start_ns - prof.start_ns) / 1e3)
    assert match["dur"] == pytest.approx(first.duration_ns / 1e3)


# -- the table ----------------------------------------------------------------------------

def test_table_sums_add_up():
    x = leaf(np.ones(4))
    with pyengine.profile() as prof:
        for _ in range(3):
            y = ((x * 2.0).exp() * x).sum()
            y.backward()
    events = prof.events
    rows = prof.summary()
    assert Counter({row.name: row.count for row in rows}) == Counter(e.name for e in events)
    assert {row.name: row.count for row in rows} == {
        "SumBackward": 3, "MulBackward": 6, "ExpBackward": 3, "AccumulateGrad": 3}
    wall = prof.backward_wall_ns()
    assert wall == sum(span.duration_ns for span in prof.backward_spans)  # 3 disjoint calls
    for row in rows:
        mine = [e.duration_ns for e in events if e.name == row.name]
        assert row.total_ns == sum(mine) and row.max_ns == max(mine)
        assert row.mean_ns == pytest.approx(sum(mine) / len(mine))
        assert row.share == pytest.approx(row.total_ns / wall)
        assert row.self_ns == row.total_ns  # nothing nested
    assert sum(row.total_ns for row in rows) <= wall  # one thread: nodes within the calls
    assert [row.total_ns for row in rows] == sorted((row.total_ns for row in rows), reverse=True)

    out = io.StringIO()
    text = prof.table(file=out)
    assert out.getvalue() == text
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["Node", "Count", "Total"]
    body = {line.split()[0]: line.split() for line in lines[2:2 + len(rows)]}
    total_line = next(line.split() for line in lines if line.startswith("Total"))
    assert int(total_line[1]) == sum(int(cells[1]) for cells in body.values()) == len(events)
    assert float(total_line[2]) == pytest.approx(sum(float(cells[2]) for cells in body.values()),
                                                 abs=0.001 * len(body))
    assert float(total_line[2]) == pytest.approx(sum(e.duration_ns for e in events) / 1e6,
                                                 abs=0.0006)
    for row in rows:
        cells = body[row.name]
        assert int(cells[1]) == row.count
        assert float(cells[6]) == pytest.approx(100 * row.share, abs=0.06)
    assert f"backward wall time {wall / 1e6:.3f} ms" in text
    assert prof.table(file=None, limit=2).count("\n") == len(lines) - len(rows) + 3


def test_shares_can_pass_100_percent_when_devices_run_in_parallel():
    # Two device branches that sleep at the same time under one root.
    x = Leaf(np.ones(3))
    join = Step(pyengine.gradient_edge(x), CPU, 1.0, CPU, label="Join")

    class Fork(pyengine.Node):
        def apply(self, grads):
            return [grads[0], fd.to_fake(grads[0].numpy(), F1)]

    left = Step(pyengine.Edge(join, 0), F0, 1.0, CPU, label="Left", sleep=0.05)
    right = Step(pyengine.Edge(join, 0), F1, 1.0, CPU, label="Right", sleep=0.05)
    fork = Fork([pyengine.Edge(left, 0), pyengine.Edge(right, 0)],
                [pyengine.InputMetadata((3,), np.float64, F0)])
    with pyengine.profile() as prof:
        pyengine.backward(pyengine.Edge(fork, 0), fd.to_fake(np.ones(3), F0))
    np.testing.assert_array_equal(x.grad, [2.0] * 3)
    rows = {row.name: row for row in prof.summary()}
    left_event = next(e for e in prof.events if e.name == "Left")
    right_event = next(e for e in prof.events if e.name == "Right")
    overlap = (min(left_event.end_ns, right_event.end_ns)
               - max(left_event.start_ns, right_event.start_ns))
    assert left_event.thread != right_event.thread
    if overlap > 0.8 * min(left_event.duration_ns, right_event.duration_ns):
        assert rows["Left"].share + rows["Right"].share > 1.0
    assert prof.backward_wall_ns() >= max(left_event.duration_ns, right_event.duration_ns)


# -- python -m pyengine demo --trace --graph ------------------------------------------------

@pytest.mark.parametrize("graph_suffix", ["dot", "svg"])
def test_demo_writes_the_trace_and_the_graph(tmp_path, capsys, graph_suffix):
    import shutil

    from pyengine.__main__ import main

    if graph_suffix == "svg" and shutil.which("dot") is None:
        pytest.skip("Graphviz's dot program is not installed")
    trace, graph = tmp_path / "out.json", tmp_path / f"out.{graph_suffix}"
    assert main(["demo", "--epochs", "2", "--points", "128", "--no-progress",
                 "--trace", str(trace), "--graph", str(graph)]) == 0
    out = capsys.readouterr().out
    steps = 2 * 2  # 128 points in batches of 64, 2 epochs
    events = json.loads(trace.read_text())["traceEvents"]
    nodes = [e for e in events if e["ph"] == "X" and e["cat"].startswith("node")]
    # 13 nodes per step (3 Linear, 2 ReLU, LogSoftmax, NllLoss, 6 AccumulateGrad).
    assert len(nodes) == 13 * steps
    assert Counter(e["name"] for e in nodes) == {
        "LinearBackward": 3 * steps, "ReluBackward": 2 * steps, "LogSoftmaxBackward": steps,
        "NllLossBackward": steps, "AccumulateGrad": 6 * steps}
    assert len([e for e in events if e["ph"] == "X" and e["cat"] == "backward"]) == steps
    assert f"trace: {13 * steps} node events written to {trace}" in out
    assert "LinearBackward" in out and "% of backward" in out
    text = graph.read_text() if graph_suffix == "dot" else None
    if text is not None:
        boxes = [line for line in text.splitlines() if 'class="node' in line
                 or 'class="accumulate' in line]
        assert len(boxes) == 13
        leaves = {line.split('label="')[1].split("\\n")[0] for line in text.splitlines()
                  if 'class="leaf' in line}
        assert leaves == {f"modules.{i}.{kind}" for i in (0, 2, 4) for kind in ("weight", "bias")}
    else:
        svg = graph.read_text()
        assert svg.count('class="node node') == 7 and svg.count('class="node accumulate') == 6
    assert f"graph: the first step's backward graph written to {graph}" in out


def test_demo_graph_without_graphviz_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import sys

    from pyengine.__main__ import main

    monkeypatch.setitem(sys.modules, "graphviz", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["demo", "--epochs", "1", "--points", "64", "--no-progress",
                 "--graph", str(tmp_path / "g.svg")]) == 2
    assert "apt-get install graphviz" in capsys.readouterr().err
