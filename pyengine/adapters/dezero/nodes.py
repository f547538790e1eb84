"""The backward graph of DeZero's Functions as pyengine nodes.

What this module owns:

- :class:`FunctionNode`: the Node of one call of a DeZero ``Function``
  (:class:`RowLookupNode` for a GetItem that looks up rows of a leaf, whose
  gradient is indexed), and :class:`DeZeroAccumulateGrad`, the sink of a
  leaf Variable.
- The leaves' LeafStates (``_leaf_states``, keyed weakly by the Variable)
  and their accumulators (``_grad_accumulator``).
- Building nodes: ``_make_node`` for one forward call (called by the
  patched ``Function.__call__`` under anomaly mode), ``_build_nodes`` for a
  graph that has none yet (made when a backward needs nodes: See Note
  [DeZero as an owner graph] in ``pyengine/adapters/dezero/owner_backward.py``),
  ``_node_of`` for a Function's node.
- The row lookup tests and gradient the owner graph shares
  (``_is_row_lookup_of_leaf``, ``_row_gradient``).
- The per-call state the nodes run under: ``_dezero_backward`` (DeZero's or
  PyTorch's semantics for ``.grad``) and ``_on_calling_thread``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import weakref

import numpy as np
from dezero.core import Config, Variable
from dezero.functions import GetItem

from ... import _core
from ..._shared.hooks import call_post_accumulate_grad_hooks
from ...indexed import IndexedGradient
from ...node import RELEASED_ERROR, AccumulateGrad, Edge, LeafState, Node
from .variable_backend import _add, _array_module

_is_grad_enabled = _core.is_grad_enabled

# Note [DeZero's Variable.grad is the buffer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DeZero's own backward keeps the gradient flowing into a variable in that
# variable's ``.grad``: each Function adds into its inputs' ``.grad``, and a
# Function reads its outputs' ``.grad`` as its incoming gradients. So a
# non-leaf's ``.grad`` left over from an earlier ``backward(retain_grad=True)``
# (or set by the user) is added into the gradient that flows on, and the
# root's own ``.grad``, if set, is the seed. Afterwards, with
# ``retain_grad=False``, the ``.grad`` of every output of every Function that
# ran is cleared (the root's included); with ``retain_grad=True`` each keeps
# the full sum.
#
# On pyengine the gradients flow in InputBuffers, so inside
# ``Variable.backward`` a FunctionNode reproduces this when it runs: the
# incoming gradient of output ``y`` is ``y.grad + buffer`` (``y.grad`` alone,
# or the buffer alone, when the other is None; out of place, ``y.grad``
# first, as DeZero adds), and ``y.grad`` becomes that sum or None. The root's
# ``.grad`` is taken as the seed and cleared before the engine starts, so it
# enters once, through the engine (where hooks see it). Leaves accumulate in
# DeZeroAccumulateGrad. Inside ``grad()`` (PyTorch's semantics) nodes neither
# read nor write ``.grad``.
#
# Which of the two applies is per backward call, and a node is shared by
# every call that reaches it, so the call's mode is per-thread state set by
# ``Variable.backward`` (``_dezero_backward``, a ContextVar: each thread
# starts from its default, and reading it is cheaper than a
# ``threading.local`` attribute: benchmarks/RESULTS.md counts both). See
# Note [DeZero runs on the caller's thread] for why per-thread state
# suffices.

# Note [No input metadata]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# DeZero nodes declare no input metadata, so ``validate_outputs`` only checks
# that each gradient has a value backend. DeZero itself neither reduces nor
# casts gradients, and a cast would change results (a float64 gradient
# reaching a float32 leaf stays float64 in DeZero). The checks would also
# cost a Python call per gradient: the compiled fast path takes only numpy
# arrays, and gradients here are Variables.

# Note [DeZero runs on the caller's thread]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DeZero decides whether a Function call records a graph from
# ``Config.enable_backprop``, one flag for the whole process. A node sets it
# to the graph task's grad mode (``create_graph``) while DeZero code runs, and
# restores it. Two threads running DeZero code at once would undo each
# other's setting, so ``Variable.backward`` and ``grad()`` run their graph
# task with pyengine's device threads off (``set_multithreading_enabled``):
# every node, cupy ones included, runs on the calling thread, as in DeZero's
# own loop. That also makes the per-thread ``_dezero_backward`` of Note
# [DeZero's Variable.grad is the buffer] visible to every node of the call. (A
# reentrant backward nested deeper than the engine's inline limit moves to a
# pool thread; DeZero code never nests backward calls.)

# Per thread: None while no backward follows DeZero's Variable.backward
# (in ``grad()``, PyTorch's semantics), else that call's ``retain_grad``
# (Note [DeZero's Variable.grad is the buffer]). Set by Variable.backward
# and grad() only.
_dezero_backward = contextvars.ContextVar("pyengine_dezero_backward", default=None)


@contextlib.contextmanager
def _on_calling_thread():
    """Run the graph task without device threads. See Note [DeZero runs on
    the caller's thread]. (A core without device threads has no switch.)"""
    is_enabled = getattr(_core, "is_multithreading_enabled", None)
    if is_enabled is None:
        yield
        return
    previous = is_enabled()
    try:
        # Inside the try: Ctrl-C may come out as the switch returns (See Note
        # [What an adapter sets around a backward] in
        # pyengine/adapters/__init__.py).
        _core.set_multithreading_enabled(False)
        yield
    finally:
        _core.set_multithreading_enabled(previous)


def _output_nr(function, variable):
    """Which output of ``function`` ``variable`` is."""
    outputs = function.outputs
    if len(outputs) == 1:
        return 0
    for index, output in enumerate(outputs):
        if output() is variable:
            return index
    raise RuntimeError(f"{type(function).__name__} does not list this Variable among its outputs")


class FunctionNode(Node):
    """The backward of one call of a DeZero Function.

    ``next_edges``: one per input of the call, in order (None for an input
    that DeZero wrapped itself: see ``constants``), then one per unchained
    output (Note [Unchain]). Holds the Function weakly: the Function holds
    this node (as ``_pyengine_node``) and DeZero's graph holds the Function,
    so a strong reference back would make every graph a reference cycle.

    Fields, written by the forward call and by ``Variable.unchain`` (under
    the GIL) and read by ``apply``:
      _function: weak reference to the DeZero Function.
      _constants: indices of the inputs that ``Function.__call__`` wrapped in
        a Variable itself (a number or an array passed to the Function): no
        one else can reach them, so they get no AccumulateGrad; in
        ``Variable.backward`` the node writes their ``.grad`` as DeZero does.
      _num_inputs, _num_outputs: of the forward call.
      _cut: None, or a dict ``output index -> next edge index`` of the
        outputs that were unchained.
      _common: whether ``apply`` may take its short path: one output, none
        cut, not released. Only ever goes from True to False.
    """

    __slots__ = ("_function", "_name", "_constants", "_num_inputs", "_num_outputs", "_cut",
                 "_common")

    def __init__(self, function, next_edges, constants=(), num_outputs=1):
        super().__init__(next_edges=next_edges)
        self._function = weakref.ref(function)
        self._name = type(function).__name__ + "Backward"
        self._constants = tuple(constants or ())
        self._num_inputs = len(self._next_edges)
        self._num_outputs = num_outputs
        self._cut = None
        self._common = num_outputs == 1

    def name(self) -> str:
        return self._name

    @property
    def function(self):
        """The DeZero Function, or None once it was freed."""
        return self._function()

    def apply(self, grads):
        if not self._common:
            return self._apply_uncommon(grads)
        function = self._function()
        if function is None or Config.enable_backprop != _is_grad_enabled():
            return self._apply_uncommon(grads)
        # The common case: one output, not unchained, DeZero's Config already
        # as the engine's grad mode wants it. _apply_general does the same.
        gy = grads[0] if grads else None
        retain_grad = _dezero_backward.get()
        if retain_grad is not None:
            gy = _output_gradient(function, gy, retain_grad)
        if gy is None:
            return [None] * self._num_inputs
        gxs = function.backward(gy)
        if isinstance(gxs, tuple):
            gxs = list(gxs)
            if len(gxs) != self._num_inputs:
                gxs = self._zip_inputs(gxs)
        elif self._num_inputs == 1:
            gxs = [gxs]
        else:
            gxs = self._zip_inputs([gxs])
        if retain_grad is not None and self._constants:
            self._accumulate_constants(function, gxs)
        return gxs

    def _apply_uncommon(self, grads):
        """``apply`` when its short path does not fit: a released node, cut
        outputs, several outputs, a freed Function, or DeZero's Config not
        as the engine's grad mode wants it."""
        if self._released:
            raise RuntimeError(RELEASED_ERROR)
        if self._cut is not None and len(self._cut) == self._num_outputs:
            # Every output was unchained (Note [Unchain]): pass the gradients
            # on to them; the Function itself may be gone.
            return [None] * self._num_inputs + [
                None if index >= len(grads) else grads[index] for index in self._cut]
        function = self._function()
        if function is None:
            raise RuntimeError(f"{self._name}: its DeZero Function was freed, so it cannot run; "
                               "keep a reference to the graph's outputs while you differentiate it")
        return self._apply_general(function, grads)

    def release_variables(self):
        # The engine sets _released next; the short path does not look.
        self._common = False
        super().release_variables()

    def _apply_general(self, function, grads):
        """``apply`` for any number of outputs and unchained ones, with
        DeZero recording exactly when the engine's grad mode (create_graph) is
        on. (Variable.backward and grad() set Config for the whole call; nodes
        reached otherwise switch it here. See Note [DeZero runs on the
        caller's thread].)"""
        previous = Config.enable_backprop
        Config.enable_backprop = _is_grad_enabled()
        try:
            cut = self._cut
            gys = self._incoming(function, grads, cut)
            if gys is None:
                gxs = [None] * self._num_inputs
            else:
                gxs = function.backward(*gys)
                gxs = list(gxs) if isinstance(gxs, tuple) else [gxs]
                if len(gxs) != self._num_inputs:
                    gxs = self._zip_inputs(gxs)
                if _dezero_backward.get() is not None and self._constants:
                    self._accumulate_constants(function, gxs)
        finally:
            Config.enable_backprop = previous
        if cut is not None:
            gxs.extend(None if index >= len(grads) else grads[index] for index in cut)
        return gxs

    def _zip_inputs(self, gxs):
        """One gradient per input, as DeZero's ``zip(f.inputs, gxs)``: extra
        ones are dropped, missing ones are no gradient (SoftmaxCrossEntropy
        returns one gradient for its two inputs)."""
        return (gxs + [None] * self._num_inputs)[:self._num_inputs]

    def _incoming(self, function, grads, cut):
        """The gradients for ``function.backward``, one per output, or None
        when there are none at all. In ``Variable.backward``, adds each
        output's ``.grad`` and stores or clears it
        (Note [DeZero's Variable.grad is the buffer])."""
        outputs = function.outputs
        retain_grad = _dezero_backward.get()
        gys = []
        defined = False
        for index in range(len(outputs)):
            if cut is not None and index in cut:
                # An unchained output is a leaf now: its gradient goes to it
                # (Note [Unchain]), not into this Function.
                gys.append(None)
                continue
            gy = grads[index] if index < len(grads) else None
            if retain_grad is not None:
                output = outputs[index]()
                if output is not None:
                    stale = output.grad
                    if stale is not None:
                        gy = stale if gy is None else _add(stale, gy)
                    output.grad = gy if retain_grad else None
            if gy is not None:
                defined = True
            gys.append(gy)
        return gys if defined else None

    def _accumulate_constants(self, function, gxs):
        """DeZero's ``x.grad = gx`` / ``x.grad + gx`` for the inputs that
        Function.__call__ wrapped itself."""
        inputs = function.inputs
        for index in self._constants:
            gx = gxs[index]
            if gx is None:
                continue
            variable = inputs[index]
            old = variable.grad
            variable.grad = gx if old is None else _add(old, gx)

    def _cut_output(self, index, variable):
        """Output ``index`` (``variable``) was unchained. See Note [Unchain]."""
        cut = dict(self._cut or {})
        if index in cut:
            return
        edges = list(self._next_edges)
        cut[index] = len(edges)
        edges.append(Edge(_grad_accumulator(variable), 0))
        if len(cut) == self._num_outputs:
            # No output leads here any more: drop the edges to the rest of
            # the graph, so that it is freed as DeZero frees it.
            edges[:self._num_inputs] = [None] * self._num_inputs
        self.next_edges = edges
        self._cut = cut
        self._common = False

    def __repr__(self):
        return f"<{self._name} sequence_nr={self.sequence_nr}>"

    # See Note [Copying a graph].
    def __reduce__(self):
        # copy, deepcopy and pickle all go through here.
        return _no_node, ()


def _no_node():
    return None


# Note [Copying a graph]
# ~~~~~~~~~~~~~~~~~~~~~~
# DeZero programs copy models (``copy.deepcopy(qnet)`` for a target network)
# and save them with pickle. A FunctionNode stored on a Function copies as
# None, so the copy of the Function gets a node of its own at its first
# backward (from its own inputs), and pickling never meets the engine's
# objects. Leaves carry nothing at all: their LeafState (hooks, the lock,
# the weak reference to their AccumulateGrad) lives in ``_leaf_states``,
# keyed weakly by the Variable, not on it.


# Note [Unchain]
# ~~~~~~~~~~~~~~
# ``x.unchain()`` (and ``unchain_backward``, which calls it) sets
# ``x.creator = None``: from then on DeZero treats ``x`` as a leaf, which
# gets a ``.grad`` and stops the backward. The nodes of later Functions that
# take ``x`` point at its AccumulateGrad, but the nodes made before point at
# the old creator's node, and which nodes those are cannot be found from
# ``x``. So the old creator's node learns instead that its output ``x`` is
# cut: the gradient arriving there goes on, untouched, to ``x``'s
# AccumulateGrad (an extra next edge), and once all its outputs are cut it
# drops its edges to the rest of the graph, which is then no longer reached
# (and freed, as DeZero frees it). A Function with some outputs cut still
# runs for the others, with None for the cut ones.


class DeZeroAccumulateGrad(AccumulateGrad):
    """The sink of a leaf Variable, with DeZero's accumulation: ``x.grad =
    gx`` when ``x.grad`` is None (the very object, no copy, as DeZero), else
    ``x.grad = x.grad + gx`` (a new Variable, recorded under
    ``create_graph``); never in place. Then the post-accumulate-grad hooks,
    which run as AccumulateGrad's do.
    Tensor hooks on the leaf run before it (``register_hook``)."""

    def __init__(self, variable):
        # Not AccumulateGrad.__init__, which reads input metadata from the
        # value (See Note [No input metadata]) and keeps the LeafState on the
        # variable (See Note [Copying a graph]). The rest is what it sets.
        Node.__init__(self, next_edges=(), input_metadata=(None,))
        _core.set_sequence_nr(self, _core.ACCUMULATE_GRAD_SEQUENCE_NR)
        self.variable = variable
        self.leaf_state = _leaf_state(variable)
        self._tensor_pre_hooks = self.leaf_state.tensor_pre_hooks

    def apply(self, grads):
        new_grad = grads[0]
        variable = self.variable
        state = self.leaf_state
        if new_grad is not None:
            grads[0] = None
            with state.lock:
                old_grad = variable.grad
                if old_grad is None and type(new_grad) is IndexedGradient:
                    # DeZero's .grad is a Variable of a dense array.
                    new_grad = Variable(new_grad.to_dense())
                variable.grad = new_grad if old_grad is None else _add(old_grad, new_grad)
        # Also for a leaf that got no gradient, and a hook must return None,
        # as AccumulateGrad's: See Note [Post accumulate grad hooks].
        hooks = state.post_accumulate_grad_hooks
        if hooks:
            call_post_accumulate_grad_hooks(variable, hooks)
        return ()


# Variable -> its LeafState, for the leaves pyengine has met. Weak keys: an
# entry goes with its Variable. Insertions are guarded by _leaf_states_lock.
_leaf_states = weakref.WeakKeyDictionary()
_leaf_states_lock = threading.Lock()


def _leaf_state(variable):
    """What pyengine keeps for a leaf Variable (See Note [Copying a graph])."""
    state = _leaf_states.get(variable)
    if state is None:
        with _leaf_states_lock:
            state = _leaf_states.get(variable)
            if state is None:
                state = _leaf_states[variable] = LeafState()
    return state


def _reset_leaf_states_lock_after_fork():
    # A backward takes it: See Note [Locks after fork] in pyengine/node.py.
    global _leaf_states_lock
    _leaf_states_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_leaf_states_lock_after_fork)


