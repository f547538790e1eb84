"""pyengine as the backward engine of Chainer (``chainer`` 7.8.1).

    from pyengine.adapters import chainer as pyengine_chainer
    pyengine_chainer.install()   # Variable.backward, chainer.backward, chainer.grad run on pyengine

``install()`` replaces ``chainer._backprop._backprop_to_all`` (the loop
under ``Variable.backward``, ``chainer.backward`` and ``F.forget``'s
backward) and ``chainer.grad`` (also ``chainer.function_node.grad``);
``uninstall()`` puts the very same functions back; ``installed()`` is the
context manager. Installing twice is harmless. ChainerX arrays are not
Chainer's graph: their backward stays ChainerX's.

Chainer records its graph in forward: each ``VariableNode`` knows its
``creator_node`` (a ``FunctionNode``), and each FunctionNode its ``inputs``
(VariableNodes) and weak references to its ``outputs``. That is an owner
graph in returns mode (See Note [Owner graphs] in
``pyengine/_pure/owner_graph.py``), read when backward runs, with no
pyengine Node made per op: See Note [Chainer as an owner graph]. Each
FunctionNode runs Chainer's own ``_backprop_utils.backprop_step`` (its
``backward`` or ``backward_accumulate``, the checks of debug mode, the
error with the forward stack), between the function hooks'
``backward_preprocess`` and ``backward_postprocess``, under
``chainer.using_device`` of its arrays; each gradient it returns passes
Chainer's ``_check_grad_type`` (same type, dtype and shape as the input:
Chainer's own errors, TypeError or ValueError). Integer gradients are
allowed where the input is of that integer dtype, as in Chainer.

Gradients are Chainer's values, ``chainer.Variable`` s, so that under
``enable_double_backprop=True`` they carry the graph of the backward pass.
While installed, the adapter registers a value backend for
``chainer.Variable`` (:class:`ChainerVariableBackend`) that sums two
gradients with ``chainer.functions.add``, as Chainer's gradient table does,
so the sums are recorded for double backprop and seen by function hooks.

Kept from Chainer: ``retain_grad`` (each function's output gradients are
stored on its output Variables once the function has run), ``loss_scale``
(the root gradient is scaled by Chainer's ``Variable.backward``, and each
leaf that gets a gradient records ``_loss_scale``), a leaf's gradient added
to the ``grad_var`` it already holds (the old gradient enters the sum when
the first function that targets the leaf runs, and is handed to a
``backward_accumulate``, as Chainer's ``GradTable`` does), a leaf whose
Variable is gone gets nothing, ``target_input_indexes`` (inputs that
require grad; under ``chainer.grad``, only those on a path to an
``inputs`` Variable), ``chainer.grad``'s ``grad_outputs`` (ones times
``loss_scale`` where None), ``grad_inputs`` (added to the result),
``set_grad`` and ``retain_grad``, and a multi-output function whose output
got no gradient reads that output's ``grad_var`` instead (and clears it),
as Chainer's legacy rule does.

What differs from Chainer's engine:

- The order: functions run in the reverse of the owner graph's depth-first
  post-order, Chainer's by decreasing rank. Both run a function only once
  every function that consumes its outputs has run, so every gradient is
  the same sum; where three or more gradients meet they may be added in
  another order (float results may differ in the last bits), and function
  hooks see the functions in another order.
- ``lazy_grad_sum``: the gradients of one input are summed as they arrive
  (one ``F.add`` per gradient), not in one ``F.add`` when the input's
  creator runs: the same values, another graph of adds under double
  backprop.
- A leaf's ``.grad`` is written when the engine reaches the leaf (after
  every function that feeds it has run), not all at once when the backward
  ends. So when a function's backward raises, the leaves the engine
  reached before it keep their new ``.grad`` (as PyTorch's leaves do),
  where Chainer leaves every ``.grad`` as it was.
- ``chainer.grad(..., retain_grad=True)``: Chainer also runs the creator of
  an output that is on no path to an ``inputs`` Variable (only to store its
  output gradients); the engine does not run it, so such an output keeps
  its old ``grad``. An ``inputs`` Variable's own gradient is stored, as in
  Chainer.

Each backward is one owner-graph run on the calling thread; ``F.forget``'s
backward runs its own backward from inside a function, reentrantly, one
graph task deeper, as a PyTorch node would.
"""

