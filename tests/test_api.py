"""backward() and grad() with each argument, execution order, AccumulateGrad,
Edge inputs and outputs, and swapping the default engine.

Oracles: analytic gradients, central finite differences, and PyTorch on the
same graph.
"""

import re

import numpy as np
import pytest
from conftest import Counter, tap
from minitensor import T, clone, const, exp, leaf, split

import pyengine
from pyengine import Edge, gradient_edge


def assert_close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-12, atol=1e-12)


# -- backward ----------------------------------------------------------------------

def test_backward_scalar_implicit_gradient():
    x = leaf([1.0, -2.0, 3.0])
    ((x * x).sum()).backward()
    assert_close(x.grad, 2 * x.data)


def test_backward_grad_tensors():
    x = leaf([1.0, 2.0, 3.0])
    w = leaf([4.0, 5.0, 6.0])
    g = np.array([0.5, -1.0, 2.0])
    pyengine.backward(x * w, grad_tensors=g)
    assert_close(x.grad, g * w.data)
    assert_close(w.grad, g * x.data)


def test_backward_grad_tensors_as_list_for_one_output():
    x = leaf([1.0, 2.0])
    g = np.array([3.0, 4.0])
    pyengine.backward([x * 2.0], [g])
    assert_close(x.grad, 2 * g)


def test_backward_several_roots():
    x = leaf([1.0, 2.0])
    y1 = x * x
    y2 = exp(x)
    g1, g2 = np.array([1.0, -1.0]), np.array([2.0, 0.5])
    pyengine.backward([y1, y2], [g1, g2])
    assert_close(x.grad, g1 * 2 * x.data + g2 * np.exp(x.data))


def test_backward_several_scalar_roots_implicit():
    x = leaf([1.0, 2.0])
    w = leaf([3.0, -1.0])
    pyengine.backward([(x * w).sum(), (x * x).sum()])
    assert_close(x.grad, w.data + 2 * x.data)
    assert_close(w.grad, x.data)


def test_backward_accumulates_over_calls():
    x = leaf([1.0, 2.0])
    (x * 3.0).sum().backward()
    (x * x).sum().backward()
    assert_close(x.grad, 3.0 + 2 * x.data)


def test_leaf_used_twice_fan_out():
    x = leaf([1.0, 2.0, 3.0])
    y = (x * x + x).sum()
    y.backward()
    assert_close(x.grad, 2 * x.data + 1)


def test_diamond_runs_shared_node_once():
    x = leaf([0.5, -1.0])
    e = exp(x)
    h, node = tap(e)
    y = ((h * 2.0) * (h * 3.0)).sum()  # 6 exp(2x)
    y.backward()
    assert node.calls == 1
    assert_close(x.grad, 12 * np.exp(2 * x.data))


def test_leaf_does_not_require_grad_gets_no_grad():
    x = leaf([1.0, 2.0])
    c = const([3.0, 4.0])
    (x * c).sum().backward()
    assert c.grad is None
    assert_close(x.grad, c.data)


# -- backward(inputs=) ---------------------------------------------------------------

def test_backward_inputs_accumulates_only_into_inputs_and_prunes():
    x = leaf([1.0, 2.0])
    w = leaf([3.0, 4.0])
    z = leaf([5.0, 6.0])
    zt, z_branch = tap(z)
    xt, x_branch = tap(x)
    y = (xt * w).sum() + (zt * zt).sum()
    y.backward(inputs=[x])
    assert_close(x.grad, w.data)
    assert w.grad is None and z.grad is None
    assert x_branch.calls == 1
    assert z_branch.calls == 0  # not on a path to x


def test_backward_inputs_single_tensor():
    x = leaf([1.0, 2.0])
    w = leaf([3.0, 4.0])
    (x * w).sum().backward(inputs=w)
    assert_close(w.grad, x.data)
    assert x.grad is None


def test_backward_inputs_non_leaf_gets_grad():
    x = leaf([1.0, 2.0])
    below, below_node = tap(x)
    h = below * 2.0
    y = (h * h).sum()
    y.backward(inputs=[h])
    assert_close(h.grad, 2 * h.data)
    assert x.grad is None
    assert below_node.calls == 0  # below the input: pruned


def test_backward_inputs_leaf_and_non_leaf(torch):
    x = leaf([1.0, -2.0])
    h = exp(x)
    y = (h * x).sum()
    y.backward(inputs=[x, h])
    tx = torch.tensor(x.data, requires_grad=True)
    th = tx.exp()
    (th * tx).sum().backward(inputs=[tx, th])
    assert_close(x.grad, tx.grad.numpy())
    assert_close(h.grad, th.grad.numpy())


def test_backward_inputs_edge_runs_that_node_only():
    x = leaf([1.0, 2.0])
    below, below_node = tap(x)
    h, node = tap(below * 3.0)
    y = (h * h).sum()
    y.backward(inputs=[Edge(node, 0)])
    assert node.calls == 1
    assert below_node.calls == 0
    assert x.grad is None


def test_backward_inputs_unreachable_leaf_is_left_alone():
    x = leaf([1.0, 2.0])
    z = leaf([3.0])
    (x * x).sum().backward(inputs=[z])
    assert z.grad is None and x.grad is None


# -- grad ----------------------------------------------------------------------------

def test_grad_returns_tuple_and_does_not_touch_dot_grad():
    x = leaf([1.0, 2.0])
    w = leaf([3.0, 4.0])
    y = (x * w).sum()
    gx, gw = pyengine.grad(y, [x, w])
    assert_close(gx, w.data)
    assert_close(gw, x.data)
    assert x.grad is None and w.grad is None


