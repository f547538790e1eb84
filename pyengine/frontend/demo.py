"""``python -m pyengine demo``: train an MLP on two interleaved spirals.

Everything runs through the reference frontend and pyengine: the dataset is
generated here (two spirals of ``--points`` points in all, and as many
held-out points), the model is ``nn.MLP``, the loss ``cross_entropy``, the
optimizer ``optim.Adam``. Each epoch prints the training loss and the
accuracy on the whole training set; the run ends with the held-out
accuracy, the number of backward nodes executed and the engine's time per
node.

Time per node: the wall time of every ``loss.backward()`` divided by the
nodes it ran, split into the op formulas (time inside ``OpNode.apply``,
measured with ``FormulaProfile``) and the rest, which is the engine's
own work: scheduling, InputBuffers, ``validate_outputs``, AccumulateGrad.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np

import pyengine

from .._core import core_description
from . import nn, optim
from .graph import FormulaProfile
from .loss import cross_entropy
from .tensor import Tensor, _as_array, manual_seed

__all__ = ["add_arguments", "main", "spirals", "count_nodes"]


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def add_arguments(parser):
    parser.add_argument("--points", type=_positive, default=4000,
                        help="training points (default 4000)")
    parser.add_argument("--epochs", type=_positive, default=30, help="epochs (default 30)")
    parser.add_argument("--batch-size", type=_positive, default=64,
                        help="minibatch size (default 64)")
    parser.add_argument("--hidden", type=_positive, default=64,
                        help="width of the 2 hidden layers (default 64)")
    parser.add_argument("--lr", type=float, default=0.01,
                        help="Adam learning rate (default 0.01), decayed to 1/20 of it")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the data, the initial weights and the batch order; the same "
                        "seed gives the same run (default 0)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda (needs cupy)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--trace", metavar="PATH", help="profile every backward node and write a "
                        "Chrome trace (Perfetto, chrome://tracing) to PATH")
    parser.add_argument("--graph", metavar="PATH", help="draw the first step's backward graph to "
                        "PATH (.dot; .svg or .png need Graphviz's dot program)")


def spirals(points, rng, noise=0.08, turns=2.0):
    """Two interleaved spirals: ``points`` 2-D points in ``[-1, 1]^2`` and
    their labels (0 or 1), shuffled."""
    half = points // 2
    # Uniform in area along the arm: denser near the center would be too easy.
    t = np.sqrt(rng.random(half)) * turns * 2 * np.pi
    arm = np.stack([t * np.cos(t), t * np.sin(t)], axis=1) / (turns * 2 * np.pi)
    x = np.concatenate([arm, -arm]) + rng.normal(0, noise / 2, (2 * half, 2))
    y = np.concatenate([np.zeros(half, np.int64), np.ones(half, np.int64)])
    order = rng.permutation(2 * half)
    return x[order], y[order]


def count_nodes(root) -> int:
    """The nodes reachable from ``root`` (a Node): what a full backward runs."""
    seen = {id(root)}
    stack = [root]
    while stack:
        node = stack.pop()
        for edge in node.next_edges:
            if edge is not None and id(edge.node) not in seen:
                seen.add(id(edge.node))
                stack.append(edge.node)
    return len(seen)


def _accuracy(model, x, y):
    """The fraction of rows of ``x`` the model labels as ``y`` (a numpy array)."""
    with pyengine.no_grad():
        predicted = model(x).data.argmax(axis=1)
    return float((_as_array(predicted) == y).mean())


class _Progress:
    """One line per epoch, redrawn in place on a terminal."""

    def __init__(self, enabled, stream=None):
        self.stream = sys.stdout if stream is None else stream
        self.live = enabled and self.stream.isatty()

    def update(self, prefix, done, total, width=24):
        if self.live:
            filled = width * done // total
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r{prefix} [{bar}] {done}/{total}")
            self.stream.flush()

    def finish(self, line):
        self.stream.write(("\r\x1b[K" if self.live else "") + line + "\n")
        self.stream.flush()


def _unwritable(option, path):
    """Why ``path`` cannot be written, checked before training rather than
    after it, or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"demo: {option} {path}: is a folder, expected a file name"
    if not os.path.isdir(folder):
        return f"demo: {option} {path}: the folder {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"demo: {option} {path}: the folder {folder} is not writable"
    return None


