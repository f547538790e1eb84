"""What a running Node asks the engine: ``task_should_compute_output`` and
``task_buffered_gradient`` (See Note [Queries a running node makes] in
pyengine/_shared/task_queries.py), and the per-class ``gradient_policy``
validate_outputs honours (See Note [Gradient policy] in
pyengine/_pure/node.py). The suite runs once per core.

Oracles:

- torch 2.13 on the same graph: in a custom Function's backward,
  ``torch._C._will_engine_execute_node`` of each of the node's next
  functions is what PyTorch's ``Node::task_should_compute_output`` reads
  (the current graph task's exec_info); ``grad(inputs=)`` is compared on
  non-leaf inputs, where torch answers for captures;
- analytic: under ``backward(inputs=)`` / ``grad(inputs=)`` an edge is used
  when it leads to an input's node or to a node with a path to one; a
  buffered sum is the sum of the gradients of the producers that ran
  before, in the order the engine ran them (later made, earlier run);
- ``gradient_policy``: the gradient the next node receives (unchanged under
  "exact", summed or cast under "reduce"), and the error's words.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from minitensor import T, leaf

import pyengine
from pyengine import Edge, Node
from pyengine._core import validate_outputs

# -- a graph built the same way in pyengine and in torch ---------------------------------

class Mix(Node):
    """Sums its inputs in forward; backward passes the gradient to every
    input, recording what it was told about its next edges."""

    def __init__(self, next_edges, input_metadata, tag, log):
        super().__init__(next_edges=next_edges, input_metadata=input_metadata)
        self.tag = tag
        self.log = log

    def apply(self, grads):
        self.log[self.tag] = [self.task_should_compute_output(i) for i in range(len(self.next_edges))]
        return [grads[0]] * len(self.next_edges)


def mix(inputs, tag, log):
    out = T(sum(value.data for value in inputs))
    edges = [pyengine.gradient_edge(value) if value.requires_grad else None for value in inputs]
    out.grad_fn = Mix(edges, [out.data], tag, log)
    out.requires_grad = True
    return out


def random_graph(seed, num_leaves=4, num_nodes=7):
    """A spec: per node, the indices (leaves first, then nodes in order) of
    its inputs; index -1 is a constant that requires no gradient."""
    rng = np.random.RandomState(seed)
    spec = []
    for k in range(num_nodes):
        available = num_leaves + k
        # The first input requires a gradient, as in torch a Function of
        # constants only makes no node.
        inputs = [int(rng.randint(0, available))]
        inputs += [int(rng.randint(-1, available)) for _ in range(rng.randint(0, 3))]
        if k == num_nodes - 1:
            # The output depends on the node before it, so that most nodes run.
            inputs.append(available - 1)
        spec.append(inputs)
    return spec


def build_pyengine(spec, num_leaves, log):
    leaves = [leaf(np.full(2, float(i + 1))) for i in range(num_leaves)]
    constant = T(np.ones(2))
    values = list(leaves)
    for k, inputs in enumerate(spec):
        values.append(mix([constant if i < 0 else values[i] for i in inputs], k, log))
    return values


def build_torch(torch, spec, num_leaves, log):
    class TorchMix(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tag, *inputs):
            ctx.tag = tag
            return sum(inputs)

        @staticmethod
        def backward(ctx, grad):
            # One next function per tensor input: the tag has none.
            log[ctx.tag] = [False if node is None else torch._C._will_engine_execute_node(node)
                            for node, _ in ctx.next_functions]
            return (None,) + (grad,) * len(ctx.next_functions)

    leaves = [torch.full((2,), float(i + 1), dtype=torch.float64, requires_grad=True)
              for i in range(num_leaves)]
    constant = torch.ones(2, dtype=torch.float64)
    values = list(leaves)
    for k, inputs in enumerate(spec):
        values.append(TorchMix.apply(k, *[constant if i < 0 else values[i] for i in inputs]))
    return values


def analytic_answers(spec, num_leaves, wanted, accumulate_grad):
    """Per node that runs, per edge, whether it is used, by the rule of
    init_to_execute: a node is needed when it is an input's node
    (``backward(inputs=)``) or an edge of it leads to a node that is needed
    or captures; an input's node captures under ``grad``."""
    num_values = num_leaves + len(spec)
    # Whether a value's node runs or captures (should_execute), and whether
    # it runs (needed). Nodes only point to lower indices: one pass up.
    used = [index in wanted for index in range(num_values)]
    needed = [accumulate_grad and index in wanted for index in range(num_values)]
    for k, inputs in enumerate(spec):
        value = num_leaves + k
        if any(i >= 0 and used[i] for i in inputs):
            used[value] = needed[value] = True
    # A node runs when it is needed and a node that runs (or the root,
    # the last value) sends it a gradient.
    runs = {}
    root = num_values - 1
    for k in reversed(range(len(spec))):
        value = num_leaves + k
        reached = value == root or any(value in spec[j] and (num_leaves + j) in runs
                                       for j in range(len(spec)))
        if reached and needed[value]:
            runs[value] = [i >= 0 and used[i] for i in spec[k]]
    return {value - num_leaves: answer for value, answer in runs.items()}


