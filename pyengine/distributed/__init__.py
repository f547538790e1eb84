"""Data-parallel training across processes on MPI (``pip install "pyengine[mpi]"``).

    from pyengine.distributed import DataParallel
    ddp = DataParallel(model)            # collective: rank 0's parameters everywhere
    loss = loss_fn(model(x_shard), y_shard)
    loss.backward()                      # .grad is now the average over the ranks
    optimizer.step()

Run with ``mpirun -n 4 python train.py``. This package owns the layer above
the engine that PyTorch's DistributedDataParallel is: ``data_parallel``
(the reducer, its buckets and failure handling, and the design Notes),
``parameters`` (how a framework's parameters and ``.grad`` are reached),
``transport`` (numpy and cupy buffers to MPI, staged through host memory or
not) and ``demo`` (``python -m pyengine demo --distributed``).

The package imports without mpi4py; ``DataParallel(...)`` then raises
ImportError saying what to install.
"""

from __future__ import annotations

from .data_parallel import (
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_TIMEOUT,
    DataParallel,
    DistributedError,
    StepStats,
)
from .parameters import DeZeroAccess, ParameterAccess, TensorAccess, named_parameters
from .transport import TRANSPORTS

__all__ = [
    "DEFAULT_BUCKET_CAP_BYTES",
    "DEFAULT_TIMEOUT",
    "TRANSPORTS",
    "DataParallel",
    "DeZeroAccess",
    "DistributedError",
    "ParameterAccess",
    "StepStats",
    "TensorAccess",
    "named_parameters",
]
