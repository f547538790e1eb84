"""The subjects of ``python -m pyengine bench``: every engine it compares, and
how each one builds each graph.

A subject builds :class:`~pyengine.bench.workload.Workload` s in a worker
process of its own (the runner sets ``PYENGINE_PURE`` and calls
``setup()`` there first). Graph kinds, with ``size`` the number of nodes
asked for (each workload reports the nodes it really has):

- ``chain``: one op after another from one leaf.
- ``wide``: ``size // 10`` branches of 10 ops from one leaf, joined at a
  root (the backward of a ``size // 10``-input op), so the leaf's
  gradient sums ``size // 10`` terms.
- ``lattice``: a square diamond lattice: every node above the bottom layer
  adds two neighbours of the layer below, so every node sums two gradients.
- ``fan-in``: ``size`` ops read one node, joined at a root: that node sums
  ``size`` gradients.
- ``mlp-step``: a training step (forward, backward, SGD update) of an MLP
  (:mod:`pyengine.bench.workload` has the two problems and their oracle).
- ``grad-inputs``: ``grad(root, inputs=leaf)`` on a chain: a backward
  whose exec_info marks the nodes on a path to the leaf and captures its
  gradient, against ``chain``'s backward into the leaf's ``.grad``.
- ``apply-floor`` (pyengine only): each node of a chain's ``apply`` called
  once, in order, from C (``map`` drained by a ``deque``), with no engine:
  the floor an engine's cost per node is measured against (issue 19).
- ``execute-fixed`` / ``backward-fixed`` / ``grad-fixed``: one call on a
  chain of ``size`` (1 or 10) nodes: the fixed cost of a call, through the
  engine's entry point (``Engine.execute``; PyTorch's ``run_backward``), and
  through the public ``backward`` and ``grad``.

What the op is, per subject:

- ``pyengine`` / ``pyengine-pure``: the engine alone, on
  :mod:`pyengine.bench.graphs` (pass-through Python Nodes, numpy (3,)
  gradients, metadata on every slot); the MLP through the reference
  frontend.
- ``torch-view``: ``y.view_as(y)``, whose backward launches no kernel;
  ``torch-function``: a Python ``torch.autograd.Function`` returning its
  gradient; ``torch-mul``: ``y * 1.0``, one small kernel per node. Roots
  that join many branches are ``torch.stack``; lattice nodes are ``a + b``
  (a Python Function for ``torch-function``). float64 (3,), one thread;
  ``torch-mul`` runs with ``retain_graph=True`` (its nodes save ``1.0``,
  which a backward would free).
- ``dezero`` / ``dezero-pyengine``: DeZero 0.0.13 Variables, the op is
  ``-y``; roots are chains of ``+`` (DeZero has no n-ary add).
- ``micrograd`` / ``micrograd-pyengine``: micrograd Values, the op is
  ``y * 1.0``; roots are chains of ``+``. Native micrograd runs with the
  recursion limit raised as far as the graph needs.

Every gradient is a power of two (or a sum of them), so every oracle is an
exact comparison, except the MLP steps (``rtol=1e-9``: sums in another order).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .workload import (
    MLPProblem,
    Unsupported,
    Workload,
    expect_close,
    expect_equal,
    scalar_mlp_problem,
    size_label,
    tensor_mlp_problem,
)

WIDE_DEPTH = 10
SHAPE = (3,)


@dataclass(frozen=True)
class Subject:
    """One engine under test. ``family`` groups the report's tables
    (``engine``, ``DeZero``, ``micrograd``); ``baseline`` names the subject
    its ratios are taken against; ``pure`` is the ``PYENGINE_PURE`` its
    worker gets (None: the default, compiled)."""

    key: str
    label: str
    family: str
    baseline: str
    needs: tuple
    pure: bool | None
    setup: Callable[[], None]
    build: Callable[[str, int], Workload]


def _lattice_side(size):
    side = max(1, round(size ** 0.5))
    if side > 1000:
        raise Unsupported("a lattice deeper than 1000 layers overflows its exact gradient")
    return side


def _branches(size):
    return max(1, size // WIDE_DEPTH)


def _build_graph(kind, size, x, unary, add, join, sign=1.0):
    """Graph ``kind`` (chain, wide, lattice, fan-in; See the module docstring)
    from leaf ``x`` with a framework's ops: ``unary(y)``, whose derivative is
    ``sign``; ``add(a, b)``; ``join(values) -> (root, nodes it made)``.
    Returns ``(name, root, nodes, leaf gradient)``, the gradient a float
    (every one of its entries) for a root gradient of ones."""
    def repeat(y, times):
        for _ in range(times):
            y = unary(y)
        return y

    if kind == "chain":
        return f"chain {size_label(size)}", repeat(x, size), size, sign ** size
    if kind == "wide":
        branches = _branches(size)
        root, joins = join([repeat(x, WIDE_DEPTH) for _ in range(branches)])
        return (f"wide {branches}x{WIDE_DEPTH}", root, branches * WIDE_DEPTH + joins,
                branches * sign ** WIDE_DEPTH)
    if kind == "lattice":
        side = _lattice_side(size)
        layer = [unary(x) for _ in range(side)]
        for _ in range(side - 1):
            layer = [add(layer[i], layer[(i + 1) % side]) for i in range(side)]
        root, joins = join(layer)
        return f"lattice {side}x{side}", root, side * side + joins, sign * side * 2.0 ** (side - 1)
    if kind == "fan-in":
        sink = unary(x)
        root, joins = join([unary(sink) for _ in range(size)])
        return f"fan-in {size_label(size)}", root, 1 + size + joins, size * sign ** 2
    raise Unsupported(kind)


def _sum_chain(values):
    """``values[0] + values[1] + ...`` one ``+`` at a time: frameworks
    without an n-ary add join branches with ``len(values) - 1`` add nodes."""
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total, len(values) - 1


# -- pyengine itself ----------------------------------------------------------------------

def _pyengine_setup():
    pass


def _pyengine_build(kind, size):
    import pyengine
    from pyengine.bench import graphs

    if kind in ("chain", "wide", "lattice", "fan-in"):
        graph = graphs.build(kind, size)
        execute = pyengine.get_default_engine().execute
        root_edge, grad, leaf = graph.root_edge, graph.grad, graph.leaf

        def run():
            leaf.grad = None
            execute([root_edge], [grad], False, False, True)

        return Workload(graph.name, graph.nodes, run, graph.check)
    if kind == "grad-inputs":
        graph = graphs.chain(size)
        root_edge, grad, leaf = graph.root_edge, graph.grad, graph.leaf
        result = [None]
        grad_fn = pyengine.grad

        def run():
            result[0] = grad_fn(root_edge, leaf, grad)

        def check():
            expect_equal(f"grad(inputs=), {graph.name}", result[0][0], graph.expected)

        return Workload(f"grad(inputs=), {graph.name}", graph.nodes, run, check)
    if kind == "apply-floor":
        return _apply_floor(graphs.chain(size), graphs.chain_nodes)
    if kind in ("execute-fixed", "backward-fixed", "grad-fixed"):
        graph = graphs.chain(size)
        root_edge, grad, leaf = graph.root_edge, graph.grad, graph.leaf
        if kind == "execute-fixed":
            execute = pyengine.get_default_engine().execute

            def run():
                leaf.grad = None
                execute([root_edge], [grad], False, False, True)

            return Workload(f"Engine.execute, {size}-node chain", size, run, graph.check,
                            unit="call")
        if kind == "backward-fixed":
            backward = pyengine.backward

            def run():
                leaf.grad = None
                backward(root_edge, grad)

            return Workload(f"backward, {size}-node chain", size, run, graph.check, unit="call")
        result = [None]
        grad_fn = pyengine.grad

        def run():
            result[0] = grad_fn(root_edge, leaf, grad)

        def check():
            expect_equal(f"grad, {size}-node chain", result[0][0], graph.expected)

        return Workload(f"grad, {size}-node chain", size, run, check, unit="call")
    if kind == "mlp-step":
        return _frontend_mlp_step(tensor_mlp_problem())
    raise Unsupported(kind)


def _apply_floor(graph, chain_nodes):
    """Every node of ``graph`` (a chain)'s ``apply`` called once, root first,
    each on the root gradient (a Pass node returns its input list), from C:
    ``map`` calls the function ``apply`` of the nodes' one class with each
    node and the gradients list, through vectorcall, and a ``deque`` of
    length one drains it, keeping the last result for the oracle. No Python
    frame runs per node but ``apply``'s own, and no object is made per
    call, so this is what calling the nodes costs with no engine at all.

    The function is looked up once per run, where the engine looks ``apply``
    up on each node: a few nanoseconds per node, left out. Not
    ``operator.methodcaller``, the floor until 2026-12-02: up to CPython
    3.12 it makes a bound method and an argument tuple for every call, which
    cost about as much as the call itself (benchmarks/RESULTS.md, "Issue 19:
    the apply floor measured methodcaller")."""
    from collections import deque
    from itertools import repeat

    nodes = chain_nodes(graph)
    node_type = type(nodes[0])
    if any(type(node) is not node_type for node in nodes):
        raise ValueError(f"the apply floor needs nodes of one class: {graph.name} mixes them")
    grads = [graph.grad]
    last = deque(maxlen=1)

    def run():
        # Looked up at each run, so that a patched apply is the one called.
        last.extend(map(node_type.apply, nodes, repeat(grads)))

    def check():
        expect_equal(f"apply floor, {graph.name}", last[0][0], graph.expected)

    return Workload(f"apply alone, {graph.name}", len(nodes), run, check)


def _frontend_mlp_step(problem: MLPProblem):
    import pyengine.frontend as F

    def make_model():
        sizes = [problem.weights[0].shape[1]] + [w.shape[0] for w in problem.weights]
        model = F.nn.MLP(sizes)
        linears = [layer for layer in model if isinstance(layer, F.nn.Linear)]
        for linear, w, b in zip(linears, problem.weights, problem.biases):
            linear.weight.data[...] = w
            linear.bias.data[...] = b
        params = [p for linear in linears for p in (linear.weight, linear.bias)]
        return model, params

    inputs, targets = F.tensor(problem.inputs), F.tensor(problem.targets)
    model, params = make_model()
    optimizer = F.optim.SGD(params, lr=problem.lr)

    def step():
        loss = F.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def check():
        fresh, fresh_params = make_model()
        F.cross_entropy(fresh(inputs), targets).backward()
        for i, (p, expected) in enumerate(zip(fresh_params, problem.gradients())):
            expect_close(f"frontend MLP parameter {i}", p.grad.data, expected)

    return Workload("MLP step 2-64-64-2, batch 64", 0, step, check, unit="step")


# -- PyTorch ------------------------------------------------------------------------------

def _torch_setup():
    import torch

    torch.set_num_threads(1)


def _torch_ops(flavor):
    """``(unary, binary)`` ops of a torch flavor (See the module docstring)."""
    import torch

    if flavor == "view":
        return (lambda y: y.view_as(y)), (lambda a, b: a + b)
    if flavor == "mul":
        return (lambda y: y * 1.0), (lambda a, b: a + b)

    class PassFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    class AddFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a + b

        @staticmethod
        def backward(ctx, grad):
            return grad, grad

    return PassFunction.apply, AddFunction.apply


def _torch_build(flavor, kind, size):
    import torch

    if kind == "mlp-step":
        if flavor != "view":
            raise Unsupported(kind)
        return _torch_mlp_step(tensor_mlp_problem())
    fixed = kind in ("execute-fixed", "backward-fixed", "grad-fixed")
    if fixed and flavor != "view":
        raise Unsupported(kind)
    unary, binary = _torch_ops(flavor)
    x = torch.zeros(SHAPE, dtype=torch.float64, requires_grad=True)

    def stack(values):
        return torch.stack(values), 1

    on_chain = fixed or kind == "grad-inputs"
    name, root, nodes, gradient = _build_graph("chain" if on_chain else kind, size, x, unary,
                                               binary, stack)
    grad = torch.ones_like(root)
    expected = np.full(SHAPE, gradient)

    if kind in ("grad-fixed", "grad-inputs"):
        result = [None]
        # y * 1.0 saves its operand, which a grad call frees unless retained.
        retain = flavor == "mul"

        def run():
            result[0] = torch.autograd.grad((root,), (x,), (grad,), retain_graph=retain)

        def check():
            expect_equal(f"torch grad, {size}-node chain", result[0][0].numpy(), expected)

        if kind == "grad-inputs":
            return Workload(f"grad(inputs=), {name}", nodes, run, check)
        return Workload(f"grad, {size}-node chain", size, run, check, unit="call")

    # y * 1.0 saves its operand, which a backward frees unless retained.
    retain_graph = flavor == "mul"

    def run():
        x.grad = None
        torch.autograd.backward((root,), (grad,), retain_graph=retain_graph)

    def check():
        expect_equal(f"torch {flavor} {name}", None if x.grad is None else x.grad.numpy(), expected)

    if kind == "execute-fixed":
        run_backward = torch.autograd.Variable._execution_engine.run_backward

        def run():
            x.grad = None
            run_backward((root,), (grad,), False, False, (), allow_unreachable=True,
                         accumulate_grad=True)

        return Workload(f"Engine.execute, {size}-node chain", size, run, check, unit="call")
    if kind == "backward-fixed":
        return Workload(f"backward, {size}-node chain", size, run, check, unit="call")
    return Workload(name, nodes, run, check)


def _torch_mlp_step(problem: MLPProblem):
    import torch

    def make_model():
        layers = []
        for i, (w, b) in enumerate(zip(problem.weights, problem.biases)):
            linear = torch.nn.Linear(w.shape[1], w.shape[0], dtype=torch.float64)
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(w))
                linear.bias.copy_(torch.from_numpy(b))
            layers.append(linear)
            if i < len(problem.weights) - 1:
                layers.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*layers)
        return model, [p for linear in layers[::2] for p in (linear.weight, linear.bias)]

    inputs, targets = torch.from_numpy(problem.inputs), torch.from_numpy(problem.targets)
    model, params = make_model()
    optimizer = torch.optim.SGD(params, lr=problem.lr)
    cross_entropy = torch.nn.functional.cross_entropy

    def step():
        loss = cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def check():
        fresh, fresh_params = make_model()
        cross_entropy(fresh(inputs), targets).backward()
        for i, (p, expected) in enumerate(zip(fresh_params, problem.gradients())):
            expect_close(f"torch MLP parameter {i}", p.grad.numpy(), expected)

    return Workload("MLP step 2-64-64-2, batch 64", 0, step, check, unit="step")


