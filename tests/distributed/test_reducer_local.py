"""DataParallel's reducer in one process, on both cores, without MPI: a fake
communicator stands for ``size`` ranks that all hold this process's values
(so the all-reduced sum is ``size`` times the local gradient, and the
average is the local gradient: the oracle is the same model in one
process). It runs in the main test suite, mpi4py or not; the real
multi-process runs are test_mpi.py.

Checked here: buckets start in index order while backward runs, host
staging hands MPI a separate numpy buffer, unused parameters and no_sync,
the timeout, failure notices, shape mismatches and bad arguments.
"""

from __future__ import annotations

import sys
import time
import types

import numpy as np
import pytest

from pyengine.distributed import DataParallel, DistributedError
from pyengine.frontend import Tensor, nn
from pyengine.frontend.loss import cross_entropy


class FakeRequest:
    """Completes after ``polls`` calls of Test (never, for None)."""

    def __init__(self, polls):
        self.polls = polls

    def Test(self):
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0


class FakeComm:
    """Rank 0 of ``size`` ranks that hold the same values as this one."""

    def __init__(self, size=3, polls=2, notice=None, views=None):
        self.size, self.polls, self.notice, self.views = size, polls, notice, views
        self.log = []

    def Get_rank(self):
        return 0

    def Get_size(self):
        return self.size

    def Dup(self):
        return self

    def allgather(self, value):
        return [value] + [self.views(rank, value) if self.views else value for rank in range(1, self.size)]

    def Bcast(self, buffer, root):
        self.log.append(("Bcast", buffer.size))

    def Iallreduce(self, sendbuf, recvbuf, op=None):
        assert sendbuf is FakeMPI.IN_PLACE
        self.log.append(("Iallreduce", recvbuf))
        recvbuf *= self.size
        return FakeRequest(self.polls)

    def iprobe(self, source=None, tag=None, status=None):
        if self.notice is not None:
            status.source = 2
            return True
        return False

    def recv(self, source=None, tag=None):
        notice, self.notice = self.notice, None
        return notice

    def isend(self, message, dest, tag):
        self.log.append(("isend", dest, message))


class FakeStatus:
    source = None

    def Get_source(self):
        return self.source


FakeMPI = types.SimpleNamespace(IN_PLACE=object(), SUM=object(), ANY_SOURCE=-1, Status=FakeStatus)


@pytest.fixture
def make_ddp(monkeypatch):
    """DataParallel on a FakeComm; every one made is closed after the test
    (an open, failed one would end the interpreter at exit)."""
    module = types.ModuleType("mpi4py")
    module.MPI = FakeMPI
    monkeypatch.setitem(sys.modules, "mpi4py", module)
    made = []

    def make(model, comm, **kwargs):
        ddp = DataParallel(model, comm, **kwargs)
        made.append(ddp)
        return ddp

    yield make
    for ddp in made:
        ddp.close()


def model_and_reference():
    model = nn.MLP([3, 8, 8, 2], activation="tanh", rng=np.random.default_rng(0))
    reference = nn.MLP([3, 8, 8, 2], activation="tanh", rng=np.random.default_rng(0))
    return model, reference


def data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(6, 3)), np.array([0, 1, 1, 0, 1, 0])


def check_grads(model, reference):
    for (name, parameter), (_, oracle) in zip(model.named_parameters(), reference.named_parameters()):
        np.testing.assert_allclose(parameter.grad.data, oracle.grad.data, rtol=1e-15, atol=0, err_msg=name)


