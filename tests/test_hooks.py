"""Hooks: tensor hooks (leaf and non-leaf), retains-grad hooks, node pre- and
post-hooks, post-accumulate-grad hooks, their order and handle.remove().

Oracles: PyTorch with the same hooks on the same graph, or analytic values.
"""

import numpy as np
import pytest
from conftest import tap
from minitensor import const, exp, leaf, split

import pyengine


def assert_close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-12, atol=1e-12)


def test_hook_order():
    # tensor pre-hooks -> retains-grad hook -> node pre-hooks -> apply -> node post-hooks
    log = []
    x = leaf([1.0, 2.0])
    h, node = tap(x * 2.0, tag="apply", log=log)
    h.retain_grad()
    h.register_hook(lambda g: log.append(("tensor", h.grad is None)))
    node.register_prehook(lambda grads: log.append(("pre", h.grad is not None)))
    node.register_hook(lambda grad_inputs, grad_outputs: log.append("post"))
    (h * 3.0).sum().backward()
    assert log == [("tensor", True), ("pre", True), "apply", "post"]


def test_hooks_of_one_kind_run_in_registration_order(torch):
    x = leaf([1.0, 2.0])
    h = x * 3.0
    h.register_hook(lambda g: g * 2.0)
    h.register_hook(lambda g: g + 1.0)
    (h * h).sum().backward()
    tx = torch.tensor(x.data, requires_grad=True)
    th = tx * 3.0
    th.register_hook(lambda g: g * 2.0)
    th.register_hook(lambda g: g + 1.0)
    (th * th).sum().backward()
    assert_close(x.grad, tx.grad.numpy())


def test_retain_grad_sees_value_after_all_tensor_hooks(torch):
    x = leaf([1.0, 2.0])
    h = x * 3.0
    h.retain_grad()
    h.register_hook(lambda g: g * 10.0)  # registered after retain_grad
    (h * h).sum().backward()
    tx = torch.tensor(x.data, requires_grad=True)
    th = tx * 3.0
    th.retain_grad()
    th.register_hook(lambda g: g * 10.0)
    (th * th).sum().backward()
    assert_close(h.grad, th.grad.numpy())
    assert_close(x.grad, tx.grad.numpy())


def test_non_leaf_tensor_hook_changes_gradient(torch):
    x = leaf([0.5, -1.0, 2.0])
    h = exp(x)
    seen = []
    h.register_hook(lambda g: (seen.append(g.copy()), g * -2.0)[1])
    (h * h).sum().backward()
    tx = torch.tensor(x.data, requires_grad=True)
    th = tx.exp()
    th.register_hook(lambda g: g * -2.0)
    (th * th).sum().backward()
    assert_close(seen[0], 2 * h.data)
    assert_close(x.grad, tx.grad.numpy())


@pytest.mark.parametrize("before_graph", [True, False])
def test_leaf_tensor_hook_changes_gradient(torch, before_graph):
    x = leaf([1.0, 2.0])
    if before_graph:
        x.register_hook(lambda g: g * 3.0)
    y = (x * x).sum()
    if not before_graph:  # the AccumulateGrad exists already
        x.register_hook(lambda g: g * 3.0)
    y.backward()
    tx = torch.tensor(x.data, requires_grad=True)
    tx.register_hook(lambda g: g * 3.0)
    (tx * tx).sum().backward()
    assert_close(x.grad, tx.grad.numpy())


def test_leaf_hook_runs_once_on_the_summed_gradient_of_a_fan_out(torch):
    calls = []
    x = leaf([1.0, 2.0])
    x.register_hook(lambda g: calls.append(g.copy()))
    (x * x + x * 5.0).sum().backward()
    tx = torch.tensor(x.data, requires_grad=True)
    torch_calls = []
    tx.register_hook(lambda g: torch_calls.append(g.clone()))
    (tx * tx + tx * 5.0).sum().backward()
    assert len(calls) == len(torch_calls) == 1
    assert_close(calls[0], torch_calls[0].numpy())


