"""Every op of the frontend against PyTorch on the same inputs: values, first
derivatives and second derivatives (``create_graph=True``), in float64, on
random shapes with broadcasting drawn by hypothesis.

For each op: ``out = op(*inputs)`` in both libraries; first derivatives
``g = grad(out, inputs, v)`` for a random ``v``; second derivatives
``grad(sum(g_i * w_i), inputs + [v])`` for random ``w_i``. The oracle is
PyTorch's result on the same graph.
"""

from __future__ import annotations

import numpy as np
import pytest
from frontend_helpers import assert_close, to_numpy, zeros_if_none
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyengine.frontend as F

torch = pytest.importorskip("torch")
tnn = pytest.importorskip("torch.nn.functional")

SETTINGS = settings(max_examples=8, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


# -- drawing inputs -------------------------------------------------------------------

@st.composite
def shape(draw, min_dims=0, max_dims=3):
    return tuple(draw(st.lists(st.integers(1, 4), min_size=min_dims, max_size=max_dims)))


@st.composite
def broadcast_shapes(draw, count=2, min_dims=0):
    """``count`` shapes that broadcast together: each drops leading axes of a
    common shape and turns some axes into 1."""
    base = draw(shape(min_dims=min_dims))
    shapes = []
    for _ in range(count):
        drop = draw(st.integers(0, len(base)))
        shapes.append(tuple(1 if draw(st.booleans()) else size for size in base[drop:]))
    return shapes


def values(rng, shape, domain="any"):
    if domain == "any":
        return rng.standard_normal(shape)
    if domain == "positive":
        return rng.uniform(0.5, 2.0, shape)
    if domain == "nonzero":  # away from the kink or pole at 0
        return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.3, 2.0, shape)
    raise ValueError(domain)


class Op:
    """An op in both libraries: ``draw_inputs(draw, rng)`` returns a list of
    float64 arrays; ``ours`` and ``theirs`` map leaf tensors to the output."""

    def __init__(self, name, draw_inputs, ours, theirs, second_order=True):
        self.name = name
        self.draw_inputs = draw_inputs
        self.ours = ours
        self.theirs = theirs
        self.second_order = second_order

    def __repr__(self):
        return self.name


def binary(domains=("any", "any")):
    def draw_inputs(draw, rng):
        shapes = draw(broadcast_shapes(2))
        return [values(rng, s, d) for s, d in zip(shapes, domains)]

    return draw_inputs


def unary(domain="any", min_dims=0):
    def draw_inputs(draw, rng):
        return [values(rng, draw(shape(min_dims=min_dims)), domain)]

    return draw_inputs


def fixed(*shapes, domain="any"):
    def draw_inputs(draw, rng):
        chosen = draw(st.sampled_from(shapes))
        return [values(rng, s, domain) for s in chosen]

    return draw_inputs


def away_from(points, margin=0.05):
    """Values in [-2, 2] at least ``margin`` away from each of ``points``."""

    def draw_inputs(draw, rng):
        x = rng.uniform(-2, 2, draw(shape()))
        for point in points:
            close = np.abs(x - point) < margin
            x = np.where(close, point + np.sign(x - point + 1e-12) * 2 * margin, x)
        return [x]

    return draw_inputs


def where_inputs(draw, rng):
    shapes = draw(broadcast_shapes(3))
    return [rng.random(shapes[0]) < 0.5, values(rng, shapes[1]), values(rng, shapes[2])]


def reduction_inputs(draw, rng):
    return [values(rng, draw(shape(min_dims=1)))]


def _axis(draw, ndim):
    choice = draw(st.sampled_from(["none", "one", "several"]))
    if choice == "none":
        return None
    if choice == "one":
        return draw(st.integers(-ndim, ndim - 1))
    axes = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    return tuple(axes)


