"""DeZero models through pyengine's DeZero adapter: after one backward,
.grad equals the single-process full-batch gradient (1e-12 relative), and
two steps of DeZero's SGD match."""

from mpi_common import check_close, comm, data, np, passed, rank, shard, skip_all

try:
    import dezero
    import dezero.functions as F
    import dezero.layers as L
except ImportError:
    skip_all("DeZero is not installed (pip install dezero==0.0.13 'numpy<1.24')")

from pyengine.adapters import dezero as pyengine_dezero
from pyengine.distributed import DataParallel

pyengine_dezero.install()


class Net(dezero.Model):
    def __init__(self):
        super().__init__()
        for index, (fan_in, fan_out) in enumerate([(5, 24), (24, 24), (24, 3)]):
            setattr(self, f"l{index}", L.Linear(fan_out, in_size=fan_in, dtype=np.float64))

    def forward(self, x):
        return self.l2(F.tanh(self.l1(F.tanh(self.l0(x)))))


def copy_params(target, source):
    flat_target, flat_source = {}, {}
    target._flatten_params(flat_target)
    source._flatten_params(flat_source)
    for name, parameter in flat_target.items():
        parameter.data = flat_source[name].data.copy()
    return flat_target, flat_source


# A DeZero Linear without in_size has no weight until its first forward.
try:
    DataParallel(dezero.models.MLP((4, 3)))
except ValueError as error:
    assert "parameter 'l0/W' has no array yet" in str(error), error
else:
    raise AssertionError("DataParallel accepted a model without weights")

x, y = data()
np.random.seed(100 + rank)            # DeZero initializes from numpy's global generator
model = Net()
dp = DataParallel(model, bucket_cap_bytes=1000, timeout=30)
assert [name for group in dp.bucket_names() for name in group][:2] == ["l2/b", "l2/W"], dp.bucket_names()
reference = Net()
flat_reference, flat_model = copy_params(reference, model)
optimizer = dezero.optimizers.SGD(lr=0.1).setup(model)
reference_optimizer = dezero.optimizers.SGD(lr=0.1).setup(reference)
for step in range(2):
    model.cleargrads()
    reference.cleargrads()
    F.softmax_cross_entropy(model(shard(x)), shard(y)).backward()
    F.softmax_cross_entropy(reference(x), y).backward()
    for name, parameter in flat_model.items():
        check_close(parameter.grad.data, flat_reference[name].grad.data, f"step {step}: {name}.grad")
    optimizer.update()
    reference_optimizer.update()
    for name, parameter in flat_model.items():
        check_close(parameter.data, flat_reference[name].data, f"step {step}: {name}")
assert dp.stats.steps == 2
assert comm.Get_size() > 0
passed()
