"""Chooses the engine core: the compiled Cython modules or their pure-Python twin.

``PYENGINE_PURE=1`` selects the twin. Without it, the compiled modules are
used; if they cannot be imported (no compiled build for this platform), the
twin is used with a warning. Everything else imports the core from here.
"""

import os
import warnings

from ._pure import owner_graph as translation_module

IMPLEMENTATION = "pure"

if os.environ.get("PYENGINE_PURE", "") in ("", "0"):
    try:
        from . import _engine as engine_module
        from . import _graph_task as graph_task_module
        from . import _input_buffer as input_buffer_module
        from . import _node as node_module
        from . import _owner_graph as owner_graph_module
        from . import _ready_queue as ready_queue_module
        from . import _state as state_module
        from . import _validate_outputs as validate_outputs_module

        IMPLEMENTATION = "compiled"
    except ImportError as error:
        warnings.warn(
            f"pyengine: the compiled core is unavailable ({error}); using the slower "
            "pure-Python twin. Reinstall pyengine to build it.",
            RuntimeWarning,
            stacklevel=2,
        )

if IMPLEMENTATION == "pure":
    from ._pure import engine as engine_module
    from ._pure import graph_task as graph_task_module
    from ._pure import input_buffer as input_buffer_module
    from ._pure import node as node_module
    from ._pure import owner_graph as owner_graph_module
    from ._pure import ready_queue as ready_queue_module
    from ._pure import state as state_module
    from ._pure import validate_outputs as validate_outputs_module

NodeBase = node_module.NodeBase
GradientFreeNodeBase = node_module.GradientFreeNodeBase
AccumulateGradBase = node_module.AccumulateGradBase
LeafState = node_module.LeafState
Edge = node_module.Edge
InputMetadata = node_module.InputMetadata
ACCUMULATE_GRAD_SEQUENCE_NR = node_module.ACCUMULATE_GRAD_SEQUENCE_NR
set_sequence_nr = node_module._set_sequence_nr

NodeTask = ready_queue_module.NodeTask
ReadyQueue = ready_queue_module.ReadyQueue
InputBuffer = input_buffer_module.InputBuffer
GraphTask = graph_task_module.GraphTask

Engine = engine_module.Engine
# Each core runs owner graphs with its own walk (See Note [Owner graphs] in
# pyengine/_pure/owner_graph.py); both translate one into nodes, only to
# look at it, with the twin's translation.
OwnerGraph = owner_graph_module.OwnerGraph
owner_graph_edge = translation_module.owner_graph_edge

GraphRoot = engine_module.GraphRoot
validate_outputs = validate_outputs_module.validate_outputs
register_engine = engine_module._register_engine

is_grad_enabled = state_module.is_grad_enabled
set_grad_enabled = state_module.set_grad_enabled
is_anomaly_enabled = state_module.is_anomaly_enabled
is_anomaly_check_nan_enabled = state_module.is_anomaly_check_nan_enabled
set_anomaly_enabled = state_module.set_anomaly_enabled
is_checkpoint_valid = state_module.is_checkpoint_valid
is_multithreading_enabled = state_module.is_multithreading_enabled
set_multithreading_enabled = state_module.set_multithreading_enabled
set_profiler = state_module.set_profiler
