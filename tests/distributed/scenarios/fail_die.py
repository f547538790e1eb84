"""Rank 1 dies inside backward (os._exit). Every other rank gets a clear
DistributedError: from the launcher's SIGTERM (plain mpirun), or from the
timeout (mpirun --enable-recovery keeps the job running)."""

import os
import sys
import time

from mpi_common import Tensor, cross_entropy, data, make_model, passed, rank, shard, size

from pyengine.distributed import DataParallel, DistributedError
from pyengine.frontend import Function

TIMEOUT = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
# Where each rank but 1 says it is ready for rank 1 to die (the test's
# report directory), or None.
READY_DIRECTORY = os.environ.get("PYENGINE_MPI_REPORT_DIR")
READY_WAIT_SECONDS = 20.0


class ReadyForTheDeath(Function):
    """Between the last two layers. The other ranks turn the launcher's
    SIGTERM into the clear error only from their first gradient hook on
    (DataParallel's reduction begins there); this node's backward runs
    after the last layer's parameters' hooks (their AccumulateGrad nodes
    run first), so here a rank other than 1 is ready, and says so with a
    file. A fixed wait on rank 1 was not enough on a loaded machine: CI
    runs with 4 ranks saw rank 3 end silently twice, the second time with
    rank 1 waiting 1 s (the compiled core, beside the ThreadSanitizer
    stage)."""

    @staticmethod
    def forward(ctx, x):
        return Tensor(x.data.copy())

    @staticmethod
    def backward(ctx, grad):
        if rank != 1 and READY_DIRECTORY:
            open(os.path.join(READY_DIRECTORY, f"ready{rank}"), "w").close()
        return grad


def wait_for_the_others():
    """Until every other rank is ready (at most READY_WAIT_SECONDS); 1 s
    where no directory is shared."""
    if not READY_DIRECTORY:
        time.sleep(1.0)
        return
    others = [os.path.join(READY_DIRECTORY, f"ready{other}") for other in range(size) if other != 1]
    deadline = time.monotonic() + READY_WAIT_SECONDS
    while not all(os.path.exists(path) for path in others) and time.monotonic() < deadline:
        time.sleep(0.01)


class DieOnRank1(Function):
    @staticmethod
    def forward(ctx, x):
        return Tensor(x.data.copy())

    @staticmethod
    def backward(ctx, grad):
        if rank == 1:
            wait_for_the_others()
            os._exit(3)
        return grad


x, y = data()
model = make_model(seed=0)
dp = DataParallel(model, bucket_cap_bytes=800, timeout=TIMEOUT)
out = model[6](ReadyForTheDeath.apply(model[5](model[4](model[3](model[2](model[1](
    DieOnRank1.apply(model[0](Tensor(shard(x)))))))))))
start = time.monotonic()
try:
    cross_entropy(out, shard(y)).backward()
except DistributedError as error:
    elapsed = time.monotonic() - start
    message = str(error)
    assert "SIGTERM" in message or f"waited {TIMEOUT:g} s (timeout)" in message, message
    assert elapsed < TIMEOUT + 2, f"rank {rank} gave up after {elapsed:.1f} s"
    passed(f"CLEAR-ERROR rank {rank} after {elapsed:.1f} s: DistributedError: {message}")
else:
    raise AssertionError(f"rank {rank}: backward succeeded although rank 1 died")
