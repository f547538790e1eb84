"""A reference tensor frontend on pyengine: numpy (or cupy) tensors with
PyTorch's autograd, written to be read.

``Tensor`` carries ``requires_grad``, ``grad``, ``grad_fn``, hooks,
``backward()``, in-place ops with a version counter; each op's forward
stands beside its backward ``Node`` (``pointwise``, ``reduce``, ``shape``,
``linalg``, ``loss``); ``Function`` is ``torch.autograd.Function``;
``checkpoint``, ``gradcheck`` / ``gradgradcheck``, ``nn`` and ``optim``
complete it. ``python -m pyengine demo`` trains an MLP with it.

The frontend imports the engine; the engine never imports the frontend.
What it chose where PyTorch and numpy differ is in ``tensor``'s docstring.
"""

# tensor first: the op modules import Tensor from it.
from .tensor import (  # isort: skip
    Parameter,
    Tensor,
    arange,
    as_tensor,
    from_numpy,
    full,
    is_tensor,
    manual_seed,
    ones,
    ones_like,
    rand,
    randn,
    tensor,
    zeros,
    zeros_like,
)
from pyengine import enable_grad, is_grad_enabled, no_grad, set_grad_enabled  # noqa: I001

from . import nn, optim
from .autograd import backward, grad
from .checkpoint import checkpoint
from .function import Function
from .gradcheck import GradcheckError, gradcheck, gradgradcheck
from .ops import (
    abs,
    add,
    astype,
    broadcast_to,
    clip,
    clone,
    concatenate,
    cross_entropy,
    div,
    embedding,
    exp,
    getitem,
    linear,
    log,
    log_softmax,
    matmul,
    max,
    maximum,
    mean,
    mul,
    neg,
    nll_loss,
    pow,
    reciprocal,
    relu,
    reshape,
    scatter_add,
    sigmoid,
    softmax,
    sqrt,
    stack,
    sub,
    sum,
    sum_to,
    swapaxes,
    tanh,
    to_device,
    transpose,
    where,
)

__all__ = [
    "Function", "GradcheckError", "Parameter", "Tensor", "abs", "add", "arange", "as_tensor",
    "astype", "backward", "broadcast_to", "checkpoint", "clip", "clone", "concatenate",
    "cross_entropy", "div", "embedding", "enable_grad", "exp", "from_numpy", "full", "getitem", "grad",
    "gradcheck", "gradgradcheck", "is_grad_enabled", "is_tensor", "linear", "log", "log_softmax",
    "manual_seed", "matmul", "max", "maximum", "mean", "mul", "neg", "nll_loss", "nn", "no_grad",
    "ones", "ones_like", "optim", "pow", "rand", "randn", "reciprocal", "relu", "reshape", "scatter_add",
    "set_grad_enabled", "sigmoid", "softmax", "sqrt", "stack", "sub", "sum", "sum_to", "swapaxes",
    "tanh", "tensor", "to_device", "transpose", "where", "zeros", "zeros_like",
]