def test_grad_single_input_not_in_list():
    x = leaf([1.0, 2.0])
    result = pyengine.grad((x * x).sum(), x)
    assert isinstance(result, tuple) and len(result) == 1
    assert_close(result[0], 2 * x.data)


def test_grad_outputs_and_several_outputs():
    x = leaf([1.0, 2.0])
    y1, y2 = x * x, x * 3.0
    g1, g2 = np.array([1.0, 2.0]), np.array([-1.0, 1.0])
    (gx,) = pyengine.grad([y1, y2], [x], grad_outputs=[g1, g2])
    assert_close(gx, 2 * x.data * g1 + 3 * g2)


def test_grad_prunes_nodes_not_on_a_path():
    x = leaf([1.0, 2.0])
    z = leaf([3.0, 4.0])
    zt, z_branch = tap(z)
    y = (x * x).sum() + zt.sum()
    (gx,) = pyengine.grad(y, x)
    assert_close(gx, 2 * x.data)
    assert z_branch.calls == 0


def test_grad_of_non_leaf_does_not_run_below_it():
    x = leaf([1.0, 2.0])
    below, below_node = tap(x)
    h = below * 2.0
    (gh,) = pyengine.grad((h * h).sum(), h)
    assert_close(gh, 2 * h.data)
    assert below_node.calls == 0
    assert x.grad is None


def test_grad_allow_unused_gives_none():
    x = leaf([1.0, 2.0])
    z = leaf([3.0, 4.0, 5.0])
    gx, gz = pyengine.grad((x * x).sum(), [x, z], allow_unused=True)
    assert_close(gx, 2 * x.data)
    assert gz is None


def test_grad_materialize_grads_gives_zeros():
    x = leaf([1.0, 2.0])
    z = leaf([3.0, 4.0, 5.0], dtype=np.float32)
    gx, gz = pyengine.grad((x * x).sum(), [x, z], materialize_grads=True)
    assert_close(gx, 2 * x.data)
    assert gz.shape == (3,) and gz.dtype == np.float32
    assert_close(gz, np.zeros(3))


def test_grad_materialize_grads_with_allow_unused_false_raises():
    x = leaf([1.0])
    with pytest.raises(ValueError, match="allow_unused"):
        pyengine.grad((x * x).sum(), [x], allow_unused=False, materialize_grads=True)


def test_grad_edge_input_equals_tensor_input():
    x = leaf([1.0, 2.0])
    h = exp(x)
    y = (h * h).sum()
    (by_tensor,) = pyengine.grad(y, h, retain_graph=True)
    (by_edge,) = pyengine.grad(y, gradient_edge(h))
    assert_close(by_edge, by_tensor)
    assert_close(by_edge, 2 * h.data)


def test_grad_leaf_edge_input_does_not_accumulate():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    (gx,) = pyengine.grad(y, pyengine.GradientEdge(pyengine.grad_accumulator(x), 0))
    assert_close(gx, 2 * x.data)
    assert x.grad is None


def test_grad_edge_output_implicit_and_explicit():
    x = leaf([1.0, 2.0])
    s = (x * x).sum()
    (gx,) = pyengine.grad(gradient_edge(s), x, retain_graph=True)
    assert_close(gx, 2 * x.data)
    v = x * 3.0
    (gx,) = pyengine.grad(gradient_edge(v), x, grad_outputs=np.array([1.0, -1.0]))
    assert_close(gx, [3.0, -3.0])


def test_backward_edge_root():
    x = leaf([1.0, 2.0])
    v = x * x
    pyengine.backward(gradient_edge(v), np.array([1.0, 0.5]))
    assert_close(x.grad, [2.0, 2.0])


def test_split_two_outputs_partial_gradient(torch):
    x = leaf([1.0, 2.0, 3.0, 4.0])
    a, b = split(x * 2.0, 1)
    (b * b).sum().backward()  # a gets no gradient: the node must fill zeros
    tx = torch.tensor(x.data, requires_grad=True)
    ta, tb = torch.split(tx * 2.0, [1, 3])
    (tb * tb).sum().backward()
    assert_close(x.grad, tx.grad.numpy())


def test_small_network_matches_torch(torch):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((2, 3))
    ws = rng.standard_normal((3, 4)) * 0.5
    bs = rng.standard_normal(4) * 0.5
    W, b = leaf(ws), leaf(bs)
    h = exp(const(xs) @ W + b)  # broadcast add: b's gradient is reduced by the engine
    p, q = split(h, 1)
    y = (p * p).sum() + (q @ W.T @ W).sum()
    y.backward()

    tW = torch.tensor(ws, requires_grad=True)
    tb = torch.tensor(bs, requires_grad=True)
    th = (torch.tensor(xs) @ tW + tb).exp()
    tp, tq = torch.split(th, [1, 1])
    ((tp * tp).sum() + (tq @ tW.T @ tW).sum()).backward()
    np.testing.assert_allclose(W.grad, tW.grad.numpy(), rtol=1e-10)
    np.testing.assert_allclose(b.grad, tb.grad.numpy(), rtol=1e-10)


def test_gradient_matches_finite_differences():
    rng = np.random.default_rng(1)
    x0 = rng.standard_normal(4)
    w0 = rng.standard_normal((4, 1))

    def f(xv, build=False):
        x = leaf(xv) if build else const(xv)
        p, q = split(exp(x * 0.5), 2)
        y = cat_sum(p, q) + (x * const(w0[:, 0])).sum() * (x * x).sum()
        return x, y

    def cat_sum(p, q):
        return (p * p).sum() + (q * 3.0).sum()

    x, y = f(x0, build=True)
    y.backward()
    eps = 1e-6
    numeric = np.empty_like(x0)
    for i in range(x0.size):
        step = np.zeros_like(x0)
        step[i] = eps
        numeric[i] = (f(x0 + step)[1].data - f(x0 - step)[1].data) / (2 * eps)
    np.testing.assert_allclose(x.grad, numeric, rtol=1e-6, atol=1e-8)