@pytest.mark.parametrize("transport", ["auto", "host"])
def test_average_of_identical_ranks_is_the_local_gradient(make_ddp, transport):
    model, reference = model_and_reference()
    comm = FakeComm(size=3)
    ddp = make_ddp(model, comm, bucket_cap_bytes=100, transport=transport)
    x, y = data()
    cross_entropy(model(Tensor(x)), y).backward()
    cross_entropy(reference(Tensor(x)), y).backward()
    check_grads(model, reference)
    reduced = [entry[1] for entry in comm.log if entry[0] == "Iallreduce"]
    # 100-byte buckets from the reversed parameters: each layer's bias and
    # weight (2 + 16, 8 + 64, 8 + 24 float64 elements) pass 100 bytes together.
    assert ddp.bucket_names() == [[f"modules.{layer}.bias", f"modules.{layer}.weight"]
                                  for layer in (4, 2, 0)]
    assert len(reduced) == 3
    for bucket, buffer in zip(ddp.buckets, reduced):
        # Host staging hands MPI a separate host buffer; "auto" the bucket's own, for numpy.
        assert isinstance(buffer, np.ndarray)
        assert np.shares_memory(buffer, bucket.buffer) == (transport == "auto")
        assert buffer.size == bucket.numel + len(bucket.members)
    assert ddp.stats.buckets_started_early == 3 and ddp.stats.buckets_started_late == 0
    assert ddp.stats.steps == 1


def test_parameters_are_broadcast_in_order(make_ddp):
    model, _ = model_and_reference()
    comm = FakeComm()
    make_ddp(model, comm)
    assert [entry for entry in comm.log if entry[0] == "Bcast"] == [
        ("Bcast", parameter.data.size) for parameter in model.parameters()]


def test_buckets_start_in_index_order_as_backward_runs(make_ddp):
    model, _ = model_and_reference()
    comm = FakeComm()
    # 8-byte buckets: one per parameter, in reverse creation order.
    ddp = make_ddp(model, comm, bucket_cap_bytes=8)
    names = [name for name, _ in model.named_parameters()]
    assert ddp.bucket_names() == [[name] for name in reversed(names)]
    x, y = data()
    cross_entropy(model(Tensor(x)), y).backward()
    sizes = [entry[1].size for entry in comm.log if entry[0] == "Iallreduce"]
    assert sizes == [bucket.numel + 1 for bucket in ddp.buckets]
    ready_layers = [name.rsplit(".", 1)[0] for name in ddp.ready_order]
    assert ready_layers == ["modules.4"] * 2 + ["modules.2"] * 2 + ["modules.0"] * 2


def test_overlap_false_starts_every_bucket_at_the_end(make_ddp):
    model, reference = model_and_reference()
    ddp = make_ddp(model, FakeComm(), bucket_cap_bytes=8, overlap=False)
    x, y = data()
    cross_entropy(model(Tensor(x)), y).backward()
    cross_entropy(reference(Tensor(x)), y).backward()
    check_grads(model, reference)
    assert ddp.stats.buckets_started_early == 0 and ddp.stats.buckets_started_late == 6


def test_unused_parameter_keeps_none_and_is_not_waited_for(make_ddp):
    used = Tensor(np.arange(3.0), requires_grad=True)
    unused = Tensor(np.ones(2), requires_grad=True)
    ddp = make_ddp([used, unused], FakeComm(), bucket_cap_bytes=1 << 20, timeout=5)
    assert ddp.bucket_names() == [["1", "0"]]
    (used * used).sum().backward()
    np.testing.assert_array_equal(used.grad.data, 2 * np.arange(3.0))
    assert unused.grad is None
    assert ddp.stats.buckets_started_late == 1


def test_no_sync_accumulates_locally(make_ddp):
    model, reference = model_and_reference()
    comm = FakeComm()
    ddp = make_ddp(model, comm)
    x, y = data()
    with ddp.no_sync():
        cross_entropy(model(Tensor(x[:3])), y[:3]).backward()
    assert not [entry for entry in comm.log if entry[0] == "Iallreduce"]
    cross_entropy(model(Tensor(x[3:])), y[3:]).backward()
    (cross_entropy(reference(Tensor(x[:3])), y[:3]) + cross_entropy(reference(Tensor(x[3:])), y[3:])
     ).backward()
    check_grads(model, reference)
    assert ddp.stats.steps == 1