def test_node_prehook_changes_grad_outputs(torch):
    x = leaf([1.0, 2.0])
    h = exp(x)
    h.grad_fn.register_prehook(lambda grads: (grads[0] * 4.0,))
    (h * 2.0).sum().backward()
    tx = torch.tensor(x.data, requires_grad=True)
    th = tx.exp()
    th.grad_fn.register_prehook(lambda grads: (grads[0] * 4.0,))
    (th * 2.0).sum().backward()
    assert_close(x.grad, tx.grad.numpy())


def test_node_post_hook_changes_grad_inputs(torch):
    x = leaf([1.0, 2.0])
    w = leaf([3.0, -4.0])
    y = x * w
    seen = []

    def post(grad_inputs, grad_outputs):
        seen.append((grad_inputs, grad_outputs))
        return (grad_inputs[0] + 1.0, grad_inputs[1])

    y.grad_fn.register_hook(post)
    y.sum().backward()
    tx = torch.tensor(x.data, requires_grad=True)
    tw = torch.tensor(w.data, requires_grad=True)
    ty = tx * tw
    ty.grad_fn.register_hook(lambda gi, go: (gi[0] + 1.0, gi[1]))
    ty.sum().backward()
    assert_close(x.grad, tx.grad.numpy())
    assert_close(w.grad, tw.grad.numpy())
    (grad_inputs, grad_outputs), = seen
    assert_close(grad_inputs[0], w.data)
    assert_close(grad_outputs[0], np.ones(2))


@pytest.mark.parametrize("kind", ["prehook", "posthook"])
def test_none_entry_returned_by_node_hook_drops_that_gradient(torch, kind):
    # As in PyTorch: a hook's returned tuple replaces the gradients, and a
    # None entry is an undefined gradient.
    def build(x, w, mul):
        y = mul(x, w)
        h = y * 1.0
        if kind == "prehook":
            y.grad_fn.register_prehook(lambda grads: (None,))
        else:
            y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: (grad_inputs[0], None))
        return h.sum()

    x, w = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    build(x, w, lambda a, b: a * b).backward()
    tx = torch.tensor(x.data, requires_grad=True)
    tw = torch.tensor(w.data, requires_grad=True)
    build(tx, tw, lambda a, b: a * b).backward()
    for mine, theirs in ((x.grad, tx.grad), (w.grad, tw.grad)):
        if theirs is None:
            assert mine is None
        else:
            assert_close(mine, theirs.numpy())


def test_hooks_on_a_two_output_node(torch):
    x = leaf([1.0, 2.0, 3.0])
    a, b = split(x * 2.0, 2)
    calls = []
    a.register_hook(lambda g: calls.append(g))  # a gets no gradient: called with None
    b.register_hook(lambda g: g * 5.0)
    (b * b).sum().backward()
    tx = torch.tensor(x.data, requires_grad=True)
    ta, tb = torch.split(tx * 2.0, [2, 1])
    torch_calls = []
    ta.register_hook(lambda g: torch_calls.append(g))
    tb.register_hook(lambda g: g * 5.0)
    (tb * tb).sum().backward()
    assert calls == torch_calls == [None]
    assert_close(x.grad, tx.grad.numpy())


def test_post_accumulate_grad_hook(torch):
    x = leaf([1.0, 2.0])
    seen = []
    x.register_post_accumulate_grad_hook(lambda t: seen.append((t is x, t.grad.copy())))
    (x * x).sum().backward()
    (x * 3.0).sum().backward()
    tx = torch.tensor(x.data, requires_grad=True)
    torch_seen = []
    tx.register_post_accumulate_grad_hook(lambda t: torch_seen.append(t.grad.clone()))
    (tx * tx).sum().backward()
    (tx * 3.0).sum().backward()
    assert [s[0] for s in seen] == [True, True]
    assert len(seen) == len(torch_seen) == 2
    for (_, mine), theirs in zip(seen, torch_seen):
        assert_close(mine, theirs.numpy())


