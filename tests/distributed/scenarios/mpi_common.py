"""What the scenario scripts share: the communicator, the data, a model, and
the oracle (the same model trained in one process on the full batch).

Each scenario script runs on every rank under mpirun and prints
``PASS <scenario> rank <r>`` once its checks passed (or ``SKIP <reason>``);
tests/distributed/test_mpi.py launches them and reads those lines.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

import pyengine
from pyengine.frontend import Tensor, nn, optim
from pyengine.frontend.loss import cross_entropy

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()

SIZES = [5, 24, 24, 24, 3]
ROWS = 48          # divisible by 1, 2, 3 and 4 ranks: equal shards


def scenario_name():
    return os.path.splitext(os.path.basename(sys.argv[0]))[0]


def report(line):
    """Print ``line``, and append it to this rank's file under
    $PYENGINE_MPI_REPORT_DIR: a launcher that tears the job down may drop
    the last lines a rank printed before they reach mpirun's output."""
    print(line, flush=True)
    directory = os.environ.get("PYENGINE_MPI_REPORT_DIR")
    if directory:
        with open(os.path.join(directory, f"rank{rank}.txt"), "a") as file:
            file.write(line + "\n")


def passed(evidence=None):
    """Report the pass, after ``evidence`` (a line saying what was seen) in
    the same write: a launcher that ends the job once a rank died can kill
    a rank between two reports, which would leave the evidence without its
    pass (one CI run saw it with 4 ranks)."""
    line = f"PASS {scenario_name()} rank {rank} of {size} ({pyengine.IMPLEMENTATION} core)"
    report(line if evidence is None else f"{evidence}\n{line}")


def skip_all(reason):
    if rank == 0:
        report(f"SKIP {reason}")
    sys.exit(0)


def data(seed=7, rows=ROWS):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, SIZES[0])), rng.integers(0, SIZES[-1], rows)


def shard(array, of_rank=None):
    """This rank's equal, contiguous share of the rows."""
    of_rank = rank if of_rank is None else of_rank
    per = len(array) // size
    return array[of_rank * per:(of_rank + 1) * per]


def make_model(seed, sizes=SIZES):
    return nn.MLP(sizes, activation="tanh", dtype=np.float64, rng=np.random.default_rng(seed))


def copy_of(model, sizes=SIZES):
    """An independent model with ``model``'s parameter values (the oracle's)."""
    twin = make_model(12345, sizes)
    for (_, mine), (_, theirs) in zip(twin.named_parameters(), model.named_parameters()):
        mine.data[...] = theirs.data
    return twin


def loss_of(model, x, y):
    return cross_entropy(model(Tensor(x)), y)


def relative_error(got, expected):
    """``|got - expected| / |expected|`` in the 2-norm over the whole array."""
    return float(np.linalg.norm(np.asarray(got) - np.asarray(expected)) / np.linalg.norm(expected))


def check_close(got, expected, what, rtol=1e-12):
    error = relative_error(got, expected)
    if not error <= rtol:
        raise AssertionError(f"rank {rank}: {what}: relative error {error:.3e} > {rtol:g}")


def check_grads(model, reference, what, rtol=1e-12):
    for (name, parameter), (_, oracle) in zip(model.named_parameters(), reference.named_parameters()):
        assert parameter.grad is not None, f"rank {rank}: {what}: {name}.grad is None"
        check_close(parameter.grad.data, oracle.grad.data, f"{what}: {name}.grad", rtol)


__all__ = ["MPI", "comm", "rank", "size", "np", "pyengine", "optim", "nn", "Tensor", "cross_entropy",
           "SIZES", "ROWS", "report", "passed", "skip_all", "data", "shard", "make_model", "copy_of",
           "loss_of", "relative_error", "check_close", "check_grads"]