# -- execution order ------------------------------------------------------------------

class LogNode(pyengine.Node):
    def __init__(self, name, log, inputs, shape):
        super().__init__(next_edges=[gradient_edge(t) for t in inputs],
                         input_metadata=[(shape, np.float64)])
        self.tag, self.log = name, log

    def apply(self, grads):
        self.log.append(self.tag)
        return [grads[0]] * len(self.next_edges)


def build_logged_graph(spec, leaf_names, log):
    """pyengine version: ``spec`` is ``[(name, [input names])]`` in forward order."""
    values = {}
    for name in leaf_names:
        values[name] = leaf(1.0)
        values[name].register_post_accumulate_grad_hook(lambda t, name=name: log.append(name))
    for name, inputs in spec:
        out = T(np.array(1.0))
        node = LogNode(name, log, [values[i] for i in inputs], ())
        out.grad_fn, out.requires_grad = node, True
        values[name] = out
    return values


def build_logged_torch_graph(torch, spec, leaf_names, log):
    class Logged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, name, *xs):
            ctx.name, ctx.n = name, len(xs)
            return sum(x.detach() for x in xs).clone()

        @staticmethod
        def backward(ctx, g):
            log.append(ctx.name)
            return (None,) + (g,) * ctx.n

    values = {}
    for name in leaf_names:
        values[name] = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        values[name].register_post_accumulate_grad_hook(lambda t, name=name: log.append(name))
    for name, inputs in spec:
        values[name] = Logged.apply(name, *[values[i] for i in inputs])
    return values


def test_order_later_branch_first_and_accumulate_grad_first():
    # PyTorch's test_current_graph_task_execution_order example.
    log = []
    v = build_logged_graph([("c", ["b"]), ("d", ["a"]), ("out", ["c", "d"])], ["a", "b"], log)
    v["out"].backward()
    assert log == ["out", "d", "a", "c", "b"]


def random_spec(seed, n_leaves=4, n_ops=14):
    rng = np.random.default_rng(seed)
    leaves = [f"x{i}" for i in range(n_leaves)]
    names = list(leaves)
    spec = []
    for i in range(n_ops):
        k = int(rng.integers(1, 4))
        inputs = [names[int(j)] for j in rng.integers(0, len(names), size=k)]
        spec.append((f"f{i}", inputs))
        names.append(f"f{i}")
    # One root that reads every op output nobody else reads.
    used = {i for _, inputs in spec for i in inputs}
    spec.append(("root", [name for name, _ in spec if name not in used]))
    return spec, leaves


@pytest.mark.parametrize("seed", range(6))
def test_order_matches_torch_on_random_graphs(torch, seed):
    spec, leaves = random_spec(seed)
    log, torch_log = [], []
    build_logged_graph(spec, leaves, log)["root"].backward()
    build_logged_torch_graph(torch, spec, leaves, torch_log)["root"].backward()
    assert log == torch_log


def test_order_matches_torch_with_several_roots(torch):
    spec = [("p", ["a"]), ("q", ["b", "a"]), ("r", ["p"]), ("s", ["q", "p"])]
    log, torch_log = [], []
    v = build_logged_graph(spec, ["a", "b"], log)
    pyengine.backward([v["r"], v["s"]])
    tv = build_logged_torch_graph(torch, spec, ["a", "b"], torch_log)
    torch.autograd.backward([tv["r"], tv["s"]])
    assert log == torch_log


def test_order_matches_torch_with_inputs_pruning(torch):
    spec, leaves = random_spec(11)
    log, torch_log = [], []
    v = build_logged_graph(spec, leaves, log)
    v["root"].backward(inputs=[v["x1"], v["f3"]])
    tv = build_logged_torch_graph(torch, spec, leaves, torch_log)
    tv["root"].backward(inputs=[tv["x1"], tv["f3"]])
    assert log == torch_log


# -- AccumulateGrad -------------------------------------------------------------------

def test_first_gradient_does_not_alias_grad_tensors():
    x = leaf([1.0, 2.0, 3.0])
    g = np.ones(3)
    clone(x).backward(g)
    g[:] = 5.0
    assert_close(x.grad, np.ones(3))


def test_first_gradient_does_not_alias_grad_tensors_on_a_leaf_root():
    x = leaf([1.0, 2.0, 3.0])
    g = np.ones(3)
    pyengine.backward(x, g)
    g[:] = 5.0
    assert_close(x.grad, np.ones(3))


class ReturnsKept(pyengine.Node):
    """Returns an array (or a view of one) that it keeps."""

    def __init__(self, x, view):
        super().__init__(next_edges=[gradient_edge(x)], input_metadata=[x.data])
        self.kept = np.ones((2,) + x.shape)
        self.view = view

    def apply(self, grads):
        return [self.kept[0] if self.view else self.kept[1]]


@pytest.mark.parametrize("view", [True, False])
def test_accumulate_grad_never_writes_into_a_node_array(view):
    x = leaf([1.0, 2.0])
    node = ReturnsKept(x, view)
    pyengine.backward(Edge(node, 0), np.ones(2), retain_graph=True)
    pyengine.backward(Edge(node, 0), np.ones(2))
    assert_close(node.kept, np.ones((2, 2)))  # the engine wrote nowhere in it
    assert_close(x.grad, [2.0, 2.0])
    node.kept[:] = 7.0
    assert_close(x.grad, [2.0, 2.0])  # and .grad is no view of it