def reduction(name, ours_fn, torch_fn):
    """An op per (axis, keepdims) drawn alongside the input."""

    def draw_inputs(draw, rng):
        x = values(rng, draw(shape(min_dims=1)))
        draw_inputs.case = (_axis(draw, x.ndim), draw(st.booleans()))
        return [x]

    def ours(x):
        axis, keepdims = draw_inputs.case
        return ours_fn(x, axis=axis, keepdims=keepdims)

    def theirs(x):
        axis, keepdims = draw_inputs.case
        dims = tuple(range(x.ndim)) if axis is None else axis
        return torch_fn(x, dims, keepdims)

    return Op(name, draw_inputs, ours, theirs)


def case_op(name, cases, inputs, ours, theirs):
    """An op whose extra arguments are drawn from ``cases``."""

    def draw_inputs(draw, rng):
        draw_inputs.case = draw(st.sampled_from(cases))
        return inputs(draw_inputs.case, rng)

    return Op(name, draw_inputs, lambda *xs: ours(draw_inputs.case, *xs),
              lambda *xs: theirs(draw_inputs.case, *xs))


def _torch_index(index):
    items = index if isinstance(index, tuple) else (index,)
    return tuple(torch.as_tensor(item) if isinstance(item, (np.ndarray, list)) else item
                 for item in items)


def _inplace(method, other_domain="any"):
    """``y = x * 1; y.method(w)``: an in-place op on a non-leaf, with an other
    operand that requires grad."""

    def run(x, w):
        y = x * 1.0
        getattr(y, method)(w)
        return y

    return Op(method, _inplace_inputs(other_domain), run, run)


def _inplace_inputs(other_domain):
    def draw_inputs(draw, rng):
        base, other = draw(broadcast_shapes(2, min_dims=1))
        # The target keeps the full shape; the other operand broadcasts to it.
        full = tuple(np.broadcast_shapes(base, other))
        return [values(rng, full, "positive"), values(rng, other, other_domain)]

    return draw_inputs


