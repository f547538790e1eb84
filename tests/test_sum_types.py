"""Every sum the engine makes keeps the type of its operands (issue 23, part 2).

numpy's ``a + b`` on two 0-d arrays is a numpy scalar, which has no
``out=``, ``.base`` or ``.flags``: a framework that keeps the sum as
``.grad`` and updates it in place breaks. The oracle of every test here is
the issue's: the type of what the engine hands over (an ``np.ndarray`` for
ndarray operands, at every rank) and the analytic value of the sum.
"""

from __future__ import annotations

import numpy as np
import pytest
from plain_tensors import Leaf

import pyengine
from pyengine import fake_device as fd
from pyengine.backends import NUMPY, backend_of

RANKS = [0, 1, 2, 3]


def _value(rank, fill):
    return np.full((2,) * rank, fill, dtype=np.float64)


class Source(pyengine.Node):
    """Returns one gradient per next edge: ``grads[k] = value * (k + 1)``."""

    def __init__(self, edges, value):
        super().__init__(edges, [(value.shape, value.dtype)])
        self.value = value

    def apply(self, grads):
        return [self.value * (k + 1) if self.value.ndim else np.array(self.value * (k + 1))
                for k in range(len(self._next_edges))]


class Sink(pyengine.Node):
    def __init__(self, value, got):
        super().__init__((), [pyengine.InputMetadata.from_value(value)])
        self.got = got

    def apply(self, grads):
        self.got.append(grads[0])
        return []


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("fan_in", [2, 3, 4])
def test_input_buffer_sum_is_an_array(rank, fan_in):
    # The issue's repro at every rank: two gradients take the out-of-place
    # sum, more take the in-place one into the buffer's own array.
    value = _value(rank, 1.0)
    got = []
    sink = Sink(value, got)
    source = Source([pyengine.Edge(sink, 0)] * fan_in, value)
    pyengine.get_default_engine().execute([pyengine.Edge(source, 0)], [np.ones_like(value)],
                                          False, False, True, None)
    (total,) = got
    assert type(total) is np.ndarray
    assert total.shape == value.shape
    np.testing.assert_array_equal(total, value * sum(range(1, fan_in + 1)))


def test_issue_repro():
    got = {}

    class Source2(pyengine.Node):
        def apply(self, grads):
            return [np.array(1.0), np.array(2.0)]

    class Sink2(pyengine.Node):
        def apply(self, grads):
            got["g"] = grads[0]
            return []

    sink = Sink2((), [((), np.float64)])
    source = Source2([pyengine.Edge(sink, 0), pyengine.Edge(sink, 0)], [((), np.float64)])
    pyengine.get_default_engine().execute([pyengine.Edge(source, 0)], [np.array(1.0)],
                                          False, False, True, None)
    assert type(got["g"]) is np.ndarray
    assert got["g"] == 3.0


def _accumulate(leaf, value, fan_in=1):
    source = Source([pyengine.gradient_edge(leaf)] * fan_in, value)
    pyengine.get_default_engine().execute([pyengine.Edge(source, 0)], [np.ones_like(value)],
                                          False, False, True, None)


@pytest.mark.parametrize("rank", RANKS)
def test_accumulate_grad_sums_are_arrays(rank):
    value = _value(rank, 1.0)
    leaf = Leaf(_value(rank, 0.0))
    _accumulate(leaf, value)  # .grad was None: stored
    assert type(leaf.grad) is np.ndarray
    _accumulate(leaf, value)  # pyengine's own .grad: in place
    assert type(leaf.grad) is np.ndarray
    np.testing.assert_array_equal(leaf.grad, 2 * value)
    leaf.grad = np.array(_value(rank, 5.0))  # the user's .grad: out of place
    _accumulate(leaf, value, fan_in=2)
    assert type(leaf.grad) is np.ndarray
    np.testing.assert_array_equal(leaf.grad, _value(rank, 5.0) + 3 * value)


def test_accumulate_grad_adds_a_scalar_gradient_into_an_array():
    # A node may hand over a numpy scalar (0-d formulas do): .grad stays an array.
    leaf = Leaf(np.array(0.0))
    leaf.grad = np.array(1.0)

    class ScalarSource(pyengine.Node):
        def apply(self, grads):
            return [np.float64(2.0)]

    source = ScalarSource([pyengine.gradient_edge(leaf)], [((), np.float64)])
    pyengine.get_default_engine().execute([pyengine.Edge(source, 0)], [np.array(1.0)],
                                          False, False, True, None)
    assert type(leaf.grad) is np.ndarray and leaf.grad == 3.0


