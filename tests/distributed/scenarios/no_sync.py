"""no_sync: the backward inside accumulates locally (no all-reduce); the
next one outside all-reduces the accumulated sum."""

from mpi_common import check_grads, comm, copy_of, data, loss_of, make_model, np, passed, shard

from pyengine.distributed import DataParallel

x, y = data()
model = make_model(seed=5)
dp = DataParallel(model, bucket_cap_bytes=1000, timeout=30)
reference = copy_of(model)
local_reference = copy_of(model)
mine_x, mine_y = shard(x), shard(y)
half = len(mine_x) // 2
with dp.no_sync():
    loss_of(model, mine_x[:half], mine_y[:half]).backward()
assert dp.stats.steps == 0
loss_of(local_reference, mine_x[:half], mine_y[:half]).backward()
check_grads(model, local_reference, "inside no_sync: the local gradient")
loss_of(model, mine_x[half:], mine_y[half:]).backward()
assert dp.stats.steps == 1
# Oracle: the mean over ranks of both micro-batch losses = each micro-batch's
# loss over all ranks' rows of it (equal sizes), summed.
size = comm.Get_size()
first = np.concatenate([shard(x, r)[:half] for r in range(size)]), np.concatenate(
    [shard(y, r)[:half] for r in range(size)])
second = np.concatenate([shard(x, r)[half:] for r in range(size)]), np.concatenate(
    [shard(y, r)[half:] for r in range(size)])
(loss_of(reference, *first) + loss_of(reference, *second)).backward()
check_grads(model, reference, "after no_sync and one synced backward")
passed()
