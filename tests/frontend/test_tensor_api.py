"""The Tensor's autograd API: fields, hooks, grad mode, detach, create_graph,
broadcasting through the engine's sum_to, dtypes, views, threads.

Oracles: analytic values, PyTorch on the same program, and what the engine
documents (a node's raw gradients against what reaches ``.grad``).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
from frontend_helpers import assert_close, pair, to_numpy

import pyengine
import pyengine.frontend as F


def test_broadcast_gradients_are_reduced_by_the_engine():
    x = F.tensor(np.ones((3, 1)), requires_grad=True)
    y = F.tensor(np.arange(4.0), requires_grad=True)
    z = x * y
    # The node returns gradients of the broadcast shape...
    raw = z.grad_fn.apply([np.ones((3, 4))])
    assert [g.shape for g in raw] == [(3, 4), (3, 4)]
    # ...and validate_outputs sums them to each input's shape.
    z.sum().backward()
    assert x.grad.shape == (3, 1) and y.grad.shape == (4,)
    assert_close(x.grad, [[6.0]] * 3)
    assert_close(y.grad, [3.0] * 4)


def test_leaf_fields():
    x = F.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2.0
    assert x.is_leaf and x.grad_fn is None and x.requires_grad
    assert not y.is_leaf and y.grad_fn.name() == "MulBackward" and y.requires_grad
    assert y.grad_fn.next_functions[0][0].name() == "AccumulateGrad"
    assert y.grad_fn.next_functions[1] == (None, 0)  # the number 2.0
    c = F.tensor([1.0])
    assert not c.requires_grad and (c * 2.0).grad_fn is None
    with pytest.raises(RuntimeError, match="only Tensors of floating point"):
        F.tensor([1, 2], requires_grad=True)
    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf"):
        y.requires_grad = False


def test_grad_is_a_tensor_accumulated_in_place():
    x = F.tensor([1.0, 2.0], requires_grad=True)
    (x * 3.0).sum().backward()
    first = x.grad
    assert isinstance(first, F.Tensor) and not first.requires_grad
    (x * x).sum().backward()
    assert x.grad is first  # the engine added into the array it stored
    assert_close(x.grad, 3.0 + 2 * x.data)
    x.grad = np.zeros(2)  # a user's array is wrapped, and never written into
    user = x.grad.data
    (x * 1.0).sum().backward()
    assert_close(user, [0.0, 0.0])
    assert_close(x.grad, [1.0, 1.0])


def test_hooks_see_and_return_tensors(torch):
    x, tx = pair(torch, [1.0, -2.0])
    seen = []

    def hook(grad):
        seen.append(type(grad).__name__)
        return grad * 10.0

    h, th = x * 3.0, tx * 3.0
    handle = h.register_hook(hook)
    th.register_hook(lambda g: g * 10.0)
    x.register_hook(lambda g: g + 1.0)
    tx.register_hook(lambda g: g + 1.0)
    (h * h).sum().backward(retain_graph=True)
    (th * th).sum().backward()
    assert seen == ["Tensor"]
    assert_close(x.grad, tx.grad)
    handle.remove()
    x.grad = None
    (h * h).sum().backward()
    assert seen == ["Tensor"]
    assert_close(x.grad, 2 * 9.0 * x.data + 1.0)


def test_retain_grad_and_post_accumulate_grad_hook():
    x = F.tensor([1.0, 2.0], requires_grad=True)
    h = x * 3.0
    h.retain_grad()
    assert h.retains_grad and not x.retains_grad
    after = []
    x.register_post_accumulate_grad_hook(lambda t: after.append(t.grad.data.copy()))
    (h * h).sum().backward()
    assert_close(h.grad, 2 * h.data)
    assert_close(x.grad, 18 * x.data)
    assert_close(after[0], 18 * x.data)


def test_grad_mode():
    x = F.tensor([1.0], requires_grad=True)
    with F.no_grad():
        y = x * 2.0
        with F.enable_grad():
            z = x * 2.0
    assert y.grad_fn is None and not y.requires_grad
    assert z.grad_fn is not None


def test_detach_shares_memory_and_leaves_the_graph():
    x = F.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2.0
    d = y.detach()
    assert d.grad_fn is None and not d.requires_grad and d.data is y.data
    with pytest.raises(RuntimeError, match="Use tensor.detach"):
        y.numpy()
    np.testing.assert_array_equal(d.numpy(), [2.0, 4.0])


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_grad_has_history(torch):
    x, tx = pair(torch, [0.5, 1.5])
    (x ** 3).sum().backward(create_graph=True)
    (tx ** 3).sum().backward(create_graph=True)
    assert x.grad.grad_fn is not None
    first = x.grad
    x.grad = None
    first.sum().backward()
    tfirst = tx.grad
    tx.grad = None
    tfirst.sum().backward()
    assert_close(x.grad, tx.grad)  # 6x


def test_second_backward_without_retain_graph():
    x = F.tensor([1.0, 2.0], requires_grad=True)
    y = (x + 1.0).sum()  # saves nothing: may run again, as in PyTorch
    y.backward()
    y.backward()
    assert_close(x.grad, [2.0, 2.0])
    z = (x * x).sum()
    mul = z.grad_fn.next_functions[0][0]
    assert len(mul._saved_values) == 2
    z.backward()
    assert mul._saved_values is None  # released after backward
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        z.backward()


def test_numpy_operands_and_dtypes():
    x = F.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    y = np.array([3.0, 4.0]) * x  # numpy defers to the Tensor
    assert isinstance(y, F.Tensor) and y.dtype == np.float64  # float32 * float64
    z = x * 2.0 + 1  # Python scalars do not widen
    assert z.dtype == np.float32
    (y.sum() + z.sum()).backward()
    assert x.grad.dtype == np.float32  # the engine casts the float64 gradient back
    assert_close(x.grad, [5.0, 6.0])


def test_views_share_memory_and_indexing_rules():
    x = F.tensor(np.arange(6.0).reshape(2, 3))
    row = x[1]
    assert row._version_counter is x._version_counter
    x.data[1, 0] = 100.0
    assert row.data[0] == 100.0
    picked = x[[0, 0]]  # advanced: a copy
    assert picked._version_counter is not x._version_counter
    scalar = x[0, 1]
    assert scalar.shape == () and scalar._version_counter is x._version_counter


def test_repr():
    x = F.tensor([1.0], requires_grad=True)
    assert repr(x) == "tensor([1.], requires_grad=True)"
    assert repr(x * 2.0) == "tensor([2.], grad_fn=<MulBackward>)"
    assert "dtype=float32" in repr(F.zeros(2, dtype=np.float32))


def test_anomaly_mode_names_the_node(no_anomaly_warning):
    x = F.tensor([0.0, 1.0], requires_grad=True)
    with pyengine.detect_anomaly(), np.errstate(invalid="ignore", divide="ignore"):
        y = (x / x).sum()
        with pytest.raises(RuntimeError, match="Function 'DivBackward' returned nan values"):
            y.backward()


def test_backward_from_two_threads():
    results = {}

    def work(name, scale):
        x = F.tensor(np.full(50, scale), requires_grad=True)
        h = x
        for _ in range(200):
            h = F.tanh(h) * 0.5 + h * 0.5
        h.sum().backward()
        results[name] = x.grad.data.copy()

    threads = [threading.Thread(target=work, args=(i, 0.1 * (i + 1))) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(2):
        x = F.tensor(np.full(50, 0.1 * (i + 1)), requires_grad=True)
        h = x
        for _ in range(200):
            h = F.tanh(h) * 0.5 + h * 0.5
        h.sum().backward()
        assert_close(results[i], x.grad, rtol=0, atol=0)


def test_frontend_grad_returns_tensors():
    x = F.tensor([1.0, 2.0], requires_grad=True)
    y = F.tensor([3.0], requires_grad=True)
    gx, gy = F.grad((x * 2.0).sum(), [x, y], allow_unused=True)
    assert isinstance(gx, F.Tensor) and gy is None
    (gx,), = [F.grad((x * 2.0).sum(), x, materialize_grads=True)]
    assert_close(gx, [2.0, 2.0])
    gx, gy = F.grad((x * 2.0).sum(), [x, y], materialize_grads=True)
    assert isinstance(gy, F.Tensor)
    assert_close(gy, [0.0])



def test_materialized_zeros_require_grad_as_torch(torch):
    # torch fills an unused input with zeros_like(input, requires_grad=create_graph),
    # so a second-order program that uses them runs: their gradient is unused.
    xs, ys = pair(torch, [1.0, 2.0]), pair(torch, [3.0, 4.0])
    for x, y, grad in zip(xs, ys, (F.grad, torch.autograd.grad)):
        gx, gy = grad((x * x).sum(), [x, y], create_graph=True, materialize_grads=True)
        assert gy.requires_grad and gy.grad_fn is None
        assert_close(to_numpy(gy), [0.0, 0.0])
        assert grad((gy * gy).sum(), [y], allow_unused=True) == (None,)
        (second,) = grad((gx * gx).sum(), [x])
        assert_close(to_numpy(second), [8.0, 16.0])  # d/dx sum((2x)^2) = 8x
        # Without create_graph, torch's zeros do not require grad.
        _, plain = grad((x * x).sum(), [x, y], materialize_grads=True)
        assert not plain.requires_grad
        assert_close(to_numpy(plain), [0.0, 0.0])


@pytest.mark.parametrize("op", ["add", "radd", "sub", "rsub"])
def test_a_post_hook_sees_none_for_an_input_that_takes_no_gradient(torch, op):
    seen = []
    for x, c in zip(pair(torch, [1.0, 2.0]), pair(torch, [5.0, 6.0], requires_grad=False)):
        y = {"add": x + c, "radd": c + x, "sub": x - c, "rsub": c - x}[op]
        y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(
            [None if g is None else to_numpy(g).tolist() for g in grad_inputs]))
        y.sum().backward()
    assert len(seen) == 2 and seen[0] == seen[1], seen


def test_readme_example(capsys):
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## A reference frontend and a demo"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("```", start)]
    exec(code, {})  # the block catches the in-place error and prints it
    printed = capsys.readouterr().out.splitlines()
    comments = re.findall(r"print\(.*\)  # (.*)", code)
    assert len(printed) == len(comments) >= 3
    for line, comment in zip(printed, comments):
        # A comment ending in "..." gives the start of a longer line.
        assert line.startswith(comment[:-3].rstrip()) if comment.endswith("...") else line == comment


@pytest.mark.parametrize("count", range(1, 13))
def test_leaves_ready_together_fire_hooks_in_torchs_order(torch, count):
    # The AccumulateGrad tasks of stack's leaves become ready together and tie
    # in the ready queue; they pop in the order PyTorch's binary heap gives
    # (0, 2, 1, 3 for four leaves): See Note [Ties in the ready queue].
    def hook_order(lib):
        log = []
        leaves = [lib.tensor([1.0], requires_grad=True) for _ in range(count)]
        for i, x in enumerate(leaves):
            x.register_hook(lambda grad, i=i: log.append(f"hook{i}"))
            x.register_post_accumulate_grad_hook(lambda x, i=i: log.append(f"post{i}"))
        lib.stack(leaves).sum().backward()
        return log

    assert hook_order(F) == hook_order(torch)


@pytest.mark.parametrize("bad", [
    np.zeros((3, 2)), np.zeros(3), np.zeros(()),  # size
    np.zeros(2, np.int64), np.zeros(2, np.float32),  # dtype
    [0.0, 0.0], "abc", 5,  # not a tensor
])
def test_grad_setter_refuses_what_torch_refuses(torch, bad):
    # The setter used to take anything: a (3, 2) .grad was then broadcast
    # into by the next backward, and x.grad silently became (3, 2).
    x, tx = pair(torch, [1.0, 2.0])
    tbad = torch.tensor(bad) if isinstance(bad, np.ndarray) else bad
    with pytest.raises((RuntimeError, TypeError)) as theirs:
        tx.grad = tbad
    for value in (bad, F.tensor(bad)) if isinstance(bad, np.ndarray) else (bad,):
        with pytest.raises(theirs.type) as ours:
            x.grad = value
        assert x.grad is None
        if theirs.type is TypeError:
            assert str(ours.value) == str(theirs.value).replace(
                "a Tensor or None", "a Tensor, an array or None")
        elif "size" in str(theirs.value):
            assert str(ours.value) == str(theirs.value)
        else:  # torch names its C dtype and a grad_dtype attribute the frontend lacks
            assert str(ours.value).startswith("attempting to assign a gradient with dtype "
                                              f"'{bad.dtype}' to a tensor with dtype 'float64'")
    x.grad = np.full(2, 0.5)  # what fits is taken, and accumulated into
    (x * 3.0).sum().backward()
    assert_close(x.grad, np.array([3.5, 3.5]))
    with pytest.raises(RuntimeError, match="can't assign Variable as its own grad"):
        x.grad = x


def test_backward_and_grad_take_generators_and_empty_outputs_as_torch(torch):
    # Generators used to be wrapped as one tensor ("element 0 of tensors does
    # not require grad"); backward([]) and grad([], [x]) raised the engine's
    # "execute needs at least one root edge"; grad(y, [5]) said "does not
    # require grad".
    def outcomes(lib, autograd, x, ones):
        y = (x * x).sum()
        results = []

        def record(fn):
            try:
                value = fn()
            except Exception as error:  # noqa: BLE001 (the oracle's type is compared)
                results.append((type(error).__name__, str(error)))
                return
            results.append(("ok", None if value is None else [to_numpy(v) for v in value]))

        record(lambda: autograd.grad(y, (v for v in [x]), retain_graph=True))
        record(lambda: autograd.grad((v for v in [y]), [x], retain_graph=True))
        record(lambda: autograd.grad(x * 2, [x], grad_outputs=(g for g in [ones])))
        record(lambda: autograd.backward((v for v in [y]), retain_graph=True))
        record(lambda: autograd.backward(y, inputs=(v for v in [x]), retain_graph=True))
        record(lambda: autograd.backward((v for v in [x * 2]), (g for g in [ones])))
        record(lambda: autograd.backward([]))
        record(lambda: autograd.backward([], inputs=[x]))
        record(lambda: autograd.grad([], [x], allow_unused=True))
        record(lambda: autograd.grad([], [x], materialize_grads=True))
        record(lambda: autograd.grad(y, [5], retain_graph=True))
        record(lambda: autograd.grad(y, ["a"], retain_graph=True))
        record(lambda: autograd.backward(y, inputs=[5.0], retain_graph=True))
        record(lambda: autograd.grad([], [x]))
        results.append(("x.grad", to_numpy(x.grad)))
        return results

    x, tx = pair(torch, [1.0, 2.0])
    ours = outcomes(F, F.autograd, x, np.ones(2))
    theirs = outcomes(torch, torch.autograd, tx, torch.ones(2, dtype=torch.float64))
    # torch 2.13 words the unused-input error by index; pyengine keeps its own.
    assert ours[-2][0] == theirs[-2][0] == "RuntimeError"
    assert "appears to not have been used in the graph" in ours[-2][1]
    ours, theirs = ours[:-2] + ours[-1:], theirs[:-2] + theirs[-1:]
    assert [kind for kind, _ in ours] == [kind for kind, _ in theirs]
    for (kind, mine), (_, other) in zip(ours, theirs):
        if kind == "RuntimeError":
            assert mine == other
        elif isinstance(mine, list):
            assert len(mine) == len(other)
            for a, b in zip(mine, other):
                assert_close(a, b)
        else:
            assert_close(mine, other)
