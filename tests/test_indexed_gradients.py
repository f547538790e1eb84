"""Indexed gradients (issue 23, part 1): the gradient of a lookup as the rows
it touches. See Note [Where an indexed gradient goes] in pyengine/indexed.py.

Oracles: the dense gradient written out with ``np.add.at`` (the definition
of an indexed gradient), analytic sums, and PyTorch's
``nn.functional.embedding(..., sparse=True)`` on the same lookups.
"""

from __future__ import annotations

import numpy as np
import pytest
from plain_tensors import Leaf

import pyengine
import pyengine.frontend as pe
from pyengine import IndexedGradient, densify
from pyengine import fake_device as fd

ROWS, COLS = 7, 3


def _dense(indices, values, shape=(ROWS, COLS)):
    dense = np.zeros(shape, dtype=values.dtype)
    np.add.at(dense, np.asarray(indices), values)
    return dense


def _indexed(indices, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    indices = np.asarray(indices)
    return IndexedGradient(indices, rng.standard_normal((len(indices), COLS)).astype(dtype),
                           (ROWS, COLS))


# -- the value --------------------------------------------------------------------------

def test_to_dense_adds_repeated_rows():
    g = _indexed([0, 3, 3, 6])
    np.testing.assert_array_equal(g.to_dense(), _dense([0, 3, 3, 6], g.values))
    assert type(g.to_dense()) is np.ndarray and g.shape == (ROWS, COLS) and g.nnz == 4


def test_negative_indices_count_from_the_end():
    g = IndexedGradient(np.array([-1, 0]), np.ones((2, COLS)), (ROWS, COLS))
    np.testing.assert_array_equal(g.indices, [ROWS - 1, 0])


def test_coalesce_keeps_the_dense_value():
    g = _indexed([5, 1, 5, 2, 1])
    c = g.coalesce()
    np.testing.assert_array_equal(c.indices, [1, 2, 5])
    np.testing.assert_allclose(c.to_dense(), g.to_dense())


def test_sums():
    a, b = _indexed([0, 2], seed=1), _indexed([2, 4], seed=2)
    total = a + b
    assert type(total) is IndexedGradient and total.nnz == 4
    np.testing.assert_allclose(total.to_dense(), a.to_dense() + b.to_dense())
    dense = np.ones((ROWS, COLS))
    for mixed in (dense + a, a + dense):
        assert type(mixed) is np.ndarray
        np.testing.assert_allclose(mixed, 1 + a.to_dense())
    np.testing.assert_array_equal(dense, np.ones((ROWS, COLS)))  # not written
    assert densify(a) is not a and densify(dense) is dense and densify(None) is None


def test_sum_coalesces_once_it_outgrows_the_table():
    parts = [_indexed([1, 2, 3, 4], seed=s) for s in range(3)]
    total = parts[0] + parts[1]  # 8 rows > 7: coalesced
    assert total.nnz == 4
    total = total + parts[2]
    assert total.nnz == 4
    np.testing.assert_allclose(total.to_dense(), sum(p.to_dense() for p in parts))


@pytest.mark.parametrize("indices, values, shape, error, match", [
    (np.array([0.0]), np.ones((1, 3)), (7, 3), TypeError, "indices must be integers"),
    (np.array([[0]]), np.ones((1, 3)), (7, 3), ValueError, "one-dimensional"),
    (np.array([0, 7]), np.ones((2, 3)), (7, 3), IndexError, "index 7 is out of bounds"),
    (np.array([-8]), np.ones((1, 3)), (7, 3), IndexError, "index -8 is out of bounds"),
    (np.array([0]), np.ones((2, 3)), (7, 3), ValueError, r"values must have shape \(1, 3\)"),
    (np.array([0]), np.ones((1, 3)), (), ValueError, "at least one axis"),
    (np.array([0]), np.ones((1, 3)), "ab", TypeError, "shape must be a tuple of ints"),
    ([0], np.ones((1, 3)), (7, 3), TypeError, "indices must be an array"),
    (np.array([0]), "x", (7, 3), TypeError, "values must be an array"),
])
def test_bad_indexed_gradient_is_refused(indices, values, shape, error, match):
    with pytest.raises(error, match=match):
        IndexedGradient(indices, values, shape)


def test_fields_are_read_only():
    g = _indexed([1])
    with pytest.raises(AttributeError):
        g.indices = np.array([100])


# -- in the engine ----------------------------------------------------------------------

class Source(pyengine.Node):
    def __init__(self, edges, grads):
        super().__init__(edges, [((), np.float64)])
        self.grads = grads

    def apply(self, grads):
        return list(self.grads)


class Sink(pyengine.Node):
    def __init__(self, got, accepts=False, metadata=((ROWS, COLS), np.float64)):
        super().__init__((), [metadata])
        self.got = got
        self.accepts = accepts

    @property
    def accepts_indexed_gradients(self):
        return self.accepts

    def apply(self, grads):
        self.got.append(grads[0])
        return []


def _run(edges, grads, capture=None):
    source = Source(edges, grads)
    return pyengine.get_default_engine().execute(
        [pyengine.Edge(source, 0)], [np.array(1.0)], False, False, capture is None, capture)


def test_input_buffer_sums_indexed_without_densifying():
    got = []
    sink = Sink(got, accepts=True)
    parts = [_indexed([0, 1], seed=1), _indexed([1, 2], seed=2), _indexed([6], seed=3)]
    _run([pyengine.Edge(sink, 0)] * 3, parts)
    (total,) = got
    assert type(total) is IndexedGradient and total.nnz == 5
    np.testing.assert_allclose(total.to_dense(), sum(p.to_dense() for p in parts))


@pytest.mark.parametrize("order", ["dense first", "indexed first"])
def test_input_buffer_dense_plus_indexed_is_dense(order):
    got = []
    sink = Sink(got, accepts=True)
    dense = np.full((ROWS, COLS), 2.0)
    kept = dense.copy()
    a, b = _indexed([0, 3], seed=1), _indexed([3, 3], seed=2)
    grads = [dense, a, b] if order == "dense first" else [a, dense, b]
    _run([pyengine.Edge(sink, 0)] * 3, grads)
    (total,) = got
    assert type(total) is np.ndarray
    np.testing.assert_allclose(total, dense + a.to_dense() + b.to_dense())
    np.testing.assert_array_equal(dense, kept)  # the node's array is never written


def test_a_node_gets_dense_gradients_unless_it_accepts_indexed():
    got = []
    sink = Sink(got)
    g = _indexed([2, 2, 5])
    seen = []
    sink.register_prehook(lambda grads: seen.append(type(grads[0])))
    _run([pyengine.Edge(sink, 0)], [g])
    assert seen == [IndexedGradient]  # hooks see the indexed value
    assert type(got[0]) is np.ndarray
    np.testing.assert_array_equal(got[0], g.to_dense())
    plain = []
    _run([pyengine.Edge(Sink(plain), 0)], [g])  # the compiled core's path without hooks
    assert type(plain[0]) is np.ndarray
    np.testing.assert_array_equal(plain[0], g.to_dense())


def test_validate_outputs_checks_an_indexed_gradient():
    got = []
    with pytest.raises(RuntimeError, match=r"invalid gradient at index 0 - got \(7, 3\) but "
                                           r"expected shape compatible with \(7, 4\)"):
        _run([pyengine.Edge(Sink(got, metadata=((ROWS, 4), np.float64)), 0)], [_indexed([1])])
    sink = Sink(got, accepts=True, metadata=((ROWS, COLS), np.float32))
    g = _indexed([1, 4])
    _run([pyengine.Edge(sink, 0)], [g])
    assert type(got[0]) is IndexedGradient and got[0].dtype == np.float32
    np.testing.assert_allclose(got[0].to_dense(), g.to_dense().astype(np.float32))
    device = pyengine.Device("fake", 0)
    with pytest.raises(RuntimeError, match="expected device fake:0 but got cpu"):
        _run([pyengine.Edge(Sink(got, metadata=((ROWS, COLS), np.float64, device)), 0)], [g])
    with pytest.raises(TypeError, match="cannot hold indexed gradients"):
        IndexedGradient(fd.to_fake(np.array([0]), device),
                        fd.to_fake(np.ones((1, COLS)), device), (ROWS, COLS))


@pytest.mark.parametrize("slot_shape", [(1, COLS), (COLS,), ()])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_validate_outputs_reduces_a_broadcast_indexed_gradient(slot_shape, dtype):
    # An indexed gradient of a shape that broadcasts down to its slot is
    # reduced as a dense one is (sum_to returns a dense array, whose own
    # backend then casts it and reads its device). Oracle: the dense
    # gradient summed over the broadcast axes.
    g = _indexed([1, 3, 3], seed=3)
    expected = g.to_dense().sum(axis=0, keepdims=len(slot_shape) == 2)
    if slot_shape == ():
        expected = expected.sum()
    leaf = Leaf(np.zeros(slot_shape, dtype=dtype))
    _run([pyengine.gradient_edge(leaf)], [g])
    assert type(leaf.grad) is np.ndarray and leaf.grad.dtype == dtype
    assert leaf.grad.shape == slot_shape
    np.testing.assert_allclose(leaf.grad, expected.astype(dtype), rtol=1e-6)
    got = []
    _run([pyengine.Edge(Sink(got, accepts=True, metadata=(slot_shape, dtype)), 0)], [g])
    assert type(got[0]) is np.ndarray and got[0].dtype == dtype
    np.testing.assert_allclose(got[0], expected.astype(dtype), rtol=1e-6)


def test_accumulate_grad_densifies_into_a_new_grad_then_adds_in_place():
    leaf = Leaf(np.zeros((ROWS, COLS)))
    a, b = _indexed([1, 1], seed=1), _indexed([0, 6], seed=2)
    _run([pyengine.gradient_edge(leaf)] * 2, [a, b])
    assert type(leaf.grad) is np.ndarray
    np.testing.assert_allclose(leaf.grad, a.to_dense() + b.to_dense())
    stored = leaf.grad
    _run([pyengine.gradient_edge(leaf)], [a])
    assert leaf.grad is stored  # pyengine's own .grad: added in place
    np.testing.assert_allclose(leaf.grad, 2 * a.to_dense() + b.to_dense())


def test_accumulate_grad_never_writes_a_users_grad():
    leaf = Leaf(np.zeros((ROWS, COLS)))
    mine = np.ones((ROWS, COLS))
    leaf.grad = mine
    a = _indexed([3])
    _run([pyengine.gradient_edge(leaf)], [a])
    assert leaf.grad is not mine
    np.testing.assert_array_equal(mine, np.ones((ROWS, COLS)))
    np.testing.assert_allclose(leaf.grad, 1 + a.to_dense())


def test_accumulate_grad_keeps_it_indexed_when_the_leaf_asks():
    leaf = Leaf(np.zeros((ROWS, COLS)))
    pyengine.keep_indexed_grad(leaf)
    a, b = _indexed([1, 2], seed=1), _indexed([2], seed=2)
    _run([pyengine.gradient_edge(leaf)], [a])
    assert type(leaf.grad) is IndexedGradient and leaf.grad is not a
    assert not np.shares_memory(leaf.grad.values, a.values)
    _run([pyengine.gradient_edge(leaf)], [b])
    assert type(leaf.grad) is IndexedGradient and leaf.grad.nnz == 3
    np.testing.assert_allclose(leaf.grad.to_dense(), a.to_dense() + b.to_dense())
    seen = []
    pyengine.register_post_accumulate_grad_hook(leaf, lambda t: seen.append(type(t.grad)))
    leaf.grad = np.zeros((ROWS, COLS))
    _run([pyengine.gradient_edge(leaf)], [a])  # a dense .grad stays dense
    assert seen == [np.ndarray]
    np.testing.assert_allclose(leaf.grad, a.to_dense())


def test_grad_inputs_returns_the_indexed_gradient():
    leaf = Leaf(np.zeros((ROWS, COLS)))
    a, b = _indexed([4], seed=1), _indexed([0], seed=2)
    (captured,) = _run([pyengine.gradient_edge(leaf)] * 2, [a, b],
                       capture=[pyengine.gradient_edge(leaf)])
    assert type(captured) is IndexedGradient
    np.testing.assert_allclose(densify(captured), a.to_dense() + b.to_dense())
    assert leaf.grad is None


def test_anomaly_mode_finds_nan_in_indexed_values(no_anomaly_warning):
    leaf = Leaf(np.zeros((ROWS, COLS)))
    bad = IndexedGradient(np.array([0]), np.full((1, COLS), np.nan), (ROWS, COLS))
    with pyengine.detect_anomaly():
        with pytest.raises(RuntimeError, match="returned nan values"):
            _run([pyengine.gradient_edge(leaf)], [bad])


# -- the frontend -----------------------------------------------------------------------

def _table(rows=10, cols=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, cols)).astype(np.float32)


