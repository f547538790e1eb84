"""Parameters that get no gradient: one used only on rank 0, one used on no
rank. Nothing waits for them; the first is averaged over all ranks (rank
0's gradient / world size), the second keeps .grad None, as in DDP."""

import time

from mpi_common import Tensor, check_close, comm, data, nn, np, passed, rank, shard

from pyengine.distributed import DataParallel
from pyengine.frontend.loss import cross_entropy


class Branchy(nn.Module):
    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.shared = nn.Linear(5, 3, rng=rng)
        self.only_rank0 = nn.Linear(5, 3, rng=rng)
        self.never = nn.Linear(5, 3, rng=rng)

    def forward(self, x, for_rank):
        out = self.shared(x)
        if for_rank == 0:
            out = out + self.only_rank0(x).tanh()
        return out


x, y = data()
model = Branchy(seed=rank)
dp = DataParallel(model, bucket_cap_bytes=64, timeout=10)
reference = Branchy(seed=99)
for (_, mine), (_, theirs) in zip(reference.named_parameters(), model.named_parameters()):
    mine.data[...] = theirs.data
start = time.monotonic()
cross_entropy(model(Tensor(shard(x)), rank), shard(y)).backward()
elapsed = time.monotonic() - start
assert elapsed < 5, f"backward took {elapsed:.1f} s: waited for an unused parameter?"
# Oracle: each rank's local gradient, computed here for every rank, averaged.
for r in range(comm.Get_size()):
    loss = cross_entropy(reference(Tensor(shard(x, r)), r), shard(y, r)) * (1.0 / comm.Get_size())
    loss.backward()
for (name, parameter), (_, oracle) in zip(model.named_parameters(), reference.named_parameters()):
    if name.startswith("never"):
        assert parameter.grad is None and oracle.grad is None, name
    else:
        check_close(parameter.grad.data, oracle.grad.data, f"{name}.grad")
passed()
