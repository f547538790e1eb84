"""The custom-op API, ``Function``, against ``torch.autograd.Function``
running the same forward and backward, and analytic values."""

from __future__ import annotations

import numpy as np
import pytest
from frontend_helpers import assert_close, pair

import pyengine
import pyengine.frontend as F

RELEASED = "Trying to backward through the graph a second time"


def make_exp(lib):
    """``exp`` as a custom Function of ``lib`` (the frontend or torch): it
    saves its output, and its backward is differentiable."""
    base = F.Function if lib is F else lib.autograd.Function

    class Exp(base):
        @staticmethod
        def forward(ctx, x):
            y = x.exp()
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, grad):
            (y,) = ctx.saved_tensors
            return grad * y

    return Exp


def make_scaled_mul(lib):
    """``(a * b * scale, a - b)``: two outputs, a non-tensor argument."""
    base = F.Function if lib is F else lib.autograd.Function

    class ScaledMul(base):
        @staticmethod
        def forward(ctx, a, scale, b):
            ctx.save_for_backward(a, b)
            ctx.scale = scale
            return a * b * scale, a - b

        @staticmethod
        def backward(ctx, grad_product, grad_difference):
            a, b = ctx.saved_tensors
            grad_a = grad_product * b * ctx.scale + grad_difference
            grad_b = grad_product * a * ctx.scale - grad_difference
            return grad_a, None, grad_b

    return ScaledMul


def test_custom_exp_first_and_second_derivatives(torch):
    x, tx = pair(torch, [0.3, -1.2, 2.0])
    y, ty = make_exp(F).apply(x), make_exp(torch).apply(tx)
    assert_close(y, ty)
    assert y.grad_fn.name() == "ExpBackward"
    (g,) = F.grad((y * y).sum(), x, create_graph=True)
    (tg,) = torch.autograd.grad((ty * ty).sum(), tx, create_graph=True)
    assert_close(g, tg)
    (gg,) = F.grad(g.sum(), x)
    (tgg,) = torch.autograd.grad(tg.sum(), tx)
    assert_close(gg, tgg)
    assert_close(gg, 4 * np.exp(2 * x.data))  # d²/dx² e^{2x}


def test_two_outputs_and_a_non_tensor_argument(torch):
    a, ta = pair(torch, [1.0, 2.0])
    b, tb = pair(torch, [3.0, -4.0])
    p, d = make_scaled_mul(F).apply(a, 0.5, b)
    tp, td = make_scaled_mul(torch).apply(ta, 0.5, tb)
    assert (p.output_nr, d.output_nr) == (0, 1) and p.grad_fn is d.grad_fn
    (p.sum() * 3.0 + (d * d).sum()).backward()
    (tp.sum() * 3.0 + (td * td).sum()).backward()
    assert_close(a.grad, ta.grad)
    assert_close(b.grad, tb.grad)


def test_unused_output_gets_zeros_unless_not_materialized(torch):
    seen = {}

    def make(lib, materialize):
        base = F.Function if lib is F else lib.autograd.Function

        class Split(base):
            @staticmethod
            def forward(ctx, x):
                ctx.set_materialize_grads(materialize)
                return x * 2.0, x * 3.0

            @staticmethod
            def backward(ctx, g0, g1):
                seen[lib.__name__] = g1
                return g0 * 2.0 if g1 is None else g0 * 2.0 + g1 * 3.0

        return Split

    for materialize in (True, False):
        x, tx = pair(torch, [1.0, 2.0])
        make(F, materialize).apply(x)[0].sum().backward()
        make(torch, materialize).apply(tx)[0].sum().backward()
        assert_close(x.grad, tx.grad)
        assert (seen["pyengine.frontend"] is None) == (seen["torch"] is None) == (not materialize)
        if materialize:
            assert_close(seen["pyengine.frontend"], seen["torch"])


def test_needs_input_grad(torch):
    log = []

    class Probe(F.Function):
        @staticmethod
        def forward(ctx, a, n, b):
            log.append(ctx.needs_input_grad)
            return a * b

        @staticmethod
        def backward(ctx, grad):
            log.append(ctx.needs_input_grad)
            return grad, None, None

    a = F.tensor([1.0], requires_grad=True)
    Probe.apply(a, 3, F.tensor([2.0])).sum().backward()
    assert log == [(True, False, False)] * 2
    assert_close(a.grad, [1.0])