LOOKUPS = [np.array([1, 5, 5, 9]), np.array([[0, 1], [5, 2]]), np.array([-1, 3])]


@pytest.mark.parametrize("lookup", ["getitem", "embedding"])
def test_frontend_lookups_match_the_dense_gradient(lookup):
    data = _table()
    w = pe.Tensor(data.copy(), requires_grad=True)
    loss = None
    for indices in LOOKUPS:
        if lookup == "embedding":
            indices = indices % data.shape[0]  # embedding takes no negative index
            e = pe.embedding(w, indices)
        else:
            e = w[indices]
        term = (e * e).sum()
        loss = term if loss is None else loss + term
    loss = loss + (w * 3.0).sum()  # a dense gradient into the same buffer
    loss.backward()
    expected = np.full(data.shape, 3.0, dtype=np.float32)
    for indices in LOOKUPS:
        np.add.at(expected, indices, 2 * data[indices])
    assert type(w.grad.data) is np.ndarray
    np.testing.assert_allclose(w.grad.data, expected, rtol=1e-6)


def test_frontend_row_lookup_gradient_is_indexed():
    w = pe.Tensor(_table(), requires_grad=True)
    e = w[np.array([2, 2, 7])]
    seen = []
    e.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(grad_inputs[0]))
    (e * 2.0).sum().backward()
    assert type(seen[0]) is IndexedGradient and seen[0].nnz == 3
    expected = np.zeros_like(w.data)
    np.add.at(expected, [2, 2, 7], 2.0)
    np.testing.assert_allclose(w.grad.data, expected)


