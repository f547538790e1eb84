"""Where the frontend once parted from torch, found by the fuzz against torch
(``tests/fuzz/test_frontend_against_torch.py``) and by an audit: the
gradients a node computes under ``grad(inputs=)``, the inputs of the nodes
of ``c - x``, ``x ** c``, ``c ** x``, ``c + x``, ``c * x`` and ``c / x``, a
second backward through an advanced index, ``.grad`` after a plain backward
that follows a ``create_graph`` one, casts to integer dtypes, in-place
changes of the index, condition and target tensors a backward reads,
``max`` over NaN, a Function's integer output, ``linear`` with a 1-D
weight; and, as torch says its indexing will be, a list of lists as one
array index.

Oracle: torch on the same program (values, which inputs get None, errors).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from frontend_helpers import assert_close, pair, to_numpy

import pyengine.frontend as F

torch = pytest.importorskip("torch")


def grad_fn_inputs(value):
    """Per input of ``value.grad_fn``: the name of the node it leads to
    without torch's overload number, or None."""
    return [None if node is None else node.name().rstrip("0123456789")
            for node, _ in value.grad_fn.next_functions]


def post_hook_log(node, log):
    """Log what a grad_fn post-hook sees as grad_inputs (None or an array)."""
    node.register_hook(lambda grad_inputs, grad_outputs: log.append(
        [None if g is None else to_numpy(g) for g in grad_inputs]))


def assert_same_logs(ours, theirs):
    assert len(ours) == len(theirs)
    for mine, expected in zip(ours, theirs):
        assert len(mine) == len(expected)
        for a, b in zip(mine, expected):
            assert_close(a, b)


def differentiate(lib, call, out, inputs):
    """``grad(out, inputs)`` or ``out.backward(inputs=inputs)`` in ``lib``."""
    if call == "grad":
        (lib.autograd.grad if lib is torch else F.grad)(out, inputs)
    else:
        out.backward(inputs=inputs)


@pytest.mark.parametrize("call", ["grad", "backward_inputs"])
def test_a_node_computes_only_the_gradients_the_call_uses(call):
    # torch's formulas ask task_should_compute_output: a post-hook sees None
    # for an input the call prunes, on nodes of one input and of two.
    logs = {}
    for lib in (F, torch):
        a, b = pair(torch, [1.0, 2.0])[lib is torch], pair(torch, [3.0, 4.0])[lib is torch]
        product = a * b
        total = product.sum()
        log = logs[lib] = []
        post_hook_log(product.grad_fn, log)
        post_hook_log(total.grad_fn, log)
        differentiate(lib, call, total, [a])
        assert b.grad is None
    assert logs[F][1][1] is None  # b's gradient, skipped
    assert_same_logs(logs[F], logs[torch])
    # A node of one input whose input is pruned: backward(inputs=) runs the
    # node of a non-leaf input, grad(inputs=) only captures its gradient.
    for lib in (F, torch):
        a = pair(torch, [1.0, 2.0])[lib is torch]
        partial = a.sum()
        total = partial * 3.0
        log = logs[lib] = []
        post_hook_log(partial.grad_fn, log)
        differentiate(lib, call, total, [partial])
        assert a.grad is None
    assert logs[F] == logs[torch] == ([] if call == "grad" else [[None]])


@pytest.mark.parametrize("spoil", ["freed", "modified"])
def test_a_pruned_one_input_node_still_checks_what_it_saved(spoil):
    # backward(inputs=[h]) runs h's node with its input pruned: torch's
    # formula unpacks its saved values before it asks which gradients to
    # compute, so a freed graph or a saved tensor changed in place raises.
    errors = {}
    for lib in (F, torch):
        x = pair(torch, [0.5, -0.5])[lib is torch]
        h = (x * 3.0).tanh()
        if spoil == "freed":
            h.sum().backward()
        else:
            with lib.no_grad():
                h.mul_(2.0)
        with pytest.raises(RuntimeError) as info:
            (h * 2.0).sum().backward(inputs=[h])
        errors[lib] = str(info.value)
    expected = "second time" if spoil == "freed" else "modified by an inplace operation"
    assert expected in errors[F] and expected in errors[torch]