def test_input_buffer_never_writes_into_grad_tensors():
    x = leaf([1.0, 2.0])
    g = np.ones(2)
    y = clone(x) + clone(x) + clone(x)  # the same g object reaches x three times
    y.backward(g)
    assert_close(g, np.ones(2))
    assert_close(x.grad, [3.0, 3.0])


def test_later_backward_accumulates_in_place():
    # A new forward graph per backward, as in a training loop: PyTorch adds
    # into the .grad it stored (``variable_grad += new_grad``).
    x = leaf([1.0, 2.0])
    (x * x).sum().backward()
    first = x.grad
    (x * 3.0).sum().backward()
    assert x.grad is first
    assert_close(first, 2 * x.data + 3.0)


def test_later_backward_on_a_retained_graph_accumulates_in_place():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    y.backward(retain_graph=True)
    first = x.grad
    y.backward()
    assert x.grad is first
    assert_close(first, 4 * x.data)


def test_user_assigned_grad_is_never_written_in_place():
    x = leaf([1.0, 2.0])
    user = np.array([10.0, 20.0])
    x.grad = user
    (x * x).sum().backward()
    assert_close(user, [10.0, 20.0])
    assert x.grad is not user
    assert_close(x.grad, [12.0, 24.0])
    (x * 1.0).sum().backward()
    assert_close(x.grad, [13.0, 25.0])
    assert_close(user, [10.0, 20.0])


def test_grad_accumulator_is_shared_by_the_graph():
    x = leaf([1.0])
    y = x * 2.0
    acc = pyengine.grad_accumulator(x)
    assert isinstance(acc, pyengine.AccumulateGrad)
    assert acc.name() == "AccumulateGrad"
    assert y.grad_fn.next_functions[0] == (acc, 0)
    assert y.grad_fn.next_functions[1] == (None, 0)
    node, input_nr = gradient_edge(x)
    assert node is acc and input_nr == 0
    assert gradient_edge(x) == Edge(acc, 0)
    assert gradient_edge(const([1.0])) is None
    assert pyengine.GradientEdge is Edge


def test_accumulate_grad_sorts_after_higher_sequence_numbers():
    x = leaf([1.0])
    acc = pyengine.grad_accumulator(x)
    later = x * 2.0
    assert acc.sequence_nr > later.grad_fn.sequence_nr


def test_sequence_nr_increases_in_forward_order():
    x = leaf([1.0])
    a = x * 2.0
    b = a * 2.0
    assert b.grad_fn.sequence_nr > a.grad_fn.sequence_nr


# -- engines ---------------------------------------------------------------------------

class CountingEngine:
    def __init__(self, inner):
        self.inner = inner
        self.executes = 0

    def execute(self, *args, **kwargs):
        self.executes += 1
        return self.inner.execute(*args, **kwargs)

    def queue_callback(self, callback):
        return self.inner.queue_callback(callback)


def test_set_default_engine_swaps_and_restores():
    original = pyengine.get_default_engine()
    counting = CountingEngine(original)
    previous = pyengine.set_default_engine(counting)
    try:
        assert previous is original
        assert pyengine.get_default_engine() is counting
        x = leaf([1.0, 2.0])
        (x * x).sum().backward()
        (gx,) = pyengine.grad((x * 3.0).sum(), x)
        assert counting.executes == 2
        assert_close(x.grad, 2 * x.data)
        assert_close(gx, [3.0, 3.0])
    finally:
        assert pyengine.set_default_engine(original) is counting
    assert pyengine.get_default_engine() is original


def test_set_default_engine_rejects_non_engine():
    with pytest.raises(TypeError):
        pyengine.set_default_engine(object())
    assert pyengine.get_default_engine() is not None


def test_engine_execute_directly():
    engine = pyengine.Engine()
    x = leaf([1.0, 2.0])
    y = x * x
    captured = engine.execute([gradient_edge(y)], [np.ones(2)], True, False, False,
                              [gradient_edge(x)])
    assert_close(captured[0], 2 * x.data)
    assert x.grad is None
    result = engine.execute([gradient_edge(y)], [np.ones(2)], False, False, True)
    assert len(result) == 0
    assert_close(x.grad, 2 * x.data)


def test_engine_execute_needs_a_root():
    with pytest.raises(RuntimeError):
        pyengine.Engine().execute([], [], False, False, True)


def test_public_names():
    for name in ("backward", "grad", "Node", "Edge", "GradientEdge", "AccumulateGrad",
                 "queue_callback", "is_checkpoint_valid", "detect_anomaly", "set_detect_anomaly",
                 "no_grad", "enable_grad", "set_grad_enabled", "Engine", "get_default_engine",
                 "set_default_engine", "register_backend", "gradient_edge"):
        assert hasattr(pyengine, name), name
    assert pyengine.IMPLEMENTATION in ("pure", "compiled")
    from pyengine import _core
    assert _core.IMPLEMENTATION == pyengine.IMPLEMENTATION


def test_node_call_and_name():
    class Twice(pyengine.Node):
        def apply(self, grads):
            return [grads[0] * 2]

    node = Twice()
    assert node.name() == "Twice"
    assert_close(node(np.array([1.0]))[0], [2.0])
    assert "Twice" in repr(node)
    assert isinstance(node.metadata, dict)


