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
forward ran there) and its ``apply`` runs with that stream current. The root
gradients were written on the caller's current streams: the root node's
stream waits on those (a GraphRoot takes the caller's stream as its own). When a
producer's gradient enters a consumer's InputBuffer and the two nodes run on
different streams, the consumer's stream first waits on an event recorded on
the producer's stream, so that the consumer never reads a gradient before it
is written. Nodes without outputs (AccumulateGrad) and captured gradients
(``grad``) mark their streams as leaf streams; when the graph task completes,
each current stream the caller had when it called backward waits on every
leaf stream of its device, and only then do final callbacks run. So
``.grad`` is safe to use on the caller's stream without a manual sync.
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
    ``producer_stream`` (nothing when they are the same stream)."""
    if consumer_stream is None or producer_stream is None or consumer_stream == producer_stream:
        return
    producer_runtime = _runtimes[producer_stream.device.type]
    event = producer_runtime.record_event(producer_stream)
    _runtimes[consumer_stream.device.type].wait_event(consumer_stream, event)


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