REFLECTED = {
    "c - x": lambda x, t: 2.0 - x,
    "c + x": lambda x, t: 2.0 + x,
    "c * x": lambda x, t: 2.0 * x,
    "c / x": lambda x, t: 2.0 / x,
    "x ** c": lambda x, t: x ** 3.0,
    "c ** x": lambda x, t: 2.0 ** x,
    "x ** t": lambda x, t: x ** t,
    "x - c": lambda x, t: x - 2.0,
    "x / c": lambda x, t: x / 2.0,
}


@pytest.mark.parametrize("op", list(REFLECTED))
def test_numbers_take_the_inputs_torch_gives_them(op):
    results = {}
    for lib in (F, torch):
        x = pair(torch, [0.5, 1.5, 2.0])[lib is torch]
        t = pair(torch, [2.0, 0.5, 3.0])[lib is torch]
        y = REFLECTED[op](x, t)
        log = []
        post_hook_log(y.grad_fn, log)
        grad = F.grad if lib is F else torch.autograd.grad
        first = grad(y.sum(), [x, t], create_graph=True, allow_unused=True)
        squares = sum((g * g).sum() for g in first if g is not None)
        # A linear op's gradient is a constant: no second order to take.
        second = grad(squares, [x], allow_unused=True) if squares.requires_grad else (None,)
        inputs = grad_fn_inputs(y)
        results[lib] = (inputs, log, first, second)
    ours, theirs = results[F], results[torch]
    # The same inputs, None where torch has None (names aside).
    assert [name is None for name in ours[0]] == [name is None for name in theirs[0]]
    assert_same_logs(ours[1], theirs[1])
    for mine, expected in zip(ours[2] + ours[3], theirs[2] + theirs[3]):
        assert_close(mine, expected)


def test_reflected_division_is_the_reciprocal_times_the_number():
    x = F.tensor([1.0, 2.0], requires_grad=True)
    y = 2.0 / x
    assert y.grad_fn.name() == "MulBackward"
    assert grad_fn_inputs(y) == ["ReciprocalBackward", None]


@pytest.mark.parametrize("index", ["list", "tensor", "mask", "slice", "int"])
def test_a_second_backward_through_an_index_after_free(index):
    # torch's IndexBackward0 saves its index: a second backward after the
    # graph was freed raises; SliceBackward0 and SelectBackward0 save none.
    outcomes = {}
    for lib in (F, torch):
        x = pair(torch, [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])[lib is torch]
        key = {"list": [0, 0, 2], "tensor": lib.tensor(np.array([2, 0])),
               "mask": lib.tensor(np.array([True, False, True])), "slice": slice(1, None),
               "int": 1}[index]
        y = x[key].sum()  # SumBackward saves no tensor: only the index node may
        y.backward()
        try:
            y.backward()
            outcomes[lib] = ("ran", to_numpy(x.grad))
        except RuntimeError as error:
            outcomes[lib] = ("raised", "second time" in str(error))
    assert outcomes[F][0] == outcomes[torch][0]
    if outcomes[F][0] == "ran":
        assert_close(outcomes[F][1], outcomes[torch][1])
    else:
        assert outcomes[F][1] and outcomes[torch][1]


def test_an_empty_list_index_picks_nothing():
    x, tx = pair(torch, [[1.0, 2.0], [3.0, 4.0]])
    out, tout = x[[]], tx[[]]
    assert out.shape == tuple(tout.shape) == (0, 2)
    (out.sum() + x.sum()).backward()
    (tout.sum() + tx.sum()).backward()
    assert_close(x.grad, tx.grad)


def test_a_second_backward_through_an_embedding_after_free_raises():
    weight = F.tensor(np.ones((4, 2)), requires_grad=True)
    y = F.embedding(weight, np.array([1, 3])).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()


