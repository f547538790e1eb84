"""pyengine as HIPS autograd's backward engine: differential tests against
autograd's own ``backward_pass`` on the same programs.

The oracle is autograd itself: each program runs natively and then with the
adapter installed, and the results must agree in value and in type,
container structure included. Where three or more gradients meet at a node
the two engines add them in different orders, so values are compared to a
few ulps. The slow test at the end runs autograd's own test suite against
the installed adapter, where ``PYENGINE_AUTOGRAD_TESTS`` names its
``tests`` folder (``.ci/frameworks`` sets it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import numpy as onp
import pytest

autograd = pytest.importorskip("autograd")

import autograd.numpy as np  # noqa: E402
from autograd import checkpoint, elementwise_grad, grad, hessian, jacobian, make_vjp  # noqa: E402
from autograd.builtins import NamedTupleVSpace, SequenceBox  # noqa: E402
from autograd.extend import Box, defvjp, primitive  # noqa: E402
from autograd.misc.fixed_points import fixed_point  # noqa: E402

import pyengine  # noqa: E402
from pyengine import backends  # noqa: E402
from pyengine.adapters import autograd as pyengine_autograd  # noqa: E402

NATIVE_BACKWARD_PASS = autograd.core.backward_pass  # autograd.core: imported by autograd


@pytest.fixture(autouse=True)
def adapter_left_as_found():
    yield
    installed = pyengine_autograd.is_installed()
    pyengine_autograd.uninstall()
    assert not installed, "the test left the adapter installed"
    assert autograd.core.backward_pass is NATIVE_BACKWARD_PASS


def native_and_pyengine(program):
    """``program()`` natively, then with the adapter installed."""
    assert not pyengine_autograd.is_installed()
    native = program()
    with pyengine_autograd.installed():
        assert autograd.core.backward_pass is pyengine_autograd.backward_pass
        ours = program()
    return native, ours


def assert_same(native, ours, rtol=1e-13):
    """The same value: the same types and container structure, equal numbers
    (to ``rtol``)."""
    assert type(ours) is type(native), (type(native), type(ours))
    if isinstance(native, (tuple, list)):
        assert len(ours) == len(native)
        for a, b in zip(native, ours):
            assert_same(a, b, rtol)
    elif isinstance(native, dict):
        assert list(ours) == list(native)
        for key in native:
            assert_same(native[key], ours[key], rtol)
    else:
        assert onp.shape(ours) == onp.shape(native)
        assert onp.result_type(ours) == onp.result_type(native)
        onp.testing.assert_allclose(ours, native, rtol=rtol, atol=1e-300)


def check(program, rtol=1e-13):
    native, ours = native_and_pyengine(program)
    assert_same(native, ours, rtol)
    return ours


X = onp.linspace(-0.9, 1.3, 6)
M = onp.arange(12.0).reshape(3, 4) / 7.0 - 0.5


def mlp_loss(weights):
    w1, b1, w2 = weights
    hidden = np.tanh(np.dot(M.T, w1) + b1)
    return np.sum(np.dot(hidden, w2) ** 2)


SCALAR_FUNCTIONS = {
    "sin_times_x": lambda x: np.sum(np.sin(x) * x),
    "shared_subexpression": lambda x: np.sum((np.exp(x) + x) * (np.exp(x) - 2.0 * x)),
    "broadcast": lambda x: np.sum(np.outer(x, x) + x[:, None] * 3.0 - x),
    "reductions": lambda x: np.mean(x ** 2) * np.max(np.abs(x)) + np.prod(x + 2.0),
    "matrix": lambda x: np.sum(np.dot(M, np.reshape(x[:4], (4, 1))) ** 3),
    "logsumexp_like": lambda x: np.log(np.sum(np.exp(x - np.max(x)))),
    "complex": lambda x: np.real(np.sum(np.exp(1j * x) * np.conj(x + 0.5j))),
}


@pytest.mark.parametrize("name", sorted(SCALAR_FUNCTIONS))
def test_grad(name):
    function = SCALAR_FUNCTIONS[name]
    check(lambda: grad(function)(X))


def test_grad_of_a_python_float_is_a_float():
    ours = check(lambda: grad(lambda x: x * x * 3.0 + np.sin(x))(0.75))
    assert type(ours) is float or isinstance(ours, onp.floating)


def test_grad_of_several_arguments():
    function = lambda a, b, c: np.sum(a * b + np.tanh(c) * a)  # noqa: E731
    check(lambda: grad(function, argnum=(0, 1, 2))(X, X[::-1], X * 2.0))


def test_elementwise_grad():
    check(lambda: elementwise_grad(lambda x: np.tanh(x) * np.exp(-x) + x ** 3)(X))


def test_jacobian():
    check(lambda: jacobian(lambda x: np.outer(np.sin(x), x[:3]))(X))


def test_hessian():
    check(lambda: hessian(lambda x: np.sum(np.sin(x) * x + x[0] * x ** 3))(X), rtol=1e-12)


def test_mlp_gradient_with_a_list_of_weights():
    rng = onp.random.default_rng(0)
    weights = [rng.normal(size=(3, 5)), rng.normal(size=5), rng.normal(size=5)]
    check(lambda: grad(mlp_loss)(weights))


def test_third_order_derivatives():
    function = lambda x: np.sin(x) * np.exp(0.3 * x) + x ** 4  # noqa: E731
    for x in (0.3, -1.7):
        ours = check(lambda x=x: grad(grad(grad(function)))(x), rtol=1e-12)
        exact = (  # d3/dx3 by hand
            onp.exp(0.3 * x) * (-onp.cos(x) - 0.9 * onp.sin(x) + 0.27 * onp.cos(x)
                                + 0.027 * onp.sin(x))
            + 24 * x)
        onp.testing.assert_allclose(ours, exact, rtol=1e-12)


def test_third_order_elementwise():
    check(lambda: elementwise_grad(elementwise_grad(elementwise_grad(np.tanh)))(X), rtol=1e-12)


TERMS = [lambda x: x * onp.linspace(1.0, 2.0, 6), lambda x: x * onp.linspace(-1.0, 0.5, 6),
         lambda x: np.sin(x) * x, lambda x: np.exp(x) * 0.5]


def terms_in_order(order):
    # Each term summed on its own: the gradient reaching a linear term is
    # then a plain array, so its vjp returns one, while a nonlinear term's
    # returns a Box of the outer trace.
    return lambda x: sum((np.sum(TERMS[k](x)) for k in order[1:]), np.sum(TERMS[order[0]](x)))


ORDERS = ([0, 1, 2, 3], [2, 0, 1, 3], [3, 2, 1, 0], [0, 2, 1, 3], [1, 0, 3, 2])


def test_hessian_where_arrays_and_boxes_meet_at_one_node():
    """Under a hessian, some vjps return plain arrays (they read no boxed
    value) and others Boxes of the outer trace; at a node reached by both,
    an array sum may be added to a Box, or a Box to an array sum the
    engine owns (in place, as autograd's ``mut_add``). Every order of the
    terms, each with three or more gradients meeting."""
    for order in ORDERS:
        function = terms_in_order(order)
        check(lambda function=function: hessian(function)(X), rtol=1e-12)
        check(lambda function=function: grad(grad(lambda x: function(x) * x))(0.3), rtol=1e-12)


def test_mixed_sums_go_through_autograds_add(monkeypatch):
    """The case numpy's backend cannot do (a Box added in place to a numpy
    sum the engine owns: a Box refuses ``out=``) happens above, and goes
    through autograd's vspace ``mut_add``."""
    calls = []
    def spy_on(name):
        original = getattr(pyengine_autograd, name)

        def spy(a, b):
            calls.append((name, type(a).__name__, type(b).__name__))
            return original(a, b)
        monkeypatch.setattr(pyengine_autograd, name, spy)

    spy_on("_add")
    spy_on("_mut_add")
    with pyengine_autograd.installed():
        for order in ORDERS:
            hessian(terms_in_order(order))(X)
    assert ("_mut_add", "ndarray", "ArrayBox") in calls


