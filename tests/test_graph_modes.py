"""retain_graph, create_graph (higher-order derivatives), grad mode and
anomaly mode.

Oracles: analytic derivatives, PyTorch on the same graph.
"""

import re
import warnings

import numpy as np
import pytest
from conftest import tap
from minitensor import T, const, exp, leaf

import pyengine
from pyengine import Edge, gradient_edge

RELEASED = "Trying to backward through the graph a second time"


def assert_close(actual, expected, rtol=1e-12):
    if isinstance(actual, T):
        actual = actual.data
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=1e-12)


# -- retain_graph --------------------------------------------------------------------

def test_second_backward_through_released_node_raises():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()  # MulBackward saved x
    y.backward()
    with pytest.raises(RuntimeError, match=re.escape(RELEASED)) as excinfo:
        y.backward()
    assert "retain_graph=True" in str(excinfo.value)
    assert_close(x.grad, 2 * x.data)  # the failed call added nothing


def test_second_grad_through_released_node_raises():
    x = leaf([1.0, 2.0])
    y = exp(x).sum()
    pyengine.grad(y, x)
    with pytest.raises(RuntimeError, match=re.escape(RELEASED)):
        pyengine.grad(y, x)


def test_saved_values_are_released_after_backward():
    x = leaf([1.0, 2.0])
    y = x * x
    node = y.grad_fn
    assert len(node.saved_values) == 2
    y.sum().backward()
    with pytest.raises(RuntimeError, match=re.escape(RELEASED)):
        _ = node.saved_values


def test_retain_graph_runs_twice_and_accumulates_exactly(torch):
    x = leaf([0.5, -1.5, 2.0])
    y = (exp(x) * x).sum()
    y.backward(retain_graph=True)
    first = x.grad.copy()
    y.backward()
    np.testing.assert_array_equal(x.grad, 2 * first)
    tx = torch.tensor(x.data, requires_grad=True)
    (tx.exp() * tx).sum().backward()
    assert_close(first, tx.grad.numpy())


def test_graph_without_saved_values_can_run_twice(torch):
    x = leaf([1.0, 2.0])
    y = (x + x).sum()
    y.backward()
    y.backward()
    assert_close(x.grad, [4.0, 4.0])
    tx = torch.tensor(x.data, requires_grad=True)
    ty = (tx + tx).sum()
    ty.backward()
    ty.backward()
    assert_close(x.grad, tx.grad.numpy())


class Releasing(pyengine.Node):
    def __init__(self, x):
        super().__init__(next_edges=[gradient_edge(x)], input_metadata=[x.data])
        self.releases = 0

    def apply(self, grads):
        return [grads[0]]

    def release_variables(self):
        self.releases += 1
        super().release_variables()


def test_release_variables_called_unless_retained():
    x = leaf([1.0])
    node = Releasing(x)
    pyengine.backward(Edge(node, 0), np.ones(1), retain_graph=True)
    assert node.releases == 0
    pyengine.backward(Edge(node, 0), np.ones(1))
    assert node.releases == 1
    assert_close(x.grad, [2.0])



def test_release_variables_frees_saved_values_and_looks_on_the_class():
    # The base frees save_for_backward's values; the engine calls the
    # method of the node's class (a C++ virtual method): a function set on
    # one node is not called, in either core.
    x = leaf([1.0])
    plain = Releasing(x)
    plain.save_for_backward(np.ones(1))
    calls = []
    plain.release_variables = lambda: calls.append("instance")
    pyengine.backward(Edge(plain, 0), np.ones(1))
    assert plain.releases == 1 and calls == []
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        plain.saved_values  # noqa: B018
    base = _PassOn(x)
    base.save_for_backward(np.ones(1))
    pyengine.backward(Edge(base, 0), np.ones(1))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        base.saved_values  # noqa: B018
    assert base._saved_values is None
    assert_close(x.grad, [2.0])



def test_an_override_added_to_a_class_later_is_called():
    # The compiled engine remembers which classes override
    # release_variables; changing a class must be seen at the next backward.
    class Late(_PassOn):
        pass

    x = leaf([1.0])
    pyengine.backward(Edge(Late(x), 0), np.ones(1))
    calls = []
    Late.release_variables = lambda self: calls.append("class")
    pyengine.backward(Edge(Late(x), 0), np.ones(1))
    assert calls == ["class"]
    del Late.release_variables
    pyengine.backward(Edge(Late(x), 0), np.ones(1))
    assert calls == ["class"]
    assert_close(x.grad, [3.0])

