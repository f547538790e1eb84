"""Owner graphs: a framework's own graph of values, read when backward runs.

This module owns the owner-graph protocol (``OwnerGraph``) and the walk that
runs it. Twin of ``pyengine/_owner_graph.pyx``: the same search, the same
loop, the same names, in the same order (See Note [Owner graphs]). It also
holds the translation into gradient-free nodes (``owner_graph_edge``),
which both cores use only to look at a graph (``translate_owner_graph``,
``graph_to_dot``); no backward runs through it.

Note [Owner graphs]
~~~~~~~~~~~~~~~~~~~
Some frameworks keep no backward graph apart from their values: each value
(an *owner*) records what it was made from, and knows how to compute its
parents' gradients. micrograd's ``_prev``/``_backward``; DeZero's and
Chainer's ``creator``/``inputs``/``backward``; autograd's ``parents``/
``vjp``. Such a graph is an *owner graph*, and an ``OwnerGraph`` says how
to read one: made once per framework (an adapter), it runs backward on any
owner of it, with no pyengine Node made at forward or at backward.

- ``parents`` (an attribute name, or a callable ``owner -> iterable``): the
  owner's *parent items*. Each item is an owner, a pair ``(owner,
  input_nr)`` (an exact ``tuple`` of two, for owners with more than one
  gradient slot; ``input_nr`` an int from 0 to ``MAX_INPUT_NR - 1``, in
  either mode, else IndexError), or None (no gradient flows there). An owner whose items
  are none at all (an empty collection, or None) is a *leaf*.
- ``backward`` (a method name, or a callable taking the owner first), in
  one of two modes:

  - ``"writes"`` (micrograd): ``owner.<backward>()`` / ``backward(owner)``
    writes its parents' gradients itself (``.grad +=``); its result is
    ignored. Leaves do not run.
  - ``"returns"`` (DeZero, Chainer, autograd): called with the owner's
    gradients (a list, one per slot, summed in the core's InputBuffer;
    None where none arrived), it returns one gradient per parent item, in
    order (a list or a tuple, or a generator, read once: autograd's vjps of
    more than two arguments return one). Each is checked (a value of a registered backend; against
    ``metadata(parent)[input_nr]`` by validate_outputs' rules when the
    framework gives ``metadata``), then summed into the parent's slot.
    ``num_inputs(owner)`` (default 1) is an owner's number of slots. A leaf
    gets its summed gradient by ``accumulate(leaf, gradient)``, called
    holding a lock of that leaf's (See Note [An owner leaf accumulates
    under a lock]), default:
    ``leaf.grad`` set to it, or summed into a ``.grad`` that is not None,
    out of place (the first gradient is stored as it is and never written
    into). An owner at which no gradient arrived (all its slots None) does
    not run and passes None on: its backward need not handle that case.
    A one-slot owner's first gradient is held as it is, with no
    InputBuffer (one would hold it as it is too); the second makes the
    buffer, the first added before it, so the sums and their ownership are
    the InputBuffer's (See Note [InputBuffer ownership] in
    ``pyengine/_pure/input_buffer.py``).

  Three options of returns mode change what the backward gets and what its
  gradients mean (issue 18; a Node has the same three):

  - ``should_compute_output=True``: the backward is called as
    ``backward(owner, grads, should_compute_output)``, a tuple of bools,
    one per parent item: False for a None item, for a parent
    ``needs_no_gradient`` refused, and, under ``grad(inputs=)``, for a
    parent that neither runs nor captures (no path to an input); True
    elsewhere (PyTorch's ``task_should_compute_output``). A gradient
    computed where it is False is dropped anyway, so a backward may skip it
    and return None there.
  - ``gradient_policy``: ``"reduce"`` (the default) checks returned
    gradients by PyTorch's ``validate_outputs`` (a broadcast gradient summed
    to the slot's shape, a dtype cast, a 0-dim gradient moved);
    ``"exact"`` by Chainer's rule (``validate_gradient_exact``): shape,
    dtype and device must already be the slot's, else an error naming the
    owner, the index, expected and got. The root's gradient is checked by
    the same policy (Chainer checks a gradient set on a variable too).
  - ``accumulates=True`` (Chainer's ``backward_accumulate``): one more
    argument after the optional tuple above, a tuple with, per parent item,
    the sum the parent's InputBuffer holds so far at that slot (None where
    none), taken out of the buffer; what the backward returns replaces it
    (a None returned leaves the slot empty). A parent named by two items
    gets its sum at the first and None at the second, whose gradient is
    then added, as Chainer pops each input's gradient list once. The
    buffer forgets that it owned a sum it handed out, so the engine never
    writes into a value a backward was given (See Note [InputBuffer
    ownership] in ``pyengine/_pure/input_buffer.py``).

  Two more shape the call itself. ``unpack_grads=True`` passes the owner's
  gradients as positional arguments instead of one list,
  ``backward(owner, *grads[, should_compute_output][, buffered])`` or
  ``owner.<backward>(*grads, ...)``: DeZero's ``backward(*gys)`` and
  autograd's ``vjp(g)`` are then the backward itself, with no Python
  function of the adapter's around each call. ``dense_gradient(value)``
  (optional) is applied to each gradient a backward is about to get (after
  ``pre_hook``) that is not a numpy array; its result is what the backward
  gets (autograd makes its sparse gradients dense before a vjp sees them).
  A leaf's ``accumulate`` and ``grad(inputs=)``'s captures get the sums as
  they are.

The search. From the root, a depth-first search reads each owner's items
once, in their iteration order, into a snapshot of its own when it first
reaches the owner (so a collection edited while the search runs changes
nothing read already, and both cores read the same owners in the same
order), skips None items and the owners ``needs_no_gradient`` (optional)
says need no gradient (asked once per owner, at the first item that names
it, so that one answer holds for every item: a refused owner is neither
searched nor given gradients), and appends each owner to the *post-order* when its
search finishes (a leaf: when first reached). Owners are told apart by
identity, whatever their ``==``. A cycle (an owner among its own
descendants) is an error: no order runs it. ``visit(owner)`` (optional) is
then called once per owner reached, leaves included, in the post-order,
before any backward runs: a framework prepares its values there (zeroes a
gradient, clears a flag).

The order. The owners run in the reverse of the post-order. That is the
order the ready queue runs the translated graph in, a node per owner (an
AccumulateGrad-like node per leaf in returns mode) made in the post-order,
so that sequence numbers increase along it: the ready queue pops the ready
node latest in the post-order, and the node latest in the post-order among
those not run yet is always ready, because each of its consumers finished
the search after it (a consumer reaches its parent before it finishes), so
comes later in the post-order and has run. So running the reverse
post-order needs no dependency counts and no ready queue, and:

- it is micrograd's own order (its recursive ``build_topo`` is this
  depth-first post-order), so every ``.grad`` is bitwise micrograd's;
- the compiled core needs no object per owner in writes mode. That matters
  more than the search's speed: micrograd's values are reference cycles, so
  the cyclic GC frees each graph, and every tracked object made per value
  makes the GC's collections both more frequent and longer
  (``benchmarks/RESULTS.md`` has the figures). Its search keeps each
  owner's snapshot in one C array used as a stack, sized (with its table
  and the order) by the previous walk of the same OwnerGraph, so that a
  graph run again doubles no table. In returns mode it keeps each owner's
  search state in its table keyed by address, where this twin has its
  ``seen`` dict (See ``pyengine/_owner_table.h``; the OwnerGraph keeps that
  table's memory for its next walk), the items of each owner (to route
  the gradients), a slot count and an InputBuffer per owner a gradient
  reaches.

Each owner runs as a node of a graph task runs: grad mode off, the graph
task current (so ``queue_callback`` works; its callbacks run when the walk
ends), a reentrant checkpoint valid unless ``inputs=`` prunes. Inside
another backward (a node's ``apply`` runs an owner graph: reentrant) the
graph task is one level deeper. Around each owner's backward (leaves'
``accumulate`` excluded), ``pre_hook(owner, grads)`` may return new
gradients, and ``post_hook(owner, grad_inputs, grads)`` new returned
gradients, as a Node's pre-hooks and hooks do (Chainer's function hooks
are protocol-wide too); like those, they get tuples, so that they cannot
keep or edit the lists the engine goes on to read; in writes mode they get
empty tuples and must return None. In anomaly mode an error names the
owner in a note, and the returned gradients are checked for NaN where
``check_nan`` is on. With a
profiler, each owner run (an accumulated leaf included) is one event,
named after the owner's type, whose ``sequence_nr`` is its index in the
post-order. An owner-graph run is no call of the engine's ``execute``, so
it has no BackwardSpan.

``grad(root, grad, inputs)`` computes the gradients flowing into
``inputs`` (owners, or pairs for one slot) instead: nothing is accumulated,
and only owners with a path to an input run, as ``torch.autograd.grad``.
An input no gradient reached is None with ``allow_unused=True``, an error
otherwise.

What differs from torch.autograd: the graph belongs to the framework, so
it is read at each backward and never released (backward can run again);
a leaf's gradient is what ``accumulate`` does with it; there is no
``create_graph`` (backward runs with grad mode off: a framework that
differentiates twice records its own second graph) and no stream rule (the
gradients are summed on the caller's current stream); an owner at which no
gradient arrived does not run (torch runs such a node with undefined
gradients); a nested
``backward`` inside an owner's method is reentrant only when the owner
graph itself runs inside another backward (otherwise it is a backward of
its own on this thread). The walk lets other threads run, and the compiled
one honours Ctrl-C, as it goes (See Note [Long passes let other threads
run] in ``pyengine/_interrupts.pxd``).
"""