# -- containers -------------------------------------------------------------------------------

def test_tuple_gradients():
    check(lambda: grad(lambda t: np.sum(t[0] * t[1]) + np.sum(t[0] ** 2))((X, X + 1.0)))


def test_list_gradients():
    check(lambda: grad(lambda xs: xs[0] * xs[1] + xs[2] * xs[0] + xs[1])([1.5, -2.0, 0.5]))


def test_dict_gradients():
    def function(d):
        return np.sum(d["w"] * d["x"]) + np.sum(np.tanh(d["w"])) * d["s"]

    check(lambda: grad(function)({"w": X, "x": X ** 2, "s": 0.25}))


def test_nested_container_gradients():
    def function(params):
        (a, b), rest = params
        return np.sum(a * b) + rest["c"][0] * rest["c"][1] + np.sum(a) * rest["c"][1]

    check(lambda: grad(function)(((X, X * 2.0), {"c": [1.5, -0.5]})))


def test_namedtuple_gradients_from_numpy():
    # slogdet returns a namedtuple; taking its fields twice sums two sparse
    # gradients into one namedtuple gradient.
    def function(a):
        result = np.linalg.slogdet(a)
        return result[1] + 2.0 * result[1] + result[0]

    a = onp.eye(3) + 0.1 * onp.arange(9.0).reshape(3, 3)
    check(lambda: grad(function)(a))
    check(lambda: grad(lambda a: np.sum(np.linalg.eigh(a)[0] ** 2)
                       + np.sum(np.linalg.eigh(a)[1][:, 0]))(a + a.T))


