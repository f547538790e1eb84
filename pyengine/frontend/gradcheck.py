"""``gradcheck`` and ``gradgradcheck``: gradients checked against finite
differences, as ``torch.autograd.gradcheck``.

``gradcheck(fn, inputs)`` builds, for every Tensor input that requires grad
and every Tensor output, the Jacobian twice: analytically, one row per
output element with ``grad(output, inputs, grad_outputs=one-hot)``, and
numerically, one column per input element with central differences
``(f(x + eps) - f(x - eps)) / 2 eps``. They must agree within
``atol + rtol * |numerical|`` element by element. Use float64 inputs: in
float32 the differences are mostly rounding.

``gradgradcheck(fn, inputs)`` runs gradcheck on the function that maps
``(inputs, grad_outputs)`` to the first derivatives computed with
``create_graph=True``: it checks second derivatives against finite
differences of first ones. ``grad_outputs`` are random unless given.

Both raise :class:`GradcheckError` on a mismatch (or return False with
``raise_exception=False``). Unlike PyTorch's, they do not check that
backward is deterministic, and they perturb an input's array in place, so
``fn`` must not keep a reference to it between calls.
"""

from __future__ import annotations

import numpy as np

import pyengine

from .autograd import grad
from .tensor import Tensor, _as_array

__all__ = ["gradcheck", "gradgradcheck", "GradcheckError"]


class GradcheckError(RuntimeError):
    """A Jacobian computed by backward differs from finite differences."""


def _as_tuple(values):
    return tuple(values) if isinstance(values, (tuple, list)) else (values,)


def _differentiable_outputs(fn, inputs):
    return [out for out in _as_tuple(fn(*inputs)) if isinstance(out, Tensor)]


def _numerical_jacobians(fn, inputs, wrt, eps):
    """``jacobians[i][j]``: d output j / d input wrt[i], shape (input size, output size).

    ``fn`` runs in the caller's grad mode: gradgradcheck's function computes
    gradients itself."""
    outputs = _differentiable_outputs(fn, inputs)
    jacobians = []
    for i in wrt:
        data = inputs[i].data
        flat = data.reshape(-1)  # a view: data is contiguous (checked by the caller)
        columns = [np.zeros((data.size, out.data.size)) for out in outputs]
        for k in range(data.size):
            original = flat[k].item()
            flat[k] = original + eps
            plus = _flat_outputs(fn, inputs)
            flat[k] = original - eps
            minus = _flat_outputs(fn, inputs)
            flat[k] = original
            for j in range(len(outputs)):
                columns[j][k] = (plus[j] - minus[j]) / (2 * eps)
        jacobians.append(columns)
    return jacobians


def _flat_outputs(fn, inputs):
    return [_as_array(out.data).astype(np.float64).ravel() for out in _differentiable_outputs(fn, inputs)]


def _analytical_jacobians(fn, inputs, wrt):
    """Same layout as the numerical ones, from backward with one-hot gradients."""
    outputs = _differentiable_outputs(fn, inputs)
    jacobians = [[np.zeros((inputs[i].data.size, out.data.size)) for out in outputs] for i in wrt]
    targets = [inputs[i] for i in wrt]
    for j, out in enumerate(outputs):
        if not out.requires_grad:
            continue  # a constant output: its analytical rows stay zero
        for k in range(out.data.size):
            one_hot = np.zeros(out.data.size, dtype=out.dtype)
            one_hot[k] = 1
            grads = grad(out, targets, grad_outputs=one_hot.reshape(out.shape), retain_graph=True,
                         allow_unused=True)
            for i, value in enumerate(grads):
                if value is not None:
                    value = pyengine.densify(value)  # a lookup's IndexedGradient
                    value = value.data if isinstance(value, Tensor) else value
                    jacobians[i][j][:, k] = _as_array(value).astype(np.float64).ravel()
    return jacobians


def gradcheck(fn, inputs, *, eps=1e-6, atol=1e-5, rtol=1e-3, raise_exception=True) -> bool:
    """Check the gradients of ``fn`` at ``inputs``; see the module docstring."""
    inputs = _as_tuple(inputs)
    wrt = [i for i, value in enumerate(inputs) if isinstance(value, Tensor) and value.requires_grad]
    if not wrt:
        raise ValueError("gradcheck expects at least one input tensor to require gradient")
    for i in wrt:
        data = inputs[i].data
        if not data.flags.c_contiguous or not data.flags.writeable:
            raise ValueError(f"gradcheck: input {i} must be a contiguous, writeable array")
    numerical = _numerical_jacobians(fn, inputs, wrt, eps)
    analytical = _analytical_jacobians(fn, inputs, wrt)
    for position, i in enumerate(wrt):
        for j, (expected, actual) in enumerate(zip(numerical[position], analytical[position])):
            if not np.allclose(actual, expected, rtol=rtol, atol=atol):
                message = (f"Jacobian mismatch for output {j} with respect to input {i},\n"
                           f"numerical:{expected}\nanalytical:{actual}\n")
                if raise_exception:
                    raise GradcheckError(message)
                return False
    return True


def gradgradcheck(fn, inputs, grad_outputs=None, *, eps=1e-6, atol=1e-5, rtol=1e-3,
                  raise_exception=True, seed=0) -> bool:
    """Check the second derivatives of ``fn`` at ``inputs``; see the module docstring."""
    inputs = _as_tuple(inputs)
    wrt = [i for i, value in enumerate(inputs) if isinstance(value, Tensor) and value.requires_grad]
    if grad_outputs is None:
        rng = np.random.default_rng(seed)
        outputs = _differentiable_outputs(fn, inputs)
        grad_outputs = [Tensor(rng.standard_normal(out.shape).astype(out.dtype), requires_grad=True)
                        for out in outputs if out.requires_grad]
    grad_outputs = tuple(_as_tuple(grad_outputs))
    count = len(inputs)

    def first_derivatives(*values):
        xs, gs = values[:count], values[count:]
        outputs = [out for out in _differentiable_outputs(fn, xs) if out.requires_grad]
        grads = grad(outputs, [xs[i] for i in wrt], grad_outputs=list(gs), create_graph=True,
                     allow_unused=True)
        return tuple(value for value in grads if value is not None)

    return gradcheck(first_derivatives, inputs + grad_outputs, eps=eps, atol=atol, rtol=rtol,
                     raise_exception=raise_exception)
