"""GradientFreeNode: nodes that call ``owner.<method>()`` and pass no gradients.

See Note [GradientFreeNode]. Oracles: the same graph built from plain
Nodes whose ``apply`` returns a None per edge (the engine's general path,
which PyTorch's order specifies) runs the same nodes in the same order,
with the same hooks, errors, profiler events and callbacks, also when its
nodes were made on several threads (the twin runs the same order: the
suite runs on both cores); a small scalar program whose nodes add into their inputs'
``.grad``, as micrograd's closures do, gets its analytic derivatives; a
deep copy of such a program is the same program over the copies (See Note
[Copying a GradientFreeNode]).
"""

import copy
import pickle
import random
import threading

import numpy as np
import pytest
from minitensor import leaf

import pyengine
from pyengine import AccumulateGrad, Edge, GradientFreeNode, Node, _core

# -- two builds of one graph ---------------------------------------------------------------


class Recorder:
    """The owner of a gradient-free node: ``run()`` logs its tag."""

    def __init__(self, tag, log, fail=False):
        self.tag = tag
        self.log = log
        self.fail = fail

    def run(self):
        self.log.append(self.tag)
        if self.fail:
            raise ValueError(f"node {self.tag} failed")


class PlainRecorder(Node):
    """The oracle's node: the same log entry from ``apply``, and a None per edge."""

    def __init__(self, next_edges, recorder):
        super().__init__(next_edges=next_edges)
        self.recorder = recorder

    def apply(self, grads):
        self.recorder.run()
        return [None] * len(self.next_edges)


def build(spec, gradient_free, log, fail=None):
    """The nodes of ``spec`` (per node, the indices of the earlier nodes its
    edges go to; None: a None edge), in order, gradient-free or plain."""
    nodes = []
    for index, targets in enumerate(spec):
        edges = [None if target is None else Edge(nodes[target], 0) for target in targets]
        recorder = Recorder(index, log, fail=index == fail)
        if gradient_free:
            nodes.append(GradientFreeNode(recorder, "run", next_edges=edges))
        else:
            nodes.append(PlainRecorder(edges, recorder))
    return nodes


def random_spec(rng, size):
    """A random DAG: each node has up to three edges to earlier nodes (repeats
    and None edges included), so fan-in, fan-out and unreachable nodes occur."""
    spec = []
    for index in range(size):
        targets = [rng.randrange(index) if rng.random() < 0.9 else None
                   for _ in range(rng.randint(0, 3))] if index else []
        spec.append(targets)
    return spec


def run(nodes, root=-1, **kwargs):
    return pyengine.get_default_engine().execute([Edge(nodes[root], 0)], [None],
                                                 kwargs.get("keep_graph", True), False, True,
                                                 kwargs.get("outputs"))


def both(spec, **kwargs):
    """The logs of running ``spec`` gradient-free and plain."""
    logs = []
    for gradient_free in (True, False):
        log = []
        run(build(spec, gradient_free, log), **kwargs)
        logs.append(log)
    return logs


# -- order -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(20))
def test_random_graphs_run_in_the_plain_nodes_order(seed):
    rng = random.Random(seed)
    spec = random_spec(rng, rng.randint(1, 60))
    gradient_free, plain = both(spec)
    assert gradient_free == plain
    assert gradient_free[0] == len(spec) - 1  # the root first


def build_on_threads(gradient_free, log):
    """On each of three fresh threads (each numbers its nodes from 0, as
    PyTorch's per-thread sequence_nr does), the diamond 3 -> {1, 2} -> 0 of
    nodes tagged A0..A3, B0..B3, C0..C3; a root R on this thread with an
    edge to each thread's node 3. Equal sequence numbers tie in the ready
    queue: See Note [Ties in the ready queue]."""
    diamond = [[], [0], [0], [1, 2]]
    tops = {}

    def build_diamond(name):
        nodes = []
        for index, targets in enumerate(diamond):
            edges = [Edge(nodes[target], 0) for target in targets]
            recorder = Recorder(f"{name}{index}", log)
            nodes.append(GradientFreeNode(recorder, "run", edges) if gradient_free
                         else PlainRecorder(edges, recorder))
        tops[name] = nodes[-1]

    for name in "ABC":
        thread = threading.Thread(target=build_diamond, args=(name,))
        thread.start()
        thread.join()
    edges = [Edge(tops[name], 0) for name in "ABC"]
    recorder = Recorder("R", log)
    return GradientFreeNode(recorder, "run", edges) if gradient_free else PlainRecorder(edges,
                                                                                       recorder)