def main(args) -> int:
    for option, path in (("--graph", args.graph), ("--trace", args.trace)):
        problem = path and _unwritable(option, path)
        if problem:
            print(problem, file=sys.stderr)
            return 2
    device = pyengine.Device.parse(args.device)
    if device.type == "cuda":
        try:
            import cupy  # noqa: F401
        except ImportError:
            print("demo: --device cuda needs cupy, which is not installed", file=sys.stderr)
            return 2
    elif device.type != "cpu":
        print(f"demo: unknown device {args.device!r} (cpu or cuda)", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    manual_seed(args.seed)
    train_x, train_y = spirals(args.points, rng)
    test_x, test_y = spirals(args.points, rng)
    dtype = np.float32
    x_all = Tensor(_as_array(train_x.astype(dtype), device=device))
    model = nn.MLP([2, args.hidden, args.hidden, 2], activation="relu", dtype=dtype, device=device,
                   rng=rng)
    optimizer = optim.Adam(model.parameters(), lr=args.lr)
    batches = -(-args.points // args.batch_size)
    print(f"pyengine demo: two spirals, {args.points} points; MLP 2-{args.hidden}-{args.hidden}-2 "
          f"(relu), Adam lr {args.lr} with cosine decay, batch {args.batch_size}; {device}, "
          f"{core_description()}")

    progress = _Progress(not args.no_progress)
    nodes_per_step = None
    steps = 0
    backward_seconds = 0.0
    start = time.perf_counter()
    tracing = pyengine.profile() if args.trace else contextlib.nullcontext()
    with FormulaProfile() as profile, tracing:
        for epoch in range(1, args.epochs + 1):
            # Cosine decay of the learning rate, from lr to lr / 20.
            decay = 0.5 * (1 + np.cos(np.pi * (epoch - 1) / args.epochs))
            for group in optimizer.param_groups:
                group["lr"] = args.lr * (0.05 + 0.95 * decay)
            order = rng.permutation(args.points)
            total_loss = 0.0
            for b in range(batches):
                rows = order[b * args.batch_size:(b + 1) * args.batch_size]
                x = Tensor(_as_array(train_x[rows].astype(dtype), device=device))
                loss = cross_entropy(model(x), train_y[rows])  # labels move with the logits
                if nodes_per_step is None:
                    nodes_per_step = count_nodes(loss.grad_fn)
                    if args.graph:
                        try:
                            pyengine.render_graph(loss, args.graph,
                                                  params=dict(model.named_parameters()))
                        except (RuntimeError, ValueError, OSError) as error:
                            # No Graphviz for .svg/.png, no suffix, a file that cannot be written.
                            print(f"demo: --graph: {error}", file=sys.stderr)
                            return 2
                optimizer.zero_grad()
                before = time.perf_counter()
                loss.backward()
                backward_seconds += time.perf_counter() - before
                optimizer.step()
                steps += 1
                total_loss += loss.item() * len(rows)
                progress.update(f"epoch {epoch:3d}/{args.epochs}", b + 1, batches)
            accuracy = _accuracy(model, x_all, train_y)
            progress.finish(f"epoch {epoch:3d}/{args.epochs}  loss {total_loss / args.points:.4f}  "
                            f"train accuracy {100 * accuracy:5.1f}%  "
                            f"{time.perf_counter() - start:6.1f} s")
    elapsed = time.perf_counter() - start
    test_accuracy = _accuracy(model, Tensor(_as_array(test_x.astype(dtype), device=device)), test_y)
    nodes = nodes_per_step * steps
    per_node = 1e6 * backward_seconds / nodes
    formulas = 1e6 * profile.seconds / nodes
    print(f"trained in {elapsed:.1f} s: train accuracy {100 * accuracy:.1f}%, "
          f"held-out accuracy {100 * test_accuracy:.1f}%")
    print(f"backward: {nodes:,} nodes executed ({nodes_per_step} per step, {steps:,} steps), "
          f"{per_node:.1f} µs per node: engine {per_node - formulas:.1f} µs, "
          f"op formulas {formulas:.1f} µs")
    if args.graph:
        print(f"graph: the first step's backward graph written to {args.graph}")
    if args.trace:
        tracing.export_chrome_trace(args.trace)
        print(f"trace: {len(tracing.events):,} node events written to {args.trace} (the profile's "
              "own cost is in the times above)")
        tracing.table(limit=8)
    return 0