import os
import threading
import time

import numpy as np

from .._shared.gradient_checks import validate_gradient, validate_gradient_exact
from .._shared.messages import OWNER_GRAPH_INITIALIZED_WHY, initialized_once_message
from .._shared.owner_graph_checks import (
    EXACT,
    GRADIENTS_CHANGED,
    REDUCE,
    RETURNS,
    WRITES,
    OwnerRun,
    accumulate_grad,
    add_owner_note,
    check_hook_result,
    check_input_nr,
    check_nan,
    check_options,
    check_reader,
    count_slots,
    cycle_error,
    format_owner_error,
    format_root_error,
    inputs_what,
    iterate,
    leaf_lock_taken_again_message,
    mark_needed,
    metadata_of_what,
    owner_name,
    parents_of_what,
    read_returned,
    reduce_owner_graph,
    split_item,
    split_root,
)
from . import state
from .graph_task import GraphTask, link_enclosing_graph_task
from .input_buffer import InputBuffer
from .node import GradLock, InputMetadata, _not_writable, as_input_metadata
from .static_types import c_type_name, check_argument, check_new
from .validate_outputs import known_value_type

__all__ = ["OwnerGraph", "OwnerRun", "WRITES", "RETURNS", "check_reader", "cycle_error",
           "owner_graph_edge", "owner_name", "search", "run_owner_graph"]
# The checks, messages and slow paths both cores call (accumulate_grad,
# mark_needed, OwnerRun, ...) are in pyengine/_shared/owner_graph_checks.py.

# What the search knows of an owner it has seen (absent: not seen).
_ON_PATH = 0  # its search is not finished
_FINISHED = 1


def _check_optional(what, value):
    if value is not None and not callable(value):
        raise TypeError(f"{what} must be a callable or None, got {type(value).__name__}")
    return value


# Note [An owner graph is initialized once]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A walk reads its OwnerGraph's fields as it goes (``returns`` in the
# search, in each owner's run and in the routing; the readers and hooks as
# it calls them), and Python code it runs (a parents reader, a backward,
# a hook, ``num_inputs``) reaches the graph. A second ``__init__`` from
# there switched the graph's mode in the middle of the walk: the search
# then entered owners into the other mode's tables, and the compiled walk
# ran owners of a writes-mode search as returns-mode ones (without their
# parent items), where the twin failed elsewhere. So ``__init__`` runs
# once per instance in both cores, as a GraphTask's and an Engine's
# (TypeError, ``initialized_once_message``); the flag is set before any
# Python code can run (a ``mode``'s ``__eq__``, a ``__bool__``), so that
# an ``__init__`` run from inside the first is refused too. A first
# ``__init__`` that raised leaves the graph as far as it got, and it too
# is not run again: make a new graph.