def test_timeout_raises_and_tells_the_other_ranks(make_ddp):
    model, _ = model_and_reference()
    comm = FakeComm(size=3, polls=None)   # the all-reduces never complete
    make_ddp(model, comm, timeout=0.2)
    x, y = data()
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 0 waited 0.2 s \(timeout\) for the gradient "
                                               r"all-reduce of buckets \[0\] in step 1"):
        cross_entropy(model(Tensor(x)), y).backward()
    assert time.monotonic() - start < 5
    assert [entry[1] for entry in comm.log if entry[0] == "isend"] == [1, 2]
    for parameter in model.parameters():
        # Nothing averaged was written back: .grad is the local accumulation.
        assert parameter.grad is not None
    with pytest.raises(DistributedError, match="broken by an earlier failure"):
        cross_entropy(model(Tensor(x)), y).backward()


def test_a_notice_ends_the_wait_at_once(make_ddp):
    model, _ = model_and_reference()
    comm = FakeComm(size=3, polls=None, notice="rank 2 failed: ValueError: boom")
    make_ddp(model, comm, timeout=60)
    x, y = data()
    start = time.monotonic()
    with pytest.raises(DistributedError, match="cannot complete: rank 2 failed: ValueError: boom"):
        cross_entropy(model(Tensor(x)), y).backward()
    assert time.monotonic() - start < 5


def test_shapes_that_differ_across_ranks(make_ddp):
    model, _ = model_and_reference()

    def views(rank, view):
        mine, settings = view
        if rank == 2:
            name, shape, dtype, kind = mine[1]
            return [mine[0], (name, (9,), dtype, kind)] + mine[2:], settings
        return view

    with pytest.raises(ValueError, match=r"parameter 1 differs across ranks: rank 2 has 'modules.0.bias' "
                                         r"with shape \(9,\), dtype float64 \(numpy\); rank 0 has "
                                         r"'modules.0.bias' with shape \(8,\)"):
        make_ddp(model, FakeComm(views=views))


@pytest.mark.parametrize("setting, theirs", [("bucket_cap_bytes", 1 << 20), ("broadcast", False),
                                             ("overlap", False)])
def test_settings_that_differ_across_ranks(make_ddp, setting, theirs):
    # Each decides the collectives: different buckets reached MPI as a bare
    # "MPI_ERR_TRUNCATE: message truncated" on one rank before.
    model, _ = model_and_reference()
    mine = dict(bucket_cap_bytes=800, broadcast=True, overlap=True)

    def views(rank, view):
        parameters, settings = view
        return (parameters, dict(settings, **{setting: theirs})) if rank == 1 else view

    with pytest.raises(ValueError, match=f"DataParallel: {setting} differs across ranks: rank 1 "
                                         f"passed {theirs!r}, rank 0 {mine[setting]!r}"):
        make_ddp(model, FakeComm(views=views), **mine)


@pytest.mark.parametrize("kwargs, message", [
    (dict(transport="gpu"), "transport must be one of 'auto', 'host', 'cuda-aware', got 'gpu'"),
    (dict(bucket_cap_bytes=0), "bucket_cap_bytes must be a positive int, got 0"),
    (dict(timeout=0), "timeout must be a positive number of seconds, got 0"),
])
def test_bad_arguments(make_ddp, kwargs, message):
    model, _ = model_and_reference()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_ddp(model, FakeComm(), **kwargs)


def test_parameters_listed_twice(make_ddp):
    weight = Tensor(np.ones(2), requires_grad=True)
    with pytest.raises(ValueError, match="parameter '1' is listed twice"):
        make_ddp([weight, weight], FakeComm())


def test_a_frozen_parameter_is_refused_by_name(make_ddp):
    trainable = Tensor(np.ones(2), requires_grad=True)
    frozen = Tensor(np.ones(2))
    with pytest.raises(ValueError, match="parameter 'frozen' does not require grad"):
        make_ddp({"trainable": trainable, "frozen": frozen}, FakeComm())
