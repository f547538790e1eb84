"""The owner-graph options of issue 18 (See Note [Owner graphs] in
``pyengine/_pure/owner_graph.py``): ``should_compute_output=True``,
``gradient_policy="reduce"|"exact"`` and ``accumulates=True``, on both
cores (the suite runs twice) and side by side in one process.

The framework under test is the DeZero-like one of
``tests/test_owner_graph_protocol.py``. Oracles: PyTorch on the same
random programs, analytic gradients, the same run with the option off, and
for ``should_compute_output`` the graph's own structure (which parent leads
to an input), worked out by hand for each small graph.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_owner_graph_protocol import (
    Add,
    Function,
    Mul,
    Sin,
    Split,
    Value,
    build,
    compiled_owner_graph,
    item_of,
    make_graph,
    num_inputs,
    parents,
    pure_owner_graph,
    random_program,
    torch_grads,
)

import pyengine
from pyengine import fake_device as fd

needs_compiled = pytest.mark.skipif(compiled_owner_graph is None, reason="no compiled core")


def seen_by(log):
    """A backward for ``should_compute_output=True`` that logs each tuple it
    gets and returns None where the tuple says no gradient is used."""
    def backward(owner, grads, should_compute_output):
        log.append((type(owner).__name__, should_compute_output))
        outputs = owner.vjp(grads)
        return [g if needed else None for g, needed in zip(outputs, should_compute_output)]
    return backward


# -- should_compute_output ------------------------------------------------------------------------


def test_should_compute_output_names_the_items_that_lead_somewhere():
    x, constant = Value([1.0, 2.0, 3.0]), Value([0.5, 0.5, 0.5])
    log = []
    y = Mul(x, constant).outputs()
    # A None item and a parent needs_no_gradient refuses get False; a leaf gets True.
    with_none = lambda owner: [None] + parents(owner) if owner is y.creator else parents(owner)  # noqa: E731

    def backward(owner, grads, should_compute_output):
        log.append(should_compute_output)
        outputs = owner.vjp(grads)
        return [None] + outputs if owner is y.creator else outputs

    graph = pyengine.OwnerGraph(with_none, backward, mode="returns", num_inputs=num_inputs,
                                needs_no_gradient=lambda owner: owner is constant,
                                should_compute_output=True)
    assert graph.should_compute_output is True
    graph.backward(item_of(y), np.ones(3))
    assert log == [(False, True, False)]
    np.testing.assert_array_equal(x.grad, constant.data)
    assert constant.grad is None


def test_should_compute_output_under_grad_inputs_prunes_what_leads_to_no_input():
    # y = sin(x) * sin(w) + x*x: with inputs=[x], the sin(w) branch leads nowhere.
    x, w = Value([0.3, -1.2, 0.7]), Value([1.1, 0.4, -0.5])
    sin_x, sin_w = Sin(x), Sin(w)
    product = Mul(sin_x.outputs(), sin_w.outputs())
    square = Mul(x, x)
    total = Add(product.outputs(), square.outputs())
    y = total.outputs()
    log = []
    graph = pyengine.OwnerGraph(parents, seen_by(log), mode="returns", num_inputs=num_inputs,
                                should_compute_output=True)
    (gx,) = graph.grad(item_of(y), np.ones(3), [x])
    np.testing.assert_allclose(gx, np.cos(x.data) * np.sin(w.data) + 2 * x.data, rtol=1e-12)
    # Sin(w) never runs (it leads to no input); Mul(sin x, sin w) computes only its first.
    assert sorted(log) == sorted([("Add", (True, True)), ("Mul", (True, False)),
                                  ("Mul", (True, True)), ("Sin", (True,))])
    # An input in the middle of the graph: its owner captures, so its item is True.
    log.clear()
    (g_product,) = graph.grad(item_of(y), np.ones(3), [product])
    np.testing.assert_array_equal(g_product, np.ones(3))
    assert log == [("Add", (True, False))]
    # Without inputs every reached parent is used.
    log.clear()
    graph.backward(item_of(y), np.ones(3))
    assert ("Mul", (True, True)) in log and ("Sin", (True,)) in log and len(log) == 5
    np.testing.assert_allclose(w.grad, np.sin(x.data) * np.cos(w.data), rtol=1e-12)


def test_should_compute_output_through_a_method_name_and_pairs(monkeypatch):
    def vjp_needed(self, grads, should_compute_output):
        self.seen = should_compute_output
        return self.vjp(grads)

    monkeypatch.setattr(Function, "vjp_needed", vjp_needed, raising=False)
    x = Value([0.5, -1.0, 2.0])
    split = Split(x)
    double, square = split.outputs()
    product = Mul(square, double)
    y = Add(double, product.outputs()).outputs()
    for reader in ("vjp_needed", lambda owner, grads, needed: owner.vjp_needed(grads, needed)):
        x.grad = None
        pyengine.OwnerGraph(parents, reader, mode="returns", num_inputs=num_inputs,
                            should_compute_output=True).backward(item_of(y), np.ones(3))
        assert split.seen == (True,) and product.seen == (True, True)
        np.testing.assert_allclose(x.grad, 2 + 6 * x.data ** 2, rtol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_skipping_unneeded_outputs_gives_torchs_gradients(seed, torch):
    program = random_program(seed)
    leaves, values = build(program)
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(3, len(values) - 1), k=2)) + [0]
    inputs = [item_of(values[i]) for i in chosen]
    graph = pyengine.OwnerGraph(parents, seen_by([]), mode="returns", num_inputs=num_inputs,
                                should_compute_output=True)
    got = graph.grad(item_of(values[-1]), np.ones(3), inputs, allow_unused=True)
    for g, e in zip(got, torch_grads(torch, program, inputs=chosen)):
        if e is None:
            assert g is None
        else:
            np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)
    graph.backward(item_of(values[-1]), np.ones(3))
    for leaf, e in zip(leaves, torch_grads(torch, program)):
        if e is None:
            assert leaf.grad is None
        else:
            np.testing.assert_allclose(leaf.grad, e, rtol=1e-12, atol=1e-12)


# -- gradient_policy ------------------------------------------------------------------------------


class Returns(Sin):
    """An owner whose backward returns ``result`` for its one parent."""

    def __init__(self, x, result):
        super().__init__(x)
        self.result = result

    def vjp(self, grads):
        return [self.result]


def policy_graph(policy, spec=((3,), np.float64)):
    return make_graph(metadata=lambda owner: [spec] * num_inputs(owner), gradient_policy=policy)


def test_exact_policy_passes_matching_gradients_as_reduce_does():
    x = Value([0.5, -1.0, 2.0])
    a = Sin(x).outputs()
    y = Mul(Add(a, x).outputs(), Add(a, a).outputs()).outputs()
    expected = ((np.cos(x.data) + 1) * 2 * np.sin(x.data)
                + (np.sin(x.data) + x.data) * 2 * np.cos(x.data))
    for policy in ("reduce", "exact"):
        x.grad = None
        graph = policy_graph(policy)
        assert graph.gradient_policy == policy
        graph.backward(item_of(y), np.ones(3))
        np.testing.assert_allclose(x.grad, expected, rtol=1e-12)
    assert make_graph().gradient_policy == "reduce"


EXACT_CASES = {
    # name: (returned gradient, slot spec, what reduce makes of it, exact's error)
    "broadcast": (np.ones((2, 3)), ((3,), np.float64), np.full(3, 2.0),
                  r"backward of a Returns: invalid gradient at index 0 - got shape \(2, 3\) but "
                  r"expected shape \(3,\)"),
    "cast": (np.ones(3, np.float32), ((3,), np.float64), np.ones(3),
             r"backward of a Returns: invalid gradient at index 0 - expected dtype float64 but got "
             r"float32"),
    "integer": (np.ones(3, np.int32), ((3,), np.int64), np.ones(3, np.int64),
                r"invalid gradient at index 0 - expected dtype int64 but got int32"),
    "device": (np.ones(()), ((), np.float64, fd.device(0)), "moved",
               r"invalid gradient at index 0 - expected device fake:0 but got cpu"),
}


@pytest.mark.parametrize("case", sorted(EXACT_CASES))
def test_exact_policy_refuses_what_reduce_fixes(case):
    gradient, spec, reduced, match = EXACT_CASES[case]
    x = Value([1.0, 2.0, 3.0])
    y = Returns(x, gradient).outputs()
    seed = np.ones(()) if case == "device" else np.ones(3)
    root_spec = ((), np.float64) if case == "device" else ((3,), np.float64)
    metadata = lambda owner: [spec if owner is x else root_spec]  # noqa: E731
    make_graph(metadata=metadata).backward(item_of(y), seed)
    if isinstance(reduced, str):
        assert pyengine.backend_of(x.grad).device(x.grad) == fd.device(0)
    else:
        np.testing.assert_array_equal(x.grad, reduced)
        assert x.grad.dtype == reduced.dtype
    x.grad = None
    with pytest.raises(RuntimeError, match=match):
        make_graph(metadata=metadata, gradient_policy="exact").backward(item_of(y), seed)
    assert x.grad is None
    assert pyengine.is_grad_enabled()


def test_exact_policy_takes_an_integer_gradient_for_its_own_dtype_and_checks_the_root():
    x = Value([1.0, 2.0, 3.0])
    y = Returns(x, np.array([1, 2, 3], np.int64)).outputs()
    metadata = lambda owner: [((3,), np.int64)]  # noqa: E731
    graph = make_graph(metadata=metadata, gradient_policy="exact")
    graph.backward(item_of(y), np.ones(3, np.int64))
    assert x.grad.dtype == np.int64
    np.testing.assert_array_equal(x.grad, [1, 2, 3])
    with pytest.raises(RuntimeError, match=r"the root's gradient: invalid gradient at index 0 - "
                                           r"expected dtype int64 but got float64"):
        graph.backward(item_of(y), np.ones(3))
    with pytest.raises(TypeError, match=r"the root's gradient: invalid gradient at index 0 - "
                                        "expected an array, but got str"):
        graph.backward(item_of(y), "one")


# -- accumulates ----------------------------------------------------------------------------------


def chainer_backward(log=None):
    """Chainer's default ``backward_accumulate``: the owner's gradients plus
    what its parents' buffers hold so far."""
    def backward(owner, grads, buffered):
        if log is not None:
            log.append((type(owner).__name__,
                        tuple(None if b is None else b.tolist() for b in buffered)))
        outputs = owner.vjp(grads)
        return [g if b is None else g + b for g, b in zip(outputs, buffered)]
    return backward