def test_mark_non_differentiable(torch):
    def make(lib):
        base = F.Function if lib is F else lib.autograd.Function

        class SortedWithRanks(base):
            @staticmethod
            def forward(ctx, x):
                order = x.data.argsort() if lib is F else x.argsort()
                ranks = F.tensor(order) if lib is F else order
                ctx.mark_non_differentiable(ranks)
                ctx.save_for_backward(ranks)
                return x[ranks], ranks

            @staticmethod
            def backward(ctx, grad, grad_ranks):
                (ranks,) = ctx.saved_tensors
                out = grad * 0.0
                out[ranks] = grad
                return out

        return SortedWithRanks

    x, tx = pair(torch, [3.0, 1.0, 2.0])
    values, ranks = make(F).apply(x)
    tvalues, tranks = make(torch).apply(tx)
    assert not ranks.requires_grad and not tranks.requires_grad
    np.testing.assert_array_equal(ranks.data, tranks.numpy())
    (values * F.tensor([1.0, 10.0, 100.0])).sum().backward()
    (tvalues * torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)).sum().backward()
    assert_close(x.grad, tx.grad)


def test_saved_tensors_released_after_backward():
    x = F.tensor([1.0, 2.0], requires_grad=True)
    y = make_exp(F).apply(x)
    y.sum().backward(retain_graph=True)
    y.sum().backward()  # retained: runs again
    assert_close(x.grad, 2 * np.exp(x.data))
    with pytest.raises(RuntimeError, match=RELEASED):
        y.sum().backward()
    with pytest.raises(RuntimeError, match=RELEASED):
        _ = y.grad_fn.saved_tensors


def test_saved_tensor_modified_in_place_raises(torch):
    x, tx = pair(torch, [1.0, 2.0])
    y, ty = make_exp(F).apply(x), make_exp(torch).apply(tx)
    y.add_(1.0)
    ty.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ty.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_wrong_number_of_gradients():
    class Bad(F.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a + b

        @staticmethod
        def backward(ctx, grad):
            return grad

    a, b = F.tensor([1.0], requires_grad=True), F.tensor([2.0], requires_grad=True)
    with pytest.raises(RuntimeError, match=r"returned an incorrect number of gradients \(expected 2, "
                                           r"got 1\)"):
        Bad.apply(a, b).sum().backward()


def test_gradient_for_a_non_tensor_argument_is_refused():
    class Bad(F.Function):
        @staticmethod
        def forward(ctx, a, scale):
            return a * scale

        @staticmethod
        def backward(ctx, grad):
            return grad, grad

    a = F.tensor([1.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="forward input was not a Tensor"):
        Bad.apply(a, 2.0).sum().backward()


def test_returning_an_input_keeps_its_history():
    class Identity(F.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad * 10.0

    x = F.tensor([1.0, 2.0], requires_grad=True)
    h = x * 1.0
    before = h.grad_fn
    y = Identity.apply(h)
    assert y is not h and h.grad_fn is before and y.grad_fn.name() == "IdentityBackward"
    assert y._version_counter is h._version_counter
    y.sum().backward()
    assert_close(x.grad, [10.0, 10.0])


def test_no_graph_without_grad():
    x = F.tensor([1.0, 2.0], requires_grad=True)
    with pyengine.no_grad():
        y = make_exp(F).apply(x)
    assert y.grad_fn is None and not y.requires_grad
    z = make_exp(F).apply(F.tensor([1.0]))
    assert z.grad_fn is None and not z.requires_grad


def test_forward_runs_without_recording():
    class Inner(F.Function):
        @staticmethod
        def forward(ctx, x):
            inner = x * 2.0
            ctx.inner_recorded = inner.grad_fn is not None
            return inner

        @staticmethod
        def backward(ctx, grad):
            return grad * 2.0

    x = F.tensor([1.0], requires_grad=True)
    y = Inner.apply(x)
    assert not y.grad_fn.inner_recorded