# -- more shapes of calls ----------------------------------------------------------------

def test_grad_same_input_twice():
    x = leaf([1.0, 2.0])
    g1, g2 = pyengine.grad((x * x).sum(), [x, x])
    assert_close(g1, 2 * x.data)
    assert_close(g2, 2 * x.data)


def test_grad_of_output_with_respect_to_itself():
    x = leaf([1.0, 2.0])
    y = x * 2.0
    (gy,) = pyengine.grad(y, y, grad_outputs=np.array([3.0, 4.0]))
    assert_close(gy, [3.0, 4.0])


def test_backward_from_second_output_of_split(torch):
    x = leaf([1.0, 2.0, 3.0])
    a, b = split(x * 2.0, 1)
    pyengine.backward(b, np.array([5.0, 7.0]))
    tx = torch.tensor(x.data, requires_grad=True)
    ta, tb = torch.split(tx * 2.0, [1, 2])
    torch.autograd.backward(tb, torch.tensor([5.0, 7.0], dtype=torch.float64))
    assert_close(x.grad, tx.grad.numpy())


def test_backward_leaf_and_non_leaf_roots():
    x = leaf([1.0, 2.0])
    y = x * 3.0
    pyengine.backward([x, y], [np.array([1.0, 1.0]), np.array([2.0, -1.0])])
    assert_close(x.grad, [7.0, -2.0])


def test_same_root_twice_sums_its_gradients(torch):
    x = leaf([1.0, 2.0])
    y = exp(x)
    pyengine.backward([y, y], [np.array([1.0, 2.0]), np.array([3.0, 4.0])])
    tx = torch.tensor(x.data, requires_grad=True)
    ty = tx.exp()
    torch.autograd.backward([ty, ty], [torch.tensor([1.0, 2.0], dtype=torch.float64),
                                       torch.tensor([3.0, 4.0], dtype=torch.float64)])
    assert_close(x.grad, tx.grad.numpy())


def test_several_roots_with_inputs(torch):
    x = leaf([1.0, 2.0])
    w = leaf([0.5, 0.25])
    y1, y2 = (x * w).sum(), (exp(x) * w).sum()
    pyengine.backward([y1, y2], inputs=[w])
    tx = torch.tensor(x.data, requires_grad=True)
    tw = torch.tensor(w.data, requires_grad=True)
    torch.autograd.backward([(tx * tw).sum(), (tx.exp() * tw).sum()], inputs=[tw])
    assert_close(w.grad, tw.grad.numpy())
    assert x.grad is None and tx.grad is None


def test_grad_with_one_root_not_reaching_the_input():
    x = leaf([1.0, 2.0])
    z = leaf([3.0])
    zt, z_node = tap(z)
    (gx,) = pyengine.grad([(x * x).sum(), zt.sum()], x)
    assert_close(gx, 2 * x.data)
    assert z_node.calls == 0


def test_materialize_grads_refuses_an_unused_edge_input(torch):
    # PyTorch refuses: a GradientEdge has no value to take zeros like.
    from torch.autograd.graph import get_gradient_edge

    tx, tz = torch.ones(2, requires_grad=True), torch.zeros(2, 2, requires_grad=True)
    with pytest.raises(RuntimeError) as expected:
        torch.autograd.grad((tx * 2.0).sum(), [tx, get_gradient_edge(tz * 1.0)],
                            materialize_grads=True)
    x, z = leaf([1.0, 2.0]), leaf(np.zeros((2, 2)), dtype=np.float32)
    with pytest.raises(RuntimeError) as got:
        pyengine.grad((x * 2.0).sum(), [x, gradient_edge(z * 1.0)], materialize_grads=True)
    assert str(got.value) == str(expected.value)
    # A used GradientEdge input, and an unused tensor input, are fine in both.
    h = x * 2.0
    gh, gz = pyengine.grad((h * h).sum(), [gradient_edge(h), z], materialize_grads=True)
    th = tx * 2.0
    tgh, tgz = torch.autograd.grad((th * th).sum(), [get_gradient_edge(th), tz],
                                   materialize_grads=True)
    assert_close(gh, 2 * h.data)
    assert_close(tgh.numpy(), 2 * th.detach().numpy())
    assert gz.dtype == np.float32 and not gz.any() and not tgz.any()


def test_root_grad_cast_on_a_leaf_root():
    x = leaf([1.0, 2.0], dtype=np.float32)
    pyengine.backward(x, np.array([1.0, 2.0], dtype=np.float64))
    assert x.grad.dtype == np.float32
    assert_close(x.grad, [1.0, 2.0])


