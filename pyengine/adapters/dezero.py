"""pyengine as the backward engine of DeZero.

    from pyengine.adapters import dezero as pyengine_dezero
    pyengine_dezero.install()   # Variable.backward() now runs on pyengine

``install()`` patches three attributes of ``dezero.core`` (``Function.__call__``,
``Variable.backward``, ``Variable.unchain``); ``uninstall()`` puts the very
same objects back; ``installed()`` is the context manager. Installing twice
is harmless. Only ``dezero.core`` is patched: ``dezero.core_simple`` (the
book's steps 23-32) keeps its own engine.

What this module owns:

- :class:`FunctionNode`: the Node of one call of a DeZero ``Function``, made
  by the patched ``Function.__call__`` where DeZero links the graph, so its
  ``sequence_nr`` is stamped in forward order. Its ``apply`` calls the
  Function's own ``backward`` on DeZero Variables.
- :class:`DeZeroAccumulateGrad`: the sink of a leaf Variable, with DeZero's
  accumulation (``x.grad = gx`` or ``x.grad + gx``).
- :class:`VariableBackend`: the value backend for ``dezero.Variable``.
  Gradients stay Variables (as in DeZero), so ``create_graph=True``
  records DeZero graphs that can be differentiated again.
- ``grad``, ``register_hook``, ``register_post_accumulate_grad_hook`` and
  ``grad_fn``: pyengine's API for DeZero Variables. Anomaly mode
  (``pyengine.detect_anomaly``) works as is: nodes made under it keep the
  forward traceback, and the NaN check reads Variables.

Where DeZero and PyTorch differ, ``Variable.backward`` keeps DeZero's
semantics, so that results and ``.grad`` fields are DeZero's own; the
functions above keep PyTorch's:

- ``Variable.grad`` of a non-leaf is DeZero's accumulator, not PyTorch's
  retained grad. See Note [DeZero's Variable.grad is the buffer].
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
  its own functions rely on that). See Note [No input metadata].
- ``x.backward()`` on a leaf seeds ``x.grad`` and returns (DeZero seeds it
  and then fails on ``None.outputs``).
- A Function none of whose outputs received a gradient is not called
  (DeZero would call ``backward(None)`` and fail).
- Nodes run in pyengine's order (dependency counting, then the later
  ``sequence_nr`` first), not DeZero's (highest ``generation`` first). Both
  are topological orders: where three or more gradients meet, their sum may
  differ from DeZero's in the last bits.
- DeZero's ``Config`` is process-global, so DeZero backward formulas run on
  the thread that called ``backward``/``grad``. See Note [DeZero runs on the
  caller's thread].
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref

import numpy as np

try:
    import dezero.core as _dezero_core
    import dezero.cuda as _dezero_cuda
    import dezero.functions as _dezero_functions
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("pyengine.adapters.dezero needs DeZero: pip install dezero") from error

import pyengine
from pyengine.adapters import installed_while

from .. import _core
from ..device import CPU, Device
from ..node import RELEASED_ERROR, AccumulateGrad, Edge, LeafState, Node

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
# ``Variable.backward`` (``_dezero_backward``, a ContextVar: each thread starts
# from its default, and reading it costs a node a quarter of what a
# ``threading.local`` attribute does). See Note [DeZero runs on the caller's
# thread] for why per-thread state suffices.

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


# -- arithmetic on gradients ----------------------------------------------------------

def _add(a, b):
    """``a + b`` as DeZero's ``x.grad + gx``: recorded when grad mode is on
    (``create_graph``), else computed without making a Function."""
    if _core.is_grad_enabled():
        previous = Config.enable_backprop
        Config.enable_backprop = True
        try:
            return a + b
        finally:
            Config.enable_backprop = previous
    if isinstance(a, Variable) and isinstance(b, Variable):
        # What DeZero's Add computes when not recording: the same numpy or
        # cupy addition, wrapped as Function.__call__ wraps an output.
        total = a.data + b.data
        if type(total) is not np.ndarray and np.isscalar(total):
            total = np.array(total)
        return Variable(total)
    previous = Config.enable_backprop
    Config.enable_backprop = False
    try:
        return a + b
    finally:
        Config.enable_backprop = previous


def _array_module(data):
    return _dezero_cuda.get_array_module(data)


def _ones_like(variable):
    """DeZero's seed for ``variable``: ``Variable(xp.ones_like(variable.data))``."""
    return Variable(_array_module(variable.data).ones_like(variable.data))