class _PassOn(pyengine.Node):
    def __init__(self, x):
        super().__init__(next_edges=[gradient_edge(x)], input_metadata=[x.data])

    def apply(self, grads):
        return [grads[0]]

def test_create_graph_retains_graph_by_default():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    pyengine.grad(y, x, create_graph=True)
    (gx,) = pyengine.grad(y, x)
    assert_close(gx, 2 * x.data)


# -- create_graph -------------------------------------------------------------------

def test_third_derivative_of_cube():
    x = leaf([1.0, -2.0, 0.5])
    y = (x * x * x).sum()
    (g1,) = pyengine.grad(y, x, create_graph=True)
    assert isinstance(g1, T) and g1.grad_fn is not None
    assert_close(g1, 3 * x.data ** 2)
    (g2,) = pyengine.grad(g1.sum(), x, create_graph=True)
    assert_close(g2, 6 * x.data)
    (g3,) = pyengine.grad(g2.sum(), x)
    assert_close(g3, [6.0, 6.0, 6.0])


def test_higher_derivatives_of_exp():
    x = leaf([0.0, 1.0, -0.5])
    g = exp(x).sum()
    for _ in range(3):
        (g,) = pyengine.grad(g.sum() if isinstance(g, T) and g.shape else g, x, create_graph=True)
        assert_close(g, np.exp(x.data))


def test_backward_create_graph_gives_differentiable_grad():
    x = leaf([1.0, 2.0])
    (x * x * x).sum().backward(create_graph=True)
    first = x.grad
    assert isinstance(first, T) and first.grad_fn is not None
    assert_close(first, 3 * x.data ** 2)
    x.grad = None
    first.sum().backward()
    assert_close(x.grad, 6 * x.data)


def test_hessian_vector_product_matches_torch(torch):
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((2, 3))
    w0 = rng.standard_normal((3, 2))
    v0 = rng.standard_normal((2, 3))

    x, w = leaf(x0), leaf(w0)
    y = (exp(x @ w) * (x @ w)).sum() + (x * x * x).sum()
    gx, gw = pyengine.grad(y, [x, w], create_graph=True)
    hx, hw = pyengine.grad((gx * const(v0)).sum(), [x, w])

    tx = torch.tensor(x0, requires_grad=True)
    tw = torch.tensor(w0, requires_grad=True)
    ty = ((tx @ tw).exp() * (tx @ tw)).sum() + (tx * tx * tx).sum()
    tgx, tgw = torch.autograd.grad(ty, [tx, tw], create_graph=True)
    thx, thw = torch.autograd.grad((tgx * torch.tensor(v0)).sum(), [tx, tw])
    assert_close(gx, tgx.detach().numpy(), rtol=1e-10)
    assert_close(gw, tgw.detach().numpy(), rtol=1e-10)
    assert_close(hx, thx.numpy(), rtol=1e-10)
    assert_close(hw, thw.numpy(), rtol=1e-10)


def test_create_graph_through_broadcast_and_fan_in(torch):
    # The engine's sum_to and InputBuffer sums go through the T backend and
    # record, so the second derivative includes them.
    a = leaf([[1.0], [2.0]])
    b = leaf([0.5, -1.0, 2.0])
    y = ((a + b) * (a + b) * b).sum()
    ga, gb = pyengine.grad(y, [a, b], create_graph=True)
    assert ga.shape == (2, 1) and gb.shape == (3,)
    (h,) = pyengine.grad((ga * ga).sum() + gb.sum(), b)

    ta = torch.tensor(a.data, requires_grad=True)
    tb = torch.tensor(b.data, requires_grad=True)
    ty = ((ta + tb) * (ta + tb) * tb).sum()
    tga, tgb = torch.autograd.grad(ty, [ta, tb], create_graph=True)
    (th,) = torch.autograd.grad((tga * tga).sum() + tgb.sum(), tb)
    assert_close(ga, tga.detach().numpy())
    assert_close(gb, tgb.detach().numpy())
    assert_close(h, th.numpy())


def test_create_graph_accumulates_onto_an_existing_grad():
    x = leaf([1.0, 2.0])
    (x * x).sum().backward()  # .grad is a plain array
    (x * x * x).sum().backward(create_graph=True)  # now a T with a graph
    assert isinstance(x.grad, T)
    assert_close(x.grad, 2 * x.data + 3 * x.data ** 2)
    (gx,) = pyengine.grad(x.grad.sum(), x)
    assert_close(gx, 6 * x.data)


