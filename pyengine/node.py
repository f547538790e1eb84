"""Nodes of the backward graph, as users subclass and inspect them.

``Node`` is what a framework subclasses for each backward formula: pass it
one ``Edge`` (or ``None``) per forward input, describe its input slots (one
per forward output) with ``input_metadata``, and override ``apply(grads)``.
``AccumulateGrad`` is the sink of a leaf tensor. The per-node state the
engine reads lives in the core's ``NodeBase`` (compiled or pure).

Hooks follow ``torch.autograd.graph.Node``:

- ``register_prehook(fn)``: ``fn(grad_outputs) -> new grad_outputs or None``,
  before ``apply``;
- ``register_hook(fn)``: ``fn(grad_inputs, grad_outputs) -> new grad_inputs
  or None``, after ``apply`` (``grad_inputs`` are what ``apply`` returned);
- ``register_tensor_prehook(input_nr, fn)``: ``fn(grad) -> new grad or None``
  for one input slot; this is what a tensor hook on a non-leaf becomes. As in
  PyTorch, it is called with None for a slot that received no gradient (it
  may not replace that None), and the hooks of one slot run together.

A hook may replace a gradient only by one of the same shape, dtype and
device. Each registration returns a handle whose ``remove()`` undoes it.

Concurrency: ``apply`` of one node may run on two threads at once when two
backward calls share a retained graph; a node that mutates its own state in
``apply`` must lock. ``AccumulateGrad`` does.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref

from . import _core
from ._core import (
    ACCUMULATE_GRAD_SEQUENCE_NR,
    AccumulateGradBase,
    Edge,
    GradientFreeNodeBase,
    InputMetadata,
    LeafState,
    NodeBase,
)
from ._shared.gradient_checks import checked_gradient_policy

__all__ = ["Node", "GradientFreeNode", "Edge", "InputMetadata", "AccumulateGrad", "RemovableHandle",
           "translate_owner_graph"]

_handle_ids = itertools.count()

RELEASED_ERROR = (
    "Trying to backward through the graph a second time (or directly access saved tensors "
    "after they have already been freed). Saved intermediate values of the graph are freed "
    "when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
    "backward through the graph a second time or if you need to access saved tensors after "
    "calling backward."
)


class RemovableHandle:
    """Undoes one hook registration; also a context manager."""

    __slots__ = ("id", "_remove")

    def __init__(self, remove):
        self.id = next(_handle_ids)
        self._remove = remove

    def remove(self):
        if self._remove is not None:
            self._remove(self.id)
            self._remove = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.remove()


# Note [Hook lists are rebound under one lock]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A node's hook lists are never edited in place: a backward may be
# iterating the old list (See Note [Hooks a running hook or node may
# change] in pyengine/_shared/hooks.py). So a registration or a removal
# reads the list, makes a new one and rebinds it, and two threads doing so
# at once would each drop the other's change (hooks lost: an audit lost
# 2,104 of 3,000 on the compiled core). This lock makes each
# read-copy-rebind whole. Registration is rare, so one lock for every
# node's lists costs nothing; a backward reads the lists without it. It is
# reentrant, for a hook that a registration's own code (a __del__ the
# rebinding runs) removes.
HOOK_LISTS_LOCK = threading.RLock()


def _remover(owner, attribute):
    """A function that drops the entry with a given handle id from a hook list.

    It holds the node weakly, as PyTorch's handle holds its hook dict: a
    handle does not keep a node alive (a leaf's AccumulateGrad that nothing
    else holds goes, with its hooks, as in PyTorch)."""
    owner_ref = weakref.ref(owner)

    def remove(handle_id):
        owner = owner_ref()
        with HOOK_LISTS_LOCK:  # See Note [Hook lists are rebound under one lock]
            hooks = getattr(owner, attribute, None)
            if hooks:
                setattr(owner, attribute,
                        [entry for entry in hooks if entry[0] != handle_id] or None)

    return remove


class Node(NodeBase):
    """A backward function: override ``apply(grads)``.

    ``Node(next_edges=(), input_metadata=())``: ``next_edges`` has one Edge
    (or None) per gradient ``apply`` returns; ``input_metadata`` one entry per
    input slot: an ``InputMetadata``, a ``(shape, dtype[, device])`` tuple, a
    value to read them from, or ``None`` (that slot's gradients are not
    checked). A gradient may arrive at a slot the node declared no metadata
    for; the node then gets as many slots as the highest one used (an Edge
    into an undeclared slot is refused from slot 65,536 on: See Note [Edge
    input_nr] in ``pyengine/_shared/messages.py``).

    Override ``release_variables()`` to free more than the values
    ``save_for_backward`` kept; the engine calls it after the node ran
    unless the graph is retained. Whether a node's class overrides it is
    read when the node is made, as a C++ object's virtual methods are fixed
    by its constructor: a ``release_variables`` assigned to the class
    afterwards is called only for nodes made afterwards, while replacing a
    method the class already had takes effect at once. See Note
    [Overriding release variables] in ``pyengine/_pure/node.py``.

    While the engine runs the node (in ``apply`` or a hook),
    ``task_should_compute_output(i)`` says whether next edge ``i``'s
    gradient will be used (PyTorch's method: False for a None edge or one
    that ``grad(inputs=)`` / ``backward(inputs=)`` prunes), and
    ``task_buffered_gradient(i)`` returns a copy of what the node edge
    ``i`` leads to has summed so far at that slot, or None; elsewhere both
    raise RuntimeError. See Note [Queries a running node makes] in
    ``pyengine/_shared/task_queries.py``.

    ``gradient_policy``: ``"reduce"`` (the default, PyTorch's rule: a
    broadcast gradient is summed to its slot's shape, a dtype cast) or
    ``"exact"`` (Chainer's: the gradients ``apply`` returns must already
    have their slots' shapes, dtypes and devices). Checked when a class
    that sets it is made, and read from the class (checked again) only
    where a gradient is not already its slot's numpy array: a value set on
    the class later applies to its nodes at once. See Note [Gradient
    policy] in ``pyengine/_pure/node.py``.

    ``accepts_indexed_gradients``: a class that sets it True gets
    :class:`pyengine.IndexedGradient` inputs as they are; for any other, the
    engine densifies them before ``apply`` (its hooks still see them
    indexed). See Note [Where an indexed gradient goes] in
    ``pyengine/indexed.py``.
    """

    accepts_indexed_gradients = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A bad policy fails where the class is made, not at its first
        # mismatched gradient: See Note [Gradient policy].
        if "gradient_policy" in cls.__dict__:
            checked_gradient_policy(cls.gradient_policy, f"Node class {cls.__qualname__}")

    def name(self) -> str:
        """The node's name in the engine's errors, anomaly notes, profiler
        events and graph drawings: its class's, as PyTorch's. Where an
        override raises, those name the node by its class and say so,
        keeping their own words: See Note [A name() that raises] in
        pyengine/_shared/messages.py."""
        return type(self).__name__

    @property
    def next_functions(self):
        """``((node, input_nr), ...)``, ``(None, 0)`` for a missing edge, as in PyTorch."""
        return tuple((None, 0) if edge is None else (edge.node, edge.input_nr)
                     for edge in self._next_edges)

    def apply(self, grads):
        """One gradient per input slot in; one per next edge out."""
        raise NotImplementedError(f"{self.name()} must override apply(grads)")

    def __call__(self, *grads):
        return self.apply(list(grads))

    # -- saved values --

    def save_for_backward(self, *values):
        """Keep ``values`` for ``apply``; released after backward unless retained."""
        self._saved_values = values
        self._released = False

    @property
    def saved_values(self):
        """What ``save_for_backward`` stored; raises once the graph was released."""
        # Read before the flag: See Note [A node is marked released before
        # it is cleared] in pyengine/_pure/engine.py.
        saved = self._saved_values
        if self._released:
            raise RuntimeError(RELEASED_ERROR)
        return saved if saved is not None else ()

    # -- hooks --

    def register_hook(self, fn) -> RemovableHandle:
        handle = RemovableHandle(_remover(self, "_post_hooks"))
        with HOOK_LISTS_LOCK:  # See Note [Hook lists are rebound under one lock]
            self._post_hooks = (self._post_hooks or []) + [(handle.id, fn)]
        return handle

    def register_prehook(self, fn) -> RemovableHandle:
        handle = RemovableHandle(_remover(self, "_pre_hooks"))
        with HOOK_LISTS_LOCK:  # See Note [Hook lists are rebound under one lock]
            self._pre_hooks = (self._pre_hooks or []) + [(handle.id, fn)]
        return handle

    def register_tensor_prehook(self, input_nr: int, fn) -> RemovableHandle:
        """Hooks of one slot run together, slots in the order in which each
        first got a hook, as PyTorch's hook dict per tensor. See Note [Hooks
        a running hook or node may change] in ``pyengine/_shared/hooks.py``."""
        input_nr = int(input_nr)
        handle = RemovableHandle(_remover(self, "_tensor_pre_hooks"))
        with HOOK_LISTS_LOCK:  # See Note [Hook lists are rebound under one lock]
            # Each slot's rank: the order of first registration, which removing
            # every hook of a slot does not change (nor does it drop a tensor's dict).
            slots = self.__dict__.setdefault("_tensor_hook_slots", [])
            if input_nr not in slots:
                slots.append(input_nr)
            rank = {slot: i for i, slot in enumerate(slots)}
            hooks = list(self._tensor_pre_hooks or ())
            position = len(hooks)
            for i, entry in enumerate(hooks):
                if rank.get(entry[1], -1) > rank[input_nr]:
                    position = i
                    break
            hooks.insert(position, (handle.id, input_nr, fn))
            self._tensor_pre_hooks = hooks
        return handle

    def set_retains_grad_hook(self, input_nr: int, fn) -> None:
        """The hook that stores slot ``input_nr``'s gradient (one per slot); runs
        after every tensor pre-hook. ``fn=None`` removes it."""
        with HOOK_LISTS_LOCK:  # See Note [Hook lists are rebound under one lock]
            hooks = dict(self._retains_grad_hooks or {})
            if fn is None:
                hooks.pop(input_nr, None)
            else:
                hooks[int(input_nr)] = fn
            self._retains_grad_hooks = hooks or None

    def __repr__(self):
        return f"<{self.name()} sequence_nr={self.sequence_nr}>"


class GradientFreeNode(GradientFreeNodeBase, Node):
    """A node that passes no gradients, for frameworks whose backward
    formulas write the gradients themselves (micrograd's closures): running
    it calls ``owner.<method>()``, and its edges only order the backward (it
    runs after every node that feeds it). See Note [GradientFreeNode] in
    ``pyengine/_pure/node.py``.

    ``GradientFreeNode(owner, method, next_edges=(), input_metadata=())``:
    ``method`` is a name, looked up on ``owner`` each time the node runs.
    ``apply(grads)`` makes that call and returns one None per next edge;
    hooks see those Nones. The engine runs it as any node, through
    ``apply``: a subclass may override ``apply`` (and whatever gradients
    that returns go along its edges, as a plain Node's do).
    """


def translate_owner_graph(root, children, method):
    """The Edge into ``root``'s node in the graph of GradientFreeNodes that
    the owner graph under ``root`` means (its values' ``children``
    collections and ``method`` methods), or None when ``root`` has no
    children. Each call makes new nodes, for looking at the graph
    (:func:`pyengine.graph_to_dot`) or running it with hooks; running the
    Edge with the engine's ``execute`` does what
    :func:`pyengine.execute_owner_graph` does. See Note [Owner graphs] in
    ``pyengine/_pure/owner_graph.py``."""
    return _core.owner_graph_edge(root, children, method, GradientFreeNode, Edge)


class AccumulateGrad(AccumulateGradBase, Node):
    """The sink of a leaf ``variable``: adds the gradient into ``variable.grad``
    (PyTorch's rules: See Note [Accumulating into .grad] in
    ``pyengine/_pure/node.py``), then runs the variable's
    post-accumulate-grad hooks, ``fn(variable)``. ``apply`` is the core's
    (compiled in the compiled core). What must outlive this node (a new
    forward pass makes a new one) lives on the variable, in its
    :class:`LeafState`. It accepts indexed gradients (See Note [Where an
    indexed gradient goes] in ``pyengine/indexed.py``).
    """

    accepts_indexed_gradients = True

    def __init__(self, variable, metadata=None):
        if metadata is None:
            metadata = InputMetadata.from_value(variable.data)
        super().__init__(next_edges=(), input_metadata=(metadata,))
        _core.set_sequence_nr(self, ACCUMULATE_GRAD_SEQUENCE_NR)
        self.variable = variable
        self.leaf_state = leaf_state(variable)
        self._tensor_pre_hooks = self.leaf_state.tensor_pre_hooks

    def name(self) -> str:
        return "AccumulateGrad"


# Guards the first LeafState of each variable. Replaced in a forked child:
# See Note [Locks after fork].
_leaf_state_lock = threading.Lock()


def leaf_state(variable) -> LeafState:
    """The LeafState of ``variable``, made on first use."""
    state = getattr(variable, "_pyengine_leaf", None)
    if state is None:
        with _leaf_state_lock:
            state = getattr(variable, "_pyengine_leaf", None)
            if state is None:
                state = variable._pyengine_leaf = LeafState()
    return state


# Note [Locks after fork]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A forked child has only the thread that called fork. A lock that another
# thread of the parent held at that moment is held forever in the child, and
# the child's first backward that takes it hangs (once in a few hundred forks
# while other threads run backward: tests/stress/test_fork.py). Every
# process-wide lock that a backward may take is therefore replaced by a new,
# free one in the child, by an ``after_in_child`` hook next to it, as the
# engine replaces its pool and device threads (``Engine._reset_after_fork``).
# Per-object locks (a leaf's ``LeafState.lock``, a graph task's) are not: a
# graph that another thread was running at the fork is that thread's, and the
# child cannot know what it left half-done. Code that takes a lock replaced
# so reads it from its module each time (``node.HOOK_LISTS_LOCK``), never
# from a name imported before the fork.


def _reset_locks_after_fork():
    global _leaf_state_lock, HOOK_LISTS_LOCK
    _leaf_state_lock = threading.Lock()
    # A hook or a node may register a hook while backward runs.
    HOOK_LISTS_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_locks_after_fork)
