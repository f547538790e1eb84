"""pyengine as Chainer's backward engine: differential tests against
Chainer's own engine on the same programs.

The oracle is Chainer itself: each program runs natively and then with the
adapter installed, on freshly built graphs, and the gradients must agree
(in dtype and shape exactly, in value to a few ulps: where three or more
gradients meet the two engines may add them in another order).
``gradient_check.check_backward`` (finite differences) is a second oracle.
The slow test at the end runs Chainer's own engine tests and a subset of its
``functions_tests``, natively and with the adapter installed, where
``PYENGINE_CHAINER_TESTS`` names Chainer 7.8.1's ``tests/chainer_tests``
folder (``.ci/frameworks`` and ``tox -e chainer`` set it).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

chainer = pytest.importorskip("chainer")

import chainer._backprop  # noqa: E402, F811
import chainer.function_node  # noqa: E402
import chainer.functions as F  # noqa: E402
from chainer import gradient_check  # noqa: E402

import pyengine  # noqa: E402
from pyengine.adapters import chainer as pyengine_chainer  # noqa: E402

NATIVE_BACKPROP_TO_ALL = chainer._backprop._backprop_to_all
NATIVE_GRAD = chainer.function_node.grad


@pytest.fixture(autouse=True)
def adapter_left_as_found():
    yield
    installed = pyengine_chainer.is_installed()
    pyengine_chainer.uninstall()
    assert not installed, "the test left the adapter installed"
    assert chainer._backprop._backprop_to_all is NATIVE_BACKPROP_TO_ALL
    assert chainer.grad is NATIVE_GRAD and chainer.function_node.grad is NATIVE_GRAD


def native_and_pyengine(program):
    """``program()`` natively, then with the adapter installed; the second
    run must go through the adapter."""
    assert not pyengine_chainer.is_installed()
    native = program()
    runs = []
    with pyengine_chainer.installed():
        # Every run of the adapter reads its graph's items with _item_of.
        original = pyengine_chainer._item_of

        def counting(node):
            runs.append(node)
            return original(node)

        pyengine_chainer._item_of = counting
        try:
            ours = program()
        finally:
            pyengine_chainer._item_of = original
    assert runs, "the program ran no backward through the adapter"
    return native, ours


def as_array(value):
    if isinstance(value, chainer.Variable):
        return value.array
    return value


def assert_same(native, ours, rtol=1e-13):
    if isinstance(native, (tuple, list)):
        assert isinstance(ours, (tuple, list)) and len(ours) == len(native)
        for a, b in zip(native, ours):
            assert_same(a, b, rtol)
        return
    native, ours = as_array(native), as_array(ours)
    if native is None:
        assert ours is None
        return
    assert ours is not None
    assert type(ours) is type(native)
    assert ours.dtype == native.dtype and ours.shape == native.shape
    np.testing.assert_allclose(ours, native, rtol=rtol, atol=1e-300)


def check(program, rtol=1e-13):
    native, ours = native_and_pyengine(program)
    assert_same(native, ours, rtol)
    return ours


def rng():
    return np.random.default_rng(0)


def mlp_program(dtype=np.float64):
    def program():
        r = rng()
        x, w1, b1, w2, b2 = [chainer.Variable(r.normal(size=shape).astype(dtype))
                             for shape in ((5, 4), (6, 4), (6,), (3, 6), (3,))]
        t = np.array([0, 2, 1, 1, 0], np.int32)
        loss = F.softmax_cross_entropy(F.linear(F.relu(F.linear(x, w1, b1)), w2, b2), t)
        loss.backward()
        return [x.grad, w1.grad, b1.grad, w2.grad, b2.grad]
    return program


def test_mlp_variable_backward():
    check(mlp_program())


def test_mlp_float32():
    check(mlp_program(np.float32), rtol=1e-6)


def shared_graph():
    """A graph where gradients meet: x feeds several paths; a function with
    two outputs (split_axis) of which the second is used twice."""
    x = chainer.Variable(np.linspace(-1.0, 1.5, 6).reshape(2, 3))
    w = chainer.Variable(np.arange(6.0).reshape(3, 2) / 5.0)
    h = F.tanh(F.matmul(x, w))
    a, b = F.split_axis(h, 2, axis=1)
    y = F.sum(a * b + b * b) + F.sum(F.exp(x) * x) + F.sum(x * 2.0)
    return x, w, h, a, b, y


def test_shared_subexpressions_and_a_function_with_two_outputs():
    def program():
        x, w, h, a, b, y = shared_graph()
        y.backward()
        return [x.grad, w.grad, h.grad, a.grad, b.grad]
    ours = check(program)
    assert ours[2] is None  # no retain_grad: intermediate gradients are not kept


def test_retain_grad_keeps_every_intermediate_gradient():
    def program():
        x, w, h, a, b, y = shared_graph()
        y.backward(retain_grad=True)
        return [x.grad, w.grad, h.grad, a.grad, b.grad, y.grad]
    check(program)


def test_an_output_of_a_two_output_function_that_gets_no_gradient():
    def program():
        x = chainer.Variable(np.arange(6.0).reshape(2, 3))
        a, b = F.split_axis(x * 3.0, 2, axis=0)
        F.sum(a * a).backward(retain_grad=True)
        return [x.grad, a.grad, b.grad]
    check(program)


def test_gradients_accumulate_into_leaves_over_calls():
    def program():
        x = chainer.Variable(np.array([0.5, -1.0, 2.0]))
        F.sum(x * x).backward()
        F.sum(F.sin(x) * x).backward()
        first = x.grad.copy()
        x.cleargrad()
        F.sum(x ** 3).backward()
        return [first, x.grad]
    check(program)


def test_a_leaf_with_a_preset_gradient_adds_to_it():
    def program():
        x = chainer.Variable(np.array([0.5, -1.0, 2.0]))
        x.grad = np.array([10.0, 20.0, 30.0])
        F.sum(x * x + x).backward()
        return x.grad
    check(program)


def test_backward_from_a_leaf_sets_its_gradient():
    def program():
        x = chainer.Variable(np.array(2.0))
        y = x * 3.0
        y.backward()
        x.backward()
        return x.grad
    native, ours = native_and_pyengine(program)
    assert_same(native, ours)


def test_a_non_scalar_root_without_a_gradient_runs_its_creator_with_none():
    """Chainer calls the root's creator with a None gradient; MulConstant's
    backward then fails on it, the same way on both engines."""
    def program():
        x = chainer.Variable(np.ones(3))
        (x * 2.0).backward()
    native, ours = chainer_error(program)
    assert native == ours


class IgnoresItsGradient(chainer.FunctionNode):
    def forward(self, inputs):
        return inputs[0] * 2,

    def backward(self, indexes, grad_outputs):
        return chainer.Variable(np.full(3, 5.0)),


def test_a_root_without_a_gradient_whose_creator_gives_one_anyway():
    def program():
        x = chainer.Variable(np.ones(3))
        y, = IgnoresItsGradient().apply((F.sin(x),))
        y.backward()
        return x.grad
    check(program)


def test_a_deep_chain():
    def program():
        x = chainer.Variable(np.array([0.5, 1.0]))
        y = x
        for _ in range(3000):
            y = y * 1.0001
        F.sum(y).backward()
        return x.grad
    check(program, rtol=1e-12)


def test_wide_graph_of_many_branches():
    def program():
        x = chainer.Variable(np.array([0.25, -0.5, 1.0]))
        total = None
        for k in range(50):
            branch = x
            for _ in range(4):
                branch = F.sin(branch) * (1.0 + k / 100.0)
            total = branch if total is None else total + branch
        F.sum(total).backward()
        return x.grad
    check(program, rtol=1e-12)


def test_loss_scale():
    def program():
        x = chainer.Variable(np.array([0.5, -1.0, 2.0]))
        F.sum(F.tanh(x) * x).backward(loss_scale=8.0)
        return [x.grad, np.array(x._loss_scale)]
    check(program)


def test_chainer_backward_from_several_outputs():
    def program():
        x = chainer.Variable(np.array([0.5, -1.0, 2.0]))
        y1 = F.sin(x) * x
        y2 = F.exp(x)
        y1.grad = np.array([1.0, 2.0, 3.0])
        y2.grad = np.array([0.5, 0.25, 0.125])
        chainer.backward([y1, y2])
        return [x.grad, y1.grad_var, y2.grad_var]
    check(program)


def test_chainer_backward_with_grad_outputs():
    def program():
        x = chainer.Variable(np.array([0.5, -1.0, 2.0]))
        y = F.sin(x) * x
        chainer.backward([y, y], [chainer.Variable(np.ones(3)), chainer.Variable(np.full(3, 2.0))])
        return x.grad
    check(program)


def test_chainer_grad():
    def program():
        x, w, h, a, b, y = shared_graph()
        return chainer.grad([y], [x, w, h, b])
    check(program)


def test_chainer_grad_of_an_output_given_twice():
    # Chainer sets each output's gradient in its table, so the last one
    # given counts, once; the adapter summed both before.
    def program():
        x = chainer.Variable(np.array([0.5, -1.0, 2.0]))
        y = F.sum(x * x)
        once = chainer.grad([y, y], [x])
        last = chainer.grad([y, y], [x], grad_outputs=[chainer.Variable(np.array(1.0)),
                                                       chainer.Variable(np.array(3.0))])
        return once + last
    check(program)


def test_chainer_grad_options():
    def program():
        x, w, h, a, b, y = shared_graph()
        z = F.sum(F.cos(h))
        gx, gw = chainer.grad([y, z], [x, w],
                              grad_outputs=[chainer.Variable(np.array(2.0)), None],
                              grad_inputs=[None, chainer.Variable(np.ones((3, 2)))],
                              set_grad=True, loss_scale=4.0)
        return [gx, gw, x.grad, w.grad]
    check(program)


def test_chainer_grad_retain_grad():
    def program():
        x, w, h, a, b, y = shared_graph()
        gx, = chainer.grad([y], [x], retain_grad=True)
        return [gx, h.grad_var, a.grad_var, b.grad_var]
    check(program)


def test_chainer_grad_of_an_unused_input_is_none():
    def program():
        x = chainer.Variable(np.array([1.0, 2.0]))
        unused = chainer.Variable(np.array([3.0]))
        return chainer.grad([F.sum(x * x)], [x, unused])
    ours = check(program)
    assert ours[1] is None


def test_chainer_grad_argument_errors_are_chainers():
    x = chainer.Variable(np.array([1.0]))
    with pyengine_chainer.installed():
        with pytest.raises(TypeError, match="outputs must be a tuple or a list"):
            chainer.grad(x, [x])
        with pytest.raises(ValueError, match="grad_outputs must be of the same length"):
            chainer.grad([x], [x], grad_outputs=[None, None])


def test_double_backprop():
    def program():
        x = chainer.Variable(np.array([0.5, -1.0, 2.0]))
        y = F.sum(x ** 3 + F.sin(x) * x)
        gx, = chainer.grad([y], [x], enable_double_backprop=True)
        ggx, = chainer.grad([F.sum(gx * gx)], [x])
        x.cleargrad()
        y2 = F.sum(F.tanh(x) * x)
        y2.backward(enable_double_backprop=True)
        g = x.grad_var
        x.cleargrad()
        F.sum(g * g).backward()
        return [gx, ggx, x.grad]
    ours = check(program, rtol=1e-12)
    x = np.array([0.5, -1.0, 2.0])
    first = 3 * x ** 2 + np.sin(x) + x * np.cos(x)
    np.testing.assert_allclose(ours[0].array, first)  # analytic
    second = 6 * x + 2 * np.cos(x) - x * np.sin(x)
    np.testing.assert_allclose(ours[1].array, 2 * first * second)


def test_forget_runs_a_reentrant_backward():
    def program():
        x = chainer.Variable(np.array([0.5, -1.0, 2.0]))
        w = chainer.Variable(np.array([1.5, 0.5, -0.25]))
        y = F.forget(lambda a, b: F.tanh(a * b) + a, x, w)
        F.sum(y * y).backward()
        return [x.grad, w.grad]
    check(program)


def test_lazy_grad_sum():
    def program():
        with chainer.using_config("lazy_grad_sum", True):
            x, w, h, a, b, y = shared_graph()
            y.backward()
            return [x.grad, w.grad]
    check(program)


class Recorder(chainer.FunctionHook):
    name = "recorder"

    def __init__(self):
        self.calls = []

    def backward_preprocess(self, function, in_data, out_grad):
        self.calls.append(("pre", function.label, tuple(g is None for g in out_grad)))

    def backward_postprocess(self, function, in_data, out_grad):
        self.calls.append(("post", function.label, tuple(g is None for g in out_grad)))


def test_function_hooks_see_every_backward():
    def program():
        recorder = Recorder()
        x, w, h, a, b, y = shared_graph()
        with recorder:
            y.backward()
        # Chainer's order is by rank, the engine's the reverse post-order:
        # the same calls, each function's pre before its post.
        pairs = sorted(recorder.calls)
        for k in range(0, len(recorder.calls), 2):
            assert recorder.calls[k][0] == "pre" and recorder.calls[k + 1][0] == "post"
            assert recorder.calls[k][1] == recorder.calls[k + 1][1]
        return [np.array([hash(call) for call in pairs]), x.grad]
    check(program)


def test_a_functions_local_hook():
    def program():
        recorder = Recorder()
        x = chainer.Variable(np.array([0.5, -1.0]))
        h = F.sin(x)
        h.creator_node.add_hook(recorder)
        F.sum(h * x).backward()
        return [np.array([c[0] == "pre" for c in recorder.calls]), x.grad]
    check(program)


def test_timer_hook_counts_the_same_functions():
    """TimerHook sees the same functions, forward ones made by backward
    formulas included; only the adds that sum gradients may be grouped
    otherwise (See the adapter's docstring)."""
    from chainer.function_hooks import TimerHook

    def program():
        hook = TimerHook()
        x, w, h, a, b, y = shared_graph()
        with hook:
            y.backward()
        return sorted(name for name, _ in hook.call_history if name not in ("Add", "MultiAdd"))
    native, ours = native_and_pyengine(program)
    assert native == ours
    assert "TanhGrad" in native


class WrongShape(chainer.FunctionNode):
    def forward(self, inputs):
        return inputs[0] * 2,

    def backward(self, indexes, grad_outputs):
        return chainer.Variable(np.ones(7)),


class WrongDtype(chainer.FunctionNode):
    def forward(self, inputs):
        return inputs[0] * 2,

    def backward(self, indexes, grad_outputs):
        return F.cast(grad_outputs[0], np.float32),


class IntegerGradient(chainer.FunctionNode):
    """An integer input whose gradient is an integer array (Chainer allows
    it where the input is of that dtype)."""

    def forward(self, inputs):
        return inputs[0].astype(np.float64) * 2,

    def backward(self, indexes, grad_outputs):
        return chainer.Variable((grad_outputs[0].array * 2).astype(np.int32)),


def chainer_error(program):
    """The type and message of the error ``program`` raises, natively and
    with the adapter."""
    errors = []
    for use in (False, True):
        with (pyengine_chainer.installed() if use else _nothing()):
            with pytest.raises(Exception) as info:
                program()
        errors.append((type(info.value), str(info.value).split("\n")[0]))
    return errors


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


@pytest.mark.parametrize("function", [WrongShape, WrongDtype])
def test_a_bad_gradient_raises_chainers_error(function):
    def program():
        x = chainer.Variable(np.ones(3))
        F.sum(function().apply((x,))[0]).backward()
    native, ours = chainer_error(program)
    assert native == ours
    assert native[0] in (TypeError, ValueError)


def test_integer_gradients_are_allowed():
    def program():
        x = chainer.Variable(np.array([1, 2, 3], np.int32))
        y, = IntegerGradient().apply((x,))
        F.sum(y * y).backward()
        return x.grad
    ours = check(program)
    assert ours.dtype == np.int32
    np.testing.assert_array_equal(ours, [8, 16, 24])  # d(4x^2)/dx, truncated to int


def test_debug_mode_detects_nan_as_chainer_does():
    def program():
        with chainer.using_config("debug", True):
            x = chainer.Variable(np.array([0.0, 1.0]))
            F.sum(F.sqrt(x) * 0.0 + F.log(x)).backward()
    native, ours = chainer_error(program)
    assert native == ours
    assert "NaN is detected" in native[1] or native[0] is FloatingPointError


def test_debug_mode_checks_shapes():
    def program():
        with chainer.using_config("debug", True):
            x = chainer.Variable(np.ones(3))
            F.sum(WrongShape().apply((x,))[0]).backward()
    native, ours = chainer_error(program)
    assert native == ours


class AccumulatingSquare(chainer.FunctionNode):
    """x ** 2 with backward_accumulate: the gradient fused with the sum so
    far."""

    def forward(self, inputs):
        self.retain_inputs((0,))
        return inputs[0] ** 2,

    def backward_accumulate(self, target_input_indexes, grad_outputs, grad_inputs):
        x, = self.get_retained_inputs()
        gx = 2.0 * x * grad_outputs[0]
        return (gx if grad_inputs[0] is None else gx + grad_inputs[0]),


def test_backward_accumulate():
    def program():
        x = chainer.Variable(np.array([0.5, -1.0, 2.0]))
        x.grad = np.array([100.0, 200.0, 300.0])
        y = AccumulatingSquare().apply((x,))[0]
        z = AccumulatingSquare().apply((x * 3.0,))[0]
        F.sum(y + z + x).backward()
        return x.grad
    check(program)


def test_gradient_check_finite_differences():
    """Chainer's own finite-difference check passes on pyengine."""
    r = rng()
    x = r.uniform(-1, 1, (3, 4))
    w = r.uniform(-1, 1, (4, 2))
    gy = r.uniform(-1, 1, (3, 2))
    with pyengine_chainer.installed():
        gradient_check.check_backward(lambda a, b: F.tanh(F.matmul(a, b)), (x, w), gy,
                                      dtype=np.float64)
        gradient_check.check_double_backward(lambda a: F.sin(a) * a, x, np.ones_like(x),
                                             np.ones_like(x), dtype=np.float64)


def test_a_leaf_whose_variable_is_gone_gets_nothing():
    def program():
        x = chainer.Variable(np.array([1.0, 2.0]))
        w = chainer.Variable(np.array([3.0, 4.0]))
        y = F.sum(x * w)
        del w
        gc.collect()
        y.backward()
        return x.grad
    check(program)


def test_threads_run_backward_at_once():
    def program():
        results = [None] * 4
        errors = []

        def work(k):
            try:
                x = chainer.Variable(np.full(3, float(k + 1)))
                for _ in range(20):
                    x.cleargrad()
                    F.sum(F.sin(x) * x).backward()
                results[k] = x.grad
            except BaseException as error:  # pragma: no cover - reported below
                errors.append(error)
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        return results
    check(program)


def test_install_is_idempotent_and_uninstall_restores_everything():
    from pyengine.backends import backend_of
    before = backend_of(chainer.Variable(np.ones(1)))
    pyengine_chainer.install()
    pyengine_chainer.install()
    assert chainer._backprop._backprop_to_all is pyengine_chainer.backprop_to_all
    assert chainer.grad is pyengine_chainer.grad
    assert backend_of(chainer.Variable(np.ones(1))) is pyengine_chainer._BACKEND
    pyengine_chainer.uninstall()
    pyengine_chainer.uninstall()
    assert chainer._backprop._backprop_to_all is NATIVE_BACKPROP_TO_ALL
    assert backend_of(chainer.Variable(np.ones(1))) is before
    with pyengine_chainer.installed():
        with pyengine_chainer.installed():
            pass
        assert pyengine_chainer.is_installed()
    assert not pyengine_chainer.is_installed()


def test_anomaly_mode_names_the_function():
    x = chainer.Variable(np.ones(3))
    with pyengine_chainer.installed(), pyengine.detect_anomaly():
        with pytest.raises(Exception) as info:
            F.sum(WrongShape().apply((x,))[0]).backward()
    assert "WrongShape" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)


