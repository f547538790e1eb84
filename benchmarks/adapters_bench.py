#!/usr/bin/env python
"""DeZero, micrograd, autograd and Chainer: their own engine against pyengine, in one table.

    python benchmarks/adapters_bench.py [--repeats 5] [--markdown]
                                        [--only dezero|micrograd|owners|autograd|chainer]
                                        [--clock wall|cpu]

Needs ``dezero`` and ``micrograd`` installed (the ``adapters`` tox
environment has them; ``autograd`` 1.9.1 is in the ``autograd`` one; a
framework that does not import is skipped, with a note, unless ``--only``
names it) and pyengine installed with its compiled core. On a
shared machine, ``OPENBLAS_NUM_THREADS=1`` steadies the DeZero MLP rows
(numpy's matrix products then do not compete for cores).

One process runs everything. Each repeat takes one sample of every
benchmark natively and one on pyengine, back to back (the adapter is
installed and uninstalled between them), so that load from other processes
falls on both alike and the ratios come from one run. Reported: median
(min-max) over the repeats, in ms per call, and native / pyengine (above 1:
pyengine is faster). ``--clock cpu`` times with ``time.process_time``
instead of the wall clock: on a shared machine, other processes then
disturb the figures less.

What is timed:

- *backward*: ``y.backward()`` on a graph built, for each engine, before
  any sample (with the adapter installed for pyengine; DeZero's and
  micrograd's graphs are read at backward); the leaves'
  ``.grad`` is cleared before each sample.
  The graphs are then frozen out of the cyclic GC (``gc.freeze()``), and
  ``gc.collect()`` runs before each sample; the GC stays enabled while
  timing. Before timing, one backward per engine runs and the leaf
  gradients are compared (the oracle); a mismatch stops the run.
- *step*: a training step as a user runs it: forward, backward, optimizer
  update. Each sample is a fresh process (so that the cyclic GC sees that
  program's objects only) that runs 2 steps, then times 5 and reports
  their mean. The GC is left as it is: micrograd's Values are reference
  cycles, so freeing each step's graph is the cyclic GC's work, and it is
  included.

Graphs (float64 arrays of shape (3,) for DeZero, as in ``graphs.py``):

- DeZero chain 10k: ``y = -y`` 10,000 times from one leaf: 10,000 Neg
  nodes; each backward formula is one DeZero Function call (``-gy``).
- DeZero wide 1000x10: 1,000 branches of 10 Negs from one leaf, summed by a
  chain of 999 Adds: 10,999 nodes, 1,000 gradients meet at the leaf.
- DeZero MLP: the MLP of DeZero's MNIST example,
  ``dezero.models.MLP((1000, 1000, 10), activation=F.relu)`` (float32), a
  batch of 100 x 784 random inputs, softmax cross entropy: backward alone,
  and a full SGD step.
- micrograd chain 10k: ``y = y * 1.0001`` 10,000 times (native with the
  recursion limit raised to 100,000).
- micrograd MLP: ``MLP(2, [16, 16, 1])`` on 20 points, squared loss
  (about 6,000 Values), backward and a full SGD step.
- owner graph, returns mode, chain 10k: plain Python owners (one parent,
  a ``backward(grads)`` method returning ``[0.5 * grads[0]]`` on float64
  arrays of shape (3,)), 10,000 deep over one leaf. *native* is the loop
  such a framework writes for itself (an iterative depth-first sort, then
  the methods in reverse, gradients summed in a dict); *pyengine* is
  ``pyengine.OwnerGraph("parents", "backward", mode="returns")``.
- autograd (HIPS, 1.9.1), float64 arrays of shape (3,): ``backward_pass``
  (``autograd.core``'s, native, or the adapter's when installed) on a graph
  traced once (``make_vjp``'s trace), for: chain 10k, ``x = -x`` 10,000
  times (``anp.negative``); wide 1000x10, 1,000 branches of 10 negatives
  summed by a chain of 999 adds; fan-in 10k, ``total = total + x`` 10,000
  times (10,001 gradients meet at the start node). Backward only.
- Chainer (7.8.1, in its own environment: ``tox -e chainer``), float64
  arrays of shape (3,): ``y.backward()`` with ``y.grad`` set to ones and
  the leaf's gradient cleared before each call, on a graph built once (by
  Chainer's forward, which the adapter does not touch): chain 10k,
  ``y = -y`` 10,000 times; wide 1000x10 as DeZero's; one node, ``y = -x``,
  1,000 backward calls per sample. Backward only.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import subprocess
import sys
import time

import numpy as np

CHAIN = 10_000
WIDE_BRANCHES, WIDE_DEPTH = 1_000, 10


def load_average():
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


# -- measurement ----------------------------------------------------------------------------

class Benchmark:
    """One row: a callable per engine that returns one sample in seconds."""

    def __init__(self, name, native, pyengine, unit_note=""):
        self.name = name
        self.sample = {"native": native, "pyengine": pyengine}
        self.samples = {"native": [], "pyengine": []}
        self.unit_note = unit_note

    def run_once(self):
        for engine in ("native", "pyengine"):
            self.samples[engine].append(self.sample[engine]())

    def summary(self, engine):
        values = [value * 1e3 for value in self.samples[engine]]
        return statistics.median(values), min(values), max(values)

    def ratio(self):
        return self.summary("native")[0] / self.summary("pyengine")[0]


class Component:
    """One line of a breakdown: a callable returning one sample in seconds,
    reported per node (``per``) in microseconds."""

    def __init__(self, name, sample, per):
        self.name = name
        self.sample = sample
        self.per = per
        self.samples = []

    def run_once(self):
        self.samples.append(self.sample())

    def summary(self):
        values = [value * 1e6 / self.per for value in self.samples]
        return statistics.median(values), min(values), max(values)


# The clock samples are read from: time.perf_counter (wall time, the
# default) or time.process_time (--clock cpu: this process's CPU time, which
# other processes on a shared machine disturb less).
clock = time.perf_counter


def timed(function):
    start = clock()
    function()
    return clock() - start


def backward_sample(root, leaves):
    """One backward of ``root`` after clearing the leaves' grads."""

    def sample():
        for leaf in leaves:
            leaf.grad = None
        gc.collect()
        return timed(root.backward)

    return sample


