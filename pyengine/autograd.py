"""The public API: ``backward``, ``grad``, and the tensor protocol they read.

A framework's tensor needs: ``grad_fn`` (a Node or None), ``output_nr`` (which
output of ``grad_fn`` it is), ``requires_grad``, a writable ``grad``, and its
array value as ``data``. Leaves (``grad_fn is None`` and ``requires_grad``)
get their gradient through an :class:`AccumulateGrad` made on first use and
kept, weakly, in the :class:`~pyengine.node.LeafState` that pyengine
stores on the tensor as ``_pyengine_leaf``: the tensor must accept that
attribute. An
:class:`Edge` (PyTorch's GradientEdge) may stand wherever a tensor does.

Errors follow PyTorch's texts, so a user coming from ``torch.autograd`` can
search them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator

import numpy as np

from . import node as _node
from .backends import backend_of, backend_to_add, check_backend_result, no_backend_to_copy
from .engine import get_default_engine
from .node import AccumulateGrad, Edge, Node, RemovableHandle, leaf_state

__all__ = [
    "backward",
    "grad",
    "gradient_edge",
    "grad_accumulator",
    "register_tensor_hook",
    "register_post_accumulate_grad_hook",
    "retain_grad",
]


# -- the tensor protocol ----------------------------------------------------------

def grad_accumulator(tensor) -> AccumulateGrad:
    """The AccumulateGrad of a leaf that requires grad, made on first use."""
    if getattr(tensor, "grad_fn", None) is not None:
        raise RuntimeError("grad_accumulator() is only valid for leaf tensors")
    if not getattr(tensor, "requires_grad", False):
        raise RuntimeError("grad_accumulator() of a tensor that does not require grad")
    state = leaf_state(tensor)
    with state.lock:
        accumulator = state.accumulator() if state.accumulator is not None else None
        if accumulator is None:
            _check_can_require_grad(tensor)
            accumulator = AccumulateGrad(tensor)
            # Weak: the accumulator holds the tensor, the graph holds the accumulator.
            state.accumulator = weakref.ref(accumulator)
    return accumulator


def _check_can_require_grad(tensor):
    """PyTorch refuses ``requires_grad`` on a tensor of another dtype than a
    floating or complex one; pyengine cannot see that flag set, so it refuses
    such a leaf where the engine first meets it, its accumulator."""
    value = getattr(tensor, "data", None)
    backend = backend_of(value)
    if backend is not None and backend.dtype_kind(backend.dtype(value)) not in ("f", "c"):
        raise RuntimeError("only Tensors of floating point and complex dtype can require gradients "
                           f"(a leaf of dtype {backend.dtype(value)} requires grad)")


def _try_get_grad_accumulator(tensor):
    state = getattr(tensor, "_pyengine_leaf", None)
    if state is None or state.accumulator is None:
        return None
    return state.accumulator()


def gradient_edge(tensor) -> Edge | None:
    """Where a gradient for ``tensor`` enters the graph, or None if it does not
    require grad."""
    if isinstance(tensor, Edge):
        return tensor
    grad_fn = getattr(tensor, "grad_fn", None)
    if grad_fn is not None:
        return Edge(grad_fn, getattr(tensor, "output_nr", 0))
    if getattr(tensor, "requires_grad", False):
        return Edge(grad_accumulator(tensor), 0)
    return None


# -- tensor hooks -------------------------------------------------------------------

def register_tensor_hook(tensor, fn) -> RemovableHandle:
    """``fn(grad) -> new grad or None`` runs when a gradient for ``tensor`` is
    computed, before it is accumulated or flows on."""
    if not getattr(tensor, "requires_grad", False):
        raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
    grad_fn = getattr(tensor, "grad_fn", None)
    if grad_fn is not None:
        return grad_fn.register_tensor_prehook(getattr(tensor, "output_nr", 0), fn)
    hooks = leaf_state(tensor)

    # See Note [Hook lists are rebound under one lock] in pyengine/node.py.
    def remove(handle_id):
        with _node.HOOK_LISTS_LOCK:
            hooks.tensor_pre_hooks = [entry for entry in hooks.tensor_pre_hooks or ()
                                      if entry[0] != handle_id] or None
            _sync_accumulator_hooks(tensor, hooks)

    handle = RemovableHandle(remove)
    with _node.HOOK_LISTS_LOCK:
        hooks.tensor_pre_hooks = (hooks.tensor_pre_hooks or []) + [(handle.id, 0, fn)]
        _sync_accumulator_hooks(tensor, hooks)
    return handle


def _sync_accumulator_hooks(tensor, hooks):
    accumulator = _try_get_grad_accumulator(tensor)
    if accumulator is not None:
        accumulator._tensor_pre_hooks = hooks.tensor_pre_hooks


def register_post_accumulate_grad_hook(tensor, fn) -> RemovableHandle:
    """``fn(tensor)`` runs after a gradient was accumulated into leaf ``tensor.grad``."""
    if getattr(tensor, "grad_fn", None) is not None:
        raise RuntimeError("post accumulate grad hooks cannot be registered on non-leaf tensors")
    if not getattr(tensor, "requires_grad", False):
        raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
    hooks = leaf_state(tensor)

    # See Note [Hook lists are rebound under one lock] in pyengine/node.py.
    def remove(handle_id):
        with _node.HOOK_LISTS_LOCK:
            hooks.post_accumulate_grad_hooks = [
                entry for entry in hooks.post_accumulate_grad_hooks or ()
                if entry[0] != handle_id] or None

    handle = RemovableHandle(remove)
    with _node.HOOK_LISTS_LOCK:
        hooks.post_accumulate_grad_hooks = ((hooks.post_accumulate_grad_hooks or [])
                                            + [(handle.id, fn)])
    return handle


def retain_grad(tensor) -> None:
    """Make a non-leaf ``tensor`` keep its gradient in ``.grad`` (summed over
    backward calls, as PyTorch does); a no-op on a leaf."""
    grad_fn = getattr(tensor, "grad_fn", None)
    if grad_fn is None:
        if not getattr(tensor, "requires_grad", False):
            raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
        return
    try:
        tensor_ref = weakref.ref(tensor)
    except TypeError:
        # Not weakly referenceable: the hook keeps the tensor alive with its graph.
        tensor_ref = lambda: tensor  # noqa: E731
    # Several threads may run backward through the tensor's node at once (a
    # retained graph): the read, add and write of .grad must be one step,
    # or one thread's sum overwrites another's. The lock is the tensor's
    # LeafState's, which guards .grad as it does for a leaf's
    # AccumulateGrad; for a tensor that cannot keep a LeafState, this
    # hook's own (the hook is the only writer of .grad the engine has).
    try:
        lock = leaf_state(tensor).lock
    except AttributeError:
        lock = threading.Lock()

    def retains_grad_hook(new_grad):
        owner = tensor_ref()
        if owner is None:
            return
        with lock:
            old_grad = owner.grad
            # Stored only once it is a value: See Note [What a backend
            # returns] in pyengine/backends.py.
            if old_grad is None:
                backend = backend_of(new_grad)
                if backend is None:
                    raise no_backend_to_copy(new_grad, "the tensor's .grad")
                owner.grad = check_backend_result(backend.copy(new_grad), backend, "copy",
                                                  "the tensor's .grad")
            else:
                backend = backend_to_add(old_grad, "the tensor's .grad")
                owner.grad = check_backend_result(backend.add(old_grad, new_grad), backend, "add",
                                                  "the tensor's .grad")

    grad_fn.set_retains_grad_hook(getattr(tensor, "output_nr", 0), retains_grad_hook)


# -- backward and grad --------------------------------------------------------------

def _as_tuple(values, what):
    """``values`` as a tuple: one tensor or Edge alone, or any iterable of
    them (a list, a tuple, a generator), as torch.autograd takes them."""
    if values is None:
        return ()
    if isinstance(values, Edge) or hasattr(values, "grad_fn") or not isinstance(values, Iterable):
        return (values,)
    return tuple(values)


# Note [The frontend's fixed cost]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On a small graph most of what backward() and grad() cost is this file's
# Python, not the engine: each bytecode, call and attribute read here is a
# measurable part of a one-node backward. So the paths a call takes most
# (one output, a numpy gradient or none) read each attribute once, look
# numpy's array type up once per process (a numpy module attribute is not
# one of the reads the interpreter specializes), and make no call that only
# forwards to another. benchmarks/RESULTS.md has what each change saved.

_ndarray = np.ndarray


def _roots_and_grads(outputs, grads):
    """The root edge of each output, and its gradient: ``grads`` (one value,
    a list or tuple, or None) checked against the outputs' shapes where
    given, made (ones, for scalar outputs only) where not. One pass and few
    calls: See Note [The frontend's fixed cost]."""
    if len(outputs) == 1 and (grads is None or type(grads) is _ndarray):
        # One output with one numpy gradient or none (``loss.backward()``),
        # the commonest call: the loop below for i = 0, without making a
        # tuple of the gradient and iterating over both.
        output = outputs[0]
        root = output if isinstance(output, Edge) else _tensor_root_edge(0, output)
        return [root], [_implicit_grad(0, output) if grads is None
                        else _checked_grad(0, output, grads)]
    if grads is None:
        grads = (None,) * len(outputs)
    elif type(grads) is _ndarray:
        # One numpy gradient without the abstract class's isinstance below.
        grads = (grads,)
    elif not isinstance(grads, (list, tuple)):
        # A generator of gradients, as torch takes; an array or a tensor is
        # one gradient (it is iterable, but not an iterator).
        grads = tuple(grads) if isinstance(grads, Iterator) else (grads,)
    if len(grads) != len(outputs):
        raise RuntimeError(f"got {len(outputs)} tensors and {len(grads)} gradients")
    roots, checked = [], []
    for i, output in enumerate(outputs):
        roots.append(output if isinstance(output, Edge) else _tensor_root_edge(i, output))
        grad = grads[i]
        checked.append(_implicit_grad(i, output) if grad is None else _checked_grad(i, output, grad))
    return roots, checked


def _tensor_root_edge(i, output):
    """The gradient edge of output ``i``, a tensor (or None, refused)."""
    if output is None:
        raise TypeError(f"element {i} of tensors is None")
    edge = gradient_edge(output)
    if edge is None:
        raise RuntimeError(f"element {i} of tensors does not require grad and does not "
                           "have a grad_fn")
    return edge


def _edge_metadata(edge):
    """The InputMetadata of the slot an Edge output flows into, or None."""
    metadata = edge.node._input_metadata
    input_nr = edge.input_nr
    return metadata[input_nr] if input_nr < len(metadata) else None


def _output_shape_dtype(i, output):
    """``(shape, dtype, backend)`` of output ``i``: from the slot's metadata
    for an Edge (backend None; shape None without metadata), else read from
    the tensor's value through its backend."""
    if isinstance(output, Edge):
        metadata = _edge_metadata(output)
        if metadata is None:
            return None, None, None
        return metadata.shape, metadata.dtype, None
    value = output.data
    backend = backend_of(value)
    if backend is None:
        raise TypeError(f"output {i} has a value of type {type(value).__name__} that no "
                        "value backend handles")
    return backend.shape(value), backend.dtype(value), backend


def _checked_grad(i, output, grad):
    """``grad``, once its shape is known to match output ``i``'s (an Edge
    output into a slot without metadata has no shape to match). An Edge's
    slot compares the shape itself (``InputMetadata.is_same_shape``, in C
    for a numpy array in the compiled core), and the shapes are only read
    to word a mismatch: See Note [The frontend's fixed cost]."""
    # The gradient's type is checked before the output is read, as torch's
    # _make_grads does.
    if type(grad) is not _ndarray and backend_of(grad) is None:
        raise TypeError(f"gradients can be either arrays or None, but got {type(grad).__name__}")
    if isinstance(output, Edge):
        metadata = output.node._input_metadata
        input_nr = output.input_nr
        slot = metadata[input_nr] if input_nr < len(metadata) else None
        if slot is None or slot.is_same_shape(grad):
            return grad
        out_shape = slot.shape  # a tuple, or None before the metadata's __init__
    else:
        out_shape = _output_shape_dtype(i, output)[0]
        if out_shape is not None:
            out_shape = tuple(out_shape)
    grad_shape = grad.shape if type(grad) is _ndarray else tuple(backend_of(grad).shape(grad))
    if out_shape is not None and grad_shape != out_shape:
        raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of {grad_shape} "
                           f"and output[{i}] has a shape of {out_shape}.")
    return grad


