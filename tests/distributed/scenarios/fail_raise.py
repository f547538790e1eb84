"""Rank 1 raises inside backward: uncaught, so that the process dies of it
(``uncaught``, the default), or caught and passed to ``DataParallel.abort``
(``abort``). Every other rank's backward raises DistributedError naming
rank 1 and its error, long before the timeout."""

import sys
import time

from mpi_common import Tensor, cross_entropy, data, make_model, passed, rank, report, shard

from pyengine.distributed import DataParallel, DistributedError
from pyengine.frontend import Function

TIMEOUT = 60
MODE = sys.argv[1] if len(sys.argv) > 1 else "uncaught"


class FailOnRank1(Function):
    @staticmethod
    def forward(ctx, x):
        return Tensor(x.data.copy())

    @staticmethod
    def backward(ctx, grad):
        if rank == 1:
            raise ValueError("injected failure on rank 1")
        return grad


x, y = data()
model = make_model(seed=0)
dp = DataParallel(model, bucket_cap_bytes=800, timeout=TIMEOUT)
# The failing node runs after the last layers' gradients: buckets are in flight.
hidden = FailOnRank1.apply(model[0](Tensor(shard(x))))
out = model[4](model[3](model[2](model[1](hidden))))
out = model[6](model[5](out))
start = time.monotonic()
try:
    cross_entropy(out, shard(y)).backward()
except ValueError as error:
    if MODE != "abort" or isinstance(error, DistributedError):
        raise
    dp.abort(f"{type(error).__name__}: {error}")
    report(f"rank {rank} aborted: {error}")
    sys.exit(0)   # the atexit handler ends the rank once the others have reported
except DistributedError as error:
    elapsed = time.monotonic() - start
    message = str(error)
    assert "rank 1 failed" in message and "injected failure on rank 1" in message, message
    assert elapsed < TIMEOUT / 2, f"rank {rank} learned of the failure after {elapsed:.1f} s"
    passed(f"CLEAR-ERROR rank {rank} after {elapsed:.1f} s: DistributedError: {message}")
else:
    raise AssertionError(f"rank {rank}: backward succeeded although rank 1 failed")