# -- DeZero ----------------------------------------------------------------------------------

def dezero_mlp():
    """The MLP of DeZero's MNIST example (step 51) on a seeded batch: the
    data, the labels, ``make_model() -> (model, optimizer)`` and
    ``step(model, optimizer)``."""
    import dezero
    import dezero.functions as F

    rng = np.random.RandomState(0)
    data = rng.rand(100, 784).astype(np.float32)
    labels = rng.randint(0, 10, size=100)

    def make_model():
        np.random.seed(0)
        model = dezero.models.MLP((1000, 1000, 10), activation=F.relu)
        optimizer = dezero.optimizers.SGD(0.1).setup(model)
        return model, optimizer

    def step(model, optimizer):
        loss = F.softmax_cross_entropy(model(data), labels)
        model.cleargrads()
        loss.backward()
        optimizer.update()
        return loss

    return data, labels, make_model, step


def dezero_benchmarks():
    import dezero
    import dezero.functions as F
    from dezero import Variable

    from pyengine.adapters import dezero as adapter

    def chain():
        x = Variable(np.ones(3))
        y = x
        for _ in range(CHAIN):
            y = -y
        return x, y

    def wide():
        x = Variable(np.ones(3))
        total = None
        for _ in range(WIDE_BRANCHES):
            y = x
            for _ in range(WIDE_DEPTH):
                y = -y
            total = y if total is None else total + y
        return x, total

    def built(build):
        """The graph for each engine, checked against each other."""
        graphs = {}
        for engine in ("native", "pyengine"):
            with adapter.installed() if engine == "pyengine" else _nothing():
                graphs[engine] = build()
                x, y = graphs[engine]
                y.backward()
                x_grad = x.grad.data.copy()
            graphs[engine + "_grad"] = x_grad
        np.testing.assert_allclose(graphs["pyengine_grad"], graphs["native_grad"], rtol=1e-12)
        return graphs

    def on_engine(engine, function):
        def sample():
            with adapter.installed() if engine == "pyengine" else _nothing():
                return function()
        return sample

    benchmarks = []
    graphs_by_name = {}
    for name, build in (("DeZero chain 10k, backward", chain), ("DeZero wide 1000x10, backward", wide)):
        graphs = graphs_by_name[name] = built(build)
        benchmarks.append(Benchmark(
            name,
            on_engine("native", backward_sample(graphs["native"][1], [graphs["native"][0]])),
            on_engine("pyengine", backward_sample(graphs["pyengine"][1], [graphs["pyengine"][0]]))))

    data, labels, make_model, step = dezero_mlp()

    models, params = {}, {}
    for engine in ("native", "pyengine"):
        # Oracle: one step each from the same weights (drawn at the first
        # forward, right after seeding) gives the same parameters.
        with adapter.installed() if engine == "pyengine" else _nothing():
            models[engine] = make_model()
            step(*models[engine])
        params[engine] = {}
        models[engine][0]._flatten_params(params[engine])
    for name, param in params["native"].items():
        np.testing.assert_allclose(params["pyengine"][name].data, param.data, rtol=1e-5, atol=1e-6)
    benchmarks.append(Benchmark("DeZero MLP step (forward+backward+SGD)",
                                step_in_fresh_process("dezero", "native"),
                                step_in_fresh_process("dezero", "pyengine")))

    def mlp_backward(engine):
        model, _ = models[engine]
        with adapter.installed() if engine == "pyengine" else _nothing():
            loss = F.softmax_cross_entropy(model(data), labels)

        def sample():
            model.cleargrads()
            gc.collect()
            with adapter.installed() if engine == "pyengine" else _nothing():
                return timed(loss.backward)

        return sample

    benchmarks.append(Benchmark("DeZero MLP backward", mlp_backward("native"),
                                mlp_backward("pyengine")))

    # Where a chain node's time goes: its backward formula (``-gy``, one
    # DeZero Function call, not recording), and the engine alone (a chain of
    # pass-through nodes carrying a Variable, as the adapter runs it).
    gradient = Variable(np.ones(3))

    def formula(engine):
        def sample():
            with adapter.installed() if engine == "pyengine" else _nothing():
                previous = dezero.Config.enable_backprop
                dezero.Config.enable_backprop = False
                try:
                    return timed(lambda: [-gradient for _ in range(CHAIN)])
                finally:
                    dezero.Config.enable_backprop = previous
        return sample

    # The owner graph's backward of a chain Function (DeZero's mode, Config
    # off), `-gy` included, called directly: the rest is the walk's. And the
    # walk alone: DeZero's graph read by the adapter's parents, a
    # pass-through backward, Variable gradients (See Note [DeZero as an
    # owner graph] in pyengine/adapters/dezero/owner_backward.py).
    import pyengine
    from pyengine.adapters.dezero import owner_backward

    chain_x, chain_root = graphs_by_name["DeZero chain 10k, backward"]["pyengine"]
    chain_functions = []
    function = chain_root.creator
    while function is not None:
        chain_functions.append(function)
        function = function.inputs[0].creator
    function_backward = owner_backward._backward(False)

    def backward_each():
        for function in chain_functions:
            function_backward(function, [gradient])  # dropped at once, as the walk drops it

    def backward_only():
        with adapter.installed():
            previous = dezero.Config.enable_backprop
            dezero.Config.enable_backprop = False
            try:
                return timed(backward_each)
            finally:
                dezero.Config.enable_backprop = previous

    pass_through = pyengine.OwnerGraph(owner_backward._parents, lambda function, grads: grads,
                                       mode="returns", accumulate=owner_backward._accumulate)

    def walk_only():
        chain_x.grad = None
        gc.collect()
        return timed(lambda: pass_through.backward(chain_root.creator, gradient))

    components = [
        Component("DeZero chain: `-gy` with DeZero's Function.__call__", formula("native"), CHAIN),
        Component("DeZero chain: `-gy` with the adapter's Function.__call__", formula("pyengine"), CHAIN),
        Component("DeZero chain: the owner graph's backward of a Function (its `-gy` included), "
                  "called directly", backward_only, CHAIN),
        Component("DeZero chain: the owner-graph walk alone (pass-through backward, Variable "
                  "gradients)", walk_only, CHAIN),
    ]
    return benchmarks, components