def test_post_accumulate_grad_hook_can_change_grad_in_place():
    x = leaf([1.0, 2.0])

    def step(t):  # an optimizer step fused into backward
        t.data -= 0.5 * t.grad
        t.grad = None

    x.register_post_accumulate_grad_hook(step)
    (x * x).sum().backward()
    assert x.grad is None
    assert_close(x.data, [0.0, 0.0])


def test_post_accumulate_grad_hook_not_called_by_grad():
    x = leaf([1.0, 2.0])
    calls = []
    x.register_post_accumulate_grad_hook(lambda t: calls.append(1))
    pyengine.grad((x * x).sum(), x)
    assert calls == []


def test_post_accumulate_grad_hook_rejects_non_leaf():
    x = leaf([1.0])
    with pytest.raises(RuntimeError, match="non-leaf"):
        (x * 2.0).register_post_accumulate_grad_hook(lambda t: None)


def test_hook_on_tensor_without_grad_raises():
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        const([1.0]).register_hook(lambda g: g)


@pytest.mark.parametrize("kind", ["leaf", "non_leaf", "prehook", "posthook", "post_accumulate"])
def test_handle_remove(kind):
    calls = []
    x = leaf([1.0, 2.0])
    h = x * 2.0

    def register():
        if kind == "leaf":
            return x.register_hook(lambda g: calls.append(1))
        if kind == "non_leaf":
            return h.register_hook(lambda g: calls.append(1))
        if kind == "prehook":
            return h.grad_fn.register_prehook(lambda grads: calls.append(1))
        if kind == "posthook":
            return h.grad_fn.register_hook(lambda gi, go: calls.append(1))
        return x.register_post_accumulate_grad_hook(lambda t: calls.append(1))

    y = (h * h).sum()
    handle = register()
    y.backward(retain_graph=True)
    assert calls == [1]
    handle.remove()
    handle.remove()  # a second remove does nothing
    y.backward(retain_graph=True)
    assert calls == [1]
    with register():
        y.backward()
    assert calls == [1, 1]
    (x * 2.0 * x).sum().backward()
    assert calls == [1, 1]
    assert_close(x.grad, 3 * 8 * x.data + 4 * x.data)


def test_removing_one_hook_keeps_the_others():
    x = leaf([1.0])
    h = x * 1.0
    first = h.register_hook(lambda g: g * 2.0)
    h.register_hook(lambda g: g * 3.0)
    first.remove()
    h.sum().backward()
    assert_close(x.grad, [3.0])


def test_hooks_apply_to_grad_captures(torch):
    x = leaf([1.0, 2.0])
    h = x * 5.0
    h.register_hook(lambda g: g * 10.0)
    (gh,) = pyengine.grad((h * 2.0).sum(), h)
    tx = torch.tensor(x.data, requires_grad=True)
    th = tx * 5.0
    th.register_hook(lambda g: g * 10.0)
    (tgh,) = torch.autograd.grad((th * 2.0).sum(), th)
    assert_close(gh, tgh.numpy())


def test_leaf_hook_applies_to_grad_of_leaf(torch):
    x = leaf([1.0, 2.0])
    x.register_hook(lambda g: g * 2.0)
    (gx,) = pyengine.grad((x * x * 9.0).sum(), x)
    tx = torch.tensor(x.data, requires_grad=True)
    tx.register_hook(lambda g: g * 2.0)
    (tgx,) = torch.autograd.grad((tx * tx * 9.0).sum(), tx)
    assert_close(gx, tgx.numpy())
    assert x.grad is None


def test_retain_grad_under_grad(torch):
    x = leaf([1.0, 2.0])
    h = x * 3.0
    h.retain_grad()
    pyengine.grad((h * h).sum(), x)
    tx = torch.tensor(x.data, requires_grad=True)
    th = tx * 3.0
    th.retain_grad()
    torch.autograd.grad((th * th).sum(), tx)
    assert_close(h.grad, th.grad.numpy())