SEEDS = range(12)


@pytest.mark.parametrize("seed", SEEDS)
def test_should_compute_output_matches_torch_under_backward_inputs(torch, seed):
    num_leaves = 4
    spec = random_graph(seed, num_leaves)
    rng = np.random.RandomState(100 + seed)
    wanted = sorted(set(int(i) for i in rng.choice(num_leaves, size=rng.randint(1, 3))))
    ours, theirs = {}, {}
    values = build_pyengine(spec, num_leaves, ours)
    torch_values = build_torch(torch, spec, num_leaves, theirs)
    pyengine.backward(values[-1], np.ones(2), inputs=[values[i] for i in wanted])
    torch.autograd.backward(torch_values[-1], torch.ones(2, dtype=torch.float64),
                            inputs=[torch_values[i] for i in wanted])
    assert ours == theirs
    assert ours == analytic_answers(spec, num_leaves, wanted, accumulate_grad=True)


@pytest.mark.parametrize("seed", SEEDS)
def test_should_compute_output_matches_torch_under_grad_of_non_leaves(torch, seed):
    num_leaves = 4
    spec = random_graph(seed, num_leaves)
    rng = np.random.RandomState(200 + seed)
    # Non-leaf inputs below the output: torch answers for those under grad().
    candidates = list(range(num_leaves, num_leaves + len(spec) - 1))
    wanted = sorted(set(int(i) for i in rng.choice(candidates, size=2)))
    ours, theirs = {}, {}
    values = build_pyengine(spec, num_leaves, ours)
    torch_values = build_torch(torch, spec, num_leaves, theirs)
    pyengine.grad(values[-1], [values[i] for i in wanted], np.ones(2), allow_unused=True)
    torch.autograd.grad(torch_values[-1], [torch_values[i] for i in wanted],
                        torch.ones(2, dtype=torch.float64), allow_unused=True)
    assert ours == theirs
    assert ours == analytic_answers(spec, num_leaves, wanted, accumulate_grad=False)


@pytest.mark.parametrize("seed", SEEDS)
def test_should_compute_output_under_grad_of_leaves(seed):
    num_leaves = 4
    spec = random_graph(seed, num_leaves)
    wanted = [seed % num_leaves]
    ours = {}
    values = build_pyengine(spec, num_leaves, ours)
    pyengine.grad(values[-1], [values[i] for i in wanted], np.ones(2), allow_unused=True)
    assert ours == analytic_answers(spec, num_leaves, wanted, accumulate_grad=False)


def test_without_pruning_every_edge_is_used_but_a_missing_one():
    log = {}
    x = leaf(np.ones(2))
    out = mix([x, T(np.ones(2)), x], "only", log)
    pyengine.backward(out, np.ones(2))
    assert log == {"only": [True, False, True]}
    np.testing.assert_array_equal(x.grad, [2.0, 2.0])


# -- where the queries may be asked ----------------------------------------------------------

