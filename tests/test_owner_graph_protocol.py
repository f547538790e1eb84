"""The owner-graph protocol (``pyengine.OwnerGraph``; See Note [Owner graphs]
in ``pyengine/_pure/owner_graph.py``) in returns mode, its options, and the
two cores' walks side by side.

The framework under test is a tiny DeZero-like one written here: functions
(the owners) with one or two outputs (``Split``: two gradient slots, so its
consumers name it by a pair ``(function, output index)``) over numpy values,
whose leaves are the values themselves. Oracles:

- gradients: PyTorch on the same computation (random graphs: chains,
  diamonds, fan-in, multi-output functions), or analytic ones;
- the order: the translation of the same owner graph into pyengine Nodes,
  made in a recursive depth-first post-order and run by the engine's
  ``execute`` (its ready queue); both must run the owners in the same order
  and give the same gradients;
- the cross-core test: ``pyengine._owner_graph`` and
  ``pyengine._pure.owner_graph`` in one process give the same order,
  gradients, hook and visit logs, and errors.
"""

from __future__ import annotations

import gc
import importlib
import random
import sys
import threading
import weakref

import numpy as np
import pytest

import pyengine
from pyengine import Edge, Node
from pyengine._pure import owner_graph as pure_owner_graph
from pyengine._pure import state as pure_state

try:
    compiled_owner_graph = importlib.import_module("pyengine._owner_graph")
except ImportError:  # pragma: no cover - no compiled build
    compiled_owner_graph = None

# -- the framework -------------------------------------------------------------------------------


class Value:
    """A numpy value; ``creator``/``index``: the function and output that made it."""

    def __init__(self, data, creator=None, index=0):
        self.data = np.asarray(data, dtype=np.float64)
        self.creator = creator
        self.index = index
        self.grad = None


class Function:
    """An owner: ``inputs`` (Values), ``n_out`` gradient slots."""

    n_out = 1

    def __init__(self, *inputs, log=None):
        self.inputs = inputs
        self.log = log

    def outputs(self):
        data = self.forward(*(value.data for value in self.inputs))
        if self.n_out == 1:
            return Value(data, self, 0)
        return tuple(Value(item, self, i) for i, item in enumerate(data))

    def vjp(self, grads):
        if self.log is not None:
            self.log.append(("backward", type(self).__name__, id(self)))
        grads = [np.zeros_like(self.outputs_like()[i]) if grad is None else grad
                 for i, grad in enumerate(grads)]
        return list(self.backward(*grads))

    def outputs_like(self):
        data = self.forward(*(value.data for value in self.inputs))
        return [data] if self.n_out == 1 else list(data)


class Add(Function):
    def forward(self, a, b):
        return a + b

    def backward(self, grad):
        return grad, grad


class Mul(Function):
    def forward(self, a, b):
        return a * b

    def backward(self, grad):
        a, b = (value.data for value in self.inputs)
        return grad * b, grad * a


class Sin(Function):
    def forward(self, a):
        return np.sin(a)

    def backward(self, grad):
        return (grad * np.cos(self.inputs[0].data),)


class Split(Function):
    """Two outputs: 2a and a*a."""

    n_out = 2

    def forward(self, a):
        return 2 * a, a * a

    def backward(self, grad_double, grad_square):
        return (2 * grad_double + 2 * self.inputs[0].data * grad_square,)


def item_of(value):
    """A parent item: the leaf itself, or the pair naming its creator's slot."""
    return value if value.creator is None else (value.creator, value.index)


def parents(owner):
    return () if isinstance(owner, Value) else [item_of(value) for value in owner.inputs]


def num_inputs(owner):
    return 1 if isinstance(owner, Value) else owner.n_out


def backward(owner, grads):
    return owner.vjp(grads)


def make_graph(core=None, **options):
    module = pyengine if core is None else core
    return module.OwnerGraph(parents, backward, mode="returns", num_inputs=num_inputs, **options)


def random_program(seed, size=25):
    """A random computation over three leaves, as a list of (op, operand
    indices) over a growing list of values; the last value is the root."""
    rng = random.Random(seed)
    program, count = [], 3
    for _ in range(size):
        op = rng.choice(["add", "mul", "sin", "split"])
        recent = list(range(max(0, count - 6), count))
        if op in ("add", "mul"):
            operands = (rng.choice(recent), rng.choice(range(count)))
            count += 1
        elif op == "sin":
            operands = (rng.choice(recent),)
            count += 1
        else:
            operands = (rng.choice(recent),)
            count += 2
        program.append((op, operands))
    return program


LEAF_DATA = [np.array([0.3, -1.2, 0.7]), np.array([1.1, 0.4, -0.5]), np.array([-0.8, 0.9, 0.2])]


def build(program, log=None):
    """Run ``program`` on our Values; return (leaves, values)."""
    leaves = [Value(data.copy()) for data in LEAF_DATA]
    values = list(leaves)
    for op, operands in program:
        inputs = [values[i] for i in operands]
        if op == "add":
            values.append(Add(*inputs, log=log).outputs())
        elif op == "mul":
            values.append(Mul(*inputs, log=log).outputs())
        elif op == "sin":
            values.append(Sin(*inputs, log=log).outputs())
        else:
            values.extend(Split(*inputs, log=log).outputs())
    return leaves, values


