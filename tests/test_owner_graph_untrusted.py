"""What Python code can do to an owner graph's walk, and what the walk
reads of the values it is given: never a crash, and the same answer in
both cores. See Notes [The walk's owners stay alive] in
``pyengine/_pure/owner_graph.py`` and [An owner graph reads an int's
value] in ``pyengine/_shared/owner_graph_checks.py``.

Oracles: exact gradients and run counts; PyTorch's thread-local state
around a node (ThreadLocalStateGuard, CheckpointValidGuard) for what an
owner runs under; the errors' words, which name the value as the compiled
walk reads it in C. The suite runs once per core, so each test holds for
both.
"""

from __future__ import annotations

import enum
import gc
import textwrap

import numpy as np
import pytest
from conftest import registered_backend, run_on_this_core
from test_owner_leaf_locks import Value, passes_on

import pyengine
from pyengine import CPU, Edge, Node

# -- the owners the walk holds ----------------------------------------------------------------

EMPTIES_THE_WALKS_LISTS = """
import gc
import pyengine

runs = []

def empty_lists_that_start_with(owner):
    # Python code that finds, through the collector, a list the walk may
    # keep its owners in (it starts with the root), and empties it.
    for referrer in gc.get_referrers(owner):
        if type(referrer) is list and referrer and referrer[0] is owner:
            referrer.clear()

class Owner:
    def __init__(self, parents=()):
        self._prev = list(parents)

    def _backward(self):
        runs.append(id(self))  # not the owner: a list of owners would be emptied below
        if self is root and WHERE == "backward":
            empty_lists_that_start_with(self)
            self._prev = []  # the last reference to the children but the walk's
            junk = [str(i) * 10 for i in range(10000)]  # memory the children had

def visit(owner):
    if owner is root:
        empty_lists_that_start_with(owner)
        owner._prev = []
        junk = [str(i) * 10 for i in range(10000)]

root = Owner([Owner([Owner()]) for _ in range(100)])
pyengine.OwnerGraph("_prev", "_backward",
                    visit=visit if WHERE == "visit" else None).backward(root)
print(len(runs), len(set(runs)))
"""


@pytest.mark.parametrize("where", ["backward", "visit"])
def test_python_code_that_empties_the_walks_lists_cannot_free_its_owners(where):
    # The compiled walk kept its owners alive in a list only, under borrowed
    # pointers: emptying it from the root's backward (or from visit) freed
    # the 100 children before they ran, and the walk called their method on
    # freed memory (a segfault).
    lines = run_on_this_core(f"WHERE = {where!r}\n" + textwrap.dedent(EMPTIES_THE_WALKS_LISTS),
                             timeout=60)
    assert lines == ["101 101"]  # the root and its 100 children ran, each once


class Val:
    """A value of a backend of this file's: a float that sums as one."""

    def __init__(self, v):
        self.v = v


INJECTED = Val(100.0)


class ValBackend(pyengine.ArrayBackend):
    """Its ``add`` (or ``shape``) reaches, through the collector, the list of
    gradients the walk is reading, and writes one where no gradient flows."""

    name = "val"
    inject_in = "add"

    def inject(self, value, length, index):
        for referrer in gc.get_referrers(value):
            if type(referrer) is list and len(referrer) == length and referrer[index] is None:
                referrer[index] = INJECTED

    def shape(self, value):
        if self.inject_in == "shape":
            self.inject(value, 2, 0)
        return ()

    def dtype(self, value):
        return np.dtype(np.float64)

    def device(self, value):
        return CPU

    def dtype_kind(self, dtype):
        return "f"

    def has_nan(self, value):
        return False

    def add(self, a, b):
        if self.inject_in == "add":
            self.inject(a, 3, 2)
        return Val(a.v + b.v)

    def cast(self, value, dtype):
        return value

    def to_device(self, value, device):
        return value


