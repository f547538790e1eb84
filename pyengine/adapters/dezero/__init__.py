"""pyengine as the backward engine of DeZero.

    from pyengine.adapters import dezero as pyengine_dezero
    pyengine_dezero.install()   # Variable.backward() now runs on pyengine

``install()`` patches three attributes of ``dezero.core`` (``Function.__call__``,
``Variable.backward``, ``Variable.unchain``); ``uninstall()`` puts the very
same objects back; ``installed()`` is the context manager. Installing twice
is harmless. Only ``dezero.core`` is patched: ``dezero.core_simple`` (the
book's steps 23-32) keeps its own engine.

How ``Variable.backward`` runs. DeZero records its own graph (``creator``,
``inputs``, ``outputs``), so ``Variable.backward`` reads it when it runs, as
a ``pyengine.OwnerGraph`` in returns mode: nothing is made at forward, and
a training step makes no pyengine object per Function. What needs pyengine
nodes gets them, made from DeZero's graph at the first backward that needs
them (or by ``grad_fn``): ``create_graph=True``, anomaly mode (nodes are then
made at forward, to keep the forward traceback), ``grad()``, hooks
(``register_hook``, ``register_post_accumulate_grad_hook``, node hooks on
``grad_fn(y)``), a Function with several outputs, a second backward from
the same Function (nodes then pay back), and a graph in which a Function
already has a node (nodes in other graphs do not matter). Both routes give
the same ``.grad`` fields.
See Note [DeZero as an owner graph] in
``pyengine/adapters/dezero/owner_backward.py``.

``Function.__call__`` computes what DeZero's computes, in shorter steps for
the common cases (it runs for every forward op and every op of every
backward formula), and makes a node only under anomaly mode.
``benchmarks/RESULTS.md`` (the adapters section) measures it against
DeZero's own ``Function.__call__``.

What this package owns, and where:

- This module: ``install``/``uninstall`` and the patched DeZero methods
  (``Function.__call__``, ``Variable.backward``, ``Variable.unchain``).
- ``owner_backward``: the owner graph over DeZero's graph, and which
  backward runs on it (``nodes_needed``).
- ``nodes``: :class:`FunctionNode`, the Node of one call of a DeZero
  ``Function``, made from DeZero's graph when a backward needs nodes
  (``sequence_nr`` in forward order: producers first). Its ``apply`` calls
  the Function's own ``backward`` on DeZero Variables. And
  :class:`DeZeroAccumulateGrad`, the sink of a leaf Variable, with DeZero's
  accumulation (``x.grad = gx`` or ``x.grad + gx``).
- ``variable_backend``: :class:`VariableBackend`, the value backend for
  ``dezero.Variable``. Gradients stay Variables (as in DeZero), so
  ``create_graph=True`` records DeZero graphs that can be differentiated
  again.
- ``autograd_api``: ``grad``, ``register_hook``,
  ``register_post_accumulate_grad_hook`` and ``grad_fn``, pyengine's API for
  DeZero Variables. Anomaly mode (``pyengine.detect_anomaly``) works as is:
  Functions called under it get nodes that keep the forward traceback, and
  the NaN check reads Variables.

Where DeZero and PyTorch differ, ``Variable.backward`` keeps DeZero's
semantics, so that results and ``.grad`` fields are DeZero's own; the
functions above keep PyTorch's:

- ``Variable.grad`` of a non-leaf is DeZero's accumulator, not PyTorch's
  retained grad. See Note [DeZero's Variable.grad is the buffer] in
  ``pyengine/adapters/dezero/nodes.py``.
- ``retain_grad`` is DeZero's flag (every non-leaf that backward reaches
  keeps its gradient, or all are cleared), not ``pyengine.retain_grad``,
  which must not be used on DeZero Variables (it would add into ``.grad``
  a second time).
- DeZero never frees a graph: ``Variable.backward`` runs with
  ``retain_graph=True``, so it can be repeated. ``grad()`` follows PyTorch:
  ``retain_graph`` defaults to ``create_graph``, and a later backward through
  the released nodes raises PyTorch's "Trying to backward through the graph
  a second time" error.
- A missing output gradient is ``ones_like(output)`` for any shape (DeZero's
  seed), in ``grad()`` too; PyTorch allows it only for scalars.
- Gradients are not validated: no shape reduction, no cast, no count check
  (DeZero zips a Function's inputs with what its ``backward`` returned, and
  its own functions rely on that). See Note [No input metadata] in
  ``pyengine/adapters/dezero/nodes.py``.
- ``x.backward()`` on a leaf seeds ``x.grad`` and returns (DeZero seeds it
  and then fails on ``None.outputs``).
- A Function none of whose outputs received a gradient is not called
  (DeZero would call ``backward(None)`` and fail).
- Functions run in pyengine's order, not DeZero's (highest ``generation``
  first): on the owner graph the reverse of a depth-first post-order, on
  nodes dependency counting, then the later ``sequence_nr`` first. All are
  topological orders: where three or more gradients meet, their sum may
  differ from DeZero's in the last bits.
- ``Variable.unchain`` cuts the graph where DeZero cuts it: the owner graph
  reads ``creator`` when backward runs, as DeZero does, and a node made
  before the cut learns of it (Note [Unchain] in
  ``pyengine/adapters/dezero/nodes.py``).
- DeZero's ``Config`` is process-global, so DeZero backward formulas run on
  the thread that called ``backward``/``grad``. See Note [DeZero runs on the
  caller's thread] in ``pyengine/adapters/dezero/nodes.py``.
"""

