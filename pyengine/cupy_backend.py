"""cupy arrays as gradient values on ``cuda:N``, and cupy's streams and events.

Imported by ``pyengine`` when cupy is installed. Registers a value backend
for ``cupy.ndarray`` (which can also hold the rows of an IndexedGradient,
summed with ``cupyx.scatter_add``), lets numpy values move to ``cuda`` devices, and gives
the engine cupy's streams (see Note [Streaming backwards] in
:mod:`pyengine.streams`). A cupy stream is wrapped in :class:`CudaStream`,
which carries its device and compares equal to another wrapper of the same
stream, as the engine's stream interface expects.
"""

from __future__ import annotations

import cupy
import cupyx

from . import backends, streams
from .device import CPU, Device
from .indexed import IndexedGradient

__all__ = ["CudaStream", "CupyBackend", "CupyRuntime"]


def _device(index: int) -> Device:
    return Device("cuda", index)


class CudaStream:
    """A cupy stream and the device it belongs to. Immutable."""

    __slots__ = ("raw", "device")

    def __init__(self, raw, device: Device):
        self.raw = raw
        self.device = device

    def __eq__(self, other):
        return isinstance(other, CudaStream) and self.raw.ptr == other.raw.ptr and \
            self.device == other.device

    def __hash__(self):
        return hash((self.raw.ptr, self.device))

    def __repr__(self):
        return f"CudaStream({self.device}, ptr={self.raw.ptr:#x})"


class CupyRuntime(streams.DeviceRuntime):
    """cupy's per-thread current streams and its events."""

    def current_stream(self, device):
        with cupy.cuda.Device(device.index):
            return CudaStream(cupy.cuda.get_current_stream(), device)

    def set_current_stream(self, stream):
        previous = self.current_stream(stream.device)
        with cupy.cuda.Device(stream.device.index):
            stream.raw.use()
        return previous

    def record_event(self, stream):
        with cupy.cuda.Device(stream.device.index):
            event = cupy.cuda.Event(disable_timing=True)
            event.record(stream.raw)
        return event

    def wait_event(self, stream, event):
        with cupy.cuda.Device(stream.device.index):
            stream.raw.wait_event(event)

    def known_devices(self):
        return [_device(index) for index in range(cupy.cuda.runtime.getDeviceCount())]


class CupyBackend(backends.ArrayBackend):
    """The value backend of cupy arrays."""

    name = "cupy"

    def shape(self, value):
        return value.shape

    def dtype(self, value):
        return value.dtype

    def device(self, value):
        return _device(value.device.id)

    def dtype_kind(self, dtype):
        return cupy.dtype(dtype).kind

    def add(self, a, b):
        with a.device:
            if type(b) is IndexedGradient:
                return b.add_to_(a.astype(cupy.result_type(a.dtype, b.dtype), copy=True))
            # cupy keeps 0-d operands arrays: the sum keeps their type.
            return a + b

    def add_(self, a, b):
        with a.device:
            if type(b) is IndexedGradient:
                if cupy.can_cast(b.dtype, a.dtype, "same_kind"):
                    return b.add_to_(a)
                return self.add(a, b)
            a += b
        return a

    def sum_to(self, value, shape):
        axes = backends.sum_to_shape_axes(value.shape, shape)
        with value.device:
            if axes:
                value = value.sum(axis=axes, keepdims=True)
            return value.reshape(shape)

    def cast(self, value, dtype):
        with value.device:
            return value.astype(dtype)

    def copy(self, value):
        with value.device:
            return value.copy()

    def to_device(self, value, device):
        if device == CPU:
            return cupy.asnumpy(value)
        with cupy.cuda.Device(device.index):
            return cupy.asarray(value)

    def zeros(self, shape, dtype, device):
        with cupy.cuda.Device(device.index):
            return cupy.zeros(shape, dtype=dtype)

    def ones_like(self, value):
        with value.device:
            return cupy.ones_like(value)

    def has_nan(self, value):
        with value.device:
            return bool(cupy.isnan(value).any())

    def index_add_(self, dense, indices, values):
        with dense.device:
            cupyx.scatter_add(dense, indices, values)
        return dense

    def concatenate(self, arrays):
        with arrays[0].device:
            return cupy.concatenate(arrays)

    def unique_inverse(self, indices):
        with indices.device:
            unique, inverse = cupy.unique(indices, return_inverse=True)
            return unique, inverse.reshape(-1)

    def index_range(self, indices):
        with indices.device:
            return int(indices.min()), int(indices.max())


def _from_host(value, device):
    with cupy.cuda.Device(device.index):
        return cupy.asarray(value)


RUNTIME = CupyRuntime()
backends.register_backend(cupy.ndarray, CupyBackend())
backends.register_device_type("cuda", _from_host)
streams.register_device_runtime("cuda", RUNTIME)
