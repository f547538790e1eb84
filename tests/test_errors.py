"""Errors raised by backward/grad and by validate_outputs, with PyTorch's texts;
how validate_outputs fixes gradients (sum_to, casts); exceptions raised in a
node or a hook, and the state left after them.
"""

import gc
import re
import weakref

import numpy as np
import pytest
from conftest import Counter, tap
from minitensor import T, const, leaf

import pyengine
from pyengine import Edge, gradient_edge


def assert_close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-12, atol=1e-12)


# -- backward / grad arguments -------------------------------------------------------

SCALAR_ONLY = "grad can be implicitly created only for scalar outputs"


def test_implicit_grad_only_for_scalar_outputs():
    x = leaf([1.0, 2.0])
    with pytest.raises(RuntimeError, match=SCALAR_ONLY):
        (x * 2.0).backward()
    with pytest.raises(RuntimeError, match=SCALAR_ONLY):
        pyengine.grad(x * 2.0, x)


def test_implicit_grad_needs_a_real_scalar():
    x = leaf(2.0)
    y = T(np.array(3, dtype=np.int64))
    y.grad_fn, y.requires_grad = Counter([gradient_edge(x)], [((), np.int64)]), True
    with pytest.raises(RuntimeError, match="implicitly created only for real scalar outputs"):
        y.backward()


def test_a_gradient_of_no_array_type_is_named_before_the_output_is_read(torch):
    x = leaf([1.0, 2.0])
    y = (x * 2.0).sum()
    tx = torch.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(TypeError) as expected:
        torch.autograd.backward((tx * 2.0).sum(), grad_tensors="x")
    with pytest.raises(TypeError) as got:
        pyengine.backward(y, "x")
    # torch's words, with numpy's arrays for its Tensors.
    assert str(got.value) == str(expected.value).replace("Tensors", "arrays")
    # An output whose value no backend reads: the gradient is named first,
    # as torch checks it before it reads the output.
    y.data = object()
    with pytest.raises(TypeError, match="^gradients can be either arrays or None, but got str$"):
        pyengine.backward(y, "x")
    with pytest.raises(TypeError, match="output 0 has a value of type object"):
        pyengine.backward(y, np.ones(()))


def test_element_does_not_require_grad():
    x = leaf([1.0])
    c = const(2.0)
    with pytest.raises(RuntimeError, match=re.escape(
            "element 1 of tensors does not require grad and does not have a grad_fn")):
        pyengine.backward([(x * x).sum(), c])
    with pytest.raises(RuntimeError, match=re.escape(
            "element 0 of tensors does not require grad and does not have a grad_fn")):
        c.backward()


def test_unused_input_raises():
    x = leaf([1.0])
    z = leaf([2.0])
    with pytest.raises(RuntimeError, match=re.escape(
            "One of the differentiated Tensors appears to not have been used in the graph. "
            "Set allow_unused=True if this is the desired behavior.")):
        pyengine.grad((x * x).sum(), [x, z])


def test_input_that_does_not_require_grad_raises():
    x = leaf([1.0])
    with pytest.raises(RuntimeError, match="does not require grad"):
        pyengine.grad((x * x).sum(), [const([1.0])])


def test_grad_requires_non_empty_inputs():
    x = leaf([1.0])
    with pytest.raises(RuntimeError, match=re.escape("grad requires non-empty inputs.")):
        pyengine.grad((x * x).sum(), [])


def test_backward_inputs_cannot_be_empty():
    x = leaf([1.0])
    message = "`inputs` argument to `backward()` cannot be empty."
    with pytest.raises(RuntimeError, match=re.escape(message)):
        (x * x).sum().backward(inputs=[])


def test_grad_tensors_shape_mismatch():
    x = leaf([1.0, 2.0, 3.0])
    with pytest.raises(RuntimeError, match=re.escape("Mismatch in shape: grad_output[0]")):
        (x * 2.0).backward(np.ones(2))


def test_grad_tensors_shape_mismatch_for_an_edge_output():
    # A GradientEdge output is checked against its slot's metadata, as
    # torch.autograd.backward checks it; a slot without metadata, or an
    # input_nr past them, leaves the gradient unchecked.
    x = leaf([1.0, 2.0])
    y = x * 2.0
    with pytest.raises(RuntimeError, match=re.escape(
            "Mismatch in shape: grad_output[0] has a shape of (3,) and output[0] has a shape of (2,).")):
        pyengine.backward(gradient_edge(y), np.ones(3))
    assert x.grad is None
    unchecked = Counter(next_edges=[gradient_edge(x)], input_metadata=[])
    pyengine.backward(Edge(unchecked, 0), np.array([1.0, 3.0]))
    assert_close(x.grad, [1.0, 3.0])