Pair = namedtuple("Pair", "first second")


@primitive
def make_pair(x):
    return Pair(x, 2.0 * x)


@primitive
def pair_product(pair):
    return pair.first * pair.second


@primitive
def pair_sum(pair):
    return pair.first + pair.second


def test_namedtuple_gradients_summed_whole():
    """A namedtuple gradient (not from indexing) reaching one node twice is
    summed by its vspace; its vspace is registered after the adapter is
    installed, so the backend registry learns of it at the next backward."""
    class PairVSpace(NamedTupleVSpace):
        seq_type = Pair

    PairVSpace.register(Pair)
    SequenceBox.register(Pair)
    defvjp(make_pair, lambda ans, x: lambda g: g.first + 2.0 * g.second)
    defvjp(pair_product, lambda ans, p: lambda g: Pair(g * p.second, g * p.first))
    defvjp(pair_sum, lambda ans, p: lambda g: Pair(g, g))
    try:
        def function(x):
            pair = make_pair(x)
            return np.sum(pair_product(pair) + pair_sum(pair) * 3.0 + pair_product(pair))

        with pyengine_autograd.installed():
            assert backends.backend_of(Pair(1.0, 2.0)) is not None  # a tuple's
        check(lambda: grad(function)(X))
    finally:
        del autograd.core.VSpace.mappings[Pair]
        del Box.type_mappings[Pair]


# -- sparse gradients -------------------------------------------------------------------------

def test_one_sparse_gradient_is_made_dense():
    check(lambda: grad(lambda x: x[2] * 3.0)(X))


def test_sparse_gradients_summed():
    check(lambda: grad(lambda x: x[0] * x[1] + np.sum(x[1:4] ** 2) + np.sum(x[[0, 0, 5]]))(X))


def test_sparse_after_dense_and_dense_after_sparse():
    check(lambda: grad(lambda x: np.sum(x * 2.0) + x[3] + np.sum(np.sin(x)) + x[3] * x[0])(X))
    check(lambda: grad(lambda x: x[3] + np.sum(x * 2.0) + x[1])(X))


def test_sparse_gradients_under_a_hessian():
    check(lambda: hessian(lambda x: x[0] * x[1] ** 2 + np.sum(x[2:] ** 3) + x[1] * x[5])(X),
          rtol=1e-12)


# -- reentrant vjps -------------------------------------------------------------------------

