"""A small ``nn``: ``Module``, ``Linear``, ``Sequential``, activations and
an ``MLP``, as ``torch.nn`` spells them.

A Module finds its parameters (and submodules) among its attributes, in the
order they were set, including inside lists and tuples; ``parameters()``
yields each once. ``Linear`` keeps ``weight`` as ``(out_features,
in_features)`` and initializes as PyTorch does, uniform in ``±1/sqrt(in_features)``
for both weight and bias, from the frontend's generator (``manual_seed``)
or the ``rng`` given.
"""

from __future__ import annotations

import numpy as np

from . import ops
from .tensor import Parameter, _zero_grad, default_generator

__all__ = ["Module", "Linear", "Sequential", "ReLU", "Tanh", "Sigmoid", "MLP"]


class Module:
    """Subclass and define ``forward``; call the module to run it."""

    def forward(self, *args):
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def __call__(self, *args):
        return self.forward(*args)

    def _children(self):
        stack = list(reversed(list(vars(self).items())))
        while stack:
            name, value = stack.pop()
            if isinstance(value, (list, tuple)):
                stack.extend(reversed([(f"{name}.{i}", item) for i, item in enumerate(value)]))
            elif isinstance(value, (Parameter, Module)):
                yield name, value

    def named_parameters(self, prefix=""):
        """``(name, parameter)`` pairs, each parameter once, in definition order.

        Each module is visited once, under the first name it is reached by,
        as ``torch.nn.Module.named_modules`` does with its memo set: modules
        that refer to each other (``enc.dec = dec; dec.enc = enc``) or one
        layer set twice end the walk instead of looping.
        """
        # A module is marked when it is visited, not when it is found, so
        # that a module reachable twice is named by the depth-first path
        # that reaches it first, as torch names it.
        seen = set()  # ids of the parameters yielded and the modules visited
        stack = [(prefix, self)]
        while stack:
            path, module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            children = []
            for name, value in module._children():
                full = f"{path}{name}"
                if isinstance(value, Parameter):
                    if id(value) not in seen:
                        seen.add(id(value))
                        yield full, value
                elif id(value) not in seen:
                    children.append((full + ".", value))
            stack.extend(reversed(children))

    def parameters(self):
        for _, parameter in self.named_parameters():
            yield parameter

    def zero_grad(self, set_to_none=True):
        """Clear every parameter's ``.grad``: set it to None, or detach it and
        zero it in place, as torch does (see ``tensor._zero_grad``)."""
        for parameter in self.parameters():
            _zero_grad(parameter, set_to_none)


class Linear(Module):
    """``y = x @ weight.T + bias``."""

    def __init__(self, in_features, out_features, bias=True, dtype=np.float64, device=None,
                 rng=None):
        shape = [out_features, in_features]
        for extent in shape:
            if extent < 0:
                raise RuntimeError(f"Trying to create tensor with negative dimension {extent}: "
                                   f"{shape}")
        rng = default_generator() if rng is None else rng
        # torch: no inputs (fan_in 0) gives a bound of 0, so a zero bias.
        bound = 1.0 / np.sqrt(in_features) if in_features > 0 else 0.0
        self.in_features, self.out_features = in_features, out_features
        weight = rng.uniform(-bound, bound, (out_features, in_features)).astype(dtype)
        self.weight = Parameter(_to(weight, device))
        self.bias = None
        if bias:
            self.bias = Parameter(_to(rng.uniform(-bound, bound, out_features).astype(dtype), device))

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias)

    def __repr__(self):
        return (f"Linear(in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None})")


def _to(array, device):
    if device is None:
        return array
    from .tensor import _as_array

    return _as_array(array, device=device)


class Sequential(Module):
    """Runs its modules one after another."""

    def __init__(self, *modules):
        self.modules = list(modules)

    def forward(self, x):
        for module in self.modules:
            x = module(x)
        return x

    def __getitem__(self, index):
        return self.modules[index]

    def __len__(self):
        return len(self.modules)

    def __iter__(self):
        return iter(self.modules)


class ReLU(Module):
    def forward(self, x):
        return ops.relu(x)


class Tanh(Module):
    def forward(self, x):
        return ops.tanh(x)


class Sigmoid(Module):
    def forward(self, x):
        return ops.sigmoid(x)


_ACTIVATIONS = {"relu": ReLU, "tanh": Tanh, "sigmoid": Sigmoid}


class MLP(Sequential):
    """``Linear`` layers of the given ``sizes`` with an activation between
    each two (none after the last): ``MLP([2, 64, 64, 2])``."""

    def __init__(self, sizes, activation="relu", dtype=np.float64, device=None, rng=None):
        if len(sizes) < 2:
            raise ValueError("an MLP needs at least an input and an output size")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}: expected one of "
                             f"{', '.join(repr(name) for name in _ACTIVATIONS)}")
        layers = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(Linear(fan_in, fan_out, dtype=dtype, device=device, rng=rng))
            if i < len(sizes) - 2:
                layers.append(_ACTIVATIONS[activation]())
        super().__init__(*layers)
