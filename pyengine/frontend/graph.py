"""Recording the backward graph: ``OpNode``, ``SavedTensor`` and ``record``.

Every differentiable op of the frontend does the same three things after
computing its result: check whether a graph is needed (grad mode on and an
input requires grad), make one :class:`OpNode` with one edge per input and
one input slot for its output, and save what its backward formula reads.
This module does them, so that an op module holds only forwards and
formulas.

Note [Formulas on arrays or tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each backward formula is written once, with operators and the ops'
functions (``where``, ``exp``, ``sum``, ``reshape``, ...), which accept raw
arrays as well as Tensors: on arrays they are plain numpy (or cupy). The
engine turns grad mode on inside ``apply`` only under
``create_graph=True``. ``OpNode.apply`` then hands the formula Tensors
(gradients and saved values), so that the formula records a graph of its
own and can be differentiated again; otherwise it hands it arrays, and the
formula costs what the numpy expressions cost.

Note [Broadcast gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~
An op that broadcasts its inputs returns gradients of the broadcast
(output) shape. The engine's ``validate_outputs`` reduces each with the
value backend's ``sum_to`` to the shape recorded for the slot it flows
into. No formula reduces by hand.

Note [Backward formulas in PyTorch's order]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under ``create_graph=True`` a formula records nodes, and the order in which
it records them sets their sequence numbers, hence the order in which a
later backward through them runs (See Note [Ready queue order] in
``pyengine/_pure/ready_queue.py``) and fires the hooks of the leaves they
lead to. PyTorch's generated backward functions compute their inputs'
gradients in the alphabetical order of the inputs' names in
``derivatives.yaml`` (``load_derivatives.py`` sorts them): ``other`` before
``self``, ``exponent`` before ``self``. So the formulas of the binary
pointwise ops (``mul``, ``div``, ``pow``, ``maximum``, ``where``) compute
the second input's gradient first. ``matmul`` and ``linear`` are composites
in PyTorch, whose backward graphs have other nodes altogether; they are
not matched.
"""

from __future__ import annotations

import time

import numpy as np

import pyengine
from pyengine import Edge, InputMetadata
from pyengine.node import RELEASED_ERROR

from .tensor import Tensor, VersionCounter, _device_of

__all__ = ["OpNode", "SavedTensor", "record", "needs_graph", "edge_of", "operand", "raw",
           "mark_view", "FormulaProfile"]

_NUMBER_TYPES = (int, float, complex, bool, np.generic)


def operand(value):
    """An op's input as the op keeps it: a Tensor stays, a Python or numpy
    scalar stays a number (Python scalars are weak in type promotion), and
    anything else becomes a constant Tensor."""
    if isinstance(value, (Tensor,) + _NUMBER_TYPES):
        return value
    return Tensor._make(np.asarray(value) if isinstance(value, (list, tuple)) else value)


def raw(value):
    """The array (or number) behind ``value``."""
    return value.data if isinstance(value, Tensor) else value


def needs_graph(*inputs) -> bool:
    """Whether an op on ``inputs`` records a node: grad mode is on and an
    input requires grad. Refuses a stale view (See Note [Views and the
    version counter])."""
    if not pyengine.is_grad_enabled():
        return False
    needed = False
    for value in inputs:
        if isinstance(value, Tensor):
            refuse_stale_view(value)
            if value._requires_grad:
                needed = True
    return needed


STALE_VIEW = ("this view was taken before its base was modified by an in-place operation that "
              "gave the base a new history; the reference frontend does not regenerate a view's "
              "history (PyTorch does): take the view again after the in-place operation. See "
              "Note [Views and the version counter].")


def refuse_stale_view(value):
    """Raise where ``value`` is a view taken before its base got a new
    history from an in-place operation: its ``grad_fn`` is the old one,
    where PyTorch's would be regenerated (See Note [Views and the version
    counter])."""
    if isinstance(value, Tensor) and value._base is not None \
            and value._base.grad_fn is not value._base_grad_fn:
        raise RuntimeError(STALE_VIEW)


