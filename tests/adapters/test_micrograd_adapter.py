"""pyengine as micrograd's backward engine: differential tests against
micrograd's own ``Value.backward`` on random expressions and on its
``nn.MLP``, and a chain too deep for micrograd's recursion.

The oracle is micrograd itself: each program builds the same graph twice
from one seed, once with micrograd's engine and once with the adapter
installed, and every Value's ``.grad`` must agree.
"""

from __future__ import annotations

import copy
import gc
import random
import sys

import pytest

micrograd = pytest.importorskip("micrograd")

from micrograd.engine import Value  # noqa: E402
from micrograd.nn import MLP  # noqa: E402

import pyengine  # noqa: E402
from pyengine import Edge, GradientFreeNode  # noqa: E402
from pyengine.adapters import micrograd as pyengine_micrograd  # noqa: E402


@pytest.fixture(autouse=True)
def adapter_left_as_found():
    yield
    installed = pyengine_micrograd.is_installed()
    pyengine_micrograd.uninstall()
    assert not installed, "the test left the adapter installed"


def run(program, on_pyengine):
    assert not pyengine_micrograd.is_installed()
    if not on_pyengine:
        return program()
    with pyengine_micrograd.installed():
        return program()


# -- random expressions ------------------------------------------------------------------------

UNARY = ["relu", "neg", "square", "cube", "inverse"]
BINARY = ["add", "mul", "sub", "div", "radd", "rmul", "rsub", "rtruediv"]


def random_expression(seed, num_leaves=4, num_ops=40):
    """A random DAG of micrograd ops over ``num_leaves`` leaves; the root
    sums a random subset of the values, so intermediates have several
    consumers. Returns ``(root, values)`` (every Value made, in order)."""
    rng = random.Random(seed)
    values = [Value(rng.uniform(0.5, 2.0) * rng.choice([-1, 1])) for _ in range(num_leaves)]
    for _ in range(num_ops):
        # Half the time a recent value (deeper graphs), else any.
        recent = values[max(0, len(values) - 1 - int(rng.expovariate(0.3)))]
        a = rng.choice([recent, rng.choice(values)])
        b = rng.choice(values)
        if rng.random() < 0.3:
            op = rng.choice(UNARY)
            if op == "relu":
                out = a.relu()
            elif op == "neg":
                out = -a
            elif op == "square":
                out = a ** 2
            elif op == "cube":
                out = a ** 3
            else:
                out = a ** -1 if abs(a.data) > 0.1 else a * 1.5
        else:
            op = rng.choice(BINARY)
            constant = rng.uniform(-2.0, 2.0)
            if op == "add":
                out = a + b
            elif op == "mul":
                out = a * b
            elif op == "sub":
                out = a - b
            elif op == "div":
                out = a / b if abs(b.data) > 0.1 else a * b
            elif op == "radd":
                out = constant + a
            elif op == "rmul":
                out = constant * a
            elif op == "rsub":
                out = constant - a
            else:
                out = constant / a if abs(a.data) > 0.1 else a + b
        if abs(out.data) > 1e6:  # keep the numbers tame
            out = out * 1e-6
        values.append(out)
    picked = rng.sample(values[num_leaves:], k=min(8, len(values) - num_leaves)) + [values[-1]]
    root = picked[0]
    for value in picked[1:]:
        root = root + value
    return root, values


def expression_program(seed, repeats=1):
    def program():
        root, values = random_expression(seed)
        result = []
        for _ in range(repeats):
            root.backward()
            result.append([value.grad for value in values] + [root.grad])
        return result

    return program


def consumers_at_most_two(seed):
    """Whether every Value of the expression has at most two consumers
    (then micrograd's sums and pyengine's are the same float sums)."""
    root, values = random_expression(seed)
    counts = {}
    stack, seen = [root], set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        for child in value._prev:
            counts[id(child)] = counts.get(id(child), 0) + 1
            stack.append(child)
    return max(counts.values(), default=0) <= 2