# -- DeZero -------------------------------------------------------------------------------

def _dezero_build(kind, size):
    import dezero

    if kind == "mlp-step":
        return _dezero_mlp_step(tensor_mlp_problem())
    x = dezero.Variable(np.zeros(SHAPE))
    name, root, nodes, gradient = _build_graph(kind, size, x, lambda y: -y, lambda a, b: a + b,
                                               _sum_chain, sign=-1.0)
    expected = np.full(SHAPE, gradient)

    def run():
        x.cleargrad()
        root.backward()

    def check():
        expect_equal(f"DeZero {name}", None if x.grad is None else x.grad.data, expected)

    return Workload(name, nodes, run, check)


def _dezero_mlp_step(problem: MLPProblem):
    import dezero
    import dezero.functions as F

    def make_model():
        model = dezero.models.MLP(tuple(w.shape[0] for w in problem.weights), activation=F.relu)
        model(problem.inputs)  # DeZero sizes its weights at the first call
        params = []
        for linear, w, b in zip(model.layers, problem.weights, problem.biases):
            linear.W.data = w.T.copy()  # DeZero's W is (in, out)
            linear.b.data = b.copy()
            params += [linear.W, linear.b]
        return model, params

    model, _ = make_model()
    optimizer = dezero.optimizers.SGD(problem.lr).setup(model)

    def step():
        loss = F.softmax_cross_entropy(model(problem.inputs), problem.targets)
        model.cleargrads()
        loss.backward()
        optimizer.update()

    def check():
        fresh, params = make_model()
        F.softmax_cross_entropy(fresh(problem.inputs), problem.targets).backward()
        for i, (p, expected) in enumerate(zip(params, problem.gradients())):
            got = p.grad.data.T if i % 2 == 0 else p.grad.data
            expect_close(f"DeZero MLP parameter {i}", got, expected)

    return Workload("MLP step 2-64-64-2, batch 64", 0, step, check, unit="step")


