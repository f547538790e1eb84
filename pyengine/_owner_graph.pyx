"""Owner graphs, compiled: the ``OwnerGraph`` protocol and its walk (the
depth-first post-order of Note [Owner graphs], run in reverse), without a
Python object per owner in writes mode. In returns mode each owner's slot
count and InputBuffer live in an ``OwnerTable`` keyed by address, and its
parent items in ``OwnerItems``, one C array (both in
``pyengine/_owner_table.h``), where the twin has two dicts keyed by ``id()``
and a tuple per owner; the other dicts are keyed by ``PyLong_FromVoidPtr``,
``id()``'s own value, without its Python call.

Twin: ``pyengine/_pure/owner_graph.py``: the same functions under the same
names, in the same order. The error messages (``split_item``,
``count_slots`` and ``check_input_nr`` raise through the twin's), the
default ``accumulate``, the profiler's ``OwnerRun`` record and
``grad(inputs=)``'s pruning (``mark_needed``) are the twin's: slow paths
written once (See Note [Slow paths are shared]).
"""

cimport cython
cimport numpy as cnp
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport uintptr_t
from libcpp.vector cimport vector

from pyengine._graph_task cimport (DependencyMap, GraphTask, link_enclosing_graph_task,
                                   new_graph_task, running_thread_state)
from pyengine._input_buffer cimport InputBuffer, new_input_buffer
from pyengine._interrupts cimport WORK_BETWEEN_YIELDS, let_others_run, yield_to_other_threads
from pyengine._locks cimport GILGuardedLock
from pyengine._node cimport InputMetadata
from pyengine._validate_outputs cimport known_value_type, numpy_gradient_matches
from pyengine._state cimport ThreadState, anomaly_check_nan, anomaly_enabled, profiler, thread_state

import os
from time import perf_counter_ns as _perf_counter_ns

from pyengine._shared.owner_graph_checks import (EXACT, GRADIENTS_CHANGED, REDUCE, RETURNS, WRITES,
                                                OwnerRun, accumulate_grad, add_owner_note,
                                                check_hook_result, check_nan, check_options,
                                                check_reader, cycle_error, format_owner_error,
                                                format_root_error, inputs_what, iterate,
                                                leaf_lock_taken_again_message, mark_needed,
                                                metadata_of_what, owner_name, parents_of_what,
                                                read_returned, reduce_owner_graph, split_root)
from pyengine._shared.owner_graph_checks import check_input_nr as check_input_nr_slow
from pyengine._shared.owner_graph_checks import count_slots as count_slots_slow
from pyengine._shared.owner_graph_checks import split_item as split_item_slow
from pyengine._shared.messages import (MAX_INPUT_NR, OWNER_GRAPH_INITIALIZED_WHY,
                                       initialized_once_message, raise_error)
from pyengine._node import as_input_metadata
from pyengine._shared.gradient_checks import validate_gradient, validate_gradient_exact

__all__ = ["OwnerGraph", "run_owner_graph"]

cnp.import_array()
# count_slots' limit as a C integer, for split_item's check per item.
cdef Py_ssize_t max_input_nr = MAX_INPUT_NR

cdef extern from "_table_growth.h":
    size_t TABLE_GROWTH_STEP "pyengine_TABLE_GROWTH_STEP"

cdef extern from "_owner_table.h":
    enum OwnerState "pyengine_OwnerState":
        NOT_SEEN "pyengine_NOT_SEEN"
        ON_PATH "pyengine_ON_PATH"
        FINISHED "pyengine_FINISHED"
    cdef struct OwnerEntry "pyengine_OwnerEntry":
        PyObject* node
        int slots
        int state  # an OwnerState: the owner's in the search
        PyObject* buffer  # owned, or NULL
        PyObject* gradient  # owned, or NULL: a one-slot owner's only gradient so far
    cppclass OwnerTable "pyengine_OwnerTable":
        OwnerTable()
        bint full()
        bint grow_step() except +
        void reserve(size_t count) except +
        OwnerEntry* add(PyObject* owner, size_t* index)
        OwnerEntry* at(PyObject* owner, size_t index)
        OwnerEntry* find(PyObject* owner)
    cppclass OwnerItems "pyengine_OwnerItems":
        OwnerItems()
        void append_owner(PyObject** first, size_t count) except +
        size_t owners()
        PyObject** of(size_t index)
        Py_ssize_t count(size_t index)

cdef extern from "Python.h":
    object PyObject_CallMethodNoArgs(object obj, object name)
    object PyObject_CallMethodOneArg(object obj, object name, object arg)
    object PyObject_CallOneArg(object callable, object arg)
    bint PyTuple_CheckExact(object obj)
    bint PyList_CheckExact(object obj)
    bint PyLong_Check(object obj)
    bint PyBool_Check(object obj)
    # Checked by hand (split_item), so that an int too big is the twin's
    # IndexError, not Cython's OverflowError.
    Py_ssize_t PyLong_AsSsize_t(object obj) noexcept
    PyObject* PyErr_Occurred() noexcept
    void PyErr_Clear() noexcept
    # On the arena's owned pointers, without a reference per use.
    void decref "Py_DECREF"(PyObject* obj)
    # id(): the same int, without a Python call and its audit event.
    object address "PyLong_FromVoidPtr"(void* pointer)


def _check_optional(what, value):
    if value is not None and not callable(value):
        raise TypeError(f"{what} must be a callable or None, got {type(value).__name__}")
    return value


