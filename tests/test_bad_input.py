"""Bad input, table-driven: every malformed gradient and API misuse gets a
clear error that names what was wrong (node, index, expected against got),
and the engine works afterwards (the autouse fixture in conftest.py runs a
backward after each test and checks its result).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import pyengine
from pyengine import fake_device as fd


class Leaf:
    def __init__(self, data, requires_grad=True):
        self.data = np.asarray(data, dtype=np.float64)
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = requires_grad


class Returns(pyengine.Node):
    """A node over leaf ``x`` whose apply returns ``make()``."""

    def __init__(self, x, make):
        super().__init__([pyengine.gradient_edge(x)], [x.data])
        self.make = make

    def apply(self, grads):
        return self.make()


class Forgetful(pyengine.Node):
    def __init__(self):
        pass  # never calls super().__init__

    def apply(self, grads):
        return []


def run_returning(make):
    x = Leaf([1.0, 2.0, 3.0])
    pyengine.backward(_output(Returns(x, make)), np.ones(3))


class _output:
    """A non-leaf tensor whose grad_fn is ``node``."""

    def __init__(self, node, shape=(3,)):
        self.grad_fn, self.output_nr, self.requires_grad = node, 0, True
        self.data = np.zeros(shape)
        self.grad = None


def hook_returning_wrong_shape():
    x = Leaf([1.0, 2.0, 3.0])
    node = Returns(x, lambda: [np.ones(3)])
    node.register_prehook(lambda grads: (np.ones(4),))
    pyengine.backward(_output(node), np.ones(3))


def backward_twice():
    x = Leaf([1.0, 2.0, 3.0])

    class Saves(pyengine.Node):
        def apply(self, grads):
            (saved,) = self.saved_values
            return [grads[0] * saved]

    node = Saves([pyengine.gradient_edge(x)], [x.data])
    node.save_for_backward(x.data)
    y = _output(node)
    pyengine.backward(y, np.ones(3))
    pyengine.backward(y, np.ones(3))


def wrong_device():
    x = Leaf([1.0, 2.0, 3.0])
    node = pyengine.Node.__new__(Returns)
    Returns.__init__(node, x, lambda: [fd.to_fake(np.ones(3), fd.device(0))])
    pyengine.backward(_output(node), np.ones(3))


CASES = [
    ("wrong count", lambda: run_returning(lambda: [np.ones(3), np.ones(3)]), RuntimeError,
     "Function Returns returned an invalid number of gradients - expected 1, but got 2"),
    ("shape not broadcastable", lambda: run_returning(lambda: [np.ones(4)]), RuntimeError,
     "Function Returns returned an invalid gradient at index 0 - got (4,) but expected shape "
     "compatible with (3,)"),
    ("complex dtype", lambda: run_returning(lambda: [np.ones(3, dtype=np.complex64)]), RuntimeError,
     "Function Returns returned an invalid gradient at index 0 - expected dtype float64 but "
     "got complex64"),
    # numpy cast a datetime into the float slot without a word, and a
    # structured or str gradient failed with numpy's own error.
    ("datetime dtype", lambda: run_returning(lambda: [np.array([7, 8, 9], dtype="M8[s]")]),
     RuntimeError, "Function Returns returned an invalid gradient at index 0 - expected dtype "
     "float64 but got datetime64[s] (only a numeric gradient casts)"),
    ("structured dtype", lambda: run_returning(
        lambda: [np.zeros(3, dtype=[("a", "f8"), ("b", "f8")])]),
     RuntimeError, "Function Returns returned an invalid gradient at index 0 - expected dtype "
     "float64 but got [('a', '<f8'), ('b', '<f8')] (only a numeric gradient casts)"),
    ("str dtype", lambda: run_returning(lambda: [np.array(["a", "b", "c"])]), RuntimeError,
     "Function Returns returned an invalid gradient at index 0 - expected dtype float64 but "
     "got <U1 (only a numeric gradient casts)"),
    ("wrong device", wrong_device, RuntimeError,
     "Function Returns returned an invalid gradient at index 0 - expected device cpu but got "
     "fake:0"),
    ("not an array", lambda: run_returning(lambda: ["three"]), TypeError,
     "Function Returns returned an invalid gradient at index 0 - expected an array, but got str"),
    ("apply returns a non-sequence", lambda: run_returning(lambda: 3.0), TypeError,
     "Function Returns.apply must return a tuple or list of gradients, got float"),
    ("None root", lambda: pyengine.backward([None]), TypeError, "element 0 of tensors is None"),
    ("grad_tensors length mismatch",
     lambda: pyengine.backward([_output(Returns(Leaf([1.0, 2.0, 3.0]), lambda: [None]))],
                               [np.ones(3), np.ones(3)]),
     RuntimeError, "got 1 tensors and 2 gradients"),
    ("root does not require grad", lambda: pyengine.backward(Leaf(1.0, requires_grad=False)),
     RuntimeError, "element 0 of tensors does not require grad and does not have a grad_fn"),
    ("input not in the graph",
     lambda: pyengine.grad(_output(Returns(Leaf([1.0, 2.0, 3.0]), lambda: [np.ones(3)])),
                           [Leaf([5.0])], np.ones(3)),
     RuntimeError, "One of the differentiated Tensors appears to not have been used in the graph"),
    ("hook returning a wrong shape", hook_returning_wrong_shape, RuntimeError,
     "has changed the shape of the gradient at index 0 (was (3,), got (4,))"),
    ("backward twice", backward_twice, RuntimeError,
     "Trying to backward through the graph a second time"),
    ("queue_callback outside backward", lambda: pyengine.queue_callback(lambda: None),
     RuntimeError, "Final callbacks can only be installed during backward pass."),
    ("Node forgets super().__init__", lambda: pyengine.Edge(Forgetful(), 0),
     RuntimeError, "Forgetful was not initialized: its __init__ must call super().__init__"),
    ("implicit grad of a non-scalar",
     lambda: pyengine.backward(_output(Returns(Leaf([1.0, 2.0, 3.0]), lambda: [np.ones(3)]))),
     RuntimeError, "grad can be implicitly created only for scalar outputs"),
]


@pytest.mark.parametrize("name, action, error_type, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named_and_the_engine_recovers(name, action, error_type, message):
    with pytest.raises(error_type, match=re.escape(message)):
        action()


@pytest.mark.parametrize("device, expected", [("cpu", pyengine.CPU),
                                              ("fake:1", pyengine.Device("fake", 1)),
                                              (pyengine.CPU, pyengine.CPU)])
def test_a_metadata_device_may_be_named_by_a_str(device, expected):
    # As torch takes "cuda:1": before, a str device reached the checks as it
    # was, and failed there ("'str' object has no attribute 'type'", or
    # "expected device cpu but got cpu" in an owner graph).
    metadata = pyengine.InputMetadata((2,), np.float64, device)
    assert metadata.device == expected and metadata.is_cpu == (expected == pyengine.CPU)

    class Value:
        def __init__(self, parents=()):
            self.parents = parents
            self.grad = None

    leaf = Value()
    graph = pyengine.OwnerGraph("parents", lambda owner, grads: [grads[0] * 2], mode="returns",
                                metadata=lambda owner: [((2,), np.float64, "cpu")])
    graph.backward(Value([leaf]), np.ones(2))
    np.testing.assert_array_equal(leaf.grad, [2.0, 2.0])


@pytest.mark.parametrize("device", [None, 0, ("cpu",), object()])
def test_a_metadata_device_of_another_type_is_refused_where_it_is_made(device):
    with pytest.raises(TypeError, match="device must be a pyengine.Device or a str such as "
                                        f"'cpu' or 'cuda:1', got {type(device).__name__}"):
        pyengine.InputMetadata((2,), np.float64, device)


# See Note [InputMetadata sizes] in pyengine/_shared/messages.py. Each was
# taken before: a float truncated (2.7 as 2), a str or bytes size parsed
# ("3" as 3), a str shape split into digits ("12" as (1, 2)), a negative
# size kept and blamed at backward on the node whose gradient could not
# match it.
BAD_SHAPES = [
    ((2.7,), TypeError, "InputMetadata shape: the size at position 0 must be an int, got float 2.7"),
    ((3, np.float64(3.0)), TypeError,
     "InputMetadata shape: the size at position 1 must be an int, got float64"),
    (("3",), TypeError, "InputMetadata shape: the size at position 0 must be an int, got str '3'"),
    ((2, b"4"), TypeError,
     "InputMetadata shape: the size at position 1 must be an int, got bytes b'4'"),
    ("12", TypeError, "InputMetadata shape must be a sequence of ints, got str '12'"),
    (b"12", TypeError, "InputMetadata shape must be a sequence of ints, got bytes b'12'"),
    ((-1,), ValueError,
     "InputMetadata shape (-1,): the size at position 0 is -1, expected a size of at least 0"),
    ((2, np.int64(-3)), ValueError,
     "InputMetadata shape (2, -3): the size at position 1 is -3, expected a size of at least 0"),
    # In order: the negative size comes before the one too large for C.
    ((-1, 2**64), ValueError, "the size at position 0 is -1, expected a size of at least 0"),
]


@pytest.mark.parametrize("shape, error_type, message", BAD_SHAPES,
                         ids=[repr(case[0]) for case in BAD_SHAPES])
def test_a_metadata_size_that_is_not_a_size_is_refused_where_it_is_made(shape, error_type, message):
    with pytest.raises(error_type, match=re.escape(message)):
        pyengine.InputMetadata(shape, np.float64)
    with pytest.raises(error_type, match=re.escape(message)):
        Returns.__base__(next_edges=(), input_metadata=[(shape, np.float64)])
    # Sizes with __index__ still make a shape of ints: numpy's integers, a bool.
    metadata = pyengine.InputMetadata((np.int64(3), np.uint8(0), True), np.float64)
    assert metadata.shape == (3, 0, 1) and [type(size) for size in metadata.shape] == [int] * 3


def test_validate_outputs_refuses_a_format_error_that_cannot_be_called():
    # The compiled core took None as its engine's own "Function NoneType ...",
    # the twin failed calling it; both refuse it now, before any check.
    from pyengine._core import validate_outputs

    class Sink(pyengine.Node):
        def apply(self, grads):
            return []

    sink = Sink(next_edges=(), input_metadata=[pyengine.InputMetadata((3,), np.float64)])
    with pytest.raises(TypeError, match="^format_error must be a callable, got NoneType$"):
        validate_outputs([pyengine.Edge(sink, 0)], [np.ones(2)], None)
    with pytest.raises(RuntimeError, match=r"^bad: invalid gradient at index 0 - got \(2,\)"):
        validate_outputs([pyengine.Edge(sink, 0)], [np.ones(2)], lambda message: f"bad: {message}")
