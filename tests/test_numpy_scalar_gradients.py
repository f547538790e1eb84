"""A numpy scalar as a gradient: what numpy gives for arithmetic on 0-d arrays
(``np.ones(()) * 2.0`` is an ``np.float64``), so what a node computing on 0-d
values returns.

validate_outputs passes one of a 0-d slot's dtype as it is, casts or reduces
the others as it would a 0-d array, and asks a backend registered for its
type; routing keeps its node on the CPU unless such a backend says
otherwise. The compiled core takes a fast path for the first, both cores
one for the routing (``has_numpy_backend``); the twin checks through the
shared slow path. Both give the same values, types and threads, which each
test checks against the analytic answer on the core it runs on.
"""

import re
import threading

import numpy as np
import pytest

import pyengine
from pyengine import Edge, InputMetadata
from pyengine import fake_device as fd
from pyengine.backends import NUMPY, NumpyBackend

F0 = fd.device(0)


class Sink(pyengine.Node):
    """A node with one slot of the given metadata, which records what it
    receives and the thread it runs on; it has no next edges."""

    def __init__(self, metadata):
        super().__init__(next_edges=(), input_metadata=[metadata])
        self.received = []
        self.threads = []

    def apply(self, grads):
        self.received.append(grads[0])
        self.threads.append(threading.current_thread().name)
        return []


class Emit(pyengine.Node):
    """Returns ``gradient`` along its one edge, into ``sink``."""

    def __init__(self, sink, gradient):
        super().__init__(next_edges=[Edge(sink, 0)], input_metadata=[InputMetadata((), np.float64)])
        self.gradient = gradient

    def apply(self, grads):
        return [self.gradient]


def received_by(metadata, gradient):
    sink = Sink(metadata)
    pyengine.backward(Edge(Emit(sink, gradient), 0), np.ones(()))
    (received,) = sink.received
    return received, sink.threads[0]


SCALAR_TYPES = [np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128,
                np.clongdouble, np.int64, np.uint8, np.bool_]


@pytest.mark.parametrize("scalar_type", SCALAR_TYPES, ids=lambda t: t.__name__)
def test_a_numpy_scalar_of_a_0d_slots_dtype_passes_as_it_is(scalar_type):
    gradient = scalar_type(3)
    # Twice: the first value of a type fills backend_of's cache, which the
    # compiled core's fast path reads; the second takes that path.
    for _ in range(2):
        received, thread = received_by(InputMetadata((), scalar_type), gradient)
        assert received is gradient
        assert thread == threading.current_thread().name


def test_a_chain_of_numpy_scalars_gives_the_analytic_gradient():
    class Double(pyengine.Node):
        def apply(self, grads):
            return [grads[0] * 2.0]

    sink = Sink(InputMetadata((), np.float64))
    node = Double(next_edges=[Edge(sink, 0)], input_metadata=[InputMetadata((), np.float64)])
    for _ in range(30):
        node = Double(next_edges=[Edge(node, 0)], input_metadata=[InputMetadata((), np.float64)])
    pyengine.backward(Edge(node, 0), np.ones(()))
    (received,) = sink.received
    assert type(received) is np.float64 and received == 2.0 ** 31


@pytest.mark.parametrize("slot_dtype, scalar, expected_dtype", [
    (np.float32, np.float64(1.5), np.float32),
    (np.float64, np.float32(1.5), np.float64),
    (np.dtype(">f8"), np.float64(1.5), np.dtype(">f8")),
    (np.complex128, np.float64(1.5), np.complex128),
])
def test_a_numpy_scalar_of_another_dtype_is_cast(slot_dtype, scalar, expected_dtype):
    for _ in range(2):
        received, _ = received_by(InputMetadata((), slot_dtype), scalar)
        assert type(received) is np.ndarray and received.shape == ()
        assert received.dtype == expected_dtype and received.dtype.byteorder == np.dtype(
            expected_dtype).byteorder
        assert received == 1.5


@pytest.mark.parametrize("shape", [(1,), (3,)])
def test_a_numpy_scalar_into_a_slot_with_dimensions_is_refused(shape):
    # PyTorch's rule: the slot's shape must expand to the gradient's, and
    # no shape with a dimension expands to ().
    with pytest.raises(RuntimeError, match=re.escape(
            f"Function Emit returned an invalid gradient at index 0 - got () but expected shape "
            f"compatible with {shape}")):
        received_by(InputMetadata(shape, np.float64), np.float64(1.5))


def test_a_complex_scalar_into_a_real_slot_is_refused():
    with pytest.raises(RuntimeError, match="expected dtype float64 but got complex128"):
        received_by(InputMetadata((), np.float64), np.complex128(1.5))


class SubFloat(np.float64):
    pass


def test_a_subclass_of_a_numpy_scalar_passes_as_it_is():
    gradient = SubFloat(2.5)
    for _ in range(2):
        received, thread = received_by(InputMetadata((), np.float64), gradient)
        assert received is gradient
        assert thread == threading.current_thread().name


class CountingBackend(NumpyBackend):
    """The numpy backend, counting the values it is asked about; on
    ``device``."""

    def __init__(self, device=pyengine.CPU):
        self.asked = 0
        self.on = device

    def shape(self, value):
        self.asked += 1
        return super().shape(value)

    def device(self, value):
        self.asked += 1
        return self.on