class Asker(Node):
    """Runs ``ask(self)`` in apply and returns ones for every edge."""

    def __init__(self, next_edges=(), input_metadata=(), ask=None):
        super().__init__(next_edges=next_edges, input_metadata=input_metadata)
        self.ask = ask
        self.answers = []

    def apply(self, grads):
        if self.ask is not None:
            self.answers.append(self.ask(self))
        return [None if edge is None else np.ones(2) for edge in self.next_edges]


def run(root, keep_graph=True):
    pyengine.get_default_engine().execute([Edge(root, 0)], [np.ones(2)], keep_graph, False, True)


@pytest.mark.parametrize("query", ["task_should_compute_output", "task_buffered_gradient"])
def test_outside_backward_is_an_error_naming_the_node(query):
    x = leaf(np.ones(2))
    node = Asker([pyengine.gradient_edge(x)], [((2,), np.float64)])
    with pytest.raises(RuntimeError, match=rf"Asker\.{query}\(\) can only be called while the "
                                            r"engine runs Asker .*no node runs on this thread"):
        getattr(node, query)(0)


@pytest.mark.parametrize("query", ["task_should_compute_output", "task_buffered_gradient"])
def test_asking_for_another_node_is_an_error_naming_both(query):
    class Other(Asker):
        pass

    x = leaf(np.ones(2))
    other = Other([pyengine.gradient_edge(x)], [((2,), np.float64)])
    errors = []

    def ask(node):
        try:
            getattr(other, query)(0)
        except RuntimeError as error:
            errors.append(str(error))

    root = Asker([Edge(other, 0)], [((2,), np.float64)], ask=ask)
    run(root)
    assert len(errors) == 1
    assert f"Other.{query}() can only be called while the engine runs Other" in errors[0]
    assert "but Asker runs on this thread" in errors[0]


def test_from_a_final_callback_is_an_error():
    x = leaf(np.ones(2))
    errors = []

    def callback():
        try:
            node.task_should_compute_output(0)
        except RuntimeError as error:
            errors.append(str(error))

    node = Asker([pyengine.gradient_edge(x)], [((2,), np.float64)],
                 ask=lambda node: pyengine.queue_callback(callback))
    run(node)
    assert len(errors) == 1 and "no node runs on this thread" in errors[0]
    # The node's own query worked while it ran, and the engine still does.
    node.ask = lambda node: node.task_should_compute_output(0)
    run(node)
    assert node.answers[-1] is True


def test_from_hooks_of_the_running_node():
    x = leaf(np.ones(2))
    node = Asker([pyengine.gradient_edge(x), None], [((2,), np.float64)])
    seen = []
    node.register_prehook(lambda grads: seen.append(
        ("pre", node.task_should_compute_output(0), node.task_should_compute_output(1))))
    node.register_hook(lambda grad_inputs, grad_outputs: seen.append(
        ("post", node.task_should_compute_output(0), node.task_buffered_gradient(0))))
    run(node)
    assert seen == [("pre", True, False), ("post", True, None)]


@pytest.mark.parametrize("query", ["task_should_compute_output", "task_buffered_gradient"])
@pytest.mark.parametrize("index", [2, -1, 10**30])
def test_index_out_of_range_names_node_index_and_edges(query, index):
    x = leaf(np.ones(2))
    errors = []

    def ask(node):
        try:
            getattr(node, query)(index)
        except IndexError as error:
            errors.append(str(error))

    node = Asker([pyengine.gradient_edge(x), None], [((2,), np.float64)], ask=ask)
    run(node)
    assert errors == [f"Asker.{query}(): output_edge_index {index} is out of range for "
                      "Asker's 2 next edges"]


@pytest.mark.parametrize("query", ["task_should_compute_output", "task_buffered_gradient"])
@pytest.mark.parametrize("index", [0.0, "0", None])
def test_index_must_be_an_int(query, index):
    errors = []

    def ask(node):
        try:
            getattr(node, query)(index)
        except TypeError as error:
            errors.append(str(error))

    node = Asker([None], [((2,), np.float64)], ask=ask)
    run(node)
    assert errors == [f"Asker.{query}(): output_edge_index must be an int, got {type(index).__name__}"]