def test_retain_grad_under_create_graph_keeps_a_graph(torch):
    def build(x):
        h = x * x
        h.retain_grad()
        return h, (h * h).sum()

    x = leaf([1.0, 2.0])
    h, y = build(x)
    y.backward(create_graph=True)
    assert isinstance(h.grad, T) and h.grad.grad_fn is not None
    (gx,) = pyengine.grad(h.grad.sum(), x)

    tx = torch.tensor(x.data, requires_grad=True)
    th, ty = build(tx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning about backward(create_graph=True)
        ty.backward(create_graph=True)
    (tgx,) = torch.autograd.grad(th.grad.sum(), tx)
    assert_close(h.grad, th.grad.detach().numpy())
    assert_close(x.grad, tx.grad.detach().numpy())
    assert_close(gx, tgx.numpy())


def test_create_graph_first_gradient_does_not_alias_grad_tensors():
    # PyTorch clones the first gradient under create_graph too
    # (AccumulateGrad: update_grad(clone_obey_contract(new_grad, variable))).
    x = leaf([1.0, 2.0])
    g = np.ones(2)
    passed, _ = tap(x)  # returns the gradient it gets, unchanged
    passed.backward(g, create_graph=True)
    assert x.grad is not g
    g[:] = 5.0
    assert_close(x.grad, [1.0, 1.0])


# -- grad mode -----------------------------------------------------------------------

class ModeProbe(pyengine.Node):
    def __init__(self, x, log):
        super().__init__(next_edges=[gradient_edge(x)], input_metadata=[x.data])
        self.log = log

    def apply(self, grads):
        self.log.append(pyengine.is_grad_enabled())
        return [grads[0]]


def test_grad_mode_inside_apply_follows_create_graph():
    log = []
    x = leaf([1.0])
    node = ModeProbe(x, log)
    root = Edge(node, 0)
    pyengine.backward(root, np.ones(1), retain_graph=True)
    pyengine.backward(root, np.ones(1), retain_graph=True, create_graph=True)
    pyengine.grad(root, x, np.ones(1), retain_graph=True)
    pyengine.grad(root, x, np.ones(1), create_graph=True)
    assert log == [False, True, False, True]
    assert pyengine.is_grad_enabled()


def test_grad_mode_restored_after_backward_under_no_grad():
    log = []
    x = leaf([1.0])
    node = ModeProbe(x, log)
    with pyengine.no_grad():
        pyengine.backward(Edge(node, 0), np.ones(1), create_graph=True)
        assert not pyengine.is_grad_enabled()
    assert log == [True]


def test_grad_mode_restored_after_failed_backward():
    x = leaf([1.0])
    h = x * 2.0
    h.register_hook(lambda g: 1 / 0)
    y = h.sum()
    with pytest.raises(ZeroDivisionError):
        y.backward(create_graph=True)
    assert pyengine.is_grad_enabled()
    with pyengine.no_grad():
        with pytest.raises(ZeroDivisionError):
            y.backward(create_graph=True)
        assert not pyengine.is_grad_enabled()


def test_no_grad_ops_record_nothing():
    x = leaf([1.0])
    with pyengine.no_grad():
        assert not pyengine.is_grad_enabled()
        y = x * 2.0
        with pyengine.enable_grad():
            z = x * 3.0
        assert not pyengine.is_grad_enabled()
    assert pyengine.is_grad_enabled()
    assert y.grad_fn is None and not y.requires_grad
    assert z.grad_fn is not None
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()


def test_no_grad_and_enable_grad_as_decorators():
    @pyengine.no_grad()
    def off():
        return pyengine.is_grad_enabled()

    @pyengine.enable_grad()
    def on():
        return pyengine.is_grad_enabled()

    assert off() is False
    with pyengine.no_grad():
        assert on() is True
        assert not pyengine.is_grad_enabled()
    assert pyengine.is_grad_enabled()


def test_no_grad_and_enable_grad_decorate_bare_as_torchs():
    @pyengine.no_grad
    def off(value):
        return value, pyengine.is_grad_enabled()

    @pyengine.enable_grad
    def on():
        return pyengine.is_grad_enabled()

    assert off(3) == (3, False) and off.__name__ == "off"
    with pyengine.no_grad():
        assert on() is True
        assert not pyengine.is_grad_enabled()
    assert pyengine.is_grad_enabled()
    assert isinstance(pyengine.no_grad(), pyengine.no_grad)


def test_set_grad_enabled_as_a_decorator_leaves_the_mode_as_it_was():
    # torch.set_grad_enabled(False) as a decorator restores the mode it set
    # at once; before, the thread stayed in no-grad mode after decorating.
    @pyengine.set_grad_enabled(False)
    def off():
        return pyengine.is_grad_enabled()

    assert pyengine.is_grad_enabled()
    assert off() is False
    assert pyengine.is_grad_enabled()


@pytest.mark.parametrize("decorator, inside", [(pyengine.no_grad, False),
                                               (pyengine.enable_grad, True),
                                               (lambda: pyengine.set_grad_enabled(False), False)])
def test_a_decorated_generator_runs_under_the_mode_at_each_step(decorator, inside):
    # The oracle is torch's rule: each resume of the generator runs under
    # the decorator's mode; the consumer keeps its own between two values.
    @decorator()
    def steps():
        received = yield pyengine.is_grad_enabled()
        try:
            yield (received, pyengine.is_grad_enabled())
        except KeyError as error:
            yield ("thrown", str(error), pyengine.is_grad_enabled())
        return "done"

    outside = not inside
    with pyengine.set_grad_enabled(outside):
        generator = steps()
        assert next(generator) is inside
        assert pyengine.is_grad_enabled() is outside
        assert generator.send("sent") == ("sent", inside)
        assert generator.throw(KeyError("k")) == ("thrown", "'k'", inside)
        assert pyengine.is_grad_enabled() is outside
        with pytest.raises(StopIteration) as stop:
            next(generator)
        assert stop.value.value == "done"
        closed = steps()
        next(closed)
        closed.close()
        assert pyengine.is_grad_enabled() is outside
    assert pyengine.is_grad_enabled()


def test_set_grad_enabled_function_and_context():
    pyengine.set_grad_enabled(False)
    try:
        assert not pyengine.is_grad_enabled()
    finally:
        pyengine.set_grad_enabled(True)
    assert pyengine.is_grad_enabled()
    with pyengine.set_grad_enabled(False):
        assert not pyengine.is_grad_enabled()
        with pyengine.set_grad_enabled(True):
            assert pyengine.is_grad_enabled()
        assert not pyengine.is_grad_enabled()
    assert pyengine.is_grad_enabled()


def test_backward_works_under_no_grad():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    with pyengine.no_grad():
        y.backward()
    assert_close(x.grad, 2 * x.data)


# -- anomaly mode --------------------------------------------------------------------

class Fail(pyengine.Node):
    def __init__(self, x):
        super().__init__(next_edges=[gradient_edge(x)], input_metadata=[x.data])

    def apply(self, grads):
        raise ValueError("bad backward")


class MakesNan(pyengine.Node):
    def __init__(self, x):
        super().__init__(next_edges=[gradient_edge(x)], input_metadata=[x.data])

    def apply(self, grads):
        return [grads[0] * np.nan]


def attach(node_type, x):
    out = T(x.data.copy())
    out.grad_fn, out.requires_grad = node_type(x), True
    return out


def test_detect_anomaly_warns_and_restores():
    with pytest.warns(UserWarning, match="Anomaly Detection has been enabled"):
        with pyengine.detect_anomaly():
            assert pyengine.is_anomaly_enabled()
    assert not pyengine.is_anomaly_enabled()


def test_anomaly_mode_records_forward_traceback(no_anomaly_warning):
    x = leaf([1.0])
    outside = x * 2.0
    with pyengine.detect_anomaly():
        inside = x * 2.0
    assert "traceback_" not in outside.grad_fn.metadata
    traceback = inside.grad_fn.metadata["traceback_"]
    assert "test_anomaly_mode_records_forward_traceback" in traceback
    assert "inside = x * 2.0" in traceback


def test_failing_node_gets_forward_traceback_note(no_anomaly_warning):
    x = leaf([1.0])
    with pyengine.detect_anomaly():
        bad = attach(Fail, x)
        y = (bad * 2.0).sum()
        with pytest.raises(ValueError, match="bad backward") as excinfo:
            y.backward()
    notes = "\n".join(getattr(excinfo.value, "__notes__", []))
    assert "Fail" in notes
    assert "bad = attach(Fail, x)" in notes


def test_failing_node_without_anomaly_has_no_note():
    x = leaf([1.0])
    with pytest.raises(ValueError) as excinfo:
        (attach(Fail, x) * 2.0).sum().backward()
    assert not getattr(excinfo.value, "__notes__", [])


def test_nan_in_output_raises(no_anomaly_warning):
    x = leaf([1.0, 2.0])
    with pyengine.detect_anomaly():
        y = attach(MakesNan, x).sum()
        with pytest.raises(RuntimeError, match=re.escape(
                "Function 'MakesNan' returned nan values in its 0th output.")):
            y.backward()
    assert x.grad is None


def test_nan_check_can_be_turned_off(no_anomaly_warning):
    x = leaf([1.0, 2.0])
    with pyengine.detect_anomaly(check_nan=False):
        attach(MakesNan, x).sum().backward()
    assert np.isnan(x.grad).all()


def test_nan_without_anomaly_mode_flows_through():
    x = leaf([1.0, 2.0])
    attach(MakesNan, x).sum().backward()
    assert np.isnan(x.grad).all()


def test_set_detect_anomaly():
    with pyengine.set_detect_anomaly(True):
        assert pyengine.is_anomaly_enabled()
        with pyengine.set_detect_anomaly(False):
            assert not pyengine.is_anomaly_enabled()
        assert pyengine.is_anomaly_enabled()
    assert not pyengine.is_anomaly_enabled()


def test_detect_anomaly_as_decorator(no_anomaly_warning):
    @pyengine.detect_anomaly()
    def inner():
        return pyengine.is_anomaly_enabled()

    assert inner() is True
    assert not pyengine.is_anomaly_enabled()


def test_anomaly_mode_keeps_gradients_right(no_anomaly_warning, torch):
    with pyengine.detect_anomaly():
        x = leaf([0.1, 0.2])
        h, _ = tap(exp(x))
        (h * x).sum().backward()
    tx = torch.tensor(x.data, requires_grad=True)
    (tx.exp() * tx).sum().backward()
    assert_close(x.grad, tx.grad.numpy())


def test_anomaly_note_for_node_created_outside(no_anomaly_warning):
    x = leaf([1.0])
    bad = attach(Fail, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pyengine.detect_anomaly():
            with pytest.raises(ValueError) as excinfo:
                bad.sum().backward()
    notes = "\n".join(getattr(excinfo.value, "__notes__", []))
    assert "Fail" in notes and "bad = attach" not in notes


def _mode_context_reuse(lib):
    """The grad and anomaly modes seen while one instance of each mode
    context manager is entered twice, nested and one after the other, in
    ``lib`` (pyengine, or torch as the oracle)."""
    if lib is pyengine:
        anomaly, grad_mode = pyengine, pyengine
        set_grad, is_grad = pyengine.set_grad_enabled, pyengine.is_grad_enabled
        is_anomaly = pyengine.is_anomaly_enabled
    else:
        anomaly, grad_mode = lib.autograd, lib
        set_grad, is_grad = lib._C._set_grad_enabled, lib.is_grad_enabled
        is_anomaly = lib.is_anomaly_enabled
    seen = []
    for make in (lambda: anomaly.detect_anomaly(),
                 lambda: anomaly.detect_anomaly(check_nan=False),
                 lambda: anomaly.set_detect_anomaly(True)):
        context = make()
        with context:
            with context:
                seen.append(is_anomaly())
            seen.append(is_anomaly())
        seen.append(is_anomaly())
        with context:
            seen.append(is_anomaly())
        seen.append(is_anomaly())
        anomaly.set_detect_anomaly(False)
    for start, make in ((True, grad_mode.no_grad), (False, grad_mode.enable_grad),
                        (True, lambda: grad_mode.set_grad_enabled(False)),
                        (False, lambda: grad_mode.set_grad_enabled(True))):
        set_grad(start)
        context = make()
        seen.append(is_grad())
        with context:
            with context:
                seen.append(is_grad())
            seen.append(is_grad())
        seen.append(is_grad())
        set_grad(start)
        with context:
            seen.append(is_grad())
        seen.append(is_grad())
    set_grad(True)
    return seen


def test_mode_contexts_entered_twice_match_torch(torch, no_anomaly_warning):
    # One detect_anomaly instance entered twice, nested, used to leave
    # anomaly mode on after both exits (it saved the mode in __enter__),
    # and a set_grad_enabled instance entered a second time ran its block
    # under the caller's mode. See Note [Where a mode context saves the
    # previous mode] in pyengine/anomaly_mode.py.
    try:
        assert _mode_context_reuse(pyengine) == _mode_context_reuse(torch)
    finally:
        torch.autograd.set_detect_anomaly(False)
        pyengine.set_detect_anomaly(False)
        torch.set_grad_enabled(True)
        pyengine.set_grad_enabled(True)
    assert not pyengine.is_anomaly_enabled() and pyengine.is_grad_enabled()
