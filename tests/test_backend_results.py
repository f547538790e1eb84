"""What a registered backend returns, the engine checks before it keeps it.

A framework's backend is Python code: an ``add_`` written without ``return
a`` returns None, and a method may return a value no registered backend
handles. Stored as they were, they made ``.grad`` None (every gradient
summed into it lost) or handed a node None from its InputBuffer, without a
word. Each test runs on the core under test (the suite runs once per core);
the oracles are analytic: the error's words (the holder, the backend's name
and class, the method, what it returned), and that ``.grad`` or the buffer
holds what it held before the failed sum. See Note [What a backend returns]
in pyengine/backends.py.
"""

from __future__ import annotations

import importlib
import re

import numpy as np
import pytest
from plain_tensors import Leaf

import pyengine
from pyengine import Edge, InputMetadata
from pyengine.backends import NUMPY


class Value:
    """A framework's tensor type: a numpy array, on ``device``."""

    def __init__(self, a, device=pyengine.CPU):
        self.a = np.array(a)
        self.device = device


class Backend(pyengine.ArrayBackend):
    """A correct backend for Value, but for ``broken``: that method returns
    ``returns`` (after doing its work, as an ``add_`` without ``return a``
    does)."""

    name = "values"

    def __init__(self, broken=None, returns=None):
        self.broken = broken
        self.returns = returns

    def _result(self, method, value):
        return self.returns if method == self.broken else value

    def shape(self, value):
        return value.a.shape

    def dtype(self, value):
        return value.a.dtype

    def device(self, value):
        return value.device

    def dtype_kind(self, dtype):
        return np.dtype(dtype).kind

    def add(self, a, b):
        return self._result("add", Value(a.a + b.a, a.device))

    def add_(self, a, b):
        a.a += b.a
        return self._result("add_", a)

    def sum_to(self, value, shape):
        return self._result("sum_to", Value(NUMPY.sum_to(value.a, shape), value.device))

    def cast(self, value, dtype):
        return self._result("cast", Value(value.a.astype(dtype), value.device))

    def copy(self, value):
        return self._result("copy", Value(value.a.copy(), value.device))

    def to_device(self, value, device):
        return self._result("to_device", Value(value.a.copy(), device))


# What a broken method returns, and how the error names it.
RETURNS = [(None, "None"), ([1.0], "a list, which no registered backend handles")]


@pytest.fixture
def register():
    """``register(backend)``: make ``backend`` handle Value for this test."""
    previous = []

    def register_(backend):
        previous.append(pyengine.register_backend(Value, backend))
        return backend

    yield register_
    pyengine.unregister_backend(Value)
    assert previous == [None] * len(previous)


def _message(holder, method, what):
    return re.escape(f"{holder}: {method}() of the backend 'values' (Backend) returned {what}: "
                     "expected a value of a registered backend")


class Emit(pyengine.Node):
    """Sends ``make()`` along each of its next edges."""

    def __init__(self, edges, make):
        super().__init__(next_edges=edges, input_metadata=[InputMetadata((), np.float64)])
        self.make = make

    def apply(self, grads):
        return [self.make() for _ in self._next_edges]


class Sink(pyengine.Node):
    def __init__(self, metadata, got):
        super().__init__(next_edges=(), input_metadata=[metadata])
        self.got = got

    def apply(self, grads):
        self.got.append(grads[0])
        return []


def _backward(edges, make):
    pyengine.backward(Edge(Emit(edges, make), 0), np.ones(()))


@pytest.mark.parametrize("returns, what", RETURNS)
def test_an_add_into_grad_in_place_that_returns_no_value_keeps_grad(register, returns, what):
    # The audit's reproducer: a second backward adds into the .grad the
    # first one stored, in place; an add_ without "return a" made .grad None.
    register(Backend("add_", returns))
    x = Leaf(Value(np.zeros(3)))
    edge = pyengine.gradient_edge(x)
    _backward([edge], lambda: Value(np.ones(3)))
    first = x.grad
    assert type(first) is Value and first.a.tolist() == [1.0] * 3
    with pytest.raises(TypeError, match=_message("the variable's .grad", "add_", what)
                       + re.escape(" (an add_ must return the sum")):
        _backward([edge], lambda: Value(np.ones(3)))
    assert x.grad is first


@pytest.mark.parametrize("returns, what", RETURNS)
def test_an_add_into_an_assigned_grad_that_returns_no_value_keeps_grad(register, returns, what):
    # A .grad the user assigned is summed out of place, with add.
    register(Backend("add", returns))
    x = Leaf(Value(np.zeros(3)))
    assigned = x.grad = Value(np.full(3, 5.0))
    with pytest.raises(TypeError, match=_message("the variable's .grad", "add", what)):
        _backward([pyengine.gradient_edge(x)], lambda: Value(np.ones(3)))
    assert x.grad is assigned and assigned.a.tolist() == [5.0] * 3