@pytest.fixture
def float64_backend():
    """Registers a backend for np.float64 itself; puts back what was there."""
    registered = []

    def register(backend):
        registered.append(pyengine.register_backend(np.float64, backend))
        return backend

    yield register
    for _ in registered:
        pyengine.unregister_backend(np.float64)
    assert pyengine.backends.backend_of(np.float64(1.0)) is NUMPY


def test_a_backend_registered_for_the_scalar_type_is_asked(float64_backend):
    gradient = np.float64(1.5)
    # Known to the numpy backend first: a registration after must be seen.
    for _ in range(2):
        assert received_by(InputMetadata((), np.float64), gradient)[0] is gradient
    backend = float64_backend(CountingBackend())
    for _ in range(2):
        received, _ = received_by(InputMetadata((), np.float64), gradient)
        assert received is gradient
    # Each backward asks it (shape and device at least): no fast path skips it.
    assert backend.asked >= 4


def test_a_backend_that_puts_numpy_scalars_on_a_device_routes_their_node_there(float64_backend):
    for _ in range(2):
        assert received_by(None, np.float64(1.5))[1] == threading.current_thread().name
    float64_backend(CountingBackend(F0))
    # The sink's slot has no metadata, so that the gradient is not moved to
    # the CPU first and routing asks where the gradient is.
    sink = Sink(None)
    pyengine.backward(Edge(Emit(sink, np.float64(1.5)), 0), np.ones(()))
    assert sink.threads == ["pyengine-fake:0"]
    assert sink.received[0] == 1.5


def test_a_numpy_scalar_without_slot_metadata_stays_on_the_cpu():
    sink = Sink(None)
    gradient = np.float64(1.5)
    for _ in range(2):
        pyengine.backward(Edge(Emit(sink, gradient), 0), np.ones(()))
    assert sink.received == [gradient, gradient] and sink.received[1] is gradient
    assert sink.threads == [threading.current_thread().name] * 2


class HashedByValue(type):
    """A metaclass with its own ``__hash__`` and ``__eq__``: a lookup of its
    classes in a dict runs Python code."""

    calls = 0

    def __hash__(cls):
        HashedByValue.calls += 1
        return hash(cls.__name__)

    def __eq__(cls, other):
        return cls is other


class MetaFloat(np.float64, metaclass=HashedByValue):
    pass


@pytest.mark.parametrize("device", [None, F0], ids=["numpy backend", "a backend on fake:0"])
def test_a_scalar_type_with_a_metaclass_is_routed_by_its_backend(device):
    registered = device is not None
    if registered:
        pyengine.register_backend(MetaFloat, CountingBackend(device))
    try:
        for _ in range(2):
            sink = Sink(None)
            pyengine.backward(Edge(Emit(sink, MetaFloat(1.5)), 0), np.ones(()))
            assert sink.threads == ["pyengine-fake:0" if registered else
                                    threading.current_thread().name]
            assert type(sink.received[0]) is MetaFloat and sink.received[0] == 1.5
    finally:
        if registered:
            pyengine.unregister_backend(MetaFloat)
    assert HashedByValue.calls > 0


class Fan(pyengine.Node):
    """Returns ``gradients`` along as many edges, all into one slot of ``sink``."""

    def __init__(self, sink, gradients):
        super().__init__(next_edges=[Edge(sink, 0)] * len(gradients),
                         input_metadata=[InputMetadata((), np.float64)])
        self.gradients = gradients

    def apply(self, grads):
        return list(self.gradients)


@pytest.mark.parametrize("gradients, expected_type", [
    ([np.float64(1.5), np.float64(2.0), np.float64(4.0)], np.float64),
    ([np.float32(1.5), np.float32(2.0), np.float32(4.0)], np.float32),
    ([np.float32(1.5), np.float64(2.0), np.float16(4.0)], np.float64),
], ids=["float64", "float32", "mixed"])
def test_numpy_scalars_into_one_slot_without_metadata_sum_to_a_numpy_scalar(gradients,
                                                                            expected_type):
    for _ in range(2):
        sink = Sink(None)
        pyengine.backward(Edge(Fan(sink, gradients), 0), np.ones(()))
        (total,) = sink.received
        assert type(total) is expected_type and total == 7.5


def test_numpy_scalars_into_a_0d_slot_sum_to_its_dtype():
    for _ in range(2):
        sink = Sink(InputMetadata((), np.float64))
        pyengine.backward(Edge(Fan(sink, [np.float64(1.5), np.float64(2.0)]), 0), np.ones(()))
        (total,) = sink.received
        assert type(total) is np.float64 and total == 3.5


class AddingBackend(CountingBackend):
    """Counts its sums too."""

    def __init__(self):
        super().__init__()
        self.sums = 0

    def add(self, a, b):
        self.sums += 1
        return super().add(a, b)


def test_a_backend_registered_for_the_scalar_type_sums_its_values(float64_backend):
    gradients = [np.float64(1.5), np.float64(2.0), np.float64(4.0)]
    sink = Sink(None)
    # Summed by the numpy backend first: a registration after must be seen.
    for _ in range(2):
        pyengine.backward(Edge(Fan(sink, gradients), 0), np.ones(()))
    backend = float64_backend(AddingBackend())
    pyengine.backward(Edge(Fan(sink, gradients), 0), np.ones(()))
    assert sink.received == [7.5] * 3
    assert backend.sums == 2