from __future__ import annotations

import threading

import numpy as np

try:
    import chainer
    import chainer._backprop as _chainer_backprop
    import chainer._backprop_utils as _backprop_utils
    import chainer.function_node as _function_node
    import chainer.functions as F
    import chainer.variable as _chainer_variable
    from chainer import backend as _chainer_backend
except Exception as error:  # pragma: no cover - depends on the environment
    if isinstance(error, ModuleNotFoundError) and error.name == "chainer":
        raise ImportError("pyengine.adapters.chainer needs chainer: pip install chainer==7.8.1") \
            from error
    raise ImportError(f"pyengine.adapters.chainer: chainer is installed but does not import "
                      f"({type(error).__name__}: {error})") from error

import pyengine
from pyengine.adapters import Patches, installed_while
from pyengine.backends import ArrayBackend
from pyengine.device import CPU, Device

__all__ = ["install", "uninstall", "is_installed", "installed", "ChainerVariableBackend"]

Variable = chainer.Variable
VariableNode = _chainer_variable.VariableNode
FunctionNode = chainer.FunctionNode
_ORIGINAL_BACKPROP_TO_ALL = _chainer_backprop._backprop_to_all
_ORIGINAL_GRAD = _function_node.grad


# Note [Chainer as an owner graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The owners are FunctionNodes and the leaves' VariableNodes. A FunctionNode
# has one gradient slot per output (``len(func.outputs)``); its parent items
# are its inputs, in order: None for an input that does not require grad,
# the VariableNode itself for a leaf (no ``creator_node``; one slot), and
# ``(creator, k)`` for an input that is output ``k`` of its creator. So a
# function with several outputs runs once, with all its output gradients,
# as in Chainer. A backward from several outputs (``chainer.backward``,
# ``chainer.grad``) starts at one ``_Outputs`` owner whose parent items are
# theirs and whose "backward" returns their gradients.
#
# Gradients reach the engine as Chainer Variables and are summed by the
# InputBuffer with ChainerVariableBackend.add (``F.add``). Chainer's gradient
# table is the InputBuffer: ``accumulates=True`` hands each function the sums
# its inputs' slots hold so far (Chainer's gradient lists, what
# ``backward_accumulate`` gets as ``grad_inputs``), and what the function
# step returns replaces them, so every sum is the ``F.add`` Chainer makes.
# ``should_compute_output=True`` gives ``target_input_indexes``: under
# backward the inputs that require grad (the others are None items), under
# ``chainer.grad`` those on a path to an input (Chainer's ``grad_required``).
# ``gradient_policy="exact"`` (Chainer's rule: no broadcast reduced, no dtype
# cast, integer gradients allowed) applies to what the engine checks: no
# metadata is given, because ``_run_function`` already makes Chainer's own
# check (``_check_grad_type``, with Chainer's errors, TypeError or
# ValueError) on every gradient, and metadata would check each twice, a
# Python call each.


class _Outputs:
    """The root of a backward from several outputs: its parent items are the
    outputs' items, its gradients the outputs' gradients."""

    __slots__ = ("items", "grads")

    def __init__(self, items, grads):
        self.items = items
        self.grads = grads


def _item_of(node):
    """The parent item for a VariableNode that requires grad."""
    creator = node.creator_node
    if creator is None:
        return node
    outputs = creator.outputs
    if len(outputs) == 1:
        return (creator, 0)
    for k in range(len(outputs)):
        if outputs[k]() is node:
            return (creator, k)
    # Its creator does not list it (edited by hand): Chainer drops its gradient.
    return None