def assert_grads_match(native, ours, exact):
    assert len(native) == len(ours)
    for call, (native_grads, our_grads) in enumerate(zip(native, ours)):
        assert len(native_grads) == len(our_grads)
        for index, (expected, got) in enumerate(zip(native_grads, our_grads)):
            if exact:
                assert got == expected, (call, index, expected, got)
            else:
                assert got == pytest.approx(expected, rel=1e-12, abs=1e-12), (call, index)


@pytest.mark.parametrize("seed", range(40))
def test_random_expression(seed):
    native = run(expression_program(seed), on_pyengine=False)
    ours = run(expression_program(seed), on_pyengine=True)
    assert any(grad != 0 for grad in native[0])
    assert_grads_match(native, ours, exact=consumers_at_most_two(seed))


@pytest.mark.parametrize("seed", range(20))
def test_same_graph_bitwise(seed):
    """On one graph, micrograd's backward and pyengine's give the same
    floats, sums of many terms included: the closures run in micrograd's
    order (See Note [Owner graphs] in ``pyengine/_pure/owner_graph.py``).
    Two runs of one program make two graphs whose ``_prev`` sets may
    iterate differently (by address), so the tests above compare sums of
    three or more terms approximately."""
    root, values = random_expression(seed)
    graph, stack = {}, [root]  # every Value, the root's sums included
    while stack:
        value = stack.pop()
        if id(value) not in graph:
            graph[id(value)] = value
            stack.extend(value._prev)
    grads = []
    for on_pyengine in (False, True):
        for value in graph.values():
            value.grad = 0
        if on_pyengine:
            with pyengine_micrograd.installed():
                root.backward()
        else:
            root.backward()
        grads.append([value.grad for value in graph.values()])
    assert grads[0] == grads[1]
    assert any(grad != 0 for grad in grads[0])


@pytest.mark.parametrize("seed", range(5))
def test_repeated_backward_accumulates_as_micrograd(seed):
    """micrograd never clears .grad: every call adds, non-leaves included,
    and the root is reset to 1."""
    native = run(expression_program(seed, repeats=3), on_pyengine=False)
    ours = run(expression_program(seed, repeats=3), on_pyengine=True)
    assert native[0] != native[1]
    assert_grads_match(native, ours, exact=False)


def test_shared_subexpressions_and_squares():
    def program():
        a, b = Value(1.5), Value(-2.0)
        c = a * a  # one child twice
        d = c * b + c
        e = (d - a).relu() + d ** 2 + c / b
        e.backward()
        return [v.grad for v in (a, b, c, d, e)]

    native = run(program, on_pyengine=False)
    assert run(program, on_pyengine=True) == native
    # An analytic oracle too: e = (a^2 b + a^2 - a)+ + (a^2 b + a^2)^2 + a^2 / b.
    a, b = 1.5, -2.0
    d = a * a * b + a * a
    relu_on = (d - a) > 0
    de_da = (relu_on * (2 * a * b + 2 * a - 1)) + 2 * d * (2 * a * b + 2 * a) + 2 * a / b
    assert native[0] == pytest.approx(de_da)


@pytest.mark.parametrize("seed", range(5))
def test_graph_recorded_before_install(seed):
    """The graph is read at backward: where it was made does not matter."""
    native = run(expression_program(seed, repeats=2), on_pyengine=False)
    root, values = random_expression(seed)
    with pyengine_micrograd.installed():
        ours = []
        for _ in range(2):
            root.backward()
            ours.append([value.grad for value in values] + [root.grad])
    assert_grads_match(native, ours, exact=False)


@pytest.mark.parametrize("seed", range(3))
def test_deepcopy_of_a_graph_backpropagates_alike(seed):
    """A copied graph backpropagates as in micrograd (its closures are
    micrograd's originals, which still refer to the original Values)."""

    def program():
        root, values = random_expression(seed)
        root.backward()
        root_copy = copy.deepcopy(root)
        root_copy.backward()
        return [[value.grad for value in values] + [root.grad]]

    native = run(program, on_pyengine=False)
    assert_grads_match(native, run(program, on_pyengine=True), exact=False)