# -- micrograd --------------------------------------------------------------------------------

def micrograd_mlp():
    """``MLP(2, [16, 16, 1])`` on 20 seeded points with a squared loss:
    ``make_model()``, ``loss_of(model)`` and ``step(model)`` (SGD)."""
    from micrograd.nn import MLP

    rng = random.Random(0)
    points = [[rng.uniform(-1, 1), rng.uniform(-1, 1)] for _ in range(20)]
    targets = [1.0 if a * b > 0 else -1.0 for a, b in points]

    def make_model():
        random.seed(1)
        return MLP(2, [16, 16, 1])

    def loss_of(model):
        return sum((model(x) - y) ** 2 for x, y in zip(points, targets))

    def step(model):
        loss = loss_of(model)
        model.zero_grad()
        loss.backward()
        for p in model.parameters():
            p.data -= 0.01 * p.grad
        return loss

    return make_model, loss_of, step


def micrograd_benchmarks():
    from micrograd.engine import Value

    from pyengine.adapters import micrograd as adapter

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 100_000))

    def chain():
        x = Value(0.5)
        y = x
        for _ in range(CHAIN):
            y = y * 1.0001
        return x, y

    def all_values(root):
        """Every Value of ``root``'s graph (micrograd never clears a .grad:
        samples reset them all, outside the timed region, so that each
        sample does the same sums)."""
        values, seen, stack = [], set(), [root]
        while stack:
            value = stack.pop()
            if id(value) not in seen:
                seen.add(id(value))
                values.append(value)
                stack.extend(value._prev)
        return values

    make_model, loss_of, _ = micrograd_mlp()

    graphs = {}
    for engine in ("native", "pyengine"):
        with adapter.installed() if engine == "pyengine" else _nothing():
            x, y = chain()
            y.backward()
            model = make_model()
            loss = loss_of(model)
            loss.backward()
            graphs[engine] = {"chain": (x, y), "mlp": (model, loss),
                              "grads": [x.grad] + [p.grad for p in model.parameters()]}
    np.testing.assert_allclose(graphs["pyengine"]["grads"], graphs["native"]["grads"], rtol=1e-12)

    def on_engine(engine, function):
        def sample():
            with adapter.installed() if engine == "pyengine" else _nothing():
                return function()
        return sample

    def backward_of(engine, graph):
        root = graphs[engine][graph][1]
        values = all_values(root)

        def sample():
            for value in values:
                value.grad = 0
            gc.collect()
            return timed(root.backward)

        return sample

    # Where an MLP node's time goes: micrograd's own topological sort, the
    # closures alone (in that order), and the engine alone (the owner graph
    # run with each Value's _backward a C no-op instead of the closure).
    native_root = graphs["native"]["mlp"][1]
    pyengine_root = graphs["pyengine"]["mlp"][1]
    nodes = sum(1 for value in all_values(pyengine_root) if value._prev)

    def topological_sort():
        # micrograd's build_topo, as in Value.backward
        topo, visited = [], set()

        def build_topo(v):
            if v not in visited:
                visited.add(v)
                for child in v._prev:
                    build_topo(child)
                topo.append(v)

        build_topo(native_root)
        return topo

    order = list(reversed(topological_sort()))

    def closures():
        gc.collect()
        return timed(lambda: [v._backward() for v in order])

    def sort_only():
        gc.collect()
        return timed(topological_sort)

    def engine_only():
        # int() is a C call that does nothing; swapped in and out untimed.
        closures = [(value, value._backward) for value in all_values(pyengine_root) if value._prev]
        for value, _ in closures:
            value._backward = int
        try:
            with adapter.installed():
                return backward_of("pyengine", "mlp")()
        finally:
            for value, closure in closures:
                value._backward = closure

    components = [
        Component("micrograd MLP: micrograd's topological sort", sort_only, nodes),
        Component("micrograd MLP: the closures alone", closures, nodes),
        Component("micrograd MLP: engine alone (each _backward a C no-op, not the closure)", engine_only,
                  nodes),
    ]

    return [
        Benchmark("micrograd chain 10k, backward", on_engine("native", backward_of("native", "chain")),
                  on_engine("pyengine", backward_of("pyengine", "chain"))),
        Benchmark("micrograd MLP backward", on_engine("native", backward_of("native", "mlp")),
                  on_engine("pyengine", backward_of("pyengine", "mlp"))),
        Benchmark("micrograd MLP step (forward+backward+SGD)",
                  step_in_fresh_process("micrograd", "native"),
                  step_in_fresh_process("micrograd", "pyengine")),
    ], components