# -- micrograd ----------------------------------------------------------------------------

def _micrograd_values(root):
    """Every Value of ``root``'s graph, found without recursion."""
    values, seen, stack = [], {id(root)}, [root]
    while stack:
        value = stack.pop()
        values.append(value)
        for child in value._prev:
            if id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return values


def _micrograd_build(kind, size):
    from micrograd.engine import Value

    if kind == "mlp-step":
        return _micrograd_mlp_step(scalar_mlp_problem())
    x = Value(0.0)
    name, root, nodes, expected = _build_graph(kind, size, x, lambda y: y * 1.0,
                                               lambda a, b: a + b, _sum_chain)

    values = _micrograd_values(root)
    # micrograd's own backward sorts the graph recursively, a frame per level.
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 2 * len(values) + 1000))

    def reset():
        # micrograd adds into every .grad and never clears one: start each
        # sample from zero (untimed), so that every sample does the same sums.
        for value in values:
            value.grad = 0.0

    def check():
        expect_equal(f"micrograd {name}", x.grad, expected)

    return Workload(name, nodes, root.backward, check, reset=reset)


def _micrograd_mlp_step(problem: MLPProblem):
    from micrograd.nn import MLP

    points = problem.inputs.tolist()
    targets = problem.targets.tolist()

    def make_model():
        sizes = [w.shape[0] for w in problem.weights]
        model = MLP(problem.weights[0].shape[1], sizes)
        params = []
        for layer, w, b in zip(model.layers, problem.weights, problem.biases):
            for neuron, row, bias in zip(layer.neurons, w, b):
                for weight, value in zip(neuron.w, row):
                    weight.data = float(value)
                neuron.b.data = float(bias)
            params.append(layer)
        return model, params

    def loss_of(model):
        return sum((model(point) - target) ** 2 for point, target in zip(points, targets))

    model, _ = make_model()

    def step():
        loss = loss_of(model)
        model.zero_grad()
        loss.backward()
        for p in model.parameters():
            p.data -= problem.lr * p.grad

    def check():
        fresh, layers = make_model()
        loss_of(fresh).backward()
        expected = problem.gradients()
        for i, layer in enumerate(layers):
            grad_w = [[weight.grad for weight in neuron.w] for neuron in layer.neurons]
            grad_b = [neuron.b.grad for neuron in layer.neurons]
            expect_close(f"micrograd MLP weight {i}", grad_w, expected[2 * i])
            expect_close(f"micrograd MLP bias {i}", grad_b, expected[2 * i + 1])

    return Workload("MLP step 2-16-16-1, 20 points", 0, step, check, unit="step")


