"""``backward`` and ``grad`` for frontend Tensors, as ``torch.autograd``.

They are pyengine's, with Tensors in and out: ``grad`` returns Tensors
(the engine captures arrays, or Tensors under ``create_graph``), and
gradients given as arrays or Tensors are both accepted.
"""

from __future__ import annotations

import pyengine
from pyengine.autograd import _grad

from .graph import refuse_stale_views
from .tensor import Tensor, zeros_like

__all__ = ["backward", "grad"]


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    """Accumulate gradients of ``tensors`` into the leaves' ``.grad``
    (``torch.autograd.backward``). A view taken before its base's in-place
    operation is refused as an output or input (See Note [Views and the
    version counter] in ``pyengine/frontend/tensor.py``)."""
    refuse_stale_views(tensors)
    refuse_stale_views(inputs)
    pyengine.backward(tensors, grad_tensors, retain_graph, create_graph, inputs)


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         allow_unused=None, materialize_grads=False):
    """The gradients of ``outputs`` with respect to ``inputs``, as a tuple of
    Tensors (None for an unused input) (``torch.autograd.grad``); an
    IndexedGradient (a lookup's, See Note [Where an indexed gradient goes] in
    ``pyengine/indexed.py``) as it is, as torch returns a sparse tensor.
    ``materialize_grads`` gives an unused input zeros that require grad
    under ``create_graph``, as torch's ``zeros_like(input,
    requires_grad=create_graph)``. A stale view is refused as in ``backward``."""
    refuse_stale_views(outputs)
    refuse_stale_views(inputs)
    results = _grad(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused,
                    materialize_grads,
                    _zeros_requiring_grad if create_graph else _zeros_not_requiring_grad)
    return tuple(value if value is None or isinstance(value, (Tensor, pyengine.IndexedGradient))
                 else Tensor._make(value) for value in results)


def _zeros_requiring_grad(tensor):
    return zeros_like(tensor, requires_grad=True)


def _zeros_not_requiring_grad(tensor):
    return zeros_like(tensor)
