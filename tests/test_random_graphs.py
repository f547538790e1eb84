"""Random DAGs of linear nodes: engine gradients against an independent oracle.

The graphs (see ``linear_graphs.py``) have fan-in and fan-out, several roots
(repeated roots sum), nodes no root reaches, constant inputs (``None`` next
edges whose gradients the engine must drop), slots without metadata, nodes
that pass the very array they got on to several consumers, and sequence
numbers that need not follow the topology. The oracle is reverse accumulation
over the spec in exact rational arithmetic; it is itself checked against
PyTorch. Values are small integers or dyadic, so every comparison is exact.

Besides the values, the tests check which nodes ran (computed from the spec):
every node a root reaches runs exactly once per backward, after every node
that feeds it; under ``grad(inputs=)`` only the nodes on a path to an input
run, and under ``backward(inputs=)`` the inputs' own nodes too. Arrays the
user passed and arrays nodes handed out are never written into.
"""

import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

import linear_graphs as lg  # noqa: E402

import pyengine  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def graph_and_roots(draw, max_ops=10, allow_leaf_roots=True):
    spec = draw(lg.graph_specs(max_ops=max_ops))
    roots = draw(lg.root_lists(spec, allow_leaf_roots=allow_leaf_roots))
    return spec, roots


@st.composite
def sequence_nrs(draw, n_ops):
    """None (creation order), or a random assignment with ties."""
    if draw(st.booleans()):
        return None
    return [draw(st.integers(0, n_ops)) for _ in range(n_ops)]


@st.composite
def input_refs(draw, spec, max_size=5):
    """(ref, as_edge) pairs: a leaf, a non-leaf value, or a GradientEdge for
    either, anywhere in the graph (reachable or not, repeats allowed)."""
    refs = spec.all_refs()
    return draw(st.lists(st.tuples(st.sampled_from(refs), st.booleans()), min_size=1,
                         max_size=max_size))


def _check_unchanged(handed_out, root_arrays, root_copies):
    for array, copy in handed_out:
        assert (array == copy).all(), "the engine wrote into an array a node handed out"
    for array, copy in zip(root_arrays, root_copies):
        assert (array == copy).all(), "the engine wrote into a grad_tensors array"


def _check_leaves(graph, expected, scale=1, only=None):
    for i, leaf in enumerate(graph.leaves):
        ref = ("leaf", i)
        want = expected[ref] if only is None or ref in only else None
        if want is not None:
            want = [v * scale for v in want]
        assert lg.equal(leaf.grad, want), f"{ref}: {lg.describe(leaf.grad, want)}"


def _reachable_ops(spec, roots):
    """Ops whose node a root reaches through next edges (the spec's inputs)."""
    stack = [ref[1] for ref, _ in roots if ref[0] == "op"]
    seen = set()
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        stack.extend(ref[1] for ref in spec.ops[k].inputs if ref[0] == "op")
    return seen


def _leading_to(spec, targets):
    """Ops with a path of at least one edge to a target: an op index, or a
    leaf (its AccumulateGrad)."""
    leads = set()
    for k, op in enumerate(spec.ops):  # inputs refer to earlier ops only
        for ref in op.inputs:
            if ref[0] == "leaf" and ref in targets:
                leads.add(k)
            elif ref[0] == "op" and (("op", ref[1]) in targets or ref[1] in leads):
                leads.add(k)
    return leads


def _check_run(spec, log, expected_ops):
    """Each expected op ran exactly once, nothing else ran, and every node ran
    before the nodes its gradients flow into."""
    ran = [tag for tag, _ in log]
    assert sorted(ran) == sorted(expected_ops), f"ran {sorted(ran)}, expected {sorted(expected_ops)}"
    position = {k: i for i, k in enumerate(ran)}
    for k in ran:
        for ref in spec.ops[k].inputs:
            if ref[0] == "op" and ref[1] in position:
                assert position[k] < position[ref[1]], f"op {ref[1]} ran before its consumer {k}"


# -- the oracle itself, against PyTorch -------------------------------------------------

def _torch_leaf_grads(spec, roots):
    torch = pytest.importorskip("torch")
    leaves = [torch.zeros(d, dtype=torch.float64, requires_grad=True) for d in spec.leaf_dims]
    values = {("leaf", i): leaf for i, leaf in enumerate(leaves)}
    for k, op in enumerate(spec.ops):
        inputs = [torch.zeros(ref[1], dtype=torch.float64) if ref[0] == "const" else values[ref]
                  for ref in op.inputs]
        outputs = [torch.zeros(d, dtype=torch.float64) for d in op.out_dims]
        for x, term_list in zip(inputs, op.terms):
            for slot, coefficient in term_list:
                # Backward maps g -> C g, so forward is y += C^T x.
                if coefficient[0] == "identity":
                    contribution = x
                elif coefficient[0] == "scalar":
                    contribution = coefficient[1] * x
                else:
                    matrix = torch.tensor(coefficient[1], dtype=torch.float64)
                    contribution = matrix.T @ x
                outputs[slot] = outputs[slot] + contribution
        for i, y in enumerate(outputs):
            values[("op", k, i)] = y
    loss = torch.zeros((), dtype=torch.float64)
    for ref, vector in roots:
        loss = loss + (values[ref] * torch.tensor(vector, dtype=torch.float64)).sum()
    if not loss.requires_grad:
        return [None] * len(leaves)
    return list(torch.autograd.grad(loss, leaves, allow_unused=True))