@pytest.fixture
def val_backend():
    with registered_backend(Val, ValBackend()) as backend:
        yield backend


def test_a_gradient_python_code_writes_where_no_gradient_flows_is_dropped(val_backend):
    # The third item names no parent. The sum into x's buffer (the second
    # gradient) writes one there: the compiled walk sent it to the parent of
    # the item before, x; the twin failed to unpack None.
    val_backend.inject_in = "add"
    x = Value()
    root = Value(x, x, None)
    graph = pyengine.OwnerGraph("parents", lambda owner, grads: [Val(1.0), Val(2.0), None],
                                mode="returns")
    graph.backward(root, Val(1.0))
    assert x.grad.v == 3.0


def test_a_gradient_written_first_where_no_gradient_flows_is_dropped(val_backend):
    # The same at the first item, written as the metadata check reads the
    # second gradient's shape: the compiled walk read a parent it had never
    # set (an id of garbage in a KeyError, a reference to it taken).
    val_backend.inject_in = "shape"
    x = Value()
    root = Value(None, x)
    graph = pyengine.OwnerGraph("parents", lambda owner, grads: [None, Val(2.0)], mode="returns",
                                metadata=lambda owner: [((), np.float64)])
    graph.backward(root, np.ones(()))
    assert x.grad.v == 2.0


# -- the thread's state while an owner runs ------------------------------------------------------


class _Sink(Node):
    def apply(self, grads):
        return []


def _in_a_pruning_backward(run):
    """Call ``run()`` from a node of a backward that prunes (outputs=, as
    grad(inputs=) does), where a reentrant checkpoint is not valid."""

    class Outer(Node):
        def apply(self, grads):
            run()
            return [grads[0]]

    sink = _Sink([], [((1,), np.float64)])
    outer = Outer([Edge(sink, 0)], [((1,), np.float64)])
    pyengine.get_default_engine().execute([Edge(outer, 0)], [np.ones(1)], False, False, False,
                                          [Edge(sink, 0)])


def _walks(seen):
    """A writes walk with and without a pre_hook (the walk's plain loop and
    run_one), and a returns walk, each noting is_checkpoint_valid()."""

    class Owner(Value):
        def back(self):
            seen.append(pyengine.is_checkpoint_valid())

    def note(owner, grads):
        seen.append(pyengine.is_checkpoint_valid())
        return passes_on(owner, grads)

    def run():
        pyengine.OwnerGraph("parents", "back").backward(Owner(Owner()))
        pyengine.OwnerGraph("parents", "back", pre_hook=lambda owner, grads: None).backward(
            Owner(Owner()))
        pyengine.OwnerGraph("parents", note, mode="returns").backward(Owner(Owner()), np.ones(1))

    return run


def test_a_checkpoint_is_not_valid_in_an_owner_below_a_pruning_backward():
    # Note [Checkpoint valid in nested backward]: ANDed with the enclosing
    # value. The twin's plain writes loop set True, and both cores' run_one
    # set their own value without the AND.
    seen = []
    _in_a_pruning_backward(_walks(seen))
    assert seen == [False, False, False]


def test_a_checkpoint_is_valid_in_an_owner_outside_any_pruning_backward():
    seen = []
    _walks(seen)()
    assert seen == [True, True, True]
    assert pyengine.is_checkpoint_valid()