def test_leaf_backward():
    for on_pyengine in (False, True):
        def program():
            x = Value(3.0)
            x.backward()
            return x.grad

        assert run(program, on_pyengine) == 1


# -- micrograd's nn --------------------------------------------------------------------------------

def mlp_training(steps=3):
    """micrograd's README demo: an MLP, a squared loss, SGD steps."""

    def program():
        random.seed(1)
        model = MLP(3, [4, 4, 1])
        xs = [[2.0, 3.0, -1.0], [3.0, -1.0, 0.5], [0.5, 1.0, 1.0], [1.0, 1.0, -1.0]]
        ys = [1.0, -1.0, -1.0, 1.0]
        history = []
        for _ in range(steps):
            predictions = [model(x) for x in xs]
            loss = sum((p - y) ** 2 for y, p in zip(ys, predictions))
            model.zero_grad()
            loss.backward()
            history.append((loss.data, [p.grad for p in model.parameters()]))
            for p in model.parameters():
                p.data -= 0.05 * p.grad
        return history, [p.data for p in model.parameters()]

    return program


def test_mlp_training_steps():
    native_history, native_params = run(mlp_training(), on_pyengine=False)
    history, params = run(mlp_training(), on_pyengine=True)
    assert [loss for loss, _ in history] == pytest.approx([loss for loss, _ in native_history], rel=1e-12)
    for (_, grads), (_, native_grads) in zip(history, native_history):
        assert grads == pytest.approx(native_grads, rel=1e-12, abs=1e-15)
    assert params == pytest.approx(native_params, rel=1e-12, abs=1e-15)
    assert native_history[-1][0] < native_history[0][0]  # it trains


# -- depth -----------------------------------------------------------------------------------------

def relu_chain(depth):
    x = Value(0.5)
    y = x
    for _ in range(depth):
        y = y.relu()
    return x, y


def test_deep_chain_fails_natively_and_works_on_pyengine():
    depth = 3 * sys.getrecursionlimit()
    x, y = relu_chain(depth)
    with pytest.raises(RecursionError):
        y.backward()
    x, y = relu_chain(depth)
    with pyengine_micrograd.installed():
        x2, y2 = relu_chain(depth)
        y2.backward()
        y.backward()  # recorded before install()
    assert x2.grad == 1 and x.grad == 1


@pytest.mark.slow
def test_million_deep_chain():
    """1,000,000 ReLUs: micrograd's recursive topological sort cannot; the
    gradient is exactly 1."""
    gc.collect()
    gc.disable()  # micrograd's graphs are cyclic; a growing chain makes every GC pass slower
    try:
        with pyengine_micrograd.installed():
            x, y = relu_chain(1_000_000)
            y.backward()
            assert x.grad == 1
            y.backward()
            # micrograd adds into every .grad, non-leaves' too: the Value k
            # levels below the root now holds g(k) = 1 + g(k - 1), g(0) = 1.
            assert x.grad == 1_000_001
            del y
    finally:
        gc.enable()
        gc.collect()


# -- install / uninstall ---------------------------------------------------------------------------

def test_uninstall_restores_micrograd_exactly_and_install_is_idempotent():
    before = dict(vars(Value))
    pyengine_micrograd.install()
    patched = vars(Value)["backward"]
    assert patched is not before["backward"]
    assert {name: value for name, value in vars(Value).items() if name != "backward"} == {
        name: value for name, value in before.items() if name != "backward"}
    pyengine_micrograd.install()
    assert vars(Value)["backward"] is patched
    pyengine_micrograd.uninstall()
    after = dict(vars(Value))
    assert after.keys() == before.keys()
    assert all(after[name] is value for name, value in before.items())
    pyengine_micrograd.uninstall()


def test_install_refuses_a_micrograd_without_the_patched_methods(monkeypatch):
    monkeypatch.delattr(Value, "backward")
    with pytest.raises(RuntimeError, match="has no backward; this micrograd version"):
        pyengine_micrograd.install()
    assert not pyengine_micrograd.is_installed()
    assert "backward" not in vars(Value)