def _parents(owner):
    """Under backward: every input that requires grad. (VariableNode's
    ``requires_grad`` and ``creator_node`` properties return these fields;
    this runs once per function, so it reads them directly.)"""
    if type(owner) is VariableNode:
        return ()
    if type(owner) is _Outputs:
        return owner.items
    items = []
    for x in owner.inputs:
        if not x._requires_grad:
            items.append(None)
            continue
        creator = x._creator_node
        if creator is None:
            items.append(x)
        elif len(creator.outputs) == 1:
            items.append((creator, 0))
        else:
            items.append(_item_of(x))
    return items


def _all_parents(owner):
    """Under chainer.grad: every input; ``should_compute_output`` then says
    which are on a path to an ``inputs`` Variable (Chainer's
    ``grad_required``), an input that does not require grad included."""
    if type(owner) is VariableNode:
        return ()
    if type(owner) is _Outputs:
        return owner.items
    return [_item_of(x) for x in owner.inputs]


def _num_inputs(owner):
    if type(owner) is VariableNode or type(owner) is _Outputs:
        return 1
    return len(owner.outputs)


class _Run:
    """What one backward call knows, read by the owners' callbacks: Chainer
    reads it once per backward."""

    __slots__ = ("retain_grad", "loss_scale", "is_debug", "base_hooks", "is_grad", "plain")

    def __init__(self, retain_grad, loss_scale, is_grad):
        self.retain_grad = retain_grad
        self.loss_scale = loss_scale
        self.is_debug = chainer.is_debug()
        self.base_hooks = chainer.get_function_hooks().values()
        # chainer.grad (True) or backward: backward's GradTable reads a
        # leaf's grad_var into its sum and chainer.grad's does not; they
        # store retained gradients at different times.
        self.is_grad = is_grad
        # No global hook, no debug mode, no gradient to store after a step:
        # a function may take _backward_step.
        self.plain = (not self.base_hooks and not self.is_debug
                      and (is_grad or not retain_grad))


# Each thread's backward calls under way, innermost last (F.forget runs one
# inside another).
_runs = threading.local()


def _is_cpu(arrays):
    for array in arrays:
        if array is not None and type(array) is not np.ndarray:
            return False
    return True


def _load_leaf_grad(node):
    """Chainer's ``_grad_var_from_alive_node``: the grad_var of a leaf's
    Variable, taken off it (None when there is none)."""
    var = node._variable()
    if var is None:
        return None
    grad_var = var.grad_var
    if grad_var is not None:
        var.grad_var = None
    return grad_var


def _check_gradient(func, node, grad):
    """Chainer's ``_check_grad_type`` of a gradient for ``node``, called only
    where the common case (a numpy array of the node's dtype and shape, the
    node's data numpy or not kept) does not already pass it."""
    array = grad.raw_array
    if (type(array) is np.ndarray and node._layout is None and array.dtype == node.dtype
            and array.shape == node.shape
            and (node._data is None or type(node._data) is np.ndarray)):
        return
    _chainer_variable._check_grad_type(func, node, True, array)