@pytest.mark.parametrize("seed", range(8))
def test_accumulating_backwards_give_torchs_gradients(seed, torch):
    program = random_program(seed)
    leaves, values = build(program)
    graph = pyengine.OwnerGraph(parents, chainer_backward(), mode="returns",
                                num_inputs=num_inputs, accumulates=True)
    assert graph.accumulates is True
    graph.backward(item_of(values[-1]), np.ones(3))
    for leaf, expected in zip(leaves, torch_grads(torch, program)):
        if expected is None:
            assert leaf.grad is None
        else:
            np.testing.assert_allclose(leaf.grad, expected, rtol=1e-12, atol=1e-12)


def test_accumulates_hands_over_the_sum_so_far_and_the_result_replaces_it():
    # y = sin(x) * x: Mul runs first and sends x a gradient; then Sin sees it.
    x = Value([0.5, -1.0, 2.0])
    s = Sin(x).outputs()
    y = Mul(s, x).outputs()
    log = []
    graph = pyengine.OwnerGraph(parents, chainer_backward(log), mode="returns",
                                num_inputs=num_inputs, accumulates=True)
    graph.backward(item_of(y), np.ones(3))
    assert log == [("Mul", (None, None)), ("Sin", (np.sin(x.data).tolist(),))]
    np.testing.assert_allclose(x.grad, np.sin(x.data) + x.data * np.cos(x.data), rtol=1e-12)

    # A backward that drops what it is handed replaces it: only its own gradient is left.
    def forgetful(owner, grads, buffered):
        return owner.vjp(grads)

    x.grad = None
    pyengine.OwnerGraph(parents, forgetful, mode="returns", num_inputs=num_inputs,
                        accumulates=True).backward(item_of(y), np.ones(3))
    np.testing.assert_allclose(x.grad, x.data * np.cos(x.data), rtol=1e-12)