def test_retain_grad_of_the_input_grad_asks_for(torch):
    # h's node only captures its gradient (nothing below it is needed): its
    # retains-grad hook runs all the same, as torch's does.
    x = leaf([1.0, 2.0])
    h = x * 3.0
    h.retain_grad()
    (gh,) = pyengine.grad((h * h).sum(), h)
    tx = torch.tensor(x.data, requires_grad=True)
    th = tx * 3.0
    th.retain_grad()
    (tgh,) = torch.autograd.grad((th * th).sum(), th)
    assert_close(gh, tgh.numpy())
    assert_close(h.grad, th.grad.numpy())
    assert x.grad is None


def test_retain_grad_accumulates_over_backward_calls(torch):
    x = leaf([1.0, 2.0])
    h = exp(x)
    h.retain_grad()
    y = (h * h).sum()
    y.backward(retain_graph=True)
    y.backward()
    tx = torch.tensor(x.data, requires_grad=True)
    th = tx.exp()
    th.retain_grad()
    ty = (th * th).sum()
    ty.backward(retain_graph=True)
    ty.backward()
    assert_close(h.grad, th.grad.numpy())
    assert_close(x.grad, tx.grad.numpy())


def test_retain_grad_on_leaf_is_a_no_op_and_needs_requires_grad():
    x = leaf([1.0])
    x.retain_grad()
    (x * 2.0).sum().backward()
    assert_close(x.grad, [2.0])
    with pytest.raises(RuntimeError, match="retain_grad"):
        const([1.0]).retain_grad()


def test_hook_changing_the_shape_raises():
    x = leaf([1.0, 2.0])
    h = x * 2.0
    h.register_hook(lambda g: np.ones(3))
    with pytest.raises(RuntimeError, match="shape"):
        h.sum().backward()


def test_hook_changing_the_dtype_raises():
    x = leaf([1.0, 2.0])
    h = x * 2.0
    h.grad_fn.register_prehook(lambda grads: (grads[0].astype(np.float32),))
    with pytest.raises(RuntimeError, match="dtype"):
        h.sum().backward()


def test_prehook_returning_wrong_count_raises():
    x = leaf([1.0, 2.0])
    h = x * 2.0
    h.grad_fn.register_prehook(lambda grads: (grads[0], grads[0]))
    with pytest.raises(RuntimeError, match="incorrect number"):
        h.sum().backward()


def test_hook_on_accumulate_grad_node():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    acc = pyengine.grad_accumulator(x)
    log = []
    acc.register_prehook(lambda grads: log.append(("pre", x.grad is None)))
    acc.register_hook(lambda gi, go: log.append(("post", x.grad is None)))
    y.backward()
    assert log == [("pre", True), ("post", False)]
    assert_close(x.grad, 2 * x.data)


def test_hooks_see_grad_mode_of_the_backward():
    x = leaf([1.0])
    modes = []
    h = x * 2.0
    h.register_hook(lambda g: modes.append(pyengine.is_grad_enabled()))
    y = (h * h).sum()
    y.backward(retain_graph=True)
    pyengine.grad(y, x, create_graph=True)
    assert modes == [False, True]


def test_tensor_hook_sees_summed_gradient_of_a_fan_in(torch):
    # A hook on an input of a node that fans in sees the summed gradient.
    x = leaf([1.0, 2.0])
    h = x * 2.0
    seen = []
    h.register_hook(lambda g: seen.append(g.copy()))
    (h * const([3.0, 4.0]) + h * h).sum().backward()
    tx = torch.tensor(x.data, requires_grad=True)
    th = tx * 2.0
    torch_seen = []
    th.register_hook(lambda g: torch_seen.append(g.clone()))
    (th * torch.tensor([3.0, 4.0], dtype=torch.float64) + th * th).sum().backward()
    assert len(seen) == 1
    assert_close(seen[0], torch_seen[0].numpy())


def test_hook_on_root_tensor(torch):
    x = leaf([1.0, 2.0])
    y = x * 3.0
    seen = []
    y.register_hook(lambda g: (seen.append(g.copy()), g * 2.0)[1])
    y.backward(np.array([1.0, -1.0]))
    tx = torch.tensor(x.data, requires_grad=True)
    ty = tx * 3.0
    ty.register_hook(lambda g: g * 2.0)
    ty.backward(torch.tensor([1.0, -1.0], dtype=torch.float64))
    assert_close(seen[0], [1.0, -1.0])
    assert_close(x.grad, tx.grad.numpy())


