"""Optimizers, as ``torch.optim`` computes them: ``SGD`` (momentum,
dampening, Nesterov, weight decay) and ``Adam`` (bias-corrected, weight
decay added to the gradient, no amsgrad).

As in torch, an optimizer holds ``param_groups`` (a list of dicts, each
with its ``"params"`` and its own hyperparameters, filled in from
``defaults``) and ``state``, a dict keyed by parameter. The constructor
checks what torch checks, with torch's messages: a single Tensor for
``params`` (TypeError), an empty list, a non-Tensor or a non-leaf in the
list, a parameter in two groups (ValueError), and each hyperparameter's
range ("Invalid learning rate: -1", "Invalid beta parameter at index 0:
1.0", ...). A parameter listed twice in one group warns, as torch does, and
is then updated twice per step through one state (one momentum buffer per
parameter): torch 2.13 neither dedups the list nor refuses it.

``step()`` updates each parameter that has a ``.grad`` in place, with grad
mode off, and bumps its version counter as PyTorch's in-place update does:
a graph that saved a parameter before the step refuses to run backward
after it. ``zero_grad()`` sets the gradients to None by default.
"""

from __future__ import annotations

import warnings

import pyengine

from .tensor import Tensor, _zero_grad, array_module

__all__ = ["Optimizer", "SGD", "Adam"]


def _typename(value) -> str:
    """``torch.typename``'s spelling: a Tensor's class, or module.class."""
    kind = type(value)
    if isinstance(value, Tensor) or kind.__module__ == "builtins":
        return kind.__name__
    return f"{kind.__module__}.{kind.__qualname__}"


class Optimizer:
    """Holds ``param_groups`` and the per-parameter ``state``, as
    ``torch.optim.Optimizer`` does; subclasses define ``_step_group``."""

    def __init__(self, params, defaults):
        if isinstance(params, Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            f"Tensors or dicts, but got {_typename(params)}")
        self.defaults = defaults
        self.state = {}  # parameter -> its state dict (Tensor hashes by identity)
        self.param_groups = []
        param_groups = list(params)
        if not param_groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(param_groups[0], dict):
            param_groups = [{"params": param_groups}]
        for param_group in param_groups:
            self.add_param_group(param_group)

    def add_param_group(self, param_group):
        """Add a group (a dict with ``"params"`` and optional hyperparameters)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        param_group = dict(param_group)
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but "
                            "the ordering of tensors in sets will change between runs. Please use "
                            "a list instead.")
        params = param_group["params"] = list(params)
        for param in params:
            if not isinstance(param, Tensor):
                raise TypeError("optimizer can only optimize Tensors, but one of the params is "
                                f"{_typename(param)}")
            if not (param.is_leaf or param.retains_grad):
                raise ValueError("can't optimize a non-leaf Tensor")
        for name, default in self.defaults.items():
            param_group.setdefault(name, default)
        ids = {id(param) for param in params}
        if len(ids) != len(params):
            warnings.warn("optimizer contains a parameter group with duplicate parameters; in "
                          "future, this will cause an error; see "
                          "github.com/pytorch/pytorch/issues/40967 for more information",
                          stacklevel=3)
        for group in self.param_groups:
            if any(id(param) in ids for param in group["params"]):
                raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append(param_group)

    @property
    def params(self):
        """Every parameter of every group, in order (a parameter listed twice twice)."""
        return [param for group in self.param_groups for param in group["params"]]

    def zero_grad(self, set_to_none=True):
        """Clear every parameter's ``.grad``: set it to None, or detach it and
        zero it in place, as torch does (see ``tensor._zero_grad``)."""
        for group in self.param_groups:
            for parameter in group["params"]:
                _zero_grad(parameter, set_to_none)

    def step(self):
        with pyengine.no_grad():
            for group in self.param_groups:
                params, grads = [], []
                for parameter in group["params"]:
                    grad = parameter.grad
                    if grad is None:
                        continue
                    # An indexed .grad (embedding(sparse=True)): dense for the
                    # update formulas, which read every row.
                    params.append(parameter)
                    grads.append(grad.to_dense() if isinstance(grad, pyengine.IndexedGradient)
                                 else grad.data)
                if params:
                    self._step_group(group, params, grads)

    def _step_group(self, group, params, grads):
        """Update ``params`` (those of ``group`` with a ``.grad``) in place."""
        raise NotImplementedError


def _check_nonnegative(value, what):
    if value < 0.0:
        raise ValueError(f"Invalid {what}: {value}")


class SGD(Optimizer):
    """``p -= lr * d`` where ``d`` is the gradient (plus ``weight_decay * p``),
    through a momentum buffer when ``momentum`` is set."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False):
        _check_nonnegative(lr, "learning rate")
        _check_nonnegative(momentum, "momentum value")
        _check_nonnegative(weight_decay, "weight_decay value")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _step_group(self, group, params, grads):
        lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
        weight_decay, nesterov = group["weight_decay"], group["nesterov"]
        # The momentum buffers are read for the whole group first and stored
        # back after it, as torch's _single_tensor_sgd does: a parameter listed
        # twice starts two buffers on its first step and keeps the last.
        buffers = [self.state.get(p, {}).get("momentum_buffer") for p in params] if momentum \
            else None
        for i, (parameter, grad) in enumerate(zip(params, grads)):
            data = parameter.data
            if weight_decay:
                grad = grad + weight_decay * data
            if momentum:
                buffer = buffers[i]
                if buffer is None:
                    buffer = buffers[i] = grad.copy()
                else:
                    buffer *= momentum
                    buffer += (1 - dampening) * grad
                grad = grad + momentum * buffer if nesterov else buffer
            data -= lr * grad
            parameter._bump_version()
        if momentum:
            for parameter, buffer in zip(params, buffers):
                self.state.setdefault(parameter, {})["momentum_buffer"] = buffer


class Adam(Optimizer):
    """Adam with PyTorch's arithmetic (``torch.optim.Adam``, no amsgrad)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for index in (0, 1):
            if not 0.0 <= betas[index] < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {betas[index]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _step_group(self, group, params, grads):
        lr, (beta1, beta2) = group["lr"], group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        for parameter, grad in zip(params, grads):
            data = parameter.data
            xp = array_module(data)
            if weight_decay:
                grad = grad + weight_decay * data
            # Keyed by parameter: a parameter listed twice shares one state
            # and advances it twice per step, as in torch.
            state = self.state.setdefault(parameter, {})
            if not state:
                state["step"] = 0
                state["exp_avg"] = xp.zeros_like(data)
                state["exp_avg_sq"] = xp.zeros_like(data)
            state["step"] += 1
            step = state["step"]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg += (grad - exp_avg) * (1 - beta1)
            exp_avg_sq *= beta2
            exp_avg_sq += (1 - beta2) * grad * grad
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            step_size = lr / bias_correction1
            denominator = xp.sqrt(exp_avg_sq) / (bias_correction2 ** 0.5) + eps
            data -= step_size * exp_avg / denominator
            parameter._bump_version()