def test_accumulates_hands_a_repeated_parent_its_sum_once():
    # x*x after sin(x)'s gradient reached x: the first item takes the sum, the second gets None.
    x = Value([0.5, -1.0, 2.0])
    s = Sin(x).outputs()
    square = Mul(x, x)
    y = Add(square.outputs(), s).outputs()
    log = []
    pyengine.OwnerGraph(parents, chainer_backward(log), mode="returns", num_inputs=num_inputs,
                        accumulates=True).backward(item_of(y), np.ones(3))
    names = [entry[0] for entry in log]
    mul_seen = log[names.index("Mul")][1]
    if names.index("Mul") > names.index("Sin"):
        assert mul_seen == (np.cos(x.data).tolist(), None)
    else:
        assert mul_seen == (None, None)
    np.testing.assert_allclose(x.grad, 2 * x.data + np.cos(x.data), rtol=1e-12)


def test_accumulates_never_lets_the_engine_write_into_a_sum_it_gave_away():
    # x gets gradients from x*x twice and from sin(x): the buffer sums two
    # gradients of one x*x into a value it owns, hands that to the next
    # owner, which adds into it and returns it; a later sum must not write
    # into a value a backward returned.
    x = Value([1.0, 2.0, 3.0])
    first, sine, second = Mul(x, x), Sin(x), Mul(x, x)
    y = Add(Add(first.outputs(), sine.outputs()).outputs(), second.outputs()).outputs()
    returned = []  # (value, its copy when returned)

    def in_place(owner, grads, buffered):
        outputs = owner.vjp(grads)
        results = []
        for g, b in zip(outputs, buffered):
            if b is None:
                results.append(g)
                continue
            # Handed over: the value is this backward's now.
            returned[:] = [entry for entry in returned if entry[0] is not b]
            b += g
            results.append(b)
        returned.extend((value, value.copy()) for value in results)
        return results

    pyengine.OwnerGraph(parents, in_place, mode="returns", num_inputs=num_inputs,
                        accumulates=True).backward(item_of(y), np.ones(3))
    np.testing.assert_allclose(x.grad, 4 * x.data + np.cos(x.data), rtol=1e-12)
    assert returned
    for value, copy in returned:
        np.testing.assert_array_equal(value, copy)