@pytest.mark.parametrize("mode", ["writes", "returns", "node"])
def test_a_mode_an_owner_or_node_sets_for_good_comes_back_after_it(mode):
    # PyTorch's ThreadLocalStateGuard puts back the whole thread-local state
    # after a node, multithreading mode included. The compiled core did (it
    # copies the state whole); the twin put back grad mode, the current graph
    # task and the checkpoint flag only.
    seen = []

    def sets_it():
        pyengine.set_multithreading_enabled(False)  # for good: not as a context
        seen.append(pyengine.is_multithreading_enabled())

    class Owner(Value):
        def back(self):
            sets_it()

    def backward(owner, grads):
        sets_it()
        return passes_on(owner, grads)

    class SetsIt(Node):
        def apply(self, grads):
            sets_it()
            return [grads[0]]

    assert pyengine.is_multithreading_enabled()
    try:
        if mode == "writes":
            pyengine.OwnerGraph("parents", "back").backward(Owner(Owner(Owner())))
        elif mode == "returns":
            pyengine.OwnerGraph("parents", backward, mode="returns").backward(
                Owner(Owner(Owner())), np.ones(1))
        else:
            node = SetsIt([Edge(SetsIt([Edge(_Sink([], [((1,), np.float64)]), 0)],
                                       [((1,), np.float64)]), 0)], [((1,), np.float64)])
            pyengine.get_default_engine().execute([Edge(node, 0)], [np.ones(1)], False, False,
                                                  True)
        assert seen == [False, False]
        assert pyengine.is_multithreading_enabled()
    finally:
        pyengine.set_multithreading_enabled(True)


# -- names and numbers the walk reads ------------------------------------------------------------


class Names(str, enum.Enum):
    """Attribute names as a framework may keep them: str members of an enum
    (``enum.StrEnum`` from Python 3.11 on is the same)."""

    PREV = "_prev"
    BACKWARD = "_backward"


class Micro:
    """micrograd's Value, as far as the walk reads it."""

    def __init__(self, *prev):
        self._prev = set(prev)
        self.grad = 0.0

    def _backward(self):
        for parent in self._prev:
            parent.grad += 1.0


def test_names_given_as_str_subclasses_read_as_the_names_they_hold():
    # The check took any str, the walks only an exact one: the enum member
    # was called as if it were a function, and execute_owner_graph kept the
    # broken graph for the plain names too (the member equals its value).
    graph = pyengine.OwnerGraph(Names.PREV, Names.BACKWARD)
    assert type(graph.parents) is str and graph.parents == "_prev"
    assert type(graph.backward_) is str and graph.backward_ == "_backward"
    for children, method in [(Names.PREV, Names.BACKWARD), ("_prev", "_backward")]:
        x = Micro()
        pyengine.execute_owner_graph(Micro(x), children, method)
        assert x.grad == 1.0


class LyingCount(int):
    """An int whose order comparisons lie: never below, never above."""

    def __lt__(self, other):
        return False

    def __gt__(self, other):
        return False


@pytest.mark.parametrize("count, error, message", [
    (-3, TypeError, "num_inputs(Value) must be an int of at least 1, got -3"),
    (2**31, ValueError, "num_inputs(Value) is 2147483648; at most 65536 slots are allowed"),
])
def test_a_slot_count_is_checked_by_its_value(count, error, message):
    # The compiled walk raised SystemError for -3 and OverflowError for 2**31
    # (it reads the value in C); the twin took the comparisons' word: an
    # InputBuffer size error for -3, and a walk with 2**31 slots accepted.
    x = Value()
    middle = Value(x)
    graph = pyengine.OwnerGraph(
        "parents", passes_on, mode="returns",
        num_inputs=lambda owner: LyingCount(count) if owner is middle else 1)
    with pytest.raises(error) as raised:
        graph.backward(Value(middle), np.ones(1))
    assert str(raised.value) == message
    assert x.grad is None


class LyingSlot(int):
    """An int that says it is at least anything and below anything."""

    def __ge__(self, other):
        return True

    def __lt__(self, other):
        return True


