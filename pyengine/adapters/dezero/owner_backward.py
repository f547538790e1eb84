"""``Variable.backward`` on DeZero's own graph, read as an owner graph.

What this module owns: the ``pyengine.OwnerGraph`` over DeZero's
``creator``/``inputs``/``outputs`` graph (See Note [DeZero as an owner
graph]), and the choice between it and the adapter's nodes for one backward
(``nodes_needed``).
"""

from __future__ import annotations

import weakref

from dezero.core import Variable
from dezero.functions import GetItem

import pyengine

from ... import _core
from ...indexed import IndexedGradient
from .nodes import _is_row_lookup_of_leaf, _leaf_states, _output_gradient, _row_gradient
from .variable_backend import _add

# Note [DeZero as an owner graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DeZero records its graph itself: a Variable's ``creator`` is the Function
# that made it, a Function's ``inputs`` are Variables and its ``outputs``
# weak references to Variables. ``Variable.backward`` runs that graph as an
# owner graph in returns mode (See Note [Owner graphs] in
# ``pyengine/_pure/owner_graph.py``), with nothing made at forward:
#
# - The owners are the Functions and the leaf Variables (no creator), which
#   accumulate. A Function's parent items are its inputs, each as the owner
#   that receives its gradient: the Variable itself for a leaf, else its
#   creator. Every built-in DeZero Function has one output, so each owner
#   has one slot and the protocol's default (``num_inputs`` not given, no
#   Python call per owner) fits; a Function with several outputs (a user's)
#   makes the search raise ``NeedsNodes`` before any backward runs, and that
#   backward runs on nodes.
# - A Function's backward is the FunctionNode's, in DeZero's mode: its
#   outputs' ``.grad`` are read and written as Note [DeZero's Variable.grad
#   is the buffer] in ``pyengine/adapters/dezero/nodes.py`` says; its
#   gradients are zipped with its inputs as DeZero zips them; inputs that
#   DeZero wrapped itself are leaves and get their ``.grad``, as in DeZero.
#   A row lookup of a leaf returns an IndexedGradient (as RowLookupNode).
# - A leaf accumulates as DeZero does (``x.grad = gx``, or ``x.grad + gx``
#   out of place), which is the protocol's default accumulate, except that
#   an IndexedGradient is made dense first (DeZero's ``.grad`` is dense).
#
# What needs nodes runs on nodes instead (``nodes_needed``): ``create_graph``
# (the engine's sums must be recorded, and an owner-graph walk runs with
# grad mode off), anomaly mode (``Function.__call__`` makes nodes at forward
# under it, to keep the forward traceback, as PyTorch's nodes do), a
# leaf with hooks, and a graph in which a Function has a node, because a
# node may carry hooks, be released (PyTorch's error on a second backward)
# or have unchained outputs (Note [Unchain]). The search finds such a
# Function (``_parents`` raises ``NeedsNodes``, as for several outputs)
# before any backward runs; nodes in other graphs do not matter, since a
# Function's node only ever runs in a graph that reaches that Function. A
# Function keeps its node while something holds the Function (``grad_fn``,
# a hook, a graph differentiated with ``create_graph`` or by ``grad()``),
# so a training loop that uses none of these makes none and runs every
# backward here, whatever graphs with nodes the program keeps beside it. A graph differentiated
# again from the same Function gets nodes at that second backward: reading
# DeZero's graph costs the walk a Python call per Function (``_parents``)
# and a check of each returned Variable, more than a node costs the engine,
# so when backward repeats on one graph, nodes made once (kept on the
# Functions, as when they were made at forward) pay back; one backward per
# graph (a training step) makes none. Both routes compute the
# same ``.grad`` fields; the order differs (reverse depth-first post-order
# here, sequence numbers there), so sums of three or more gradients may
# differ in the last bits.

# Leaves whose hooks were registered through the adapter (weakly).
_hooked_leaves = weakref.WeakSet()


def leaf_hooked(variable):
    _hooked_leaves.add(variable)


def _leaves_have_hooks():
    for variable in list(_hooked_leaves):
        state = _leaf_states.get(variable)
        if state is not None and (state.tensor_pre_hooks or state.post_accumulate_grad_hooks):
            return True
        _hooked_leaves.discard(variable)
    return False


# The Functions a backward on the owner graph started from (weakly).
_roots_run = weakref.WeakSet()


def nodes_needed(create_graph, creator):
    """Whether this backward, from an output of ``creator``, runs on the
    adapter's nodes (See Note [DeZero as an owner graph])."""
    return (create_graph or _core.is_anomaly_enabled()
            or (len(_hooked_leaves) > 0 and _leaves_have_hooks()) or creator in _roots_run)


class NeedsNodes(Exception):
    """Raised by the search when it reaches a Function with several outputs,
    before any backward ran: that backward then runs on nodes (See Note
    [DeZero as an owner graph])."""


def _parents(owner, len=len, getattr=getattr):
    """A Function's parent items; None for a leaf Variable (which has no
    ``inputs``). Raises NeedsNodes for a Function with several outputs or
    with a node (See Note [DeZero as an owner graph])."""
    try:
        inputs = owner.inputs
    except AttributeError:
        return None
    if len(owner.outputs) != 1 or getattr(owner, "_pyengine_node", None) is not None:
        raise NeedsNodes
    return [variable if (creator := variable.creator) is None else creator for variable in inputs]


def _backward(retain_grad):
    """The owner graph's backward for one ``retain_grad``."""

    def function_backward(function, grads, tuple=tuple, isinstance=isinstance):
        # Only Functions with one output get here: _parents and
        # owner_backward send the others to nodes.
        n_inputs = len(function.inputs)
        gy = _output_gradient(function, grads[0], retain_grad)
        if gy is None:
            return [None] * n_inputs
        if type(function) is GetItem and _is_row_lookup_of_leaf(function):
            return [_row_gradient(function, gy)]
        gxs = function.backward(gy)
        if isinstance(gxs, tuple):
            if len(gxs) == n_inputs:
                return gxs
            gxs = list(gxs)
        elif not isinstance(gxs, list):
            gxs = [gxs]
        # DeZero's zip(f.inputs, gxs): extra gradients are dropped, missing
        # ones are none (SoftmaxCrossEntropy returns one for its two inputs).
        return (gxs + [None] * n_inputs)[:n_inputs]

    return function_backward


def _accumulate(leaf, gradient):
    """DeZero's ``x.grad = gx`` / ``x.grad = x.grad + gx``; an indexed
    gradient made dense, as DeZero's ``.grad`` is."""
    old = leaf.grad
    if old is None:
        if type(gradient) is IndexedGradient:
            gradient = Variable(gradient.to_dense())
        leaf.grad = gradient
    else:
        leaf.grad = _add(old, gradient)


_GRAPHS = {retain_grad: pyengine.OwnerGraph(_parents, _backward(retain_grad), mode="returns",
                                            accumulate=_accumulate)
           for retain_grad in (False, True)}


def backward_on_owner_graph(variable, seed, retain_grad):
    """Run backward from ``variable`` (which has a creator) with gradient
    ``seed``, in DeZero's mode, on the owner graph. The caller sets
    ``Config.enable_backprop`` off and clears ``variable.grad``."""
    # _parents raises NeedsNodes for a Function with several outputs, the
    # root's creator included.
    creator = variable.creator
    _GRAPHS[bool(retain_grad)].backward(creator, seed)
    _roots_run.add(creator)