def test_retain_grad_on_root_copies_grad_tensors():
    x = leaf([1.0, 2.0])
    y = x * 3.0
    y.retain_grad()
    g = np.array([1.0, -1.0])
    y.backward(g)
    assert_close(y.grad, g)
    g[:] = 9.0
    assert_close(y.grad, [1.0, -1.0])


def test_hook_removing_itself_during_backward():
    calls = []
    x = leaf([1.0])
    h = x * 2.0

    def once(g):
        calls.append("once")
        handle.remove()

    handle = h.register_hook(once)
    h.register_hook(lambda g: calls.append("other"))
    y = h.sum()
    y.backward(retain_graph=True)
    y.backward()
    assert calls == ["once", "other", "other"]


def test_post_hook_sees_grad_outputs_after_prehooks(torch):
    def build(x):
        h = x.exp() if hasattr(x, "exp") else exp(x)
        seen = []
        h.grad_fn.register_prehook(lambda grads: (grads[0] * 4.0,))
        h.grad_fn.register_hook(lambda gi, go: seen.append((gi[0] * 1.0, go[0] * 1.0)))
        return h, seen

    x = leaf([1.0, 2.0])
    h, seen = build(x)
    (h * 2.0).sum().backward()
    tx = torch.tensor(x.data, requires_grad=True)
    th, torch_seen = build(tx)
    (th * 2.0).sum().backward()
    for mine, theirs in zip(seen[0], torch_seen[0]):
        assert_close(mine, theirs.numpy())


def test_hooks_registered_and_removed_from_many_threads_are_all_kept():
    # See Note [Hook lists are rebound under one lock] in pyengine/node.py:
    # before it, a registration racing another thread's lost hooks (an
    # audit lost 2,104 of 3,000 on the compiled core). The oracle is the
    # count: every hook kept runs exactly once, none removed runs.
    import sys
    import threading

    class Pass(pyengine.Node):
        def apply(self, grads):
            return [grads[0]]

    x = leaf([1.0, 2.0])
    node = Pass(next_edges=[pyengine.gradient_edge(x)], input_metadata=[((2,), np.float64)])
    calls = {"post": 0, "pre": 0, "tensor": 0, "leaf": 0, "accumulated": 0, "removed": 0}

    def counter(kind):
        def hook(*args):
            calls[kind] += 1
        return hook

    def removed(*args):
        calls["removed"] += 1

    per_thread = 200
    registrations = [
        lambda: node.register_hook(counter("post")),
        lambda: node.register_prehook(counter("pre")),
        lambda: node.register_tensor_prehook(0, counter("tensor")),
        lambda: pyengine.register_tensor_hook(x, counter("leaf")),
        lambda: pyengine.register_post_accumulate_grad_hook(x, counter("accumulated")),
    ]
    removals = [
        lambda: node.register_hook(removed).remove(),
        lambda: node.register_prehook(removed).remove(),
        lambda: node.register_tensor_prehook(0, removed).remove(),
        lambda: pyengine.register_tensor_hook(x, removed).remove(),
        lambda: pyengine.register_post_accumulate_grad_hook(x, removed).remove(),
    ]

    def register():
        for _ in range(per_thread):
            for registration in registrations:
                registration()

    def churn():
        for _ in range(per_thread):
            for removal in removals:
                removal()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    try:
        threads = ([threading.Thread(target=register) for _ in range(3)]
                   + [threading.Thread(target=churn) for _ in range(2)])
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    pyengine.backward([pyengine.Edge(node, 0)], [np.ones(2)])
    assert calls == {"post": 3 * per_thread, "pre": 3 * per_thread, "tensor": 3 * per_thread,
                     "leaf": 3 * per_thread, "accumulated": 3 * per_thread, "removed": 0}
    np.testing.assert_array_equal(x.grad, np.ones(2))
