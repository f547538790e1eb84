"""``python -m pyengine bench``: its oracles can fail, its graphs have the
gradients their docstrings promise, its report computes ratios and goals
right, and one quick run goes from start to plot.

Oracles: analytic gradients (worked out here independently of the
builders), finite differences for the MLP problems' hand-written
backward, and hand-computed ratios for the report.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import pyengine
from pyengine.__main__ import build_parser
from pyengine.bench import command, graphs, report, runner, subjects, worker
from pyengine.bench.command import parse_size
from pyengine.bench.workload import (
    MLPProblem,
    Workload,
    scalar_mlp_problem,
    tensor_mlp_problem,
)

# Where the pyengine under test lives (a checkout or site-packages), so that
# subprocesses import the same one.
PYENGINE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pyengine.__file__)))


# -- graphs -----------------------------------------------------------------------------

@pytest.mark.parametrize("width, depth", [(1, 1), (1, 3), (2, 2), (3, 4), (5, 2)])
def test_lattice_gradient_doubles_per_layer(width, depth):
    # Every node of a layer feeds two nodes of the layer above, so each
    # layer down doubles the gradient; the bottom layer's `width` nodes
    # all reach the leaf.
    graph = graphs.lattice(width, depth)
    graph.run()
    np.testing.assert_array_equal(graph.leaf.grad, np.full(3, width * 2.0 ** (depth - 1)))
    assert graph.nodes == 1 + width * depth


def test_fan_in_sums_every_branch_at_the_sink():
    graph = graphs.fan_in(7)
    graph.run()
    np.testing.assert_array_equal(graph.leaf.grad, np.full(3, 7.0))
    sink = graph.root_edge.node.next_edges[0].node.next_edges[0].node
    assert all(edge.node.next_edges[0].node is sink for edge in graph.root_edge.node.next_edges)


@pytest.mark.parametrize("n", [1, 5])
def test_scalar_chain_passes_numpy_scalars_to_every_node(n):
    graph = graphs.build("scalar-chain", n)
    seen = []
    for node in graphs.chain_nodes(graph):
        node.register_prehook(lambda grads: seen.append(grads[0]))
    graph.run_checked()
    assert graph.nodes == n and len(seen) == n
    assert all(type(grad) is np.float64 and grad == 1.0 for grad in seen)
    graph.run()
    assert graph.leaf.grad == 1.0 and graph.leaf.grad.shape == ()
    with pytest.raises(AssertionError, match="scalar chain"):
        graph.leaf.grad = np.float64(2.0)
        graph.check()


def test_lattice_refuses_a_depth_whose_gradient_overflows():
    with pytest.raises(ValueError, match="1000 layers"):
        graphs.lattice(1, 1001)


def test_unknown_graph_kind_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown graph kind 'ring'.*chain"):
        graphs.build("ring", 10)


# -- workloads and their oracles ----------------------------------------------------------

PYENGINE_KEYS = ["chain:50", "wide:50", "lattice:49", "fan-in:20", "mlp-step:0",
                 "execute-fixed:1", "backward-fixed:10", "grad-fixed:10", "grad-inputs:50",
                 "apply-floor:50"]


@pytest.mark.parametrize("key", PYENGINE_KEYS)
def test_pyengine_workloads_pass_their_oracle(key):
    kind, _, size = key.partition(":")
    workload = subjects.SUBJECTS["pyengine"].build(kind, int(size))
    workload.run_checked()
    workload.run_checked()  # reusable: a sample calls run() many times


class _EngineThatDoesNothing:
    def execute(self, *args, **kwargs):
        return (np.zeros(3),)


def test_apply_floor_calls_every_node_once_and_its_oracle_catches_a_broken_node(monkeypatch):
    workload = subjects.SUBJECTS["pyengine"].build("apply-floor", 40)
    calls = []
    real_apply = graphs.Pass.apply

    def counting_apply(self, grads):
        calls.append(self)
        return real_apply(self, grads)

    monkeypatch.setattr(graphs.Pass, "apply", counting_apply)
    workload.run_checked()
    assert len(calls) == len(set(map(id, calls))) == workload.nodes == 40
    monkeypatch.setattr(graphs.Pass, "apply", lambda self, grads: [np.zeros(3)])
    with pytest.raises(AssertionError, match="apply floor.*expected"):
        workload.run_checked()


# The apply floor runs no engine: test_apply_floor_... checks its oracle.
@pytest.mark.parametrize("key", [k for k in PYENGINE_KEYS
                                 if not k.startswith(("mlp", "apply-floor"))])
def test_pyengine_workload_oracle_catches_a_broken_engine(key, monkeypatch):
    # Workloads look the engine up when they are built: build them broken.
    monkeypatch.setattr(pyengine, "get_default_engine", _EngineThatDoesNothing)
    monkeypatch.setattr(pyengine, "backward", lambda *args, **kwargs: None)
    monkeypatch.setattr(pyengine, "grad", lambda *args, **kwargs: (np.zeros(3),))
    kind, _, size = key.partition(":")
    workload = subjects.SUBJECTS["pyengine"].build(kind, int(size))
    with pytest.raises(AssertionError, match=r"(leaf\.grad|gradient) is .*expected"):
        workload.run_checked()


@pytest.mark.parametrize("problem", [tensor_mlp_problem(), scalar_mlp_problem()],
                         ids=["tensor", "scalar"])
def test_mlp_problem_gradients_match_finite_differences(problem: MLPProblem):
    analytic = problem.gradients()
    params = [p for pair in zip(problem.weights, problem.biases) for p in pair]
    rng = np.random.default_rng(3)
    eps = 1e-6
    for param, grad in zip(params, analytic):
        assert grad.shape == param.shape
        for _ in range(4):
            index = tuple(rng.integers(0, n) for n in param.shape)
            saved = param[index]
            param[index] = saved + eps
            up = _mlp_loss(problem)
            param[index] = saved - eps
            down = _mlp_loss(problem)
            param[index] = saved
            assert (up - down) / (2 * eps) == pytest.approx(grad[index], rel=1e-5, abs=1e-8)


def _mlp_loss(problem):
    x = problem.inputs
    for i, (w, b) in enumerate(zip(problem.weights, problem.biases)):
        x = x @ w.T + b
        if i < len(problem.weights) - 1:
            x = np.maximum(x, 0.0)
    if problem.loss == "squared":
        return float(((x[:, 0] - problem.targets) ** 2).sum())
    shifted = x - x.max(axis=1, keepdims=True)
    log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-log_probabilities[np.arange(len(x)), problem.targets].mean())


def test_torch_workloads_pass_their_oracle():
    pytest.importorskip("torch")
    for flavor in ("view", "function", "mul"):
        for key in ["chain:30", "wide:30", "lattice:25", "fan-in:10"]:
            kind, _, size = key.partition(":")
            workload = subjects._torch_build(flavor, kind, int(size))
            workload.run_checked()
            workload.run_checked()
    for key in ["mlp-step:0", "execute-fixed:1", "backward-fixed:10", "grad-fixed:10",
                "grad-inputs:30"]:
        kind, _, size = key.partition(":")
        subjects._torch_build("view", kind, int(size)).run_checked()
    for flavor in ("function", "mul"):  # a sample calls run() many times
        workload = subjects._torch_build(flavor, "grad-inputs", 30)
        workload.run_checked()
        workload.run_checked()
    with pytest.raises(subjects.Unsupported):
        subjects._torch_build("view", "apply-floor", 10)
    with pytest.raises(subjects.Unsupported):
        subjects._torch_build("mul", "mlp-step", 0)


def test_workload_budget_sizes_a_sample():
    workload = Workload("g", 300, run=lambda: None, check=lambda: None)
    assert workload.calls == 334  # ceil(100,000 / 300)
    workload.set_budget(1_000)
    assert workload.calls == 4
    assert workload.scale(2.0) == pytest.approx(2.0 / (4 * 300) * 1e6)
    fixed = Workload("f", 1, run=lambda: None, check=lambda: None, unit="call")
    assert fixed.calls == 10_000
    step = Workload("s", 0, run=lambda: None, check=lambda: None, unit="step")
    assert step.calls == 10 and step.scale(1.0) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="unknown unit 'second'"):
        Workload("x", 1, run=lambda: None, check=lambda: None, unit="second")


# -- the worker -------------------------------------------------------------------------------

def test_worker_reports_a_failing_oracle_and_keeps_serving(monkeypatch):
    def build(kind, size):
        if kind == "broken":
            def check():
                raise AssertionError("broken: gradient is None, expected ones")
            return Workload("broken", 1, run=lambda: None, check=check)
        return subjects._pyengine_build(kind, size)

    fake = subjects.Subject("fake", "fake", "engine", "pyengine", (), None, lambda: None, build)
    monkeypatch.setitem(subjects.SUBJECTS, "fake", fake)
    monkeypatch.setattr(worker, "SUBJECTS", subjects.SUBJECTS)
    out = io.StringIO()
    worker.serve("fake", 1_000, ["broken:1", "chain:10", "ring:3"],
                 out=out, requests=io.StringIO("sample chain:10\ncheck\nbogus\nquit\n"))
    hello, sample, check, bogus = [json.loads(line) for line in out.getvalue().splitlines()]
    assert "broken: gradient is None" in hello["workloads"]["broken:1"]["error"]
    assert hello["workloads"]["chain:10"] == {"name": "chain 10", "nodes": 10, "unit": "node",
                                              "calls": 100}
    assert "ring:3" not in hello["workloads"]  # Unsupported: no cell, no error
    assert sample["value"] > 0
    assert check == {"errors": {}}
    assert "unknown request" in bogus["error"]


# -- a worker that hangs (See Note [Worker timeout]) -------------------------------------------

_HELLO = {"subject": "pyengine", "implementation": "compiled", "workloads": {
    key: {"name": key, "nodes": 10, "unit": "node", "calls": 1} for key in ("chain:10", "chain:20")}}

# A serve worker that writes its pid, says hello, answers, and hangs on
# `sample chain:20` (or before its hello).
_HANGING_WORKER = f"""
import json, os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
if sys.argv[2] == "hello":
    time.sleep(600)