cdef class OwnerGraph:
    """How to read a framework's own graph, and backward on it. See Note
    [Owner graphs] in ``pyengine/_pure/owner_graph.py`` for every argument;
    made once per framework.

    ``OwnerGraph("_prev", "_backward").backward(value)`` runs micrograd's
    graph; ``OwnerGraph(parents, vjp, mode="returns").backward(y, grad)``
    one whose backward returns its parents' gradients."""

    cdef readonly object parents
    cdef readonly object backward_
    cdef readonly str mode
    cdef readonly bint returns
    cdef readonly object num_inputs
    cdef readonly object metadata
    cdef readonly object accumulate
    cdef readonly object visit
    cdef readonly object needs_no_gradient
    cdef readonly object pre_hook
    cdef readonly object post_hook
    cdef readonly bint should_compute_output
    cdef readonly str gradient_policy
    cdef readonly bint accumulates
    cdef readonly bint unpack_grads
    cdef readonly object dense_gradient
    # The number of owners the last walk reached: the next one sizes its
    # table and vectors by it (a hint; written under the GIL).
    cdef size_t owners_hint
    # Set as __init__ starts: a second __init__ is refused (See Note [An
    # owner graph is initialized once] in pyengine/_pure/owner_graph.py).
    cdef bint initialized_

    def __init__(self, parents, backward, *, mode=WRITES, num_inputs=None, metadata=None,
                 accumulate=None, visit=None, needs_no_gradient=None, pre_hook=None,
                 post_hook=None, should_compute_output=False, gradient_policy=REDUCE,
                 accumulates=False, unpack_grads=False, dense_gradient=None):
        # Before any Python code runs (a mode's __eq__ may): See Note [An
        # owner graph is initialized once] in pyengine/_pure/owner_graph.py.
        if self.initialized_:
            raise TypeError(initialized_once_message(self, OWNER_GRAPH_INITIALIZED_WHY))
        self.initialized_ = True
        self.parents = check_reader("parents", parents)
        self.backward_ = check_reader("backward", backward)
        if mode != WRITES and mode != RETURNS:
            raise ValueError(f"mode must be {WRITES!r} or {RETURNS!r}, got {mode!r}")
        self.mode = mode
        self.returns = mode == RETURNS
        if not self.returns:
            for what, value in (("num_inputs", num_inputs), ("metadata", metadata),
                                ("accumulate", accumulate), ("dense_gradient", dense_gradient)):
                if value is not None:
                    raise TypeError(f"{what} is for mode={RETURNS!r}: in mode={WRITES!r} "
                                    "the owners write their parents' gradients themselves")
        self.num_inputs = _check_optional("num_inputs", num_inputs)
        self.metadata = _check_optional("metadata", metadata)
        self.accumulate = _check_optional("accumulate", accumulate)
        self.visit = _check_optional("visit", visit)
        self.needs_no_gradient = _check_optional("needs_no_gradient", needs_no_gradient)
        self.pre_hook = _check_optional("pre_hook", pre_hook)
        self.post_hook = _check_optional("post_hook", post_hook)
        self.gradient_policy = check_options(self.returns, should_compute_output,
                                             gradient_policy, accumulates, unpack_grads)
        self.should_compute_output = should_compute_output
        self.accumulates = accumulates
        self.unpack_grads = unpack_grads
        self.dense_gradient = _check_optional("dense_gradient", dense_gradient)

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


cdef inline int split_item(object item, object holder, PyObject** parent,
                           Py_ssize_t* input_nr) except -1:
    """Set ``parent`` and ``input_nr`` from a parent item of ``holder``;
    return 0 where no gradient flows (None, or a pair whose owner is None),
    else 1. Makes no object."""
    cdef Py_ssize_t nr
    if item is None:
        return 0
    if PyTuple_CheckExact(item):
        if (len(<tuple>item) != 2 or not PyLong_Check((<tuple>item)[1])
                or PyBool_Check((<tuple>item)[1])):
            split_item_slow(item, holder)  # raises, with the twin's message
        # An int past Py_ssize_t reads as -1 here, and so goes the slow
        # way to the twin's IndexError rather than an OverflowError.
        nr = PyLong_AsSsize_t((<tuple>item)[1])
        if nr == -1 and PyErr_Occurred() != NULL:
            PyErr_Clear()
        if not 0 <= nr < max_input_nr:
            split_item_slow(item, holder)  # raises, with the twin's message
        if (<tuple>item)[0] is None:
            return 0
        parent[0] = <PyObject*>(<tuple>item)[0]
        input_nr[0] = nr
        return 1
    parent[0] = <PyObject*>item
    input_nr[0] = 0
    return 1


cdef inline bint is_builtin_collection(object collection) noexcept:
    return (type(collection) is set or type(collection) is tuple or type(collection) is list
            or type(collection) is frozenset)


cdef int count_slots(OwnerGraph graph, object owner) except -1:
    """``num_inputs(owner)``, checked; 1 without ``num_inputs``."""
    if graph.num_inputs is None:
        return 1
    return count_slots_slow(graph, owner)


cdef int check_input_nr(object owner, Py_ssize_t input_nr, OwnerTable* owners,
                        object where) except -1:
    """The twin's, on the table: ``slots`` there, ``owners`` here."""
    cdef OwnerEntry* entry = owners.find(<PyObject*>owner)
    if entry == NULL:
        check_input_nr_slow(owner, input_nr, {}, where)  # raises the twin's KeyError
    if not 0 <= input_nr < entry.slots:
        # Raises, with the twin's message.
        check_input_nr_slow(owner, input_nr, {id(owner): entry.slots}, where)
    return 0


