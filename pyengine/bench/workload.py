"""Workload: one thing ``python -m pyengine bench`` times, with its oracle.

A workload is one engine (a *subject*, see :mod:`pyengine.bench.subjects`)
on one graph at one size, built before any timing: ``run()`` is exactly
what a sample times (one backward, one ``grad`` call or one training step),
``reset()`` runs untimed before each sample, and ``check()`` raises unless
the last ``run()`` left the analytic gradient. The runner checks every
workload before it times it and again afterwards, so a broken engine fails
instead of posting a fast time.

Also here: the two MLP problems of the training-step rows, with gradients
computed by hand in numpy as their oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

# One sample of a per-node workload covers at least this many node
# executions (several calls on small graphs), so that it lasts long enough
# to time. A fixed-cost sample is a tenth of it in calls, a step sample a
# ten-thousandth in steps.
NODES_PER_SAMPLE = 100_000


class Unsupported(Exception):
    """The subject has no version of this graph (not an error: the cell stays empty)."""


def _nothing():
    pass


@dataclass
class Workload:
    """One subject on one graph, built and ready to time.

    ``unit`` says what one sample is divided by: ``"node"`` (us per node:
    ``nodes`` x calls), ``"call"`` (us per call: the fixed cost of a
    backward or grad call) or ``"step"`` (ms per training step).
    """

    name: str
    nodes: int
    run: Callable[[], object]
    check: Callable[[], None]
    unit: str = "node"
    reset: Callable[[], None] = field(default=_nothing)
    calls: int = 0

    def __post_init__(self):
        if self.unit not in ("node", "call", "step"):
            raise ValueError(f"unknown unit {self.unit!r}")
        if not self.calls:
            self.set_budget(NODES_PER_SAMPLE)

    def set_budget(self, node_executions: int) -> None:
        """Size one sample: ``calls`` for about ``node_executions`` nodes."""
        if self.unit == "node":
            self.calls = max(1, math.ceil(node_executions / self.nodes))
        elif self.unit == "call":
            self.calls = max(1, node_executions // 10)
        else:
            self.calls = max(2, node_executions // 10_000)

    def run_checked(self) -> None:
        """reset, run once, check: the oracle, before and after timing."""
        self.reset()
        self.run()
        self.check()

    def scale(self, seconds: float) -> float:
        """A sample's wall time, in the workload's unit (us/node, us/call, ms/step)."""
        if self.unit == "node":
            return seconds / (self.calls * self.nodes) * 1e6
        if self.unit == "call":
            return seconds / self.calls * 1e6
        return seconds / self.calls * 1e3


def expect_equal(what: str, got, expected) -> None:
    """Raise naming ``what`` unless ``got`` equals ``expected`` exactly (both array-like)."""
    got_array = None if got is None else np.asarray(got, dtype=np.float64)
    if got_array is None or got_array.shape != np.shape(expected) or \
            not np.array_equal(got_array, expected):
        raise AssertionError(f"{what}: gradient is {got!r}, expected {expected!r}")


def expect_close(what: str, got, expected, rtol: float = 1e-9) -> None:
    """As :func:`expect_equal`, within ``rtol`` (sums taken in another order)."""
    got_array = None if got is None else np.asarray(got, dtype=np.float64)
    if got_array is None or got_array.shape != np.shape(expected) or \
            not np.allclose(got_array, expected, rtol=rtol, atol=1e-12):
        raise AssertionError(f"{what}: gradient is {got!r}, expected {expected!r}")


def size_label(n: int) -> str:
    """10000 -> "10k", 1000000 -> "1M"."""
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1_000 and n % 1_000 == 0:
        return f"{n // 1_000}k"
    return str(n)


# -- the MLP problems -------------------------------------------------------------------

@dataclass
class MLPProblem:
    """An MLP with ReLU between its linear layers, fixed weights and a batch.

    ``weights[i]`` is ``(out, in)`` as in PyTorch; ``loss`` is
    ``"cross_entropy"`` (mean over the batch, integer ``targets``) or
    ``"squared"`` (sum of squared errors, one output). ``gradients()`` is
    the oracle: the loss's gradients with respect to every weight and bias,
    by hand in numpy.
    """

    weights: list
    biases: list
    inputs: np.ndarray
    targets: np.ndarray
    loss: str
    lr: float = 0.01

    def gradients(self):
        """``[dW0, db0, dW1, db1, ...]`` of the loss at the problem's weights."""
        activations = [self.inputs]
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            z = activations[-1] @ w.T + b
            activations.append(np.maximum(z, 0.0) if i < len(self.weights) - 1 else z)
        out = activations[-1]
        if self.loss == "cross_entropy":
            shifted = out - out.max(axis=1, keepdims=True)
            probabilities = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
            probabilities[np.arange(len(out)), self.targets] -= 1.0
            grad_out = probabilities / len(out)
        else:
            grad_out = 2.0 * (out - self.targets.reshape(out.shape))
        grads = []
        for i in range(len(self.weights) - 1, -1, -1):
            grads.append(grad_out.sum(axis=0))
            grads.append(grad_out.T @ activations[i])
            if i:
                grad_out = (grad_out @ self.weights[i]) * (activations[i] > 0)
        grads.reverse()  # now dW0, db0, dW1, db1, ...
        return grads


def _problem(sizes, batch, loss, seed):
    rng = np.random.default_rng(seed)
    weights, biases = [], []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        bound = 1.0 / math.sqrt(fan_in)
        weights.append(rng.uniform(-bound, bound, (fan_out, fan_in)))
        biases.append(rng.uniform(-bound, bound, fan_out))
    inputs = rng.standard_normal((batch, sizes[0]))
    # Two classes (or +-1 targets): the sign of x0 * x1.
    positive = inputs[:, 0] * inputs[:, 1] > 0
    targets = positive.astype(np.int64) if loss == "cross_entropy" else np.where(positive, 1.0, -1.0)
    return MLPProblem(weights, biases, inputs, targets, loss)


def tensor_mlp_problem() -> MLPProblem:
    """The tensor frameworks' step (pyengine's frontend, PyTorch, DeZero):
    2 -> 64 -> 64 -> 2, a batch of 64, softmax cross entropy, float64."""
    return _problem((2, 64, 64, 2), 64, "cross_entropy", seed=0)


def scalar_mlp_problem() -> MLPProblem:
    """micrograd's step, at micrograd's scale (each number a node):
    2 -> 16 -> 16 -> 1 on 20 points, squared error."""
    return _problem((2, 16, 16, 1), 20, "squared", seed=1)
