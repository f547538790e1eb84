"""DeZero's GetItem with an integer array of rows, on pyengine: its gradient
flows as an IndexedGradient into the leaf (issue 23). The oracle is DeZero's
own engine on the same program: the same ``.grad`` values, a dense Variable
as DeZero leaves it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("dezero")

import dezero.functions as F  # noqa: E402
import dezero_cases  # noqa: E402
from dezero import Variable  # noqa: E402

import pyengine  # noqa: E402
from pyengine.adapters import dezero as pyengine_dezero  # noqa: E402
from pyengine.adapters.dezero import nodes  # noqa: E402


def _program(steps=2):
    rng = np.random.default_rng(0)
    table = Variable(rng.standard_normal((9, 3)))
    other = Variable(rng.standard_normal((9, 3)))
    lookups = [np.array([0, 4, 4, 8]), np.array([[1, 4], [-1, 2]]), np.array(3)]
    for _ in range(steps):
        loss = None
        for rows in lookups:
            e = table[rows]
            term = F.sum(e * e)
            loss = term if loss is None else loss + term
        loss = loss + F.sum(table * other)  # a dense gradient into the same leaf
        loss.backward()
    return table, other


def test_row_lookups_match_dezero():
    native_table, native_other = _program()
    with pyengine_dezero.installed():
        table, other = _program()
    for ours, native in ((table, native_table), (other, native_other)):
        assert type(ours.grad) is Variable and type(ours.grad.data) is np.ndarray
        np.testing.assert_allclose(ours.grad.data, native.grad.data, rtol=1e-12)


def test_a_row_lookup_of_a_leaf_makes_an_indexed_gradient():
    table = Variable(np.ones((5, 2)))
    seen = []
    with pyengine_dezero.installed():
        e = table[np.array([1, 1, 3])]
        node = pyengine_dezero.grad_fn(e)  # made now: backward then runs on nodes
        assert type(node) is nodes.RowLookupNode
        node.register_hook(lambda grad_inputs, grad_outputs: seen.append(grad_inputs[0]))
        F.sum(e * 2.0).backward()
    assert type(seen[0]) is pyengine.IndexedGradient
    np.testing.assert_array_equal(table.grad.data, [[0, 0], [4, 4], [0, 0], [2, 2], [0, 0]])


def test_the_owner_graph_sends_row_gradients_indexed(monkeypatch):
    """Without nodes (See Note [DeZero as an owner graph]) a row lookup of a
    leaf still returns an IndexedGradient, made dense once, at the leaf."""
    densified = []
    to_dense = pyengine.IndexedGradient.to_dense

    def counting_to_dense(self):
        densified.append(self.shape)
        return to_dense(self)

    monkeypatch.setattr(pyengine.IndexedGradient, "to_dense", counting_to_dense)
    table = Variable(np.ones((5, 2)))
    with pyengine_dezero.installed():
        loss = F.sum(table[np.array([1, 1, 3])] * 2.0) + F.sum(table[np.array([4])])
        assert dezero_cases.live_adapter_nodes() == 0
        loss.backward()
    assert densified == [(5, 2)]
    assert type(table.grad) is Variable and type(table.grad.data) is np.ndarray
    np.testing.assert_array_equal(table.grad.data, [[0, 0], [4, 4], [0, 0], [2, 2], [1, 1]])


def test_lookups_that_are_not_rows_of_a_leaf_stay_dense():
    table = Variable(np.ones((5, 2)))
    with pyengine_dezero.installed():
        mid = table * 3.0
        assert type(pyengine_dezero.grad_fn(mid[np.array([0])])) is nodes.FunctionNode
        assert type(pyengine_dezero.grad_fn(table[1:3])) is nodes.FunctionNode
        y = mid[np.array([0, 0])]
        F.sum(y).backward()
    np.testing.assert_array_equal(table.grad.data, [[6, 6], [0, 0], [0, 0], [0, 0], [0, 0]])


def test_create_graph_through_a_row_lookup_matches_dezero():
    def program():
        x = Variable(np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
        y = F.sum(x[np.array([0, 2, 2])] ** 3)
        y.backward(create_graph=True)
        gx = x.grad
        x.cleargrad()
        F.sum(gx).backward()
        return gx.data, x.grad.data

    native = program()
    with pyengine_dezero.installed():
        ours = program()
    for a, b in zip(ours, native):
        np.testing.assert_allclose(a, b)