def _run_function(func, grads, should_compute_output, buffered):
    """The owner graph's backward: one step of Chainer's loop for ``func``,
    given its output gradients, which inputs are targets, and the sums
    their gradient lists hold so far; the new sums, one per input (See
    Note [Chainer as an owner graph])."""
    if type(func) is _Outputs:
        return func.grads
    run = _runs.stack[-1]
    inputs = func.inputs
    if len(grads) == 1:
        out_grad = (grads[0],)
    else:
        out_grad = _output_gradients(func, grads, run)
    if run.is_grad and run.retain_grad:
        _retain(func.outputs, out_grad, run, True)
    target_input_indexes = tuple([i for i in range(len(inputs)) if should_compute_output[i]])
    if not target_input_indexes:
        return buffered
    # Chainer's gradient lists: the sum so far, or (backward, a leaf met for
    # the first time) the grad_var the leaf already holds.
    in_grad = {}
    for i in target_input_indexes:
        x = inputs[i]
        if x not in in_grad:
            old = buffered[i]
            if old is None and not run.is_grad and x._creator_node is None:
                x._check_old_style_gradient()
                old = _load_leaf_grad(x)
            in_grad[x] = [] if old is None else [old]
    if (run.plain and len(target_input_indexes) == 1 and func._local_function_hooks is None
            and _on_cpu(inputs, out_grad)
            and func.backward_accumulate.__code__ is _BASE_BACKWARD_ACCUMULATE_CODE):
        return _backward_step(func, target_input_indexes, out_grad, in_grad, buffered)

    in_data = [x._data for x in inputs]  # VariableNode.data returns _data
    out_grad_array = [None if g is None else _array_of(g) for g in out_grad]
    if func._n_local_function_hooks != 0:
        local_hooks = dict(chainer.get_function_hooks())
        local_hooks.update(func.local_function_hooks)
        hooks = local_hooks.values()
    else:
        hooks = run.base_hooks
    device_arrays = in_data if run.is_grad else in_data + out_grad_array
    if not hooks and _is_cpu(device_arrays):
        # using_device of the CPU is a context that does nothing.
        _backprop_utils.backprop_step(func, target_input_indexes, out_grad, in_grad,
                                      run.is_debug)
    else:
        with chainer.using_device(_chainer_backend.get_device_from_array(*device_arrays)):
            for hook in hooks:
                hook.backward_preprocess(func, tuple(in_data), tuple(out_grad_array))
            _backprop_utils.backprop_step(func, target_input_indexes, out_grad, in_grad,
                                          run.is_debug)
            for hook in hooks:
                hook.backward_postprocess(func, tuple(in_data), tuple(out_grad_array))
    if not run.is_grad and run.retain_grad:
        _retain(func.outputs, out_grad, run, False)

    result = list(buffered)
    for i in target_input_indexes:
        gx = in_grad.pop(inputs[i], None)
        if not gx:
            continue
        for gx_elem in gx:
            _check_gradient(func, inputs[i], gx_elem)
        # lazy_grad_sum leaves several: See the module docstring.
        result[i] = gx[0] if len(gx) == 1 else F.add(*gx)
    return result


def _output_gradients(func, grads, run):
    """The output gradients of a function with several outputs; under
    backward, Chainer's legacy rule: an output no gradient reached gives the
    grad_var its Variable holds, taken off it."""
    out_grad = list(grads)
    if not run.is_grad:
        outputs = func.outputs
        for k in range(len(out_grad)):
            if out_grad[k] is None:
                y = outputs[k]()
                if y is not None and y._creator_node is not None:
                    out_grad[k] = _load_leaf_grad(y)
    return tuple(out_grad)


def _on_cpu(inputs, out_grad):
    """Whether every array Chainer would pick a device from is numpy's (or
    absent), so that its ``using_device`` would do nothing."""
    for x in inputs:
        if x._data is not None and type(x._data) is not np.ndarray:
            return False
    for g in out_grad:
        if g is not None and type(_array_of(g)) is not np.ndarray:
            return False
    return True


def _array_of(grad):
    """The array of a gradient: a Variable's, or the array itself
    (``chainer.grad`` takes arrays as ``grad_outputs`` too)."""
    return grad.raw_array if isinstance(grad, Variable) else grad


_BASE_BACKWARD_ACCUMULATE_CODE = FunctionNode.backward_accumulate.__code__


def _backward_step(func, target_input_indexes, out_grad, in_grad, buffered):
    """``backprop_step`` for one target input and a plain ``backward``, with
    no hook, on the CPU, out of debug mode (what most functions are): the
    same calls, checks and errors, without the lists."""
    try:
        gxs = func.backward(target_input_indexes, out_grad)
    except Exception as error:
        _backprop_utils._reraise_with_stack(func, error)
    i = target_input_indexes[0]
    len_gxs = len(gxs)
    if len_gxs == len(func.inputs):
        gx = gxs[i]
    elif len_gxs == 1:
        gx = gxs[0]
    else:
        message = "number of gradients returned from backward is incorrect: "
        if len(func.inputs) == 1:
            message += f"{len_gxs} != expected {len(func.inputs)}"
        else:
            message += f"{len_gxs} != expected {len(func.inputs)} or 1"
        raise ValueError(func._get_error_message(message))
    x = func.inputs[i]
    old, = in_grad[x] or (None,)
    result = list(buffered)
    if gx is None or gx.raw_array is None:
        result[i] = old
        return result
    _check_gradient(func, x, gx)
    result[i] = gx if old is None else F.add(old, gx)
    return result


