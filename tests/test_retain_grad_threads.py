"""``retain_grad`` on a graph that several threads run backward on at once
(``retain_graph=True``): every thread's gradient reaches the retained
non-leaf's ``.grad``. Its hook reads, adds and writes ``.grad`` under the
tensor's lock, as AccumulateGrad does for a leaf; without it, a large add
(which releases the GIL) let one thread's sum overwrite another's.

Oracle: the analytic sum. Thread ``t`` backpropagates ``(t + 1) * ones``
through ``y = 2 * x`` ``CALLS`` times, so ``y.grad`` is ``CALLS * sum(t + 1)``
everywhere and ``x.grad`` twice that: small integers, exact in float64.
"""

from __future__ import annotations

import threading

import numpy as np

import pyengine
from pyengine import AccumulateGrad, Edge, Node

SIZE = 200_000
THREADS = 8
CALLS = 4
REPETITIONS = 4


class Tensor:
    """The tensor protocol: a leaf, or a non-leaf made by ``grad_fn``."""

    def __init__(self, data, grad_fn=None):
        self.data = data
        self.grad = None
        self.grad_fn = grad_fn
        self.output_nr = 0
        self.requires_grad = True


class Double(Node):
    def apply(self, grads):
        return [grads[0] * 2.0]


class Identity(Node):
    def apply(self, grads):
        return [grads[0]]


def test_retained_grad_sums_every_threads_gradient():
    engine = pyengine.get_default_engine()
    for repetition in range(REPETITIONS):
        x = Tensor(np.zeros(SIZE))
        y = Tensor(None, Double([Edge(AccumulateGrad(x), 0)], [((SIZE,), np.float64)]))
        pyengine.retain_grad(y)
        # The root is a node of its own, so that y's gradient enters y's
        # node as an input slot, where the retains-grad hook runs.
        root = Identity([Edge(y.grad_fn, 0)], [((SIZE,), np.float64)])
        barrier = threading.Barrier(THREADS)
        errors = []

        def work(t, barrier, root, errors):
            try:
                grad = np.full(SIZE, float(t + 1))
                barrier.wait()
                for _ in range(CALLS):
                    engine.execute([Edge(root, 0)], [grad], True, False, True)
            except BaseException as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=work, args=(t, barrier, root, errors))
                   for t in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors and not any(thread.is_alive() for thread in threads)
        total = CALLS * sum(range(1, THREADS + 1))
        lost = np.count_nonzero(y.grad != total)
        assert lost == 0, f"repetition {repetition}: {lost} of {SIZE} entries lost updates"
        np.testing.assert_array_equal(x.grad, np.full(SIZE, 2.0 * total))