print(json.dumps({_HELLO!r}), flush=True)
for line in sys.stdin:
    if line.strip() == sys.argv[2]:
        time.sleep(600)
    print(json.dumps({{"errors": {{}}}} if line.startswith("check") else {{"value": 1.0}}),
          flush=True)
"""


def _hanging_worker(monkeypatch, tmp_path, hangs_on):
    pid_file = tmp_path / "pid"
    monkeypatch.setattr(runner, "_worker_command", lambda *args: [
        sys.executable, "-c", _HANGING_WORKER, str(pid_file), hangs_on])
    return pid_file


def _was_stopped(pid_file):
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    return True


def test_a_worker_that_hangs_on_a_sample_is_stopped_and_named(monkeypatch, tmp_path):
    pid_file = _hanging_worker(monkeypatch, tmp_path, "sample chain:20")
    results = runner.run_timing(["pyengine"], ["chain:10", "chain:20"], 2, 1_000,
                                log=lambda text: None, timeout_s=0.5)
    why = ("no reply in 0.5 s to 'sample chain:20'; the worker was stopped "
           "(a hang? --worker-timeout gives it longer)")
    workloads = results["pyengine"]["workloads"]
    assert workloads["chain:20"]["error"] == why
    assert workloads["chain:10"]["samples"] == [1.0]  # repeat 1, before the hang
    assert workloads["chain:10"]["error"] == "not run: " + why
    assert _was_stopped(pid_file)


def test_a_worker_that_hangs_while_building_is_stopped(monkeypatch, tmp_path):
    pid_file = _hanging_worker(monkeypatch, tmp_path, "hello")
    results = runner.run_timing(["pyengine"], ["chain:10"], 1, 1_000, log=lambda text: None,
                                timeout_s=0.5)
    assert results["pyengine"]["error"] == (
        "no reply in 0.5 s while building and checking its workloads; the worker was stopped "
        "(a hang? --worker-timeout gives it longer)")
    assert _was_stopped(pid_file)


def test_a_memory_worker_that_hangs_is_a_failed_figure_not_a_traceback(monkeypatch, tmp_path):
    pid_file = _hanging_worker(monkeypatch, tmp_path, "hello")
    figures = runner.run_memory(["pyengine"], [10], log=lambda text: None, timeout_s=0.5)
    assert figures == [{"subject": "pyengine", "size": 10, "error": (
        "no result in 0.5 s for the chain of 10; the worker was stopped "
        "(a hang? --worker-timeout gives it longer)")}]
    assert _was_stopped(pid_file)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e9", "soon"])
def test_worker_timeout_out_of_range_is_a_usage_error(capsys, value):
    assert _usage_error(capsys, ["--worker-timeout", value]) == (
        2, "python -m pyengine bench: error: argument --worker-timeout: expected seconds, more "
        f"than 0 and at most 604800 (a week), got {value!r}")


# -- the report ---------------------------------------------------------------------------------

def _results(timing, memory=()):
    return {"header": "h", "title": "t", "keys": {"graphs": ["chain:10000", "chain:100000",
                                                             "chain:1000000", "wide:10000"],
                                                  "steps": ["mlp-step:0"],
                                                  "fixed": ["execute-fixed:1"]},
            "timing": timing, "memory": list(memory)}


def _entry(name, nodes, samples, unit="node"):
    return {"name": name, "nodes": nodes, "unit": unit, "calls": 1, "samples": samples}


def test_report_ratios_and_goals_from_known_samples():
    timing = {
        "pyengine": {"workloads": {
            "chain:10000": _entry("chain 10k", 10_000, [0.20, 0.25, 0.30]),
            "chain:100000": _entry("chain 100k", 100_000, [0.28, 0.29, 0.50]),
            "chain:1000000": _entry("chain 1M", 1_000_000, [0.40]),
            "wide:10000": _entry("wide 1000x10", 10_001, [0.45]),
            "execute-fixed:1": _entry("Engine.execute, 1-node chain", 1, [2.5], "call"),
            "backward-fixed:1": _entry("backward, 1-node chain", 1, [2.6], "call"),
            "grad-fixed:1": _entry("grad, 1-node chain", 1, [3.4], "call"),
            "apply-floor:100000": _entry("apply alone, chain 100k", 100_000, [0.1, 0.2]),
            "grad-inputs:10000": _entry("grad(inputs=), chain 10k", 10_000, [0.30]),
            "grad-inputs:100000": _entry("grad(inputs=), chain 100k", 100_000, [0.58])}},
        "torch-view": {"workloads": {
            "chain:100000": _entry("chain 100k", 100_000, [2.9, 3.0]),
            "wide:10000": {"error": "RuntimeError: boom"}}},
        "dezero": {"workloads": {"chain:10000": _entry("chain 10k", 10_000, [6.0]),
                                 "mlp-step:0": _entry("MLP step", 0, [0.25])}},
        "dezero-pyengine": {"workloads": {"chain:10000": _entry("chain 10k", 10_000, [2.0]),
                                          "mlp-step:0": _entry("MLP step", 0, [0.3])}},
        "micrograd": {"skipped": "micrograd is not installed", "workloads": {}},
    }
    results = _results(timing)
    assert report.format_ratio(results, "torch-view", "pyengine", "chain:100000") == "10x"
    assert report.format_stats(report.stats(timing["pyengine"]["workloads"]["chain:10000"])) \
        == "0.250 (0.200-0.300)"
    rows = {row[0]: row[1:] for row in report.goals(results)}
    assert rows["compiled <= 0.3 us/node, chain 100k"] == ["0.290 us/node", "met"]
    assert rows["compiled <= 0.4 us/node, wide 1000x10"] == ["0.450 us/node", "MISSED"]
    assert rows["fixed cost <= 3.0 us (Engine.execute, 1 node)"] == ["2.500 us", "met"]
    assert rows["compiled per-node cost at 1M within 1.2x of 10k (chain)"] == ["1.60x", "MISSED"]
    assert rows["backward() fixed cost <= 2.5 us (1 node)"] == ["2.600 us", "MISSED"]
    assert rows["grad() fixed cost <= 3.5 us (1 node)"] == ["3.400 us", "met"]
    # 0.29 against a floor of 0.15 (the median of 0.1 and 0.2).
    assert rows["engine cost per node <= 2.0x calling each apply alone, chain 100k"] \
        == ["1.93x", "met"]
    assert rows["grad(inputs=) per node <= 1.3x backward, chain 10k"] == ["1.20x", "met"]
    assert rows["grad(inputs=) per node <= 1.3x backward, chain 100k"] == ["2.00x", "MISSED"]
    assert rows["grad(inputs=) per node <= 1.3x backward, chain 1M"] == ["not measured", "-"]
    assert rows["DeZero on pyengine >= 2x faster, chain 10k"] == ["3.00x", "met"]
    assert rows["DeZero on pyengine no slower, MLP step"] == ["0.83x", "MISSED"]
    assert rows["micrograd on pyengine no slower, chain 10k"] == ["not measured", "-"]
    text = report.report(results)
    assert "FAILED" in text and "PyTorch view_as, wide:10000: RuntimeError: boom" in text
    assert report.failure_lines(results) == ["PyTorch view_as, wide:10000: RuntimeError: boom"]
    assert report.skipped_lines(results) == ["micrograd native: micrograd is not installed"]


def test_parse_size():
    assert parse_size("10k") == 10_000 and parse_size("1M") == 1_000_000
    assert parse_size("2,500") == 2_500 and parse_size("1.5k") == 1_500
    assert parse_size("1e6") == 1_000_000 and parse_size("10M") == 10_000_000
    assert parse_size("1.001k") == 1_001  # exact: not 1000.999... truncated to 1000
    for bad in ("0", "ten", "-3"):
        with pytest.raises(Exception, match="size"):
            parse_size(bad)


def _usage_error(capsys, argv):
    """The exit status and the error line of ``python -m pyengine bench ARGV``
    refused while parsing."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", *argv])
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m pyengine bench")
    return exit_info.value.code, err.splitlines()[-1]