def _retain(outputs, out_grad, run, in_grad_call):
    """retain_grad: the output gradients stored on the output Variables, as
    ``_backprop_to_all`` (after the step) or ``chainer.grad`` (before it, with
    the check and the loss scale) does."""
    for k in range(len(outputs)):
        node = outputs[k]()
        if node is None:
            continue
        if in_grad_call:
            y = node.get_variable_or_none()
            if y is not None:
                y.grad_var = out_grad[k]
                y._loss_scale = run.loss_scale
        else:
            node._set_grad_var_if_available(out_grad[k])


def _accumulate(leaf, grad):
    """A leaf's summed gradient, set as Chainer sets it when backward ends:
    added to a grad_var still there, with the loss scale recorded."""
    var = leaf._variable() if type(leaf) is VariableNode else None
    if var is None:
        return
    old = var.grad_var
    if old is not None:
        grad = F.add(old, grad)
    var._set_grad_var_without_check(grad)
    var._loss_scale = _runs.stack[-1].loss_scale


# See Note [Chainer as an owner graph].
_GRAPH = pyengine.OwnerGraph(_parents, _run_function, mode="returns", num_inputs=_num_inputs,
                             accumulate=_accumulate, should_compute_output=True,
                             accumulates=True, gradient_policy="exact")
_GRAD_GRAPH = pyengine.OwnerGraph(_all_parents, _run_function, mode="returns",
                                  num_inputs=_num_inputs, should_compute_output=True,
                                  accumulates=True, gradient_policy="exact")


def _run_graph(graph, root, grad, inputs, retain_grad, loss_scale, is_grad):
    """``graph.backward(root, grad)`` (or ``graph.grad`` with ``inputs``)
    with this call's _Run innermost on the thread's stack."""
    stack = getattr(_runs, "stack", None)
    if stack is None:
        stack = _runs.stack = []
    depth = len(stack)
    try:
        # Inside the try, and the stack cut back to its depth: Ctrl-C may
        # come out as append returns (See Note [What an adapter sets around
        # a backward] in pyengine/adapters/__init__.py).
        stack.append(_Run(retain_grad, loss_scale, is_grad))
        if inputs is None:
            return graph.backward(root, grad)
        return graph.grad(root, grad, inputs, allow_unused=True)
    finally:
        del stack[depth:]


def _root_of(nodes_and_grads):
    """The root item and its gradient for ``(VariableNode, grad)`` pairs: the
    output's own item for one, an ``_Outputs`` for several."""
    if len(nodes_and_grads) == 1:
        node, grad = nodes_and_grads[0]
        return _item_of(node), grad
    items = [_item_of(node) for node, _ in nodes_and_grads]
    return _Outputs(items, [grad for _, grad in nodes_and_grads]), _ROOT_SEED


# The gradient of an _Outputs root: any value; its backward ignores it.
_ROOT_SEED = np.zeros(())


def backprop_to_all(outputs, retain_grad, loss_scale):
    """Chainer's ``_backprop_to_all(outputs, retain_grad, loss_scale)`` on
    pyengine (installed as ``chainer._backprop._backprop_to_all``):
    ``outputs`` are ``(VariableNode, gradient Variable)`` pairs."""
    pairs = []
    for node, grad in outputs:
        if node._creator_node is None:
            # Chainer's gradient table reads a leaf output's own grad_var.
            node._check_old_style_gradient()
        if grad is None:
            if node._creator_node is not None:
                pairs += _first_step_without_gradient(node, retain_grad, loss_scale)
                continue
            # A leaf with no gradient: Chainer sets its grad to None.
            var = node.get_variable_or_none()
            if var is not None:
                var._set_grad_var_without_check(None)
                var._loss_scale = loss_scale
            continue
        pairs.append((node, grad))
    if not pairs:
        return
    root, grad = _root_of(pairs)
    if root is None:
        return
    _run_graph(_GRAPH, root, grad, None, retain_grad, loss_scale, False)


