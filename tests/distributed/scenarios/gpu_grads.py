"""cupy gradients: after one backward, .grad on the GPU equals the
single-process full-batch gradient (1e-12 relative), through host staging
and, where PYENGINE_MPI_CUDA_AWARE=1 says the MPI is CUDA-aware, directly."""

import os

from mpi_common import check_close, comm, data, nn, np, passed, rank, shard, skip_all

try:
    import cupy
    cupy.cuda.runtime.getDeviceCount()
except Exception as error:  # no cupy, or no GPU
    skip_all(f"no cupy with a GPU ({error})")

from pyengine.distributed import DataParallel
from pyengine.frontend import Tensor
from pyengine.frontend.loss import cross_entropy

device = f"cuda:{rank % cupy.cuda.runtime.getDeviceCount()}"
transports = ["auto", "host"] + (["cuda-aware"] if os.environ.get("PYENGINE_MPI_CUDA_AWARE") == "1" else [])
x, y = data()
for transport in transports:
    model = nn.MLP([5, 24, 24, 3], activation="tanh", dtype=np.float64, device=device,
                   rng=np.random.default_rng(100 + rank))
    dp = DataParallel(model, bucket_cap_bytes=700, transport=transport, timeout=60)
    reference = nn.MLP([5, 24, 24, 3], activation="tanh", dtype=np.float64, device=device,
                       rng=np.random.default_rng(0))
    for (_, mine), (_, theirs) in zip(reference.named_parameters(), model.named_parameters()):
        mine.data[...] = theirs.data
    with cupy.cuda.Device(int(device.split(":")[1])):
        cross_entropy(model(Tensor(cupy.asarray(shard(x)))), shard(y)).backward()
        cross_entropy(reference(Tensor(cupy.asarray(x))), y).backward()
    for (name, parameter), (_, oracle) in zip(model.named_parameters(), reference.named_parameters()):
        assert isinstance(parameter.grad.data, cupy.ndarray), name
        check_close(cupy.asnumpy(parameter.grad.data), cupy.asnumpy(oracle.grad.data),
                    f"{transport}: {name}.grad")
    dp.close()
assert comm.Get_size() > 0
passed()