def _implicit_grad(i, output):
    """The gradient of output ``i`` when none was given: ones for a real
    scalar, None for a tensor that does not require grad."""
    if not isinstance(output, Edge) and not output.requires_grad:
        return None
    out_shape, out_dtype, out_backend = _output_shape_dtype(i, output)
    if out_shape is None:
        raise RuntimeError(f"grad_output[{i}] must be given for a GradientEdge output whose "
                           "node has no input metadata")
    size = 1
    for extent in out_shape:
        size *= extent
    if size != 1:
        raise RuntimeError("grad can be implicitly created only for scalar outputs")
    if out_backend is None:
        # An Edge's slot: numpy's ones, as the backend's ones_like makes them.
        ones = np.empty(out_shape, dtype=out_dtype)
        ones.fill(1)
        return ones
    if out_backend.dtype_kind(out_dtype) != "f":
        raise RuntimeError("grad can be implicitly created only for real scalar outputs "
                           f"but got {out_dtype}")
    return out_backend.ones_like(output.data)


class _Unreachable(Node):
    """Stands for an input that no graph can reach (a leaf without an
    accumulator): pruning then marks nothing as needed for it."""

    def apply(self, grads):
        return ()


def _input_edges(inputs, accumulate_grad):
    """The edge each input's gradient is captured at (``grad``) or
    accumulated through (``backward(inputs=)``). The tensor protocol's
    attributes are read directly, not by getattr with a default: See Note
    [The frontend's fixed cost]."""
    edges = []
    for i, tensor in enumerate(inputs):
        if tensor is None:
            raise TypeError(f"element {i} of inputs is None")
        if isinstance(tensor, Edge):
            edges.append(tensor)
            continue
        try:
            requires_grad = tensor.requires_grad
        except AttributeError:
            raise RuntimeError("all inputs have to be Tensors or GradientEdges, but got "
                               f"{type(tensor).__name__}") from None
        if not requires_grad:
            raise RuntimeError("One of the differentiated Tensors does not require grad")
        try:
            grad_fn = tensor.grad_fn
        except AttributeError:
            grad_fn = None
        if grad_fn is not None:
            if accumulate_grad:
                retain_grad(tensor)
            edges.append(Edge(grad_fn, getattr(tensor, "output_nr", 0)))
            continue
        accumulator = _try_get_grad_accumulator(tensor)
        edges.append(Edge(accumulator if accumulator is not None else _Unreachable(), 0))
    return edges


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    """Accumulate the gradients of ``tensors`` into the ``.grad`` of the leaves.

    As ``torch.autograd.backward``: ``grad_tensors`` may be omitted for scalar
    outputs; ``retain_graph`` defaults to ``create_graph``; ``inputs`` limits
    accumulation to those tensors (non-leaf inputs retain their grad) and runs
    only the nodes on a path to them. ``tensors``, ``grad_tensors`` and
    ``inputs`` may be any iterables (a generator too); no tensors at all
    (``backward([])``) does nothing, as in torch.
    """
    roots, grads = _roots_and_grads(_as_tuple(tensors, "tensors"), grad_tensors)
    if retain_graph is None:
        retain_graph = create_graph
    output_edges = None
    if inputs is not None:
        input_tuple = _as_tuple(inputs, "inputs")
        if not input_tuple:
            raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
        output_edges = _input_edges(input_tuple, accumulate_grad=True)
    if not roots:
        return
    get_default_engine().execute(roots, grads, bool(retain_graph), bool(create_graph),
                                 True, output_edges)


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         allow_unused=None, materialize_grads=False):
    """The gradients of ``outputs`` with respect to ``inputs``, as a tuple;
    nothing is accumulated into ``.grad``.

    As ``torch.autograd.grad``: an input that no output depends on raises
    unless ``allow_unused`` (its gradient is then None, or zeros with
    ``materialize_grads``). Only nodes on a path to an input run.
    ``outputs``, ``inputs`` and ``grad_outputs`` may be any iterables (a
    generator too). With no outputs (``grad([], [x])``) every input is
    unused, as in torch. The zeros ``materialize_grads`` gives are the
    input's array backend's zeros (torch gives a tensor that requires grad:
    the frontend's ``grad`` does, from its own tensors).
    """
    return _grad(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused,
                 materialize_grads, _zeros_like_input)