@pytest.mark.gpu
def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.zeros(1)
    except Exception:  # pragma: no cover - depends on the machine
        pytest.skip("cupy does not work here")

    def program():
        x = chainer.Variable(cupy.asarray(np.linspace(-1, 1, 6).reshape(2, 3)))
        w = chainer.Variable(cupy.asarray(np.arange(6.0).reshape(3, 2) / 5.0))
        y = F.sum(F.tanh(F.matmul(x, w)) * 2.0 + F.exp(x).sum())
        y.backward()
        return [cupy.asnumpy(x.grad), cupy.asnumpy(w.grad)]
    check(program, rtol=1e-12)


# -- Chainer's own tests ----------------------------------------------------------------------

CHAINER_TESTS = os.environ.get("PYENGINE_CHAINER_TESTS")

# Chainer 7.8.1's tests of its engine, and of functions whose backward
# formulas cover most of what the engine meets (several outputs, double
# backprop, integer inputs, forget's reentrant backward).
CHAINER_TEST_FILES = [
    "test_variable.py", "test_function_node.py", "test_function.py", "test_backprop.py",
    "test_backprop_utils.py", "function_hooks_tests/test_timer.py",
    *[f"functions_tests/{name}" for name in (
        "math_tests/test_basic_math.py", "math_tests/test_exponential.py",
        "math_tests/test_trigonometric.py", "math_tests/test_hyperbolic.py",
        "math_tests/test_matmul.py", "math_tests/test_sum.py", "math_tests/test_maximum.py",
        "math_tests/test_logsumexp.py", "math_tests/test_sqrt.py",
        "math_tests/test_linear_interpolate.py", "math_tests/test_einsum.py",
        "activation_tests/test_relu.py", "activation_tests/test_sigmoid.py",
        "activation_tests/test_tanh.py", "activation_tests/test_softmax.py",
        "activation_tests/test_log_softmax.py", "activation_tests/test_elu.py",
        "activation_tests/test_maxout.py", "array_tests/test_split_axis.py",
        "array_tests/test_reshape.py", "array_tests/test_concat.py",
        "array_tests/test_broadcast.py", "array_tests/test_transpose.py",
        "array_tests/test_stack.py", "array_tests/test_where.py", "array_tests/test_cast.py",
        "array_tests/test_separate.py", "connection_tests/test_linear.py",
        "connection_tests/test_embed_id.py", "connection_tests/test_bilinear.py",
        "loss_tests/test_softmax_cross_entropy.py", "loss_tests/test_mean_squared_error.py",
        "loss_tests/test_sigmoid_cross_entropy.py", "loss_tests/test_crf1d.py",
        "normalization_tests/test_layer_normalization.py", "util_tests/test_forget.py")],
]


