"""Hooks: around ``apply`` in PyTorch's order, and after a leaf's
accumulation (post-accumulate-grad hooks); and anomaly mode's checks.

Shared by the compiled core and the twin (See Note [Slow paths are
shared]): the compiled engine runs a node without hooks itself and comes
here only for a node that has some; the twin comes here for every node.
Each core passes its own ``validate_outputs`` to ``call_function``.
"""

from ..backends import backend_of
from ..indexed import IndexedGradient
from .messages import node_name


def _hook_name(hook):
    return getattr(hook, "__name__", repr(hook))


def _check_hook_value(node, hook, index, original, result):
    """A hook may replace a gradient only by one of the same shape, dtype, device."""
    if original is None:
        raise RuntimeError(f"hook '{_hook_name(hook)}' on {node_name(node)} can't replace a None "
                           f"gradient with a non-None value at index {index}")
    old, new = backend_of(original), backend_of(result)
    if new is None:
        raise TypeError(f"hook '{_hook_name(hook)}' on {node_name(node)} returned "
                        f"{type(result).__name__} at index {index}, expected an array")
    for what, get in (("shape", "shape"), ("dtype", "dtype"), ("device", "device")):
        was, got = getattr(old, get)(original), getattr(new, get)(result)
        if was != got:
            raise RuntimeError(f"hook '{_hook_name(hook)}' on {node_name(node)} has changed the "
                               f"{what} of the gradient at index {index} (was {was}, got {got})")


def _apply_hook_results(node, hook, values, results):
    """The gradients a node pre- or post-hook returned in place of ``values``.

    As in PyTorch, the tuple replaces them all: a ``None`` entry means no
    gradient; any other entry must match the original's shape, dtype, device.
    """
    if not isinstance(results, (tuple, list)):
        raise TypeError(f"hook '{_hook_name(hook)}' on {node_name(node)} must return a tuple of "
                        f"gradients or None, got {type(results).__name__}")
    if len(results) != len(values):
        raise RuntimeError(f"hook '{_hook_name(hook)}' on {node_name(node)} has returned an "
                           f"incorrect number of values (got {len(results)}, but expected {len(values)})")
    for i, result in enumerate(results):
        if result is not None and result is not values[i]:
            _check_hook_value(node, hook, i, values[i], result)
    return list(results)


# Note [Hooks a running hook or node may change]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A hook or ``apply`` may register or remove hooks of the node that runs it
# (``remove()`` rebinds a node's hook list, and sets it to None once it is
# empty). PyTorch keeps one dict per kind of hook (one per tensor for tensor
# hooks) and reads each when its turn comes, iterating a snapshot of it; so
# does the engine here: a kind of hook is read when its turn comes, never
# before, and its list is copied before its first hook runs. So a hook
# removed before its kind's turn is not called; one removed by an earlier
# hook of the same kind (the same slot, for tensor hooks) still is. The
# tensor hooks of one slot run together, slots in the order in which each
# first got a hook (PyTorch's hook dict per tensor): ``register_tensor_prehook``
# keeps the list in that order.
#
# One difference is deliberate: post hooks run only if the node had some
# when it started (``apply`` gets a copy of its inputs for them). PyTorch
# also calls a post hook that ``apply`` registered on a node that had none,
# with empty ``grad_outputs``; the compiled engine runs a node without hooks
# without coming here, and reading the node's hooks again after every
# ``apply`` is a cost on every node for that corner.


def call_tensor_pre_hooks(node, grads):
    """Tensor hooks, slot by slot, then the retains-grad hooks (always last).
    A tensor hook is called for a slot that received no gradient too, with
    None (it may not replace it), as in PyTorch. See Note [Hooks a running
    hook or node may change]."""
    hooks = node._tensor_pre_hooks
    if hooks:
        slots = []
        for _, input_nr, _ in hooks:
            if input_nr not in slots:
                slots.append(input_nr)
        for input_nr in slots:
            hooks = node._tensor_pre_hooks
            if not hooks:
                break
            if input_nr >= len(grads):
                continue
            for hook in [entry[2] for entry in hooks if entry[1] == input_nr]:
                grad = grads[input_nr]
                result = hook(grad)
                if result is not None:
                    _check_hook_value(node, hook, input_nr, grad, result)
                    grads[input_nr] = result
    if node._retains_grad_hooks:
        for input_nr, hook in list(node._retains_grad_hooks.items()):
            if input_nr < len(grads) and grads[input_nr] is not None:
                hook(grads[input_nr])
    return grads


def has_indexed(grads):
    """Whether an IndexedGradient is among ``grads``."""
    for grad in grads:
        if type(grad) is IndexedGradient:
            return True
    return False


def densify_inputs(node, grads):
    """Densify the IndexedGradients in ``grads`` (a list, edited in place)
    unless ``node`` accepts them: See Note [Where an indexed gradient goes]
    in ``pyengine/indexed.py``. Called once the node's pre-hooks ran."""
    if getattr(node, "accepts_indexed_gradients", False):
        return
    for i, grad in enumerate(grads):
        if type(grad) is IndexedGradient:
            grads[i] = grad.to_dense()


def outputs_as_list(node, outputs):
    """What ``node.apply`` returned, as a list (a tuple is copied); anything
    else is a TypeError naming the node."""
    if type(outputs) is not list:
        if not isinstance(outputs, (tuple, list)):
            raise TypeError(f"Function {node_name(node)}.apply must return a tuple or list of "
                            f"gradients, got {type(outputs).__name__}")
        outputs = list(outputs)
    return outputs


def returned_error_format(node):
    """``validate_outputs``' ``format_error`` for the gradients ``node`` returned."""
    return lambda message: f"Function {node_name(node)} returned an {message}"