def test_float32_graph_keeps_float32(torch):
    x = leaf([0.5, 1.5], dtype=np.float32)
    w = leaf([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    y = (exp(x * 0.5) + const([[1.0, 0.0]], dtype=np.float32) @ w).sum()
    y.backward()
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float32
    tx = torch.tensor(x.data, requires_grad=True)
    tw = torch.tensor(w.data, requires_grad=True)
    ((tx * 0.5).exp() + torch.tensor([[1.0, 0.0]]) @ tw).sum().backward()
    np.testing.assert_allclose(x.grad, tx.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(w.grad, tw.grad.numpy(), rtol=1e-6)


def test_fresh_gradient_becomes_grad_without_a_copy():
    # AccumulateGrad takes over an array nothing else can see (PyTorch's
    # use_count test) instead of copying it.
    import weakref

    class Fresh(pyengine.Node):
        def apply(self, grads):
            fresh = grads[0] * 2.0
            self.ref = weakref.ref(fresh)
            return [fresh]

    x = leaf([1.0, 2.0])
    node = Fresh(next_edges=[gradient_edge(x)], input_metadata=[x.data])
    pyengine.backward(Edge(node, 0), np.ones(2))
    assert x.grad is node.ref()
    assert_close(x.grad, [2.0, 2.0])



class _Keeps(pyengine.Node):
    """Returns an array it keeps (or a view of it, or a read-only one): one
    that something besides the engine can see."""

    def __init__(self, variable, kept):
        super().__init__(next_edges=[gradient_edge(variable)], input_metadata=[variable.data])
        self.kept = kept

    def apply(self, grads):
        return [self.kept]


@pytest.mark.parametrize("make", [
    lambda: np.array([2.0, 3.0]),
    lambda: np.array([[2.0, 3.0], [9.0, 9.0]])[0],
    lambda: np.frombuffer(np.array([2.0, 3.0]).tobytes()),  # read-only, not owning its data
], ids=["kept", "view", "read-only"])
def test_a_gradient_something_else_sees_is_copied_into_grad(make):
    x = leaf([1.0, 2.0])
    kept = make()
    pyengine.backward(Edge(_Keeps(x, kept), 0), np.ones(2))
    assert x.grad is not kept and not np.shares_memory(x.grad, kept)
    assert x.grad.flags.writeable and x.grad.flags.owndata
    assert_close(x.grad, [2.0, 3.0])
    # The copy is pyengine's own: the next backward adds into it in place.
    first = x.grad
    pyengine.backward(Edge(_Keeps(x, kept), 0), np.ones(2))
    assert x.grad is first
    assert_close(x.grad, [4.0, 6.0])
    assert_close(kept, [2.0, 3.0])


def test_a_grad_stored_under_create_graph_is_added_into_by_a_plain_backward():
    # torch's AccumulateGrad: outside create_graph it adds into .grad in
    # place; under create_graph it stores a copy, then sums out of place.
    # The copy and the sum are pyengine's own, so a later plain backward adds
    # into them (See Note [Accumulating into .grad] in pyengine/_pure/node.py).
    x = leaf([1.0, 2.0])
    kept = np.array([2.0, 3.0])
    pyengine.backward(Edge(_Keeps(x, kept), 0), np.ones(2), create_graph=True)
    first = x.grad
    assert first is not kept
    pyengine.backward(Edge(_Keeps(x, kept), 0), np.ones(2), create_graph=True)
    assert x.grad is not first  # out of place under create_graph
    assert_close(first, [2.0, 3.0])
    summed = x.grad
    pyengine.backward(Edge(_Keeps(x, kept), 0), np.ones(2))
    assert x.grad is summed  # in place after
    assert_close(x.grad, [6.0, 9.0])
    assert_close(kept, [2.0, 3.0])


def test_a_read_only_grad_is_replaced_by_the_sum():
    x = leaf([1.0, 2.0])
    pyengine.backward(Edge(_Keeps(x, np.array([2.0, 3.0])), 0), np.ones(2))
    x.grad.flags.writeable = False  # still the array pyengine stored
    frozen = x.grad
    pyengine.backward(Edge(_Keeps(x, np.array([1.0, 1.0])), 0), np.ones(2))
    assert x.grad is not frozen
    assert_close(frozen, [2.0, 3.0])
    assert_close(x.grad, [3.0, 4.0])


def test_accumulation_uses_a_backend_registered_over_numpy():
    # AccumulateGrad's numpy fast paths stand for the built-in numpy backend
    # only: a backend registered for np.ndarray must see every copy and add.
    from pyengine.backends import NUMPY, NumpyBackend

    calls = []

    class Recording(NumpyBackend):
        def copy(self, value):
            calls.append("copy")
            return super().copy(value)

        def add_(self, a, b):
            calls.append("add_")
            return super().add_(a, b)

        def add(self, a, b):
            calls.append("add")
            return super().add(a, b)

    x = leaf([1.0, 2.0])
    pyengine.register_backend(np.ndarray, Recording())
    try:
        pyengine.backward(Edge(_Keeps(x, np.array([2.0, 3.0])), 0), np.ones(2))
        pyengine.backward(Edge(_Keeps(x, np.array([1.0, 1.0])), 0), np.ones(2))
        x.grad = np.array([5.0, 5.0])
        pyengine.backward(Edge(_Keeps(x, np.array([1.0, 1.0])), 0), np.ones(2))
    finally:
        pyengine.register_backend(np.ndarray, NUMPY)
    assert calls == ["copy", "add_", "add"]
    assert_close(x.grad, [6.0, 6.0])


def test_queue_callback_goes_to_the_default_engine():
    class Recording(CountingEngine):
        callbacks = 0

        def queue_callback(self, callback):
            Recording.callbacks += 1
            return self.inner.queue_callback(callback)

    original = pyengine.get_default_engine()
    engine = Recording(original)
    pyengine.set_default_engine(engine)
    try:
        ran = []
        x = leaf([1.0])
        h = x * 2.0
        h.register_hook(lambda g: pyengine.queue_callback(lambda: ran.append(1)))
        h.sum().backward()
    finally:
        pyengine.set_default_engine(original)
    assert ran == [1] and Recording.callbacks == 1 and engine.executes == 1


def test_grad_input_that_is_also_on_the_path_matches_torch(torch):
    # h is captured and also needed (x lies below it): as in PyTorch, the
    # capture is taken before h's tensor hooks run, and x sees the hooked value.
    def build(x):
        h = x * 3.0
        h.register_hook(lambda g: g * 10.0)
        return h, (h * h).sum()

    x = leaf([1.0, 2.0])
    h, y = build(x)
    gh, gx = pyengine.grad(y, [h, x])
    tx = torch.tensor(x.data, requires_grad=True)
    th, ty = build(tx)
    tgh, tgx = torch.autograd.grad(ty, [th, tx])
    assert_close(gh, tgh.numpy())
    assert_close(gx, tgx.numpy())


def test_node_without_metadata_gets_a_slot_per_gradient():
    class Two(pyengine.Node):  # declares no input metadata
        def apply(self, grads):
            self.got = list(grads)
            return [grads[0] + grads[1]]

    x = leaf([1.0, 2.0])
    sink = Two(next_edges=[gradient_edge(x)])
    top = Counter(next_edges=[Edge(sink, 0), Edge(sink, 1)], input_metadata=[x.data])
    pyengine.backward(Edge(top, 0), np.array([1.0, 3.0]))
    assert len(sink.got) == 2
    assert_close(sink.got[0], [1.0, 3.0])
    assert_close(sink.got[1], [1.0, 3.0])
    assert_close(x.grad, [2.0, 6.0])


@pytest.mark.parametrize("slots", [(), (None,)], ids=["past the metadata", "None metadata"])
def test_a_root_edge_into_a_slot_without_metadata_takes_any_shape(slots):
    # No shape to check the gradient against: it flows as given (the
    # chain's gradient, 1 per element of the leaf).
    x = leaf([1.0, 2.0])
    sink = Counter(next_edges=[gradient_edge(x)], input_metadata=list(slots))
    pyengine.backward(Edge(sink, 0), np.array([1.0, 1.0]))
    assert_close(x.grad, [1.0, 1.0])
    with pytest.raises(RuntimeError, match="must be given for a GradientEdge output whose node has "
                                           "no input metadata"):
        pyengine.backward(Edge(sink, 0))


ONE_OUTPUT_FORMS = {
    "alone": lambda output, grad: pyengine.backward(output, grad),
    "in a list": lambda output, grad: pyengine.backward([output],
                                                        None if grad is None else [grad]),
    "in a tuple": lambda output, grad: pyengine.backward((output,),
                                                         None if grad is None else (grad,)),
}


@pytest.mark.parametrize("form", ONE_OUTPUT_FORMS)
def test_one_output_alone_or_in_a_sequence_is_checked_alike(form):
    # One output with a numpy gradient or none skips the frontend's loop
    # over outputs (See Note [The frontend's fixed cost]): alone or in a
    # sequence, the same gradients (analytic) and the same errors (torch's
    # words, as the tests above pin them).
    backward = ONE_OUTPUT_FORMS[form]
    x = leaf([1.0, 2.0, 3.0])
    backward(x * 2.0, np.array([1.0, -1.0, 0.5]))
    assert_close(x.grad, [2.0, -2.0, 1.0])
    x.grad = None
    backward((x * x).sum(), None)
    assert_close(x.grad, [2.0, 4.0, 6.0])
    x.grad = None
    backward(gradient_edge(x * 3.0), np.ones(3))
    assert_close(x.grad, [3.0, 3.0, 3.0])
    x.grad = None
    with pytest.raises(RuntimeError, match=re.escape(
            "Mismatch in shape: grad_output[0] has a shape of (2,) and output[0] has a shape of (3,).")):
        backward(gradient_edge(x * 3.0), np.ones(2))
    with pytest.raises(RuntimeError, match=re.escape(
            "Mismatch in shape: grad_output[0] has a shape of (2,) and output[0] has a shape of (3,).")):
        backward(x * 3.0, np.ones(2))
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        backward(x * 3.0, None)
    with pytest.raises(RuntimeError, match=re.escape(
            "element 0 of tensors does not require grad and does not have a grad_fn")):
        backward(const([1.0]), np.ones(1))
    assert x.grad is None
    if form != "alone":  # None alone is no tensors at all
        with pytest.raises(TypeError, match="^element 0 of tensors is None$"):
            backward(None, np.ones(1))


class _Subarray(np.ndarray):
    pass


@pytest.mark.parametrize("value", [
    np.full((), 2.0), np.full((2, 3), 2.0, np.float32), np.asfortranarray(np.ones((3, 4))),
    np.arange(12.0).reshape(3, 4)[:, ::2], np.zeros(3, bool), np.arange(4), np.ones(2, complex),
    np.float64(3.0), np.arange(3.0).view(_Subarray),
], ids=["0-d", "float32", "fortran", "strided", "bool", "int", "complex", "numpy scalar",
        "subclass"])
def test_numpy_ones_like_is_numpys(value):
    # The numpy backend fills an empty array for a plain ndarray (the
    # implicit gradient of loss.backward()): what np.ones_like gives, to the
    # type, dtype, layout and value.
    ones, expected = pyengine.backends.NUMPY.ones_like(value), np.ones_like(value)
    assert type(ones) is type(expected) and ones.dtype == expected.dtype
    assert np.shape(ones) == np.shape(expected) and np.array_equal(ones, expected)
    if isinstance(expected, np.ndarray):
        assert ones.strides == expected.strides


@pytest.mark.parametrize("dtype", [np.dtype("f4"), np.float32, "float64", np.dtype("c8"), int, "?"])
def test_numpy_dtype_kind_is_numpys(dtype):
    assert pyengine.backends.NUMPY.dtype_kind(dtype) == np.dtype(dtype).kind


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_implicit_gradient_takes_the_output_dtype(dtype):
    # ones of the output's dtype, for a tensor output and for an Edge
    # output, whose slot's metadata gives it (torch: ones_like the output).
    x = leaf([1.0, 2.0], dtype)
    (x * 3.0).sum().backward()
    assert x.grad.dtype == dtype
    assert_close(x.grad, [3.0, 3.0])
    x.grad = None
    y = (x * 3.0).sum()
    received = []
    sink = Counter(next_edges=[gradient_edge(y)],
                   input_metadata=[pyengine.InputMetadata((), dtype)])
    tap_hook = sink.register_prehook(lambda grads: received.append(grads[0]))
    pyengine.backward(Edge(sink, 0))
    tap_hook.remove()
    assert type(received[0]) is np.ndarray and received[0].dtype == dtype
    assert received[0].shape == () and received[0] == 1
    assert_close(x.grad, [3.0, 3.0])


def test_is_same_shape_reads_the_value_through_its_backend():
    metadata = pyengine.InputMetadata((2, 3), np.float64)
    assert metadata.is_same_shape(np.zeros((2, 3)))
    assert metadata.is_same_shape(np.zeros((2, 3), np.float32))  # the shape only
    assert not metadata.is_same_shape(np.zeros((3, 2)))
    assert not metadata.is_same_shape(np.zeros(6))
    assert not metadata.is_same_shape(np.zeros((2, 3))[None])
    assert pyengine.InputMetadata((), np.float64).is_same_shape(np.float64(1.0) * np.ones(()))
    assert pyengine.InputMetadata((2,), np.int64).is_same_shape(np.arange(2))  # no fast path
    assert not pyengine.InputMetadata.__new__(pyengine.InputMetadata).is_same_shape(np.zeros(2))
    with pytest.raises(TypeError, match="no value backend for str"):
        metadata.is_same_shape("x")


def test_edge_equality_and_hash():
    a, b = Counter(), Counter()
    assert Edge(a, 0) == Edge(a, 0)
    assert hash(Edge(a, 0)) == hash(Edge(a, 0))
    assert Edge(a, 0) != Edge(a, 1)
    assert Edge(a, 0) != Edge(b, 0)
    assert len({Edge(a, 0), Edge(a, 0), Edge(b, 0)}) == 2
    with pytest.raises(TypeError):
        Edge("not a node", 0)
    with pytest.raises(TypeError):
        Counter(next_edges=["not an edge"])


def test_a_leaf_that_took_part_in_backward_can_be_copied_and_pickled():
    # The engine's per-leaf state (a lock, the accumulator, hooks) is not
    # copied: the copy starts fresh, with the same .grad value, and its own
    # backward accumulates into its own .grad only.
    import copy
    import pickle

    x = leaf([1.0, 2.0])
    (x * 3.0).sum().backward()
    for copied in (copy.deepcopy(x), pickle.loads(pickle.dumps(x))):
        np.testing.assert_array_equal(copied.grad, [3.0, 3.0])
        (copied * 2.0).sum().backward()
        np.testing.assert_array_equal(copied.grad, [5.0, 5.0])
    np.testing.assert_array_equal(x.grad, [3.0, 3.0])



def test_the_backend_lookup_cache_does_not_keep_every_value_type_alive():
    # Gradients of types made on the fly (a class per call): the cache is
    # bounded, and a type it let go of is freed; values still find numpy's
    # backend through the MRO after the cache is cleared.
    import gc
    import weakref

    first = None
    for _ in range(pyengine.backends.BACKEND_CACHE_LIMIT + 10):
        value_type = type("Made", (np.ndarray,), {})
        assert pyengine.backend_of(np.zeros(1).view(value_type)) is pyengine.backends.NUMPY
        if first is None:
            first = weakref.ref(value_type)
        del value_type
        assert len(pyengine.backends._backend_cache) <= pyengine.backends.BACKEND_CACHE_LIMIT
    gc.collect()
    assert first() is None
    assert pyengine.backend_of(np.zeros(1)) is pyengine.backends.NUMPY

def test_register_backend_returns_the_previous_and_unregister_backend_undoes_it():
    class Value:
        pass

    class Derived(Value):
        pass

    class Backend(pyengine.ArrayBackend):
        pass

    base, derived = Backend(), Backend()
    assert pyengine.register_backend(Value, base) is None
    try:
        assert pyengine.backend_of(Derived()) is base
        assert pyengine.register_backend(Derived, derived) is None
        assert pyengine.backend_of(Derived()) is derived
        # Unregistering the subclass's backend uncovers the base class's again
        # (the lookup cache is cleared).
        assert pyengine.unregister_backend(Derived) is derived
        assert pyengine.backend_of(Derived()) is base
        assert pyengine.unregister_backend(Derived) is None
        other = Backend()
        assert pyengine.register_backend(Value, other) is base
        assert pyengine.backend_of(Value()) is other
    finally:
        pyengine.unregister_backend(Value)
    assert pyengine.backend_of(Value()) is None
    assert pyengine.backend_of(Derived()) is None
    # numpy's own is untouched.
    assert pyengine.backend_of(np.zeros(1)) is pyengine.backends.NUMPY
    # Replacing numpy's and putting it back keeps the fast paths' flag true
    # to the registry (See Note [Replacing the numpy backend]).
    numpy_backend = pyengine.register_backend(np.ndarray, Backend())
    try:
        assert numpy_backend is pyengine.backends.NUMPY
        assert not pyengine.backends.numpy_backend_is_builtin
    finally:
        pyengine.register_backend(np.ndarray, pyengine.backends.NUMPY)
    assert pyengine.backends.numpy_backend_is_builtin
    assert pyengine.unregister_backend(Derived) is None
    assert pyengine.backends.numpy_backend_is_builtin