def _grad_accumulator(variable):
    """The DeZeroAccumulateGrad of a leaf Variable, made on first use; kept
    weakly in its LeafState (the graph keeps it alive, as in PyTorch)."""
    state = _leaf_state(variable)
    reference = state.accumulator
    accumulator = reference() if reference is not None else None
    if accumulator is None:
        with state.lock:
            reference = state.accumulator
            accumulator = reference() if reference is not None else None
            if accumulator is None:
                accumulator = DeZeroAccumulateGrad(variable)
                state.accumulator = weakref.ref(accumulator)
    return accumulator


class RowLookupNode(FunctionNode):
    """The backward of ``x[rows]`` (DeZero's GetItem, ``rows`` an integer
    array) for a leaf ``x``: the rows' gradients as an IndexedGradient (See
    Note [Where an indexed gradient goes] in ``pyengine/indexed.py``), which
    DeZeroAccumulateGrad adds into ``x.grad`` as DeZero would add the dense
    gradient. Under ``create_graph``, or in any uncommon case, DeZero's own
    GetItemGrad, as for any Function."""

    __slots__ = ()

    def apply(self, grads):
        function = self._function()
        if not self._common or function is None or _is_grad_enabled():
            return super().apply(grads)
        gys = self._incoming(function, grads, None)
        if gys is None:
            return [None]
        return [_row_gradient(function, gys[0])]