def test_numpy_integer_index():
    x = leaf(np.ones(2))
    node = Asker([pyengine.gradient_edge(x)], [((2,), np.float64)],
                 ask=lambda node: node.task_should_compute_output(np.int64(0)))
    run(node)
    assert node.answers == [True]


class EdgesSwap:
    """An index whose ``__index__`` gives the running node ``edges`` first:
    the query must answer for the edges the node has once the index is
    known (the compiled core read them before: a stale tuple)."""

    def __init__(self, node_edges, index):
        self.node_edges = node_edges
        self.index = index
        self.node = None

    def __index__(self):
        self.node.next_edges = self.node_edges
        return self.index


@pytest.mark.parametrize("query", ["task_should_compute_output", "task_buffered_gradient"])
def test_an_index_that_shrinks_the_edges_is_out_of_range_of_the_new_ones(query):
    x = leaf(np.ones(2))
    errors = []
    swap = EdgesSwap([pyengine.gradient_edge(x)], 2)

    def ask(node):
        swap.node = node
        edges = node.next_edges
        try:
            getattr(node, query)(swap)
        except IndexError as error:
            errors.append(str(error))
        # The engine checks the gradients against the edges it ran the node with.
        node.next_edges = edges

    run(Asker([None, None, pyengine.gradient_edge(x)], [((2,), np.float64)], ask=ask))
    assert errors == [f"Asker.{query}(): output_edge_index 2 is out of range for "
                      "Asker's 1 next edges"]


@pytest.mark.parametrize("before, after, index, answer", [
    (2, [None, None], 1, False),
    # Edges that grow: the index is past the end of the ones read before.
    (1, [None, None, "x"], 2, True),
])
def test_an_index_that_swaps_the_edges_answers_for_the_new_ones(before, after, index, answer):
    x = leaf(np.ones(2))
    swap = EdgesSwap([pyengine.gradient_edge(x) if edge == "x" else edge for edge in after], index)

    def ask(node):
        swap.node = node
        edges = node.next_edges
        asked = node.task_should_compute_output(swap)
        node.next_edges = edges
        return asked

    node = Asker([pyengine.gradient_edge(x)] * before, [((2,), np.float64)], ask=ask)
    run(node)
    assert node.answers == [answer]


# -- reentrant backward ------------------------------------------------------------------------

def test_reentrant_backward_answers_for_each_task():
    """The outer node asks before and after a nested grad(inputs=) on
    another graph; the nested node answers for the nested task; the outer
    node's own query from inside the nested node is refused."""
    outer_x, outer_y = leaf(np.ones(2)), leaf(np.ones(2))
    nested_log = {}
    outer_answers = []
    refused = []

    class Outer(Node):
        def apply(self, grads):
            outer_answers.append([self.task_should_compute_output(i) for i in range(2)])
            a, b = leaf(np.ones(2)), leaf(np.ones(2))
            inner = mix([a, b], "inner", nested_log)

            def refuse(grads):
                try:
                    self.task_should_compute_output(0)
                except RuntimeError as error:
                    refused.append(str(error))

            inner.grad_fn.register_prehook(refuse)
            (grad_b,) = pyengine.grad(inner, [b], np.ones(2))
            np.testing.assert_array_equal(grad_b, [1.0, 1.0])
            outer_answers.append([self.task_should_compute_output(i) for i in range(2)])
            return [grads[0], grads[0]]

    out = T(np.ones(2))
    out.grad_fn = Outer([pyengine.gradient_edge(outer_x), pyengine.gradient_edge(outer_y)],
                        [out.data])
    out.requires_grad = True
    pyengine.backward(out, np.ones(2), inputs=[outer_y])
    assert outer_answers == [[False, True], [False, True]]
    assert nested_log == {"inner": [False, True]}
    assert len(refused) == 1 and "but Mix runs on this thread" in refused[0]
    assert outer_x.grad is None
    np.testing.assert_array_equal(outer_y.grad, [1.0, 1.0])


