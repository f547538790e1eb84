"""nn and optim against torch.nn and torch.optim with the same weights and
the same gradients."""

from __future__ import annotations

import numpy as np
import pytest
from frontend_helpers import assert_close, to_numpy

import pyengine.frontend as F
from pyengine.frontend import nn, optim


def torch_mlp(torch, model):
    """A torch.nn MLP with the weights of ``model`` (an nn.MLP)."""
    layers = []
    for module in model:
        if isinstance(module, nn.Linear):
            linear = torch.nn.Linear(module.in_features, module.out_features, dtype=torch.float64)
            with torch.no_grad():
                linear.weight.copy_(torch.tensor(module.weight.data))
                linear.bias.copy_(torch.tensor(module.bias.data))
            layers.append(linear)
        else:
            layers.append({"ReLU": torch.nn.ReLU, "Tanh": torch.nn.Tanh}[type(module).__name__]())
    return torch.nn.Sequential(*layers)


def test_parameters_in_definition_order_each_once():
    model = nn.MLP([3, 4, 2], rng=np.random.default_rng(0))
    names = [name for name, _ in model.named_parameters()]
    assert names == ["modules.0.weight", "modules.0.bias", "modules.2.weight", "modules.2.bias"]

    class Tied(nn.Module):
        def __init__(self):
            self.a = nn.Linear(2, 2)
            self.b = self.a  # the same layer twice

    assert len(list(Tied().parameters())) == 2
    shapes = [p.shape for p in model.parameters()]
    assert shapes == [(4, 3), (4,), (2, 4), (2,)]
    bound = 1 / np.sqrt(3)
    assert np.all(np.abs(model[0].weight.data) <= bound)


def test_mlp_forward_and_gradients_match_torch(torch):
    model = nn.MLP([3, 5, 4, 2], activation="tanh", rng=np.random.default_rng(1))
    reference = torch_mlp(torch, model)
    x = np.random.default_rng(2).standard_normal((6, 3))
    target = np.array([0, 1, 1, 0, 1, 0])
    loss = F.cross_entropy(model(F.tensor(x)), target)
    tloss = torch.nn.functional.cross_entropy(reference(torch.tensor(x)), torch.tensor(target))
    assert_close(loss, tloss)
    loss.backward()
    tloss.backward()
    for p, tp in zip(model.parameters(), reference.parameters()):
        assert_close(p.grad, tp.grad)


def test_zero_grad():
    model = nn.Linear(2, 2)
    (model(F.ones(1, 2)).sum()).backward()
    model.zero_grad(set_to_none=False)
    assert all(np.all(p.grad.data == 0) for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


OPTIMIZERS = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1)),
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)),
]


@pytest.mark.parametrize("name,options", OPTIMIZERS)
def test_optimizer_matches_torch(torch, name, options):
    rng = np.random.default_rng(3)
    start = [rng.standard_normal((3, 2)), rng.standard_normal(2)]
    ours = [F.Parameter(a.copy()) for a in start]
    theirs = [torch.nn.Parameter(torch.tensor(a)) for a in start]
    optimizer = getattr(optim, name)(ours, **options)
    reference = getattr(torch.optim, name)(theirs, **options)
    x = rng.standard_normal((4, 3))
    for _ in range(6):
        optimizer.zero_grad()
        reference.zero_grad()
        (F.tanh(F.tensor(x) @ ours[0] + ours[1]) ** 2).sum().backward()
        (torch.tanh(torch.tensor(x) @ theirs[0] + theirs[1]) ** 2).sum().backward()
        optimizer.step()
        reference.step()
    for p, tp in zip(ours, theirs):
        assert_close(p, tp, rtol=1e-10, atol=1e-12)


def test_step_skips_parameters_without_grad():
    a, b = F.Parameter(np.ones(2)), F.Parameter(np.ones(2))
    (a * 2.0).sum().backward()
    optim.SGD([a, b], lr=0.5).step()
    np.testing.assert_array_equal(a.data, [0.0, 0.0])
    np.testing.assert_array_equal(b.data, [1.0, 1.0])
    assert b._version == 0