# -- nodes ----------------------------------------------------------------------------

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
            output = function.outputs[0]()
            if output is not None:
                stale = output.grad
                if stale is not None:
                    gy = stale if gy is None else _add(stale, gy)
                output.grad = gy if retain_grad else None
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
    ``create_graph``); never in place. Then the post-accumulate-grad hooks.
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
        if new_grad is None:
            return ()
        grads[0] = None
        variable = self.variable
        state = self.leaf_state
        with state.lock:
            old_grad = variable.grad
            variable.grad = new_grad if old_grad is None else _add(old_grad, new_grad)
        hooks = state.post_accumulate_grad_hooks
        if hooks:
            for _, hook in list(hooks):
                hook(variable)
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


# -- the patched DeZero methods ---------------------------------------------------------

def _function_call(self, *inputs):
    """DeZero's ``Function.__call__`` with the same steps (``as_variable``,
    ``forward``, ``Variable(as_array(y))``, the links), plus the
    FunctionNode, made where DeZero links the graph. It runs for every
    Function call, backward formulas included, so the common cases take
    short paths that compute exactly what DeZero's lines compute."""
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


@contextlib.contextmanager
def _on_calling_thread():
    """Run the graph task without device threads. See Note [DeZero runs on
    the caller's thread]. (A core without device threads has no switch.)"""
    is_enabled = getattr(_core, "is_multithreading_enabled", None)
    if is_enabled is None:
        yield
        return
    previous = is_enabled()
    _core.set_multithreading_enabled(False)
    try:
        yield
    finally:
        _core.set_multithreading_enabled(previous)


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
    root = Edge(_node_of(creator), _output_nr(creator, self))
    # The seed enters through the engine, not through .grad: See Note
    # [DeZero's Variable.grad is the buffer].
    self.grad = None
    previous_config = Config.enable_backprop
    mode = _dezero_backward.set(bool(retain_grad))
    # As DeZero's using_config around each backward formula, for the whole
    # call (hooks see it too): nodes then need not switch it.
    Config.enable_backprop = bool(create_graph)
    try:
        with _on_calling_thread():
            pyengine.get_default_engine().execute([root], [seed], True, bool(create_graph), True)
    except BaseException:
        if self.grad is None:
            self.grad = seed
        raise
    finally:
        Config.enable_backprop = previous_config
        _dezero_backward.reset(mode)


def _variable_unchain(self):
    """DeZero's ``Variable.unchain``, and the node of the old creator learns
    that this output is cut (Note [Unchain])."""
    creator = self.creator
    self.creator = None
    if creator is not None:
        node = getattr(creator, "_pyengine_node", None)
        if node is not None:
            node._cut_output(_output_nr(creator, self), self)


_PATCHES = (
    (Function, "__call__", _function_call),
    (Variable, "backward", _variable_backward),
    (Variable, "unchain", _variable_unchain),
)

# The attributes install() replaced, as (class, name, original); None when
# not installed. Guarded by _install_lock.
_originals = None
_install_lock = threading.Lock()


def install():
    """Make DeZero's ``Variable.backward`` run on pyengine. Idempotent.

    Graphs recorded before ``install()`` work too (their nodes are made at
    their first backward).
    """
    global _originals
    with _install_lock:
        if _originals is not None:
            return
        for cls, name, _ in _PATCHES:
            if name not in cls.__dict__:
                raise RuntimeError(f"pyengine.adapters.dezero: dezero.core.{cls.__name__} has no "
                                   f"{name}; this DeZero version ({_dezero_version()}) is not supported")
        originals = [(cls, name, cls.__dict__[name]) for cls, name, _ in _PATCHES]
        for cls, name, replacement in _PATCHES:
            setattr(cls, name, replacement)
        _originals = originals


def uninstall():
    """Put DeZero's own methods back (the very objects). Idempotent.

    Nodes already made stay on their Functions and are used again after a
    new ``install()``; DeZero's own loop ignores them.
    """
    global _originals
    with _install_lock:
        if _originals is None:
            return
        for cls, name, original in _originals:
            setattr(cls, name, original)
        _originals = None


def is_installed() -> bool:
    return _originals is not None


def installed():
    """``with installed():`` runs its block with the adapter installed and
    then restores the previous state (it stays installed if it was)."""
    return installed_while(is_installed, install, uninstall)


def _dezero_version():
    import dezero

    return getattr(dezero, "__version__", "unknown")


# -- pyengine's API for DeZero Variables ---------------------------------------------------

