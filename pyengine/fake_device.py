"""The ``fake`` device type: numpy arrays on ``fake:N``, with streams that
behave like a GPU's, so that device routing and stream synchronization are
tested on machines without a GPU.

A :class:`FakeArray` holds a numpy buffer and the device it lives on. Its
operators, like cupy's, refuse operands from another device and *launch*
their work on the current stream of their device instead of running it. A
:class:`FakeStream` runs launched work at once (``eager``, the default) or
keeps it pending (``delayed``, see :func:`set_delayed`) until someone waits:
an event wait runs the recorded stream's work up to the event, and a host
read (``numpy()``) or ``synchronize()`` runs the reading stream's own work.
In delayed mode a result not yet computed holds NaN. So, in delayed mode, a consumer whose
stream forgot to wait on its producer's event reads NaN: a missing sync is a
wrong result, as on a GPU, and not a silent pass.

Every ``record`` and ``wait`` is appended to :data:`RUNTIME.log` as
``("record", stream, position)`` or ``("wait", stream, event)``; past
twice :data:`LOG_LENGTH` entries the log drops all but the latest
``LOG_LENGTH``, so that a long run on fake devices does not grow without
bound (a list, trimmed in place, so that a reader iterating it while a
device thread appends sees no error). Devices,
streams and the log are guarded by one lock; launched work runs outside it,
on whichever thread waits for it, yet in launch order and one item of a
stream at a time, and a wait returns only once that work finished (See Note
[A fake stream runs its work in order, one item at a time]).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from . import backends, streams
from ._shared.weak_members import WeakMembers
from .device import CPU, Device

__all__ = ["FakeArray", "FakeStream", "FakeEvent", "FakeRuntime", "LOG_LENGTH", "RUNTIME", "device",
           "launch", "set_delayed", "to_fake"]

# How many records and waits RUNTIME.log keeps at least: the latest.
LOG_LENGTH = 10_000
# How long a thread that waits for another's item of a stream sleeps between
# looks (See Note [An interrupt in a fake stream's wait]): a few times a
# Python node's run, so that the waiter costs the runner little.
WAIT_POLL_S = 50e-6


def device(index: int) -> Device:
    return Device("fake", index)


class FakeStream:
    """An ordered queue of work on one fake device.

    See Note [A fake stream runs its work in order, one item at a time]."""

    def __init__(self, device: Device, name: str):
        self.device = device
        self.name = name
        # Guarded by RUNTIME.lock: work launched and not yet started, how many
        # items were launched, how many finished, and whether one is running.
        self._pending: list = []
        self._launched = 0
        self._done = 0
        self._running = False
        with RUNTIME.streams_lock:
            RUNTIME.streams.add(self)

    def launch(self, work) -> None:
        with RUNTIME.lock:
            # The new count first: a MemoryError in making it, or in the
            # append, leaves the stream as it was, not an item that its
            # count misses, which no wait ran and a reader found unwritten.
            position = self._launched + 1
            # An in-place add, not an append call: Ctrl-C comes out at a
            # call's end, and there it left an item its count missed, which
            # the next launch's wait took for its own (its reader found its
            # buffer unwritten).
            self._pending += [work]
            self._launched = position
            delayed = RUNTIME.delayed
        if not delayed:
            self._run_until(position)

    # Note [A fake stream runs its work in order, one item at a time]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Any thread that waits on a stream (an event wait, synchronize, a host
    # read, an eager launch) runs the stream's pending work itself, outside
    # the lock. As on a GPU, the items of one stream must still run in launch
    # order, one at a time, and a wait must return only once the items before
    # its position have *finished*. So an item counts as done only after it
    # ran, and while one thread runs an item of a stream, another thread that
    # needs that stream's work waits for it to finish (See Note [An
    # interrupt in a fake stream's wait]) instead of starting the next item:
    # otherwise it could read a result still being written, or
    # run item n+1 beside item n.

    # Note [An interrupt in a fake stream's wait]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Ctrl-C raises KeyboardInterrupt between two bytecodes of the main
    # thread, in any Python frame, and threading.Condition is Python code
    # around its lock: an interrupt in its __enter__ after the acquire, or
    # in its __exit__ before the release, left RUNTIME.lock held and every
    # device thread waiting for it (the interrupt fuzz's dense-Ctrl-C runs
    # hung there); one in its wait() between the release and the re-acquire
    # made the with statement release the lock that another thread held. So
    # no Python frame runs while RUNTIME.lock is held here: each ``with
    # lock`` body is attribute and list operations (the acquire and release
    # are single C calls), and a thread that waits for another's item
    # sleeps for WAIT_POLL_S between looks instead of waiting on a
    # condition, as a GPU's stream synchronize may spin. The try begins
    # before an item is claimed, so that whatever raises once ``_running``
    # is set clears it, or every later wait on the stream would wait for an
    # item nobody runs (the one write of the stream's state that the lock
    # does not guard: See the finally below). An interrupt can still land between the claim and
    # the item's run: that item is then lost, as a kernel whose launch was
    # interrupted, but nothing waits for it.

    def _run_until(self, position: int) -> None:
        lock = RUNTIME.lock
        while True:
            claimed = False
            try:
                with lock:
                    if self._done >= position:
                        return
                    if not self._running:
                        if not self._pending:
                            return
                        work = self._pending.pop(0)
                        self._running = claimed = True
                if claimed:
                    work()
                else:
                    time.sleep(WAIT_POLL_S)  # another thread runs this stream's item
            finally:
                if claimed:
                    # _running is cleared first, and without the lock (one
                    # store, atomic under the GIL; a waiter that then claims
                    # the next item does so after this one ran): a with
                    # statement's start allocates (the lock's bound
                    # __enter__ and __exit__), and a MemoryError there left
                    # the item running for good, every later wait on the
                    # stream polling. A with statement still, not acquire()
                    # and try: Ctrl-C can land between those two, the lock
                    # then held for good, but not inside the with statement's
                    # start. Where the count's new int cannot be made, or
                    # the with statement cannot start, the count stays one
                    # short: a later wait then runs an item early, in order.
                    self._running = False
                    with lock:
                        self._done += 1

    def synchronize(self) -> None:
        with RUNTIME.lock:
            position = self._launched
        self._run_until(position)

    def __repr__(self):
        return f"FakeStream({self.device}, {self.name!r})"


class FakeEvent:
    """A position in a stream's work: waiting on it runs the work before it."""

    __slots__ = ("stream", "position")

    def __init__(self, stream: FakeStream, position: int):
        self.stream = stream
        self.position = position

    def __repr__(self):
        return f"FakeEvent({self.stream!r}, {self.position})"