@pytest.mark.parametrize("slot, message", [
    (7, "a parent item of a Value names slot 7 of a Value, which has 2 slots"),
    (-1, "a parent item of a Value names slot -1: a slot is at least 0 and below 65536"),
    (2**70, f"a parent item of a Value names slot {2**70}: a slot is at least 0 and below 65536"),
])
def test_a_slot_number_is_checked_by_its_value(slot, message):
    # The compiled walk named 2**70 as slot -1; the twin's range check took
    # the comparisons' word and the InputBuffer refused the slot as negative.
    x = Value()
    graph = pyengine.OwnerGraph("parents", passes_on, mode="returns",
                                num_inputs=lambda owner: 2)
    with pytest.raises(IndexError) as raised:
        graph.backward(Value((x, LyingSlot(slot))), np.ones(1))
    assert str(raised.value) == message
    assert x.grad is None


def test_a_slot_number_subclass_in_range_is_its_value():
    y = Value()
    graph = pyengine.OwnerGraph("parents", lambda owner, grads: [grads[0] * 2.0],
                                mode="returns", num_inputs=lambda owner: 2)
    captured = graph.grad(Value((y, LyingSlot(1))), np.ones(1), [(y, 1)])
    assert captured[0].tolist() == [2.0]


@pytest.mark.parametrize("call, error, message", [
    (lambda graph, x, y: graph.backward((y, 0, 0), np.ones(1)), TypeError,
     "the root is a tuple of 3: expected an owner or a pair (owner, input_nr) with an int "
     "input_nr"),
    (lambda graph, x, y: graph.backward((y, "a"), np.ones(1)), TypeError,
     "the root is a tuple of 2: expected an owner or a pair (owner, input_nr) with an int "
     "input_nr"),
    (lambda graph, x, y: graph.backward((None, 0), np.ones(1)), TypeError,
     "the root must be an owner or a pair (owner, input_nr), got a pair whose owner is None"),
    (lambda graph, x, y: graph.grad(y, np.ones(1), [x, (x, -1)]), IndexError,
     "inputs[1] names slot -1: a slot is at least 0 and below 65536"),
    (lambda graph, x, y: graph.grad(y, np.ones(1), [(x, 0, 1)]), TypeError,
     "inputs[0] is a tuple of 3: expected an owner or a pair (owner, input_nr) with an int "
     "input_nr"),
])
def test_a_bad_root_or_input_is_named_as_itself(call, error, message):
    # They were named "a parent item of a NoneType" and "the root".
    x = Value()
    y = Value(x)
    with pytest.raises(error) as raised:
        call(pyengine.OwnerGraph("parents", passes_on, mode="returns"), x, y)
    assert str(raised.value) == message
    assert x.grad is None


class SaysReduce(str):
    """A str that holds "exact" and prints as "reduce"."""

    def __str__(self):
        return "reduce"


def test_the_gradient_policy_kept_is_the_one_checked():
    # The check compared the str's value and the graph kept str() of it:
    # checked as "exact", kept as "reduce", and a broadcast gradient reduced.
    x = Value()
    graph = pyengine.OwnerGraph(
        "parents", lambda owner, grads: [np.ones((3, 2))], mode="returns",
        gradient_policy=SaysReduce("exact"),
        metadata=lambda owner: [((2,), np.float64)] if owner is x else [((1,), np.float64)])
    assert type(graph.gradient_policy) is str and graph.gradient_policy == "exact"
    with pytest.raises(RuntimeError, match=r"expected shape \(2,\) \(gradient_policy='exact'"):
        graph.backward(Value(x), np.ones(1))
    assert x.grad is None


def test_a_flag_of_another_modules_bool_type_is_named_with_its_module():
    # "accumulates must be a bool, got bool": numpy 2 names np.True_'s type bool.
    with pytest.raises(TypeError, match=r"^accumulates must be a bool, got numpy\.bool_?$"):
        pyengine.OwnerGraph("parents", passes_on, mode="returns", accumulates=np.True_)