def torch_grads(torch, program, root_index=-1, inputs=None):
    leaves = [torch.tensor(data, requires_grad=True) for data in LEAF_DATA]
    values = list(leaves)
    for op, operands in program:
        args = [values[i] for i in operands]
        if op == "add":
            values.append(args[0] + args[1])
        elif op == "mul":
            values.append(args[0] * args[1])
        elif op == "sin":
            values.append(torch.sin(args[0]))
        else:
            values.extend([2 * args[0], args[0] * args[0]])
    root = values[root_index]
    targets = leaves if inputs is None else [values[i] for i in inputs]
    grads = torch.autograd.grad(root, targets, torch.ones(3, dtype=torch.float64),
                                allow_unused=True)
    return [None if grad is None else grad.numpy() for grad in grads]


# -- gradients against PyTorch --------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_graphs_against_torch(seed, torch):
    program = random_program(seed)
    leaves, values = build(program)
    make_graph().backward(item_of(values[-1]), np.ones(3))
    for leaf, expected in zip(leaves, torch_grads(torch, program)):
        if expected is None:
            assert leaf.grad is None
        else:
            np.testing.assert_allclose(leaf.grad, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", ["chain", "diamond", "fan_in", "split"])
def test_small_graphs_analytic(shape):
    x = Value([0.5, -1.0, 2.0])
    if shape == "chain":
        y = Sin(Sin(Sin(x).outputs()).outputs()).outputs()
        s1 = np.sin(x.data)
        s2 = np.sin(s1)
        expected = np.cos(s2) * np.cos(s1) * np.cos(x.data)
    elif shape == "diamond":
        a = Sin(x).outputs()
        y = Mul(Add(a, x).outputs(), Add(a, a).outputs()).outputs()
        # y = (sin x + x) * 2 sin x
        expected = (np.cos(x.data) + 1) * 2 * np.sin(x.data) + (np.sin(x.data) + x.data) * 2 * np.cos(x.data)
    elif shape == "fan_in":
        y = Add(Add(x, x).outputs(), Add(x, Mul(x, x).outputs()).outputs()).outputs()
        expected = 3 + 2 * x.data
    else:
        double, square = Split(x).outputs()
        y = Add(double, Mul(square, double).outputs()).outputs()
        # y = 2x + 2x^3
        expected = 2 + 6 * x.data ** 2
    make_graph().backward(item_of(y), np.ones(3))
    np.testing.assert_allclose(x.grad, expected, rtol=1e-12)


def test_grad_accumulates_over_calls_and_a_leaf_root():
    x = Value([1.0, 2.0, 3.0])
    y = Mul(x, x).outputs()
    graph = make_graph()
    graph.backward(item_of(y), np.ones(3))
    first = x.grad
    graph.backward(item_of(y), np.ones(3))  # the graph is never released
    np.testing.assert_array_equal(x.grad, 4 * x.data)
    np.testing.assert_array_equal(first, 2 * x.data)  # summed out of place
    leaf = Value([1.0, 1.0, 1.0])
    graph.backward(leaf, np.full(3, 5.0))
    np.testing.assert_array_equal(leaf.grad, np.full(3, 5.0))


def test_a_custom_accumulate_gets_each_leaf_once():
    got = []
    x, w = Value([1.0, 2.0, 3.0]), Value([2.0, 2.0, 2.0])
    y = Add(Mul(x, w).outputs(), Mul(x, x).outputs()).outputs()
    make_graph(accumulate=lambda leaf, grad: got.append((leaf, grad))).backward(item_of(y),
                                                                               np.ones(3))
    assert [leaf for leaf, _ in got].count(x) == 1 and len(got) == 2
    np.testing.assert_array_equal(dict((id(k), v) for k, v in got)[id(x)], w.data + 2 * x.data)
    assert x.grad is None  # only accumulate decides


# -- the order: the translation into Nodes, run by the engine --------------------------------------


def reference_post_order(root):
    """A recursive depth-first post-order over the items, leaves included."""
    order, seen = [], set()

    def visit(owner):
        seen.add(id(owner))
        for item in parents(owner):
            parent = item[0] if type(item) is tuple else item
            if id(parent) not in seen:
                visit(parent)
        order.append(owner)

    visit(root)
    return order


def run_translation(root_item, grad, log):
    """The owner graph as Nodes made in the post-order (so their sequence
    numbers increase along it), run by the engine's execute."""
    root = root_item[0] if type(root_item) is tuple else root_item
    node_of = {}

    class OwnerNode(Node):
        def __init__(self, owner, next_edges, slots):
            super().__init__(next_edges, [((3,), np.float64)] * slots)
            self.owner = owner

        def apply(self, grads):
            if isinstance(self.owner, Value):
                log.append(("leaf", id(self.owner)))
                self.owner.grad = grads[0] if self.owner.grad is None else self.owner.grad + grads[0]
                return []
            return backward(self.owner, grads)

    for owner in reference_post_order(root):
        next_edges = []
        for item in parents(owner):
            parent, input_nr = item if type(item) is tuple else (item, 0)
            next_edges.append(Edge(node_of[id(parent)], input_nr))
        node_of[id(owner)] = OwnerNode(owner, next_edges, num_inputs(owner))
    input_nr = root_item[1] if type(root_item) is tuple else 0
    pyengine.get_default_engine().execute([Edge(node_of[id(root)], input_nr)], [grad], False,
                                          False, True)


@pytest.mark.parametrize("seed", range(10))
def test_the_order_is_the_translations(seed):
    program = random_program(seed, size=40)
    walk_log, translation_log = [], []
    leaves, values = build(program, walk_log)

    def accumulate(leaf, grad):
        walk_log.append(("leaf", id(leaf)))
        pure_owner_graph.accumulate_grad(leaf, grad)

    make_graph(accumulate=accumulate).backward(item_of(values[-1]), np.ones(3))
    walk_grads = [leaf.grad for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    for value in values:
        if value.creator is not None:
            value.creator.log = translation_log
    run_translation(item_of(values[-1]), np.ones(3), translation_log)
    assert walk_log == translation_log
    assert len(walk_log) > 10
    for got, expected in zip(walk_grads, (leaf.grad for leaf in leaves)):
        np.testing.assert_array_equal(got, expected)


# -- visit and needs_no_gradient -------------------------------------------------------------------


def test_visit_runs_in_the_post_order_before_any_backward():
    log = []
    program = random_program(3)
    leaves, values = build(program, log)
    root = values[-1].creator
    make_graph(visit=lambda owner: log.append(("visit", id(owner)))).backward(
        item_of(values[-1]), np.ones(3))
    visits = [entry for entry in log if entry[0] == "visit"]
    assert log[:len(visits)] == visits
    assert visits == [("visit", id(owner)) for owner in reference_post_order(root)]


def test_needs_no_gradient_prunes_the_search():
    class Forbidden(Function):
        """Its parents must never be read: it needs no gradient."""

        @property
        def inputs(self):
            raise AssertionError("searched below a value that needs no gradient")

        @inputs.setter
        def inputs(self, value):
            pass

        def forward(self, *args):
            return np.ones(3)

    x, constant = Value([1.0, 2.0, 3.0]), Value([4.0, 5.0, 6.0])
    frozen = Value(np.ones(3), Forbidden(), 0)
    frozen.creator.frozen = True
    constant.frozen = True
    y = Add(Mul(x, constant).outputs(), Mul(x, frozen).outputs()).outputs()
    visited = []
    graph = make_graph(needs_no_gradient=lambda owner: getattr(owner, "frozen", False),
                       visit=visited.append)
    graph.backward(item_of(y), np.ones(3))
    np.testing.assert_array_equal(x.grad, constant.data + 1)
    assert constant.grad is None
    assert constant not in visited and frozen.creator not in visited and x in visited
    with pytest.raises(RuntimeError, match="the root .* needs no gradient"):
        graph.backward(constant, np.ones(3))


@pytest.mark.parametrize("first_answer", [True, False])
def test_needs_no_gradient_is_asked_once_per_owner(first_answer):
    # y = a*a + 2a through one Split, whose two slots are two items of the
    # Add. Its first answer holds for both: before, a predicate that changed
    # its mind gave the Split the gradient of an item it had refused.
    a = Value([1.0, 2.0, 3.0])
    split = Split(a)
    double, square = split.outputs()
    y = Add(square, double).outputs()
    asked = []

    def needs_no_gradient(owner):
        asked.append(owner)
        if owner is not split:
            return False
        return first_answer if asked.count(owner) == 1 else not first_answer

    make_graph(needs_no_gradient=needs_no_gradient).backward(item_of(y), np.ones(3))
    expected = [y.creator, split] if first_answer else [y.creator, split, a]
    assert [id(owner) for owner in asked] == [id(owner) for owner in expected]
    if first_answer:
        assert a.grad is None
    else:
        np.testing.assert_array_equal(a.grad, 2 + 2 * a.data)


# -- grad(inputs=) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_grad_inputs_against_torch(seed, torch):
    program = random_program(seed)
    leaves, values = build(program)
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(3, len(values) - 1), k=2)) + [0, 1]
    inputs = [item_of(values[i]) for i in chosen]
    got = make_graph().grad(item_of(values[-1]), np.ones(3), inputs, allow_unused=True)
    expected = torch_grads(torch, program, inputs=chosen)
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
        else:
            np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)
    assert all(leaf.grad is None for leaf in leaves)  # nothing accumulated