def test_reentrant_backward_on_a_pool_thread(engine_with_depth):
    """Past max_recursion_depth the nested task runs on a pool thread: its
    node answers there, and the outer node answers again once it is back."""
    engine_with_depth(0)
    nested_log = {}
    outer_answers = []
    x = leaf(np.ones(2))

    class Outer(Node):
        def apply(self, grads):
            a, b, c = leaf(np.ones(2)), leaf(np.ones(2)), leaf(np.ones(2))
            inner = mix([a, b, c], "inner", nested_log)
            pyengine.backward(inner, np.ones(2), inputs=[a, c])
            np.testing.assert_array_equal(c.grad, [1.0, 1.0])
            assert b.grad is None
            outer_answers.append(self.task_should_compute_output(0))
            return [grads[0]]

    out = T(np.ones(2))
    out.grad_fn = Outer([pyengine.gradient_edge(x)], [out.data])
    out.requires_grad = True
    pyengine.backward(out, np.ones(2))
    assert nested_log == {"inner": [True, False, True]}
    assert outer_answers == [True]


def test_from_an_owner_graph_walk_in_a_node_is_an_error():
    """An owner graph's walk makes its own graph task current and runs no
    Node: the node whose apply started it cannot ask from an owner's
    backward (See Note [Queries a running node makes])."""
    errors = []

    class Value:
        def __init__(self, parents=()):
            self._prev = parents

        def _backward(self):
            try:
                node.task_should_compute_output(0)
            except RuntimeError as error:
                errors.append(str(error))

    def ask(node):
        pyengine.OwnerGraph("_prev", "_backward").backward(Value((Value(),)))
        return node.task_should_compute_output(0)

    x = leaf(np.ones(2))
    node = Asker([pyengine.gradient_edge(x)], [((2,), np.float64)], ask=ask)
    run(node)
    assert len(errors) == 1 and "no node runs on this thread" in errors[0]
    assert node.answers == [True]


# -- threads -----------------------------------------------------------------------------------

def test_each_thread_sees_its_own_graph_task():
    """Two threads run backward(inputs=) with different inputs on one
    retained graph; both are inside the shared node's apply at once (a
    barrier), and each sees its own pruning."""
    p, q = leaf(np.ones(2)), leaf(np.ones(2))
    barrier = threading.Barrier(2, timeout=30)
    answers = {}

    class Shared(Node):
        def apply(self, grads):
            barrier.wait()
            first = [self.task_should_compute_output(i) for i in range(2)]
            barrier.wait()
            answers[threading.current_thread().name] = (
                first, [self.task_should_compute_output(i) for i in range(2)])
            return [grads[0], grads[0]]

    out = T(np.ones(2))
    out.grad_fn = Shared([pyengine.gradient_edge(p), pyengine.gradient_edge(q)], [out.data])
    out.requires_grad = True
    errors = []

    def worker(wanted):
        try:
            pyengine.backward(out, np.ones(2), inputs=[wanted], retain_graph=True)
        except BaseException as error:  # reported below, with the thread's answers
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(p,), name="wants-p"),
               threading.Thread(target=worker, args=(q,), name="wants-q")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert answers == {"wants-p": ([True, False], [True, False]),
                       "wants-q": ([False, True], [False, True])}
    np.testing.assert_array_equal(p.grad, [1.0, 1.0])
    np.testing.assert_array_equal(q.grad, [1.0, 1.0])


def test_a_node_on_a_device_thread_asks_its_graph_task():
    """A node on a fake device runs on that device's worker thread, which
    has its own thread state: the query answers there for the caller's
    graph task."""
    from pyengine import fake_device

    device = fake_device.device(0)
    p, q = leaf(np.ones(3)), leaf(np.ones(3))
    seen = []

    class OnDevice(Node):
        def apply(self, grads):
            seen.append((threading.current_thread().name,
                         [self.task_should_compute_output(i) for i in range(2)]))
            host = grads[0].numpy() * 2.0
            return [host, host]

    node = OnDevice([pyengine.gradient_edge(p), pyengine.gradient_edge(q)],
                    [pyengine.InputMetadata((3,), np.float64, device)])
    (grad_q,) = pyengine.get_default_engine().execute(
        [Edge(node, 0)], [fake_device.to_fake(np.ones(3), device)], False, False, False,
        [pyengine.gradient_edge(q)])
    assert seen == [("pyengine-fake:0", [False, True])]
    np.testing.assert_array_equal(grad_q, [2.0, 2.0, 2.0])