class OwnerGraph:
    """How to read a framework's own graph, and backward on it. See Note
    [Owner graphs] for every argument; made once per framework.

    ``OwnerGraph("_prev", "_backward").backward(value)`` runs micrograd's
    graph; ``OwnerGraph(parents, vjp, mode="returns").backward(y, grad)``
    one whose backward returns its parents' gradients."""

    __slots__ = ("parents", "backward_", "mode", "returns", "num_inputs", "metadata",
                 "accumulate", "visit", "needs_no_gradient", "pre_hook", "post_hook",
                 "should_compute_output", "gradient_policy", "accumulates", "unpack_grads",
                 "dense_gradient", "initialized_")

    def __new__(cls, *args, **kwargs):
        # The fields the compiled OwnerGraph has before __init__ (C's None
        # and zeroes): one made by __new__ alone reads and fails alike in
        # both cores.
        if cls.__new__ is not OwnerGraph.__new__:
            check_new(OwnerGraph, cls)
        self = object.__new__(cls)
        for name in OwnerGraph.__slots__:
            object.__setattr__(self, name, None)
        for name in ("returns", "should_compute_output", "accumulates", "unpack_grads",
                     "initialized_"):
            object.__setattr__(self, name, False)
        return self

    def __setattr__(self, name, value):
        # The compiled class's fields are readonly: AttributeError when
        # Python code writes one (a subclass's own attributes it takes).
        if name in OwnerGraph.__slots__ or type(self) is OwnerGraph:
            _not_writable(self, name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if name in OwnerGraph.__slots__ or type(self) is OwnerGraph:
            _not_writable(self, name)
        object.__delattr__(self, name)

    def __init__(self, parents, backward, *, mode=WRITES, num_inputs=None, metadata=None,
                 accumulate=None, visit=None, needs_no_gradient=None, pre_hook=None,
                 post_hook=None, should_compute_output=False, gradient_policy=REDUCE,
                 accumulates=False, unpack_grads=False, dense_gradient=None):
        # Only __init__ writes the fields (See OwnerGraph.__setattr__), once:
        # See Note [An owner graph is initialized once]. The flag is set
        # before any Python code runs (a mode's __eq__ may).
        if self.initialized_:
            raise TypeError(initialized_once_message(self, OWNER_GRAPH_INITIALIZED_WHY))
        set_field = object.__setattr__
        set_field(self, "initialized_", True)
        set_field(self, "parents", check_reader("parents", parents))
        set_field(self, "backward_", check_reader("backward", backward))
        if mode != WRITES and mode != RETURNS:
            raise ValueError(f"mode must be {WRITES!r} or {RETURNS!r}, got {mode!r}")
        if type(mode) is not str:
            # The compiled field's type: a str, exactly.
            raise TypeError(f"Expected str, got {c_type_name(type(mode))}")
        set_field(self, "mode", mode)
        set_field(self, "returns", mode == RETURNS)
        if not self.returns:
            for what, value in (("num_inputs", num_inputs), ("metadata", metadata),
                                ("accumulate", accumulate), ("dense_gradient", dense_gradient)):
                if value is not None:
                    raise TypeError(f"{what} is for mode={RETURNS!r}: in mode={WRITES!r} "
                                    "the owners write their parents' gradients themselves")
        set_field(self, "num_inputs", _check_optional("num_inputs", num_inputs))
        set_field(self, "metadata", _check_optional("metadata", metadata))
        set_field(self, "accumulate", _check_optional("accumulate", accumulate))
        set_field(self, "visit", _check_optional("visit", visit))
        set_field(self, "needs_no_gradient", _check_optional("needs_no_gradient", needs_no_gradient))
        set_field(self, "pre_hook", _check_optional("pre_hook", pre_hook))
        set_field(self, "post_hook", _check_optional("post_hook", post_hook))
        set_field(self, "gradient_policy", check_options(
            self.returns, should_compute_output, gradient_policy, accumulates, unpack_grads))
        set_field(self, "should_compute_output", should_compute_output)
        set_field(self, "accumulates", accumulates)
        set_field(self, "unpack_grads", unpack_grads)
        set_field(self, "dense_gradient", _check_optional("dense_gradient", dense_gradient))

    def backward(self, root, grad=None):
        """Run backward from ``root`` (an owner, or a pair ``(owner,
        input_nr)``): ``grad`` is its gradient (returns mode; writes mode
        takes none)."""
        run_owner_graph(self, root, grad, None, False)

    def grad(self, root, grad, inputs, allow_unused=False):
        """The gradients flowing into ``inputs`` (owners or pairs), in order;
        nothing is accumulated. Returns mode only."""
        return run_owner_graph(self, root, grad, list(iterate(inputs, inputs_what)),
                               allow_unused)

    def __repr__(self):
        return f"OwnerGraph({self.parents!r}, {self.backward_!r}, mode={self.mode!r})"

    def __reduce__(self):
        return reduce_owner_graph(self, OwnerGraph)


def read_parents(parents, owner):
    """The snapshot of ``owner``'s parent items, read once through their own
    iteration."""
    collection = getattr(owner, parents) if type(parents) is str else parents(owner)
    if collection is None or (is_builtin_collection(collection) and len(collection) == 0):
        return ()
    if not is_builtin_collection(collection):
        collection = iterate(collection, parents_of_what, parents, owner)
    return tuple(collection)


def is_builtin_collection(collection):
    return type(collection) in (set, tuple, list, frozenset)


def read_metadata(graph, owner):
    """``metadata(owner)`` as the Node API reads ``input_metadata``: each
    entry an InputMetadata, None, a ``(shape, dtype[, device])`` tuple or a
    value to read them from."""
    return tuple([as_input_metadata(spec) for spec in
                  iterate(graph.metadata(owner), metadata_of_what, owner)])


# Note [The walk's owners stay alive]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A walk reads each owner's parents once and then runs the owners, which
# may drop their own references to the others (an owner's backward that
# clears its parents, as frameworks free their graph) before those run.
# So the walk holds a reference to every owner it has seen until it
# returns: ``held`` here, HeldOwners in the compiled core, whose ``order``
# and search frames are borrowed pointers to the owners. Nothing else may
# let go of them: a list can be found from Python code
# (``gc.get_referrers`` of an owner) and emptied, which here only lets an
# id be reused, but there would leave pointers to freed objects. So the
# compiled core keeps them in a C++ vector in an object the cyclic GC does
# not track, which no Python code can reach.


def search(graph, root, order, is_leaf, items_of, slots, held, keep_items):
    """Append to ``order`` the owners under ``root`` in the depth-first
    post-order of Note [Owner graphs], with ``is_leaf`` beside it, each
    owner's items to ``items_of`` with ``keep_items``, and (in returns mode)
    its slot count to ``slots`` (by id). ``held`` keeps every owner seen alive, so that its id
    stays its own (See Note [The walk's owners stay alive]). Iterative: any depth."""
    parents = graph.parents
    needs_no_gradient = graph.needs_no_gradient
    returns = graph.returns
    seen = {}
    refusals = {}  # needs_no_gradient's answers, by id (the owner is held)
    stack = []  # frames: [owner, items, index of the next item]
    reach_owner(graph, root, seen, stack, order, is_leaf, items_of, slots, held, keep_items)
    while stack:
        frame = stack[-1]
        items = frame[1]
        if frame[2] == len(items):
            stack.pop()
            owner = frame[0]
            seen[id(owner)] = _FINISHED
            order.append(owner)
            is_leaf.append(False)
            if keep_items:
                items_of.append(items)
            continue
        item = items[frame[2]]
        frame[2] += 1
        pair = split_item(item, frame[0])
        if pair is None:
            continue
        parent = pair[0]
        if needs_no_gradient is not None and refuses(needs_no_gradient, parent, refusals, held):
            continue
        parent_state = seen.get(id(parent))
        if parent_state is None:
            reach_owner(graph, parent, seen, stack, order, is_leaf, items_of, slots, held,
                        keep_items)
        elif parent_state == _ON_PATH:
            raise cycle_error(parent, parents)
        if returns and pair[1] != 0:  # every owner has slot 0
            check_input_nr(parent, pair[1], slots, frame[0])


def refuses(needs_no_gradient, owner, refusals, held):
    """``needs_no_gradient(owner)``, asked once per owner in a search. An
    answer that changed between two items would let one item's gradient
    reach an owner another item's answer refused, unchecked: the search
    reads no slot count of a refused owner."""
    answer = refusals.get(id(owner))
    if answer is None:
        answer = refusals[id(owner)] = bool(needs_no_gradient(owner))
        held.append(owner)  # its id stays its own while refusals holds it
    return answer


def reach_owner(graph, owner, seen, stack, order, is_leaf, items_of, slots, held, keep_items):
    """Read an owner the search reaches first: a leaf finishes at once,
    another one starts a frame."""
    held.append(owner)
    if graph.returns:
        slots[id(owner)] = count_slots(graph, owner)
    items = read_parents(graph.parents, owner)
    if not items:
        seen[id(owner)] = _FINISHED
        order.append(owner)
        is_leaf.append(True)
        if keep_items:
            items_of.append(items)
        return
    seen[id(owner)] = _ON_PATH
    stack.append([owner, items, 0])


def call_backward(graph, owner, grads, extra):
    """The owner's backward (See Note [Owner graphs]); in returns mode its
    gradients, with ``extra`` (the should_compute_output and buffered
    tuples its options ask for) after ``grads``."""
    backward = graph.backward_
    if not graph.returns:
        if type(backward) is str:
            getattr(owner, backward)()
        else:
            backward(owner)
        return None
    if graph.unpack_grads:
        extra = () if extra is None else extra
        return (getattr(owner, backward)(*grads, *extra) if type(backward) is str
                else backward(owner, *grads, *extra))
    if extra is not None:
        return (getattr(owner, backward)(grads, *extra) if type(backward) is str
                else backward(owner, grads, *extra))
    outputs = getattr(owner, backward)(grads) if type(backward) is str else backward(owner, grads)
    return outputs


def dense_grads(graph, grads):
    """``dense_gradient`` applied, in place, to each of ``grads`` that is a
    value but not a numpy array (See Note [Owner graphs])."""
    for k in range(len(grads)):
        # dense_gradient is Python code, which may reach the list (it is the
        # owner's InputBuffer's) and shorten it.
        if k >= len(grads):
            raise RuntimeError(GRADIENTS_CHANGED)
        grad = grads[k]
        if grad is not None and type(grad) is not np.ndarray:
            dense = graph.dense_gradient(grad)
            if k >= len(grads):
                raise RuntimeError(GRADIENTS_CHANGED)
            grads[k] = dense


def should_compute_outputs(owner, items, slots, exec_info):
    """One bool per parent item of ``owner``: whether a gradient there is
    used, that is, the item names a parent the search reached (not None,
    not refused by ``needs_no_gradient``) and, under ``grad(inputs=)``
    (``exec_info``: the ids of the owners that run or capture), one that
    runs or captures. See Note [Owner graphs]."""
    result = []
    for item in items:
        pair = split_item(item, owner)
        result.append(pair is not None and id(pair[0]) in slots
                      and (exec_info is None or id(pair[0]) in exec_info))
    return tuple(result)


def take_buffered(owner, items, buffers, slots):
    """One value per parent item of ``owner``: the sum its parent's
    InputBuffer holds so far at that slot, taken out of the buffer (None
    where there is none, or where an earlier item took it), so that what
    the backward returns replaces it (``accumulates``: See Note [Owner
    graphs]). The buffer no longer owns a value it gave away."""
    result = []
    for item in items:
        pair = split_item(item, owner)
        value = None
        if pair is not None and id(pair[0]) in slots:
            buffer = buffers.get(id(pair[0]))
            if type(buffer) is tuple:
                if pair[1] == 0:
                    value = buffer[0]
                    del buffers[id(pair[0])]
            elif buffer is not None and pair[1] < len(buffer.buffer):
                value = buffer.buffer[pair[1]]
                buffer.buffer[pair[1]] = None
                owned = buffer._owned
                if owned is not None and pair[1] < len(owned):
                    owned[pair[1]] = None
        result.append(value)
    return tuple(result)


def evaluate_owner(graph, owner, grads, items, buffers, slots, metadata_of, exec_info):
    """Run one owner's hooks and backward; in returns mode check its
    gradients and sum them into its parents' InputBuffers."""
    returns = graph.returns
    if graph.pre_hook is not None:
        # A tuple, as a Node's pre-hooks get: the hook cannot keep or edit
        # the owner's own list, which the engine reads after it.
        result = graph.pre_hook(owner, tuple(grads) if returns else ())
        if result is not None:
            if not returns:
                raise TypeError(f"pre_hook of a {owner_name(owner)} returned "
                                f"{type(result).__name__}; in mode={WRITES!r} hooks return None")
            grads = check_hook_result(owner, "pre_hook", result, len(grads))
    if graph.dense_gradient is not None:
        dense_grads(graph, grads)
    extra = None
    if graph.should_compute_output or graph.accumulates:
        extra = ()
        if graph.should_compute_output:
            extra += (should_compute_outputs(owner, items, slots, exec_info),)
        if graph.accumulates:
            extra += (take_buffered(owner, items, buffers, slots),)
    outputs = call_backward(graph, owner, grads, extra)
    if not returns:
        if graph.post_hook is not None:
            result = graph.post_hook(owner, (), ())
            if result is not None:
                raise TypeError(f"post_hook of a {owner_name(owner)} returned "
                                f"{type(result).__name__}; in mode={WRITES!r} hooks return None")
        return
    if not isinstance(outputs, (list, tuple)) or len(outputs) != len(items):
        outputs = read_returned(owner, outputs, len(items))  # a generator, or an error
    # A tuple is read as it is (no Python code can change it); a list is
    # copied. check_outputs copies a tuple it must change.
    outputs = check_outputs(graph, owner, outputs if type(outputs) is tuple else list(outputs),
                            items, slots, metadata_of)
    if graph.post_hook is not None:
        # Tuples, as a Node's hooks get: the hook returns new gradients,
        # and cannot keep or edit the list the engine passes on.
        result = graph.post_hook(owner, tuple(outputs), tuple(grads))
        if result is not None:
            outputs = check_outputs(graph, owner,
                                    check_hook_result(owner, "post_hook", result, len(items)),
                                    items, slots, metadata_of)
    if state.is_anomaly_enabled() and state.is_anomaly_check_nan_enabled():
        check_nan(owner, outputs)
    route_gradients(owner, outputs, items, buffers, slots)


def check_outputs(graph, owner, outputs, items, slots, metadata_of):
    """validate_outputs for an owner: a gradient for a parent that gets none
    is dropped; the others are values, checked against the parent's
    metadata where the framework gives it. ``outputs`` is a list (changed
    in place) or a tuple (copied into a list at the first change); returns
    the checked gradients."""
    format_error = None
    for i in range(len(outputs)):
        grad = outputs[i]
        if grad is None:
            continue
        pair = split_item(items[i], owner)
        if pair is None or id(pair[0]) not in slots:
            if type(outputs) is not list:
                outputs = list(outputs)
            outputs[i] = None
            continue
        metadata = None
        if graph.metadata is not None:
            all_metadata = metadata_of.get(id(pair[0]))
            if all_metadata is None:
                all_metadata = metadata_of[id(pair[0])] = read_metadata(graph, pair[0])
            if pair[1] < len(all_metadata):
                metadata = all_metadata[pair[1]]
        if gradient_matches(metadata, grad):
            continue
        if format_error is None:
            format_error = format_owner_error(owner)
        if type(outputs) is not list:
            outputs = list(outputs)
        outputs[i] = (validate_gradient_exact(i, grad, metadata, format_error)
                      if graph.gradient_policy == EXACT
                      else validate_gradient(i, grad, metadata, format_error))
    return outputs


def gradient_matches(metadata, grad):
    """A gradient that validate_gradient would return as it is: a value of
    a type a backend was found for where there is no metadata, else a numpy
    array whose dtype, shape and device are the slot's."""
    if metadata is None:
        return known_value_type(type(grad))
    return (type(metadata) is InputMetadata and type(grad) is np.ndarray and metadata.is_cpu
            and grad.dtype == metadata.dtype and grad.shape == metadata.shape)


def route_gradients(owner, outputs, items, buffers, slots):
    """Sum each gradient into its parent's InputBuffer, made on the first."""
    for i in range(len(outputs)):
        # The sum below runs Python code, which may reach the list and
        # shorten it.
        if i >= len(outputs):
            raise RuntimeError(GRADIENTS_CHANGED)
        grad = outputs[i]
        if grad is None:
            continue
        pair = split_item(items[i], owner)
        if pair is None:
            # A gradient Python code wrote (as above) where no gradient
            # flows: dropped, as check_outputs drops one.
            continue
        parent, input_nr = pair
        buffer = buffers.get(id(parent))
        if buffer is None:
            if slots[id(parent)] == 1:
                # Held as it is, as an InputBuffer holds a first gradient:
                # See Note [Owner graphs].
                buffers[id(parent)] = (grad,)
                continue
            buffer = buffers[id(parent)] = InputBuffer(slots[id(parent)])
        elif type(buffer) is tuple:
            # The second gradient: the first moves into the new buffer.
            first = buffer[0]
            buffer = buffers[id(parent)] = InputBuffer(1)
            buffer.add(0, first, False)
        buffer.add(input_nr, grad, False)


def run_one(graph, graph_task, checkpoint_valid, owner, sequence_nr, grads, items, buffers, slots,
            metadata_of, accumulate, exec_info):
    """Run one owner (``accumulate``: a leaf's gradient) as a node of
    ``graph_task`` runs: its thread state, its profiler event, its anomaly
    note."""
    profiler = state.profiler()
    start = time.perf_counter_ns() if profiler is not None else 0
    previous_graph_task = state.set_current_graph_task(graph_task)
    previous_grad_mode = state.is_grad_enabled()
    state.set_grad_enabled(False)
    # ANDed with the thread's: See Note [Checkpoint valid in nested backward]
    # in pyengine/_pure/state.py.
    previous_checkpoint_valid = state.swap_checkpoint_valid(
        checkpoint_valid and state.is_checkpoint_valid())
    # Kept: an owner may set it for good (See Note [An owner's thread state
    # comes back]).
    previous_multithreading = state.is_multithreading_enabled()
    try:
        if accumulate is not None:
            accumulate_into_leaf(accumulate, owner, grads[0] if len(grads) == 1 else grads)
        else:
            evaluate_owner(graph, owner, grads, items, buffers, slots, metadata_of, exec_info)
    except BaseException as error:
        if state.is_anomaly_enabled():
            add_owner_note(error, owner)
        raise
    finally:
        try:
            if profiler is not None:
                # In the running state, as the engine reports a node.
                profiler(OwnerRun(owner, sequence_nr), start, time.perf_counter_ns())
        finally:
            # Even where the callback raised: See Note [An owner's thread
            # state comes back].
            state.set_multithreading_enabled(previous_multithreading)
            state.swap_checkpoint_valid(previous_checkpoint_valid)
            state.set_grad_enabled(previous_grad_mode)
            state.set_current_graph_task(previous_graph_task)


# Note [An owner leaf accumulates under a lock]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Threads may walk owner graphs that share leaves (a model's parameters)
# at once, as they may run backward on Node graphs that do. A leaf's
# ``accumulate`` reads the leaf's gradient, adds and writes the sum (the
# default ``accumulate_grad`` and the adapters' alike), and the Python code
# in between lets other threads run (a large numpy add gives the GIL
# away): two walks that accumulated into one leaf together kept one of the
# two gradients. PyTorch's AccumulateGrad accumulates holding a mutex of
# its own, as a Node graph's leaf here holds its GradLock (See Note [The
# lock of a leaf's .grad] in pyengine/_pure/node.py). An owner leaf is the
# framework's object, with no room for a lock, so each core keeps one
# aside for each accumulation in flight: a LeafLock, with the leaf's
# identity (``id``), a GradLock and the count of the threads that hold it
# or wait for it, in a process-wide list.
# ``accumulate_into_leaf`` looks for the leaf's entry there (making one
# where there is none) and runs ``accumulate`` holding its lock, so that
# accumulations into one leaf follow one another and those into different
# leaves do not wait for each other. As for a Node graph's leaf:
# - an accumulation that starts another into the same leaf on its own
#   thread (which would wait for itself) is refused with RuntimeError;
# - a thread that waits for the lock lets the others run and honours
#   Ctrl-C; an error in ``accumulate`` lets go of it.
# An entry goes with its last user. So the list holds the accumulations in
# flight and no more (about one a thread, so a scan, cheaper than a dict
# keyed by the identity as an int), a process keeps nothing for the leaves
# it once accumulated into, and an entry's identity is always its live
# leaf's (the leaf lives while its accumulation runs). An entry per
# accumulation, not one kept per leaf: a table kept across backward calls
# grew with every leaf a process ever accumulated into, up to a bound, and
# the leak checks of tests/stress/test_error_path_leaks.py saw that as a
# leak; benchmarks/RESULTS.md ("An owner leaf's lock entry a step") has
# what each costs.
# A forked child starts on an empty list (and, in the twin, a new
# guard), as Note [Locks after fork] in pyengine/node.py has every
# process-wide lock replaced: a leaf whose lock a thread of the parent held
# at the fork would otherwise wait in the child for good. The parent's
# entries (its accumulations in flight at the fork) are kept, unused, for
# the child's life, not freed: a lock that other threads waited for at the
# fork is not one to destroy. An accumulation the forking thread was
# running ends in the child on an entry that is not in the child's list,
# and leaves that list alone.
# Writes mode accumulates nothing of the engine's (a framework's backward
# writes its parents' gradients itself, as safely as its own code does),
# and what ``grad(inputs=)`` captures is the walk's own: neither locks.
# The compiled core's list is guarded by the GIL (nothing in its updates
# runs Python code); the twin's by a reentrant lock of its own, under which
# no Python code of the framework's runs, only, at worst, a collection's
# __del__ (an entry is made before the guard is taken). The compiled
# LeafLock holds its GILGuardedLock itself, not a GradLock object, and keeps
# a few freed ones for the next accumulations.

# Note [An owner's thread state comes back]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each owner runs with the thread's grad mode off, its current graph task
# the walk's and its checkpoint flag set (``run_one``, as thread_main sets
# them around a node), and the thread gets them back after, with its
# multithreading mode, whatever the owner did (an owner that sets a mode
# for good sets it for itself, as a node does under PyTorch's
# ThreadLocalStateGuard). Two ways out skipped that:
# - A profiler callback that raised (a foreign one set with
#   ``set_profiler``, or the profiler's own, cut by Ctrl-C or out of
#   memory) raised from ``run_one``'s ``finally`` before the state was put
#   back: grad mode stayed off, so the thread's next forward recorded no
#   graph, and in the compiled core the thread's current graph task stayed a
#   borrowed pointer to the walk's graph task, freed once the walk ended: a
#   later ``queue_callback`` (or any query of the running backward)
#   crashed the process. The state now comes back in a ``finally`` of its
#   own, after the callback; the compiled core also keeps the thread's
#   WorkerState, which a backward run by an owner may have made, out of
#   the copy it puts back (``set_thread_state``).
# - In the twin, the state is three Python calls each way, and Ctrl-C's
#   KeyboardInterrupt comes out between them (See Note [Where the twin's
#   main thread sees an interrupt] in pyengine/_pure/engine.py): an
#   interrupt before ``run_one``'s ``try``, or in its ``finally``, or in
#   the final callbacks' own restore, left grad mode off. So the twin's
#   walk also puts all four back as they were outside it when it raises,
#   as its outermost Node backward does (Note [A backward that raises
#   leaves its ready queue] there). The compiled core's state is one C
#   struct, copied whole, which no interrupt cuts.
# tests/test_owner_graph_thread_state.py raises from a profiler callback
# and interrupts every kind of walk at random moments (from Python 3.10 on:
# See random_interrupts_need_3_10 in tests/conftest.py), and
# tests/test_owner_leaf_locks.py interrupts returns-mode walks; each checks
# the thread's state after every walk.

# Note [An interrupt in the twin's leaf locks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On the main thread, Ctrl-C's KeyboardInterrupt comes out of the twin
# between its steps (See Note [Where the twin's main thread sees an
# interrupt] in pyengine/_pure/engine.py): on entering a Python function,
# on a loop's back edge, after a call returns, in a blocking wait. An
# entry of ``_leaf_locks`` is two steps of state each way (in the list, and
# counted a user of), and an interrupt between them left an entry in the
# list for good: one counted by a call whose ``try`` had not begun, or
# counted by no one (put in the list, or its last user gone, with the
# interrupt before its ``drop``). Nothing hung (a later accumulation into
# the leaf finds the entry and its free lock), but the list is meant to
# hold the accumulations in flight and no more. Under random SIGINTs, one
# interrupt in about fifteen left one. So:
# - the ``try`` begins before the entry is looked for, and a call counts
#   itself a user of an entry and says so (``entry``) with no call between
#   the two; a new entry is counted before it goes in the list, so an
#   interrupt as the list's ``append`` returns finds it counted;
# - the ``finally`` lets go of the entry with the list's own C methods,
#   with no Python call first (the compiled core's ``drop_leaf_lock`` is
#   inline there).
# The compiled core does these steps in C, which no interrupt cuts.
# tests/test_owner_leaf_locks.py interrupts a thread's accumulations at
# random moments, hundreds of times, and checks that the list is empty after
# each. Left: a second interrupt while the first is handled (as the Note in
# engine.py leaves out), and an interrupt while another thread holds
# ``_leaf_locks_guard`` just as the ``finally`` asks for it, whose wait
# honours Ctrl-C.

class LeafLock:
    """An owner leaf's accumulation in flight, its entry in ``_leaf_locks``:
    See Note [An owner leaf accumulates under a lock]."""

    __slots__ = ("leaf", "lock", "users")

    def __init__(self, leaf):
        # The leaf's id, set before the entry goes in the list and not
        # changed after: the leaf lives while its accumulation runs, so no
        # other object has that id while the entry is there.
        self.leaf = leaf
        self.lock = GradLock()
        # The threads that hold or wait for the lock; guarded by
        # _leaf_locks_guard.
        self.users = 0


# The LeafLock of each accumulation in flight, about one a thread, so a list
# scanned for the leaf's id; guarded by _leaf_locks_guard: reentrant, for a
# __del__ that accumulates, run by a collection while the guard is held.
_leaf_locks = []
_leaf_locks_guard = threading.RLock()


def find_leaf_lock(leaf):
    """The entry of ``_leaf_locks`` for the leaf of id ``leaf``, or None
    (_leaf_locks_guard held)."""
    for entry in _leaf_locks:
        if entry.leaf == leaf:
            return entry
    return None


def accumulate_into_leaf(accumulate, leaf, gradient):
    """``accumulate(leaf, gradient)`` holding the leaf's lock: See Note [An
    owner leaf accumulates under a lock]. Its steps are ordered for Ctrl-C:
    See Note [An interrupt in the twin's leaf locks]."""
    key = id(leaf)
    made = None
    entry = None  # the entry this call counts itself a user of
    try:
        while entry is None:
            with _leaf_locks_guard:
                found = find_leaf_lock(key)
                if found is None and made is not None:
                    # Counted, and known counted, before it is in the list:
                    # no call between the two, so no interrupt.
                    made.users += 1
                    entry = made
                    _leaf_locks.append(made)
                elif found is not None:
                    found.users += 1
                    entry = found
            if entry is None:
                # Made without the guard, then looked for again under it.
                made = LeafLock(key)
        if entry.lock.held():
            raise RuntimeError(leaf_lock_taken_again_message(leaf))
        with entry.lock:
            accumulate(leaf, gradient)
    finally:
        if entry is not None:
            with _leaf_locks_guard:
                entry.users -= 1
                # The compiled core's drop_leaf_lock, here with no Python
                # call before the list's own methods: by identity (LeafLock
                # has no __eq__), and nothing where the entry is not there
                # (a fork replaced the list since it went in).
                if entry.users == 0 and entry in _leaf_locks:
                    _leaf_locks.remove(entry)


def leaf_locks_in_use():
    """How many owner leaves' locks a thread holds or waits for now (the
    entries of the list): for the tests."""
    with _leaf_locks_guard:
        return len(_leaf_locks)


# The lists of the parents of this process, kept: See Note [An owner leaf
# accumulates under a lock].
_leaf_locks_before_fork = []


def _reset_leaf_locks_after_fork():
    global _leaf_locks, _leaf_locks_guard
    _leaf_locks_before_fork.append(_leaf_locks)
    _leaf_locks = []
    _leaf_locks_guard = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_leaf_locks_after_fork)


