"""Helpers shared by the frontend tests: moving values between the frontend
and PyTorch, and comparing them."""

from __future__ import annotations

import numpy as np

import pyengine.frontend as F

# "match torch within 1e-6 in float64": the tests hold a tighter bound.
RTOL = 1e-7
ATOL = 1e-9


def to_numpy(value):
    """A frontend Tensor, a torch tensor, an array or None as an array (None stays)."""
    if value is None:
        return None
    if isinstance(value, F.Tensor):
        return np.asarray(value.data)
    if hasattr(value, "detach"):
        if value._is_zerotensor():  # torch's symbolic zeros (double backward of abs, ...)
            return np.zeros(tuple(value.shape))
        return value.detach().numpy()
    return np.asarray(value)


def assert_close(actual, expected, rtol=RTOL, atol=ATOL, what=""):
    actual, expected = to_numpy(actual), to_numpy(expected)
    assert (actual is None) == (expected is None), f"{what}: {actual!r} against {expected!r}"
    if actual is None:
        return
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} against {expected.shape}"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def pair(torch, array, requires_grad=True):
    """The same float64 values as a frontend leaf and a torch leaf."""
    array = np.array(array, dtype=np.float64)
    return (F.tensor(array, requires_grad=requires_grad),
            torch.tensor(array, requires_grad=requires_grad))


def zeros_if_none(grads, like):
    return [np.zeros(to_numpy(x).shape) if g is None else to_numpy(g) for g, x in zip(grads, like)]