def test_a_plain_backward_after_a_create_graph_one_adds_in_place():
    # torch's AccumulateGrad adds into .grad in place outside create_graph:
    # the .grad the create_graph backward stored keeps its history.
    seen = {}
    for lib in (F, torch):
        x = pair(torch, [1.0, 2.0])[lib is torch]
        (x ** 3).sum().backward(create_graph=True)
        first = x.grad
        (x * x).sum().backward()
        seen[lib] = (x.grad is first, x.grad.requires_grad, x.grad.grad_fn is not None,
                     to_numpy(x.grad))
    assert seen[F][:3] == seen[torch][:3] == (True, True, True)
    assert_close(seen[F][3], seen[torch][3])


def test_a_grad_the_user_assigned_is_not_written_into():
    # The one place pyengine parts from torch on purpose: See Note
    # [Accumulating into .grad] in pyengine/_pure/node.py.
    x = F.tensor([1.0, 2.0], requires_grad=True)
    mine = F.tensor([10.0, 10.0])
    x.grad = mine
    (x * x).sum().backward()
    assert_close(mine, [10.0, 10.0])
    assert_close(x.grad, [12.0, 14.0])


@pytest.mark.parametrize("dtype", [np.int64, np.bool_])
def test_a_cast_to_an_integer_dtype_leaves_the_graph(dtype):
    x = F.tensor([1.2, 2.7, -0.6], requires_grad=True)
    m = x.astype(dtype)
    assert not m.requires_grad and m.grad_fn is None
    (g,) = F.grad((m * x).sum(), [x])
    xt = torch.tensor([1.2, 2.7, -0.6], dtype=torch.float64, requires_grad=True)
    mt = xt.to(torch.int64 if dtype is np.int64 else torch.bool)
    assert not mt.requires_grad
    assert_close(g, torch.autograd.grad((mt * xt).sum(), [xt])[0])
    with pytest.raises(RuntimeError, match="does not require grad"):
        (x.astype(dtype) * 2.5).sum().backward()


def _index(lib, x, key):
    return x[key]


def _where(lib, x, key):
    return lib.where(key, x, 0.0)


def _setitem(lib, x, key):
    y = x * 1.0
    y[key] = 7.0
    return y


def _nll_target(lib, x, key):
    nll = F.nll_loss if lib is F else torch.nn.functional.nll_loss
    return nll(x, key, reduction="sum")


MODIFIED = {
    "index": (_index, lambda lib: lib.tensor(np.array([0, 2])), lambda key: key.__setitem__(0, 1)),
    "two-part index": (lambda lib, x, key: x[key, 1], lambda lib: lib.tensor(np.array([0, 2])),
                       lambda key: key.__setitem__(0, 1)),
    "where": (_where, lambda lib: lib.tensor(np.array([[True, False]] * 3)),
              lambda key: key.fill_(False)),
    "setitem": (_setitem, lambda lib: lib.tensor(np.array([0, 2])),
                lambda key: key.__setitem__(0, 1)),
    "nll target": (_nll_target, lambda lib: lib.tensor(np.array([0, 1, 1])),
                   lambda key: key.__setitem__(0, 1)),
}


@pytest.mark.parametrize("case", list(MODIFIED))
def test_a_tensor_the_backward_reads_is_version_checked(case):
    op, make_key, modify = MODIFIED[case]
    raised = {}
    for lib in (F, torch):
        x = pair(torch, [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])[lib is torch]
        key = make_key(lib)
        y = op(lib, x, key)
        modify(key)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            y.sum().backward()
        raised[lib] = info.value
    assert raised[F] and raised[torch]


def test_nll_loss_checks_its_log_probs_version():
    for lib in (F, torch):
        x = pair(torch, [[0.1, 0.9], [0.4, 0.6]])[lib is torch]
        log_probs = (x * 1.0).log()
        nll = F.nll_loss if lib is F else torch.nn.functional.nll_loss
        loss = nll(log_probs, lib.tensor(np.array([1, 0])))
        with lib.no_grad():
            log_probs.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_embedding_checks_its_index_tensor_version():
    weight = F.tensor(np.ones((4, 2)), requires_grad=True)
    rows = F.tensor(np.array([1, 3]))
    y = F.embedding(weight, rows).sum()
    rows[0] = 2
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_max_over_nan_gives_the_gradient_to_the_nans(axis):
    data = [[1.0, np.nan, 3.0], [4.0, 5.0, 6.0]]
    x = F.tensor(data, requires_grad=True)
    F.max(x, axis=axis).sum().backward()
    xt = torch.tensor(data, dtype=torch.float64, requires_grad=True)
    if axis is None:
        torch.max(xt).backward()  # evenly_distribute_backward
    else:
        torch.max(xt, dim=axis).values.sum().backward()  # to the (first) NaN's index
    assert_close(x.grad, xt.grad)