def test_parameters_of_modules_that_refer_to_each_other_end(torch, monkeypatch):
    # Modules visited once each, as torch's named_modules memo does: a cycle
    # (enc.dec = dec; dec.enc = enc) used to make parameters() loop forever
    # (and grow its stack until memory ran out): fail fast instead.
    calls = []
    children = nn.Module._children

    def counted(self):
        calls.append(self)
        assert len(calls) < 100, "the module walk does not end"
        return children(self)

    monkeypatch.setattr(nn.Module, "_children", counted)
    def build(nn):
        enc, dec = nn.Module(), nn.Module()
        enc.lin = nn.Linear(2, 2)
        dec.enc = enc
        dec.lin = nn.Linear(2, 3)
        enc.dec = dec
        root = nn.Module()
        root.first = dec
        root.inner = nn.Module()
        root.inner.shared = enc
        root.again = enc  # reached first through first.enc, depth first
        return root

    ours = [(name, p.shape) for name, p in build(nn).named_parameters()]
    theirs = [(name, tuple(p.shape)) for name, p in build(torch.nn).named_parameters()]
    assert ours == theirs
    assert [name for name, _ in ours] == [
        "first.enc.lin.weight", "first.enc.lin.bias", "first.lin.weight", "first.lin.bias"]


@pytest.mark.parametrize("owner", ["optimizer", "module"])
def test_zero_grad_in_place_detaches_a_create_graph_grad(torch, owner):
    # torch's zero_grad(set_to_none=False): detach_() a .grad that has a
    # grad_fn, then zero_() it. A graph that saved the old .grad used to run
    # backward on the zeros and give x.grad = [0, 0] silently.
    def run(lib, x, zero_grad):
        (x * x).sum().backward(create_graph=True)
        g = x.grad
        z = (g * g).sum()  # saves g
        version = g._version
        zero_grad()
        assert x.grad is g and g.grad_fn is None and not g.requires_grad
        assert g._version > version
        assert np.all(to_numpy(g) == 0)
        with pytest.raises(RuntimeError) as caught:
            z.backward()
        (x * 3.0).sum().backward()  # accumulates onto the zeroed .grad
        assert_close(x.grad, np.array([3.0, 3.0]))
        return str(caught.value)

    class Holder(nn.Module):
        def __init__(self):
            self.x = F.Parameter(np.array([1.0, 2.0]))

    class TorchHolder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.x = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))

    module, tmodule = Holder(), TorchHolder()
    if owner == "optimizer":
        ours = lambda: optim.SGD([module.x], lr=0.1).zero_grad(set_to_none=False)  # noqa: E731
        theirs = lambda: torch.optim.SGD([tmodule.x], lr=0.1).zero_grad(set_to_none=False)  # noqa: E731
    else:
        ours = lambda: module.zero_grad(set_to_none=False)  # noqa: E731
        theirs = lambda: tmodule.zero_grad(set_to_none=False)  # noqa: E731
    message = run(F, module.x, ours)
    assert message == run(torch, tmodule.x, theirs)
    assert "saved tensor that has been detached in-place" in message


INVALID_OPTIONS = [
    ("SGD", dict(lr=-1)), ("SGD", dict(lr=-0.1)), ("SGD", dict(lr=0.1, momentum=-1.0)),
    ("SGD", dict(lr=0.1, weight_decay=-1.0)), ("SGD", dict(lr=0.1, nesterov=True)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)),
    ("Adam", dict(lr=-1)), ("Adam", dict(eps=-1)), ("Adam", dict(betas=(1.0, 0.999))),
    ("Adam", dict(betas=(0.9, 1.0))), ("Adam", dict(betas=(-0.1, 0.9))),
    ("Adam", dict(weight_decay=-1)), ("Adam", dict(lr=float("nan"))),
]


@pytest.mark.parametrize("name,options", INVALID_OPTIONS)
def test_optimizer_refuses_what_torch_refuses(torch, name, options):
    # These were all accepted; Adam with beta 1.0 then divided by zero in
    # step() after advancing its state.
    with pytest.raises(ValueError) as theirs:
        getattr(torch.optim, name)([torch.nn.Parameter(torch.ones(2))], **options)
    with pytest.raises(ValueError) as ours:
        getattr(optim, name)([F.Parameter(np.ones(2))], **options)
    assert str(ours.value) == str(theirs.value)