OPS = [
    # arithmetic, broadcasting
    Op("add", binary(), lambda a, b: a + b, lambda a, b: a + b),
    Op("sub", binary(), lambda a, b: a - b, lambda a, b: a - b),
    Op("mul", binary(), lambda a, b: a * b, lambda a, b: a * b),
    Op("div", binary(("any", "nonzero")), lambda a, b: a / b, lambda a, b: a / b),
    Op("neg", unary(), lambda a: -a, lambda a: -a),
    Op("add_scalar", unary(), lambda a: a + 2.5, lambda a: a + 2.5),
    Op("rsub_scalar", unary(), lambda a: 2.5 - a, lambda a: 2.5 - a),
    Op("mul_scalar", unary(), lambda a: a * -1.5, lambda a: a * -1.5),
    Op("rdiv_scalar", unary("nonzero"), lambda a: 2.0 / a, lambda a: 2.0 / a),
    Op("pow_tensor_tensor", binary(("positive", "any")), lambda a, b: a ** b, lambda a, b: a ** b),
    case_op("pow_scalar", [2, 3, 0.5, -1.5, 0, 1],
            lambda case, rng: [values(rng, (2, 3), "positive")],
            lambda case, a: a ** case, lambda case, a: a ** case),
    Op("rpow_scalar", unary(), lambda a: 2.0 ** a, lambda a: 2.0 ** a),
    # elementwise functions
    Op("exp", unary(), F.exp, torch.exp),
    Op("log", unary("positive"), F.log, torch.log),
    Op("sqrt", unary("positive"), F.sqrt, torch.sqrt),
    Op("tanh", unary(), F.tanh, torch.tanh),
    Op("sigmoid", unary(), F.sigmoid, torch.sigmoid),
    Op("relu", unary("nonzero"), F.relu, torch.relu),
    Op("abs", unary("nonzero"), F.abs, torch.abs),
    Op("clip", away_from([-0.5, 0.5]), lambda x: F.clip(x, -0.5, 0.5),
       lambda x: torch.clamp(x, -0.5, 0.5)),
    Op("clip_min", away_from([0.2]), lambda x: x.clip(min=0.2), lambda x: torch.clamp(x, min=0.2)),
    Op("maximum", binary(), F.maximum, torch.maximum),
    Op("where", where_inputs,
       lambda c, a, b: F.where(c.data.astype(bool), a, b),
       lambda c, a, b: torch.where(c.detach().bool(), a, b)),
    # matrix products
    Op("matmul", fixed(((3, 4), (4, 2)), ((4,), (4, 2)), ((3, 4), (4,)), ((4,), (4,)),
                       ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)), ((4,), (2, 4, 3)),
                       ((2, 3, 4), (4,)), ((1, 3, 4), (2, 4, 2))),
       lambda a, b: a @ b, lambda a, b: a @ b),
    Op("linear", fixed(((5, 3), (4, 3), (4,)), ((2, 5, 3), (4, 3), (4,)), ((3,), (4, 3), (4,))),
       F.linear, tnn.linear),
    # reductions
    reduction("sum", F.sum, lambda x, dims, keep: x.sum(dim=dims, keepdim=keep)),
    reduction("mean", F.mean, lambda x, dims, keep: x.mean(dim=dims, keepdim=keep)),
    reduction("max", F.max, lambda x, dims, keep: torch.amax(x, dim=dims, keepdim=keep)),
    case_op("sum_to", [((2, 3, 4), (3, 1)), ((2, 3), (1, 3)), ((4,), ()), ((2, 1, 3), (2, 1, 3))],
            lambda case, rng: [values(rng, case[0])],
            lambda case, x: F.sum_to(x, case[1]), lambda case, x: x.sum_to_size(case[1])),
    # shapes
    case_op("reshape", [((2, 3, 4), (4, 6)), ((2, 3, 4), (-1,)), ((6,), (3, 1, 2)), ((), (1, 1))],
            lambda case, rng: [values(rng, case[0])],
            lambda case, x: x.reshape(case[1]), lambda case, x: x.reshape(case[1])),
    case_op("transpose", [((2, 3, 4), None), ((2, 3, 4), (1, 0, 2)), ((3, 4), (1, 0)), ((5,), None)],
            lambda case, rng: [values(rng, case[0])],
            lambda case, x: x.transpose(case[1]),
            lambda case, x: x.permute(case[1] or tuple(range(x.ndim))[::-1])),
    Op("T", fixed(((3, 4),)), lambda x: x.T, lambda x: x.T),
    Op("swapaxes", fixed(((2, 3, 4),)), lambda x: x.swapaxes(0, -1), lambda x: x.transpose(0, -1)),
    case_op("broadcast_to", [((3, 1), (2, 3, 4)), ((4,), (3, 4)), ((), (2, 2)), ((1, 1), (1, 5))],
            lambda case, rng: [values(rng, case[0])],
            lambda case, x: x.broadcast_to(case[1]), lambda case, x: x.broadcast_to(case[1])),
    # indexing
    case_op("getitem", [1, (slice(None), slice(1, 3)), (None, Ellipsis, 0), (0, 2, 1),
                        (slice(1, None), None, slice(None, None, 2)), Ellipsis,
                        [0, 2, 0, 0], (slice(None), np.array([1, 1, 0])), np.array([[0, 1], [1, 0]]),
                        ([0, 1, 1], [2, 0, 2]), (np.array([2, 2]), slice(None), 1)],
            lambda case, rng: [values(rng, (3, 4, 2))],
            lambda case, x: x[case], lambda case, x: x[_torch_index(case)]),
    case_op("getitem_mask", [0.5, 0.2],
            lambda case, rng: [values(rng, (3, 4)), rng.random((3, 4)) < case],
            lambda case, x, m: x[m.data.astype(bool)], lambda case, x, m: x[m.detach().bool()]),
    case_op("setitem", [(slice(1, 3), (2, 4)), ((0, slice(None)), (4,)), ((slice(None), 1), ()),
                        ([0, 2], (1, 4))],
            lambda case, rng: [values(rng, (3, 4)), values(rng, case[1])],
            lambda case, x, v: _setitem(x * 1.0, case[0], v),
            lambda case, x, v: _setitem(x * 1.0, _torch_index(case[0]), v)),
    case_op("concatenate", [0, 1, -1],
            lambda case, rng: [values(rng, (2, 3)), values(rng, (2, 3)), values(rng, (2, 3))],
            lambda case, a, b, c: F.concatenate([a, b, c], axis=case),
            lambda case, a, b, c: torch.cat([a, b, c], dim=case)),
    case_op("concatenate_sizes", [0],
            lambda case, rng: [values(rng, (1, 3)), values(rng, (4, 3))],
            lambda case, a, b: F.concatenate([a, b], axis=case),
            lambda case, a, b: torch.cat([a, b], dim=case)),
    case_op("stack", [0, 1, -1],
            lambda case, rng: [values(rng, (2, 3)), values(rng, (2, 3))],
            lambda case, a, b: F.stack([a, b], axis=case),
            lambda case, a, b: torch.stack([a, b], dim=case)),
    # softmax and losses
    case_op("softmax", [-1, 0, 1], lambda case, rng: [values(rng, (3, 4))],
            lambda case, x: F.softmax(x, case), lambda case, x: torch.softmax(x, case)),
    case_op("log_softmax", [-1, 0], lambda case, rng: [values(rng, (3, 4))],
            lambda case, x: F.log_softmax(x, case), lambda case, x: torch.log_softmax(x, case)),
    case_op("cross_entropy", ["mean", "sum", "none"], lambda case, rng: [values(rng, (5, 3))],
            lambda case, x: F.cross_entropy(x, np.array([0, 2, 1, 2, 2]), reduction=case),
            lambda case, x: tnn.cross_entropy(x, torch.tensor([0, 2, 1, 2, 2]), reduction=case)),
    # in-place ops on a non-leaf, recorded and rebased
    _inplace("add_"),
    _inplace("sub_"),
    _inplace("mul_"),
    _inplace("div_", "nonzero"),
]