def test_frontend_lookup_under_create_graph_is_dense_and_differentiable():
    data = _table()
    w = pe.Tensor(data.copy(), requires_grad=True)
    e = w[np.array([1, 1, 4])]
    (g,) = pe.grad((e * e * e).sum(), [w], create_graph=True)
    assert isinstance(g, pe.Tensor)
    expected = np.zeros_like(data)
    np.add.at(expected, [1, 1, 4], 3 * data[[1, 1, 4]] ** 2)
    np.testing.assert_allclose(g.data, expected, rtol=1e-6)
    g.sum().backward()
    second = np.zeros_like(data)
    np.add.at(second, [1, 1, 4], 6 * data[[1, 1, 4]])
    np.testing.assert_allclose(w.grad.data, second, rtol=1e-6)


@pytest.mark.parametrize("sparse", [False, True])
def test_embedding_matches_torch(torch, sparse):
    data = _table(rows=12, cols=5)
    lookups = [np.array([3, 0, 3, 11]), np.array([[4, 4], [7, 0]]), np.array([9])]
    w = pe.Tensor(data.copy(), requires_grad=True)
    tw = torch.tensor(data.copy(), requires_grad=True)
    for _ in range(2):  # the second step adds into the .grad of the first
        loss, tloss = None, None
        for indices in lookups:
            e = pe.embedding(w, indices, sparse=sparse)
            te = torch.nn.functional.embedding(torch.from_numpy(indices), tw, sparse=sparse)
            loss = (e * e).sum() if loss is None else loss + (e * e).sum()
            tloss = (te * te).sum() if tloss is None else tloss + (te * te).sum()
        loss.backward()
        tloss.backward()
        np.testing.assert_allclose(pe.Tensor(w.data).data, tw.detach().numpy())
        if sparse:
            assert type(w.grad) is IndexedGradient
            assert tw.grad.is_sparse
            mine, theirs = w.grad.coalesce(), tw.grad.coalesce()
            np.testing.assert_array_equal(mine.indices, theirs.indices()[0].numpy())
            np.testing.assert_allclose(mine.values, theirs.values().numpy(), rtol=1e-6)
        else:
            assert type(w.grad.data) is np.ndarray
            assert not tw.grad.is_sparse
            np.testing.assert_allclose(w.grad.data, tw.grad.numpy(), rtol=1e-6)