def test_both_options_come_in_order_and_hooks_still_run():
    x, w = Value([0.5, -1.0, 2.0]), Value([1.0, 1.0, 1.0])
    y = Mul(Sin(x).outputs(), x).outputs()
    calls = []

    def backward(owner, grads, should_compute_output, buffered):
        calls.append((type(owner).__name__, should_compute_output,
                      tuple(b is not None for b in buffered)))
        outputs = owner.vjp(grads)
        return [g if b is None else g + b for g, b in zip(outputs, buffered)]

    hooks = []
    graph = pyengine.OwnerGraph(parents, backward, mode="returns", num_inputs=num_inputs,
                                should_compute_output=True, accumulates=True,
                                pre_hook=lambda owner, grads: hooks.append("pre"),
                                post_hook=lambda owner, out, grads: hooks.append("post"))
    graph.backward(item_of(y), np.ones(3))
    assert calls == [("Mul", (True, True), (False, False)), ("Sin", (True,), (True,))]
    assert hooks == ["pre", "post", "pre", "post"]
    np.testing.assert_allclose(x.grad, np.sin(x.data) + x.data * np.cos(x.data), rtol=1e-12)
    assert w.grad is None


# -- bad options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, error, match", [
    (dict(gradient_policy="sum"), ValueError, "gradient_policy must be 'reduce' or 'exact', got 'sum'"),
    (dict(should_compute_output=1), TypeError, "should_compute_output must be a bool, got int"),
    (dict(accumulates="yes"), TypeError, "accumulates must be a bool, got str"),
])
def test_bad_options_are_refused(options, error, match):
    with pytest.raises(error, match=match):
        make_graph(**options)


@pytest.mark.parametrize("option", [dict(should_compute_output=True),
                                    dict(gradient_policy="exact"), dict(accumulates=True)])
def test_writes_mode_refuses_the_returns_options(option):
    name = next(iter(option))
    with pytest.raises(TypeError, match=f"{name} is for mode='returns'"):
        pyengine.OwnerGraph("_prev", "_backward", **option)
    graph = pyengine.OwnerGraph("_prev", "_backward", gradient_policy="reduce")
    assert graph.gradient_policy == "reduce" and not graph.accumulates


