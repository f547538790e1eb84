"""The value backend for ``dezero.Variable``, and arithmetic on gradients.

What this module owns:

- :class:`VariableBackend`: what the engine may do with a gradient that is a
  DeZero Variable, registered for ``dezero.Variable`` on import. Gradients
  stay Variables (as in DeZero), so ``create_graph=True`` records DeZero
  graphs that can be differentiated again.
- The differentiable Functions it records under ``create_graph``:
  ``_Copy``, ``_Cast``, ``_ToDevice``.
- DeZero's arithmetic on gradients, shared with the nodes: ``_add`` (as
  ``x.grad + gx``) and ``_ones_like`` (DeZero's seed).
"""

from __future__ import annotations

import dezero.cuda as _dezero_cuda
import dezero.functions as _dezero_functions
import numpy as np
from dezero.core import Config, Function, Variable

import pyengine

from ... import _core
from ...device import CPU, Device
from ...indexed import IndexedGradient


def _add(a, b):
    """``a + b`` as DeZero's ``x.grad + gx``: recorded when grad mode is on
    (``create_graph``), else computed without making a Function. An
    IndexedGradient (a row lookup's, never under ``create_graph``) makes a
    dense sum, out of place as DeZero adds."""
    if type(b) is IndexedGradient:
        return Variable(_data(a) + b)
    if type(a) is IndexedGradient:
        return Variable(a + _data(b))
    if _core.is_grad_enabled():
        previous = Config.enable_backprop
        Config.enable_backprop = True
        try:
            return a + b
        finally:
            Config.enable_backprop = previous
    if isinstance(a, Variable) and isinstance(b, Variable):
        # What DeZero's Add computes when not recording: the same numpy or
        # cupy addition, wrapped as Function.__call__ wraps an output.
        total = a.data + b.data
        if type(total) is not np.ndarray and np.isscalar(total):
            total = np.array(total)
        return Variable(total)
    previous = Config.enable_backprop
    Config.enable_backprop = False
    try:
        return a + b
    finally:
        Config.enable_backprop = previous


def _array_module(data):
    return _dezero_cuda.get_array_module(data)


def _ones_like(variable):
    """DeZero's seed for ``variable``: ``Variable(xp.ones_like(variable.data))``."""
    return Variable(_array_module(variable.data).ones_like(variable.data))


class _Copy(Function):
    """A differentiable copy (the backend's ``copy`` under create_graph)."""

    def forward(self, x):
        return x.copy()

    def backward(self, gy):
        return gy


class _Cast(Function):
    """A differentiable dtype cast (the backend's ``cast`` under create_graph)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def forward(self, x):
        self.input_dtype = x.dtype
        return x.astype(self.dtype)

    def backward(self, gy):
        return _Cast(self.input_dtype)(gy)


class _ToDevice(Function):
    """A differentiable move between the CPU and a cupy device."""

    def __init__(self, device):
        self.device = device

    def forward(self, x):
        self.input_device = _device_of(x)
        return _move(x, self.device)

    def backward(self, gy):
        return _ToDevice(self.input_device)(gy)


def _device_of(data):
    if isinstance(data, (np.ndarray, np.generic)):
        return CPU
    return Device("cuda", data.device.id)


def _move(data, device):
    if device == CPU:
        return _dezero_cuda.as_numpy(data)
    if device.type != "cuda":
        raise ValueError(f"DeZero arrays live on the cpu or on cuda devices, not on {device}")
    import cupy

    with cupy.cuda.Device(device.index):
        return cupy.asarray(data)


def _under_grad_mode(function, *args):
    """``function(*args)`` with DeZero recording exactly when grad mode is on."""
    previous = Config.enable_backprop
    Config.enable_backprop = _core.is_grad_enabled()
    try:
        return function(*args)
    finally:
        Config.enable_backprop = previous


class VariableBackend(pyengine.ArrayBackend):
    """What the engine may do with a gradient that is a DeZero Variable:
    DeZero's own operations, recorded exactly when grad mode is on (under
    ``create_graph``), so that the engine's sums are part of the graph."""

    name = "dezero"

    def shape(self, value):
        return value.data.shape

    def dtype(self, value):
        return value.data.dtype

    def device(self, value):
        return _device_of(value.data)

    def dtype_kind(self, dtype):
        return np.dtype(dtype).kind

    def add(self, a, b):
        return _add(a, b)

    def add_(self, a, b):
        # Only for a value the engine made itself (InputBuffer ownership),
        # never under create_graph; in place only where numpy or cupy would
        # give the out-of-place sum's dtype and shape.
        a_data, b_data = a.data, _data(b)
        if type(b_data) is IndexedGradient:
            if (getattr(a_data, "flags", None) is not None and a_data.flags.writeable
                    and b_data.shape == a_data.shape and b_data.dtype == a_data.dtype):
                b_data.add_to_(a_data)
                return a
            return _add(a, b)
        if (type(a_data) is type(b_data) and a_data.shape == b_data.shape
                and a_data.dtype == b_data.dtype and getattr(a_data, "flags", None) is not None
                and a_data.flags.writeable):
            a_data += b_data
            return a
        return _add(a, b)

    def sum_to(self, value, shape):
        return _under_grad_mode(_dezero_functions.sum_to, value, tuple(shape))

    def cast(self, value, dtype):
        if _core.is_grad_enabled():
            return _under_grad_mode(_Cast(dtype), value)
        return Variable(value.data.astype(dtype))

    def copy(self, value):
        if _core.is_grad_enabled():
            return _under_grad_mode(_Copy(), value)
        return Variable(value.data.copy())

    def to_device(self, value, device):
        if _device_of(value.data) == device:
            return value
        if _core.is_grad_enabled():
            return _under_grad_mode(_ToDevice(device), value)
        return Variable(_move(value.data, device))

    def zeros(self, shape, dtype, device):
        zeros = np.zeros(shape, dtype=dtype)
        return Variable(zeros if device == CPU else _move(zeros, device))

    def ones_like(self, value):
        return _ones_like(value)

    def has_nan(self, value):
        return bool(_array_module(value.data).isnan(value.data).any())


def _data(value):
    return value.data if isinstance(value, Variable) else value


pyengine.register_backend(Variable, VariableBackend())