@pytest.mark.parametrize("value, why", [
    ("1.5", "a size must be a whole number, got '1.5'"),  # was 1, silently
    ("1.0005k", "a size must be a whole number, got '1.0005k'"),
    ("1e30", "a size must be at most 10,000,000 (10M; every graph is held in memory), "
             "got '1e30'"),  # was accepted
    ("10000001", "a size must be at most 10,000,000 (10M; every graph is held in memory), "
                 "got '10000001'"),
])
@pytest.mark.parametrize("option", ["--sizes", "--memory-sizes", "--lookup-rows"])
def test_a_size_that_is_not_whole_or_too_large_is_a_usage_error(capsys, option, value, why):
    assert _usage_error(capsys, [option, value]) == (
        2, f"python -m pyengine bench: error: argument {option}: {why}")


@pytest.mark.parametrize("value", [",", " , ,", ""])
def test_subjects_naming_none_is_a_usage_error(capsys, value):
    # It ran nothing, printed empty tables and exited 0.
    assert _usage_error(capsys, ["--subjects", value]) == (
        2, "python -m pyengine bench: error: argument --subjects: expected at least one of "
        f"{', '.join(subjects.SUBJECTS)}, got {value!r}")


def test_subjects_named_twice_run_once():
    args = build_parser().parse_args(["bench", "--subjects", "pyengine,pyengine-pure,pyengine"])
    assert args.subjects == ["pyengine", "pyengine-pure"]