class _TensorView:
    """pyengine's tensor protocol, read from a DeZero Variable, so that
    pyengine's own ``grad`` and hook functions serve DeZero.

    ``grad_fn`` and ``output_nr`` come from the creator's node;
    ``requires_grad`` is always true (DeZero differentiates every
    Variable); ``data`` is the Variable itself (gradients are Variables, and
    VariableBackend answers for them); ``grad`` is the Variable's;
    ``_pyengine_leaf``, where pyengine looks for a leaf's LeafState, is the
    Variable's entry in ``_leaf_states``.
    """

    __slots__ = ("variable",)
    requires_grad = True

    def __init__(self, variable):
        self.variable = variable

    @property
    def grad_fn(self):
        creator = self.variable.creator
        return None if creator is None else _node_of(creator)

    @property
    def output_nr(self):
        creator = self.variable.creator
        return 0 if creator is None else _output_nr(creator, self.variable)

    @property
    def data(self):
        return self.variable

    @property
    def grad(self):
        return self.variable.grad

    @grad.setter
    def grad(self, value):
        self.variable.grad = value

    @property
    def _pyengine_leaf(self):
        return _leaf_state(self.variable)

    @_pyengine_leaf.setter
    def _pyengine_leaf(self, state):
        raise AssertionError("a DeZero Variable's LeafState is made by _leaf_state")


def _variables(values, what):
    """``values`` (a Variable or a sequence of them) as a list, checked."""
    if isinstance(values, Variable):
        return [values]
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{what} must be a dezero.Variable or a list or tuple of them, got "
                        f"{type(values).__name__}")
    for index, value in enumerate(values):
        if not isinstance(value, Variable):
            raise TypeError(f"{what}[{index}] must be a dezero.Variable, got {type(value).__name__}")
    return list(values)


def _view(variable, what):
    if not isinstance(variable, Variable):
        raise TypeError(f"{what} must be a dezero.Variable, got {type(variable).__name__}")
    return _TensorView(variable)


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         allow_unused=None, materialize_grads=False):
    """``torch.autograd.grad`` for DeZero Variables: the gradients of
    ``outputs`` with respect to ``inputs``, as a tuple of Variables (or None
    for an unused input with ``allow_unused``); no ``.grad`` is read or
    written. Only the nodes on a path to an input run.

    ``grad_outputs``: Variables or arrays, one per output; None (or a None
    entry) is ``ones_like(output)`` whatever its shape, DeZero's seed. With
    ``create_graph=True`` the results have creators and can be
    differentiated again. ``retain_graph`` defaults to ``create_graph``: a
    released node raises if a later backward reaches it.
    """
    output_list = _variables(outputs, "outputs")
    input_list = _variables(inputs, "inputs")
    if not output_list:
        raise RuntimeError("grad requires non-empty outputs.")
    if not input_list:
        raise RuntimeError("grad requires non-empty inputs.")
    if grad_outputs is None:
        grad_list = [None] * len(output_list)
    elif isinstance(grad_outputs, (list, tuple)):
        grad_list = list(grad_outputs)
    else:
        grad_list = [grad_outputs]
    if len(grad_list) != len(output_list):
        raise RuntimeError(f"got {len(output_list)} outputs and {len(grad_list)} grad_outputs")
    seeds = []
    for index, (output, seed) in enumerate(zip(output_list, grad_list)):
        if seed is None:
            seed = _ones_like(output)
        elif not isinstance(seed, Variable):
            if not isinstance(seed, _dezero_core.array_types):
                raise TypeError(f"grad_outputs[{index}] must be a dezero.Variable, an array or None, "
                                f"got {type(seed).__name__}")
            seed = Variable(seed)
        seeds.append(seed)
    for output in output_list:
        if output.creator is None:
            # The root's sink must be ours, not the AccumulateGrad that
            # pyengine would make for a leaf it meets first.
            _grad_accumulator(output)
    previous_config = Config.enable_backprop
    mode = _dezero_backward.set(None)
    Config.enable_backprop = bool(create_graph)
    try:
        with _on_calling_thread():
            return pyengine.grad([_TensorView(output) for output in output_list],
                                 [_TensorView(variable) for variable in input_list],
                                 grad_outputs=seeds, retain_graph=retain_graph,
                                 create_graph=create_graph, allow_unused=allow_unused,
                                 materialize_grads=materialize_grads)
    finally:
        Config.enable_backprop = previous_config
        _dezero_backward.reset(mode)


def grad_fn(variable):
    """The node that computes ``variable``'s gradient's successors: the
    FunctionNode of its creator, or None for a leaf. Its ``register_hook``,
    ``register_prehook``, ``name()``, ``next_functions`` and ``metadata``
    are pyengine's (PyTorch's) node API."""
    return _view(variable, "variable").grad_fn


