"""InputBuffer: exact per-slot sums and who owns which array.
See Note [InputBuffer ownership].

The oracle for the sums is Python integer arithmetic (all values are float64
arrays with small integer entries, so every order of summation is exact).
Inputs are writable and compared with copies afterwards (numpy's backend
quietly adds out of place into a read-only array, which would hide a wrong
in-place addition); the random test mixes in read-only ones, which a compiled
fast path must not write into either.
"""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyengine._core import InputBuffer

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def arr(values, writeable=True):
    array = np.array(values, dtype=np.float64)
    array.flags.writeable = writeable
    return array


def test_first_value_is_stored_as_is():
    for create_graph in (False, True):
        buffer = InputBuffer(3)
        a = arr([1.0, 2.0])
        buffer.add(1, a, create_graph)
        assert buffer.buffer[1] is a
        assert buffer.buffer[0] is None and buffer.buffer[2] is None
        assert len(buffer.buffer) == 3


def test_second_addition_is_out_of_place():
    buffer = InputBuffer(1)
    a, b = arr([1.0, 2.0, 3.0]), arr([10.0, 20.0, 30.0])
    buffer.add(0, a, False)
    buffer.add(0, b, False)
    total = buffer.buffer[0]
    assert total is not a and total is not b
    assert not np.shares_memory(total, a) and not np.shares_memory(total, b)
    assert (total == [11.0, 22.0, 33.0]).all()
    assert (a == [1.0, 2.0, 3.0]).all() and (b == [10.0, 20.0, 30.0]).all()


def test_second_addition_leaves_writable_inputs_and_their_bases_alone():
    base = np.arange(6, dtype=np.float64)
    view = base[1:4]  # a view of something a node keeps
    other = np.array([100.0, 200.0, 300.0])
    buffer = InputBuffer(1)
    buffer.add(0, view, False)
    buffer.add(0, other, False)
    buffer.add(0, other, False)
    buffer.add(0, view, False)
    assert (buffer.buffer[0] == [202.0, 404.0, 606.0]).all()
    assert (base == np.arange(6)).all()
    assert (other == [100.0, 200.0, 300.0]).all()


def test_third_addition_is_in_place_into_the_buffers_own_array():
    buffer = InputBuffer(1)
    a, b, c, d = arr([1.0, 1.0]), arr([2.0, 2.0]), arr([4.0, 4.0]), arr([8.0, 8.0])
    buffer.add(0, a, False)
    buffer.add(0, b, False)
    owned = buffer.buffer[0]
    buffer.add(0, c, False)
    assert buffer.buffer[0] is owned, "the third addition allocated a new array"
    buffer.add(0, d, False)
    assert buffer.buffer[0] is owned, "the fourth addition allocated a new array"
    assert (owned == [15.0, 15.0]).all()
    for value, want in ((a, 1.0), (b, 2.0), (c, 4.0), (d, 8.0)):
        assert (value == want).all()


def test_same_array_added_again_is_not_mutated():
    a = arr([1.0, -3.0])
    buffer = InputBuffer(1)
    for _ in range(4):
        buffer.add(0, a, False)
    assert (buffer.buffer[0] == [4.0, -12.0]).all()
    assert (a == [1.0, -3.0]).all()


def test_under_create_graph_every_sum_is_out_of_place():
    buffer = InputBuffer(1)
    values = [arr([float(2**i), -float(i)]) for i in range(5)]
    buffer.add(0, values[0], True)
    assert buffer.buffer[0] is values[0]
    seen = [values[0]]
    for value in values[1:]:
        previous = buffer.buffer[0]
        snapshot = previous.copy()
        buffer.add(0, value, True)
        current = buffer.buffer[0]
        assert all(current is not old for old in seen), "create_graph sum reused an array"
        assert (previous == snapshot).all(), "create_graph sum wrote into the previous value"
        seen.append(current)
    assert (buffer.buffer[0] == [31.0, -10.0]).all()


def test_none_is_ignored():
    buffer = InputBuffer(2)
    buffer.add(0, None, False)
    assert buffer.buffer == [None, None]
    a = arr([3.0])
    buffer.add(0, a, False)
    buffer.add(0, None, False)
    buffer.add(0, None, True)
    assert buffer.buffer[0] is a
    assert buffer.buffer[1] is None