def plain_writes(graph):
    """Writes mode with nothing to run around a method: the loop calls the
    methods directly (the same calls run_one makes, less what is off)."""
    return (not graph.returns and graph.pre_hook is None and graph.post_hook is None
            and state.profiler() is None and not state.is_anomaly_enabled())


def run_owner_graph(graph, root, grad, inputs, allow_unused):
    """Backward over the owner graph under ``root``: See Note [Owner graphs].
    Returns the captured gradients with ``inputs``, else None."""
    check_argument("graph", graph, OwnerGraph)
    returns = graph.returns
    if not returns and (grad is not None or inputs is not None):
        raise TypeError(f"mode={WRITES!r} takes no gradient and no inputs: the owners write "
                        "their parents' gradients themselves")
    if returns and grad is None:
        raise TypeError(f"mode={RETURNS!r} needs the root's gradient")
    root_owner, root_nr = split_root(root, "the root")
    if graph.needs_no_gradient is not None and graph.needs_no_gradient(root_owner):
        raise RuntimeError(f"the root (a {owner_name(root_owner)}) needs no gradient: "
                           "needs_no_gradient says so")
    wanted = None
    if inputs is not None:
        if not inputs:
            raise RuntimeError("grad needs at least one input")
        inputs = [split_root(item, f"inputs[{i}]") for i, item in enumerate(inputs)]
        wanted = {id(owner) for owner, _ in inputs}

    # slots and (below) buffers, keyed by id(owner): the compiled core keeps
    # both, with the search's seen, in one C table keyed by address, and
    # items_of in one C array (pyengine/_owner_table.h); held keeps each
    # key's owner alive, so that no id is reused while it runs.
    order, is_leaf, items_of, slots, held = [], [], [], {}, []
    search(graph, root_owner, order, is_leaf, items_of, slots, held, returns)
    if returns:
        check_input_nr(root_owner, root_nr, slots, "the root")
        for i, (owner, input_nr) in enumerate(inputs or ()):
            if id(owner) in slots:
                check_input_nr(owner, input_nr, slots, f"inputs[{i}]")
    if graph.visit is not None:
        for owner in order:
            graph.visit(owner)

    current = state.get_current_graph_task()
    graph_task = GraphTask(False, False, 0 if current is None else current.reentrant_depth + 1,
                           None, multithreading=state.is_multithreading_enabled())
    link_enclosing_graph_task(graph_task)
    # grad(inputs=) prunes, so a reentrant checkpoint is not valid in it.
    checkpoint_valid = inputs is None
    buffers, metadata_of = {}, {}
    captured = [None] * len(inputs) if inputs is not None else None
    needed = mark_needed(order, is_leaf, items_of, wanted) if inputs is not None else None
    # The owners that run or capture under grad(inputs=), for should_compute_output.
    exec_info = needed | wanted if needed is not None and graph.should_compute_output else None
    if returns:
        metadata = None
        if graph.metadata is not None:
            all_metadata = metadata_of[id(root_owner)] = read_metadata(graph, root_owner)
            if root_nr < len(all_metadata):
                metadata = all_metadata[root_nr]
        grad = (validate_gradient_exact(0, grad, metadata, format_root_error)
                if graph.gradient_policy == EXACT
                else validate_gradient(0, grad, metadata, format_root_error))
        buffers[id(root_owner)] = InputBuffer(slots[id(root_owner)])
        buffers[id(root_owner)].add(root_nr, grad, False)
    accumulate = graph.accumulate if graph.accumulate is not None else accumulate_grad
    backward = graph.backward_
    # What run_one changes per owner, as it is out here: put back where the
    # walk raises. See Note [An owner's thread state comes back].
    outside = (state.is_grad_enabled(), state.get_current_graph_task(),
               state.is_checkpoint_valid(), state.is_multithreading_enabled())
    try:
        i = len(order) - 1
        if plain_writes(graph) and type(backward) is str:
            # run_one without what is off: See Note [Owner graphs].
            while i >= 0:
                if not is_leaf[i]:
                    previous_graph_task = state.set_current_graph_task(graph_task)
                    previous_grad_mode = state.is_grad_enabled()
                    state.set_grad_enabled(False)
                    # As run_one's: True ANDed with the thread's, which stays.
                    previous_checkpoint_valid = state.is_checkpoint_valid()
                    previous_multithreading = state.is_multithreading_enabled()
                    try:
                        getattr(order[i], backward)()
                    finally:
                        state.set_multithreading_enabled(previous_multithreading)
                        state.swap_checkpoint_valid(previous_checkpoint_valid)
                        state.set_grad_enabled(previous_grad_mode)
                        state.set_current_graph_task(previous_graph_task)
                i -= 1
        while i >= 0:
            owner = order[i]
            if not returns:
                if not is_leaf[i]:
                    run_one(graph, graph_task, True, owner, i, None, None, None, None, None, None,
                            None)
                i -= 1
                continue
            buffer = buffers.pop(id(owner), None)
            if buffer is None:
                i -= 1
                continue
            grads = [buffer[0]] if type(buffer) is tuple else buffer.buffer
            if wanted is not None and id(owner) in wanted:
                for k, (input_owner, input_nr) in enumerate(inputs):
                    if input_owner is owner and input_nr < len(grads):
                        captured[k] = grads[input_nr]
            if is_leaf[i]:
                if inputs is None:
                    run_one(graph, graph_task, True, owner, i, grads, None, None, None, None,
                            accumulate, None)
            elif needed is None or id(owner) in needed:
                run_one(graph, graph_task, checkpoint_valid, owner, i, grads, items_of[i], buffers,
                        slots, metadata_of, None, exec_info)
            i -= 1
        graph_task.mark_as_completed_and_run_post_processing()
        if graph_task.exception is not None:
            # A final callback's error (or an interrupt as the callbacks'
            # state was put back); taken off the task, as execute does.
            error, graph_task.exception_ = graph_task.exception, None
            try:
                raise error
            finally:
                # See Note [A raised error must not name itself in its frame] in
                # pyengine/_pure/engine.py.
                del error
    except BaseException:
        grad_mode, current_graph_task, current_checkpoint_valid, multithreading = outside
        state.set_current_graph_task(current_graph_task)
        state.swap_checkpoint_valid(current_checkpoint_valid)
        state.set_grad_enabled(grad_mode)
        state.set_multithreading_enabled(multithreading)
        raise
    if captured is None:
        return None
    if not allow_unused:
        for k in range(len(captured)):
            if captured[k] is None:
                raise RuntimeError(f"inputs[{k}] (a {owner_name(inputs[k][0])}) was not reached "
                                   "by any gradient. Set allow_unused=True if this is the "
                                   "desired behavior.")
    return captured