# -- an owner graph in returns mode ------------------------------------------------------------

class Link:
    """An owner of a plain Python framework whose backward returns its
    parents' gradients."""

    __slots__ = ("parents", "grad")

    def __init__(self, parents):
        self.parents = parents
        self.grad = None

    def backward(self, grads):
        return [0.5 * grads[0]]


def own_backward(root, grad):
    """The loop a framework writes for itself: a depth-first sort, then the
    methods in reverse, gradients summed in a dict; leaves get ``.grad``."""
    order, seen, stack = [], {id(root)}, [(root, iter(root.parents))]
    while stack:
        owner, parents = stack[-1]
        for parent in parents:
            if id(parent) not in seen:
                seen.add(id(parent))
                stack.append((parent, iter(parent.parents)))
                break
        else:
            stack.pop()
            order.append(owner)
    grads = {id(root): grad}
    for owner in reversed(order):
        gradient = grads.pop(id(owner))
        if not owner.parents:
            owner.grad = gradient if owner.grad is None else owner.grad + gradient
            continue
        for parent, parent_grad in zip(owner.parents, owner.backward([gradient])):
            old = grads.get(id(parent))
            grads[id(parent)] = parent_grad if old is None else old + parent_grad


def owner_graph_benchmarks():
    import pyengine

    leaf = Link(())
    root = leaf
    for _ in range(CHAIN):
        root = Link((root,))
    graph = pyengine.OwnerGraph("parents", "backward", mode="returns")
    seed = np.ones(3)
    grads = []
    for run in (own_backward, graph.backward):
        leaf.grad = None
        run(root, seed)
        grads.append(leaf.grad)
    np.testing.assert_array_equal(grads[0], grads[1])

    def sample_of(run):
        def sample():
            leaf.grad = None
            gc.collect()
            return timed(lambda: run(root, seed))
        return sample

    return [Benchmark("owner graph returns mode chain 10k, backward", sample_of(own_backward),
                      sample_of(graph.backward))], []