def _row_gradient(function, gy):
    """The gradient of a row lookup ``function`` (See ``_is_row_lookup``)
    for ``gy``, as an IndexedGradient."""
    gy = gy.data if isinstance(gy, Variable) else gy
    shape = function.inputs[0].shape
    xp = _array_module(gy)
    rows = xp.asarray(function.slices).reshape(-1)
    return IndexedGradient(rows, gy.reshape((rows.shape[0],) + tuple(shape[1:])), shape)


def _is_row_lookup(function, inputs, edges):
    """A GetItem with one integer array as its index, of a leaf (the only
    consumer that takes an indexed gradient as DeZero's ``.grad`` allows)."""
    if type(function) is not GetItem or len(edges) != 1 or edges[0] is None:
        return False
    return type(edges[0].node) is DeZeroAccumulateGrad and _indexes_rows(function, inputs[0])


def _output_gradient(function, gy, retain_grad):
    """The gradient of ``function``'s one output as DeZero's
    ``Variable.backward`` hands it on: ``gy`` added to what the output's
    ``.grad`` holds from an earlier backward, and kept there only under
    ``retain_grad``. See Note [DeZero's Variable.grad is the buffer]."""
    output = function.outputs[0]()
    if output is not None:
        stale = output.grad
        if stale is not None:
            gy = stale if gy is None else _add(stale, gy)
        output.grad = gy if retain_grad else None
    return gy