def test_embedding_sparse_grad_works_with_the_optimizer(torch):
    data = _table(rows=6, cols=2)
    w = pe.Tensor(data.copy(), requires_grad=True)
    tw = torch.tensor(data.copy(), requires_grad=True)
    opt, topt = pe.optim.SGD([w], lr=0.1), torch.optim.SGD([tw], lr=0.1)
    indices = np.array([1, 1, 4])
    for _ in range(3):
        opt.zero_grad()
        topt.zero_grad()
        (pe.embedding(w, indices, sparse=True) ** 2).sum().backward()
        (torch.nn.functional.embedding(torch.from_numpy(indices), tw, sparse=True) ** 2).sum().backward()
        opt.step()
        topt.step()
    np.testing.assert_allclose(w.data, tw.detach().numpy(), rtol=1e-6)


@pytest.mark.parametrize("indices, error, match", [
    (np.array([0.5]), TypeError, "embedding indices must be integers"),
    (np.array([10]), IndexError, "embedding index 10 is out of range for a weight of 10 rows"),
    (np.array([-1]), IndexError, "embedding index -1 is out of range"),
])
def test_embedding_bad_indices(indices, error, match):
    w = pe.Tensor(_table(), requires_grad=True)
    with pytest.raises(error, match=match):
        pe.embedding(w, indices)