from __future__ import annotations

import weakref

import numpy as np

try:
    import dezero.core as _dezero_core
except Exception as error:  # pragma: no cover - depends on the environment
    if isinstance(error, ModuleNotFoundError) and error.name == "dezero":
        raise ImportError("pyengine.adapters.dezero needs DeZero: pip install dezero==0.0.13 "
                          "'numpy<1.24' 'matplotlib<3.9'") from error
    # Installed but broken: DeZero 0.0.13 uses np.int (gone from numpy 1.24) and
    # imports matplotlib without declaring it.
    raise ImportError(f"pyengine.adapters.dezero: DeZero is installed but does not import "
                      f"({type(error).__name__}: {error}); DeZero 0.0.13 needs 'numpy<1.24' and "
                      "matplotlib ('matplotlib<3.9')") from error

import pyengine
from pyengine.adapters import Patches

from ...node import Edge
from .autograd_api import grad, grad_fn, register_hook, register_post_accumulate_grad_hook
from .nodes import (
    DeZeroAccumulateGrad,
    FunctionNode,
    _dezero_backward,
    _make_node,
    _node_of,
    _on_calling_thread,
    _output_nr,
)
from .owner_backward import NeedsNodes, backward_on_owner_graph, nodes_needed
from .variable_backend import VariableBackend, _ones_like

_is_anomaly_enabled = pyengine.is_anomaly_enabled

__all__ = [
    "install",
    "uninstall",
    "is_installed",
    "installed",
    "grad",
    "grad_fn",
    "register_hook",
    "register_post_accumulate_grad_hook",
    "FunctionNode",
    "DeZeroAccumulateGrad",
    "VariableBackend",
]

Variable = _dezero_core.Variable
Function = _dezero_core.Function
Config = _dezero_core.Config


# -- the patched DeZero methods ---------------------------------------------------------

def _function_call(self, *inputs):
    """DeZero's ``Function.__call__`` with the same steps (``as_variable``,
    ``forward``, ``Variable(as_array(y))``, the links), and under anomaly
    mode the FunctionNode, made where DeZero links the graph (it keeps the
    forward traceback). It runs for every Function call, backward formulas
    included, so the common cases take short paths that compute exactly
    what DeZero's lines compute."""
    constants = None
    if len(inputs) == 1:
        if not isinstance(inputs[0], Variable):
            inputs, constants = _as_variables(inputs)
        ys = self.forward(inputs[0].data)
    else:
        for value in inputs:
            if not isinstance(value, Variable):
                inputs, constants = _as_variables(inputs)
                break
        ys = self.forward(*[x.data for x in inputs])
    # as_array(y) returns an ndarray unchanged: test that first.
    if isinstance(ys, tuple):
        outputs = [Variable(y if type(y) is np.ndarray else _dezero_core.as_array(y)) for y in ys]
    else:
        output = Variable(ys if type(ys) is np.ndarray else _dezero_core.as_array(ys))
        if not Config.enable_backprop:
            # A backward formula, or no_grad: no list, no links.
            return output
        outputs = [output]

    if Config.enable_backprop:
        variables = list(inputs)
        self.generation = max([x.generation for x in variables])
        for output in outputs:
            output.set_creator(self)
        self.inputs = variables
        self.outputs = [weakref.ref(output) for output in outputs]
        if _is_anomaly_enabled():
            self._pyengine_node = _make_node(self, variables, constants, len(outputs))

    return outputs if len(outputs) > 1 else outputs[0]