def run_chainer_tests(install):
    """Chainer's tests in a child process, natively or with the adapter
    installed (the child then checks that its backward passes ran on
    pyengine): the ids of the failed tests and pytest's summary line."""
    script = textwrap.dedent("""
        import sys
        import pytest
        from pyengine.adapters import chainer as adapter

        install = sys.argv.pop(1) == "1"
        runs = [0]
        if install:
            adapter.install()
            original = adapter._item_of

            def counting(node):
                runs[0] += 1
                return original(node)

            adapter._item_of = counting
        status = pytest.main(sys.argv[1:])
        assert not install or runs[0] > 1000, runs[0]
        sys.exit(0 if status in (0, 1) else status)
    """)
    paths = [os.path.join(CHAINER_TESTS, name) for name in CHAINER_TEST_FILES]
    missing = [path for path in paths if not os.path.exists(path)]
    assert not missing, missing
    # Chainer's setup.cfg turns warnings into errors, which breaks chainer on
    # Python 3.11: its configuration is not read (-c os.devnull).
    result = subprocess.run(
        [sys.executable, "-c", script, "1" if install else "0", "-q", "-rfE",
         "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", os.path.dirname(CHAINER_TESTS),
         "-m", "not gpu and not cudnn and not slow", "-W", "ignore", *paths],
        capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    failed = {line.split(" ")[1] for line in result.stdout.splitlines()
              if line.startswith(("FAILED ", "ERROR "))}
    return failed, result.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.skipif(not CHAINER_TESTS, reason="PYENGINE_CHAINER_TESTS (the tests/chainer_tests "
                    "folder of Chainer 7.8.1's source: its sdist has none) is not set")
def test_chainers_own_tests():
    """Chainer's own tests fail with the adapter exactly where they fail
    natively (in this environment, only where they need iDeep or
    Intel64), and pass everywhere else."""
    native_failed, native_summary = run_chainer_tests(False)
    failed, summary = run_chainer_tests(True)
    assert failed == native_failed, (sorted(failed - native_failed),
                                     sorted(native_failed - failed))
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed > 3000, summary
    assert summary.split(" in ")[0] == native_summary.split(" in ")[0], (summary, native_summary)


def test_readme_swap_in():
    """The README's lines for Chainer run as they are."""
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Use it in Chainer"):]
    code = section[section.index("```python needs=chainer") + len("```python needs=chainer"):]
    code = code[:code.index("```")]
    namespace = {}
    try:
        exec(compile(code, "README.md", "exec"), namespace)
    finally:
        pyengine_chainer.uninstall()