OPS += [
    Op("clone", unary(), lambda x: F.clone(x) * 1.0, lambda x: torch.clone(x) * 1.0),
    Op("astype", unary(), lambda x: (x.astype(np.float32) * 3.0).astype(np.float64),
       lambda x: (x.float() * 3.0).double()),
    Op("exp_", unary(), lambda x: (x * 1.0).exp_(), lambda x: (x * 1.0).exp_()),
    Op("relu_", unary("nonzero"), lambda x: (x * 1.0).relu_(), lambda x: (x * 1.0).relu_()),
    Op("clip_", away_from([-0.5, 0.5]), lambda x: (x * 1.0).clip_(-0.5, 0.5),
       lambda x: (x * 1.0).clamp_(-0.5, 0.5)),
    Op("iadd", _inplace_inputs("any"), lambda a, b: _plus_equals(a * 1.0, b),
       lambda a, b: _plus_equals(a * 1.0, b)),
]


def _plus_equals(target, other):
    target += other
    return target


def _setitem(target, index, value):
    target[index] = value
    return target


# -- the check ------------------------------------------------------------------------

def check(op, arrays, rng):
    ours_in = [F.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    theirs_in = [torch.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    wrt = [i for i, a in enumerate(arrays) if a.dtype.kind == "f"]
    theirs = op.theirs(*theirs_in)
    ours = op.ours(*ours_in)
    assert_close(ours, theirs, what=f"{op} forward")

    v = rng.standard_normal(to_numpy(theirs).shape)
    ours_v, theirs_v = F.tensor(v, requires_grad=True), torch.tensor(v, requires_grad=True)
    ours_g = F.grad(ours, [ours_in[i] for i in wrt], ours_v, create_graph=True, allow_unused=True)
    theirs_g = torch.autograd.grad(theirs, [theirs_in[i] for i in wrt], theirs_v,
                                   create_graph=True, allow_unused=True)
    for i, (a, b) in enumerate(zip(ours_g, theirs_g)):
        assert_close(a, b, what=f"{op} first derivative {i}")
    if not op.second_order:
        return

    ws = [rng.standard_normal(to_numpy(g).shape) if g is not None else None for g in theirs_g]
    ours_s = sum((g * w).sum() for g, w in zip(ours_g, ws) if g is not None and g.requires_grad)
    theirs_s = sum((g * torch.tensor(w)).sum() for g, w in zip(theirs_g, ws)
                   if g is not None and g.requires_grad)
    if isinstance(theirs_s, int):
        return  # no first derivative depends on anything: nothing to differentiate
    targets_ours = [ours_in[i] for i in wrt] + [ours_v]
    targets_theirs = [theirs_in[i] for i in wrt] + [theirs_v]
    ours_gg = F.grad(ours_s, targets_ours, allow_unused=True)
    theirs_gg = torch.autograd.grad(theirs_s, targets_theirs, allow_unused=True)
    for i, (a, b) in enumerate(zip(zeros_if_none(ours_gg, targets_ours),
                                   zeros_if_none(theirs_gg, targets_theirs))):
        assert_close(a, b, what=f"{op} second derivative {i}")


@pytest.mark.parametrize("op", OPS, ids=repr)
@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_op_matches_torch(op, data, seed):
    rng = np.random.default_rng(seed)
    arrays = op.draw_inputs(data.draw, rng)
    check(op, arrays, rng)


# -- third derivatives of scalar functions ---------------------------------------------

SCALAR_FUNCTIONS = [
    ("tanh*exp", lambda x: F.tanh(x) * F.exp(x), lambda x: torch.tanh(x) * torch.exp(x)),
    ("sigmoid(x^2)/x", lambda x: F.sigmoid(x ** 2) / x, lambda x: torch.sigmoid(x ** 2) / x),
    ("log(1+x^2)*sqrt(x^2+1)", lambda x: F.log(1 + x * x) * F.sqrt(x * x + 1),
     lambda x: torch.log(1 + x * x) * torch.sqrt(x * x + 1)),
    ("x^x", lambda x: F.abs(x) ** x, lambda x: torch.abs(x) ** x),
    ("logsumexp", lambda x: F.log_softmax(F.stack([x, x * x, -x]), 0)[0],
     lambda x: torch.log_softmax(torch.stack([x, x * x, -x]), 0)[0]),
]


@pytest.mark.parametrize("name,ours,theirs", SCALAR_FUNCTIONS, ids=[f[0] for f in SCALAR_FUNCTIONS])
def test_third_derivative_matches_torch(name, ours, theirs):
    points = np.array([-1.3, -0.4, 0.7, 1.9])
    x, tx = F.tensor(points, requires_grad=True), torch.tensor(points, requires_grad=True)
    y, ty = ours(x).sum(), theirs(tx).sum()
    for order in (1, 2, 3):
        (x_grad,) = F.grad(y, x, create_graph=True)
        (t_grad,) = torch.autograd.grad(ty, tx, create_graph=True)
        assert_close(x_grad, t_grad, what=f"{name} derivative {order}")
        y, ty = x_grad.sum(), t_grad.sum()


# -- pow at a zero base ----------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                            "ignore:invalid value:RuntimeWarning")  # numpy's log(0), 0 * inf
def test_pow_exponent_gradient_at_a_zero_base_matches_torch():
    # PyTorch's pow_backward_exponent is grad * where(a == 0 & b >= 0, 0,
    # out * log(a)): the mask applies to out * log(a), not to the incoming
    # gradient, so a NaN or inf there reaches b; and the second derivative
    # through log(0) is NaN at a zero base.
    a_values = np.array([0.0, 2.0, 0.0, 0.0, 0.0, 1.0])
    b_values = np.array([1.0, 1.0, 0.0, 0.5, 2.0, -1.0])
    incoming = np.array([np.nan, np.inf, 1.0, -np.inf, 1.0, np.nan])
    b, tb = F.tensor(b_values, requires_grad=True), torch.tensor(b_values, requires_grad=True)
    (g,) = F.grad(F.tensor(a_values) ** b, [b], grad_outputs=[incoming])
    (tg,) = torch.autograd.grad(torch.tensor(a_values) ** tb, [tb],
                                grad_outputs=[torch.tensor(incoming)])
    assert_close(g, tg, what="pow exponent gradient")
    a, ta = F.tensor(a_values, requires_grad=True), torch.tensor(a_values, requires_grad=True)
    b, tb = F.tensor(b_values, requires_grad=True), torch.tensor(b_values, requires_grad=True)
    ga, gb = F.grad((a ** b).sum(), [a, b], create_graph=True)
    tga, tgb = torch.autograd.grad((ta ** tb).sum(), [ta, tb], create_graph=True)
    assert_close(ga, tga, what="pow base gradient")
    assert_close(gb, tgb, what="pow exponent gradient")
    for name, ours, theirs in (("d(grad_b)", gb, tgb), ("d(grad_a)", ga, tga)):
        second = F.grad(ours.sum(), [a, b], allow_unused=True)
        t_second = torch.autograd.grad(theirs.sum(), [ta, tb], allow_unused=True)
        for i, (x, y) in enumerate(zip(zeros_if_none(second, [a, b]),
                                       zeros_if_none(t_second, [ta, tb]))):
            assert_close(x, y, what=f"{name}/d(input {i})")


# -- class indices out of bounds ---------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", ["nll_loss", "cross_entropy"])
@pytest.mark.parametrize("target", [[0, -1, 2], [-3, 1, 1], [0, 1, 4], [4, 0, 0], [0, 9, -2]])
def test_a_target_out_of_bounds_raises_as_in_torch(name, reduction, target):
    # numpy indexing counted -1 from the end (a loss and a gradient for the
    # last class); PyTorch raises IndexError naming the target.
    if reduction == "none" and target == [0, 9, -2]:
        target = [0, 9, 1]  # torch's unreduced kernel may name either of two bad targets
    x = np.log(np.random.default_rng(0).dirichlet(np.ones(4), size=3))
    with pytest.raises(IndexError) as theirs:
        getattr(tnn, name)(torch.tensor(x), torch.tensor(target), reduction=reduction)
    with pytest.raises(IndexError) as ours:
        getattr(F, name)(F.tensor(x, requires_grad=True), np.array(target), reduction=reduction)
    assert str(ours.value) == str(theirs.value)


def test_ignore_index_is_not_supported_so_minus_100_is_refused():
    # PyTorch ignores a target of -100 (its default ignore_index); the
    # frontend has no ignore_index and refuses it rather than wrap it.
    with pytest.raises(IndexError, match=r"^Target -100 is out of bounds\.$"):
        F.nll_loss(F.tensor(np.zeros((2, 3))), np.array([0, -100]))


@pytest.mark.parametrize("shape,axis", [((0,), -1), ((2, 0), -1), ((0, 3), 0), ((0, 3), 1)])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_of_an_empty_tensor_is_empty_as_in_torch(torch, name, shape, axis):
    # Reducing an empty axis used to raise numpy's "zero-size array to
    # reduction operation maximum which has no identity".
    x = F.tensor(np.zeros(shape), requires_grad=True)
    tx = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    out, tout = getattr(F, name)(x, axis), getattr(torch, name)(tx, axis)
    assert_close(out, tout)
    out.sum().backward()
    tout.sum().backward()
    assert_close(x.grad, tx.grad)


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", [0, -1, (0,)])
@pytest.mark.parametrize("name", ["sum", "mean", "max"])
def test_reducing_a_0d_tensor_over_axis_0_as_torch(torch, name, axis, keepdims):
    # numpy refuses the axis (AxisError); torch, whose 0-d tensors take
    # axis 0 and -1, reduces over nothing.
    x = F.tensor(np.float64(2.5), requires_grad=True)
    tx = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    torch_reduce = torch.amax if name == "max" else getattr(torch, name)
    out, tout = getattr(F, name)(x, axis, keepdims), torch_reduce(tx, axis, keepdim=keepdims)
    assert_close(out, tout)
    (out * 3.0).sum().backward()
    (tout * 3.0).sum().backward()
    assert_close(x.grad, tx.grad)
    with pytest.raises(ValueError, match="axis 1 is out of bounds for a tensor of dimension 0"):
        getattr(F, name)(x, 1)