# -- the buffered sum --------------------------------------------------------------------------

class Sink(Node):
    """Records the gradients it receives."""

    def __init__(self, input_metadata):
        super().__init__(next_edges=(), input_metadata=input_metadata)
        self.received = []

    def apply(self, grads):
        self.received.append([None if grad is None else np.array(grad) for grad in grads])
        return []


class Producer(Node):
    """Sends ``value`` along each edge; records the buffered sums it was
    shown, and mutates what it got (the caller owns a copy)."""

    def __init__(self, next_edges, value, order):
        super().__init__(next_edges=next_edges, input_metadata=[((2,), np.float64)])
        self.value = value
        self.order = order
        self.seen = []

    def apply(self, grads):
        self.order.append(self)
        for i in range(len(self.next_edges)):
            buffered = self.task_buffered_gradient(i)
            self.seen.append(None if buffered is None else np.array(buffered))
            if buffered is not None:
                buffered *= 1000.0
        return [np.full(2, self.value) for _ in self.next_edges]


class FanOut(Node):
    def apply(self, grads):
        return [grads[0]] * len(self.next_edges)


@pytest.mark.parametrize("retain", [True, False])
def test_buffered_sum_at_fan_in_is_the_partial_sum_in_engine_order(retain):
    sink = Sink([((2,), np.float64)])
    order = []
    producers = [Producer([Edge(sink, 0)], 10.0 ** k, order) for k in range(4)]
    root = FanOut([Edge(producer, 0) for producer in producers], [((2,), np.float64)])
    run(root, keep_graph=retain)
    # Later made, earlier run: See Note [Ties in the ready queue].
    assert order == producers[::-1]
    total = 0.0
    for producer in order:
        if total == 0.0:
            assert producer.seen == [None]
        else:
            np.testing.assert_array_equal(producer.seen[0], [total, total])
        total += producer.value
    # What a producer did to its copy changed nothing.
    np.testing.assert_array_equal(sink.received[0][0], [1111.0, 1111.0])


def test_buffered_sum_per_slot_missing_edge_and_pruned_node():
    sink = Sink([((2,), np.float64), ((2,), np.float64)])
    x = leaf(np.ones(2))
    order = []
    first = Producer([Edge(sink, 1), Edge(sink, 0)], 1.0, order)
    second = Producer([Edge(sink, 0), None, Edge(sink, 1), pyengine.gradient_edge(x)], 5.0, order)
    root = FanOut([Edge(first, 0), Edge(second, 0)], [((2,), np.float64)])
    run(root)
    assert order == [second, first]
    # second runs first: nothing is buffered yet, nor ever for None or a
    # leaf's single producer.
    assert second.seen == [None, None, None, None]
    # first runs after second: slot 1 holds 5, slot 0 holds 5.
    np.testing.assert_array_equal(first.seen[0], [5.0, 5.0])
    np.testing.assert_array_equal(first.seen[1], [5.0, 5.0])
    np.testing.assert_array_equal(sink.received[0][0], [6.0, 6.0])
    np.testing.assert_array_equal(sink.received[0][1], [6.0, 6.0])

    # Under backward(inputs=x) the sink is pruned: no buffer is made for it.
    order.clear()
    first.seen.clear()
    second.seen.clear()
    pyengine.get_default_engine().execute([Edge(root, 0)], [np.ones(2)], True, False, True,
                                          [pyengine.gradient_edge(x)])
    assert order == [second]
    assert second.seen == [None, None, None, None]