@pytest.mark.parametrize("rows, nnz, columns", [(50, 600, 4), (3, 200, 2), (1000, 300, (2, 3)),
                                                (20, 1, 4), (20, 0, 4), (500, 200, ())])
def test_numpy_index_add_is_np_add_at_to_the_bit(rows, nnz, columns):
    # See Note [Adding rows at indices]: the sorted add against np.add.at itself.
    columns = columns if isinstance(columns, tuple) else (columns,)
    rng = np.random.default_rng(nnz)
    dense = rng.standard_normal((rows,) + columns).astype(np.float32)
    indices = rng.integers(-rows, rows, nnz)  # negative ones count from the end
    values = rng.standard_normal((nnz,) + columns).astype(np.float32)
    expected = dense.copy()
    np.add.at(expected, indices, values)
    got = pyengine.backends.NUMPY.index_add_(dense, indices, values)
    assert got is dense
    np.testing.assert_array_equal(got, expected)


# -- the lookup benchmark ----------------------------------------------------------------

def test_lookup_workload_checks_its_gradients_and_times_each_way():
    from pyengine.bench import lookups

    workload = lookups.LookupWorkload(2_000)  # its constructor runs the oracle
    for way in lookups.WAYS:
        assert workload.step(way) > 0
    workload.check()  # still right after more steps of each way
    # A few copies of the rows looked up (their gradients, concatenated, gathered).
    row_bytes = lookups.COLUMNS * 4
    assert workload.peak_bytes("indexed") < 4 * lookups.LOOKUPS * lookups.ROWS_PER_LOOKUP * row_bytes


