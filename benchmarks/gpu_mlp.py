#!/usr/bin/env python
"""An MLP's backward on a GPU: engine overhead against kernel time.

    python benchmarks/gpu_mlp.py [--layers 8] [--width 1024] [--batch 256] [--repeats 20]

Builds the backward graph of ``--layers`` linear layers (matmul + bias, as
pyengine Nodes over cupy arrays on cuda:0) and times, median (min-max) over
``--repeats`` runs: (a) one backward through the engine, synchronized at the
end; (b) the same kernels launched directly in a Python loop with no engine
(the kernel time plus the unavoidable launches). (a) - (b) is the engine's
overhead per backward. Exits with a message where cupy or a GPU is missing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no CUDA device")
    except Exception as error:  # no cupy, no driver, no device
        print(f"gpu_mlp: skipped ({error})")
        return 0

    import pyengine
    from pyengine.device import Device

    cuda0 = Device("cuda", 0)

    class Leaf:
        def __init__(self, data):
            self.data, self.grad, self.grad_fn = data, None, None
            self.output_nr, self.requires_grad = 0, True

    class LinearBackward(pyengine.Node):
        def __init__(self, x, w, edges, out):
            super().__init__(edges, [pyengine.InputMetadata(out.shape, out.dtype, cuda0)])
            self.x, self.w = x, w

        def apply(self, grads):
            g = grads[0]
            return [g @ self.w.T, self.x.T @ g, g.sum(axis=0)]

    rng = cupy.random.default_rng(0)
    weights = [Leaf(rng.standard_normal((args.width, args.width), dtype=np.float32) * 0.01)
               for _ in range(args.layers)]
    biases = [Leaf(cupy.zeros(args.width, dtype=np.float32)) for _ in range(args.layers)]
    x = rng.standard_normal((args.batch, args.width), dtype=np.float32)
    activations, edge = [x], None
    for w, b in zip(weights, biases):
        out = activations[-1] @ w.data + b.data
        node = LinearBackward(activations[-1], w.data,
                              [edge, pyengine.gradient_edge(w), pyengine.gradient_edge(b)], out)
        activations.append(out)
        edge = pyengine.Edge(node, 0)
    seed = cupy.ones_like(activations[-1])

    def engine_backward():
        for leaf in weights + biases:
            leaf.grad = None
        pyengine.get_default_engine().execute([edge], [seed], True, False, True)
        cupy.cuda.get_current_stream().synchronize()

    def kernels_only():
        g = seed
        for w, a in zip(reversed(weights), reversed(activations[:-1])):
            a.T @ g
            g.sum(axis=0)
            g = g @ w.data.T
        cupy.cuda.get_current_stream().synchronize()

    def timed(function):
        function()
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            function()
            samples.append(time.perf_counter() - start)
        return samples

    engine, kernels = timed(engine_backward), timed(kernels_only)
    median = statistics.median
    print(f"pyengine {pyengine.IMPLEMENTATION}; MLP {args.layers} x {args.width}, batch "
          f"{args.batch}, float32, cuda:0; median (min-max) of {args.repeats}")
    for label, samples in (("engine backward", engine), ("kernels only", kernels)):
        print(f"  {label:16s} {median(samples) * 1e3:8.3f} ms "
              f"({min(samples) * 1e3:.3f}-{max(samples) * 1e3:.3f})")
    overhead = median(engine) - median(kernels)
    print(f"  engine overhead {overhead * 1e6:.0f} us per backward, "
          f"{overhead / (3 * args.layers) * 1e6:.1f} us per node (layers x 3 nodes incl. leaves)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