def test_buffered_sum_of_an_indexed_gradient_is_a_copy():
    sink = Sink([((4,), np.float64)])
    seen = []

    class Sparse(Node):
        def apply(self, grads):
            return [pyengine.IndexedGradient(np.array([1]), np.array([3.0]), (4,))]

    class Reader(Node):
        def apply(self, grads):
            seen.append(self.task_buffered_gradient(0))
            return [np.ones(4)]

    reader = Reader([Edge(sink, 0)], [((2,), np.float64)])
    sparse = Sparse([Edge(sink, 0)], [((2,), np.float64)])
    # sparse is made after reader: it runs first.
    root = FanOut([Edge(reader, 0), Edge(sparse, 0)], [((2,), np.float64)])
    run(root)
    assert type(seen[0]) is pyengine.IndexedGradient
    np.testing.assert_array_equal(seen[0].to_dense(), [0.0, 3.0, 0.0, 0.0])
    np.testing.assert_array_equal(sink.received[0][0], [1.0, 4.0, 1.0, 1.0])


# -- gradient_policy ---------------------------------------------------------------------------

class Returns(Node):
    """Returns ``gradient`` along its one edge."""

    def __init__(self, next_edges, gradient):
        super().__init__(next_edges=next_edges, input_metadata=[((2,), np.float64)])
        self.gradient = gradient

    def apply(self, grads):
        return [self.gradient]


class ReturnsExact(Returns):
    gradient_policy = "exact"


def run_into(node_class, slot, gradient, hooked=False):
    sink = Sink([slot])
    node = node_class([Edge(sink, 0)], gradient)
    if hooked:
        # The shared call_function, which hooks take.
        node.register_hook(lambda grad_inputs, grad_outputs: None)
    run(node)
    return sink.received[0][0]


def test_default_policy_is_reduce_and_reduces():
    assert Node.gradient_policy == "reduce"
    assert Returns([None], None)._gradient_policy == "reduce"
    received = run_into(Returns, ((3,), np.float64), np.ones((2, 3), np.float32))
    assert received.dtype == np.float64
    np.testing.assert_array_equal(received, [2.0, 2.0, 2.0])


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int8, np.uint16, np.bool_, np.float32,
                                   np.complex128])
def test_exact_accepts_a_gradient_of_the_slot_dtype_and_shape(hooked, dtype):
    gradient = (np.arange(6).reshape(2, 3) % 2).astype(dtype)
    received = run_into(ReturnsExact, ((2, 3), dtype), gradient, hooked)
    assert received.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(received, gradient)


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("slot, gradient, words", [
    (((2, 3), np.float64), np.ones((1, 3)),
     "got shape (1, 3) but expected shape (2, 3)"),
    (((3,), np.float64), np.ones((2, 3)),
     "got shape (2, 3) but expected shape (3,)"),
    (((), np.float64), np.ones(1),
     "got shape (1,) but expected shape ()"),
    (((2,), np.float64), np.ones(2, np.float32),
     "expected dtype float64 but got float32"),
    (((2,), np.int64), np.ones(2, np.int32),
     "expected dtype int64 but got int32"),
    (((2,), np.float64), np.ones(2, np.int64),
     "expected dtype float64 but got int64"),
])
def test_exact_rejects_a_mismatch_naming_node_index_expected_and_got(hooked, slot, gradient, words):
    with pytest.raises(RuntimeError) as raised:
        run_into(ReturnsExact, slot, gradient, hooked)
    message = str(raised.value)
    assert message.startswith("Function ReturnsExact returned an invalid gradient at index 0 - ")
    assert words in message


def test_reduce_still_reduces_what_exact_rejects():
    # The oracle of the row above: PyTorch's rule accepts these.
    np.testing.assert_array_equal(run_into(Returns, ((3,), np.float64), np.ones((2, 3))), [2.0] * 3)
    assert run_into(Returns, ((), np.float64), np.ones(1)) == 1.0
    assert run_into(Returns, ((2,), np.float64), np.ones(2, np.int64)).dtype == np.float64


def test_exact_names_the_index_of_the_bad_gradient():
    sink = Sink([((2,), np.float64), ((2,), np.float64)])

    class Two(Node):
        gradient_policy = "exact"

        def apply(self, grads):
            return [np.ones(2), np.ones(2, np.float32)]

    node = Two([Edge(sink, 0), Edge(sink, 1)], [((2,), np.float64)])
    with pytest.raises(RuntimeError, match=r"Function Two returned an invalid gradient at index 1 - "
                                           r"expected dtype float64 but got float32"):
        run(node)