class _CurrentStreams(threading.local):
    def __init__(self):
        self.by_device = {}


class FakeRuntime(streams.DeviceRuntime):
    """Streams and events of the fake devices."""

    def __init__(self):
        self.lock = threading.Lock()
        # Every stream made, so that a fork can clear a running flag: added to
        # under a lock of its own (FakeStream may be made under ``lock``),
        # read only in a forked child, by its only thread. Held weakly with
        # no callback: See Note [No weak reference callback on an engine
        # path] in pyengine/_shared/weak_members.py.
        self.streams = WeakMembers()
        self.streams_lock = threading.Lock()
        self.delayed = False
        self.log: list = []
        self._default_streams: dict[Device, FakeStream] = {}
        self._current = _CurrentStreams()

    def default_stream(self, device: Device) -> FakeStream:
        with self.lock:
            stream = self._default_streams.get(device)
            if stream is None:
                stream = self._default_streams[device] = FakeStream(device, "default")
        return stream

    def current_stream(self, device):
        stream = self._current.by_device.get(device)
        return stream if stream is not None else self.default_stream(device)

    def set_current_stream(self, stream):
        previous = self.current_stream(stream.device)
        self._current.by_device[stream.device] = stream
        return previous

    def record_event(self, stream):
        with self.lock:
            event = FakeEvent(stream, stream._launched)
            self._append_to_log(("record", stream, event.position))
        return event

    def wait_event(self, stream, event):
        with self.lock:
            self._append_to_log(("wait", stream, event))
        event.stream._run_until(event.position)

    def _append_to_log(self, entry):
        """Under the lock."""
        self.log.append(entry)
        if len(self.log) > 2 * LOG_LENGTH:
            del self.log[:-LOG_LENGTH]

    def known_devices(self):
        with self.lock:
            return list(self._default_streams)

    def _reset_after_fork(self):
        # A device worker of the parent may have held the lock at the fork.
        # See Note [Locks after fork] in pyengine/node.py.
        self.lock = threading.Lock()
        self.streams_lock = threading.Lock()
        # The thread that ran an item is gone in the child: that item counts as
        # done (as a kernel in flight at the fork has run, or never will).
        for stream in list(self.streams):
            if stream._running:
                stream._running = False
                stream._done += 1