cdef tuple read_metadata(OwnerGraph graph, object owner):
    """``metadata(owner)`` as the Node API reads ``input_metadata``: each
    entry an InputMetadata, None, a ``(shape, dtype[, device])`` tuple or a
    value to read them from."""
    # A loop, not a list comprehension: See Note [Python allocations that
    # fail] in pyengine/_engine.pyx.
    specs = []
    for spec in iterate(graph.metadata(owner), metadata_of_what, owner):
        specs.append(as_input_metadata(spec))
    return tuple(specs)


# Not tracked by the GC, so that Python code cannot reach it (a list can
# be found with gc.get_referrers and emptied): See Note [The walk's owners
# stay alive] in pyengine/_pure/owner_graph.py.
@cython.final
@cython.no_gc
cdef class HeldOwners:
    """A reference to every owner a walk has seen: the twin's ``held``
    list, kept in C."""
    cdef vector[PyObject*] owners

    cdef inline int hold(self, object owner) except -1:
        self.owners.push_back(<PyObject*>owner)  # MemoryError before the reference
        Py_INCREF(owner)
        return 0

    def __dealloc__(self):
        cdef size_t i
        for i in range(self.owners.size()):
            decref(self.owners[i])


cdef struct Frame:
    PyObject* owner  # borrowed: HeldOwners owns it
    # The owner's items are arena[start:end]; the next to read is arena[next].
    size_t start
    size_t next
    size_t end
    size_t slot  # where the owner's search state is: See enter_owner


cdef int read_parents(object parents, object owner, vector[PyObject*]& arena) except -1:
    """Append the snapshot of ``owner``'s parent items to the arena, each
    owned, read once through their own iteration. An error leaves the items
    read so far in the arena, which owns them: search releases them all."""
    cdef object collection = (getattr(owner, <str>parents) if type(parents) is str
                              else PyObject_CallOneArg(parents, owner))
    if collection is None or (is_builtin_collection(collection) and len(collection) == 0):
        return 0
    if not is_builtin_collection(collection):
        collection = iterate(collection, parents_of_what, parents, owner)
    for item in collection:
        Py_INCREF(item)
        arena.push_back(<PyObject*>item)
    return 0


cdef int search(OwnerGraph graph, object root, vector[PyObject*]& order, vector[char]& is_leaf,
                OwnerItems* items_of, OwnerTable* owners, HeldOwners held, bint keep_items,
                size_t expected) except -1:
    """Append to ``order`` the owners under ``root`` in the depth-first
    post-order of Note [Owner graphs] (borrowed: ``held`` keeps every owner
    seen alive, so that no address is reused), with ``is_leaf`` beside it,
    each owner's items to ``items_of`` with ``keep_items`` (the twin's list
    of tuples: See pyengine/_owner_table.h), and (in returns mode) its
    slot count to ``owners`` (the twin's ``slots``, by address: See
    pyengine/_owner_table.h); each owner's search state (the twin's
    ``seen``) goes where enter_owner says. The snapshots are the
    frames' ranges of one arena, used as a stack, so that no object is made
    per owner without ``keep_items``. Iterative: any depth; it lets other
    threads run as it goes (See Note [Long passes let other threads run])."""
    cdef object parents = graph.parents
    cdef object needs_no_gradient = graph.needs_no_gradient
    cdef DependencyMap seen  # writes mode's search states: See enter_owner
    cdef dict refusals = {}  # the twin's: See refuses
    cdef vector[Frame] stack
    cdef vector[PyObject*] arena
    cdef Frame* frame
    cdef PyObject* parent
    cdef Py_ssize_t input_nr
    cdef int parent_state
    cdef Py_ssize_t work_left = WORK_BETWEEN_YIELDS
    cdef size_t i, slot
    # Sized as the last walk of this graph (no more than a table step): no
    # doubling on a graph run again.
    expected = min(expected, <size_t>TABLE_GROWTH_STEP)
    stack.reserve(expected)
    arena.reserve(expected)
    order.reserve(expected)
    is_leaf.reserve(expected)
    if graph.returns:
        owners.reserve(expected)
    try:
        enter_owner(graph.returns, &seen, owners, <PyObject*>root, &slot)
        reach_owner(graph, root, slot, &seen, stack, arena, order, is_leaf, items_of, owners,
                    held, keep_items)
        while not stack.empty():
            let_others_run(&work_left)
            frame = &stack.back()
            if frame.next == frame.end:
                finish_owner(graph.returns, &seen, owners, frame.owner, frame.slot)
                order.push_back(frame.owner)
                is_leaf.push_back(0)
                if keep_items:
                    # The arena's references move to items_of: no object per owner.
                    items_of.append_owner(&arena[frame.start], frame.end - frame.start)
                    arena.resize(frame.start)
                    stack.pop_back()
                    continue
                for i in range(frame.start, frame.end):
                    decref(arena[i])
                arena.resize(frame.start)
                stack.pop_back()
                continue
            item = <object>arena[frame.next]
            frame.next += 1
            if not split_item(item, <object>frame.owner, &parent, &input_nr):
                continue
            if needs_no_gradient is not None and refuses(needs_no_gradient, <object>parent,
                                                         refusals, held):
                continue
            parent_state = enter_owner(graph.returns, &seen, owners, parent, &slot)
            if parent_state == ON_PATH:
                raise cycle_error(<object>parent, parents)
            holder = <object>frame.owner  # reach_owner may move the frames
            if parent_state == NOT_SEEN:
                reach_owner(graph, <object>parent, slot, &seen, stack, arena, order, is_leaf,
                            items_of, owners, held, keep_items)
            if graph.returns and input_nr != 0:  # every owner has slot 0
                check_input_nr(<object>parent, input_nr, owners, holder)
    finally:
        # What an error (a cycle, an attribute, Ctrl-C) left.
        for i in range(arena.size()):
            decref(arena[i])
        # seen is not released into the kept tables: See Note [Tables kept
        # between backward calls].
    return 0


