"""Chooses the engine core: the compiled Cython modules or their pure-Python twin.

``PYENGINE_PURE=1`` selects the twin. Without it, the compiled modules are
used; if they cannot be imported, the twin is used with a warning that says
why and what to do (:func:`why_no_compiled_core`). Everything else imports
the core from here.
"""

import importlib.machinery
import os
import warnings

from ._pure import owner_graph as translation_module

IMPLEMENTATION = "pure"
_PURE_REQUESTED = os.environ.get("PYENGINE_PURE", "") not in ("", "0")

# The compiled modules this file imports; each is a pyengine/<name>.pyx.
_COMPILED = ("_engine", "_graph_task", "_input_buffer", "_node", "_ready_queue", "_state",
             "_validate_outputs")


def why_no_compiled_core(error):
    """The warning for a pyengine whose compiled modules failed to import with
    ``error``: which of three cases this is, and what to do.

    Python words a missing submodule of a package that is being imported as
    "most likely due to a circular import", which is never the cause here, so
    the files say what happened: no built module next to its ``.pyx`` source
    is a source tree that was not built (``python -m pyengine`` or a script
    run from the repository root imports the checkout, which shadows an
    installed pyengine); no built module and no source is an install that
    found no C++ compiler (See Note [Installing without a compiler] in
    setup.py); a built module that fails to import is a build for another
    Python or numpy, and the error says which.
    """
    package = os.path.dirname(os.path.abspath(__file__))
    built = [name for name in _COMPILED
             if any(os.path.exists(os.path.join(package, name + suffix))
                    for suffix in importlib.machinery.EXTENSION_SUFFIXES)]
    twin = "pyengine runs on its pure-Python twin, which is several times slower"
    if len(built) < len(_COMPILED) and os.path.exists(os.path.join(package, "_engine.pyx")):
        checkout = os.path.dirname(package)
        shadow = (" (Python imports from the current directory first, so the checkout shadows any "
                  "installed pyengine)" if os.path.abspath(os.getcwd()) == checkout else "")
        return (f"pyengine: imported from the source tree {package}{shadow}, where the compiled "
                f"core is not built; {twin}. To use the compiled core, run from outside {checkout} "
                f"to import the installed pyengine, or build it in place: cd {checkout} && python "
                "setup.py build_ext --inplace. PYENGINE_PURE=1 selects the twin without this warning.")
    if not built:
        return (f"pyengine: installed without its compiled core ({package} has no compiled modules: "
                f"the install found no working C++ compiler); {twin}. Install a C++17 compiler (g++ "
                "or clang++) and reinstall pyengine with pip install --force-reinstall "
                "--no-cache-dir. PYENGINE_PURE=1 selects the twin without this warning.")
    return (f"pyengine: the compiled core in {package} does not import ({error}); {twin}. It was "
            "probably built for another Python or numpy: reinstall pyengine with pip install "
            "--force-reinstall --no-cache-dir.")


if not _PURE_REQUESTED:
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
        warnings.warn(why_no_compiled_core(error), RuntimeWarning, stacklevel=2)

def core_description():
    """Which core runs, in words for the command-line tools' first line; the
    pure twin says plainly why it runs."""
    if IMPLEMENTATION == "compiled":
        return "compiled engine core"
    if _PURE_REQUESTED:
        return "pure engine core (the pure-Python twin, as PYENGINE_PURE=1 asks)"
    return ("pure engine core: the pure-Python twin, several times slower, because the compiled "
            "core did not import (the warning above says why)")


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
GradLock = node_module.GradLock
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

is_grad_enabled = state_module.is_grad_enabled
set_grad_enabled = state_module.set_grad_enabled
is_anomaly_enabled = state_module.is_anomaly_enabled
is_anomaly_check_nan_enabled = state_module.is_anomaly_check_nan_enabled
set_anomaly_enabled = state_module.set_anomaly_enabled
is_checkpoint_valid = state_module.is_checkpoint_valid
is_multithreading_enabled = state_module.is_multithreading_enabled
set_multithreading_enabled = state_module.set_multithreading_enabled
set_profiler = state_module.set_profiler
RestoreOnExit = state_module.RestoreOnExit