def test_checkpoint():
    @checkpoint
    def block(x):
        return np.tanh(np.sin(x) * x + 1.0)

    check(lambda: grad(lambda x: np.sum(block(block(x)) * x))(X))


def test_fixed_point():
    # x* = sqrt(a) as the fixed point of Newton's iteration.
    def newton(a):
        return lambda x: 0.5 * (x + a / x)

    def distance(x, y):
        return np.abs(x - y)

    def root(a):
        return fixed_point(newton, a, 1.0, distance, 1e-12)

    ours = check(lambda: grad(root)(2.0), rtol=1e-10)
    onp.testing.assert_allclose(ours, 0.5 / onp.sqrt(2.0), rtol=1e-8)


def test_odeint():
    scipy_integrate = pytest.importorskip("autograd.scipy.integrate")
    times = np.linspace(0.0, 1.0, 5)

    def decay(y, t, k):
        return -k * y + np.sin(t)

    def loss(y0, args):
        ys = scipy_integrate.odeint(decay, y0, times, args, rtol=1e-10, atol=1e-10)
        return np.sum(ys ** 2)

    y0, args = onp.array([1.0, 2.0]), (onp.array([0.7]),)
    gradient_y0, (gradient_k,) = check(lambda: grad(loss, argnum=(0, 1))(y0, args), rtol=1e-8)
    step = 1e-6
    central = (loss(y0, (args[0] + step,)) - loss(y0, (args[0] - step,))) / (2 * step)
    onp.testing.assert_allclose(gradient_k, [central], rtol=1e-5)
    central = (loss(y0 + [step, 0.0], args) - loss(y0 - [step, 0.0], args)) / (2 * step)
    onp.testing.assert_allclose(gradient_y0[0], central, rtol=1e-5)


# -- the engine runs it ----------------------------------------------------------------------

@primitive
def marked(x):
    return x * 1.0


def test_vjps_run_inside_a_pyengine_graph_task():
    """queue_callback needs a running graph task: inside a vjp it works on
    pyengine and fails natively; the callback runs when backward ends."""
    ran = []

    def vjp_maker(ans, x):
        def vjp(g):
            pyengine.queue_callback(lambda: ran.append(len(ran)))
            return g * 2.0
        return vjp

    defvjp(marked, vjp_maker)
    function = lambda x: np.sum(marked(x) ** 2)  # noqa: E731
    with pytest.raises(RuntimeError):
        grad(function)(X)
    with pyengine_autograd.installed():
        onp.testing.assert_allclose(grad(function)(X), 4.0 * X)
    assert ran == [0]


def test_backward_passes_on_several_threads_at_once():
    """Each thread's result is its own (the traces are made first: autograd's
    tracing is not thread-safe, its backward passes are)."""
    import threading

    functions = [lambda x, k=k: np.sum(np.sin(x * (k + 1)) * x[k]) for k in range(4)]
    vjps = [make_vjp(function)(X)[0] for function in functions]
    expected = [vjp(1.0) for vjp in vjps]
    results, errors = {}, []

    def work(k):
        try:
            results[k] = [vjps[k](1.0) for _ in range(50)]
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    with pyengine_autograd.installed():
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors
    for k in range(4):
        for result in results[k]:
            assert_same(expected[k], result)


def test_deep_graph_beyond_the_recursion_limit():
    depth = 3 * sys.getrecursionlimit()

    def function(x):
        for _ in range(depth):
            x = np.sin(x) * 0.5 + x
        return np.sum(x)

    check(lambda: grad(function)(X[:2]))


def test_output_independent_of_the_input_and_identity():
    with pytest.warns(UserWarning):
        check(lambda: grad(lambda x: 3.0)(1.0))
    check(lambda: grad(lambda x: x)(2.5))
    check(lambda: make_vjp(lambda x: x)(X)[0](X * 3.0))