cdef bint refuses(object needs_no_gradient, object owner, dict refusals,
                   HeldOwners held) except -1:
    """``needs_no_gradient(owner)``, asked once per owner in a search: See
    the twin's ``refuses``."""
    key = address(<void*>owner)
    answer = refusals.get(key)
    if answer is None:
        answer = refusals[key] = bool(needs_no_gradient(owner))
        held.hold(owner)  # its address stays its own while refusals holds it
    return answer


cdef int enter_owner(bint returns, DependencyMap* seen, OwnerTable* owners, PyObject* owner,
                     size_t* slot) except -1:
    """An edge into ``owner`` (or the root, with none) found by the search:
    returns its search state before it, and puts an owner not seen yet on
    the path; ``slot``: where its state is (a hint for finish_owner).
    Returns mode keeps the states in its owner table, beside the slot
    counts and gradients, so that an edge is one probe; writes mode, which
    keeps nothing else per owner, in ``seen``, whose slots are half the size
    (See Note [The owner table hash])."""
    cdef OwnerEntry* entry
    cdef int state
    if returns:
        if owners.full():
            # See pyengine/_table_growth.h.
            while not owners.grow_step():
                yield_to_other_threads()
        entry = owners.add(owner, slot)
        state = entry.state
        if state == NOT_SEEN:
            entry.state = ON_PATH
        return state
    if seen.full():
        while not seen.grow_step():
            yield_to_other_threads()
    return <int>seen.add_edge(owner, slot)


cdef inline void finish_owner(bint returns, DependencyMap* seen, OwnerTable* owners,
                              PyObject* owner, size_t slot) noexcept:
    """The search below ``owner`` is done (``slot``: from enter_owner)."""
    if returns:
        owners.at(owner, slot).state = FINISHED
    else:
        seen.finish(owner, slot)


cdef int reach_owner(OwnerGraph graph, object owner, size_t slot, DependencyMap* seen,
                     vector[Frame]& stack, vector[PyObject*]& arena, vector[PyObject*]& order,
                     vector[char]& is_leaf, OwnerItems* items_of, OwnerTable* owners,
                     HeldOwners held, bint keep_items) except -1:
    """Read an owner the search reaches first (on the path, at ``slot``:
    See enter_owner): a leaf finishes at once, another one starts a frame.
    Only the search adds entries, so Python code run here (reading the
    parents, num_inputs) leaves ``slot`` where it is."""
    held.hold(owner)  # before any Python code runs: its address stays its own
    if graph.returns:
        owners.at(<PyObject*>owner, slot).slots = count_slots(graph, owner)
    cdef Frame frame
    frame.start = arena.size()
    read_parents(graph.parents, owner, arena)
    if arena.size() == frame.start:
        finish_owner(graph.returns, seen, owners, <PyObject*>owner, slot)
        order.push_back(<PyObject*>owner)
        is_leaf.push_back(1)
        if keep_items:
            items_of.append_owner(NULL, 0)
        return 0
    frame.owner = <PyObject*>owner
    frame.slot = slot
    frame.next = frame.start
    frame.end = arena.size()
    stack.push_back(frame)
    return 0


cdef object call_backward(OwnerGraph graph, object owner, list grads, tuple extra):
    """The owner's backward (See Note [Owner graphs]); in returns mode its
    gradients, with ``extra`` (the should_compute_output and buffered
    tuples its options ask for) after ``grads``."""
    cdef object backward = graph.backward_
    if not graph.returns:
        if type(backward) is str:
            PyObject_CallMethodNoArgs(owner, backward)
        else:
            PyObject_CallOneArg(backward, owner)
        return None
    if graph.unpack_grads:
        if extra is None and len(grads) == 1:
            # One gradient, as autograd's vjp(g) takes it: no tuple of arguments.
            return (PyObject_CallMethodOneArg(owner, backward, grads[0]) if type(backward) is str
                    else backward(owner, grads[0]))
        extra = () if extra is None else extra
        return (getattr(owner, <str>backward)(*grads, *extra) if type(backward) is str
                else backward(owner, *grads, *extra))
    if extra is not None:
        return (getattr(owner, <str>backward)(grads, *extra) if type(backward) is str
                else backward(owner, grads, *extra))
    outputs = (PyObject_CallMethodOneArg(owner, backward, grads) if type(backward) is str
               else backward(owner, grads))
    return outputs


cdef int dense_grads(OwnerGraph graph, list grads) except -1:
    """``dense_gradient`` applied, in place, to each of ``grads`` that is a
    value but not a numpy array (See Note [Owner graphs])."""
    cdef Py_ssize_t k
    for k in range(len(grads)):
        # dense_gradient is Python code, which may reach the list (it is the
        # owner's InputBuffer's) and shorten it.
        if k >= len(grads):
            raise RuntimeError(GRADIENTS_CHANGED)
        grad = grads[k]
        if grad is not None and type(grad) is not cnp.ndarray:
            dense = graph.dense_gradient(grad)
            if k >= len(grads):
                raise RuntimeError(GRADIENTS_CHANGED)
            grads[k] = dense
    return 0