def _first_step_without_gradient(node, retain_grad, loss_scale):
    """A root with no gradient at all (``Variable.backward`` of a non-scalar
    with no ``grad``): Chainer still runs its creator's step, with None
    gradients, and most functions raise there; what a function returns
    instead flows on: ``(input node, gradient)`` pairs."""
    func = node._creator_node
    items = _parents(func)
    should_compute_output = tuple([item is not None for item in items])
    stack = getattr(_runs, "stack", None)
    if stack is None:
        stack = _runs.stack = []
    depth = len(stack)
    try:
        # As _run_graph's.
        stack.append(_Run(retain_grad, loss_scale, False))
        gxs = _run_function(func, [None] * len(func.outputs), should_compute_output,
                            (None,) * len(items))
    finally:
        del stack[depth:]
    return [(func.inputs[i], gxs[i]) for i in range(len(items))
            if items[i] is not None and gxs[i] is not None]


def _check_gradients_for(name, gradients, values_name, values):
    """``chainer.grad``'s check of ``grad_outputs`` / ``grad_inputs``, with
    its errors: None, or a tuple or list as long as ``values``."""
    if gradients is None:
        return
    if not isinstance(gradients, (tuple, list)):
        raise TypeError(f"{name} must be a tuple or a list or None, not {type(gradients)}.")
    if len(values) != len(gradients):
        raise ValueError(f"{name} must be of the same length as {values_name}.\n"
                         f"len({values_name}) = {len(values)}, len({name}) = {len(gradients)}")


def grad(outputs, inputs, grad_outputs=None, grad_inputs=None, set_grad=False,
         retain_grad=False, enable_double_backprop=False, loss_scale=None):
    """``chainer.grad`` on pyengine (installed as ``chainer.grad`` and
    ``chainer.function_node.grad``): the same arguments, checks and
    result."""
    if not isinstance(outputs, (tuple, list)):
        raise TypeError(f"outputs must be a tuple or a list, not {type(outputs)}.")
    if not isinstance(inputs, (tuple, list)):
        raise TypeError(f"inputs must be a tuple or a list, not {type(inputs)}.")
    if any(x is not None and x._has_chainerx_array for x in inputs):
        return _ORIGINAL_GRAD(outputs, inputs, grad_outputs, grad_inputs, set_grad, retain_grad,
                              enable_double_backprop, loss_scale)
    _check_gradients_for("grad_outputs", grad_outputs, "outputs", outputs)
    _check_gradients_for("grad_inputs", grad_inputs, "inputs", inputs)
    for v in outputs:
        v.node._check_old_style_gradient()

    if grad_outputs is None:
        grad_outputs = (None,) * len(outputs)
    # Chainer's gradient table, set (not summed) per node: an output given
    # twice starts with its last gradient, as in Chainer (torch.autograd.grad
    # would sum both).
    table = {}
    for y, gy in zip(outputs, grad_outputs):
        if gy is None:
            with chainer.using_device(y.device):
                gy = Variable(y.device.xp.ones_like(y.array), requires_grad=False)
                if loss_scale is not None:
                    gy.data *= loss_scale
        table[y.node] = gy
    if grad_inputs is not None:
        # The table starts with them too: they are summed into the inputs'
        # gradients and flow on from there.
        for x, gx in zip(inputs, grad_inputs):
            if gx is not None:
                table[x.node] = gx
    root, seed = _root_of(list(table.items()))
    input_items = [_item_of(x.node) for x in inputs]
    with chainer.using_config("enable_backprop", enable_double_backprop):
        if root is None or all(item is None for item in input_items):
            result = [None] * len(inputs)
        else:
            wanted = [item for item in input_items if item is not None]
            captured = iter(_run_graph(_GRAD_GRAPH, root, seed, wanted, retain_grad, loss_scale,
                                       True))
            result = [None if item is None else next(captured) for item in input_items]
    if retain_grad:
        # Chainer runs the creator of an input even where it is on no path
        # to an input, and stores the input's gradient then; the engine
        # captures it without running the creator.
        for x, gx in zip(inputs, result):
            if x.creator_node is not None:
                x.grad_var = gx
                x._loss_scale = loss_scale
    if set_grad:
        for x, gx in zip(inputs, result):
            x.grad_var = gx
    return result