@settings(SETTINGS, max_examples=40)
@given(graph_and_roots())
def test_oracle_agrees_with_torch(case):
    spec, roots = case
    expected = lg.oracle(spec, roots)
    for i, got in enumerate(_torch_leaf_grads(spec, roots)):
        want = expected[("leaf", i)]
        got = None if got is None else got.numpy()
        assert lg.equal(got, want), f"leaf {i}: {lg.describe(got, want)}"


# -- backward -----------------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_backward_accumulates_exact_leaf_gradients(data):
    spec, roots = data.draw(graph_and_roots())
    repeats = data.draw(st.integers(1, 2))
    assume(lg.exactness_bits(spec, roots, repeats) <= 53)
    create_graph = data.draw(st.booleans())
    handed_out = [] if data.draw(st.booleans()) else None
    log = []
    graph = lg.build(spec, data.draw(sequence_nrs(len(spec.ops))), log=log,
                     handed_out=handed_out)
    tensors = [graph.tensor(ref) for ref, _ in roots]
    root_arrays = lg.root_grad_arrays(roots, read_only=data.draw(st.booleans()))
    root_copies = [array.copy() for array in root_arrays]
    reachable = _reachable_ops(spec, roots)
    for r in range(repeats):
        log.clear()
        pyengine.backward(tensors, grad_tensors=root_arrays,
                          retain_graph=True if create_graph else r < repeats - 1,
                          create_graph=create_graph)
        _check_run(spec, log, reachable)
    _check_leaves(graph, lg.oracle(spec, roots), scale=repeats)
    for values in graph.values:
        for value in values:
            assert value.grad is None, "backward wrote .grad of a non-leaf"
    _check_unchanged(handed_out or (), root_arrays, root_copies)


@SETTINGS
@given(graph_and_roots(allow_leaf_roots=False))
def test_backward_single_root_through_engine_execute(case):
    # Engine.execute called directly with Edges, one root.
    spec, roots = case
    roots = roots[:1]
    assume(lg.exactness_bits(spec, roots) <= 53)
    engine = pyengine.get_default_engine()
    graph = lg.build(spec)
    ((ref, _),) = roots
    grads = lg.root_grad_arrays(roots)
    captured = engine.execute([graph.edge(ref)], grads, False, False, True, None)
    assert not captured
    _check_leaves(graph, lg.oracle(spec, roots))


# -- grad(inputs=...) -------------------------------------------------------------------

def _input_objects(graph, inputs):
    objects = []
    for ref, as_edge in inputs:
        if as_edge:
            edge = graph.edge(ref)
            objects.append(edge)
        else:
            objects.append(graph.tensor(ref))
    return objects


@SETTINGS
@given(st.data())
def test_grad_captures_exact_gradients_anywhere_in_the_graph(data):
    spec, roots = data.draw(graph_and_roots())
    inputs = data.draw(input_refs(spec))
    assume(lg.exactness_bits(spec, roots) <= 53)
    handed_out = [] if data.draw(st.booleans()) else None
    log = []
    graph = lg.build(spec, data.draw(sequence_nrs(len(spec.ops))), log=log,
                     handed_out=handed_out)
    tensors = [graph.tensor(ref) for ref, _ in roots]
    root_arrays = lg.root_grad_arrays(roots)
    root_copies = [array.copy() for array in root_arrays]
    results = pyengine.grad(tensors, _input_objects(graph, inputs), grad_outputs=root_arrays,
                            allow_unused=True)
    # Only the nodes on a path to an input run; an input's own node only
    # captures, unless it leads to another input.
    targets = {ref if ref[0] == "leaf" else ref[:2] for ref, _ in inputs}
    _check_run(spec, log, _reachable_ops(spec, roots) & _leading_to(spec, targets))
    expected = lg.oracle(spec, roots)
    assert len(results) == len(inputs)
    for (ref, as_edge), result in zip(inputs, results):
        assert lg.equal(result, expected[ref]), f"{ref} edge={as_edge}: " \
            f"{lg.describe(result, expected[ref])}"
    for leaf in graph.leaves:
        assert leaf.grad is None, "grad() accumulated into a leaf"
    for values in graph.values:
        for value in values:
            assert value.grad is None, "grad() wrote .grad of a non-leaf"
    _check_unchanged(handed_out or (), root_arrays, root_copies)