def owner_graph_edge(root, children, method, node_type, edge_type):
    """The Edge into the node of ``root`` in the graph of gradient-free nodes
    that the owner graph under it means in writes mode (See Note [Owner
    graphs]): a node per non-leaf owner, made in the post-order, whose next
    edges go to its distinct non-leaf parents in item order; None when
    ``root`` is a leaf. For looking at a graph: ``node_type`` is a
    gradient-free node class taking ``(owner, method, next_edges)``,
    ``edge_type`` the core's Edge. ``root`` may be a pair ``(owner,
    input_nr)``, as a walk's root: its owner is the root."""
    graph = OwnerGraph(children, method)
    # Checked before the search, as a walk checks them: the nodes take a
    # method's name only.
    if type(graph.backward_) is not str:
        raise TypeError(f"method must be a str (a method name) to translate an owner graph "
                        f"into nodes, got {type(method).__name__}")
    root = split_root(root, "the root")[0]
    order, is_leaf, items_of, held = [], [], [], []
    search(graph, root, order, is_leaf, items_of, {}, held, True)
    edge_of = {}  # id(owner) -> the Edge into its node
    edge = None
    for i in range(len(order)):
        if is_leaf[i]:
            continue
        next_edges, distinct = [], set()
        for item in items_of[i]:
            pair = split_item(item, order[i])
            if pair is not None and id(pair[0]) in edge_of and id(pair[0]) not in distinct:
                distinct.add(id(pair[0]))
                next_edges.append(edge_of[id(pair[0])])
        edge = edge_of[id(order[i])] = edge_type(node_type(order[i], method, tuple(next_edges)), 0)
    return edge if order and not is_leaf[-1] else None