# -- the registry --------------------------------------------------------------------------

def _framework_setup(framework, on_pyengine):
    """The setup of a framework's worker: import it, or install pyengine's
    adapter for it (``pyengine.adapters.<framework>``), which imports it."""
    def setup():
        if on_pyengine:
            importlib.import_module(f"pyengine.adapters.{framework}").install()
        else:
            importlib.import_module(framework)

    return setup


def _torch_subject(flavor, label):
    return Subject(f"torch-{flavor}", label, "engine", "pyengine", ("torch",), None, _torch_setup,
                   lambda kind, size: _torch_build(flavor, kind, size))


SUBJECTS = {subject.key: subject for subject in (
    Subject("pyengine", "pyengine compiled", "engine", "pyengine", (), False, _pyengine_setup,
            _pyengine_build),
    Subject("pyengine-pure", "pyengine pure", "engine", "pyengine", (), True, _pyengine_setup,
            _pyengine_build),
    _torch_subject("view", "PyTorch view_as"),
    _torch_subject("function", "PyTorch Function"),
    _torch_subject("mul", "PyTorch x*c"),
    Subject("dezero", "DeZero native", "DeZero", "dezero-pyengine", ("dezero",), None,
            _framework_setup("dezero", False), _dezero_build),
    Subject("dezero-pyengine", "DeZero on pyengine", "DeZero", "dezero-pyengine", ("dezero",),
            False, _framework_setup("dezero", True), _dezero_build),
    Subject("micrograd", "micrograd native", "micrograd", "micrograd-pyengine", ("micrograd",),
            None, _framework_setup("micrograd", False), _micrograd_build),
    Subject("micrograd-pyengine", "micrograd on pyengine", "micrograd", "micrograd-pyengine",
            ("micrograd",), False, _framework_setup("micrograd", True), _micrograd_build),
)}