RUNTIME = FakeRuntime()
streams.register_device_runtime("fake", RUNTIME)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=RUNTIME._reset_after_fork)


class set_delayed:
    """Keep launched work pending until waited for (a context manager; also
    takes effect at once when called)."""

    def __init__(self, delayed: bool = True):
        self._previous = RUNTIME.delayed
        RUNTIME.delayed = delayed

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        RUNTIME.delayed = self._previous
        return False


def launch(device: Device, shape, dtype, compute) -> FakeArray:
    """A new array on ``device`` whose buffer ``compute(out)`` fills, later,
    on the current stream."""
    buffer = np.empty(shape, dtype=dtype)
    if RUNTIME.delayed:
        # Until the work lands, a reader sees NaN (poisoning costs a pass over
        # the memory with the GIL held, so eager mode skips it).
        buffer.fill(np.nan)
    out = FakeArray(buffer, device)
    RUNTIME.current_stream(device).launch(lambda: compute(out._buffer))
    return out


def _operand(value, device: Device):
    if isinstance(value, FakeArray):
        if value.device != device:
            raise ValueError(f"operands are on different devices: {device} and {value.device}")
        return value
    if isinstance(value, np.ndarray) and value.ndim > 0:
        raise ValueError(f"a numpy array of shape {value.shape} is on the cpu, not on {device}; "
                         "move it with to_fake")
    return value  # a Python or 0-d scalar, as cupy allows


def _buffer_of(value):
    return value._buffer if isinstance(value, FakeArray) else value