def test_a_function_output_of_integer_dtype_is_not_differentiable():
    class Doubled(F.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, (x > 1.5).astype(np.int64)

        @staticmethod
        def backward(ctx, grad, grad_flags):
            return grad * 2

    x = F.tensor([1.0, 2.0], requires_grad=True)
    doubled, flags = Doubled.apply(x)
    assert doubled.requires_grad and not flags.requires_grad and flags.grad_fn is None
    doubled.sum().backward()
    assert_close(x.grad, [2.0, 2.0])


@pytest.mark.parametrize("x_shape, w_shape, b_shape", [
    # A 1-D weight: matmul(x, weight) (DotBackward0, MvBackward0, ...), the
    # bias added by its own node.
    ((4,), (4,), None), ((3, 4), (4,), None), ((2, 3, 4), (4,), ()), ((2, 3, 4), (4,), None),
    # Biases that broadcast to the product without growing it.
    ((3, 4), (5, 4), (3, 1)), ((3, 4), (5, 4), ()), ((2, 3, 4), (5, 4), (2, 1, 5)),
])
def test_linear_as_torch_where_torch_gives_a_result(x_shape, w_shape, b_shape):
    rng = np.random.default_rng(0)
    x, xt = pair(torch, rng.standard_normal(x_shape))
    w, wt = pair(torch, rng.standard_normal(w_shape))
    b, bt = (None, None) if b_shape is None else pair(torch, rng.standard_normal(b_shape))
    out = F.linear(x, w, b)
    out_t = torch.nn.functional.linear(xt, wt, bt)
    assert_close(out, out_t.detach().numpy())
    weights = rng.standard_normal(out_t.shape)
    (out * F.tensor(weights)).sum().backward()
    (out_t * torch.tensor(weights)).sum().backward()
    for ours, theirs in [(x, xt), (w, wt)] + ([] if b_shape is None else [(b, bt)]):
        assert_close(ours.grad, theirs.grad)


@pytest.mark.parametrize("x_shape, w_shape, b_shape", [((4,), (5, 4), (2, 1)), ((4,), (4,), (3,))])
def test_linear_refuses_a_bias_that_would_grow_the_product(x_shape, w_shape, b_shape):
    with pytest.raises(RuntimeError):
        torch.nn.functional.linear(torch.ones(x_shape), torch.ones(w_shape), torch.ones(b_shape))
    with pytest.raises(ValueError, match=re.escape(f"a bias of shape {b_shape} does not broadcast")):
        F.linear(F.tensor(np.ones(x_shape)), F.tensor(np.ones(w_shape)), F.tensor(np.ones(b_shape)))


def test_linear_refuses_a_weight_of_another_rank_naming_its_shape():
    x = F.tensor(np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"weight must be 1-D or 2-D, got shape \(2, 3, 4\)"):
        F.linear(x, F.tensor(np.ones((2, 3, 4))))
    with pytest.raises(RuntimeError):
        torch.nn.functional.linear(torch.ones(3, 4), torch.ones(2, 3, 4))


@pytest.mark.parametrize("index", [[[1, 0]], [[0, 1], [1, 2]], [[2], [0]]])
def test_a_list_of_lists_index_is_one_array_index(index):
    # As torch's deprecation warning says its future reading is:
    # x[torch.tensor(seq)]. (torch 2.13 still reads x[seq] as x[tuple(seq)].)
    x, xt = pair(torch, np.arange(12.0).reshape(3, 4))
    out, out_t = x[index], xt[torch.tensor(index)]
    assert out.shape == tuple(out_t.shape)
    weights = np.arange(out.size, dtype=np.float64).reshape(out.shape)
    (out * F.tensor(weights)).sum().backward()
    (out_t * torch.tensor(weights)).sum().backward()
    assert_close(x.grad, xt.grad)