# -- HIPS autograd -------------------------------------------------------------------------------

def autograd_benchmarks():
    import autograd.core
    import autograd.numpy as anp
    from autograd.core import VJPNode
    from autograd.tracer import trace

    import pyengine
    from pyengine.adapters import autograd as adapter

    def chain(x):
        for _ in range(CHAIN):
            x = anp.negative(x)
        return x

    def wide(x):
        total = None
        for _ in range(WIDE_BRANCHES):
            y = x
            for _ in range(WIDE_DEPTH):
                y = anp.negative(y)
            total = y if total is None else total + y
        return total

    def fan_in(x):
        total = x
        for _ in range(CHAIN):
            total = total + x
        return total

    def end_node_of(function):
        # The graph make_vjp traces (forward never touches the engine, so
        # one graph serves both).
        _, end_node = trace(VJPNode.new_root(), function, np.ones(3))
        return end_node

    seed = np.ones(3)
    rows = []
    for name, function in (("chain 10k", chain), (f"wide {WIDE_BRANCHES}x{WIDE_DEPTH}", wide),
                           ("fan-in 10k", fan_in)):
        end_node = end_node_of(function)
        native = autograd.core.backward_pass(seed, end_node)
        with adapter.installed():
            ours = autograd.core.backward_pass(seed, end_node)
        np.testing.assert_allclose(ours, native, rtol=1e-12)

        def sample_of(engine, end_node=end_node):
            def sample():
                with adapter.installed() if engine == "pyengine" else _nothing():
                    # Looked up where make_vjp looks it up: the patched one
                    # when installed.
                    backward_pass = autograd.core.backward_pass
                    gc.collect()
                    return timed(lambda: backward_pass(seed, end_node))
            return sample

        rows.append(Benchmark(f"autograd {name}, backward", sample_of("native"),
                              sample_of("pyengine")))

    # Where a chain node's time goes: autograd's toposort, the vjps alone
    # (each node's on a fixed gradient, in order), and the engine alone (the
    # owner graph run with a C callable in place of the vjps: a dict's get,
    # which hands each node's gradient list back as its one parent's).
    from autograd.util import toposort

    end_node = end_node_of(chain)
    nodes = list(toposort(end_node))
    engine_only = pyengine.OwnerGraph("parents", {}.get, mode="returns", accumulate={}.get)

    def sort_only():
        gc.collect()
        return timed(lambda: list(toposort(end_node)))

    def vjps_only():
        gc.collect()
        return timed(lambda: [node.vjp(seed) for node in nodes])

    def engine_alone():
        gc.collect()
        return timed(lambda: engine_only.backward(end_node, seed))

    components = [
        Component("autograd chain: autograd's toposort", sort_only, CHAIN),
        Component("autograd chain: the vjps alone", vjps_only, CHAIN),
        Component("autograd chain: engine alone (a C callable for each vjp)", engine_alone, CHAIN),
    ]
    return rows, components