cdef tuple should_compute_outputs(object owner, PyObject** items, Py_ssize_t n_items,
                                  OwnerTable* owners, object exec_info):
    """One bool per parent item of ``owner``: whether a gradient there is
    used, that is, the item names a parent the search reached (not None,
    not refused by ``needs_no_gradient``) and, under ``grad(inputs=)``
    (``exec_info``: the ids of the owners that run or capture), one that
    runs or captures. See Note [Owner graphs]."""
    cdef PyObject* parent
    cdef Py_ssize_t input_nr
    cdef Py_ssize_t i
    cdef list result = []
    for i in range(n_items):
        result.append(bool(split_item(<object>items[i], owner, &parent, &input_nr)
                           and owners.find(parent) != NULL
                           and (exec_info is None
                                or address(<void*>parent) in <set>exec_info)))
    return tuple(result)


cdef tuple take_buffered(object owner, PyObject** items, Py_ssize_t n_items, OwnerTable* owners):
    """One value per parent item of ``owner``: the sum its parent's
    InputBuffer holds so far at that slot, taken out of the buffer (None
    where there is none, or where an earlier item took it), so that what
    the backward returns replaces it (``accumulates``: See Note [Owner
    graphs]). The buffer no longer owns a value it gave away."""
    cdef PyObject* parent
    cdef Py_ssize_t input_nr
    cdef Py_ssize_t i
    cdef OwnerEntry* entry
    cdef InputBuffer buffer
    cdef list result = []
    for i in range(n_items):
        value = None
        if split_item(<object>items[i], owner, &parent, &input_nr):
            entry = owners.find(parent)
            if entry != NULL and entry.gradient != NULL:
                if input_nr == 0:
                    value = <object>entry.gradient
                    decref(entry.gradient)
                    entry.gradient = NULL
            elif entry != NULL and entry.buffer != NULL:
                buffer = <InputBuffer>entry.buffer
                # Python code can reach an InputBuffer and write its buffer.
                if buffer.buffer is not None and input_nr < len(buffer.buffer):
                    value = buffer.buffer[input_nr]
                    buffer.buffer[input_nr] = None
                    if buffer._owned is not None and input_nr < len(buffer._owned):
                        buffer._owned[input_nr] = None
        result.append(value)
    return tuple(result)


cdef int evaluate_owner(OwnerGraph graph, object owner, list grads, PyObject** items,
                        Py_ssize_t n_items,
                        OwnerTable* owners, dict metadata_of, object exec_info) except -1:
    """Run one owner's hooks and backward; in returns mode check its
    gradients and sum them into its parents' InputBuffers."""
    cdef bint returns = graph.returns
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
    cdef tuple extra = None
    if graph.should_compute_output or graph.accumulates:
        extra = ()
        if graph.should_compute_output:
            extra += (should_compute_outputs(owner, items, n_items, owners, exec_info),)
        if graph.accumulates:
            extra += (take_buffered(owner, items, n_items, owners),)
    outputs = call_backward(graph, owner, grads, extra)
    if not returns:
        if graph.post_hook is not None:
            result = graph.post_hook(owner, (), ())
            if result is not None:
                raise TypeError(f"post_hook of a {owner_name(owner)} returned "
                                f"{type(result).__name__}; in mode={WRITES!r} hooks return None")
        return 0
    if not isinstance(outputs, (list, tuple)) or len(outputs) != n_items:
        outputs = read_returned(owner, outputs, n_items)  # a generator, or an error
    # A tuple is read as it is (no Python code can change it); a list is
    # copied. check_outputs copies a tuple it must change.
    checked = check_outputs(graph, owner,
                            outputs if PyTuple_CheckExact(outputs) else list(outputs),
                            items, n_items, owners, metadata_of)
    if graph.post_hook is not None:
        # Tuples, as a Node's hooks get: the hook returns new gradients,
        # and cannot keep or edit the list the engine passes on.
        result = graph.post_hook(owner, tuple(checked), tuple(grads))
        if result is not None:
            checked = check_outputs(graph, owner,
                                    check_hook_result(owner, "post_hook", result, n_items),
                                    items, n_items, owners, metadata_of)
    if anomaly_enabled() and anomaly_check_nan():
        check_nan(owner, checked)
    route_gradients(owner, checked, items, n_items, owners)
    return 0


# Bounds checked: each outputs[i] follows Python code (the metadata, a
# cast), which may reach the list and shorten it; an IndexError, as the
# twin's, where the build's default would read past its end.
@cython.boundscheck(True)
cdef object check_outputs(OwnerGraph graph, object owner, object outputs, PyObject** items,
                          Py_ssize_t n_items, OwnerTable* owners, dict metadata_of):
    """validate_outputs for an owner: a gradient for a parent that gets none
    is dropped; the others are values, checked against the parent's
    metadata where the framework gives it. ``outputs`` is a list (changed
    in place) or a tuple (copied into a list at the first change); returns
    the checked gradients."""
    cdef PyObject* parent
    cdef Py_ssize_t input_nr
    cdef Py_ssize_t i
    format_error = None
    for i in range(len(outputs)):
        grad = outputs[i]
        if grad is None:
            continue
        if i >= n_items:
            raise IndexError("tuple index out of range")  # the twin's items[i]
        if (not split_item(<object>items[i], owner, &parent, &input_nr)
                or owners.find(parent) == NULL):
            if not PyList_CheckExact(outputs):
                outputs = list(outputs)
            outputs[i] = None
            continue
        metadata = None
        if graph.metadata is not None:
            key = address(<void*>parent)
            all_metadata = metadata_of.get(key)
            if all_metadata is None:
                all_metadata = metadata_of[key] = read_metadata(graph, <object>parent)
            if input_nr < len(all_metadata):
                metadata = all_metadata[input_nr]
        if gradient_matches(metadata, grad):
            continue
        if format_error is None:
            format_error = format_owner_error(owner)
        if not PyList_CheckExact(outputs):
            outputs = list(outputs)
        outputs[i] = (validate_gradient_exact(i, grad, metadata, format_error)
                      if graph.gradient_policy == EXACT
                      else validate_gradient(i, grad, metadata, format_error))
    return outputs