def test_nodes_made_on_three_threads_run_in_the_plain_nodes_order():
    """Sequence numbers tie across threads; both builds run in the ready
    queue's order, which libstdc++'s heap gives PyTorch's engine (See Note
    [Ties in the ready queue]): 2 of C's diamond before 2 of B's."""
    logs = []
    for gradient_free in (True, False):
        log = []
        root = build_on_threads(gradient_free, log)
        assert sorted({node.sequence_nr for node in _diamond_nodes(root)}) == [0, 1, 2, 3]
        pyengine.get_default_engine().execute([Edge(root, 0)], [None], True, False, True)
        logs.append(log)
    assert logs[0] == logs[1]
    assert logs[0] == ["R", "A3", "B3", "C3", "A2", "C2", "B2", "A1", "B1", "C1", "A0", "B0", "C0"]


def _diamond_nodes(root):
    """The nodes below ``root``."""
    seen, stack = [], [edge.node for edge in root.next_edges]
    while stack:
        node = stack.pop()
        if all(node is not other for other in seen):
            seen.append(node)
            stack.extend(edge.node for edge in node.next_edges)
    return seen


def test_a_node_runs_after_all_of_its_consumers():
    # 3 -> 1, 3 -> 2, 2 -> 1, 1 -> 0: 1 waits for both 3 and 2.
    log = []
    run(build([[], [0], [1], [1, 2]], True, log))
    assert log == [3, 2, 1, 0]


def test_a_deep_chain_needs_no_recursion():
    depth = 100_000
    log = []
    run(build([[]] + [[index] for index in range(depth - 1)], True, log))
    assert log == list(range(depth - 1, -1, -1))


def test_retained_graph_runs_again_and_a_released_one_releases_its_nodes():
    log = []
    nodes = build([[], [0], [1]], True, log)
    run(nodes)
    run(nodes)
    assert log == [2, 1, 0] * 2
    run(nodes, keep_graph=False)
    assert all(node._released for node in nodes)


# -- with other nodes --------------------------------------------------------------------------

class Doubler(Node):
    """A plain node between gradient-free ones: passes its gradient on, doubled."""

    def __init__(self, next_edges, log):
        super().__init__(next_edges=next_edges)
        self.log = log
        self.seen = []

    def apply(self, grads):
        self.seen.append(list(grads))
        self.log.append("doubler")
        grad = grads[0] if grads else None
        return [None if grad is None else 2.0 * grad] * len(self.next_edges)


def test_mixed_graph_matches_the_plain_one():
    """Gradient-free nodes feeding a plain node and a leaf, and a plain node
    feeding gradient-free ones: the engine's general path, gradients None
    where a gradient-free node produced them."""
    results = []
    for gradient_free in (True, False):
        log = []
        x = leaf([1.0, 2.0])
        accumulate = AccumulateGrad(x)
        bottom = build([[]], gradient_free, log)[0]
        doubler = Doubler([Edge(accumulate, 0), Edge(bottom, 0)], log)
        middle = (GradientFreeNode(Recorder("middle", log), "run", [Edge(doubler, 0)])
                  if gradient_free else PlainRecorder([Edge(doubler, 0)], Recorder("middle", log)))
        pyengine.get_default_engine().execute([Edge(middle, 0)], [None], True, False, True)
        results.append((log, doubler.seen, x.grad))
    assert results[0] == results[1]
    assert results[0][0] == ["middle", "doubler", 0]
    assert results[0][1] == [[]]  # no slots declared, and only a None arrived
    assert results[0][2] is None


def test_a_gradient_free_node_ignores_the_gradient_it_receives():
    log = []
    node = GradientFreeNode(Recorder("sink", log), "run", input_metadata=[((2,), np.float64)])
    doubler = Doubler([Edge(node, 0)], log)
    pyengine.get_default_engine().execute([Edge(doubler, 0)], [np.ones(2)], True, False, True)
    assert log == ["doubler", "sink"]
    np.testing.assert_array_equal(doubler.seen[0][0], np.ones(2))


