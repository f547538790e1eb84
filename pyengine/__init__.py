"""pyengine: PyTorch's autograd execution engine for Python frameworks.

A framework describes its backward graph with :class:`Node` subclasses
(``apply(grads)`` plus ``next_edges``) and pyengine runs it with the
semantics of ``torch/csrc/autograd/engine.cpp``: dependency counting, a ready
queue ordered by sequence number, gradient accumulation in InputBuffers,
``validate_outputs``, hooks, reentrant backward, ``retain_graph`` and
``create_graph``. The hot core is compiled Cython; ``PYENGINE_PURE=1`` runs
its pure-Python twin instead.
"""

from ._core import IMPLEMENTATION, GraphRoot, InputMetadata, is_checkpoint_valid
from .anomaly_mode import detect_anomaly, is_anomaly_enabled, set_detect_anomaly
from .autograd import (
    backward,
    grad,
    grad_accumulator,
    gradient_edge,
    register_post_accumulate_grad_hook,
    register_tensor_hook,
    retain_grad,
)
from .backends import ArrayBackend, backend_of, register_backend, unregister_backend
from .device import CPU, Device
from .engine import (
    Engine,
    OwnerGraph,
    execute_owner_graph,
    get_default_engine,
    is_multithreading_enabled,
    queue_callback,
    set_default_engine,
    set_multithreading_enabled,
)
from .grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from .indexed import IndexedGradient, densify, keep_indexed_grad
from .node import (
    AccumulateGrad,
    Edge,
    GradientFreeNode,
    Node,
    RemovableHandle,
    translate_owner_graph,
)
from .profiler import profile
from .viz import graph_to_dot, render_graph

GradientEdge = Edge


def _load_cupy_backend():
    """Plug in cupy arrays and streams where cupy is installed and works."""
    import importlib.util
    import warnings

    if importlib.util.find_spec("cupy") is None:
        return
    try:
        from . import cupy_backend  # noqa: F401
    except Exception as error:  # a cupy without CUDA fails in many ways
        warnings.warn(f"pyengine: cupy is installed but unusable ({error}); cuda devices are off",
                      RuntimeWarning, stacklevel=2)


_load_cupy_backend()

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATION",
    "AccumulateGrad",
    "ArrayBackend",
    "CPU",
    "Device",
    "Edge",
    "Engine",
    "GradientEdge",
    "GradientFreeNode",
    "GraphRoot",
    "IndexedGradient",
    "InputMetadata",
    "Node",
    "RemovableHandle",
    "backend_of",
    "backward",
    "densify",
    "detect_anomaly",
    "enable_grad",
    "OwnerGraph",
    "execute_owner_graph",
    "get_default_engine",
    "grad",
    "grad_accumulator",
    "gradient_edge",
    "graph_to_dot",
    "is_anomaly_enabled",
    "is_checkpoint_valid",
    "is_grad_enabled",
    "is_multithreading_enabled",
    "keep_indexed_grad",
    "no_grad",
    "profile",
    "queue_callback",
    "register_backend",
    "unregister_backend",
    "register_post_accumulate_grad_hook",
    "register_tensor_hook",
    "render_graph",
    "retain_grad",
    "set_default_engine",
    "set_detect_anomaly",
    "set_grad_enabled",
    "set_multithreading_enabled",
    "translate_owner_graph",
]