class FakeArray:
    """A numpy array on a fake device. Read it on the host with ``numpy()``."""

    __slots__ = ("_buffer", "device", "__weakref__")

    __array_priority__ = 1000  # numpy defers mixed operators to FakeArray

    def __init__(self, buffer: np.ndarray, device: Device):
        self._buffer = buffer
        self.device = device

    @property
    def shape(self):
        return self._buffer.shape

    @property
    def dtype(self):
        return self._buffer.dtype

    @property
    def ndim(self):
        return self._buffer.ndim

    def numpy(self) -> np.ndarray:
        """A host copy; runs the current stream's pending work first, as a
        device-to-host copy on that stream would."""
        RUNTIME.current_stream(self.device).synchronize()
        return self._buffer.copy()

    def _binary(self, other, ufunc, reverse=False):
        other = _operand(other, self.device)
        a, b = (other, self) if reverse else (self, other)
        shape = np.broadcast_shapes(np.shape(_buffer_of(a)), np.shape(_buffer_of(b)))
        dtype = np.result_type(_buffer_of(a), _buffer_of(b))
        return launch(self.device, shape, dtype,
                       lambda out: ufunc(_buffer_of(a), _buffer_of(b), out=out))

    def __add__(self, other):
        return self._binary(other, np.add)

    def __radd__(self, other):
        return self._binary(other, np.add, reverse=True)

    def __sub__(self, other):
        return self._binary(other, np.subtract)

    def __rsub__(self, other):
        return self._binary(other, np.subtract, reverse=True)

    def __mul__(self, other):
        return self._binary(other, np.multiply)

    def __rmul__(self, other):
        return self._binary(other, np.multiply, reverse=True)

    def __truediv__(self, other):
        return self._binary(other, np.true_divide)

    def __neg__(self):
        return launch(self.device, self.shape, self.dtype,
                       lambda out: np.negative(self._buffer, out=out))

    def __iadd__(self, other):
        other = _operand(other, self.device)
        RUNTIME.current_stream(self.device).launch(
            lambda: np.add(self._buffer, _buffer_of(other), out=self._buffer))
        return self

    def __matmul__(self, other):
        other = _operand(other, self.device)
        shape = np.matmul(np.empty(self.shape[-2:] if self.ndim > 1 else self.shape, self.dtype),
                          np.empty(other.shape[-2:] if other.ndim > 1 else other.shape,
                                   other.dtype)).shape
        dtype = np.result_type(self.dtype, other.dtype)
        return launch(self.device, shape, dtype,
                       lambda out: np.matmul(self._buffer, other._buffer, out=out))

    def sum(self, axis=None, keepdims=False):
        shape = np.sum(np.empty(self.shape, dtype=np.bool_), axis=axis, keepdims=keepdims).shape
        return launch(self.device, shape, self.dtype,
                       lambda out: np.sum(self._buffer, axis=axis, keepdims=keepdims, out=out))

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        # A view, as in numpy: it sees the buffer whenever the work lands.
        return FakeArray(self._buffer.reshape(shape), self.device)

    def astype(self, dtype):
        return launch(self.device, self.shape, dtype,
                       lambda out: np.copyto(out, self._buffer, casting="unsafe"))

    def copy(self):
        return self.astype(self.dtype)

    def __repr__(self):
        return f"FakeArray(shape={self.shape}, dtype={self.dtype}, device={self.device})"


def to_fake(value, device: Device) -> FakeArray:
    """``value`` (a numpy array, scalar or FakeArray) copied onto ``device``,
    on the current stream of the destination, after the work queued on the
    source device's current stream (a FakeArray from another device)."""
    if isinstance(value, FakeArray):
        source = value
        if source.device != device:
            # As torch's copy_ between two GPUs: the copy is ordered after the
            # work queued so far on the source device's current stream, where
            # the source was written. The engine relies on it: See Note [Which
            # stream waits where a gradient enters a buffer], case (3).
            destination_stream = RUNTIME.current_stream(device)
            RUNTIME.wait_event(destination_stream,
                               RUNTIME.record_event(RUNTIME.current_stream(source.device)))
        return launch(device, source.shape, source.dtype,
                       lambda out: np.copyto(out, source._buffer))
    array = np.array(value)
    return launch(device, array.shape, array.dtype, lambda out: np.copyto(out, array))


class FakeBackend(backends.ArrayBackend):
    """The value backend of FakeArray."""

    name = "fake"

    def shape(self, value):
        return value.shape

    def dtype(self, value):
        return value.dtype

    def device(self, value):
        return value.device

    def dtype_kind(self, dtype):
        return np.dtype(dtype).kind

    def add(self, a, b):
        return a + b

    def add_(self, a, b):
        a += b
        return a

    def sum_to(self, value, shape):
        axes = backends.sum_to_shape_axes(value.shape, shape)
        if axes:
            value = value.sum(axis=axes, keepdims=True)
        return value.reshape(shape)

    def cast(self, value, dtype):
        return value.astype(dtype)

    def copy(self, value):
        return value.copy()

    def to_device(self, value, device):
        if device == CPU:
            return value.numpy()
        return to_fake(value, device)

    def zeros(self, shape, dtype, device):
        return FakeArray(np.zeros(shape, dtype=dtype), device)

    def ones_like(self, value):
        return FakeArray(np.ones(value.shape, dtype=value.dtype), value.device)

    def has_nan(self, value):
        return bool(np.isnan(value.numpy()).any())


backends.register_backend(FakeArray, FakeBackend())
backends.register_device_type("fake", to_fake)