# -- where the results go: checked before any timing, written after the report ----------

def _formats():
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        pytest.skip("matplotlib is not installed: no plot format to check")
    return ", ".join("." + f for f in sorted(FigureCanvasBase.get_supported_filetypes()))


@pytest.mark.parametrize("option, name, why", [
    ("--json", "missing/x.json", "cannot write {path!r}: the folder {folder!r} does not exist"),
    ("--json", ".", "cannot write {path!r}: it names a folder, expected a file name"),
    ("--json", "new/", "cannot write {path!r}: it names a folder, expected a file name"),
    ("--plot", "missing/x.png", "cannot write {path!r}: the folder {folder!r} does not exist"),
    ("--plot", ".", "cannot write {path!r}: it names a folder, expected a file name"),
    ("--plot", "x.txt", "cannot tell a plot format from {path!r}: matplotlib writes no '.txt' "
                        "files; expected a name ending in one of {formats}"),
    ("--plot", "x", "cannot tell a plot format from {path!r}: it has no suffix; expected a "
                    "name ending in one of {formats}"),
])
def test_an_output_that_cannot_be_written_is_a_usage_error(capsys, tmp_path, option, name, why):
    # These failed after the whole run (an hour), losing the report or the plot.
    path = os.path.join(str(tmp_path), name) if name != "." else str(tmp_path)
    formats = _formats() if option == "--plot" else None
    line = why.format(path=path, folder=str(tmp_path / "missing"), formats=formats)
    assert _usage_error(capsys, [option, path]) == (
        2, f"python -m pyengine bench: error: argument {option}: {line}")