def test_a_vjps_error_reaches_the_caller_unchanged():
    @primitive
    def broken(x):
        return x

    def vjp_maker(ans, x):
        def vjp(g):
            raise ZeroDivisionError("broken vjp")
        return vjp

    defvjp(broken, vjp_maker)
    with pyengine_autograd.installed():
        with pytest.raises(ZeroDivisionError, match="broken vjp"):
            grad(lambda x: np.sum(broken(x) * 2.0))(X)
        assert pyengine_autograd._results.stack == []
        # The next backward is unaffected.
        onp.testing.assert_allclose(grad(lambda x: np.sum(x * 2.0))(X), 2.0)


def test_a_vjp_returning_too_few_gradients_is_an_error():
    @primitive
    def two_inputs(x, y):
        return x * y

    defvjp(two_inputs, lambda ans, x, y: lambda g: g * y,
           lambda ans, x, y: lambda g: g * x)
    # A vjp maker that forgets one parent: autograd's zip would drop it.
    autograd.core.primitive_vjps[two_inputs] = lambda argnums, *args: lambda g: (g,)
    with pyengine_autograd.installed():
        with pytest.raises(RuntimeError, match="returned 1 gradients; expected 2"):
            grad(lambda x: np.sum(two_inputs(x, x)))(X)


# -- install, uninstall -----------------------------------------------------------------------

def test_install_and_uninstall_are_idempotent_and_restore_everything():
    numpy_backend = backends.backend_of(onp.zeros(1))
    scalar_backend = backends.backend_of(onp.float64(1.0))
    assert backends.backend_of((1.0,)) is None
    pyengine_autograd.install()
    pyengine_autograd.install()
    assert pyengine_autograd.is_installed()
    assert autograd.core.backward_pass is pyengine_autograd.backward_pass
    assert isinstance(backends.backend_of(onp.zeros(1)), pyengine_autograd.AutogradNumpyBackend)
    # It is numpy's own for two numpy arrays: the fast paths stay on (See
    # Note [Replacing the numpy backend]).
    assert backends.numpy_backend_is_builtin
    for value in ((1.0,), [1.0], {"a": 1.0}, 1.0, 1j):
        assert isinstance(backends.backend_of(value), pyengine_autograd.AutogradBackend)
    pyengine_autograd.uninstall()
    pyengine_autograd.uninstall()
    assert not pyengine_autograd.is_installed()
    assert autograd.core.backward_pass is NATIVE_BACKWARD_PASS
    assert backends.backend_of(onp.zeros(1)) is numpy_backend
    assert backends.numpy_backend_is_builtin
    assert backends.backend_of(onp.float64(1.0)) is scalar_backend
    for value in ((1.0,), [1.0], {"a": 1.0}, 1.0, 1j):
        assert backends.backend_of(value) is None


def test_numpy_fast_paths_step_aside_when_the_wrapped_backend_is_not_numpys():
    class Counting(backends.NumpyBackend):
        sums = 0

        def add(self, a, b):
            Counting.sums += 1
            return super().add(a, b)

    previous = pyengine.register_backend(onp.ndarray, Counting())
    try:
        assert not backends.numpy_backend_is_builtin
        with pyengine_autograd.installed():
            assert not backends.numpy_backend_is_builtin
            # x + x + x: the second gradient into x is a sum of two numpy
            # arrays, which must reach the user's backend.
            got = grad(lambda x: np.sum(x + x + x))(X)
        assert Counting.sums >= 1
        onp.testing.assert_allclose(got, onp.full_like(X, 3.0))
    finally:
        pyengine.unregister_backend(onp.ndarray)
        if previous is not None:
            pyengine.register_backend(onp.ndarray, previous)
    assert backends.numpy_backend_is_builtin


def test_installed_restores_the_previous_state():
    with pyengine_autograd.installed():
        assert pyengine_autograd.is_installed()
        with pyengine_autograd.installed():
            assert pyengine_autograd.is_installed()
        assert pyengine_autograd.is_installed()
    assert not pyengine_autograd.is_installed()
    pyengine_autograd.install()
    with pyengine_autograd.installed():
        pass
    assert pyengine_autograd.is_installed()
    pyengine_autograd.uninstall()