def test_grad_runs_only_what_leads_to_an_input_and_checks_unused():
    log = []
    x, w = Value([1.0, 2.0, 3.0]), Value([0.5, 0.5, 0.5])
    a = Sin(w, log=log).outputs()
    y = Add(Mul(x, x, log=log).outputs(), a).outputs()
    (gx,) = make_graph().grad(item_of(y), np.ones(3), [x])
    np.testing.assert_array_equal(gx, 2 * x.data)
    assert [entry[1] for entry in log] == ["Mul"]  # Sin leads to no input
    unused = Value([1.0])
    with pytest.raises(RuntimeError, match=r"inputs\[1\] \(a Value\) was not reached"):
        make_graph().grad(item_of(y), np.ones(3), [x, unused])
    assert make_graph().grad(item_of(y), np.ones(3), [x, unused], allow_unused=True)[1] is None
    with pytest.raises(TypeError, match="takes no gradient and no inputs"):
        pyengine.OwnerGraph(parents, backward).grad(item_of(y), None, [x])


# -- hooks, anomaly, profiler, callbacks, reentrant ---------------------------------------------


def test_hooks_see_and_replace_gradients():
    x = Value([1.0, 2.0, 3.0])
    y = Mul(x, Sin(x).outputs()).outputs()
    log = []

    def pre_hook(owner, grads):
        log.append(("pre", type(owner).__name__, [g.copy() for g in grads]))
        return [2 * g for g in grads] if isinstance(owner, Mul) else None

    def post_hook(owner, grad_inputs, grads):
        log.append(("post", type(owner).__name__, len(grad_inputs)))
        return None

    make_graph(pre_hook=pre_hook, post_hook=post_hook).backward(item_of(y), np.ones(3))
    assert [entry[:2] for entry in log] == [("pre", "Mul"), ("post", "Mul"), ("pre", "Sin"),
                                            ("post", "Sin")]
    np.testing.assert_array_equal(log[0][2][0], np.ones(3))
    expected = 2 * (np.sin(x.data) + x.data * np.cos(x.data))
    np.testing.assert_allclose(x.grad, expected, rtol=1e-12)

    x.grad = None
    make_graph(post_hook=lambda owner, grad_inputs, grads: [None] * len(grad_inputs)
               if isinstance(owner, Sin) else None).backward(item_of(y), np.ones(3))
    np.testing.assert_allclose(x.grad, np.sin(x.data), rtol=1e-12)
    with pytest.raises(RuntimeError, match="pre_hook of a Mul returned 2 values; expected None "
                                           "or a list of 1 gradients"):
        make_graph(pre_hook=lambda owner, grads: [1, 2]).backward(item_of(y), np.ones(3))