cdef inline bint gradient_matches(object metadata, object grad) noexcept:
    """A gradient that validate_gradient would return as it is: a value of
    a type a backend was found for where there is no metadata, else a numpy
    array whose dtype, shape and device are the slot's."""
    if metadata is None:
        return known_value_type(type(grad))
    return type(metadata) is InputMetadata and numpy_gradient_matches(<InputMetadata>metadata, grad)


cdef int route_gradients(object owner, object outputs, PyObject** items, Py_ssize_t n_items,
                         OwnerTable* owners) except -1:
    """Sum each gradient into its parent's InputBuffer, made on the first
    (check_outputs dropped the gradients of parents not in the table)."""
    cdef PyObject* parent
    cdef Py_ssize_t input_nr
    cdef Py_ssize_t i
    cdef OwnerEntry* entry
    cdef InputBuffer buffer
    for i in range(len(outputs)):
        # The sum below runs Python code, which may reach the list and
        # shorten it.
        if i >= len(outputs):
            raise RuntimeError(GRADIENTS_CHANGED)
        grad = outputs[i]
        if grad is None:
            continue
        if i >= n_items:
            # Past the C items array: the twin's items[i]. check_outputs
            # returns one gradient per item, but code that reached the list
            # (as above) may have lengthened it.
            raise IndexError("tuple index out of range")
        if not split_item(<object>items[i], owner, &parent, &input_nr):
            # A gradient Python code wrote (as above) where no gradient
            # flows: dropped, as check_outputs drops one.
            continue
        # Found again for each gradient: the sum below runs Python code.
        entry = owners.find(parent)
        if entry == NULL:
            raise KeyError(id(<object>parent))  # as the twin's slots[id(parent)]
        if entry.buffer == NULL:
            if entry.slots == 1 and entry.gradient == NULL:
                # Held as it is, as an InputBuffer holds a first gradient:
                # See Note [Owner graphs].
                Py_INCREF(grad)
                entry.gradient = <PyObject*>grad
                continue
            buffer = new_input_buffer(entry.slots)
            Py_INCREF(buffer)
            entry.buffer = <PyObject*>buffer
            if entry.gradient != NULL:
                # The second gradient: the first moves into the new buffer.
                first = <object>entry.gradient
                decref(entry.gradient)
                entry.gradient = NULL
                buffer.add(0, first, False)
        else:
            buffer = <InputBuffer>entry.buffer
        buffer.add(input_nr, grad, False)
    return 0


cdef inline void set_thread_state(ThreadState* thread, ThreadState state) noexcept:
    """``thread[0] = state`` (an owner's running state, or the state from
    before it ran), but for the thread's WorkerState, the thread's for good
    once made: a backward an owner ran may have made it (See Note [The
    worker state's thread-local pointer] in pyengine/_engine.pyx), and the
    pointer holds a reference, which a copy from before would drop."""
    state.worker_state = thread.worker_state
    thread[0] = state


cdef int run_one(OwnerGraph graph, GraphTask graph_task, bint checkpoint_valid, object owner,
                 Py_ssize_t sequence_nr, list grads, OwnerItems* items_of, OwnerTable* owners,
                 dict metadata_of, object accumulate, object exec_info) except -1:
    """Run one owner (``accumulate``: a leaf's gradient) as a node of
    ``graph_task`` runs: its thread state, its profiler event, its anomaly
    note."""
    # Held: an owner's method may unset the profiler.
    cdef object callback = <object>profiler() if profiler() != NULL else None
    cdef object start = _perf_counter_ns() if callback is not None else 0
    cdef ThreadState* thread = thread_state()
    cdef ThreadState previous = thread[0]
    cdef ThreadState running = running_thread_state(graph_task)
    # ANDed with the thread's: See Note [Checkpoint valid in nested backward]
    # in pyengine/_pure/state.py.
    running.checkpoint_valid = checkpoint_valid and previous.checkpoint_valid
    set_thread_state(thread, running)
    try:
        if accumulate is not None:
            accumulate_into_leaf(accumulate, owner, grads[0] if len(grads) == 1 else grads)
        else:
            if <size_t>sequence_nr < items_of.owners():
                evaluate_owner(graph, owner, grads, items_of.of(sequence_nr),
                               items_of.count(sequence_nr), owners, metadata_of, exec_info)
            else:  # writes mode keeps no items
                evaluate_owner(graph, owner, grads, NULL, 0, owners, metadata_of, exec_info)
    except BaseException as error:
        if anomaly_enabled():
            add_owner_note(error, owner)
        raise
    finally:
        try:
            if callback is not None:
                # In the running state, as the engine reports a node.
                callback(OwnerRun(owner, sequence_nr), start, _perf_counter_ns())
        finally:
            # Even where the callback raised: See Note [An owner's thread
            # state comes back] in the twin.
            set_thread_state(thread, previous)
    return 0