def call_function(graph_task, node, grads, next_edges, validate_outputs):
    """Hooks and ``apply`` on ``grads`` (the node's InputBuffer's list), in
    PyTorch's order: tensor pre-hooks, retains-grad hooks, node pre-hooks,
    ``apply``, ``validate_outputs`` (the calling core's), node post-hooks.
    ``next_edges``: the node's edges from before it ran, which the engine
    routes the gradients along. See Note [Next edges while a node runs] in
    ``pyengine/_pure/engine.py``. Hook lists are read when their turn
    comes: See Note [Hooks a running hook or node may change].
    IndexedGradients are densified after the pre-hooks (``densify_inputs``)."""
    if node._tensor_pre_hooks or node._retains_grad_hooks:
        grads = call_tensor_pre_hooks(node, grads)
    pre_hooks = node._pre_hooks
    if pre_hooks:
        for _, hook in list(pre_hooks):
            result = hook(tuple(grads))
            if result is not None:
                grads = _apply_hook_results(node, hook, grads, result)
    # A function, not a loop here: a loop variable would keep the last
    # gradient alive, and AccumulateGrad could no longer steal it.
    if has_indexed(grads):
        densify_inputs(node, grads)
    had_post_hooks = bool(node._post_hooks)
    # apply may edit the list it gets; post-hooks must see the inputs unchanged.
    outputs = node.apply(list(grads) if had_post_hooks else grads)
    outputs = outputs_as_list(node, outputs)
    validate_outputs(next_edges, outputs, returned_error_format(node), node=node)
    post_hooks = node._post_hooks if had_post_hooks else None
    if post_hooks:
        grad_outputs = tuple(grads)
        for _, hook in list(post_hooks):
            result = hook(tuple(outputs), grad_outputs)
            if result is not None:
                outputs = _apply_hook_results(node, hook, outputs, result)
    return outputs


def check_nan(node, outputs):
    """Anomaly mode's NaN check on the gradients a node returned."""
    for i, output in enumerate(outputs):
        if output is not None and backend_of(output).has_nan(output):
            raise RuntimeError(f"Function '{node_name(node)}' returned nan values in its {i}th output.")


def add_anomaly_note(error, node):
    """Name the failing node, with its forward traceback, on ``error`` (anomaly mode)."""
    metadata = getattr(node, "_metadata", None) or {}
    traceback = metadata.get("traceback_")
    note = f"Error detected in {node_name(node)}."
    if traceback:
        note += f" Traceback of forward call that caused the error:\n{traceback}"
    else:
        note += (" No forward pass information available. Enable detect anomaly during "
                 "forward pass for more information.")
    add_note(error, note)


# Note [Error notes before Python 3.11]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Anomaly mode names the failing node and its forward traceback on the error
# the node raised, with ``BaseException.add_note`` (PEP 678), which exists from
# Python 3.11. Before 3.11 the same note goes where PEP 678 says backports put
# it, the error's ``__notes__`` list, so code that reads the notes works on
# every version. Those Pythons' traceback printing does not show
# ``__notes__``, though, and the note is for a person reading a traceback, so
# there it is also appended to the message, on its own line, where the
# message is the error's one string argument (``str(error)`` is then the
# message and the note). An error that words its message otherwise (a
# ``__str__`` of its own, as KeyError's, or several arguments) keeps it, and
# keeps the note in ``__notes__`` only.

_HAS_ADD_NOTE = hasattr(BaseException, "add_note")


def add_note(error, note):
    """``error.add_note(note)`` on every Python pyengine supports. See Note
    [Error notes before Python 3.11]."""
    if _HAS_ADD_NOTE:
        error.add_note(note)
    else:
        add_note_without_add_note(error, note)


def add_note_without_add_note(error, note):
    """What :func:`add_note` does before Python 3.11, where exceptions have no
    ``add_note``; a function of its own so that every version tests it."""
    if not isinstance(note, str):
        raise TypeError(f"note must be a str, not {type(note).__name__}")
    notes = getattr(error, "__notes__", None)
    if notes is None:
        error.__notes__ = notes = []
    if not isinstance(notes, list):
        raise TypeError("Cannot add note: __notes__ is not a list")
    notes.append(note)
    if (type(error).__str__ is BaseException.__str__ and len(error.args) == 1
            and isinstance(error.args[0], str)):
        error.args = (f"{error.args[0]}\n{note}",)


# Note [Post accumulate grad hooks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# As in PyTorch 2.13, an AccumulateGrad that runs calls its leaf's
# post-accumulate-grad hooks whether or not a gradient arrived (a node
# returned None for the leaf): ``.grad`` is then as it was, maybe None. The
# hooks are read when the accumulation is done and copied before the first
# runs, so a hook that removes a later one does not stop it this time. A
# hook must return None: as PyTorch's ``_call_hooks``, a hook that returns
# anything else than None or its argument hands that value to the next
# hook; a value of another type than the leaf's is a TypeError at once,
# and once every hook ran, a returned value is a RuntimeError.


def call_post_accumulate_grad_hooks(variable, hooks):
    """Run ``hooks`` (a leaf's ``(handle_id, fn)`` list) on ``variable``.
    See Note [Post accumulate grad hooks]."""
    argument = variable
    returned = False
    for _, hook in list(hooks):
        result = hook(argument)
        if result is None or result is argument:
            continue
        if not isinstance(result, type(variable)):
            raise TypeError(f"expected {type(variable).__name__}, but post accumulate grad hook "
                            f"'{getattr(hook, '__name__', repr(hook))}' returned "
                            f"'{type(result).__name__}'")
        argument = result
        returned = True
    if returned:
        raise RuntimeError("Tensor post accumulate grad hooks should return None.")