@pytest.mark.parametrize("size", [0, 1, 3])
def test_grows_to_a_slot_beyond_the_declared_size(size):
    buffer = InputBuffer(size)
    a, b, c = arr([1.0]), arr([2.0]), arr([4.0])
    buffer.add(size + 2, a, False)
    assert len(buffer.buffer) == size + 3
    assert buffer.buffer[size + 2] is a
    assert all(value is None for value in buffer.buffer[:size + 2])
    buffer.add(size + 2, b, False)
    second = buffer.buffer[size + 2]
    assert second is not a and second is not b and (second == [3.0]).all()
    buffer.add(size + 2, c, False)
    assert buffer.buffer[size + 2] is second and (second == [7.0]).all()
    # A lower slot after growing, and growing again past it.
    buffer.add(0, c, False)
    assert buffer.buffer[0] is c
    buffer.add(size + 5, b, False)
    assert len(buffer.buffer) == size + 6 and buffer.buffer[size + 5] is b
    assert buffer.buffer[size + 2] is second and (second == [7.0]).all()
    for value, want in ((a, 1.0), (b, 2.0), (c, 4.0)):
        assert (value == want).all()


def test_slots_are_independent():
    buffer = InputBuffer(2)
    a, b, c = arr([1.0, 2.0]), arr([3.0, 4.0]), arr([5.0, 6.0])
    buffer.add(0, a, False)
    buffer.add(1, b, False)
    buffer.add(0, c, False)
    assert buffer.buffer[1] is b
    owned0 = buffer.buffer[0]
    buffer.add(1, c, False)  # the second addition to slot 1: out of place
    assert buffer.buffer[1] is not b and buffer.buffer[1] is not owned0
    assert buffer.buffer[0] is owned0
    assert (owned0 == [6.0, 8.0]).all() and (buffer.buffer[1] == [8.0, 10.0]).all()


SHAPES = st.sampled_from([(), (1,), (3,), (2, 2)])


@st.composite
def add_sequences(draw):
    size = draw(st.integers(0, 3))
    n_slots = size + draw(st.integers(0, 2)) or 1
    shapes = [draw(SHAPES) for _ in range(n_slots)]
    create_graph_mode = draw(st.sampled_from(["off", "on", "mixed"]))
    ops = []
    for _ in range(draw(st.integers(1, 12))):
        slot = draw(st.integers(0, n_slots - 1))
        count = int(np.prod(shapes[slot], dtype=np.int64))
        values = [draw(st.integers(-8, 8)) for _ in range(count)]
        create_graph = {"off": False, "on": True, "mixed": None}[create_graph_mode]
        if create_graph is None:
            create_graph = draw(st.booleans())
        layouts = ["plain", "strided", "reversed"] + (["scalar"] if shapes[slot] == () else [])
        ops.append((slot, values, draw(st.booleans()), create_graph,
                    draw(st.sampled_from(layouts))))
    return size, shapes, ops


def _make_value(values, shape, layout, writeable):
    """``values`` as an array of ``shape``: plain, a strided or reversed view
    into a bigger base (returned too, to check that nothing around the view
    was written), or a numpy scalar."""
    plain = np.array(values, dtype=np.float64).reshape(shape)
    if layout == "scalar":
        return np.float64(plain), None
    if layout == "plain" or plain.ndim == 0:
        base, value = plain, plain
    elif layout == "strided":
        base = np.full(tuple(2 * n for n in shape), 99.0)
        value = base[tuple(slice(None, None, 2) for _ in shape)]
        value[...] = plain
    else:
        base = np.ascontiguousarray(plain[tuple(slice(None, None, -1) for _ in shape)])
        value = base[tuple(slice(None, None, -1) for _ in shape)]
    if not writeable:
        value.flags.writeable = False
        base.flags.writeable = False
    return value, base