# Not tracked by the GC: it holds no Python object. A few freed ones are
# kept: one is made at each accumulation.
@cython.final
@cython.no_gc
@cython.freelist(8)
cdef class LeafLock:
    """An owner leaf's accumulation in flight, its entry in ``leaf_locks``:
    See Note [An owner leaf accumulates under a lock] in the twin."""
    # The leaf's address, set before the entry goes in the list and not
    # changed after: the leaf lives while its accumulation runs, so no other
    # object has that address while the entry is there.
    cdef uintptr_t leaf
    # The twin's GradLock, a GILGuardedLock held here, not behind an object
    # of its own (See Note [A lock the GIL guards] in _gil_guarded_lock.h).
    cdef GILGuardedLock lock_
    # The threads that hold or wait for the lock; guarded by the GIL.
    cdef Py_ssize_t users

    cdef int lock(self, object leaf) except -1:
        """Wait for the lock (letting other threads run, honouring Ctrl-C)
        and take it; RuntimeError where this thread holds it."""
        cdef int result = self.lock_.lock()
        if result > 0:
            raise RuntimeError(leaf_lock_taken_again_message(leaf))
        return result  # -1: a signal handler raised while it waited (its exception is set)


# The LeafLock of each accumulation in flight (a reference each), about one
# a thread, so scanned for the leaf's address; guarded by the GIL: no update
# of it runs Python code. A vector, not the twin's list: its room stays
# from one accumulation to the next, where a list's was freed each time its
# last entry went.
cdef vector[PyObject*] leaf_locks


cdef LeafLock find_leaf_lock(uintptr_t leaf):
    """The entry of ``leaf_locks`` for the leaf at ``leaf``, or None."""
    cdef PyObject* entry
    for entry in leaf_locks:
        if (<LeafLock>entry).leaf == leaf:
            return <LeafLock>entry
    return None


cdef void drop_leaf_lock(LeafLock entry) noexcept:
    """Take ``entry`` out of ``leaf_locks`` (the last entry fills its
    place) and let go of its reference; nothing where it is not there (a
    fork replaced the list since it went in)."""
    cdef size_t i
    for i in range(leaf_locks.size()):
        if leaf_locks[i] == <PyObject*>entry:
            leaf_locks[i] = leaf_locks.back()
            leaf_locks.pop_back()
            Py_DECREF(entry)  # the caller holds another
            return


cdef int accumulate_into_leaf(object accumulate, object leaf, object gradient) except -1:
    """``accumulate(leaf, gradient)`` holding the leaf's lock: See Note [An
    owner leaf accumulates under a lock] in the twin."""
    cdef uintptr_t address = <uintptr_t><PyObject*>leaf
    cdef LeafLock entry = find_leaf_lock(address)
    cdef LeafLock made
    if entry is None:
        # Made, then looked for again: making it may collect, and a __del__
        # run then may accumulate into this leaf and put one in first.
        made = LeafLock.__new__(LeafLock)
        made.leaf = address
        entry = find_leaf_lock(address)
        if entry is None:
            leaf_locks.push_back(<PyObject*>made)
            Py_INCREF(made)
            entry = made
    entry.users += 1
    try:
        entry.lock(leaf)
        try:
            accumulate(leaf, gradient)
        finally:
            entry.lock_.unlock()
    finally:
        entry.users -= 1
        if entry.users == 0:
            drop_leaf_lock(entry)
    return 0


def leaf_locks_in_use():
    """How many owner leaves' locks a thread holds or waits for now (the
    entries of the list): for the tests."""
    return leaf_locks.size()


# The lists of the parents of this process, kept: See Note [An owner leaf
# accumulates under a lock] in the twin.
cdef list leaf_locks_before_fork = []


def _reset_leaf_locks_after_fork():
    cdef PyObject* entry
    # What may fail first, with the vector as it was.
    leaf_locks_before_fork.append([<object>entry for entry in leaf_locks])
    for entry in leaf_locks:
        Py_DECREF(<object>entry)  # the kept list's now
    leaf_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_leaf_locks_after_fork)


cdef inline bint plain_writes(OwnerGraph graph) noexcept:
    """Writes mode with nothing to run around a method: the loop calls the
    methods directly (the same calls run_one makes, less what is off)."""
    return (not graph.returns and graph.pre_hook is None and graph.post_hook is None
            and profiler() == NULL and not anomaly_enabled())