# -- the value backend of Chainer's gradients ----------------------------------------------

class ChainerVariableBackend(ArrayBackend):
    """The value backend of ``chainer.Variable`` gradients while the adapter
    is installed: Chainer's addition (``F.add``, out of place, recorded under
    double backprop), the device of the array inside. The engine gives no
    metadata for Chainer's graph, so nothing asks it to reshape, cast or
    move a gradient."""

    name = "chainer"

    def shape(self, value):
        return value.shape

    def dtype(self, value):
        return value.dtype

    def device(self, value):
        array = value.raw_array
        if type(array) is np.ndarray:
            return CPU
        device = _chainer_backend.get_device_from_array(array)
        if device.xp is np:
            return CPU
        return Device("cuda", device.device.id)

    def dtype_kind(self, dtype):
        return np.dtype(dtype).kind

    def add(self, a, b):
        return F.add(a, b)

    def add_(self, a, b):
        # Chainer never adds into a gradient.
        return F.add(a, b)

    def ones_like(self, value):
        return Variable(value.xp.ones_like(value.array), requires_grad=False)

    def zeros(self, shape, dtype, device):
        if device == CPU:
            return Variable(np.zeros(shape, dtype), requires_grad=False)
        import cupy
        with cupy.cuda.Device(device.index):
            return Variable(cupy.zeros(shape, dtype), requires_grad=False)

    def has_nan(self, value):
        return bool(value.xp.isnan(value.array).any())

    def copy(self, value):
        return Variable(value.array.copy(), requires_grad=value.requires_grad)

    def _unsupported(self, what):
        raise NotImplementedError(f"the chainer adapter's gradients cannot be {what}: Chainer "
                                  "requires a gradient of the input's own shape and dtype")

    def sum_to(self, value, shape):
        self._unsupported("reduced to a shape")

    def cast(self, value, dtype):
        self._unsupported("cast")

    def to_device(self, value, device):
        self._unsupported("moved to a device")


_BACKEND = ChainerVariableBackend()


# -- install --------------------------------------------------------------------------------

def _unsupported():
    return "this chainer version is not supported (pyengine.adapters.chainer needs 7.8)"


_PATCHES = Patches("pyengine.adapters.chainer",
                   ((_chainer_backprop, "_backprop_to_all", backprop_to_all),
                    (_function_node, "grad", grad),
                    (chainer, "grad", grad)), _unsupported)

_lock = threading.RLock()
# The backend registered for chainer.Variable before install(), or None;
# guarded by _lock.
_replaced_backend = [None]


def install():
    """Make Chainer's backward run on pyengine. Idempotent."""
    with _lock:
        if _PATCHES.is_installed():
            return
        _PATCHES.install()
        _replaced_backend[0] = pyengine.register_backend(Variable, _BACKEND)


def uninstall():
    """Put Chainer's own functions and the replaced value backend back.
    Idempotent."""
    with _lock:
        if not _PATCHES.is_installed():
            return
        _PATCHES.uninstall()
        current = pyengine.unregister_backend(Variable)
        if current is not _BACKEND:
            # Registered over by someone else since: theirs stays.
            pyengine.register_backend(Variable, current)
        elif _replaced_backend[0] is not None:
            pyengine.register_backend(Variable, _replaced_backend[0])
        _replaced_backend[0] = None


def is_installed() -> bool:
    return _PATCHES.is_installed()


def installed():
    """``with installed():`` runs its block with the adapter installed and
    then restores the previous state (it stays installed if it was)."""
    return installed_while(is_installed, install, uninstall)