@SETTINGS
@given(add_sequences())
def test_random_additions_sum_exactly_and_never_touch_inputs(case):
    size, shapes, ops = case
    buffer = InputBuffer(size)
    sums = {}
    counts = {}
    inputs = []
    for slot, values, writeable, create_graph, layout in ops:
        value, base = _make_value(values, shapes[slot], layout, writeable)
        inputs.append((value, np.array(value, copy=True)))
        if base is not None:
            inputs.append((base, base.copy()))
        previous = buffer.buffer[slot] if slot < len(buffer.buffer) else None
        snapshot = None if previous is None else np.array(previous, copy=True)
        buffer.add(slot, value, create_graph)
        current = buffer.buffer[slot]
        counts[slot] = counts.get(slot, 0) + 1
        sums[slot] = [x + y for x, y in zip(sums.get(slot, [0] * len(values)), values)]
        if counts[slot] == 1:
            assert current is value
        else:
            assert all(current is not v for v, _ in inputs), "a sum was written into an input"
            if create_graph:
                assert current is not previous
                assert (np.asarray(previous) == snapshot).all()
        assert np.shape(current) == shapes[slot]
    assert len(buffer.buffer) >= max(size, max(sums) + 1)
    for slot in range(len(buffer.buffer)):
        if slot not in sums:
            assert buffer.buffer[slot] is None
            continue
        total = np.asarray(buffer.buffer[slot])
        want = np.array(sums[slot], dtype=np.float64).reshape(shapes[slot])
        assert total.dtype == np.float64 and (total == want).all()
    for value, copy in inputs:
        assert (value == copy).all(), "the buffer wrote into an array it did not allocate"


@SETTINGS
@given(st.integers(3, 12), st.integers(1, 4))
def test_without_create_graph_one_array_is_allocated_per_slot(n_adds, length):
    buffer = InputBuffer(1)
    values = [arr([float(i + 1)] * length) for i in range(n_adds)]
    buffer.add(0, values[0], False)
    buffer.add(0, values[1], False)
    owned = buffer.buffer[0]
    for value in values[2:]:
        buffer.add(0, value, False)
        assert buffer.buffer[0] is owned
    assert (owned == n_adds * (n_adds + 1) // 2).all()


# Gradients of an undeclared slot (no metadata: nothing cast or reduced them
# to one dtype and shape), in every order. numpy's out-of-place sum, whose
# promotion and broadcast do not depend on the order, is the oracle.
MIXED_GRADIENTS = [
    pytest.param([np.array([1, 2, 3]), np.array([1, 2, 3]), np.array([0.5, 0.5, 0.5])],
                 id="int-int-float"),
    pytest.param([np.ones(3), np.ones(3), np.ones((2, 3))], id="row-row-matrix"),
    pytest.param([np.ones(3, np.float32), np.ones(3, np.float32), np.full(3, 1e-9)],
                 id="float32-float32-float64"),
]


@pytest.mark.parametrize("gradients", MIXED_GRADIENTS)
def test_a_slot_sums_alike_in_every_order(gradients):
    # The third gradient was added in place into the sum the buffer owned:
    # numpy refused to cast a float into the int sum or to grow the row, and
    # cast a float64 into the float32 sum, where another order summed.
    expected = gradients[0] + gradients[1] + gradients[2]
    for order in itertools.permutations(range(3)):
        buffer = InputBuffer(1)
        for i in order:
            buffer.add(0, gradients[i].copy(), False)
        total = buffer.buffer[0]
        assert total.dtype == expected.dtype and total.shape == expected.shape
        np.testing.assert_array_equal(total, expected)
    # Where dtype and shape agree, the third is still added in place.
    buffer = InputBuffer(1)
    for value in (gradients[0].copy(), gradients[0].copy()):
        buffer.add(0, value, False)
    owned = buffer.buffer[0]
    buffer.add(0, gradients[0].copy(), False)
    assert buffer.buffer[0] is owned


def test_the_numpy_backends_add_is_in_place_only_where_it_sums_alike():
    from pyengine.backends import NUMPY
    total = np.array([1, 2, 3])
    assert NUMPY.add_(total, np.array([1, 1, 1])) is total
    result = NUMPY.add_(total, np.array([0.5, 0.5, 0.5]))
    assert result is not total and result.dtype == np.float64
    assert result.tolist() == [2.5, 3.5, 4.5] and total.tolist() == [2, 3, 4]
    row = np.ones(3)
    assert NUMPY.add_(row, np.ones((2, 3))).shape == (2, 3) and row.tolist() == [1.0] * 3