def test_a_backward_that_takes_too_few_arguments_fails_cleanly():
    x = Value([1.0, 2.0, 3.0])
    y = Sin(x).outputs()
    graph = pyengine.OwnerGraph(parents, lambda owner, grads: owner.vjp(grads), mode="returns",
                                num_inputs=num_inputs, accumulates=True)
    with pytest.raises(TypeError, match="positional argument"):
        graph.backward(item_of(y), np.ones(3))
    assert x.grad is None and pyengine.is_grad_enabled()


# -- the two cores side by side ---------------------------------------------------------------------


def run_with_options(core, seed, policy):
    program = random_program(seed, size=30)
    log = []
    leaves, values = build(program)

    def backward(owner, grads, should_compute_output, buffered):
        log.append((type(owner).__name__, should_compute_output,
                    tuple(None if b is None else b.tolist() for b in buffered)))
        outputs = owner.vjp(grads)
        return [None if not needed else (g if b is None else g + b)
                for g, needed, b in zip(outputs, should_compute_output, buffered)]

    graph = core.OwnerGraph(parents, backward, mode="returns", num_inputs=num_inputs,
                            metadata=lambda owner: [((3,), np.float64)] * num_inputs(owner),
                            needs_no_gradient=lambda owner: owner is leaves[2],
                            should_compute_output=True, gradient_policy=policy, accumulates=True)
    graph.backward(item_of(values[-1]), np.ones(3))
    captured = graph.grad(item_of(values[-1]), np.ones(3), [leaves[0], item_of(values[5])],
                          allow_unused=True)
    return (log, [None if leaf.grad is None else leaf.grad.tolist() for leaf in leaves],
            [None if g is None else g.tolist() for g in captured])


@needs_compiled
@pytest.mark.parametrize("policy", ["reduce", "exact"])
@pytest.mark.parametrize("seed", range(6))
def test_both_cores_agree_with_every_option(seed, policy):
    compiled = run_with_options(compiled_owner_graph, seed, policy)
    pure = run_with_options(pure_owner_graph, seed, policy)
    assert compiled == pure
    assert len(compiled[0]) > 10


# -- unpack_grads, dense_gradient, generators ---------------------------------------------------------


def test_unpack_grads_passes_each_gradient_as_an_argument():
    x = Value([0.5, -1.0, 2.0])
    double, square = Split(x).outputs()
    y = Add(double, Mul(square, double).outputs()).outputs()
    seen = []

    def unpacked(owner, *args):
        seen.append((type(owner).__name__, len(args)))
        return owner.vjp(list(args))

    graph = pyengine.OwnerGraph(parents, unpacked, mode="returns", num_inputs=num_inputs,
                                unpack_grads=True)
    assert graph.unpack_grads is True
    graph.backward(item_of(y), np.ones(3))
    np.testing.assert_allclose(x.grad, 2 + 6 * x.data ** 2, rtol=1e-12)  # y = 2x + 2x^3
    assert sorted(seen) == [("Add", 1), ("Mul", 1), ("Split", 2)]


def test_unpack_grads_through_a_method_name_with_the_other_options(monkeypatch):
    def vjp_unpacked(self, *args):
        *grads, should_compute_output, buffered = args
        self.seen = (len(grads), should_compute_output, buffered)
        outputs = self.vjp(grads)
        return [g if b is None else g + b for g, b in zip(outputs, buffered)]

    monkeypatch.setattr(Function, "vjp_unpacked", vjp_unpacked, raising=False)
    x = Value([0.5, -1.0, 2.0])
    split = Split(x)
    double, square = split.outputs()
    y = Add(double, Mul(square, double).outputs()).outputs()
    pyengine.OwnerGraph(parents, "vjp_unpacked", mode="returns", num_inputs=num_inputs,
                        unpack_grads=True, should_compute_output=True,
                        accumulates=True).backward(item_of(y), np.ones(3))
    np.testing.assert_allclose(x.grad, 2 + 6 * x.data ** 2, rtol=1e-12)
    assert split.seen == (2, (True,), (None,))


