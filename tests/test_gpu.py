"""The device tests' core cases on a real GPU, with cupy arrays and streams.

Marked ``gpu``; skipped where cupy or a CUDA device is missing. Oracles: the
same products of factors as the fake-device tests, and an MLP's gradients
computed with numpy on the host.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pyengine

cupy = pytest.importorskip("cupy")
try:
    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no driver, no device
    HAVE_GPU = False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA device")]

if HAVE_GPU:
    from pyengine import cupy_backend  # noqa: F401  (registered on import of pyengine)
    from pyengine.device import CPU, Device

    CUDA0 = Device("cuda", 0)


class Leaf:
    def __init__(self, data):
        self.data = data
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


def on(value, device):
    if device == CPU:
        return cupy.asnumpy(value) if isinstance(value, cupy.ndarray) else value
    return cupy.asarray(value)


class Scale(pyengine.Node):
    threads: list = []

    def __init__(self, edge, device, factor, input_device):
        super().__init__([edge], [pyengine.InputMetadata((3,), np.float64, device)])
        self.factor, self.input_device = factor, input_device

    def apply(self, grads):
        Scale.threads.append(threading.current_thread().name)
        return [on(grads[0] * self.factor, self.input_device)]


def test_cpu_and_cuda_nodes_run_on_their_threads_and_are_exact():
    Scale.threads = []
    x = Leaf(np.ones(3))
    n_cpu = Scale(pyengine.gradient_edge(x), CPU, 2.0, CPU)
    n_cuda = Scale(pyengine.Edge(n_cpu, 0), CUDA0, 3.0, CPU)
    pyengine.get_default_engine().execute([pyengine.Edge(n_cuda, 0)], [cupy.ones(3)],
                                          False, False, True)
    np.testing.assert_array_equal(x.grad, [6.0] * 3)
    assert Scale.threads == ["pyengine-cuda:0", threading.current_thread().name]


def test_nodes_on_two_streams_and_a_cuda_leaf():
    x = Leaf(cupy.ones((1024, 1024)))
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)

    class Heavy(pyengine.Node):
        def apply(self, grads):
            return [grads[0] @ cupy.eye(1024) * 2.0]

    accumulator = pyengine.grad_accumulator(x)
    meta = pyengine.InputMetadata((1024, 1024), np.float64, CUDA0)
    with b:
        consumer = Heavy([pyengine.Edge(accumulator, 0)], [meta])
    with a:
        producer = Heavy([pyengine.Edge(consumer, 0)], [meta])
    assert producer.stream.raw.ptr == a.ptr and consumer.stream.raw.ptr == b.ptr
    pyengine.get_default_engine().execute([pyengine.Edge(producer, 0)], [cupy.ones((1024, 1024))],
                                          False, False, True)
    # No manual sync: the caller's current stream waited on the leaf's.
    assert float(x.grad.sum()) == 4.0 * 1024 * 1024


def test_mlp_backward_on_cupy_matches_numpy():
    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((8, 16)), rng.standard_normal((16, 4))
    inputs = rng.standard_normal((32, 8))

    class MatMulBackward(pyengine.Node):
        def __init__(self, a, b, edges, meta):
            super().__init__(edges, meta)
            self.a, self.b = a, b

        def apply(self, grads):
            return [grads[0] @ self.b.T, self.a.T @ grads[0]]

    leaves = [Leaf(cupy.asarray(w)) for w in (w1, w2)]
    x = cupy.asarray(inputs)
    h = x @ leaves[0].data
    meta = lambda array: pyengine.InputMetadata(array.shape, array.dtype, CUDA0)  # noqa: E731
    n1 = MatMulBackward(x, leaves[0].data, [None, pyengine.gradient_edge(leaves[0])], [meta(h)])
    y = h @ leaves[1].data
    n2 = MatMulBackward(h, leaves[1].data,
                        [pyengine.Edge(n1, 0), pyengine.gradient_edge(leaves[1])], [meta(y)])
    pyengine.get_default_engine().execute([pyengine.Edge(n2, 0)], [cupy.ones(y.shape)],
                                          False, False, True)
    g = np.ones((32, 4))
    np.testing.assert_allclose(cupy.asnumpy(leaves[1].grad), (inputs @ w1).T @ g, rtol=1e-10)
    np.testing.assert_allclose(cupy.asnumpy(leaves[0].grad), inputs.T @ (g @ w2.T), rtol=1e-10)