BAD_POLICIES = [
    ("sum", ValueError, "gradient_policy must be 'reduce' or 'exact', got 'sum'"),
    ("Exact", ValueError, "gradient_policy must be 'reduce' or 'exact', got 'Exact'"),
    (None, TypeError, "gradient_policy must be a str, 'reduce' or 'exact', got NoneType"),
    (1, TypeError, "gradient_policy must be a str, 'reduce' or 'exact', got int"),
    (b"exact", TypeError, "gradient_policy must be a str, 'reduce' or 'exact', got bytes"),
]


@pytest.mark.parametrize("policy, error, words", BAD_POLICIES)
def test_bad_policy_is_refused_when_the_class_is_made_naming_it(policy, error, words):
    with pytest.raises(error) as raised:
        class Bad(Node):
            gradient_policy = policy
    assert str(raised.value).endswith(f".Bad: {words}")
    assert str(raised.value).startswith("Node class ")


@pytest.mark.parametrize("policy, error, words", BAD_POLICIES)
def test_bad_policy_set_later_is_refused_where_it_is_read_naming_the_class(policy, error, words):
    sink = Sink([((2,), np.float64)])

    class Bad(Returns):
        pass

    good = Bad([Edge(sink, 0)], np.ones(2))
    mismatched = Bad([Edge(sink, 0)], np.ones((3, 2)))
    Bad.gradient_policy = policy
    # The fast path reads no policy: a gradient that is its slot's array passes.
    run(good)
    np.testing.assert_array_equal(sink.received[-1][0], np.ones(2))
    with pytest.raises(error) as raised:
        run(mismatched)
    assert str(raised.value) == f"Node class {Bad.__qualname__}: {words}"
    with pytest.raises(error):
        _ = mismatched._gradient_policy


def test_a_str_subclass_equal_to_a_policy_is_that_policy():
    class Policy(str):
        pass

    class Subclassed(Returns):
        gradient_policy = Policy("exact")

    node = Subclassed([None], None)
    assert node._gradient_policy == "exact" and type(node._gradient_policy) is str


def test_policy_is_the_class_s_when_a_gradient_is_checked():
    class Changing(Returns):
        gradient_policy = "exact"

    node = Changing([None], None)
    assert node._gradient_policy == "exact"
    Changing.gradient_policy = "reduce"
    assert node._gradient_policy == "reduce"
    # An instance attribute is not the class's, and the field is read-only.
    node.gradient_policy = "exact"
    assert node._gradient_policy == "reduce"
    with pytest.raises(AttributeError):
        node._gradient_policy = "exact"
    # The class's value when the node runs decides: made under "reduce",
    # run under "exact", a broadcast is rejected; and back.
    sink = Sink([((2,), np.float64)])
    made_reduce = Changing([Edge(sink, 0)], np.ones((3, 2)))
    Changing.gradient_policy = "exact"
    with pytest.raises(RuntimeError, match=r"got shape \(3, 2\) but expected shape \(2,\)"):
        run(made_reduce)
    Changing.gradient_policy = "reduce"
    run(Changing([Edge(sink, 0)], np.ones((3, 2))))
    np.testing.assert_array_equal(sink.received[-1][0], [3.0, 3.0])


def test_validate_outputs_takes_a_policy():
    sink = Sink([((2,), np.float64)])
    grads = [np.ones(2, np.float32)]
    validate_outputs([Edge(sink, 0)], grads, lambda message: message)
    assert grads[0].dtype == np.float64
    with pytest.raises(RuntimeError, match="expected dtype float64 but got float32"):
        validate_outputs([Edge(sink, 0)], [np.ones(2, np.float32)], lambda message: message, "exact")
    with pytest.raises(ValueError, match="validate_outputs: gradient_policy must be"):
        validate_outputs([Edge(sink, 0)], [np.ones(2)], lambda message: message, "strict")


def test_exact_without_metadata_takes_any_value():
    received = run_into(ReturnsExact, None, np.ones((5, 1), np.float32))
    assert received.shape == (5, 1) and received.dtype == np.float32