def refuse_stale_views(values):
    """``refuse_stale_view`` for a Tensor, or for each item of a list or
    tuple (anything else, an iterator included, is left to the engine)."""
    if isinstance(values, (list, tuple)):
        for value in values:
            refuse_stale_view(value)
    else:
        refuse_stale_view(values)


def edge_of(value):
    """The Edge a gradient for ``value`` flows along, or None."""
    if not isinstance(value, Tensor) or not value._requires_grad:
        return None
    if value.grad_fn is not None:
        return Edge(value.grad_fn, value.output_nr)
    return pyengine.gradient_edge(value)


def mark_view(out: Tensor, base: Tensor) -> Tensor:
    """Make ``out`` a view of ``base``: shared version counter, common root."""
    root = base._base if base._base is not None else base
    out._version_counter = base._version_counter
    out._base = root
    out._base_grad_fn = root.grad_fn
    return out


def record(node_type, inputs, out, saved=(), checked=(), **attributes):
    """Attach a new ``node_type`` node to ``out`` as its ``grad_fn``.

    ``inputs``: the op's inputs, one edge each (None for numbers and
    tensors that don't require grad). ``saved``: what the formula reads, in
    order; a Tensor becomes a SavedTensor, anything else (None, numbers) is
    kept as it is. ``checked``: Tensors the backward reads through arrays
    it keeps (an index, a condition, a target): saved too, so that an
    in-place change of one before backward raises as torch's saved
    variables do, but not passed to the formula; values that are not
    Tensors are skipped. ``attributes`` are set on the node.
    """
    data = out.data
    node = node_type(next_edges=[edge_of(value) for value in inputs],
                     input_metadata=[InputMetadata(data.shape, data.dtype, _device_of(data))])
    out.grad_fn = node
    out._requires_grad = True
    checked = [value for value in checked if isinstance(value, Tensor)]
    if saved or checked:
        node.save_for_backward(*[SavedTensor(value, value is out) if isinstance(value, Tensor)
                                 else value for value in saved],
                               *[SavedTensor(value, False) for value in checked])
        node._saves = True
        node._checked = len(checked)
    node.__dict__.update(attributes)
    return node


class SavedTensor:
    """A tensor an OpNode saved for backward, with the version it had then.

    An input is kept as it is (its history matters under create_graph). An
    output is kept as its array only, as PyTorch does, so that no reference
    cycle runs through the node; unpacking it as a Tensor makes one whose
    ``grad_fn`` is the node that saved it.
    """

    __slots__ = ("data", "tensor", "counter", "version", "output_nr", "had_history")

    def __init__(self, tensor: Tensor, is_output: bool):
        self.data = tensor.data
        self.counter = tensor._version_counter
        self.version = self.counter.value
        self.tensor = None if is_output else tensor
        self.output_nr = tensor.output_nr
        # A saved input that was not a leaf must still have its history when
        # unpacked, as torch's SavedVariable checks (detach_() drops it; the
        # optimizers' zero_grad does that to a create_graph .grad).
        self.had_history = not is_output and tensor.grad_fn is not None

    def _check_version(self, node):
        if self.had_history and self.tensor.grad_fn is None:
            raise RuntimeError(
                "Trying to use a saved tensor that has been detached in-place, i.e. with "
                ".detach_().This is not supported, please use out-of-place `.detach()` instead")
        now = self.counter.value
        if now != self.version:
            shape = list(self.data.shape)
            owner = node if self.tensor is None else self.tensor.grad_fn
            which = f", which is output {self.output_nr} of {owner.name()}," if owner is not None else ""
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{self.data.dtype} {shape}]{which} is at version {now}; "
                f"expected version {self.version} instead. Hint: enable anomaly detection to find "
                "the operation that failed to compute its gradient, with "
                "pyengine.set_detect_anomaly(True).")

    def unpack_data(self, node):
        self._check_version(node)
        return self.data

    def unpack_tensor(self, node):
        self._check_version(node)
        if self.tensor is not None:
            return self.tensor
        out = Tensor._make(self.data, self.counter)
        out.grad_fn = node
        out.output_nr = self.output_nr
        out._requires_grad = True
        return out

    def keep_copy(self):
        """Keep a private copy of the value: the tensor is about to be
        written in place. See Note [In-place operations]."""
        old = self.tensor
        copy = Tensor._make(old.data.copy(), VersionCounter())
        copy.grad_fn, copy.output_nr, copy._requires_grad = old.grad_fn, old.output_nr, old._requires_grad
        self.tensor, self.data, self.counter, self.version = copy, copy.data, copy._version_counter, 0

    def repoint(self, target: Tensor):
        """The saved output now lives in ``target`` (an in-place op's result)."""
        self.data = target.data
        self.counter = target._version_counter
        self.version = self.counter.value


