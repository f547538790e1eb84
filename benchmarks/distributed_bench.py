"""How much of the gradient all-reduce pyengine.distributed hides behind
backward, and the time per training step at 1, 2 and 4 ranks.

    python benchmarks/distributed_bench.py            # launches mpirun for 1, 2 and 4 ranks
    python benchmarks/distributed_bench.py --ranks 4  # one size
    mpirun -n 4 python benchmarks/distributed_bench.py --worker   # what each launch runs

The model: an MLP of ``--layers`` float64 ``--width`` x ``--width`` layers
(tanh), a global batch of ``--batch`` rows split evenly across the ranks
(strong scaling: the same work per step at every size), mean squared error,
SGD. With 256 KiB buckets each 256 x 256 weight (512 KiB) is a bucket of its
own: 10 buckets.

Per rank size, two runs of ``--steps`` steps after ``--warmup``:

- ``overlap=False``: every bucket starts at the end of backward; the final
  callback's wait is the whole all-reduce, exposed.
- ``overlap=True`` (the default of DataParallel): buckets start as they fill.

and, after a barrier, every bucket's all-reduce alone. Hidden fraction =
(median wait without overlap - median wait with overlap) / (all-reduce
alone), clipped to [0, 1]: both waits hold the skew between ranks (waiting
for the slowest rank's backward), which no overlap can hide, so their
difference is the all-reduce time that overlap moved behind backward. The in-run estimate of
``StepStats.hidden_fraction`` is printed beside it. Figures are medians
over steps, and over ranks the maximum (the slowest rank sets the pace).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="run as one rank (under mpirun)")
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256, help="global batch, split across ranks")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-bytes", type=int, default=256 * 1024,
                        help="bucket_cap_bytes (default 256 KiB: one bucket per 256 x 256 layer)")
    return parser.parse_args(argv)


def worker(args):
    from mpi4py import MPI

    import pyengine
    from pyengine.distributed import DataParallel
    from pyengine.frontend import Tensor, nn, optim

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(0)
    model = nn.MLP([args.width] * (args.layers + 1), activation="tanh", dtype=np.float64, rng=rng)
    x = rng.normal(size=(args.batch, args.width))
    target = rng.normal(size=(args.batch, args.width))
    mine = np.array_split(np.arange(args.batch), world)[rank]
    cap = args.bucket_bytes
    results = {}
    for overlap in (False, True):
        ddp = DataParallel(model, comm, bucket_cap_bytes=cap, overlap=overlap, timeout=600)
        optimizer = optim.SGD(model.parameters(), lr=1e-4)
        step_seconds, wait_seconds, backward_seconds = [], [], []
        for step in range(args.warmup + args.steps):
            comm.Barrier()
            start = time.perf_counter()
            out = model(Tensor(x[mine]))
            loss = ((out - Tensor(target[mine])) ** 2).mean()
            optimizer.zero_grad()
            waited = ddp.stats.wait_seconds
            before = time.perf_counter()
            loss.backward()
            after = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            if step >= args.warmup:
                step_seconds.append(end - start)
                wait_seconds.append(ddp.stats.wait_seconds - waited)
                backward_seconds.append(after - before - (ddp.stats.wait_seconds - waited))
        if not overlap:
            # The all-reduce alone: every bucket's, started together after a barrier.
            buffers = [bucket.buffer.copy() for bucket in ddp.buckets]
            alone = []
            for _ in range(args.steps):
                comm.Barrier()
                before = time.perf_counter()
                MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
                                     for buffer in buffers])
                alone.append(time.perf_counter() - before)
            results["allreduce_alone"] = statistics.median(alone)
        results["overlap" if overlap else "no_overlap"] = dict(
            step=statistics.median(step_seconds), wait=statistics.median(wait_seconds),
            backward=statistics.median(backward_seconds),
            hidden_fraction_in_run=ddp.stats.hidden_fraction)
        buckets = len(ddp.buckets)
        ddp.close()
    everyone = comm.gather(results, root=0)
    if rank == 0:
        summary = {"ranks": world, "buckets": buckets, "core": pyengine.IMPLEMENTATION}
        for mode in ("overlap", "no_overlap"):
            for field in ("step", "wait", "backward"):
                summary[f"{mode}_{field}"] = max(r[mode][field] for r in everyone)
        summary["allreduce_alone"] = max(r["allreduce_alone"] for r in everyone)
        summary["hidden_fraction_in_run"] = min(r["overlap"]["hidden_fraction_in_run"] for r in everyone)
        print("RESULT " + json.dumps(summary), flush=True)


def launch(args, ranks):
    beside = Path(sys.executable).parent / "mpirun"
    mpirun = str(beside) if beside.exists() else shutil.which("mpirun")
    command = [mpirun, "--oversubscribe", "-n", str(ranks), sys.executable, __file__, "--worker",
               "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--bucket-bytes", str(args.bucket_bytes)]
    if os.geteuid() == 0:
        command.insert(1, "--allow-run-as-root")
    # One BLAS thread per rank: ranks are the parallelism (and the machine is small).
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    output = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    print(f"MLP {args.layers} x ({args.width} x {args.width}) float64, tanh; global batch {args.batch}; "
          f"{args.steps} steps after {args.warmup}; medians over steps, max over ranks")
    print("ranks buckets  step ms  step ms (no overlap)  backward ms  all-reduce alone ms  "
          "waited ms (no overlap)  waited ms (overlap)  hidden  hidden (in-run)")
    for ranks in args.ranks:
        r = launch(args, ranks)
        exposed, full, alone = r["overlap_wait"], r["no_overlap_wait"], r["allreduce_alone"]
        # Both waits include the skew between ranks (the slowest rank's
        # backward); their difference is the all-reduce time overlap took away.
        hidden = min(1.0, max(0.0, (full - exposed) / alone)) if ranks > 1 else float("nan")
        print(f"{ranks:5d} {r['buckets']:7d} {1e3 * r['overlap_step']:8.1f} "
              f"{1e3 * r['no_overlap_step']:21.1f} {1e3 * r['overlap_backward']:12.1f} "
              f"{1e3 * alone:20.1f} {1e3 * full:23.1f} {1e3 * exposed:20.1f} {100 * hidden:6.1f}% "
              f"{100 * r['hidden_fraction_in_run']:14.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
