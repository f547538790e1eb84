"""``python -m pyengine demo``: its dataset, its node count, and its claim
(at least 95% train accuracy) checked by running it."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np

import pyengine
import pyengine.frontend as F
from pyengine.__main__ import build_parser
from pyengine.frontend import demo, nn


def test_spirals():
    x, y = demo.spirals(1000, np.random.default_rng(0))
    assert x.shape == (1000, 2) and y.shape == (1000,)
    assert np.bincount(y).tolist() == [500, 500]
    assert np.abs(x).max() < 1.3
    # Interleaved: neither class is linearly separable from the other.
    w, *_ = np.linalg.lstsq(np.c_[x, np.ones(len(x))], 2.0 * y - 1, rcond=None)
    assert np.mean((np.c_[x, np.ones(len(x))] @ w > 0) == y) < 0.8


def test_count_nodes_is_what_backward_runs():
    model = nn.MLP([2, 8, 8, 2], rng=np.random.default_rng(0))
    loss = F.cross_entropy(model(F.tensor(np.ones((4, 2)))), np.array([0, 1, 1, 0]))
    ran = []
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        node.register_prehook(lambda grads, node=node: ran.append(node))
        stack.extend(edge.node for edge in node.next_edges if edge is not None)
    expected = demo.count_nodes(loss.grad_fn)
    loss.backward()
    assert len(ran) == expected == 13  # 3 Linear, 2 ReLU, LogSoftmax, NllLoss, 6 AccumulateGrad


def test_demo_reaches_95_percent(capsys):
    args = build_parser().parse_args(["demo", "--no-progress"])
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    epochs = re.findall(r"train accuracy\s+([\d.]+)%", out)
    assert len(epochs) == 30 + 1  # one line per epoch, and the summary
    assert float(epochs[-1]) >= 95.0
    match = re.search(r"backward: ([\d,]+) nodes executed \(13 per step, ([\d,]+) steps\), "
                      r"([\d.]+) µs per node: engine ([\d.-]+) µs, op formulas ([\d.]+) µs", out)
    assert match, out
    nodes, steps = (int(match.group(i).replace(",", "")) for i in (1, 2))
    assert nodes == 13 * steps == 13 * 30 * 63
    assert f"{pyengine.IMPLEMENTATION} engine core" in out


def test_command_line():
    result = subprocess.run([sys.executable, "-m", "pyengine", "demo", "--help"], capture_output=True,
                            text=True, check=True)
    assert "--device" in result.stdout and "--epochs" in result.stdout
    result = subprocess.run([sys.executable, "-m", "pyengine"], capture_output=True, text=True)
    assert result.returncode == 2 and "demo" in result.stderr


def test_cuda_without_cupy_is_a_clear_error(capsys):
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover - a machine with cupy
        import pytest

        pytest.skip("cupy is installed")
    assert demo.main(build_parser().parse_args(["demo", "--device", "cuda"])) == 2
    assert "needs cupy" in capsys.readouterr().err


def test_progress_bar_on_a_terminal():
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = demo._Progress(True, stream)
    progress.update("epoch 1/2", 3, 4, width=8)
    progress.finish("epoch 1/2 done")
    assert stream.getvalue() == "\repoch 1/2 [######..] 3/4\r\x1b[Kepoch 1/2 done\n"
    plain = io.StringIO()
    quiet = demo._Progress(True, plain)
    quiet.update("epoch 1/2", 3, 4)
    quiet.finish("epoch 1/2 done")
    assert plain.getvalue() == "epoch 1/2 done\n"