def _grad(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused,
          materialize_grads, zeros_like):
    """``grad``, with ``zeros_like(input)`` making a materialized gradient."""
    if materialize_grads and allow_unused is False:
        raise ValueError("Expected allow_unused to be True or not passed when materialize_grads=True, "
                         "but got: allow_unused=False.")
    if allow_unused is None:
        allow_unused = materialize_grads
    output_tuple = _as_tuple(outputs, "outputs")
    input_tuple = _as_tuple(inputs, "inputs")
    if not input_tuple:
        raise RuntimeError("grad requires non-empty inputs.")
    roots, grads = _roots_and_grads(output_tuple, grad_outputs)
    if retain_graph is None:
        retain_graph = create_graph
    output_edges = _input_edges(input_tuple, accumulate_grad=False)
    if roots:
        results = list(get_default_engine().execute(roots, grads, bool(retain_graph),
                                                    bool(create_graph), False, output_edges))
    else:
        results = [None] * len(output_edges)
    for result in results:
        if result is None and not allow_unused:
            raise RuntimeError("One of the differentiated Tensors appears to not have been used in "
                               "the graph. Set allow_unused=True if this is the desired behavior.")
    if materialize_grads:
        # As PyTorch: an unused GradientEdge input has no value to take zeros like.
        if any(result is None and isinstance(tensor, Edge)
               for result, tensor in zip(results, input_tuple)):
            raise RuntimeError("materialize_grads cannot be used when the given input is a GradientEdge")
        results = [zeros_like(tensor) if result is None else result
                   for result, tensor in zip(results, input_tuple)]
    return tuple(results)


def _zeros_like_input(tensor):
    value = tensor.data
    backend = backend_of(value)
    return backend.zeros(backend.shape(value), backend.dtype(value), backend.device(value))