# -- Chainer --------------------------------------------------------------------------------------

ONE_NODE_CALLS = 1_000


def chainer_benchmarks():
    import chainer

    from pyengine.adapters import chainer as adapter

    def chain(x):
        y = x
        for _ in range(CHAIN):
            y = -y
        return y

    def wide(x):
        total = None
        for _ in range(WIDE_BRANCHES):
            y = x
            for _ in range(WIDE_DEPTH):
                y = -y
            total = y if total is None else total + y
        return total

    def one_node(x):
        return -x

    seed = np.ones(3)
    rows = []
    for name, function, calls in (("chain 10k", chain, 1),
                                  (f"wide {WIDE_BRANCHES}x{WIDE_DEPTH}", wide, 1),
                                  (f"one node x{ONE_NODE_CALLS}", one_node, ONE_NODE_CALLS)):
        # Chainer's graph is made in forward and kept by backward: one graph
        # serves both engines.
        x = chainer.Variable(np.linspace(-1.0, 1.0, 3))
        y = function(x)

        def backward(x=x, y=y, calls=calls):
            for _ in range(calls):
                x.cleargrad()
                y.grad = seed
                y.backward()
            return x.grad

        native = backward()
        with adapter.installed():
            ours = backward()
        np.testing.assert_allclose(ours, native, rtol=1e-12)

        def sample_of(engine, backward=backward):
            def sample():
                with adapter.installed() if engine == "pyengine" else _nothing():
                    gc.collect()
                    return timed(backward)
            return sample

        rows.append(Benchmark(f"chainer {name}, backward", sample_of("native"),
                              sample_of("pyengine")))
    return rows, []


# -- training steps, each sample in a fresh process ------------------------------------------

WARMUP_STEPS, TIMED_STEPS = 2, 5


def step_in_fresh_process(framework, engine):
    """A sample: the mean time of a training step in a new process (see
    ``step_worker``), as a user's script runs it: the cyclic GC sees only
    that program's objects, not this one's graphs."""

    def sample():
        command = [sys.executable, os.path.abspath(__file__), "--worker", framework,
                   "--engine", engine, "--clock", "cpu" if clock is time.process_time else "wall"]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        return float(result.stdout.split()[-1])

    return sample


def step_worker(framework, engine):
    """Build ``framework``'s MLP (with the adapter installed for pyengine),
    run ``WARMUP_STEPS`` steps, then print the mean time of
    ``TIMED_STEPS`` more."""
    if framework == "dezero":
        from pyengine.adapters import dezero as adapter

        if engine == "pyengine":
            adapter.install()
        _, _, make_model, step = dezero_mlp()
        model = make_model()
        run_step = lambda: step(*model)  # noqa: E731
    else:
        from pyengine.adapters import micrograd as adapter

        if engine == "pyengine":
            adapter.install()
        make_model, _, step = micrograd_mlp()
        model = make_model()
        run_step = lambda: step(model)  # noqa: E731
    for _ in range(WARMUP_STEPS):
        run_step()
    total = timed(lambda: [run_step() for _ in range(TIMED_STEPS)])
    print(total / TIMED_STEPS)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


# -- report -------------------------------------------------------------------------------------

GOALS = {
    "DeZero chain 10k, backward": (2.0, "DeZero on pyengine >= 2x faster on the chain"),
    "DeZero wide 1000x10, backward": (5.0, "DeZero on pyengine >= 5x faster on the wide graph"),
    "micrograd chain 10k, backward": (1.0, "micrograd on pyengine no slower than native (chain)"),
    "micrograd MLP backward": (1.0, "micrograd on pyengine no slower than native (MLP backward)"),
    "micrograd MLP step (forward+backward+SGD)": (
        1.0, "micrograd on pyengine no slower than native (MLP training step)"),
    "autograd chain 10k, backward": (1.5, "autograd on pyengine >= 1.5x faster on the chain"),
    f"autograd wide {WIDE_BRANCHES}x{WIDE_DEPTH}, backward": (
        1.5, "autograd on pyengine >= 1.5x faster on the wide graph"),
    "autograd fan-in 10k, backward": (1.5, "autograd on pyengine >= 1.5x faster on the fan-in"),
    "chainer chain 10k, backward": (2.0, "Chainer on pyengine >= 2x faster on the chain"),
    f"chainer wide {WIDE_BRANCHES}x{WIDE_DEPTH}, backward": (
        2.0, "Chainer on pyengine >= 2x faster on the wide graph"),
    f"chainer one node x{ONE_NODE_CALLS}, backward": (
        1.0, "Chainer on pyengine no slower than native (one-node backward)"),
}