def test_grad_tensors_count_mismatch():
    x = leaf([1.0])
    with pytest.raises(RuntimeError):
        pyengine.backward([x * 2.0, x * 3.0], [np.ones(1)])


def test_grad_tensors_of_wrong_type():
    x = leaf([1.0, 2.0])
    with pytest.raises(TypeError):
        (x * 2.0).backward("not an array")


# -- validate_outputs -----------------------------------------------------------------

class Returns(pyengine.Node):
    """Returns ``make(grads)`` from apply: whatever a test wants to return."""

    def __init__(self, inputs, make, shape=(3,)):
        super().__init__(next_edges=[gradient_edge(t) for t in inputs],
                         input_metadata=[(shape, np.float64)])
        self.make = make

    def apply(self, grads):
        return self.make(grads)


def run(node, shape=(3,)):
    pyengine.backward(Edge(node, 0), np.ones(shape))


class BadCount(Returns):
    pass


class BadShape(Returns):
    pass


def test_wrong_number_of_gradients():
    x, w = leaf([1.0, 2.0, 3.0]), leaf([1.0, 2.0, 3.0])
    node = BadCount([x, w], lambda grads: [grads[0]])
    with pytest.raises(RuntimeError, match=re.escape(
            "Function BadCount returned an invalid number of gradients - expected 2, but got 1")):
        run(node)


def test_shape_not_broadcastable():
    x = leaf([1.0, 2.0, 3.0])
    node = BadShape([x], lambda grads: [np.ones(4)])
    with pytest.raises(RuntimeError, match=re.escape(
            "Function BadShape returned an invalid gradient at index 0 - got (4,) but expected "
            "shape compatible with (3,)")):
        run(node)
    assert x.grad is None


class BadShapeUnnamed(Returns):
    def name(self):
        raise LookupError("no name")


class BadName(Returns):
    """A name() that returns an object whose str() raises."""

    def name(self):
        class Unprintable:
            def __str__(self):
                raise ValueError("unprintable")
        return Unprintable()


@pytest.mark.parametrize("node_type", [BadShapeUnnamed, BadName])
def test_a_name_that_raises_leaves_the_error_it_was_asked_to_word(node_type):
    # The shape error still comes out, naming the node by its type: See Note
    # [A name() that raises] in pyengine/_shared/messages.py.
    x = leaf([1.0, 2.0, 3.0])
    node = node_type([x], lambda grads: [np.ones(4)])
    raised = "LookupError" if node_type is BadShapeUnnamed else "ValueError"
    with pytest.raises(RuntimeError, match=re.escape(
            f"Function {node_type.__name__} (its name() raised {raised}) returned an invalid "
            "gradient at index 0 - got (4,) but expected shape compatible with (3,)")):
        run(node)
    assert x.grad is None


def test_a_name_that_raises_keyboard_interrupt_is_not_caught():
    class Interrupting(Returns):
        def name(self):
            raise KeyboardInterrupt

    x = leaf([1.0, 2.0, 3.0])
    with pytest.raises(KeyboardInterrupt):
        run(Interrupting([x], lambda grads: [np.ones(4)]))
    assert x.grad is None
    run(Returns([x], lambda grads: [np.ones(3)]))  # the engine works on
    assert_close(x.grad, np.ones(3))


def test_broadcastable_gradient_is_reduced_with_sum_to():
    x = leaf([1.0, 2.0, 3.0])
    g = np.arange(6.0).reshape(2, 3)
    run(Returns([x], lambda grads: [g]))
    assert x.grad.shape == (3,)
    assert_close(x.grad, g.sum(axis=0))
    y = leaf(np.zeros((2, 1)))
    run(Returns([y], lambda grads: [np.arange(6.0).reshape(2, 3)]))
    assert_close(y.grad, [[3.0], [12.0]])


def test_broadcast_add_reduces_like_torch(torch):
    a = leaf(np.arange(6.0).reshape(2, 3))
    b = leaf([[1.0], [2.0]])
    c = leaf([1.0, 2.0, 3.0])
    ((a + b + c) * (a + c)).sum().backward()
    ta, tb, tc = (torch.tensor(v.data, requires_grad=True) for v in (a, b, c))
    ((ta + tb + tc) * (ta + tc)).sum().backward()
    for mine, theirs in ((a, ta), (b, tb), (c, tc)):
        assert mine.grad.shape == mine.data.shape
        assert_close(mine.grad, theirs.grad.numpy())


@pytest.mark.parametrize("leaf_dtype, grad_dtype", [(np.float64, np.float32),
                                                    (np.float32, np.float64)])
