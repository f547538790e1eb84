"""Reentrant checkpointing. Oracles: the same model without checkpoints,
PyTorch's ``checkpoint(use_reentrant=True)``, and its error for ``grad()``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from frontend_helpers import assert_close, pair

import pyengine
import pyengine.frontend as F
from pyengine.frontend import nn

REENTRANT_ERROR = "When use_reentrant=True, .*checkpoint is incompatible with .grad()"


def deep_mlp(layers, width, seed):
    return nn.MLP([width] * (layers + 1), activation="tanh", rng=np.random.default_rng(seed))


def test_checkpointed_100_layer_mlp_matches_plain():
    rng = np.random.default_rng(0)
    x_data = rng.standard_normal((4, 8))
    grads = []
    for checkpointed in (False, True):
        model = deep_mlp(100, 8, seed=1)
        x = F.tensor(x_data, requires_grad=True)
        h = x
        for layer in model:
            h = F.checkpoint(layer, h) if checkpointed else layer(h)
        loss = (h * h).sum()
        loss.backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    plain, checkpointed = grads
    assert len(plain) == 1 + 2 * 100
    for a, b in zip(plain, checkpointed):
        assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_each_layer_recomputed_once_in_backward():
    calls = []

    def layer(x):
        calls.append(len(calls))
        return F.tanh(x) * 2.0

    x = F.tensor([0.1, 0.2], requires_grad=True)
    h = x
    for _ in range(5):
        h = F.checkpoint(layer, h)
    assert len(calls) == 5
    assert h.grad_fn.name() == "CheckpointFunctionBackward"
    h.sum().backward()
    assert len(calls) == 10
    expected = np.ones(2)
    value = x.data
    values = []
    for _ in range(5):
        values.append(value)
        value = np.tanh(value) * 2.0
    for v in reversed(values):
        expected = expected * 2.0 * (1 - np.tanh(v) ** 2)
    assert_close(x.grad, expected)


def test_matches_torch_checkpoint_with_non_tensor_args_and_two_outputs(torch):
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def block(lib, a, scale, b):
        return lib.tanh(a * b) * scale, a + b

    a, ta = pair(torch, [0.5, -1.0, 2.0])
    b, tb = pair(torch, [1.5, 0.5, -0.5])
    p, s = F.checkpoint(lambda *args: block(F, *args), a, 3.0, b)
    tp, ts = torch_checkpoint(lambda *args: block(torch, *args), ta, 3.0, tb, use_reentrant=True)
    (p.sum() + (s * s).sum()).backward()
    (tp.sum() + (ts * ts).sum()).backward()
    assert_close(a.grad, ta.grad)
    assert_close(b.grad, tb.grad)


def test_parameters_used_inside_get_gradients(torch):
    w, tw = pair(torch, [[0.5, -0.2], [0.1, 0.3]])
    x, tx = pair(torch, [[1.0, 2.0]])
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    y = F.checkpoint(lambda h: F.tanh(h @ w), x)
    ty = torch_checkpoint(lambda h: torch.tanh(h @ tw), tx, use_reentrant=True)
    (y * y).sum().backward()
    (ty * ty).sum().backward()
    assert_close(w.grad, tw.grad)
    assert_close(x.grad, tx.grad)


def test_grad_and_backward_inputs_refused_as_in_torch(torch):
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    x, tx = pair(torch, [1.0, 2.0])
    y = F.checkpoint(lambda h: h * h, x).sum()
    ty = torch_checkpoint(lambda h: h * h, tx, use_reentrant=True).sum()
    with pytest.raises(RuntimeError, match=REENTRANT_ERROR):
        torch.autograd.grad(ty, tx, retain_graph=True)
    with pytest.raises(RuntimeError, match=REENTRANT_ERROR):
        F.grad(y, x, retain_graph=True)
    with pytest.raises(RuntimeError, match=REENTRANT_ERROR):
        ty.backward(inputs=[tx], retain_graph=True)
    with pytest.raises(RuntimeError, match=REENTRANT_ERROR):
        y.backward(inputs=[x], retain_graph=True)
    y.backward()  # a plain backward works
    assert_close(x.grad, 2 * x.data)
    assert pyengine.is_checkpoint_valid()


def test_nested_checkpoints():
    def inner(h):
        return F.sigmoid(h) * h

    def outer(h):
        return F.checkpoint(inner, F.checkpoint(inner, h)) + h

    x_data = np.array([0.3, -0.8])
    x1 = F.tensor(x_data, requires_grad=True)
    F.checkpoint(outer, x1).sum().backward()
    x2 = F.tensor(x_data, requires_grad=True)
    outer(x2).sum().backward()
    assert_close(x1.grad, x2.grad, rtol=1e-12)


def test_warns_when_no_input_requires_grad():
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        y = F.checkpoint(lambda h: h * 2.0, F.tensor([1.0]))
    assert not y.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.checkpoint(lambda h: h * 2.0, F.tensor([1.0], requires_grad=True))
