"""After one backward, every rank's .grad equals the single-process
full-batch gradient (1e-12 relative), for several bucket sizes and both
transports; the parameters were broadcast from rank 0."""

from mpi_common import check_close, check_grads, comm, copy_of, data, loss_of, make_model, np, passed, shard

from pyengine.distributed import DataParallel

x, y = data()
for cap in (1 << 20, 1, 700):
    for transport in ("auto", "host"):
        model = make_model(seed=100 + comm.Get_rank())   # every rank starts elsewhere
        dp = DataParallel(model, bucket_cap_bytes=cap, transport=transport, timeout=30)
        # The oracle of the broadcast: rank 0's initial values, made again here.
        for (name, parameter), (_, initial) in zip(model.named_parameters(),
                                                   make_model(seed=100).named_parameters()):
            assert np.array_equal(parameter.data, initial.data), f"{name} was not broadcast"
        reference = copy_of(model)
        loss_of(model, shard(x), shard(y)).backward()
        loss_of(reference, x, y).backward()
        check_grads(model, reference, f"cap {cap}, transport {transport}")
        # The local loss is this rank's; the full-batch loss is the mean of them.
        local = comm.allreduce(loss_of(model, shard(x), shard(y)).item()) / comm.Get_size()
        check_close(local, loss_of(reference, x, y).item(), "mean of the local losses")
        assert dp.stats.steps == 1, dp.stats.as_dict()
        dp.close()
passed()