def test_writes_mode_hooks_get_empty_tuples_and_return_none():
    class W:
        def __init__(self, children, log):
            self.children, self.log = children, log

        def run(self):
            self.log.append("run")

    log = []
    root = W((W((), log),), log)
    pyengine.OwnerGraph("children", "run", pre_hook=lambda o, g: log.append(("pre", g)),
                        post_hook=lambda o, gi, g: log.append(("post", gi, g))).backward(root)
    assert log == [("pre", ()), "run", ("post", (), ())]
    with pytest.raises(TypeError, match="in mode='writes' hooks return None"):
        pyengine.OwnerGraph("children", "run", pre_hook=lambda o, g: [1]).backward(root)


def test_anomaly_mode_names_the_owner_and_checks_nan(no_anomaly_warning):
    class Failing(Function):
        def forward(self, a):
            return a

        def backward(self, grad):
            raise ValueError("backward failed")

    class Nan(Function):
        def forward(self, a):
            return a

        def backward(self, grad):
            return (grad * np.nan,)

    x = Value([1.0, 2.0, 3.0])
    with pyengine.detect_anomaly():
        with pytest.raises(ValueError, match="backward failed") as info:
            make_graph().backward(item_of(Failing(x).outputs()), np.ones(3))
        assert any("Error detected in the backward of a Failing" in note
                   for note in info.value.__notes__)
        with pytest.raises(RuntimeError, match="backward of a Nan returned nan values in its 0th"):
            make_graph().backward(item_of(Nan(x).outputs()), np.ones(3))
    with pytest.raises(ValueError) as info:
        make_graph().backward(item_of(Failing(x).outputs()), np.ones(3))
    assert not getattr(info.value, "__notes__", None)
    make_graph().backward(item_of(Nan(x).outputs()), np.ones(3))  # no check outside anomaly mode
    assert np.isnan(x.grad).all()


def test_profiler_events_one_per_owner_run():
    program = random_program(5)
    leaves, values = build(program)
    root = values[-1].creator
    post_order = reference_post_order(root)
    with pyengine.profile() as prof:
        make_graph().backward(item_of(values[-1]), np.ones(3))
    names = [event.name for event in prof.events]
    reached_leaves = [owner for owner in post_order if isinstance(owner, Value)]
    assert names.count("Value") == len(reached_leaves)
    assert len(names) == len(post_order)
    assert [event.sequence_nr for event in prof.events] == list(range(len(post_order)))[::-1]
    assert names == [type(owner).__name__ for owner in reversed(post_order)]


def test_queue_callback_and_grad_mode_inside():
    log = []

    class Recording(Function):
        def forward(self, a):
            return a

        def backward(self, grad):
            log.append(pyengine.is_grad_enabled())
            pyengine.queue_callback(lambda: log.append("callback"))
            log.append("backward")
            return (grad,)

    x = Value([1.0])
    make_graph().backward(item_of(Recording(Recording(x).outputs()).outputs()), np.ones(1))
    assert log == [False, "backward", False, "backward", "callback", "callback"]
    assert pyengine.is_grad_enabled()


