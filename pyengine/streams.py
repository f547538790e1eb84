"""Streams and events of non-CPU devices, behind one small interface.

The engine synchronizes work across streams the way PyTorch's does (Note
[Streaming backwards]); this module is how it reaches a device type's
streams without knowing the library behind them. A *device runtime* (one
per device type: ``cuda`` through cupy, ``fake`` for tests) answers:

- ``current_stream(device)``: the calling thread's current stream there;
- ``set_current_stream(stream)``: make ``stream`` current on its device for
  the calling thread, returning the stream it replaces;
- ``record_event(stream)`` and ``wait_event(stream, event)``;
- ``known_devices()``: the devices whose current streams a backward caller
  may have set, so that the engine can stash them.

A runtime's streams carry their ``device`` and compare equal when they are
the same stream.

Note [Streaming backwards]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A node records the current stream of its device when it is created (its
forward ran there) and its ``apply`` runs with that stream current. Each
gradient a node returns (its producer) enters the InputBuffer of the node
it flows into (its consumer) after the syncs of PyTorch's
``InputBuffer::add`` (See Note [Which stream waits where a gradient enters
a buffer]), so that nothing reads a gradient before it is written. The root
gradients were written on the caller's current streams, and stand for a
producer each: a single root's stream is the caller's current stream on
its gradient's device, and a GraphRoot (several roots) keeps one such
stream per root, so that each root node waits on the stream its own root
gradient was written on. Nodes without outputs (AccumulateGrad) and
captured gradients (``grad``) mark their streams as leaf streams; when the
graph task completes, each current stream the caller had when it called
backward waits on every leaf stream of its device, and only then do final
callbacks run. So ``.grad`` is safe to use on the caller's stream without a
manual sync.

Note [Which stream waits where a gradient enters a buffer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``accumulation_stream`` follows the five cases of PyTorch's
``InputBuffer::add`` (torch/csrc/autograd/input_buffer.cpp), with "the
producer's stream" the stream the producing node ran on (None on the CPU)
and "the consumer's stream" the stream of the node the gradient flows into:

(1) The gradient is not on a device with streams (numpy on the CPU): no
    sync; it is added with no stream made current.
(2) It is on the device of both streams: the consumer's stream waits on the
    producer's (when they differ) and the sum runs on the consumer's.
(3) It is on the consumer's device but not the producer's: the producer (a
    CPU node, or a node on another device) moved it there, and a move, as
    cupy's or ``tensor.to``, runs on the destination's *current* stream (the
    default one, unless the thread chose another). That stream, not the
    producer's, is the effective producer: the consumer's stream waits on
    it, and the sum runs on the consumer's. (PyTorch asserts that this
    current stream is the default one; here it is whatever the producing
    thread has current there, which is the default one on a device worker.)
(4) It is on the producer's device but not the consumer's: the consumer will
    read it on that device's current stream (the effective consumer), so
    that stream waits on the producer's, and the sum runs on it.
(5) It is on neither device: it was written on its device's current stream
    and the consumer syncs with that stream itself, as in (4); no sync, and
    the sum runs on that stream.

Waiting on the producer's stream in (3), as a first version did, is wrong:
the move was queued on another stream, so the consumer could read the
destination before the move lands. A value of a type no backend knows
(its device unknown) keeps the conservative rule: the consumer's stream
waits on the producer's.
"""

from __future__ import annotations

from .backends import backend_of
from .device import Device

__all__ = ["DeviceRuntime", "register_device_runtime", "runtime_for"]


class DeviceRuntime:
    """Streams and events of one device type. Subclass and override all."""

    def current_stream(self, device: Device):
        raise NotImplementedError

    def set_current_stream(self, stream):
        raise NotImplementedError

    def record_event(self, stream):
        raise NotImplementedError

    def wait_event(self, stream, event) -> None:
        raise NotImplementedError

    def known_devices(self) -> list[Device]:
        raise NotImplementedError


_runtimes: dict[str, DeviceRuntime] = {}


def register_device_runtime(device_type: str, runtime: DeviceRuntime) -> None:
    """Make ``runtime`` the streams of devices of ``device_type``."""
    if not isinstance(runtime, DeviceRuntime):
        raise TypeError(f"runtime must be a DeviceRuntime, got {type(runtime).__name__}")
    _runtimes[device_type] = runtime


def runtime_for(device: Device) -> DeviceRuntime | None:
    """The runtime of ``device``'s type, or None (the CPU has no streams)."""
    return _runtimes.get(device.type)


def value_stream(value):
    """The calling thread's current stream on ``value``'s device: where a
    gradient the caller made was written. None on the CPU."""
    backend = backend_of(value) if value is not None else None
    if backend is None:
        return None
    device = backend.device(value)
    runtime = _runtimes.get(device.type)
    return runtime.current_stream(device) if runtime is not None else None


def current_streams() -> dict:
    """The calling thread's current stream on every device a runtime knows."""
    streams = {}
    for runtime in _runtimes.values():
        for device in runtime.known_devices():
            streams[device] = runtime.current_stream(device)
    return streams


def sync_streams(consumer_stream, producer_stream) -> None:
    """Make ``consumer_stream`` wait for the work queued so far on
    ``producer_stream`` (nothing when they are the same stream, or either is
    None)."""
    if consumer_stream is None or producer_stream is None or consumer_stream == producer_stream:
        return
    producer_runtime = _runtimes[producer_stream.device.type]
    event = producer_runtime.record_event(producer_stream)
    _runtimes[consumer_stream.device.type].wait_event(consumer_stream, event)


def accumulation_stream(gradient, producer_stream, consumer_stream):
    """Before ``gradient``, made by a node that ran on ``producer_stream``,
    enters the InputBuffer of a node that runs on ``consumer_stream``: make
    the stream that will read it wait for the stream that wrote it, and
    return the stream to add it into the buffer on (None: none). See Note
    [Which stream waits where a gradient enters a buffer]."""
    if gradient is None:
        return consumer_stream
    backend = backend_of(gradient)
    if backend is None:
        sync_streams(consumer_stream, producer_stream)
        return consumer_stream
    device = backend.device(gradient)
    runtime = _runtimes.get(device.type)
    if runtime is None:
        return None  # (1)
    on_producer = producer_stream is not None and producer_stream.device == device
    on_consumer = consumer_stream is not None and consumer_stream.device == device
    if on_producer and on_consumer:
        sync_streams(consumer_stream, producer_stream)  # (2)
        return consumer_stream
    current = runtime.current_stream(device)
    if on_consumer:
        sync_streams(consumer_stream, current)  # (3)
        return consumer_stream
    if on_producer:
        sync_streams(current, producer_stream)  # (4)
    return current  # (4) and (5)


class stream_guard:
    """Makes ``stream`` current on its device for a block; None does nothing."""

    __slots__ = ("_stream", "_previous", "_runtime")

    def __init__(self, stream):
        self._stream = stream

    def __enter__(self):
        if self._stream is not None:
            self._runtime = _runtimes[self._stream.device.type]
            self._previous = self._runtime.set_current_stream(self._stream)
        return self

    def __exit__(self, *exc_info):
        if self._stream is not None:
            self._runtime.set_current_stream(self._previous)
        return False