def test_context_manager_restores_on_error():
    before = dict(vars(Value))
    with pytest.raises(ZeroDivisionError):
        with pyengine_micrograd.installed():
            with pyengine_micrograd.installed():
                pass
            assert pyengine_micrograd.is_installed()
            1 / 0  # noqa: B018
    assert not pyengine_micrograd.is_installed()
    assert dict(vars(Value)) == before


def test_node_of_translates_the_graph():
    """node_of and edge_of make a new translation each call: one
    GradientFreeNode per non-leaf Value, its edges to the distinct non-leaf
    children in ``_prev`` order, children made first."""
    a, b = Value(1.0), Value(2.0)
    c = a * b
    d = c * c
    e = d + c
    assert pyengine_micrograd.node_of(a) is None and pyengine_micrograd.edge_of(a) is None
    edge = pyengine_micrograd.edge_of(e)
    node = edge.node
    assert type(node) is GradientFreeNode and edge.input_nr == 0
    assert node.owner is e and node.method == "_backward"
    children = {edge.node.owner: edge.node for edge in node.next_edges}
    assert [edge.node.owner for edge in node.next_edges] == [v for v in e._prev if v._prev]
    assert children.keys() == {c, d}
    assert children[d].next_edges == (Edge(children[c], 0),) or (
        [next_edge.node for next_edge in children[d].next_edges] == [children[c]])
    assert children[c].next_edges == ()  # both children are leaves
    assert children[c].sequence_nr < children[d].sequence_nr < node.sequence_nr
    assert pyengine_micrograd.node_of(e) is not node
    with pytest.raises(TypeError, match="expected a micrograd Value"):
        pyengine_micrograd.node_of(1.0)
    with pytest.raises(TypeError, match="expected a micrograd Value"):
        pyengine_micrograd.edge_of("c")


def test_forward_is_micrograds_own():
    """The adapter adds nothing to a forward: the same attributes on each
    Value, and the same GC-tracked objects, counted two ways (the objects
    the GC tracks, which each full collection visits, and the GC's
    allocation counter, which brings the next collection closer). A
    backward on the compiled core makes no object per Value either; the
    pure twin runs the translation (See Note [Owner graphs] in
    ``pyengine/_pure/owner_graph.py``)."""

    def count(install):
        random.seed(3)
        model = MLP(2, [8, 8, 1])
        points = [[random.uniform(-1, 1), random.uniform(-1, 1)] for _ in range(5)]
        if install:
            pyengine_micrograd.install()
        try:
            sum(model(point) ** 2 for point in points).backward()  # warm up; garbage now
            gc.collect()
            enabled = gc.isenabled()
            gc.disable()
            try:
                allocations = gc.get_count()[0]
                tracked = len(gc.get_objects())
                loss = sum(model(point) ** 2 for point in points)
                forward = (len(gc.get_objects()) - tracked, gc.get_count()[0] - allocations)
                allocations = gc.get_count()[0]
                loss.backward()
                backward_allocations = gc.get_count()[0] - allocations
            finally:
                if enabled:
                    gc.enable()
        finally:
            pyengine_micrograd.uninstall()
        return forward, backward_allocations, sorted(vars(loss))

    native_forward, native_backward, native_attributes = count(False)
    forward, backward, attributes = count(True)
    assert forward == native_forward and native_forward[0] > 3000
    assert attributes == native_attributes
    if pyengine.IMPLEMENTATION == "compiled":
        # A graph task and a list: none per Value, as micrograd's own sort
        # (a list, a set, a closure).
        assert backward <= native_backward + 3, (backward, native_backward)


def test_errors_in_closures_reach_the_caller():
    with pyengine_micrograd.installed():
        x = Value(2.0)
        y = x * 3.0
        z = y + 1.0

        def broken():
            raise ArithmeticError("closure failed")

        y._backward = broken
        with pytest.raises(ArithmeticError, match="closure failed"):
            z.backward()
        y._backward = lambda: None
        z.backward()  # the engine still works
        assert y.grad == 2  # two calls added into it