@settings(SETTINGS, max_examples=30)
@given(st.data())
def test_grad_without_allow_unused_raises_exactly_when_an_input_is_unreached(data):
    spec, roots = data.draw(graph_and_roots())
    inputs = data.draw(input_refs(spec, max_size=3))
    assume(lg.exactness_bits(spec, roots) <= 53)
    expected = lg.oracle(spec, roots)
    graph = lg.build(spec)
    tensors = [graph.tensor(ref) for ref, _ in roots]
    call = lambda: pyengine.grad(tensors, _input_objects(graph, inputs),  # noqa: E731
                                 grad_outputs=lg.root_grad_arrays(roots))
    if any(expected[ref] is None for ref, _ in inputs):
        with pytest.raises(RuntimeError, match="appears to not have been used"):
            call()
    else:
        results = call()
        for (ref, _), result in zip(inputs, results):
            assert lg.equal(result, expected[ref])


@settings(SETTINGS, max_examples=30)
@given(st.data())
def test_grad_twice_on_a_retained_graph_gives_the_same_result(data):
    spec, roots = data.draw(graph_and_roots())
    inputs = data.draw(input_refs(spec, max_size=3))
    assume(lg.exactness_bits(spec, roots) <= 53)
    graph = lg.build(spec)
    tensors = [graph.tensor(ref) for ref, _ in roots]
    expected = lg.oracle(spec, roots)
    for _ in range(2):
        results = pyengine.grad(tensors, _input_objects(graph, inputs),
                                grad_outputs=lg.root_grad_arrays(roots),
                                retain_graph=True, allow_unused=True)
        for (ref, _), result in zip(inputs, results):
            assert lg.equal(result, expected[ref]), lg.describe(result, expected[ref])


# -- backward(inputs=...) ----------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_backward_inputs_accumulates_only_into_the_inputs(data):
    spec, roots = data.draw(graph_and_roots())
    inputs = data.draw(input_refs(spec))
    assume(lg.exactness_bits(spec, roots) <= 53)
    log = []
    graph = lg.build(spec, data.draw(sequence_nrs(len(spec.ops))), log=log)
    tensors = [graph.tensor(ref) for ref, _ in roots]
    pyengine.backward(tensors, grad_tensors=lg.root_grad_arrays(roots),
                      inputs=_input_objects(graph, inputs))
    # The nodes on a path to an input run, and so do the inputs' own nodes.
    targets = {ref if ref[0] == "leaf" else ref[:2] for ref, _ in inputs}
    own = {ref[1] for ref, _ in inputs if ref[0] == "op"}
    _check_run(spec, log, _reachable_ops(spec, roots) & (_leading_to(spec, targets) | own))
    expected = lg.oracle(spec, roots)
    # Leaves named as tensors or as their accumulator's edge accumulate.
    leaf_inputs = {ref for ref, _ in inputs if ref[0] == "leaf"}
    _check_leaves(graph, expected, only=leaf_inputs)
    # Non-leaf values named as tensors retain their gradient; as edges, nothing.
    value_inputs = {ref for ref, as_edge in inputs if ref[0] == "op" and not as_edge}
    for k, values in enumerate(graph.values):
        for i, value in enumerate(values):
            ref = ("op", k, i)
            want = expected[ref] if ref in value_inputs else None
            assert lg.equal(value.grad, want), f"{ref}: {lg.describe(value.grad, want)}"


# -- fixed graphs that random ones may miss ----------------------------------------------

def _diamond(fan):
    """root -> fan nodes -> one leaf; each branch b scales by b + 1."""
    x = lg.Leaf(np.zeros(2), name="x")
    acc = pyengine.gradient_edge(x)
    branches = [lg.ScaleNode((acc,), float(b + 1)) for b in range(fan)]
    top = lg.ScaleNode(tuple(pyengine.Edge(node, 0) for node in branches), None)
    return x, top


@pytest.mark.parametrize("fan", [1, 2, 3, 17])
def test_fan_in_into_one_leaf_sums_every_branch(fan):
    x, top = _diamond(fan)
    g = np.array([1.0, -2.0])
    pyengine.backward(lg.Value(np.zeros(2), top, 0), grad_tensors=g)
    total = fan * (fan + 1) // 2
    assert (x.grad == total * g).all() and x.grad.dtype == np.float64
    assert (g == [1.0, -2.0]).all()


def test_same_root_twice_sums_its_gradients():
    x, top = _diamond(3)
    y = lg.Value(np.zeros(2), top, 0)
    pyengine.backward([y, y], grad_tensors=[np.array([1.0, 2.0]), np.array([4.0, 8.0])])
    assert (x.grad == 6 * np.array([5.0, 10.0])).all()