cpdef run_owner_graph(OwnerGraph graph, root, grad, inputs, allow_unused):
    """Backward over the owner graph under ``root``: See Note [Owner graphs].
    Returns the captured gradients with ``inputs``, else None."""
    if graph is None:  # a cpdef function's argument cannot say ``not None``
        raise TypeError("Argument 'graph' has incorrect type (expected "
                        "pyengine._owner_graph.OwnerGraph, got NoneType)")
    cdef bint returns = graph.returns
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
        # A loop, not a list comprehension: See Note [Python allocations
        # that fail] in pyengine/_engine.pyx.
        pairs = []
        for index, item in enumerate(inputs):
            pairs.append(split_root(item, f"inputs[{index}]"))
        inputs = pairs
        wanted = {id(owner) for owner, _ in inputs}

    cdef vector[PyObject*] order
    cdef vector[char] is_leaf
    cdef OwnerItems items_of  # the twin's items_of: See pyengine/_owner_table.h
    # The twin's slots and buffers; releases the buffers an error leaves.
    # Its memory goes back to this thread's kept tables as it is destroyed,
    # on return or error: See Note [Tables kept between backward calls].
    cdef OwnerTable owners
    cdef OwnerEntry* entry
    cdef HeldOwners held = HeldOwners()
    search(graph, root_owner, order, is_leaf, &items_of, &owners, held, returns,
           graph.owners_hint)
    graph.owners_hint = order.size()
    cdef Py_ssize_t i, k
    if returns:
        check_input_nr(root_owner, root_nr, &owners, "the root")
        for i, (owner, input_nr) in enumerate(inputs or ()):
            if owners.find(<PyObject*>owner) != NULL:
                check_input_nr(owner, input_nr, &owners, f"inputs[{i}]")
    if graph.visit is not None:
        for i in range(<Py_ssize_t>order.size()):
            graph.visit(<object>order[i])

    cdef ThreadState* thread = thread_state()
    cdef int depth = (0 if thread.current_graph_task == NULL
                      else (<GraphTask>thread.current_graph_task).reentrant_depth + 1)
    cdef GraphTask graph_task = new_graph_task(False, False, depth, None, False,
                                               thread.multithreading_enabled)
    link_enclosing_graph_task(graph_task, thread)
    # grad(inputs=) prunes, so a reentrant checkpoint is not valid in it.
    cdef bint checkpoint_valid = inputs is None
    cdef dict metadata_of = {}
    cdef list captured = [None] * len(inputs) if inputs is not None else None
    needed = None
    if inputs is not None:
        order_list = []
        is_leaf_list = []
        for i in range(<Py_ssize_t>order.size()):
            order_list.append(<object>order[i])
            is_leaf_list.append(<bint>is_leaf[i])
        # A loop, not a list comprehension: See Note [Python allocations
        # that fail] in pyengine/_engine.pyx.
        items_list = []
        for i in range(<Py_ssize_t>order.size()):
            items_list.append(tuple([<object>items_of.of(i)[k] for k in range(items_of.count(i))]))
        needed = mark_needed(order_list, is_leaf_list, items_list, wanted)
    # The owners that run or capture under grad(inputs=), for should_compute_output.
    exec_info = needed | wanted if needed is not None and graph.should_compute_output else None
    cdef InputBuffer buffer
    if returns:
        metadata = None
        if graph.metadata is not None:
            all_metadata = metadata_of[id(root_owner)] = read_metadata(graph, root_owner)
            if root_nr < len(all_metadata):
                metadata = all_metadata[root_nr]
        grad = (validate_gradient_exact(0, grad, metadata, format_root_error)
                if graph.gradient_policy == EXACT
                else validate_gradient(0, grad, metadata, format_root_error))
        entry = owners.find(<PyObject*>root_owner)
        buffer = new_input_buffer(entry.slots)
        Py_INCREF(buffer)
        entry.buffer = <PyObject*>buffer
        buffer.add(root_nr, grad, False)
    accumulate = graph.accumulate if graph.accumulate is not None else accumulate_grad
    cdef ThreadState previous, running
    cdef object backward = graph.backward_
    # The twin puts the thread's state back here too where the walk raises,
    # for an interrupt between its steps; here each owner's comes back whole
    # (See Note [An owner's thread state comes back] in the twin).
    i = <Py_ssize_t>order.size() - 1
    if plain_writes(graph) and type(backward) is str:
        # run_one without what is off: no object per owner. See Note [Owner graphs].
        previous = thread[0]
        running = running_thread_state(graph_task)
        while i >= 0:
            if not is_leaf[i]:
                set_thread_state(thread, running)
                try:
                    PyObject_CallMethodNoArgs(<object>order[i], backward)
                finally:
                    set_thread_state(thread, previous)
            i -= 1
    while i >= 0:
        owner = <object>order[i]
        if not returns:
            if not is_leaf[i]:
                run_one(graph, graph_task, True, owner, i, None, &items_of, &owners, None, None,
                        None)
            i -= 1
            continue
        # The twin's buffers.pop(id(owner), None): the reference moves out.
        entry = owners.find(order[i])
        if entry == NULL or (entry.buffer == NULL and entry.gradient == NULL):
            i -= 1
            continue
        if entry.gradient != NULL:
            grads = [<object>entry.gradient]
            decref(entry.gradient)
            entry.gradient = NULL
        else:
            buffer = <InputBuffer>entry.buffer
            decref(entry.buffer)
            entry.buffer = NULL
            grads = buffer.buffer
        key = address(order[i]) if wanted is not None or needed is not None else None
        if wanted is not None and key in wanted:
            for k, (input_owner, input_nr) in enumerate(inputs):
                if input_owner is owner and input_nr < len(grads):
                    captured[k] = grads[input_nr]
        if is_leaf[i]:
            if inputs is None:
                run_one(graph, graph_task, True, owner, i, grads, &items_of, &owners, None,
                        accumulate, None)
        elif needed is None or key in needed:
            run_one(graph, graph_task, checkpoint_valid, owner, i, grads, &items_of, &owners,
                    metadata_of, None, exec_info)
        i -= 1
    graph_task.mark_as_completed_and_run_post_processing()
    if graph_task.exception_ is not None:
        # A final callback's error; taken off the task, as execute does.
        error = graph_task.exception_
        graph_task.exception_ = None
        if not isinstance(error, BaseException):
            raise_error(error)
        raise error
    if captured is None:
        return None
    if not allow_unused:
        for k in range(len(captured)):
            if captured[k] is None:
                raise RuntimeError(f"inputs[{k}] (a {owner_name(inputs[k][0])}) was not reached "
                                   "by any gradient. Set allow_unused=True if this is the "
                                   "desired behavior.")
    return captured
