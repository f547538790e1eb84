"""``mpirun -n 4 python -m pyengine demo --distributed``: the spiral demo,
data-parallel.

Every rank makes the same data, model and batch order as ``python -m
pyengine demo`` with the same flags (the same seed), and takes its share of
each minibatch: rank r of w gets the r-th of w near-equal slices of the
batch's rows, and scales its mean loss by its share, so that the averaged
gradient is the whole batch's, and training follows the single-process run
up to float32 rounding. A minibatch with fewer rows than ranks (the last of
an epoch, at most) is skipped. Rank 0 prints the epochs; at the end every
rank's work (rows, steps, backward time, all-reduce time and the part of it
hidden behind backward, from :class:`StepStats`) is gathered and printed.

The buckets are small (``DEMO_BUCKET_CAP_BYTES``) so that the demo's small
MLP gets one bucket per layer and shows the overlap; the library default
(1 MiB) would put it in one bucket.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import pyengine

DEMO_BUCKET_CAP_BYTES = 4096


def _accuracy(model, x, y, Tensor):
    with pyengine.no_grad():
        return float((np.asarray(model(Tensor(x)).data).argmax(axis=1) == y).mean())


def main(args) -> int:
    try:
        from mpi4py import MPI
    except ImportError:
        print("demo --distributed needs mpi4py and an MPI: pip install \"pyengine[mpi]\", then "
              "mpirun -n 4 python -m pyengine demo --distributed", file=sys.stderr)
        return 2
    from pyengine.frontend import Tensor, nn, optim
    from pyengine.frontend.demo import count_nodes, spirals
    from pyengine.frontend.loss import cross_entropy
    from pyengine.frontend.tensor import manual_seed

    from .data_parallel import DataParallel

    if args.device != "cpu":
        print("demo --distributed: only --device cpu", file=sys.stderr)
        return 2
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    # The same random stream as the single-process demo, on every rank.
    rng = np.random.default_rng(args.seed)
    manual_seed(args.seed)
    train_x, train_y = spirals(args.points, rng)
    test_x, test_y = spirals(args.points, rng)
    dtype = np.float32
    model = nn.MLP([2, args.hidden, args.hidden, 2], activation="relu", dtype=dtype, rng=rng)
    ddp = DataParallel(model, comm, bucket_cap_bytes=DEMO_BUCKET_CAP_BYTES)
    optimizer = optim.Adam(model.parameters(), lr=args.lr)
    batches = -(-args.points // args.batch_size)
    if rank == 0:
        print(f"pyengine demo --distributed: {world} ranks; two spirals, {args.points} points; MLP "
              f"2-{args.hidden}-{args.hidden}-2 (relu), Adam lr {args.lr} with cosine decay, batch "
              f"{args.batch_size} split across the ranks; {len(ddp.buckets)} gradient buckets of "
              f"<= {DEMO_BUCKET_CAP_BYTES} bytes; {pyengine.IMPLEMENTATION} engine core", flush=True)
    rows_done = steps = 0
    nodes_per_step = None
    backward_seconds = 0.0
    start = time.perf_counter()
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        decay = 0.5 * (1 + np.cos(np.pi * (epoch - 1) / args.epochs))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * (0.05 + 0.95 * decay)
        order = rng.permutation(args.points)
        total_loss = 0.0
        for b in range(batches):
            rows = order[b * args.batch_size:(b + 1) * args.batch_size]
            if len(rows) < world:
                continue
            mine = np.array_split(rows, world)[rank]
            x = Tensor(train_x[mine].astype(dtype))
            local = cross_entropy(model(x), train_y[mine])
            loss = local * (len(mine) * world / len(rows))
            if nodes_per_step is None:
                nodes_per_step = count_nodes(loss.grad_fn)
            optimizer.zero_grad()
            before = time.perf_counter()
            loss.backward()
            backward_seconds += time.perf_counter() - before
            optimizer.step()
            steps += 1
            rows_done += len(mine)
            total_loss += local.item() * len(mine)
        total_loss = comm.allreduce(total_loss)
        accuracy = _accuracy(model, train_x.astype(dtype), train_y, Tensor)
        if rank == 0:
            print(f"epoch {epoch:3d}/{args.epochs}  loss {total_loss / args.points:.4f}  "
                  f"train accuracy {100 * accuracy:5.1f}%  {time.perf_counter() - start:6.1f} s",
                  flush=True)
    elapsed = time.perf_counter() - start
    test_accuracy = _accuracy(model, test_x.astype(dtype), test_y, Tensor)
    stats = ddp.stats
    mine = (rank, rows_done, steps, (nodes_per_step or 0) * steps, backward_seconds, stats.allreduce_seconds,
            stats.hidden_seconds, stats.wait_seconds, stats.bytes_reduced, test_accuracy)
    everyone = comm.gather(mine, root=0)
    if rank == 0:
        accuracies = {round(row[-1], 6) for row in everyone}
        print(f"trained in {elapsed:.1f} s: train accuracy {100 * accuracy:.1f}%, "
              f"held-out accuracy {100 * test_accuracy:.1f}% (the same on every rank: "
              f"{len(accuracies) == 1})")
        print("rank   rows  steps  backward nodes  backward s  all-reduce s  hidden s  waited s  "
              "hidden  MB reduced")
        for (r, rows_r, steps_r, nodes_r, backward_r, allreduce_r, hidden_r, wait_r, bytes_r,
             _) in everyone:
            fraction = hidden_r / allreduce_r if allreduce_r else 0.0
            print(f"{r:4d} {rows_r:6d} {steps_r:6d} {nodes_r:15,d} {backward_r:11.2f} "
                  f"{allreduce_r:13.2f} {hidden_r:9.2f} {wait_r:9.2f} {100 * fraction:6.1f}% "
                  f"{bytes_r / 1e6:11.1f}")
        print("backward s: loss.backward(), the final wait included; all-reduce s: each bucket from "
              "its start to its completion, summed; hidden: the part of it before backward ended; "
              "waited: the final callback's wait after backward")
    ddp.close()
    return 0