def report(benchmarks, components, markdown):
    def cell(summary):
        return "{:.2f} ({:.2f}-{:.2f})".format(*summary)

    report_times(benchmarks, markdown, cell)
    report_goals(benchmarks, markdown)
    if components:
        print()
        if markdown:
            print("| where the time goes | us per node |")
            print("|---|---:|")
        for component in components:
            if markdown:
                print(f"| {component.name} | {cell(component.summary())} |")
            else:
                print(f"{component.name}: {cell(component.summary())} us/node")


def report_times(benchmarks, markdown, cell):
    if markdown:
        print("| benchmark | native ms | pyengine ms | native / pyengine |")
        print("|---|---:|---:|---:|")
        for b in benchmarks:
            print(f"| {b.name} | {cell(b.summary('native'))} | {cell(b.summary('pyengine'))} | "
                  f"{b.ratio():.2f}x |")
        print()
    else:
        width = max(len(b.name) for b in benchmarks)
        print(f"{'benchmark':<{width}}  {'native ms':>24}  {'pyengine ms':>24}  native/pyengine")
        for b in benchmarks:
            print(f"{b.name:<{width}}  {cell(b.summary('native')):>24}  "
                  f"{cell(b.summary('pyengine')):>24}  {b.ratio():.2f}x")
        print()


def report_goals(benchmarks, markdown):
    if markdown:
        print()
        print("| goal | measured | status |")
        print("|---|---|---|")
    for b in benchmarks:
        if b.name in GOALS:
            target, text = GOALS[b.name]
            status = "met" if b.ratio() >= target else "missed"
            if markdown:
                print(f"| {text} | {b.ratio():.2f}x | {status} |")
            else:
                print(f"goal: {text}: {b.ratio():.2f}x, {status}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--only", choices=["dezero", "micrograd", "owners", "autograd", "chainer"])
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: time.perf_counter (default); cpu: time.process_time")
    parser.add_argument("--worker", choices=["dezero", "micrograd"], help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=["native", "pyengine"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.worker:
        step_worker(args.worker, args.engine)
        return

    import pyengine

    if pyengine.IMPLEMENTATION != "compiled":
        print(f"warning: pyengine's {pyengine.IMPLEMENTATION} core", file=sys.stderr)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    start_load = load_average()
    t0 = time.perf_counter()
    benchmarks, components = [], []
    for framework, make in (("dezero", dezero_benchmarks), ("micrograd", micrograd_benchmarks),
                            ("owners", owner_graph_benchmarks), ("autograd", autograd_benchmarks),
                            ("chainer", chainer_benchmarks)):
        if args.only in (None, framework):
            try:
                rows, parts = make()
            except ImportError as error:
                if args.only is not None:
                    raise
                print(f"skipped {framework}: {error}", file=sys.stderr)
                continue
            benchmarks += rows
            components += parts
    gc.collect()
    gc.freeze()  # the graphs built above: out of every later GC pass
    for _ in range(args.repeats):
        for benchmark in benchmarks + components:
            benchmark.run_once()
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    def version(name):
        try:
            return installed_version(name)
        except PackageNotFoundError:
            return "not installed"

    print(f"pyengine adapters_bench.py, started {started}; wall time {time.perf_counter() - t0:.0f} s; "
          f"python {platform.python_version()}; numpy {np.__version__}; dezero {version('dezero')}; "
          f"micrograd {version('micrograd')}; autograd {version('autograd')}; "
          f"chainer {version('chainer')}; "
          f"pyengine {pyengine.IMPLEMENTATION} core; {os.cpu_count()} CPUs; load average at start "
          f"{start_load}, at end {load_average()}")
    print(f"{args.repeats} samples per benchmark, native and pyengine interleaved; "
          f"median (min-max), ms per call, {args.clock} clock")
    print()
    report(benchmarks, components, args.markdown)


if __name__ == "__main__":
    main()