def to_fake(value):
    return fd.to_fake(value, fd.device(0))


def test_dense_gradient_sees_each_non_numpy_gradient_before_a_backward():
    # sin(x) * w with Mul returning fake-device gradients: Sin must get numpy.
    class FakeMul(Mul):
        def backward(self, grad):
            return tuple(to_fake(g) for g in super().backward(grad))

    x, w = Value([0.5, -1.0, 2.0]), Value([1.5, 2.0, -1.0])
    y = FakeMul(Sin(x).outputs(), w).outputs()
    received, densified = [], []

    def backward(owner, grads):
        received.extend(type(g).__name__ for g in grads)
        return owner.vjp(grads)

    def dense(value):
        densified.append(type(value).__name__)
        return value.numpy()

    pyengine.OwnerGraph(parents, backward, mode="returns", num_inputs=num_inputs,
                        dense_gradient=dense).backward(item_of(y), np.ones(3))
    assert received == ["ndarray", "ndarray"] and densified == ["FakeArray"]
    np.testing.assert_allclose(x.grad, w.data * np.cos(x.data), rtol=1e-12)
    # A leaf's sum is accumulate's: not densified.
    assert isinstance(w.grad, fd.FakeArray)
    np.testing.assert_allclose(w.grad.numpy(), np.sin(x.data), rtol=1e-12)


def test_a_generator_is_read_as_the_returned_gradients():
    x, w = Value([0.5, -1.0, 2.0]), Value([1.5, 2.0, -1.0])
    y = Mul(Sin(x).outputs(), w).outputs()

    def generating(owner, grads):
        return (g for g in owner.vjp(grads))

    pyengine.OwnerGraph(parents, generating, mode="returns",
                        num_inputs=num_inputs).backward(item_of(y), np.ones(3))
    np.testing.assert_allclose(x.grad, w.data * np.cos(x.data), rtol=1e-12)
    np.testing.assert_allclose(w.grad, np.sin(x.data), rtol=1e-12)

    def short(owner, grads):
        return (g for g in owner.vjp(grads)[:1])

    with pytest.raises(RuntimeError, match="the backward of a Mul returned 1 gradients; expected 2"):
        pyengine.OwnerGraph(parents, short, mode="returns",
                            num_inputs=num_inputs).backward(item_of(y), np.ones(3))


@pytest.mark.parametrize("option, error, match", [
    (dict(unpack_grads=True), TypeError, "unpack_grads is for mode='returns'"),
    (dict(dense_gradient=len), TypeError, "dense_gradient is for mode='returns'"),
])
def test_writes_mode_refuses_unpacking_and_densifying(option, error, match):
    with pytest.raises(error, match=match):
        pyengine.OwnerGraph("_prev", "_backward", **option)
    with pytest.raises(TypeError, match="unpack_grads must be a bool, got int"):
        make_graph(unpack_grads=1)
    with pytest.raises(TypeError, match="dense_gradient must be a callable or None, got int"):
        make_graph(dense_gradient=1)


def run_unpacked(core, seed):
    program = random_program(seed, size=30)
    leaves, values = build(program)
    log = []

    def backward(owner, *grads):
        log.append((type(owner).__name__, len(grads),
                    [None if g is None else type(g).__name__ for g in grads]))
        return (to_fake(g) for g in owner.vjp(list(grads)))

    graph = core.OwnerGraph(parents, backward, mode="returns", num_inputs=num_inputs,
                            unpack_grads=True, dense_gradient=lambda value: value.numpy())
    graph.backward(item_of(values[-1]), np.ones(3))
    return log, [None if leaf.grad is None else leaf.grad.numpy().tolist() for leaf in leaves]


@needs_compiled
@pytest.mark.parametrize("seed", range(4))
def test_both_cores_agree_unpacked(seed, torch):
    compiled = run_unpacked(compiled_owner_graph, seed)
    pure = run_unpacked(pure_owner_graph, seed)
    assert compiled == pure
    expected = torch_grads(torch, random_program(seed, size=30))
    for got, e in zip(compiled[1], expected):
        if e is None:
            assert got is None
        else:
            np.testing.assert_allclose(got, e, rtol=1e-12, atol=1e-12)