class FormulaProfile:
    """Time spent in OpNode formulas while active (``with FormulaProfile() as p``):
    ``p.seconds`` and ``p.calls``. One at a time; for the demo's figures."""

    active = None

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0

    def __enter__(self):
        FormulaProfile.active = self
        return self

    def __exit__(self, *exc_info):
        FormulaProfile.active = None
        return False


class OpNode(pyengine.Node):
    """The backward of one op: override ``formula(grad, *saved)``.

    ``formula`` gets the gradient of the op's output and the unpacked saved
    values, and returns one gradient (or None) per input, on arrays or on
    Tensors (See Note [Formulas on arrays or tensors]).
    """

    _saves = False
    _checked = 0  # how many saved values, last, are there for their version only

    def needs(self, index: int) -> bool:
        """Whether the formula should compute input ``index``'s gradient:
        the input takes one, and the backward running this node will use
        it (``task_should_compute_output``, which torch's generated
        formulas ask), so that under ``grad(inputs=)`` /
        ``backward(inputs=)`` a pruned input's gradient is None, as the
        node's post-hooks see it in torch. Called outside a backward (the
        node's ``apply`` called by hand), it answers as torch does without
        a graph task: whether the input takes a gradient."""
        try:
            return self.task_should_compute_output(index)
        except RuntimeError:
            # The engine is not running this node (or, from a __del__ run
            # under its graph task's lock, the query cannot take the lock):
            # answer as without a graph task.
            return self._next_edges[index] is not None

    def apply(self, grads):
        profile = FormulaProfile.active
        if profile is None:
            return self._apply(grads)
        start = time.perf_counter()
        try:
            return self._apply(grads)
        finally:
            profile.seconds += time.perf_counter() - start
            profile.calls += 1

    def _apply(self, grads):
        grad = grads[0]
        num_edges = len(self._next_edges)
        if grad is None:
            return [None] * num_edges
        if self._saves:
            # Read before the flag: See Note [A node is marked released
            # before it is cleared] in pyengine/_pure/engine.py.
            saved = self._saved_values
            if self._released:
                raise RuntimeError(RELEASED_ERROR)
        else:
            saved = ()
        if pyengine.is_grad_enabled():
            if not isinstance(grad, Tensor):
                grad = Tensor._make(grad)
            saved = [value.unpack_tensor(self) if type(value) is SavedTensor else value
                     for value in saved]
        else:
            if isinstance(grad, Tensor):
                grad = grad.data
            saved = [value.unpack_data(self) if type(value) is SavedTensor else value
                     for value in saved]
        if self._checked:
            # Unpacked above for their version check only.
            saved = saved[:-self._checked]
        # A formula of several inputs asks ``needs`` for each; that of one
        # input is skipped here when its gradient will not be used, as
        # torch's formulas skip every gradient ``task_should_compute_output``
        # rules out. After the unpacking: as in torch, a freed graph or a
        # saved tensor changed in place raises even so.
        if num_edges == 1 and not self.needs(0):
            return [None]
        return self.formula(grad, *saved)

    def formula(self, grad, *saved):
        raise NotImplementedError(f"{self.name()} must override formula(grad, *saved)")