def register_hook(variable, hook):
    """``hook(grad) -> new grad or None`` runs when the gradient for
    ``variable`` is computed (for a leaf: summed, before it is accumulated),
    as ``torch.Tensor.register_hook``. Returns a handle with ``remove()``.
    A replacement must keep the gradient's shape, dtype and device."""
    return pyengine.register_tensor_hook(_view(variable, "variable"), hook)


def register_post_accumulate_grad_hook(variable, hook):
    """``hook(variable)`` runs after a gradient was accumulated into the
    leaf ``variable.grad``. Returns a handle with ``remove()``."""
    # DeZeroAccumulateGrad calls the hook with the Variable itself.
    return pyengine.register_post_accumulate_grad_hook(_view(variable, "variable"), hook)


# -- the value backend ------------------------------------------------------------------------

class _Copy(Function):
    """A differentiable copy (the backend's ``copy`` under create_graph)."""

    def forward(self, x):
        return x.copy()

    def backward(self, gy):
        return gy


class _Cast(Function):
    """A differentiable dtype cast (the backend's ``cast`` under create_graph)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def forward(self, x):
        self.input_dtype = x.dtype
        return x.astype(self.dtype)

    def backward(self, gy):
        return _Cast(self.input_dtype)(gy)


class _ToDevice(Function):
    """A differentiable move between the CPU and a cupy device."""

    def __init__(self, device):
        self.device = device

    def forward(self, x):
        self.input_device = _device_of(x)
        return _move(x, self.device)

    def backward(self, gy):
        return _ToDevice(self.input_device)(gy)


def _device_of(data):
    if isinstance(data, (np.ndarray, np.generic)):
        return CPU
    return Device("cuda", data.device.id)


def _move(data, device):
    if device == CPU:
        return _dezero_cuda.as_numpy(data)
    if device.type != "cuda":
        raise ValueError(f"DeZero arrays live on the cpu or on cuda devices, not on {device}")
    import cupy

    with cupy.cuda.Device(device.index):
        return cupy.asarray(data)


def _under_grad_mode(function, *args):
    """``function(*args)`` with DeZero recording exactly when grad mode is on."""
    previous = Config.enable_backprop
    Config.enable_backprop = _core.is_grad_enabled()
    try:
        return function(*args)
    finally:
        Config.enable_backprop = previous


class VariableBackend(pyengine.ArrayBackend):
    """What the engine may do with a gradient that is a DeZero Variable:
    DeZero's own operations, recorded exactly when grad mode is on (under
    ``create_graph``), so that the engine's sums are part of the graph."""

    name = "dezero"

    def shape(self, value):
        return value.data.shape

    def dtype(self, value):
        return value.data.dtype

    def device(self, value):
        return _device_of(value.data)

    def dtype_kind(self, dtype):
        return np.dtype(dtype).kind

    def add(self, a, b):
        return _add(a, b)

    def add_(self, a, b):
        # Only for a value the engine made itself (InputBuffer ownership),
        # never under create_graph; in place only where numpy or cupy would
        # give the out-of-place sum's dtype and shape.
        a_data, b_data = a.data, _data(b)
        if (type(a_data) is type(b_data) and a_data.shape == b_data.shape
                and a_data.dtype == b_data.dtype and getattr(a_data, "flags", None) is not None
                and a_data.flags.writeable):
            a_data += b_data
            return a
        return _add(a, b)

    def sum_to(self, value, shape):
        return _under_grad_mode(_dezero_functions.sum_to, value, tuple(shape))

    def cast(self, value, dtype):
        if _core.is_grad_enabled():
            return _under_grad_mode(_Cast(dtype), value)
        return Variable(value.data.astype(dtype))

    def copy(self, value):
        if _core.is_grad_enabled():
            return _under_grad_mode(_Copy(), value)
        return Variable(value.data.copy())

    def to_device(self, value, device):
        if _device_of(value.data) == device:
            return value
        if _core.is_grad_enabled():
            return _under_grad_mode(_ToDevice(device), value)
        return Variable(_move(value.data, device))

    def zeros(self, shape, dtype, device):
        zeros = np.zeros(shape, dtype=dtype)
        return Variable(zeros if device == CPU else _move(zeros, device))

    def ones_like(self, value):
        return _ones_like(value)

    def has_nan(self, value):
        return bool(_array_module(value.data).isnan(value.data).any())


def _data(value):
    return value.data if isinstance(value, Variable) else value


pyengine.register_backend(Variable, VariableBackend())