def test_uninstall_keeps_a_backend_registered_over_the_adapters():
    class Other(pyengine.ArrayBackend):
        pass

    other = Other()
    pyengine_autograd.install()
    pyengine.register_backend(tuple, other)
    try:
        pyengine_autograd.uninstall()
        assert backends.backend_of((1.0,)) is other
    finally:
        pyengine.unregister_backend(tuple)


def test_uninstall_restores_native_results():
    function = lambda x: np.sum(np.sin(x) * x + x[0])  # noqa: E731
    before = grad(function)(X)
    with pyengine_autograd.installed():
        grad(function)(X)
    assert autograd.core.backward_pass is NATIVE_BACKWARD_PASS
    assert_same(before, grad(function)(X), rtol=0)


def test_the_backend_sums_as_autograd_sums():
    backend = pyengine_autograd.AutogradBackend()
    assert backend.add((1.0, [2.0]), (0.5, [1.0])) == (1.5, [3.0])
    assert backend.add({"a": 1.0}, {"a": 2.0}) == {"a": 3.0}
    total = backend.add(onp.ones(2), onp.ones(2))
    assert backend.add_(total, onp.ones(2)) is total
    onp.testing.assert_array_equal(total, [3.0, 3.0])
    assert backend.has_nan((1.0, {"a": onp.array([0.0, onp.nan])}))
    assert not backend.has_nan([1.0, onp.zeros(2)])
    with pytest.raises(NotImplementedError, match="no metadata"):
        backend.cast(1.0, onp.float32)


# -- autograd's own test suite ----------------------------------------------------------------

AUTOGRAD_TESTS = os.environ.get("PYENGINE_AUTOGRAD_TESTS")


@pytest.mark.slow
@pytest.mark.skipif(not AUTOGRAD_TESTS, reason="PYENGINE_AUTOGRAD_TESTS (autograd's tests/ "
                    "folder, from its sdist) is not set")
def test_autograds_own_test_suite():
    """autograd 1.9.1's tests/ (less its timing tests), in a child process
    with the adapter installed; the child checks that its backward passes ran
    on pyengine."""
    script = textwrap.dedent("""
        import sys
        import pytest
        import autograd.core
        from pyengine.adapters import autograd as adapter

        adapter.install()
        runs = [0]
        original = adapter.backward_pass

        def counting(g, end_node):
            runs[0] += 1
            return original(g, end_node)

        autograd.core.backward_pass = counting
        status = pytest.main(sys.argv[1:])
        assert runs[0] > 1000, runs[0]
        sys.exit(status)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script, "-q", "-p", "no:cacheprovider", "-c", os.devnull,
         "--rootdir", AUTOGRAD_TESTS, AUTOGRAD_TESTS,
         "--ignore", os.path.join(AUTOGRAD_TESTS, "test_performance.py"),
         "--ignore", os.path.join(AUTOGRAD_TESTS, "_test_complexity.py")],
        capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert " passed" in result.stdout


def test_readme_swap_in(capsys):
    """The README's three lines for autograd run as they are and print what
    their comment says."""
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Use it in HIPS autograd"):]
    # The fence is ```python needs=autograd (tests/test_readme.py reads the word).
    start = section.index("\n", section.index("```python")) + 1
    code = section[start:section.index("```", start)]
    exec(code, {})
    assert not pyengine_autograd.is_installed()
    printed = capsys.readouterr().out.splitlines()
    assert printed == re.findall(r"print\(.*\)  # (.*)", code) == ["1.209464"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_installs_and_differentiates_while_a_thread_held_the_lock():
    # The adapter's lock, which a backward takes for a vspace type it has
    # not met, held by another thread at the fork: the child takes its own
    # (See Note [Locks after fork] in pyengine/node.py).
    from conftest import in_a_fork_while_held

    def in_child():
        pyengine_autograd.install()
        try:
            return float(grad(lambda x: 3.0 * x * x)(2.0)) == 12.0
        finally:
            pyengine_autograd.uninstall()

    assert in_a_fork_while_held(pyengine_autograd._lock, in_child) == 0
    assert in_child()