def test_optimizer_refuses_params_torch_refuses(torch):
    def errors(lib, parameter, make):
        found = []
        for params in ([parameter][0], [np.ones(2)], [make()], [], [{"params": [parameter]}] * 2):
            with pytest.raises((TypeError, ValueError)) as caught:
                lib.SGD(params, lr=0.1)
            found.append((caught.type, str(caught.value)))
        return found

    ours = errors(optim, F.Parameter(np.ones(2)), lambda: F.Parameter(np.ones(2)) * 2.0)
    theirs = errors(torch.optim, torch.nn.Parameter(torch.ones(2)),
                    lambda: torch.nn.Parameter(torch.ones(2)) * 2.0)
    # A single tensor used to be iterated as its rows (non-leaf views that
    # step() never wrote back).
    assert ours[0] == (TypeError, "params argument given to the optimizer should be an iterable "
                                  "of Tensors or dicts, but got Parameter")
    assert theirs[0][1].endswith("but got torch.FloatTensor")
    assert ours[1:] == theirs[1:]


def test_param_groups_match_torch(torch):
    rng = np.random.default_rng(4)
    start = [rng.standard_normal(3) for _ in range(3)]
    ours = [F.Parameter(a.copy()) for a in start]
    theirs = [torch.nn.Parameter(torch.tensor(a)) for a in start]
    for lib, params in ((optim, ours), (torch.optim, theirs)):
        groups = [{"params": params[:2]}, {"params": params[2], "lr": 0.5, "momentum": 0.0}]
        optimizer = lib.SGD(groups, lr=0.1, momentum=0.9)
        assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.5]
        for step in range(3):
            for p in params:
                p.grad = None
            ((params[0] * params[1]).sum() + (params[2] ** 2).sum() * step).backward()
            optimizer.step()
    for p, tp in zip(ours, theirs):
        assert_close(p, tp, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name,options", [("SGD", dict(lr=0.1, momentum=0.9)),
                                          ("SGD", dict(lr=0.1, momentum=0.5, weight_decay=0.1)),
                                          ("Adam", dict(lr=0.1)), ("SGD", dict(lr=0.1))])
def test_parameter_listed_twice_matches_torch(torch, name, options):
    # torch 2.13 warns, keeps the list as it is (the parameter is updated
    # twice per step) and keeps one state per parameter; pyengine kept one
    # momentum buffer per position.
    a, ta = F.Parameter(np.array([1.0, 2.0])), torch.nn.Parameter(torch.tensor([1.0, 2.0],
                                                                               dtype=torch.float64))
    message = "optimizer contains a parameter group with duplicate parameters"
    with pytest.warns(UserWarning, match=message):
        ours = getattr(optim, name)([a, a], **options)
    with pytest.warns(UserWarning, match=message):
        theirs = getattr(torch.optim, name)([ta, ta], **options)
    for _ in range(3):
        a.grad = np.array([0.5, -1.0])
        ta.grad = torch.tensor([0.5, -1.0], dtype=torch.float64)
        ours.step()
        theirs.step()
    assert_close(a, ta, rtol=1e-12, atol=1e-14)
    assert len(ours.state) == len(theirs.state)


def test_linear_and_mlp_sizes_as_torch(torch):
    # Linear(0, 3) used to raise OverflowError (a bound of 1/sqrt(0));
    # Linear(-1, 3) too; MLP(activation="gelu") a bare KeyError.
    layer, reference = nn.Linear(0, 3), torch.nn.Linear(0, 3, dtype=torch.float64)
    assert layer.weight.shape == tuple(reference.weight.shape)
    assert_close(layer.bias, reference.bias)
    x = F.tensor(np.ones((2, 0)), requires_grad=True)
    out = layer(x)
    assert_close(out, reference(torch.ones(2, 0, dtype=torch.float64)))
    out.sum().backward()
    assert x.grad.shape == (2, 0) and layer.weight.grad.shape == (3, 0)
    for sizes in ((-1, 3), (3, -2), (-1, -2)):
        with pytest.raises(RuntimeError) as theirs:
            torch.nn.Linear(*sizes)
        with pytest.raises(RuntimeError) as ours:
            nn.Linear(*sizes)
        assert str(ours.value) == str(theirs.value)
    with pytest.raises(ValueError, match="unknown activation 'gelu': expected one of 'relu', "
                                         "'tanh', 'sigmoid'"):
        nn.MLP([2, 3, 2], activation="gelu")
