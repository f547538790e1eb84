"""Several steps of SGD (with momentum) and Adam, data-parallel, match the
same steps taken in one process on the full minibatches."""

from mpi_common import (
    check_close,
    check_grads,
    comm,
    copy_of,
    data,
    loss_of,
    make_model,
    np,
    optim,
    passed,
    shard,
)

from pyengine.distributed import DataParallel

STEPS = 6
x, y = data(seed=11, rows=48 * STEPS)
for name, make_optimizer in (("SGD", lambda params: optim.SGD(params, lr=0.1, momentum=0.9)),
                             ("Adam", lambda params: optim.Adam(params, lr=0.01))):
    model = make_model(seed=3 + comm.Get_rank())
    dp = DataParallel(model, bucket_cap_bytes=2048, timeout=30)
    reference = copy_of(model)
    optimizer, reference_optimizer = make_optimizer(model.parameters()), make_optimizer(
        reference.parameters())
    for step in range(STEPS):
        rows = slice(48 * step, 48 * (step + 1))
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        loss_of(model, shard(x[rows]), shard(y[rows])).backward()
        loss_of(reference, x[rows], y[rows]).backward()
        check_grads(model, reference, f"{name} step {step}", rtol=1e-11)
        optimizer.step()
        reference_optimizer.step()
        for (parameter_name, parameter), (_, oracle) in zip(model.named_parameters(),
                                                            reference.named_parameters()):
            check_close(parameter.data, oracle.data, f"{name} step {step}: {parameter_name}", 1e-12)
    # Every rank holds the same parameters (bitwise: same averaged gradients).
    everyone = comm.allgather(np.concatenate([p.data.ravel() for p in model.parameters()]))
    assert all(np.array_equal(everyone[0], theirs) for theirs in everyone), f"{name}: ranks differ"
    assert dp.stats.steps == STEPS
    dp.close()
passed()
