"""How a bucket's buffer reaches MPI: directly, or staged through host memory.

One switch, ``transport=`` of :class:`~pyengine.distributed.DataParallel`,
picks it for every bucket:

- ``"auto"`` (default): numpy buffers go to MPI as they are; cupy buffers
  are staged through host memory (a copy to a numpy buffer before the
  all-reduce, and back after), which works with every MPI.
- ``"host"``: every buffer is staged through a separate host buffer, numpy
  ones too. It is ``"auto"``'s cupy path run on numpy, so that the tests
  exercise the staging code on machines without a GPU.
- ``"cuda-aware"``: cupy buffers go to MPI as they are (mpi4py passes their
  ``__cuda_array_interface__``); the MPI must be built CUDA-aware (Open MPI
  with UCX or smcuda, MVAPICH2-GDR, ...), or it reads device pointers as
  host memory. The current stream is synchronized first, so that MPI reads
  finished gradients.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TRANSPORTS", "Staging", "make_staging"]

TRANSPORTS = ("auto", "host", "cuda-aware")


def _is_numpy(array):
    return isinstance(array, np.ndarray)


def _synchronize(array):
    """Wait for the work queued on ``array``'s device (cupy), so MPI reads finished values."""
    import cupy

    with array.device:
        cupy.cuda.get_current_stream().synchronize()


class Staging:
    """The transport of one buffer (a contiguous 1-D array): what MPI is
    handed, and the copies around it. ``staged`` is True where a host copy
    sits between the buffer and MPI."""

    def __init__(self, buffer, staged):
        self.buffer = buffer
        self.staged = staged
        self.host = np.empty(buffer.shape, buffer.dtype) if staged else None

    def outbound(self):
        """The array MPI reads and writes, with the buffer's values in it."""
        if not self.staged:
            if not _is_numpy(self.buffer):
                _synchronize(self.buffer)
            return self.buffer
        if _is_numpy(self.buffer):
            np.copyto(self.host, self.buffer)
        else:
            self.buffer.get(out=self.host)
        return self.host

    def inbound(self):
        """Copy what MPI wrote back into the buffer (a no-op when not staged)."""
        if not self.staged:
            return
        if _is_numpy(self.buffer):
            np.copyto(self.buffer, self.host)
        else:
            self.buffer.set(self.host)


def make_staging(buffer, transport):
    """The :class:`Staging` of ``buffer`` under the ``transport`` switch."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, got {transport!r}")
    if _is_numpy(buffer):
        return Staging(buffer, staged=transport == "host")
    return Staging(buffer, staged=transport != "cuda-aware")