def test_gradient_is_cast_to_the_input_dtype(leaf_dtype, grad_dtype):
    x = leaf([1.0, 2.0, 3.0], dtype=leaf_dtype)
    node = Returns([x], lambda grads: [np.full(3, 0.5, dtype=grad_dtype)])
    run(node)
    assert x.grad.dtype == leaf_dtype
    assert_close(x.grad, [0.5, 0.5, 0.5])


def test_root_gradient_is_cast_to_the_output_dtype():
    x = leaf([1.0, 2.0], dtype=np.float32)
    y = x * 2.0
    y.backward(np.ones(2, dtype=np.float64))
    assert x.grad.dtype == np.float32
    assert_close(x.grad, [2.0, 2.0])


def test_integer_gradient_for_a_complex_input_is_rejected(torch):
    # As PyTorch: an integer gradient casts to a real dtype only.
    class Int(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.clone()

        @staticmethod
        def backward(ctx, g):
            return torch.ones(3, dtype=torch.int64)

    tx = torch.ones(3, dtype=torch.complex128, requires_grad=True)
    with pytest.raises(RuntimeError):
        Int.apply(tx).abs().sum().backward()
    assert tx.grad is None
    x = leaf([1.0, 2.0, 3.0], dtype=np.complex128)
    node = Returns([x], lambda grads: [np.ones(3, dtype=np.int64)])
    with pytest.raises(RuntimeError, match=re.escape("returned an invalid gradient at index 0 - "
                                                     "expected dtype complex128 but got int64")):
        run(node)
    assert x.grad is None


def test_complex_gradient_for_real_input_is_rejected():
    x = leaf([1.0, 2.0, 3.0])
    node = Returns([x], lambda grads: [np.ones(3, dtype=np.complex128)])
    with pytest.raises(RuntimeError, match="invalid gradient at index 0 - expected dtype"):
        run(node)


@pytest.mark.parametrize("result", [np.ones(3), None, 1.0])
def test_apply_returning_a_non_sequence_is_rejected(result):
    x = leaf([1.0, 2.0, 3.0])
    node = Returns([x], lambda grads: result)
    with pytest.raises(TypeError, match="must return a tuple or list"):
        run(node)


def test_apply_returning_a_non_array_gradient_is_rejected():
    x = leaf([1.0, 2.0, 3.0])
    node = Returns([x], lambda grads: ["nope"])
    with pytest.raises(TypeError, match="invalid gradient at index 0"):
        run(node)


def test_gradient_for_a_none_edge_is_ignored():
    x = leaf([1.0, 2.0, 3.0])
    node = Returns([const([0.0, 0.0, 0.0]), x], lambda grads: [np.ones(99), grads[0] * 2])
    run(node)
    assert_close(x.grad, [2.0, 2.0, 2.0])


# -- exceptions from nodes and hooks ----------------------------------------------------

class MyError(Exception):
    def __init__(self, message, payload):
        super().__init__(message)
        self.payload = payload


class Fail(pyengine.Node):
    def __init__(self, x):
        super().__init__(next_edges=[gradient_edge(x)], input_metadata=[x.data])

    def apply(self, grads):
        raise MyError("node failed", payload=42)


def fail(x):
    out = T(x.data.copy())
    out.grad_fn, out.requires_grad = Fail(x), True
    return out


def test_exception_in_node_reaches_caller_and_stops_the_graph_task(torch):
    # Forward order: the failing branch first, so that it runs last but one.
    log = []
    x0, x1, x2 = leaf([1.0]), leaf([2.0]), leaf([3.0])
    early, early_node = tap(x0, tag="early", log=log)  # lowest sequence_nr: would run last
    b = fail(x2)
    a, _ = tap(x1, tag="a", log=log)
    y = (a + b + early).sum()
    with pytest.raises(MyError, match="node failed") as excinfo:
        y.backward()
    assert excinfo.value.payload == 42
    assert any(entry.name == "apply" for entry in excinfo.traceback)
    assert log == ["a"]
    assert early_node.calls == 0
    assert_close(x1.grad, [1.0])  # its AccumulateGrad ran before the failure
    assert x2.grad is None and x0.grad is None

    # The same graph in PyTorch leaves the same .grad fields.
    class TorchFail(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            raise MyError("node failed", payload=42)

    t0, t1, t2 = (torch.tensor(v.data, requires_grad=True) for v in (x0, x1, x2))
    t_early = t0 * 1.0
    tb = TorchFail.apply(t2)
    ta = t1 * 1.0
    ty = (ta + tb + t_early).sum()
    with pytest.raises(MyError):
        ty.backward()
    assert tuple(t.grad is None for t in (t0, t1, t2)) == (True, False, True)


def test_engine_works_after_an_exception():
    x = leaf([1.0, 2.0])
    with pytest.raises(MyError):
        (fail(x) * 2.0).sum().backward()
    assert x.grad is None
    for _ in range(2):
        y = (x * x).sum()
        y.backward()
    assert_close(x.grad, 4 * x.data)


def test_retained_graph_can_run_again_after_an_exception():
    x = leaf([1.0, 2.0])
    h = x * 3.0
    y = (h * h).sum()
    handle = h.register_hook(lambda g: (_ for _ in ()).throw(KeyError("hook")))
    with pytest.raises(KeyError):
        y.backward(retain_graph=True)
    assert x.grad is None
    handle.remove()
    y.backward()
    assert_close(x.grad, 18 * x.data)


def _raise(error):
    raise error


@pytest.mark.parametrize("where", ["tensor_hook", "leaf_hook", "prehook", "posthook",
                                   "post_accumulate"])
def test_exception_in_hook_reaches_caller(where):
    x = leaf([1.0, 2.0])
    h = x * 2.0
    error = ValueError(f"from {where}")
    if where == "tensor_hook":
        h.register_hook(lambda g: _raise(error))
    elif where == "leaf_hook":
        x.register_hook(lambda g: _raise(error))
    elif where == "prehook":
        h.grad_fn.register_prehook(lambda grads: _raise(error))
    elif where == "posthook":
        h.grad_fn.register_hook(lambda gi, go: _raise(error))
    else:
        x.register_post_accumulate_grad_hook(lambda t: _raise(error))
    with pytest.raises(ValueError, match=f"from {where}") as excinfo:
        (h * h).sum().backward()
    assert excinfo.value is error


def test_exception_in_grad_reaches_caller():
    x = leaf([1.0, 2.0])
    with pytest.raises(MyError):
        pyengine.grad((fail(x) * 2.0).sum(), x)
    (gx,) = pyengine.grad((x * 2.0).sum(), x)
    assert_close(gx, [2.0, 2.0])


def test_leaf_grad_unchanged_after_failed_backward():
    x = leaf([1.0, 2.0])
    (x * x).sum().backward()
    before = x.grad.copy()
    with pytest.raises(MyError):
        (fail(x) + x * 0.0).sum().backward()  # Fail raises before x's AccumulateGrad is ready
    assert_close(x.grad, before)


def test_keyboard_interrupt_is_propagated():
    x = leaf([1.0])
    h = x * 2.0
    h.register_hook(lambda g: _raise(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        h.sum().backward()


# -- a failed backward lets its graph go -----------------------------------------------
# See Note [A raised error must not name itself in its frame] in
# pyengine/_pure/engine.py. Oracle: torch frees a failed backward's graph by
# reference counting once the caller lets go of the error; so must both cores,
# with the cyclic garbage collector off.

class _Saving(pyengine.Node):
    """Saves a large array and raises in apply, or queues a failing final callback."""

    def __init__(self, x, fail_in):
        super().__init__(next_edges=[gradient_edge(x)], input_metadata=[((3,), np.float64)])
        self.save_for_backward(np.ones(100_000))
        self.fail_in = fail_in

    def apply(self, grads):
        if self.fail_in == "apply":
            raise ValueError("boom")
        pyengine.queue_callback(lambda: 1 / 0)
        return [grads[0]]


class _Owner:
    """A returns-mode owner (See pyengine.OwnerGraph) whose backward queues a failing callback."""

    def __init__(self, parents=()):
        self.data = np.ones(3)
        self.grad = None
        self.parents = parents

    def backward(self, grads):
        pyengine.queue_callback(lambda: 1 / 0)
        return [grads[0]]


@pytest.fixture
def gc_off():
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was_enabled:
        gc.enable()


@pytest.mark.parametrize("fail_in", ["apply", "final callback"])
def test_a_failed_backward_frees_its_graph_by_reference_counting(gc_off, fail_in):
    def fail_once():
        node = _Saving(leaf([1.0, 2.0, 3.0]), fail_in)
        alive = weakref.ref(node)
        with pytest.raises((ValueError, ZeroDivisionError)):
            run(node)
        return alive

    assert fail_once()() is None


def test_a_failed_owner_graph_backward_frees_its_graph_by_reference_counting(gc_off):
    def fail_once():
        root = _Owner((_Owner(),))
        alive = weakref.ref(root)
        with pytest.raises(ZeroDivisionError):
            pyengine.OwnerGraph("parents", "backward", mode="returns").backward(root, np.ones(3))
        return alive

    assert fail_once()() is None
