"""Bucket boundaries (by hand from the rule: reversed parameters, close at
the cap, one kind per bucket), the order gradients become ready, buckets
started during backward, and overlap=False starting them all at its end."""

from mpi_common import Tensor, check_close, comm, data, loss_of, make_model, np, passed, pyengine, shard

from pyengine.distributed import DEFAULT_BUCKET_CAP_BYTES, DataParallel

x, y = data()
# SIZES [5, 24, 24, 24, 3]: elements per parameter, reversed:
# 6.bias 3, 6.weight 72, 4.bias 24, 4.weight 576, 2.bias 24, 2.weight 576, 0.bias 24, 0.weight 120.
layers = ["modules.6", "modules.4", "modules.2", "modules.0"]
expected = {
    DEFAULT_BUCKET_CAP_BYTES: [["modules.6.bias", "modules.6.weight", "modules.4.bias", "modules.4.weight",
                                "modules.2.bias", "modules.2.weight", "modules.0.bias",
                                "modules.0.weight"]],
    # 100 float64 elements: 3 + 72 + 24 = 99 stays open, + 576 closes it.
    800: [["modules.6.bias", "modules.6.weight", "modules.4.bias", "modules.4.weight"],
          ["modules.2.bias", "modules.2.weight"], ["modules.0.bias", "modules.0.weight"]],
    8: [[f"{layer}.{kind}"] for layer in layers for kind in ("bias", "weight")],
}
for cap, buckets in expected.items():
    for overlap in (True, False):
        model = make_model(seed=1)
        dp = DataParallel(model, bucket_cap_bytes=cap, overlap=overlap, timeout=30)
        assert dp.bucket_names() == buckets, (cap, dp.bucket_names())
        loss_of(model, shard(x), shard(y)).backward()
        # Ready order: the later layer first (the ready queue's sequence_nr order).
        ready_layers = [name.rsplit(".", 1)[0] for name in dp.ready_order]
        assert ready_layers == [layer for layer in layers for _ in range(2)], dp.ready_order
        started = dp.stats.buckets_started_early, dp.stats.buckets_started_late
        assert started == ((len(buckets), 0) if overlap else (0, len(buckets))), (cap, overlap, started)
        dp.close()

# Mixed dtypes: each kind has buckets of its own. Reversed: c (f8), b (f4), a (f8);
# the f8 bucket stays open until a, the last parameter, so the f4 one comes first.
a = Tensor(np.arange(10.0), requires_grad=True)
b = Tensor(np.arange(10, dtype=np.float32), requires_grad=True)
c = Tensor(np.linspace(0, 1, 10), requires_grad=True)
dp = DataParallel([a, b, c], timeout=30)
assert dp.bucket_names() == [["1"], ["2", "0"]], dp.bucket_names()
rank_scale = comm.Get_rank() + 1.0
loss = (a * (2.0 * rank_scale)).sum() + (b.astype(np.float64) * 3.0).sum() + (c * c).sum()
loss.backward()
mean_scale = np.mean(np.arange(1, comm.Get_size() + 1))
check_close(a.grad.data, np.full(10, 2.0 * mean_scale), "a.grad")
assert b.grad.data.dtype == np.float32
check_close(b.grad.data, np.full(10, 3.0), "b.grad")
check_close(c.grad.data, 2 * c.data, "c.grad")
dp.close()
assert pyengine.IMPLEMENTATION in ("compiled", "pure")
passed()