def test_a_slot_without_metadata_gets_no_list_entry_for_a_none_gradient():
    """A None flowing into slot 2 of a node that declared no slots leaves its
    gradient list empty, as an InputBuffer that got only Nones (both cores)."""
    seen = []

    class Sink(Node):
        def apply(self, grads):
            seen.append(list(grads))
            return []

    sink = Sink()
    middle = GradientFreeNode(Recorder("middle", []), "run", [Edge(sink, 2)])
    pyengine.get_default_engine().execute([Edge(middle, 0)], [None], True, False, True)
    assert seen == [[]]


def test_grad_with_outputs_captures_none_and_prunes_like_plain_nodes():
    spec = [[], [0], [1], [0], [2, 3]]
    results = []
    for gradient_free in (True, False):
        log = []
        nodes = build(spec, gradient_free, log)
        captured = run(nodes, outputs=[Edge(nodes[1], 0)])
        results.append((log, captured))
    assert results[0] == results[1]
    assert results[0] == ([4, 2, 1], [None])


# -- hooks, errors, callbacks, profiler, threads ----------------------------------------------

def test_hooks_see_the_nones_the_plain_node_returns():
    calls = []
    for gradient_free in (True, False):
        log = []
        nodes = build([[], [0, 0]], gradient_free, log)
        hooked = nodes[1]
        hooked.register_prehook(lambda grads: calls.append(("pre", grads)))
        hooked.register_hook(lambda grad_inputs, grad_outputs:
                             calls.append(("post", grad_inputs, grad_outputs)))
        run(nodes)
        assert log == [1, 0]
    assert calls[:2] == calls[2:]
    assert calls[:2] == [("pre", ()), ("post", (None, None), ())]


@pytest.mark.parametrize("anomaly", [False, True])
def test_an_error_propagates_and_stops_the_backward(anomaly, no_anomaly_warning):
    spec = [[], [0], [1], [2]]
    outcomes = []
    for gradient_free in (True, False):
        log = []
        nodes = build(spec, gradient_free, log, fail=2)
        with pyengine.detect_anomaly() if anomaly else _nothing():
            with pytest.raises(ValueError, match="node 2 failed") as excinfo:
                run(nodes)
        notes = getattr(excinfo.value, "__notes__", [])
        outcomes.append((log, [note.split(".")[0] for note in notes]))
    assert outcomes[0][0] == outcomes[1][0] == [3, 2]
    assert len(outcomes[0][1]) == len(outcomes[1][1]) == (1 if anomaly else 0)


def test_a_callback_queued_by_a_node_runs_after_every_node():
    log = []

    class Queuer:
        def run(self):
            log.append("queuer")
            pyengine.queue_callback(lambda: log.append("callback"))

    bottom = build([[]], True, log)[0]
    top = GradientFreeNode(Queuer(), "run", [Edge(bottom, 0)])
    pyengine.get_default_engine().execute([Edge(top, 0)], [None], True, False, True)
    assert log == ["queuer", 0, "callback"]


def test_node_sees_the_graph_tasks_grad_mode_and_a_reentrant_backward_works():
    """Inside a node: grad mode is create_graph, and a backward started there
    (reentrant) runs to completion before the outer one goes on."""
    log = []
    inner = build([[], [0]], True, log)

    class Reenters:
        def run(self):
            log.append(("grad mode", pyengine.is_grad_enabled()))
            run(inner)

    bottom = GradientFreeNode(Recorder("bottom", log), "run")
    top = GradientFreeNode(Reenters(), "run", [Edge(bottom, 0)])
    for create_graph in (False, True):
        log.clear()
        pyengine.get_default_engine().execute([Edge(top, 0)], [None], True, create_graph, True)
        assert log == [("grad mode", create_graph), 1, 0, "bottom"]


def test_profiler_sees_the_same_nodes_as_for_plain_nodes():
    spec = [[], [0], [0, 1]]
    sequences = []
    for gradient_free in (True, False):
        nodes = build(spec, gradient_free, [])
        with pyengine.profile() as prof:
            run(nodes)
        order = {node.sequence_nr: index for index, node in enumerate(nodes)}
        sequences.append([order[event.sequence_nr] for event in prof.events])
    assert sequences[0] == sequences[1] == [2, 1, 0]