def test_lookup_report_ratios_and_goals():
    from pyengine.bench import lookups

    def entry(rows, indexed, dense, floor, peak):
        return {"rows": rows, "seconds": {"indexed": [indexed] * 3, "dense": [dense] * 3,
                                          "floor": [floor] * 3},
                "peak_bytes": {"indexed": peak, "dense": 10 * peak, "floor": 0},
                "looked_up": 30_000, "table_bytes": rows * 256}

    results = [entry(100_000, 0.010, 0.05, 0.004, 3_000_000),
               entry(1_000_000, 0.010, 0.25, 0.006, 3_000_000)]
    rows = lookups.lookup_rows(results)
    assert rows[1][4] == "1.67x" and rows[1][5] == "25.0x"
    goals = lookups.lookup_goals(results)
    assert [g[2] for g in goals] == ["MISSED", "met", "met", "met"]
    assert goals[0][1] == "2.50x" and goals[2][1] == "25.0x" and goals[3][1].startswith("x1.00")


def test_frontend_tensor_hooks_see_the_indexed_gradient():
    w = pe.Tensor(_table(), requires_grad=True)
    seen = []

    def hook(grad):
        seen.append(grad)
        return IndexedGradient(grad.indices, grad.values * 10, grad.shape)

    w.register_hook(hook)
    (w[np.array([4, 4, 1])] * 1.0).sum().backward()
    assert type(seen[0]) is IndexedGradient and seen[0].nnz == 3
    expected = np.zeros_like(w.data)
    np.add.at(expected, [4, 4, 1], 10.0)
    np.testing.assert_allclose(w.grad.data, expected)


def test_frontend_grad_returns_the_indexed_gradient():
    data = _table()
    w = pe.Tensor(data.copy(), requires_grad=True)
    (g,) = pe.grad((w[np.array([0, 9, 0])] ** 2).sum(), [w])
    assert type(g) is IndexedGradient
    expected = np.zeros_like(data)
    np.add.at(expected, [0, 9, 0], 2 * data[[0, 9, 0]])
    np.testing.assert_allclose(densify(g), expected, rtol=1e-6)
    assert w.grad is None


def test_frontend_gradcheck_through_row_lookups():
    # gradcheck's analytical Jacobian reads the lookup's IndexedGradient;
    # finite differences are the oracle.
    w = pe.Tensor(np.random.default_rng(3).standard_normal((6, 2)), requires_grad=True)
    assert pe.gradcheck(lambda t: (t[np.array([1, 1, 4])] ** 2) * 3.0, [w])
    assert pe.gradcheck(lambda t: pe.embedding(t, np.array([[0, 5], [5, 5]])).sum(), [w])


def test_module_zero_grad_clears_an_indexed_grad():
    module = pe.nn.Module()
    module.weight = pe.Parameter(_table())
    (pe.embedding(module.weight, np.array([1, 2]), sparse=True) * 1.0).sum().backward()
    assert type(module.weight.grad) is IndexedGradient
    module.zero_grad(set_to_none=False)
    assert module.weight.grad is None


@pytest.mark.parametrize("what", ["indices", "values"])
def test_masked_arrays_are_refused(what):
    # Masked entries passed the range check (min() and max() skip them) and
    # were used all the same: np.add.at failed on index 99 at backward.
    indices = np.array([0, 99])
    values = np.ones((2, 2))
    if what == "indices":
        indices = np.ma.array(indices, mask=[False, True])
    else:
        values = np.ma.array(values, mask=[[False, False], [True, True]])
    with pytest.raises(TypeError, match=f"^IndexedGradient {what} must not be a masked array"):
        IndexedGradient(indices, values, (100, 2))


def test_negative_indices_of_a_narrow_dtype_wrap_in_a_table_it_cannot_hold():
    # indices % rows in int8 overflowed for a 300-row table.
    values = np.arange(4.0).reshape(2, 2)
    gradient = IndexedGradient(np.array([-1, 3], np.int8), values, (300, 2))
    expected = np.zeros((300, 2))
    np.add.at(expected, [299, 3], values)
    np.testing.assert_array_equal(densify(gradient), expected)
