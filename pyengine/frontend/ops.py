"""Every op of the frontend in one namespace (``pyengine.frontend.ops``).

The ops live in modules by concept, each forward beside its backward node:
``pointwise`` (arithmetic, elementwise functions, ``where``, copies),
``reduce`` (``sum``, ``mean``, ``max``, ``sum_to``), ``shape`` (``reshape``,
``transpose``, ``broadcast_to``, indexing, ``concatenate``, ``stack``),
``linalg`` (``matmul``, ``linear``) and ``loss`` (``softmax``,
``log_softmax``, ``nll_loss``, ``cross_entropy``). The plumbing they share
(``OpNode``, ``SavedTensor``, ``record``) is in ``graph``.
"""

from .linalg import linear, matmul
from .loss import cross_entropy, log_softmax, nll_loss, softmax
from .pointwise import (
    abs,
    add,
    astype,
    clip,
    clone,
    compare,
    copy_from,
    div,
    exp,
    fill,
    log,
    maximum,
    mul,
    neg,
    pow,
    reciprocal,
    relu,
    sigmoid,
    sign,
    sqrt,
    sub,
    tanh,
    to_device,
    where,
)
from .reduce import max, mean, sum, sum_to
from .shape import (
    broadcast_to,
    concatenate,
    embedding,
    getitem,
    index_put,
    reshape,
    scatter_add,
    stack,
    swapaxes,
    transpose,
)

__all__ = [
    "abs", "add", "astype", "broadcast_to", "clip", "clone", "compare", "concatenate",
    "copy_from", "cross_entropy", "div", "embedding", "exp", "fill", "getitem", "index_put", "linear", "log",
    "log_softmax", "matmul", "max", "maximum", "mean", "mul", "neg", "nll_loss", "pow", "reciprocal",
    "relu", "reshape", "scatter_add", "sigmoid", "sign", "softmax", "sqrt", "stack", "sub", "sum",
    "sum_to", "swapaxes", "tanh", "to_device", "transpose", "where",
]