def test_threads_share_a_gradient_free_graph():
    """Each backward has its own dependency counts: every node of the shared
    graph runs once per call."""
    counts = {}
    lock = threading.Lock()

    class Counted:
        def __init__(self, index):
            self.index = index

        def run(self):
            with lock:
                counts[self.index] = counts.get(self.index, 0) + 1

    nodes = []
    for index in range(200):
        edges = [Edge(nodes[index - 1], 0)] + ([Edge(nodes[index // 2], 0)] if index > 1 else []) \
            if index else []
        nodes.append(GradientFreeNode(Counted(index), "run", edges))
    errors = []

    def worker():
        try:
            for _ in range(20):
                run(nodes)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert counts == {index: 80 for index in range(200)}


# -- micrograd's way: closures that write the gradients -----------------------------------------

class Scalar:
    """A scalar whose backward adds into its inputs' ``.grad``, as micrograd's
    Value does; its node is gradient-free."""

    def __init__(self, data, inputs=(), backward=None):
        self.data = data
        self.grad = 0.0
        self._inputs = inputs
        self._backward_formula = backward
        self.node = GradientFreeNode(self, "backward_step",
                                     [x.node_edge for x in inputs if x.node is not None]) \
            if inputs else None
        self.node_edge = Edge(self.node, 0) if self.node is not None else None

    def backward_step(self):
        self._backward_formula(self)

    def __mul__(self, other):
        def backward(out):
            self.grad += other.data * out.grad
            other.grad += self.data * out.grad
        return Scalar(self.data * other.data, (self, other), backward)

    def __add__(self, other):
        def backward(out):
            self.grad += out.grad
            other.grad += out.grad
        return Scalar(self.data + other.data, (self, other), backward)

    def sin(self):
        def backward(out):
            self.grad += np.cos(self.data) * out.grad
        return Scalar(np.sin(self.data), (self,), backward)


def test_closures_that_write_gradients_get_the_analytic_derivatives():
    a, b = Scalar(0.7), Scalar(-1.3)
    c = a * b
    d = c.sin() + a * a
    e = d * c + b
    e.grad = 1.0
    pyengine.get_default_engine().execute([e.node_edge], [None], True, False, True)
    # e = (sin(ab) + a^2) ab + b
    ab = 0.7 * -1.3
    de_da = (np.cos(ab) * -1.3 + 2 * 0.7) * ab + (np.sin(ab) + 0.49) * -1.3
    de_db = (np.cos(ab) * 0.7) * ab + (np.sin(ab) + 0.49) * 0.7 + 1.0
    np.testing.assert_allclose([a.grad, b.grad], [de_da, de_db], rtol=1e-12)


class CoreScalar:
    """A Scalar whose node is the core's own GradientFreeNodeBase, kept with
    its Edge among the value's attributes (as a framework that makes its
    nodes at forward keeps them), so that copying the value copies them."""

    def __init__(self, data, inputs=(), backward=None):
        self.data = data
        self.grad = 0.0
        self.inputs = inputs
        self._backward_formula = backward
        edges = tuple(x.edge for x in inputs if x.edge is not None)
        self.edge = _core.Edge(_core.GradientFreeNodeBase(self, "backward_step", edges), 0) \
            if inputs else None

    def backward_step(self):
        self._backward_formula(self)

    def __mul__(self, other):
        def backward(out):
            out.inputs[0].grad += out.inputs[1].data * out.grad
            out.inputs[1].grad += out.inputs[0].data * out.grad
        return CoreScalar(self.data * other.data, (self, other), backward)

    def __add__(self, other):
        def backward(out):
            out.inputs[0].grad += out.grad
            out.inputs[1].grad += out.grad
        return CoreScalar(self.data + other.data, (self, other), backward)


def core_program():
    """e = (a b + a) b, with a = 0.5, b = -2: de/da = (b + 1) b = 2,
    de/db = 2 a b + a = -1.5."""
    a, b = CoreScalar(0.5), CoreScalar(-2.0)
    c = a * b
    d = c + a
    return a, b, d * b


def backward_of(root):
    root.grad = 1.0
    pyengine.get_default_engine().execute([root.edge], [None], True, False, True)


def test_a_deep_copy_of_values_copies_their_gradient_free_graph():
    a, b, e = core_program()
    a2, b2, e2 = copy.deepcopy((a, b, e))
    node, copied = e.edge.node, e2.edge.node
    assert type(copied) is _core.GradientFreeNodeBase and copied is not node
    assert copied.owner is e2 and copied.method == "backward_step"
    assert copied.sequence_nr > node.sequence_nr  # a new node
    d2 = e2.inputs[0]
    assert copied.next_edges == (d2.edge,) and d2.edge.node.owner is d2
    assert d2.edge.node.next_edges == (d2.inputs[0].edge,)  # c's node; a is a leaf
    # The copy is the same program over the copies; the originals are untouched.
    backward_of(e2)
    assert (a2.grad, b2.grad) == (2.0, -1.5)
    assert (a.grad, b.grad) == (0.0, 0.0)
    backward_of(e)
    assert (a.grad, b.grad) == (2.0, -1.5)


def test_copy_and_pickle_of_an_edge_and_a_gradient_free_node():
    node = _core.GradientFreeNodeBase(Picklable(3), "run")
    edge = _core.Edge(node, 1)
    shallow = copy.copy(edge)
    assert shallow is not edge and shallow == edge  # the same node and slot
    restored = pickle.loads(pickle.dumps(edge))
    assert restored.input_nr == 1 and restored.node.method == "run"
    assert restored.node.owner.tag == 3 and restored.node is not node
    assert repr(edge) == "Edge(GradientFreeNodeBase, 1)"  # a core node has no name()


class Picklable:
    def __init__(self, tag):
        self.tag = tag

    def run(self):
        pass


# -- the contract -------------------------------------------------------------------------------

def test_apply_calls_the_method_and_returns_a_none_per_edge():
    log = []
    bottom = build([[]], True, log)[0]
    node = GradientFreeNode(Recorder("node", log), "run", [Edge(bottom, 0), None])
    assert node.apply([]) == [None, None]
    assert log == ["node"]
    assert isinstance(node, pyengine.Node)
    assert node.next_functions == ((bottom, 0), (None, 0))


def test_the_method_is_looked_up_when_the_node_runs():
    log = []
    owner = Recorder("first", log)
    node = GradientFreeNode(owner, "run")
    owner.run = lambda: log.append("replaced")
    run([node])
    assert log == ["replaced"]


def test_method_must_be_a_name():
    with pytest.raises(TypeError, match="method must be a str"):
        GradientFreeNode(Recorder("x", []), Recorder.run)


def test_an_apply_override_runs_and_its_gradients_flow():
    """A subclass's ``apply`` is what the engine calls, in a graph of
    gradient-free nodes only and in a mixed one: here it passes a gradient
    on, which the plain node below receives (its analytic value: 3 times
    the root's)."""
    log = []

    class Overrides(GradientFreeNode):
        def apply(self, grads):
            log.append(("apply", self.owner.tag))
            return [3.0 * grads[0]]

    class Sink(Node):
        def apply(self, grads):
            log.append(("sink", list(grads)))
            return []

    bottom = GradientFreeNode(Recorder("bottom", log), "run")
    top = Overrides(Recorder("top", log), "run", [Edge(bottom, 0)])
    pyengine.get_default_engine().execute([Edge(top, 0)], [np.ones(2)], True, False, True)
    assert log == [("apply", "top"), "bottom"]  # owner.run of top did not run

    log.clear()
    sink = Sink(input_metadata=[((2,), np.float64)])
    top = Overrides(Recorder("top", log), "run", [Edge(sink, 0)],
                    input_metadata=[((2,), np.float64)])
    pyengine.get_default_engine().execute([Edge(top, 0)], [np.ones(2)], True, False, True)
    assert log[0] == ("apply", "top")
    assert log[1][0] == "sink"
    np.testing.assert_array_equal(log[1][1][0], np.full(2, 3.0))


def test_a_subclass_may_name_itself():
    class Named(GradientFreeNode):
        def name(self):
            return "Named"

    assert Named(Recorder("x", []), "run").name() == "Named"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False
