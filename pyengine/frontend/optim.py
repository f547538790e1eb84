"""Optimizers, as ``torch.optim`` computes them: ``SGD`` (momentum,
dampening, Nesterov, weight decay) and ``Adam`` (bias-corrected, weight
decay added to the gradient, no amsgrad).

``step()`` updates each parameter that has a ``.grad`` in place, with grad
mode off, and bumps its version counter as PyTorch's in-place update does:
a graph that saved a parameter before the step refuses to run backward
after it. ``zero_grad()`` sets the gradients to None by default.
"""

from __future__ import annotations

import pyengine

from .tensor import _zero_grad, array_module

__all__ = ["Optimizer", "SGD", "Adam"]


class Optimizer:
    """Holds the parameters (a list, in order) and their per-parameter state."""

    def __init__(self, params, defaults):
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        self.defaults = defaults
        self.state = [dict() for _ in self.params]

    def zero_grad(self, set_to_none=True):
        """Clear every parameter's ``.grad``: set it to None, or detach it and
        zero it in place, as torch does (see ``tensor._zero_grad``)."""
        for parameter in self.params:
            _zero_grad(parameter, set_to_none)

    def step(self):
        with pyengine.no_grad():
            for parameter, state in zip(self.params, self.state):
                grad = parameter.grad
                if grad is None:
                    continue
                # An indexed .grad (embedding(sparse=True)): dense for the
                # update formulas, which read every row.
                grad = grad.to_dense() if isinstance(grad, pyengine.IndexedGradient) else grad.data
                self._update(parameter.data, grad, state)
                parameter._bump_version()

    def _update(self, data, grad, state):
        raise NotImplementedError


class SGD(Optimizer):
    """``p -= lr * d`` where ``d`` is the gradient (plus ``weight_decay * p``),
    through a momentum buffer when ``momentum`` is set."""

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov

    def _update(self, data, grad, state):
        if self.weight_decay:
            grad = grad + self.weight_decay * data
        if self.momentum:
            buffer = state.get("momentum_buffer")
            if buffer is None:
                buffer = state["momentum_buffer"] = grad.copy()
            else:
                buffer *= self.momentum
                buffer += (1 - self.dampening) * grad
            grad = grad + self.momentum * buffer if self.nesterov else buffer
        data -= self.lr * grad


class Adam(Optimizer):
    """Adam with PyTorch's arithmetic (``torch.optim.Adam``, no amsgrad)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay

    def _update(self, data, grad, state):
        xp = array_module(data)
        beta1, beta2 = self.betas
        if self.weight_decay:
            grad = grad + self.weight_decay * data
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
        step_size = self.lr / bias_correction1
        denominator = xp.sqrt(exp_avg_sq) / (bias_correction2 ** 0.5) + self.eps
        data -= step_size * exp_avg / denominator