def _as_variables(inputs):
    """DeZero's ``[as_variable(x) for x in inputs]``, and the indices of the
    inputs it wrapped: only ``self.inputs`` can reach those Variables."""
    variables = []
    constants = []
    for index, value in enumerate(inputs):
        if not isinstance(value, Variable):
            value = Variable(value)
            constants.append(index)
        variables.append(value)
    return variables, tuple(constants)


def _variable_backward(self, retain_grad=False, create_graph=False):
    """DeZero's ``Variable.backward``, run by pyengine (installed by
    ``pyengine.adapters.dezero``): the same results and the same ``.grad``
    fields as DeZero's own loop."""
    seed = self.grad
    if seed is None:
        seed = _ones_like(self)
    creator = self.creator
    if creator is None:
        # A leaf: nothing runs. DeZero seeds .grad, then fails on None.outputs.
        self.grad = seed
        return
    # The seed enters through the engine, not through .grad: See Note
    # [DeZero's Variable.grad is the buffer] in ``pyengine/adapters/dezero/nodes.py``.
    if not nodes_needed(create_graph, creator):
        # DeZero's own graph, read as an owner graph: See Note [DeZero as an
        # owner graph] in ``pyengine/adapters/dezero/owner_backward.py``.
        self.grad = None
        previous_config = Config.enable_backprop
        try:
            Config.enable_backprop = False
            backward_on_owner_graph(self, seed, retain_grad)
            return
        except NeedsNodes:
            pass  # raised by the search, before any backward ran: on nodes, below
        except BaseException:
            if self.grad is None:
                self.grad = seed
            raise
        finally:
            Config.enable_backprop = previous_config
    root = Edge(_node_of(creator), _output_nr(creator, self))
    self.grad = None
    previous_config = Config.enable_backprop
    previous_mode = _dezero_backward.get()
    try:
        # See Note [What an adapter sets around a backward] in
        # pyengine/adapters/__init__.py.
        _dezero_backward.set(bool(retain_grad))
        # As DeZero's using_config around each backward formula, for the whole
        # call (hooks see it too): nodes then need not switch it.
        Config.enable_backprop = bool(create_graph)
        with _on_calling_thread():
            pyengine.get_default_engine().execute([root], [seed], True, bool(create_graph), True)
    except BaseException:
        if self.grad is None:
            self.grad = seed
        raise
    finally:
        Config.enable_backprop = previous_config
        _dezero_backward.set(previous_mode)


def _variable_unchain(self):
    """DeZero's ``Variable.unchain``, and the node of the old creator learns
    that this output is cut (Note [Unchain] in
    ``pyengine/adapters/dezero/nodes.py``)."""
    creator = self.creator
    self.creator = None
    if creator is not None:
        node = getattr(creator, "_pyengine_node", None)
        if node is not None:
            node._cut_output(_output_nr(creator, self), self)


def _unsupported():
    return f"this DeZero version ({_dezero_version()}) is not supported"


_PATCHES = Patches("pyengine.adapters.dezero", (
    (Function, "__call__", _function_call),
    (Variable, "backward", _variable_backward),
    (Variable, "unchain", _variable_unchain),
), _unsupported)


def install():
    """Make DeZero's ``Variable.backward`` run on pyengine. Idempotent.

    Graphs recorded before ``install()`` work too (their nodes are made at
    their first backward).
    """
    _PATCHES.install()


def uninstall():
    """Put DeZero's own methods back (the very objects). Idempotent.

    Nodes already made stay on their Functions and are used again after a
    new ``install()``; DeZero's own loop ignores them.
    """
    _PATCHES.uninstall()


def is_installed() -> bool:
    return _PATCHES.is_installed()


def installed():
    """``with installed():`` runs its block with the adapter installed and
    then restores the previous state (it stays installed if it was)."""
    return _PATCHES.installed()


def _dezero_version():
    import dezero

    return getattr(dezero, "__version__", "unknown")
