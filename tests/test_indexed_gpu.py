"""Indexed gradients with cupy rows (issue 23): the cupy backend's
``index_add_`` (cupyx.scatter_add), sums and AccumulateGrad on a GPU.

Marked ``gpu``; skipped where cupy or a CUDA device is missing. Oracle: the
same gradient summed with ``np.add.at`` on the host.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_indexed_gradients import Leaf, Source

import pyengine
from pyengine import IndexedGradient

cupy = pytest.importorskip("cupy")
try:
    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except cupy.cuda.runtime.CUDARuntimeError:
    HAVE_GPU = False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA device")]

ROWS, COLS = 50, 4


def _parts(seed):
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, ROWS, 300)
    values = rng.standard_normal((300, COLS))
    return indices, values


def test_cupy_indexed_gradients_sum_and_accumulate():
    host = [_parts(seed) for seed in range(3)]
    expected = np.zeros((ROWS, COLS))
    for indices, values in host:
        np.add.at(expected, indices, values)
    grads = [IndexedGradient(cupy.asarray(i), cupy.asarray(v), (ROWS, COLS)) for i, v in host]
    assert pyengine.backend_of(grads[0]).device(grads[0]) == pyengine.Device("cuda", 0)
    np.testing.assert_allclose(cupy.asnumpy((grads[0] + grads[1] + grads[2]).to_dense()), expected)
    leaf = Leaf(cupy.zeros((ROWS, COLS)))
    source = Source([pyengine.gradient_edge(leaf)] * 3, grads)
    pyengine.get_default_engine().execute([pyengine.Edge(source, 0)], [np.array(1.0)],
                                          False, False, True, None)
    assert type(leaf.grad) is cupy.ndarray
    np.testing.assert_allclose(cupy.asnumpy(leaf.grad), expected)
    stored = leaf.grad
    source = Source([pyengine.gradient_edge(leaf)], grads[:1])
    pyengine.get_default_engine().execute([pyengine.Edge(source, 0)], [np.array(1.0)],
                                          False, False, True, None)
    assert leaf.grad is stored  # added in place
    again = expected.copy()
    np.add.at(again, host[0][0], host[0][1])
    np.testing.assert_allclose(cupy.asnumpy(leaf.grad), again)