class Identity(pyengine.Node):
    def apply(self, grads):
        return [grads[0]]


@pytest.mark.parametrize("rank", RANKS)
def test_retain_grad_sum_is_an_array(rank):
    value = _value(rank, 1.0)
    leaf = Leaf(_value(rank, 0.0))
    middle = Identity([pyengine.gradient_edge(leaf)], [(value.shape, value.dtype)])

    class NonLeaf:
        grad = None
        grad_fn = middle
        output_nr = 0
        requires_grad = True

    nonleaf = NonLeaf()
    pyengine.retain_grad(nonleaf)
    for _ in range(3):
        source = Source([pyengine.Edge(middle, 0)] * 2, value)
        pyengine.get_default_engine().execute([pyengine.Edge(source, 0)], [np.ones_like(value)],
                                              True, False, True, None)
        assert type(nonleaf.grad) is np.ndarray
    np.testing.assert_array_equal(nonleaf.grad, 9 * value)


@pytest.mark.parametrize("rank", RANKS)
def test_grad_inputs_capture_is_an_array(rank):
    value = _value(rank, 1.0)
    leaf = Leaf(_value(rank, 0.0))
    source = Source([pyengine.gradient_edge(leaf)] * 3, value)
    (captured,) = pyengine.get_default_engine().execute(
        [pyengine.Edge(source, 0)], [np.ones_like(value)], False, False, False,
        [pyengine.gradient_edge(leaf)])
    assert type(captured) is np.ndarray
    np.testing.assert_array_equal(captured, 6 * value)
    assert leaf.grad is None


@pytest.mark.parametrize("rank", RANKS)
def test_fake_device_sums_keep_their_type(rank):
    device = pyengine.Device("fake", 0)
    value = fd.to_fake(_value(rank, 1.0), device)
    got = []
    sink = Sink(value, got)

    class FakeSource(pyengine.Node):
        def apply(self, grads):
            return [value, value, value]

    source = FakeSource([pyengine.Edge(sink, 0)] * 3, [(value.shape, value.dtype, device)])
    pyengine.get_default_engine().execute([pyengine.Edge(source, 0)], [fd.to_fake(_value(rank, 1.0), device)],
                                          False, False, True, None)
    (total,) = got
    assert type(total) is fd.FakeArray
    np.testing.assert_array_equal(total.numpy(), 3 * _value(rank, 1.0))


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("make", [np.array, lambda a: fd.to_fake(a, pyengine.Device("fake", 0))],
                         ids=["numpy", "fake"])
def test_every_backend_add_keeps_the_type(rank, make):
    a, b = make(_value(rank, 1.0)), make(_value(rank, 2.0))
    backend = backend_of(a)
    for total in (backend.add(a, b), backend.add_(backend.copy(a), b)):
        assert type(total) is type(a)
        host = total.numpy() if isinstance(total, fd.FakeArray) else total
        np.testing.assert_array_equal(host, _value(rank, 3.0))


def test_numpy_scalars_still_sum_to_scalars():
    # The rule is "the type the operands had": two numpy scalars stay one.
    assert type(NUMPY.add(np.float64(1.0), np.float64(2.0))) is np.float64


_SCALAR_TYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                 np.uint64, np.float16, np.float32, np.float64, np.longdouble, np.complex64,
                 np.complex128, np.clongdouble]
_SCALAR_VALUES = [0, 1, 3, 127, 250, -2.5, 1e300, float("nan"), float("inf")]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("left", _SCALAR_TYPES, ids=lambda t: t.__name__)
def test_two_numpy_scalars_sum_as_np_add_does(left):
    # The numpy backend sums two numpy scalars with numpy's scalar
    # arithmetic: np.add's type and value (nan where np.add gives nan), or
    # np.add's error, for every pair of numeric scalar types.
    for right in _SCALAR_TYPES:
        for a_value in _SCALAR_VALUES:
            for b_value in _SCALAR_VALUES:
                try:
                    a, b = left(a_value), right(b_value)
                except (OverflowError, ValueError):
                    continue  # a value its type cannot hold
                try:
                    expected = np.add(a, b)
                except TypeError as error:
                    with pytest.raises(type(error)):
                        NUMPY.add(a, b)
                    continue
                total = NUMPY.add(a, b)
                assert type(total) is type(expected), (a, b)
                np.testing.assert_array_equal(np.asarray(total), np.asarray(expected),
                                              err_msg=f"{a!r} + {b!r}")