@pytest.mark.parametrize("returns, what", RETURNS)
def test_a_copy_into_grad_that_returns_no_value_leaves_grad_none(register, returns, what):
    # The first gradient of a leaf is copied (it is not a numpy array the
    # engine may steal).
    register(Backend("copy", returns))
    x = Leaf(Value(np.zeros(3)))
    with pytest.raises(TypeError, match=_message("the variable's .grad", "copy", what)):
        _backward([pyengine.gradient_edge(x)], lambda: Value(np.ones(3)))
    assert x.grad is None


@pytest.mark.parametrize("method, fan_in", [("add", 2), ("add_", 3)])
@pytest.mark.parametrize("returns, what", RETURNS)
def test_a_sum_in_an_input_buffer_that_returns_no_value_reaches_no_node(
        register, method, fan_in, returns, what):
    # Two gradients into one slot: add; a third: add_ into the buffer's own
    # sum. The node received None from its InputBuffer before.
    register(Backend(method, returns))
    got = []
    sink = Sink(InputMetadata((3,), np.float64), got)
    with pytest.raises(TypeError, match=_message("InputBuffer slot 0", method, what)):
        _backward([Edge(sink, 0)] * fan_in, lambda: Value(np.ones(3)))
    assert got == []


@pytest.mark.parametrize("returns, what", RETURNS)
def test_an_input_buffer_keeps_its_sum_when_add__returns_no_value(register, returns, what):
    # The InputBuffer itself: the slot holds the sum made before the failed
    # one (the value add returned), not what add_ returned.
    register(Backend("add_", returns))
    buffer = pyengine._core.InputBuffer(1)
    buffer.add(0, Value(np.ones(3)), False)
    buffer.add(0, Value(np.full(3, 2.0)), False)
    total = buffer.buffer[0]
    assert type(total) is Value and total.a.tolist() == [3.0] * 3
    with pytest.raises(TypeError, match=_message("InputBuffer slot 0", "add_", what)):
        buffer.add(0, Value(np.full(3, 4.0)), False)
    assert buffer.buffer == [total]


@pytest.mark.parametrize("method, metadata, make, expected", [
    # float32 slot, float64 gradient: cast.
    ("cast", InputMetadata((3,), np.float32), lambda: Value(np.ones(3)), [1.0] * 3),
    # a (2, 3) gradient for a (3,) slot: sum_to.
    ("sum_to", InputMetadata((3,), np.float64), lambda: Value(np.ones((2, 3))), [2.0] * 3),
    # a 0-d gradient on another device than its slot's: to_device.
    ("to_device", InputMetadata((), np.float64),
     lambda: Value(np.ones(()), pyengine.Device("fake", 0)), 1.0),
])
@pytest.mark.parametrize("returns, what", RETURNS)
def test_validate_outputs_names_a_backend_whose_result_is_no_value(
        register, method, metadata, make, expected, returns, what):
    backend = register(Backend(method, returns))
    got = []
    sink = Sink(metadata, got)
    words = (f"Function Emit returned an invalid gradient at index 0 - {method}() of the backend "
             f"'values' (Backend) returned {what}: expected a value of a registered backend")
    with pytest.raises(TypeError, match=re.escape(words)):
        _backward([Edge(sink, 0)], make)
    assert got == []
    # Mended, the backend's result passes on: the analytic gradient, as the
    # slot's metadata asks.
    backend.broken = None
    _backward([Edge(sink, 0)], make)
    (grad,) = got
    assert type(grad) is Value and grad.a.tolist() == expected
    assert grad.a.dtype == metadata.dtype and grad.device == pyengine.CPU


def test_a_backend_whose_name_raises_is_named_by_its_class(register):
    class Unnamed(Backend):
        @property
        def name(self):
            raise LookupError("no name")

    register(Unnamed("add", None))
    sink = Sink(InputMetadata((3,), np.float64), [])
    with pytest.raises(TypeError, match=re.escape(
            "InputBuffer slot 0: add() of the backend (its name raised LookupError) (Unnamed) "
            "returned None")):
        _backward([Edge(sink, 0)] * 2, lambda: Value(np.ones(3)))


class Tensor:
    """A non-leaf tensor: its gradient comes through ``grad_fn``."""

    def __init__(self, grad_fn):
        self.grad_fn = grad_fn
        self.output_nr = 0
        self.requires_grad = True
        self.grad = None


class Pass(pyengine.Node):
    def __init__(self, edges):
        super().__init__(next_edges=edges, input_metadata=[InputMetadata((3,), np.float64)])

    def apply(self, grads):
        return list(grads)