def test_an_unwritable_json_stops_the_command_before_timing(tmp_path):
    env = dict(os.environ, PYTHONPATH=PYENGINE_ROOT)
    path = tmp_path / "missing" / "x.json"
    proc = subprocess.run([sys.executable, "-m", "pyengine", "bench", "--quick", "--subjects",
                           "pyengine", "--sizes", "10", "--no-memory", "--no-lookups",
                           "--no-plot", "--json", str(path)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1] == (
        f"python -m pyengine bench: error: argument --json: cannot write {str(path)!r}: "
        f"the folder {str(path.parent)!r} does not exist")
    assert "Traceback" not in proc.stderr and "repeat 1/" not in proc.stderr


def _timing_that_removes(folder):
    def run_timing(subject_keys, workload_keys, repeats, budget, log, timeout_s):
        shutil.rmtree(folder)  # the folder goes away during the run
        return {"pyengine": {"implementation": "compiled", "workloads": {
            "chain:10": _entry("chain 10", 10, [0.5, 0.4, 0.6])}}}
    return run_timing


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_that_fails_at_the_end_comes_after_the_report(capsys, monkeypatch, tmp_path,
                                                                option):
    if option == "--plot":
        _formats()
    folder = tmp_path / "out"
    folder.mkdir()
    path = folder / ("x.json" if option == "--json" else "x.png")
    monkeypatch.setattr(command, "run_timing", _timing_that_removes(folder))
    args = build_parser().parse_args(["bench", "--quick", "--subjects", "pyengine", "--sizes",
                                      "10", "--no-memory", "--no-lookups", option, str(path)]
                                     + (["--no-plot"] if option == "--json" else []))
    assert command.main(args) == 1
    captured = capsys.readouterr()
    assert "Goals" in captured.out and "0.500" in captured.out  # the report, timings and all
    assert captured.err.splitlines()[-1] == (f"bench: {option} {path}: not written: "
                                             "No such file or directory")
    assert "Traceback" not in captured.err


def test_the_default_plot_path_is_checked_before_timing(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / command.DEFAULT_PLOT).mkdir()
    monkeypatch.setattr(command, "run_timing", lambda *args: pytest.fail("timing started"))
    args = build_parser().parse_args(["bench", "--quick", "--no-memory", "--no-lookups"])
    assert command.main(args) == 2
    assert capsys.readouterr().err == (
        "python -m pyengine bench: error: argument --plot: cannot write 'pyengine-bench.png': "
        "it names a folder, expected a file name (the default; pass --plot PATH or --no-plot)\n")


def test_a_json_that_fails_to_write_leaves_the_earlier_one_whole(tmp_path):
    path = tmp_path / "bench.json"
    assert command._write_json(str(path), {"timing": [1.5]}) is None
    problem = command._write_json(str(path), {"timing": [2.5], "bad": object()})
    assert problem == (f"bench: --json {path}: not written: TypeError: Object of type object "
                       "is not JSON serializable")
    assert json.loads(path.read_text()) == {"timing": [1.5]}
    assert os.listdir(tmp_path) == ["bench.json"]  # no temporary file left behind


# -- one quick run, end to end ----------------------------------------------------------------------

def test_bench_command_quick_run(tmp_path):
    chosen = ["pyengine", "pyengine-pure"]
    try:
        import torch  # noqa: F401

        chosen.append("torch-view")
    except ImportError:
        pass
    try:
        import matplotlib  # noqa: F401

        plot = ["--plot", str(tmp_path / "bench.png")]
    except ImportError:
        plot = ["--no-plot"]
    env = dict(os.environ, PYTHONPATH=PYENGINE_ROOT)
    env.pop("PYENGINE_PURE", None)
    proc = subprocess.run([sys.executable, "-m", "pyengine", "bench", "--quick", "--repeats", "2",
                           "--subjects", ",".join(chosen), "--memory-sizes", "10k",
                           "--json", str(tmp_path / "bench.json"), *plot],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["timing"]["pyengine"]["implementation"] == "compiled"
    assert results["timing"]["pyengine-pure"]["implementation"] == "pure"
    keys = results["keys"]["graphs"] + results["keys"]["steps"] + results["keys"]["fixed"]
    for subject in ("pyengine", "pyengine-pure"):
        for key in keys:
            entry = results["timing"][subject]["workloads"][key]
            assert len(entry["samples"]) == 2 and all(s > 0 for s in entry["samples"]), (subject, key)
    assert {m["subject"] for m in results["memory"]} == set(chosen)
    assert all("error" not in m for m in results["memory"])
    assert "Goals" in proc.stdout and "chain 10k" in proc.stdout
    if plot[0] == "--plot":
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
