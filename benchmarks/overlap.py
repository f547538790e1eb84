#!/usr/bin/env python
"""Two fake devices working at once: the speedup of device threads.

    python benchmarks/overlap.py [--depth 8] [--passes 4] [--repeats 5]

The graph: a CPU root fans out to two chains of ``--depth`` nodes, one on
``fake:0`` and one on ``fake:1``, that meet at a CPU leaf. Every device node
passes its gradient through and does GIL-releasing, compute-bound numpy
work (``--passes`` sines over 200,000 float64, run by its device's stream on
that device's worker thread; memory-bound work would measure the memory
bus instead: two threads of ``np.exp`` over 16 MB arrays overlap only
1.4-1.7x on this machine even without the engine). With
multithreading enabled the two chains run on two worker threads at once;
with ``set_multithreading_enabled(False)`` everything runs on the caller,
one node after the other. Printed: the median (min-max) wall time of one
backward each way over ``--repeats`` runs, taken alternately, and the ratio
of medians. The leaf's gradient is checked against the analytic value
first. No BLAS call is made and numpy's elementwise ufuncs are
single-threaded, so the overlap is the engine's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pyengine
from pyengine import fake_device as fd
from pyengine.device import CPU


class Leaf:
    def __init__(self, data):
        self.data = data
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


class Work(pyengine.Node):
    """Backward of ``y = x`` (the gradient passes through unchanged) that also
    burns GIL-free time on its device: ``--passes`` sines over a cache-sized
    scratch array, compute-bound so that two cores can really overlap."""

    def __init__(self, edge, device, shape, to_host, passes, rng):
        super().__init__([edge], [pyengine.InputMetadata(shape, np.float64, device)])
        self.to_host = to_host
        self.passes = passes
        self.phases = rng.random(200_000)
        self.scratch = np.empty_like(self.phases)

    def apply(self, grads):
        grad = grads[0]

        def compute(out):
            for _ in range(self.passes):
                np.sin(self.phases, out=self.scratch)
            np.copyto(out, grad._buffer)

        result = fd.launch(grad.device, grad.shape, grad.dtype, compute)
        return [result.numpy() if self.to_host else result]


class Fork(pyengine.Node):
    def apply(self, grads):
        return [fd.to_fake(grads[0], fd.device(0)), fd.to_fake(grads[0], fd.device(1))]


def build(depth, size, passes):
    rng = np.random.default_rng(0)
    shape = (size,)
    x = Leaf(np.zeros(shape))
    edges = []
    for index in (0, 1):
        device = fd.device(index)
        edge = pyengine.gradient_edge(x)
        for level in range(depth):
            edge = pyengine.Edge(Work(edge, device, shape, level == 0, passes, rng), 0)
        edges.append(edge)
    fork = Fork(edges, [pyengine.InputMetadata(shape, np.float64, CPU)])
    return x, fork


def one_backward(x, fork, size, multithreading):
    x.grad = None
    with pyengine.set_multithreading_enabled(multithreading):
        start = time.perf_counter()
        pyengine.get_default_engine().execute([pyengine.Edge(fork, 0)], [np.ones(size)],
                                              True, False, True)
        return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--size", type=int, default=1000, help="gradient elements")
    parser.add_argument("--passes", type=int, default=4, help="sines of 200k elements per node")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    x, fork = build(args.depth, args.size, args.passes)
    one_backward(x, fork, args.size, True)
    assert np.array_equal(x.grad, np.full(args.size, 2.0)), "wrong gradient"
    times = {True: [], False: []}
    for _ in range(args.repeats):
        for multithreading in (True, False):
            times[multithreading].append(one_backward(x, fork, args.size, multithreading))
    print(f"pyengine {pyengine.IMPLEMENTATION} core; 2 chains x {args.depth} nodes, "
          f"{args.passes} sines of 200,000 float64 per node; median (min-max) of {args.repeats}")
    for multithreading, label in ((True, "device threads"), (False, "multithreading off")):
        samples = times[multithreading]
        print(f"  {label:20s} {statistics.median(samples) * 1e3:8.1f} ms "
              f"({min(samples) * 1e3:.1f}-{max(samples) * 1e3:.1f})")
    speedup = statistics.median(times[False]) / statistics.median(times[True])
    print(f"  speedup {speedup:.2f}x (goal >= 1.8x on 2 cores)")


if __name__ == "__main__":
    main()
