"""gradcheck and gradgradcheck. Oracles: they pass on ops whose derivatives
are checked against PyTorch elsewhere, and fail on functions with a wrong
first derivative, or a right first derivative that is wrong to differentiate."""

from __future__ import annotations

import numpy as np
import pytest

import pyengine.frontend as F
from pyengine.frontend import GradcheckError, gradcheck, gradgradcheck


def leaves(*shapes, seed=0, positive=False):
    rng = np.random.default_rng(seed)
    return tuple(F.tensor(rng.uniform(0.5, 1.5, s) if positive else rng.standard_normal(s),
                          requires_grad=True) for s in shapes)


CORRECT = [
    ("broadcast mul", lambda a, b: a * b, ((2, 3), (3,))),
    ("matmul", lambda a, b: a @ b, ((2, 3), (3, 2))),
    ("softmax", lambda a: F.softmax(a, axis=1), ((2, 3),)),
    ("cross_entropy", lambda a: F.cross_entropy(a, np.array([1, 0])), ((2, 3),)),
    ("getitem with repeats", lambda a: a[[0, 0, 1]] * a[1], ((2, 3),)),
    ("two outputs", lambda a, b: (F.tanh(a) * b, F.exp(a).sum()), ((3,), (3,))),
    ("max", lambda a: F.max(a, axis=0) * a.mean(), ((3, 2),)),
    ("stack and concatenate", lambda a, b: F.concatenate([F.stack([a, b]), a[None]]), ((2,), (2,))),
]


@pytest.mark.parametrize("name,fn,shapes", CORRECT, ids=[c[0] for c in CORRECT])
def test_gradcheck_and_gradgradcheck_pass(name, fn, shapes):
    inputs = leaves(*shapes)
    assert gradcheck(fn, inputs)
    assert gradgradcheck(fn, inputs)


class WrongFirst(F.Function):
    """sin with the derivative of -cos... i.e. a wrong sign."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.tensor(np.sin(x.data))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return -grad * F.tensor(np.cos(x.data))


class RightFirstWrongSecond(F.Function):
    """exp whose backward uses a constant copy of exp(x): right to first order,
    but its derivative misses the dependence on x."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y.detach()


def test_gradcheck_catches_a_wrong_derivative():
    (x,) = leaves((3,))
    with pytest.raises(GradcheckError, match="Jacobian mismatch for output 0 with respect to input 0"):
        gradcheck(WrongFirst.apply, (x,))
    assert gradcheck(WrongFirst.apply, (x,), raise_exception=False) is False


def test_gradgradcheck_catches_a_wrong_second_derivative():
    (x,) = leaves((3,))
    assert gradcheck(RightFirstWrongSecond.apply, (x,))
    with pytest.raises(GradcheckError, match="Jacobian mismatch"):
        gradgradcheck(RightFirstWrongSecond.apply, (x,))


def test_gradcheck_leaves_inputs_unchanged():
    (x,) = leaves((2, 2))
    before = x.data.copy()
    gradcheck(lambda a: (a * a).sum(), (x,))
    np.testing.assert_array_equal(x.data, before)
    assert x.grad is None  # grad(), not backward(): nothing accumulated


def test_gradcheck_needs_an_input_that_requires_grad():
    with pytest.raises(ValueError, match="at least one input tensor to require gradient"):
        gradcheck(lambda a: a * 2.0, (F.tensor([1.0]),))