@pytest.mark.parametrize("method", ["copy", "add"])
@pytest.mark.parametrize("returns, what", RETURNS)
def test_retain_grad_keeps_grad_when_the_backend_returns_no_value(register, method, returns, what):
    # retain_grad's hook copies the first gradient and adds the next ones.
    backend = register(Backend())
    leaf = Leaf(Value(np.zeros(3)))
    tensor = Tensor(Pass([pyengine.gradient_edge(leaf)]))
    pyengine.retain_grad(tensor)
    if method == "add":
        pyengine.backward(Edge(tensor.grad_fn, 0), Value(np.ones(3)))
    before = tensor.grad
    backend.broken, backend.returns = method, returns
    with pytest.raises(TypeError, match=_message("the tensor's .grad", method, what)):
        pyengine.backward(Edge(tensor.grad_fn, 0), Value(np.ones(3)))
    assert tensor.grad is before
    if method == "add":
        assert type(before) is Value and before.a.tolist() == [1.0] * 3


def test_a_backend_unregistered_before_accumulate_grad_copies_is_named(register):
    # A pre-hook of the leaf's AccumulateGrad (an adapter's teardown, say)
    # unregisters the backend after validate_outputs found it: the copy
    # into .grad found no backend, and called .copy on None.
    register(Backend())
    x = Leaf(Value(np.zeros(3)))
    edge = pyengine.gradient_edge(x)
    edge.node.register_prehook(lambda grads: pyengine.unregister_backend(Value) and None)
    with pytest.raises(TypeError, match=re.escape(
            "the gradient for the variable's .grad is a Value, which no registered backend "
            "copies: expected a value of a registered backend (see pyengine.register_backend)")):
        _backward([edge], lambda: Value(np.ones(3)))
    assert x.grad is None


def test_a_backend_unregistered_before_retain_grad_copies_is_named(register):
    # The same for retain_grad's copy: a tensor hook, which runs before it,
    # unregisters the backend.
    register(Backend())
    tensor = Tensor(Pass([]))
    pyengine.retain_grad(tensor)
    pyengine.register_tensor_hook(tensor, lambda grad: pyengine.unregister_backend(Value) and None)
    with pytest.raises(TypeError, match=re.escape(
            "the gradient for the tensor's .grad is a Value, which no registered backend copies")):
        pyengine.backward(Edge(tensor.grad_fn, 0), Value(np.ones(3)))
    assert tensor.grad is None


def _core(name):
    """The node and engine modules of one core, side by side in this process
    (as tests/test_cross_core.py loads them); skips where the compiled core
    is not built."""
    prefix = "pyengine._" if name == "compiled" else "pyengine._pure."
    try:
        return (importlib.import_module(prefix + "node"),
                importlib.import_module(prefix + "engine"))
    except ImportError as error:
        pytest.skip(f"the {name} core cannot be imported here: {error}")


def test_a_root_gradient_of_a_framework_type_asks_its_backend_alike_in_both_cores(register):
    # A root gradient that is not a numpy array takes accumulate_on_streams:
    # the twin adds it at once where neither side has a stream, the compiled
    # core asked accumulation_stream, and so the backend's device(), once
    # more (a device() that fails on a later call failed on one core only).
    # Oracles: the twin's calls, and the sink receiving the root gradient
    # itself.
    calls = []

    class Counting(Backend):
        pass

    for method in ("shape", "dtype", "device", "dtype_kind", "add", "add_", "sum_to", "cast",
                   "copy", "to_device"):
        def counted(self, *args, _method=method):
            calls.append(_method)
            return getattr(Backend, _method)(self, *args)
        setattr(Counting, method, counted)

    register(Counting())
    counts = {}
    for name in ("pure", "compiled"):
        node_module, engine_module = _core(name)
        got = []

        class Sink(node_module.NodeBase):
            def apply(self, grads):
                self.got.append(grads[0])
                return []

        sink = Sink(next_edges=(), input_metadata=[((3,), np.float64)])
        sink.got = got
        root = Value(np.full(3, 2.0))
        del calls[:]
        engine_module.Engine().execute([node_module.Edge(sink, 0)], [root], False, False, True,
                                       None)
        assert got == [root]
        counts[name] = list(calls)
    assert counts["compiled"] == counts["pure"], counts


@pytest.mark.parametrize("shape, what", [(None, "None"), (3, "3 of type int"),
                                         ("3", "'3' of type str")])
@pytest.mark.parametrize("policy", ["reduce", "exact"])
def test_a_backend_whose_shape_is_no_sequence_is_named(register, shape, what, policy):
    # tuple(backend.shape(grad)) said "'NoneType' object is not iterable" or
    # "'int' object is not iterable", naming neither backend nor node, and
    # took "3" as ("3",), which then "got ('3',)" against (3,).
    class Shapeless(Backend):
        def shape(self, value):
            return shape

    register(Shapeless())

    class Emits(Emit):
        gradient_policy = policy

    got = []
    sink = Sink(InputMetadata((3,), np.float64), got)
    words = ("Function Emits returned an invalid gradient at index 0 - shape() of the backend "
             f"'values' (Shapeless) returned {what}: expected a tuple of ints")
    with pytest.raises(TypeError, match=re.escape(words)):
        pyengine.backward(Edge(Emits([Edge(sink, 0)], lambda: Value(np.ones(3))), 0), np.ones(()))
    assert got == []