def test_reentrant_inside_a_node():
    x = Value([1.0, 2.0, 3.0])
    y = Mul(x, Sin(x).outputs()).outputs()
    depths = []

    class Inner(Function):
        def forward(self, a):
            return a

        def backward(self, grad):
            depths.append(pyengine._core.state_module.get_current_graph_task().reentrant_depth)
            return (grad,)

    class Outer(Node):
        def apply(self, grads):
            make_graph().backward(item_of(y), grads[0])
            make_graph().backward(item_of(Inner(x).outputs()), np.zeros(3))
            return []

    pyengine.get_default_engine().execute([Edge(Outer(), 0)], [np.ones(3)], False, False, True)
    np.testing.assert_allclose(x.grad, np.sin(x.data) + x.data * np.cos(x.data), rtol=1e-12)
    assert depths == [1]


def test_a_backward_inside_an_owners_backward():
    """An owner's backward may run a Node graph and queue callbacks after it:
    they go to the owner graph's task."""
    log = []

    class Sink(Node):
        def apply(self, grads):
            log.append(("sink", grads[0].tolist()))
            return []

    class Nesting(Function):
        def forward(self, a):
            return a

        def backward(self, grad):
            pyengine.get_default_engine().execute([Edge(Sink([], [((1,), np.float64)]), 0)],
                                                  [2 * grad], False, False, True)
            pyengine.queue_callback(lambda: log.append("callback"))
            return (grad,)

    x = Value([1.0])
    make_graph().backward(item_of(Nesting(x).outputs()), np.ones(1))
    assert log == [("sink", [2.0]), "callback"]
    np.testing.assert_array_equal(x.grad, [1.0])


def test_metadata_reduces_broadcast_gradients_and_rejects_bad_ones():
    class Broadcasting(Function):
        def forward(self, a):
            return a

        def backward(self, grad):
            return (np.ones((2, 3)),)  # broadcast over a leading axis

    x = Value([1.0, 2.0, 3.0])
    metadata = lambda owner: [pyengine.InputMetadata((3,), np.float64)]  # noqa: E731
    make_graph(metadata=metadata).backward(item_of(Broadcasting(x).outputs()), np.ones(3))
    np.testing.assert_array_equal(x.grad, np.full(3, 2.0))
    # Specs as the Node API takes them: a (shape, dtype) tuple, a value; a cast.
    for spec in [((3,), np.float32), np.zeros(3, np.float32)]:
        x.grad = None
        make_graph(metadata=lambda owner, spec=spec: [spec]).backward(
            item_of(Broadcasting(x).outputs()), np.ones(3))
        assert x.grad.dtype == np.float32
        np.testing.assert_array_equal(x.grad, np.full(3, 2.0, np.float32))

    class Wrong(Broadcasting):
        def backward(self, grad):
            return (np.ones(4),)

    with pytest.raises(RuntimeError, match=r"backward of a Wrong: invalid gradient at index 0 - "
                                           r"got \(4,\) but expected shape compatible with \(3,\)"):
        make_graph(metadata=metadata).backward(item_of(Wrong(x).outputs()), np.ones(3))


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, error, match", [
    (lambda: pyengine.OwnerGraph(parents, 3), TypeError, "backward must be a str"),
    (lambda: pyengine.OwnerGraph(parents, backward, mode="both"), ValueError, "mode must be"),
    (lambda: pyengine.OwnerGraph(parents, backward, num_inputs=num_inputs), TypeError,
     "num_inputs is for mode='returns'"),
    (lambda: make_graph(visit=1), TypeError, "visit must be a callable or None, got int"),
])
def test_bad_protocols(make, error, match):
    with pytest.raises(error, match=match):
        make()


class Bad(Function):
    def __init__(self, *inputs, result=None, items=None, slots=1):
        super().__init__(*inputs)
        self.result, self.items, self.slots = result, items, slots

    def forward(self, *args):
        return np.ones(3)


def bad_parents(owner):
    if isinstance(owner, Bad) and owner.items is not None:
        return owner.items
    return parents(owner)


def bad_backward(owner, grads):
    return owner.result if isinstance(owner, Bad) else owner.vjp(grads)


def bad_graph(core=None):
    module = pyengine if core is None else core
    return module.OwnerGraph(bad_parents, bad_backward, mode="returns",
                             num_inputs=lambda o: o.slots if isinstance(o, Bad) else num_inputs(o))