@pytest.mark.parametrize("root, method, error, message", [
    (None, "_backward", TypeError,
     "the root must be an owner or a pair (owner, input_nr), got None"),
    ((None, 0), "_backward", TypeError,
     "the root must be an owner or a pair (owner, input_nr), got a pair whose owner is None"),
    ("micro", lambda owner: None, TypeError,
     "method must be a str (a method name) to translate an owner graph into nodes, got function"),
])
def test_translating_a_bad_root_or_method_is_refused_before_the_search(root, method, error,
                                                                       message):
    # An AttributeError on NoneType or tuple, or the whole search and then
    # the first node's refusal.
    read = []

    class Counted(Micro):
        @property
        def _prev(self):
            read.append(self)
            return self.__dict__["_prev"]

        @_prev.setter
        def _prev(self, value):
            self.__dict__["_prev"] = value

    if root == "micro":
        root = Counted(Counted())
    with pytest.raises(error) as raised:
        pyengine.translate_owner_graph(root, "_prev", method)
    assert str(raised.value) == message
    assert read == []


def test_translating_a_pair_root_translates_its_owner():
    x = Micro()
    y = Micro(x)
    root = Micro(y)
    edge = pyengine.translate_owner_graph((root, 0), "_prev", "_backward")
    assert edge.node.owner is root
    assert [e.node.owner for e in edge.node.next_edges] == [y]


@pytest.mark.parametrize("make_graph, message", [
    (lambda: pyengine.OwnerGraph(lambda owner: 3 if owner.parents else None, "back"),
     "parents(Value) must be iterable, got int"),
    (lambda: pyengine.OwnerGraph("count", "back"), "the 'count' of a Value must be iterable, got int"),
    (lambda: pyengine.OwnerGraph("parents", passes_on, mode="returns",
                                 metadata=lambda owner: None),
     "metadata(Value) must be iterable, got NoneType"),
])
def test_a_collection_that_is_not_iterable_is_named(make_graph, message):
    # Python's own words named only the type: "'int' object is not iterable".
    x = Value()
    root = Value(x)
    root.count = 3
    x.count = None
    with pytest.raises(TypeError) as raised:
        graph = make_graph()
        if graph.returns:
            graph.backward(root, np.ones(1))
        else:
            graph.backward(root)
    assert str(raised.value) == message
    assert x.grad is None


def test_grad_inputs_that_are_not_iterable_are_named():
    x = Value()
    graph = pyengine.OwnerGraph("parents", passes_on, mode="returns")
    with pytest.raises(TypeError) as raised:
        graph.grad(Value(x), np.ones(1), x)
    assert str(raised.value) == "inputs must be iterable, got Value"
    # A generator is an iterable: read once.
    assert graph.grad(Value(x), np.ones(1), (owner for owner in [x]))[0].tolist() == [1.0]


class ForgetsToReturn(ValBackend):
    """A backend whose add returns None: an add written without its return."""

    inject_in = None

    def add(self, a, b):
        a.v += b.v


def test_a_backend_add_that_returns_none_leaves_an_owner_leafs_grad_as_it_was():
    # The default accumulate stored what the backend's add returned: the
    # leaf's .grad became None, and every gradient summed into it was lost.
    with registered_backend(Val, ForgetsToReturn()):
        x = Value()
        graph = pyengine.OwnerGraph("parents", lambda owner, grads: [Val(2.0)], mode="returns")
        graph.backward(Value(x), Val(1.0))
        first = x.grad
        assert first.v == 2.0
        with pytest.raises(TypeError) as raised:
            graph.backward(Value(x), Val(1.0))
        assert str(raised.value) == (
            "the .grad of a Value: add() of the backend 'val' (ForgetsToReturn) returned None: "
            "expected a value of a registered backend")
        assert x.grad is first


def test_a_collection_whose_own_iter_raises_keeps_its_words():
    class Refuses:
        def __iter__(self):
            raise TypeError("not now")

    x = Value()
    root = Value()
    root.parents = Refuses()
    with pytest.raises(TypeError, match="^not now$"):
        pyengine.OwnerGraph("parents", passes_on, mode="returns").backward(root, np.ones(1))
    assert x.grad is None