def _is_row_lookup_of_leaf(function):
    """``_is_row_lookup`` read from DeZero's graph alone: a GetItem (the
    caller checks the type) of rows of a Variable without a creator."""
    inputs = function.inputs
    return len(inputs) == 1 and inputs[0].creator is None and _indexes_rows(function, inputs[0])


def _indexes_rows(function, variable):
    rows = function.slices
    return (getattr(rows, "dtype", None) is not None and not isinstance(rows, np.generic)
            and rows.dtype.kind in "iu" and len(variable.shape) >= 1)


def _make_node(function, inputs, constants, num_outputs):
    """The FunctionNode of a forward call of ``function`` on ``inputs``."""
    edges = []
    for index, variable in enumerate(inputs):
        creator = variable.creator
        if creator is not None:
            node = getattr(creator, "_pyengine_node", None)
            if node is None:
                node = _build_nodes(creator)
            edges.append(Edge(node, 0 if len(creator.outputs) == 1 else _output_nr(creator, variable)))
        elif constants and index in constants:
            edges.append(None)
        else:
            edges.append(Edge(_grad_accumulator(variable), 0))
    if _is_row_lookup(function, inputs, edges):
        return RowLookupNode(function, edges, constants, num_outputs)
    return FunctionNode(function, edges, constants, num_outputs)


def _build_nodes(function):
    """Nodes for ``function`` and every Function upstream of it that has
    none (a graph recorded before ``install()``), producers first so that
    sequence numbers follow the forward order. Iterative version of::

        def build(f):
            for x in f.inputs:
                if x.creator is not None and not has_node(x.creator):
                    build(x.creator)
            f._pyengine_node = make_node(f)

    Which inputs DeZero wrapped itself is not known any more: every input
    without a creator gets an AccumulateGrad.
    """
    stack = [(function, False)]
    while stack:
        current, inputs_done = stack.pop()
        if getattr(current, "_pyengine_node", None) is not None:
            continue
        if inputs_done:
            current._pyengine_node = _make_node(current, current.inputs, (), len(current.outputs))
            continue
        stack.append((current, True))
        for variable in current.inputs:
            creator = variable.creator
            if creator is not None and getattr(creator, "_pyengine_node", None) is None:
                stack.append((creator, False))
    return function._pyengine_node


def _node_of(function):
    node = getattr(function, "_pyengine_node", None)
    return node if node is not None else _build_nodes(function)