BAD_CASES = {
    "count": (dict(result=[np.ones(3)]), RuntimeError,
              "the backward of a Bad returned 1 gradients; expected 2, one per parent item"),
    "not a list": (dict(result=np.ones(3)), TypeError,
                   "backward of a Bad returned ndarray; expected a list or tuple of 2 gradients"),
    "not a value": (dict(result=["a", None]), TypeError,
                    "backward of a Bad: invalid gradient at index 0 - expected an array, but got str"),
    "triple": (dict(items=[(Value(1.0), 0, 1)]), TypeError,
               "a parent item of a Bad is a tuple of 3: expected an owner, None, or a pair"),
    "input_nr": (dict(items=[(Split(Value(1.0)), 2)]), IndexError,
                 "a parent item of a Bad names slot 2 of a Split, which has 2 slots"),
    "negative input_nr": (dict(items=[(Split(Value(1.0)), -1)]), IndexError,
                          "a parent item of a Bad names slot -1: a slot is at least 0 and below "
                          "65536"),
    # Past a C integer: the compiled walk's OverflowError before, not the twin's IndexError.
    "input_nr past 64 bits": (dict(items=[(Split(Value(1.0)), 1 << 64)]), IndexError,
                              "a parent item of a Bad names slot 18446744073709551616: a slot is "
                              "at least 0 and below 65536"),
    "slots": (dict(slots=0), TypeError, "num_inputs.Bad. must be an int of at least 1, got 0"),
    "huge": (dict(slots=1 << 40), ValueError, "num_inputs.Bad. is 1099511627776; at most 65536"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_graphs_raise_clearly_and_leave_nothing(case):
    options, error, match = BAD_CASES[case]
    x, w = Value([1.0, 2.0, 3.0]), Value([1.0, 1.0, 1.0])
    bad = Bad(x, w, **options)
    with pytest.raises(error, match=match):
        bad_graph().backward(bad, np.ones(3))
    assert x.grad is None and w.grad is None
    assert pyengine.is_grad_enabled()
    assert pyengine._core.state_module.get_current_graph_task() is None


def test_bad_roots_and_cycles():
    graph = make_graph()
    with pytest.raises(TypeError, match="root must be an owner or a pair"):
        graph.backward(None, np.ones(3))
    with pytest.raises(TypeError, match="needs the root's gradient"):
        graph.backward(Value(1.0))
    with pytest.raises(IndexError, match="the root names slot 3 of a Split"):
        graph.backward((Split(Value(1.0)), 3), np.ones(3))
    with pytest.raises(IndexError, match="the root names slot 9223372036854775808: a slot is "
                                         "at least 0 and below 65536"):
        graph.backward((Split(Value(1.0)), 1 << 63), np.ones(3))
    a = Bad(items=[])
    b = Bad(items=[a])
    a.items.append(b)
    with pytest.raises(RuntimeError, match="the owner graph has a cycle: a Bad is among its own "
                                           "descendants through its parents"):
        bad_graph().backward(b, np.ones(3))


# -- the two cores side by side -----------------------------------------------------------------


needs_compiled = pytest.mark.skipif(compiled_owner_graph is None, reason="no compiled core")


def run_logged(core, seed, error_case):
    """Run a random graph through ``core``'s OwnerGraph with every option
    logging; returns what it saw and did."""
    program = random_program(seed, size=30)
    log = []
    leaves, values = build(program, log)
    root = item_of(values[-1])
    if error_case:
        reached = [owner for owner in reference_post_order(values[-1].creator)
                   if not isinstance(owner, Value)]
        bad_owner = reached[len(reached) // 2]

        def failing(owner, grads):
            if owner is bad_owner:
                return [np.ones(3)] * (len(owner.inputs) + 1)
            return owner.vjp(grads)
        graph_backward = failing
    else:
        graph_backward = backward
    graph = core.OwnerGraph(
        parents, graph_backward, mode="returns", num_inputs=num_inputs,
        metadata=lambda owner: [((3,), np.float64)] * num_inputs(owner),
        visit=lambda owner: log.append(("visit", id(owner))),
        needs_no_gradient=lambda owner: owner is leaves[2],
        pre_hook=lambda owner, grads: log.append(("pre", id(owner), [g.tolist() for g in grads
                                                                        if g is not None])),
        post_hook=lambda owner, grad_inputs, grads: log.append(
            ("post", id(owner), [None if g is None else g.tolist() for g in grad_inputs])))
    error = None
    try:
        graph.backward(root, np.ones(3))
    except Exception as caught:  # noqa: BLE001 - compared across cores
        error = (type(caught), str(caught))
    captured = None
    if error is None:
        captured = graph.grad(root, np.ones(3), [leaves[0], root], allow_unused=True)
    # Owners by their place in the program, not by address.
    index_of = {}
    for value in values:
        index_of.setdefault(id(value if value.creator is None else value.creator), len(index_of))
    normalised = [tuple(index_of.get(part, part) if type(part) is int else part for part in entry)
                  for entry in log]
    grads = [None if leaf.grad is None else leaf.grad.tolist() for leaf in leaves]
    captured = None if captured is None else [None if g is None else g.tolist() for g in captured]
    return normalised, grads, captured, error


@needs_compiled
@pytest.mark.parametrize("error_case", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_both_cores_agree(seed, error_case):
    compiled = run_logged(compiled_owner_graph, seed, error_case)
    pure = run_logged(pure_owner_graph, seed, error_case)
    assert compiled == pure
    assert len(compiled[0]) > 10
    assert (compiled[3] is not None) == error_case


class Scalar:
    """micrograd-style writes-mode values."""

    def __init__(self, data, children=(), log=None):
        self.data, self.grad, self.children, self.log = data, 0.0, tuple(children), log

    def run(self):
        self.log.append(id(self))
        if len(self.children) == 2:
            a, b = self.children
            a.grad += b.data * self.grad
            b.grad += a.data * self.grad
        elif self.children:
            self.children[0].grad += self.grad


@needs_compiled
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("reader", ["names", "callables"])
def test_both_cores_agree_in_writes_mode(seed, reader):
    def run(core):
        rng = random.Random(seed)
        log = []
        values = [Scalar(rng.uniform(-1, 1), (), log) for _ in range(3)]
        for _ in range(40):
            count = rng.choice([1, 2])
            values.append(Scalar(rng.uniform(-1, 1), rng.sample(values[-6:], count), log))
        values[-1].grad = 1.0
        visits = []
        if reader == "names":
            graph = core.OwnerGraph("children", "run", visit=visits.append)
        else:
            graph = core.OwnerGraph(lambda v: v.children, lambda v: v.run(), visit=visits.append)
        graph.backward(values[-1])
        index = {id(value): i for i, value in enumerate(values)}
        return ([index[i] for i in log], [index[id(v)] for v in visits],
                [value.grad for value in values])

    assert run(compiled_owner_graph) == run(pure_owner_graph)


def test_writes_mode_rejects_gradients_and_returns_mode_options():
    with pytest.raises(TypeError, match="takes no gradient"):
        pyengine.OwnerGraph("children", "run").backward(Scalar(1.0), np.ones(1))


def test_a_deep_returns_chain():
    x = Value([1.0])
    y = x
    for _ in range(3 * sys.getrecursionlimit()):
        y = Add(y, x).outputs()
    make_graph().backward(item_of(y), np.ones(1))
    np.testing.assert_array_equal(x.grad, [3 * sys.getrecursionlimit() + 1])


def test_pure_state_is_untouched_after_a_run():
    # The twin's walk restores its own thread state (the compiled one is
    # covered by test_bad_graphs_raise_clearly_and_leave_nothing).
    x = Value([1.0])
    pure_owner_graph.OwnerGraph(parents, backward, mode="returns", num_inputs=num_inputs).backward(
        item_of(Sin(x).outputs()), np.ones(1))
    assert pure_state.get_current_graph_task() is None and pure_state.is_grad_enabled()


def owner_graph_module(core):
    """The OwnerGraph module of ``core``; skips where the compiled one is not built."""
    if core == "compiled" and compiled_owner_graph is None:
        pytest.skip("no compiled build")
    return compiled_owner_graph if core == "compiled" else pure_owner_graph


class PlainOwner:
    """An owner of a framework's own graph: its parents, a name and an
    action its backward may run."""

    def __init__(self, parents=(), action=None, name=""):
        self.parents, self.action, self.name = list(parents), action, name


@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_an_error_releases_the_gradients_still_waiting(core):
    # The compiled walk keeps the InputBuffers in a C table (See
    # pyengine/_owner_table.h), which must let them go when a backward
    # raises, as the twin's dict does. Root's parents are [waiting,
    # failing]: the reverse post-order runs failing first, while waiting's
    # gradient sits in its buffer.
    module = owner_graph_module(core)
    import gc
    import weakref

    waiting = PlainOwner([PlainOwner()], name="waiting")
    failing = PlainOwner([PlainOwner()], name="failing")
    root = PlainOwner([waiting, failing], name="root")
    sent = []  # a weak reference to the gradient root sends waiting

    def vjp(owner, grads):
        if owner is root:
            gradient = np.full(2, 7.0)
            sent.append(weakref.ref(gradient))
            return [gradient, np.ones(2)]
        if owner is failing:
            assert sent[0]() is not None  # held, pending, by waiting's buffer
            raise ValueError("failing's backward")
        raise AssertionError("waiting runs after failing")

    graph = module.OwnerGraph("parents", vjp, mode="returns", accumulate=lambda leaf, grad: None)
    try:
        graph.backward(root, np.ones(2))
    except ValueError as error:
        assert str(error) == "failing's backward"
    else:
        raise AssertionError("the backward did not raise")
    gc.collect()
    assert len(sent) == 1 and sent[0]() is None


@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_a_post_hook_cannot_lengthen_what_the_engine_routes(core):
    # The compiled walk reads an owner's items from a C array (See
    # pyengine/_owner_table.h), so no gradient may come past them. A hook
    # gets tuples (it once got the engine's own list and could append to
    # it), and a longer list it returns is refused by count.
    module = owner_graph_module(core)
    x = Value([1.0, 2.0])
    y = Sin(x).outputs()

    def appends(owner, outputs, grads):
        outputs.append(np.ones(2))

    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'append'"):
        make_graph(module, post_hook=appends).backward(item_of(y), np.ones(2))
    with pytest.raises(RuntimeError, match="post_hook of a Sin returned 2 values; expected None "
                                           "or a list of 1 gradients"):
        make_graph(module, post_hook=lambda owner, outputs, grads: list(outputs) + [None]
                   ).backward(item_of(y), np.ones(2))
    assert x.grad is None


def chain_of_owners(n, leaf, top_action=None):
    """n PlainOwners over ``leaf``, each the only parent of the next: the top one."""
    owner = leaf
    for i in range(n):
        owner = PlainOwner([owner], top_action if i == n - 1 else None)
    return owner


def counting_walker(module):
    """A returns-mode OwnerGraph whose owners each add 1 to their gradient
    (so a chain of n owners over a leaf gives the leaf g + n), and
    ``walk(n, top_action)``: the leaf's gradient of a new chain of n
    walked from a zero gradient. Safe from several threads at once. An
    owner named "sent" leaves a weak reference to the gradient it sends its
    parents in ``walk.sent``."""
    got = {}
    sent = []

    def vjp(owner, grads):
        if owner.action is not None:
            owner.action()
        gradient = grads[0] + 1.0
        if owner.name == "sent":
            sent.append(weakref.ref(gradient))
        return [gradient] * len(owner.parents)

    graph = module.OwnerGraph("parents", vjp, mode="returns",
                              accumulate=lambda leaf, grad: got.__setitem__(id(leaf), grad))

    def walk(n, top_action=None):
        leaf = PlainOwner()
        graph.backward(chain_of_owners(n, leaf, top_action), np.zeros(2))
        return got.pop(id(leaf))

    walk.sent = sent
    return graph, walk


class ParentsFail(PlainOwner):
    """An owner whose parents cannot be read: the search stops at it."""

    @property
    def parents(self):
        raise ValueError("an owner's parents")

    @parents.setter
    def parents(self, value):
        pass


@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_one_graph_walked_at_many_sizes_after_errors_and_reentrantly(core):
    # The compiled walk keeps its owner table's memory in its thread's kept
    # tables for the next walk (See Note [Tables kept between backward
    # calls] in pyengine/_table_growth.h): walks of other sizes (small after
    # large, large after small, one past the largest table kept), walks
    # that fail in the search (its table half grown), in a backward with
    # gradients waiting, or by Ctrl-C, and walks run inside another's
    # backward (which take what is left) all give the analytic gradients.
    module = owner_graph_module(core)
    graph, walk = counting_walker(module)

    for n in (5_000, 3, 70_000, 5_000, 1, 140_000, 20, 40_000):
        np.testing.assert_array_equal(walk(n), np.full(2, float(n)))

    def fail():
        raise ValueError("an owner's backward")

    # Root's parents are [waiting, failing]: failing runs first, while
    # waiting's gradient sits in the table.
    leaf = PlainOwner()
    root = PlainOwner([chain_of_owners(2_000, leaf), PlainOwner([leaf], fail)])
    with pytest.raises(ValueError, match="an owner's backward"):
        graph.backward(root, np.zeros(2))
    np.testing.assert_array_equal(walk(5_000), np.full(2, 5_000.0))

    # The search fails 50,000 owners deep, its table grown past its first size.
    with pytest.raises(ValueError, match="an owner's parents"):
        graph.backward(chain_of_owners(50_000, ParentsFail()), np.zeros(2))
    np.testing.assert_array_equal(walk(40_000), np.full(2, 40_000.0))
    bottom = PlainOwner()
    top = chain_of_owners(30_000, bottom)
    bottom.parents = [top]
    with pytest.raises(RuntimeError, match="cycle"):
        graph.backward(top, np.zeros(2))
    bottom.parents = []
    np.testing.assert_array_equal(walk(30_000), np.full(2, 30_000.0))

    def interrupt():
        raise KeyboardInterrupt

    # Ctrl-C in an owner's backward, with gradients waiting in a large
    # table: the one root sent the chain is released with the table.
    leaf = PlainOwner()
    root = PlainOwner([chain_of_owners(40_000, leaf), PlainOwner([leaf], interrupt)],
                      name="sent")
    with pytest.raises(KeyboardInterrupt):
        graph.backward(root, np.zeros(2))
    gc.collect()
    assert len(walk.sent) == 1 and walk.sent.pop()() is None
    np.testing.assert_array_equal(walk(40_000), np.full(2, 40_000.0))

    inner = []
    outer = walk(3_000, lambda: inner.append(walk(4_000)))
    np.testing.assert_array_equal(outer, np.full(2, 3_000.0))
    np.testing.assert_array_equal(inner[0], np.full(2, 4_000.0))
    np.testing.assert_array_equal(walk(4_000), np.full(2, 4_000.0))

    # Nested twice, each larger than the walk it runs in, the outer one with
    # gradients waiting below the owner that runs the nested walks.
    inner = []
    outer = walk(10_000, lambda: inner.append(walk(30_000, lambda: inner.append(walk(70_000)))))
    np.testing.assert_array_equal(outer, np.full(2, 10_000.0))
    np.testing.assert_array_equal(inner[0], np.full(2, 70_000.0))
    np.testing.assert_array_equal(inner[1], np.full(2, 30_000.0))
    for n in (70_000, 10_000, 30_000):
        np.testing.assert_array_equal(walk(n), np.full(2, float(n)))


@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_owner_graphs_walked_from_two_threads_at_once(core):
    # Each thread takes and gives its own kept tables (See Note [Tables
    # kept between backward calls]); the searches let the other thread run
    # as they go, so the two threads' walks of many sizes, on one
    # OwnerGraph and on one each, interleave. Every gradient is the
    # analytic one.
    module = owner_graph_module(core)
    shared_graph, shared_walk = counting_walker(module)
    barrier = threading.Barrier(2)
    errors = []

    def run(sizes):
        _, own_walk = counting_walker(module)
        try:
            barrier.wait()
            for n in sizes:
                for walk in (shared_walk, own_walk):
                    np.testing.assert_array_equal(walk(n), np.full(2, float(n)))
        except BaseException as error:  # reported below, on the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(sizes,))
               for sizes in ((40_000, 3, 1, 70_000), (1, 70_000, 5_000, 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
