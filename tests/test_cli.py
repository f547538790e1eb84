"""``python -m pyengine``: what its commands print, and the warnings that say
which core runs and why.

Oracles: the commands' exit status and text; for the core warnings, a copy
of the imported package made into each case (a source tree without built
modules, an install without them), imported in a fresh process.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import pytest

import pyengine
from pyengine import stress
from pyengine.__main__ import build_parser
from pyengine.frontend import demo

PACKAGE = os.path.dirname(os.path.abspath(pyengine.__file__))


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_stress_progress_is_one_line_redrawn_on_a_terminal():
    screen = Terminal()
    progress = stress.ProgressLine(screen)
    report = stress.run(batches=3, seed=1, log=progress)
    progress.finish()
    text = screen.getvalue()
    assert text.count("\r\x1b[K") == 3 and text.count("\n") == 1
    last = text.rsplit("\r\x1b[K", 1)[1]
    assert f"{report.batches} batches" in last and f"{3 * len(stress.SCENARIOS)} scenarios" in last
    assert "0 failures" in last and f"{report.backward_calls:,} backward calls" in last
    assert report.seconds > 0 and f"{report.seconds:.1f} s" in last


def test_stress_progress_in_a_log_is_a_line_now_and_then():
    log = io.StringIO()
    progress = stress.ProgressLine(log, every_s=3600.0)
    stress.run(batches=2, seed=2, log=progress)
    progress.finish()
    assert log.getvalue() == ""  # an hour between lines: none in two batches
    progress = stress.ProgressLine(log, every_s=0.0)
    stress.run(batches=2, seed=2, log=progress)
    assert log.getvalue().count("\n") == 2 and "\r" not in log.getvalue()


def test_stress_report_times_every_batch():
    seconds = []
    stress.run(batches=3, seed=3, log=lambda report: seconds.append(report.seconds))
    assert len(seconds) == 3 and 0 < seconds[0] <= seconds[1] <= seconds[2]


def test_stress_quiet_prints_the_header_and_the_summary(capsys):
    args = build_parser().parse_args(["stress", "--minutes", "0.001", "--quiet", "--seed", "4"])
    assert stress.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"pyengine stress: {pyengine.IMPLEMENTATION} engine core")
    assert lines[1].startswith("passed: ") and "deadlocks 0" in lines[1]


@pytest.mark.parametrize("argv, option, value", [
    (["stress", "--minutes", "nan"], "--minutes", "nan"),  # never ended
    (["stress", "--minutes", "inf"], "--minutes", "inf"),
    (["stress", "--minutes", "-1"], "--minutes", "-1"),  # "passed" after 0 batches
    (["stress", "--minutes", "0"], "--minutes", "0"),
    (["stress", "--watchdog", "0"], "--watchdog", "0"),  # a false deadlock
    (["stress", "--watchdog", "-1"], "--watchdog", "-1"),
    (["stress", "--watchdog", "nan"], "--watchdog", "nan"),
    (["stress", "--watchdog", "1e300"], "--watchdog", "1e300"),  # past threading.TIMEOUT_MAX
    (["stress", "--seed", "-5"], "--seed", "-5"),  # numpy's ValueError traceback
    (["stress", "--seed", "1.5"], "--seed", "1.5"),
    (["bench", "--sizes", "1e400"], "--sizes", "1e400"),  # OverflowError traceback
    (["bench", "--sizes", "inf"], "--sizes", "inf"),
    (["bench", "--memory-sizes", "10k", "inf"], "--memory-sizes", "inf"),
    (["bench", "--lookup-rows", "1e400"], "--lookup-rows", "1e400"),
])
def test_a_bad_number_is_a_usage_error_naming_the_option_and_value(capsys, argv, option, value):
    # argparse's own way out: exit status 2 and one line that names the
    # option and the value, before anything runs.
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m pyengine " + argv[0])
    assert f"error: argument {option}: " in err and repr(value) in err


def test_stress_command_rejects_a_negative_seed_in_a_process():
    result = run_python(os.path.dirname(PACKAGE), "-m", "pyengine", "stress", "--seed", "-5",
                        "--minutes", "0.001", "--quiet", pythonpath=os.path.dirname(PACKAGE))
    assert result.returncode == 2 and result.stdout == ""
    assert "error: argument --seed: expected a seed >= 0, got '-5'" in result.stderr
    assert "Traceback" not in result.stderr


def test_stress_time_budget_runs_one_batch_at_least():
    report = stress.run(duration_s=1e-9, seed=5)
    assert report.batches == 1 and report.backward_calls > 0


@pytest.mark.parametrize("option", ["--graph", "--trace"])
def test_demo_refuses_an_unwritable_path_before_training(capsys, tmp_path, option):
    missing = tmp_path / "no such folder" / "out.svg"
    assert demo.main(build_parser().parse_args(["demo", option, str(missing)])) == 2
    captured = capsys.readouterr()
    assert f"demo: {option} {missing}: the folder {missing.parent} does not exist" in captured.err
    assert "epoch" not in captured.out
    assert demo.main(build_parser().parse_args(["demo", option, str(tmp_path)])) == 2
    assert "is a folder, expected a file name" in capsys.readouterr().err


def test_demo_graph_without_a_suffix_is_a_clear_error(capsys, tmp_path):
    args = build_parser().parse_args(["demo", "--epochs", "1", "--points", "64", "--graph",
                                      str(tmp_path / "graph")])
    assert demo.main(args) == 2
    assert "demo: --graph: cannot tell the format" in capsys.readouterr().err


def test_demo_seed_has_help():
    help_text = build_parser()._subparsers._group_actions[0].choices["demo"].format_help()
    assert "--seed SEED" in help_text and "same seed gives the same run" in help_text


def package_copy(tmp_path, source_tree):
    """pyengine's Python files in ``tmp_path/pyengine``: a source tree (with a
    .pyx) or an install, without compiled modules either way."""
    copy = tmp_path / "pyengine"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns(
        "*.so", "*.pyd", "*.pyx", "*.cpp", "__pycache__"))
    if source_tree:
        (copy / "_engine.pyx").write_text("# the source\n")
    return copy


def run_python(cwd, *args, pythonpath=None):
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYENGINE_PURE", "PYTHONPATH")}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_source_tree_without_a_build_says_what_to_do(tmp_path):
    package_copy(tmp_path, source_tree=True)
    result = run_python(tmp_path, "-m", "pyengine", "stress", "--minutes", "0.001", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "circular" not in result.stderr
    assert f"imported from the source tree {tmp_path / 'pyengine'}" in result.stderr
    assert "the checkout shadows any installed pyengine" in result.stderr
    assert f"cd {tmp_path} && python setup.py build_ext --inplace" in result.stderr
    assert result.stdout.startswith("pyengine stress: pure engine core: the pure-Python twin")


def test_install_without_compiled_modules_says_what_to_do(tmp_path):
    site = tmp_path / "site-packages"
    site.mkdir()
    package_copy(site, source_tree=False)
    result = run_python(tmp_path, "-c", "import pyengine; print(pyengine.IMPLEMENTATION)",
                        pythonpath=site)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "pure\n"
    assert "circular" not in result.stderr
    assert "installed without its compiled core" in result.stderr
    assert "pip install --force-reinstall --no-cache-dir" in result.stderr


def fake_package(tmp_path, name, body):
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text(body)
    (tmp_path / name / "core.py").write_text("")
    (tmp_path / name / "engine.py").write_text("")


@pytest.mark.parametrize("framework, adapter", [("dezero", "pyengine.adapters.dezero"),
                                                ("micrograd", "pyengine.adapters.micrograd")])
def test_adapter_shows_the_error_of_a_framework_that_does_not_import(tmp_path, framework, adapter):
    fake_package(tmp_path, framework, "import numpy as np\nnp.int_is_gone\n")
    parent = os.path.dirname(PACKAGE)
    result = run_python(tmp_path, "-c", f"import {adapter}",
                        pythonpath=os.pathsep.join([str(tmp_path), parent]))
    assert result.returncode == 1
    assert "is installed but does not import" in result.stderr
    assert "AttributeError: module 'numpy' has no attribute 'int_is_gone'" in result.stderr


@pytest.mark.parametrize("framework, adapter, command", [
    ("dezero", "pyengine.adapters.dezero", "pip install dezero==0.0.13 'numpy<1.24' 'matplotlib<3.9'"),
    ("micrograd", "pyengine.adapters.micrograd", "pip install micrograd")])
def test_adapter_names_a_missing_framework_and_how_to_install_it(framework, adapter, command):
    parent = os.path.dirname(PACKAGE)
    # As if the framework were not installed, wherever it is.
    hide = (f"import sys\n"
            f"class Hide:\n"
            f"    def find_spec(self, name, path=None, target=None):\n"
            f"        if name == {framework!r}:\n"
            f"            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)\n"
            f"sys.meta_path.insert(0, Hide())\n"
            f"import {adapter}\n")
    result = run_python(parent, "-c", hide, pythonpath=parent)
    assert result.returncode == 1
    assert f"needs {'DeZero' if framework == 'dezero' else 'micrograd'}: {command}" in result.stderr
