"""Random backward graphs as plain data, built and run in either core.

The cross-core differential tests (tests/test_cross_core.py) build the SAME
graph from one spec in the compiled core (``pyengine._node``,
``pyengine._engine``) and in the pure twin (``pyengine._pure.node``,
``pyengine._pure.engine``), in one process, run each with its own core's
``Engine.execute``, and compare what happened. A spec is plain data
(``GraphSpec``), so a failing one prints as a value and can be replayed.

What a spec holds:

- nodes: index 0 is a root; node k's edges lead to nodes of higher index or
  to leaves (AccumulateGrad of a leaf variable), so the graph has no cycle.
  Fan-in, fan-out and diamonds come from several edges into one node.
- each node is made on one of ``num_threads`` builder threads, fresh for
  each build, so sequence numbers (per thread) tie across threads as they
  do in a framework that records on several threads, and are the same in
  both builds.
- node kinds: ``plain`` (returns ``coefficient * sum of its gradients``
  along each edge, or None along an edge whose coefficient is None),
  ``raise`` (raises ValueError naming itself), ``gradient_free`` (a
  GradientFreeNode whose owner logs), ``callback`` (a plain node that also
  queues a final callback with its core's Engine), ``nested`` (a plain node
  that first runs a backward of its own through a two-node chain: a
  reentrant backward).
- each node logs the grad mode and ``is_checkpoint_valid()`` of its core
  as it runs.
- hooks: node pre-hooks (which scale the gradients), post-hooks, tensor
  pre-hooks on one slot (which halve its gradient), retains-grad hooks on
  one slot, post-accumulate-grad hooks on leaves.
- the run: ``backward`` (every node), ``backward_inputs`` (accumulate only
  into some leaves: ``outputs`` with ``accumulate_grad=True``) or ``grad``
  (capture the gradients flowing into some edges), one or several roots,
  and one or two runs (the first with ``keep_graph=True``).

``run_spec(core, spec)`` returns everything observable: the log (nodes in
the order they ran, with every hook and callback and the gradient it saw,
as bytes), each leaf's ``.grad`` and the captured gradients after each run
(bytes: bitwise), and the error of each run (type name and message).
"""

from __future__ import annotations

import importlib
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

SHAPE = (2,)

# Coefficients that keep sums exact enough to be interesting, not exact:
# the order in which gradients are summed shows in the last bits.
COEFFICIENTS = (0.5, 1.25, -0.75, 3.0, 0.1, 1.0 / 3.0)


@dataclass
class EdgeSpec:
    target: tuple  # ("node", k) or ("leaf", j)
    input_nr: int
    coefficient: float | None  # None: the node returns None along this edge


@dataclass
class NodeSpec:
    thread: int
    kind: str  # "plain", "raise", "gradient_free", "callback"
    num_inputs: int
    edges: list  # of EdgeSpec or None
    pre_hook: bool = False
    post_hook: bool = False
    tensor_pre_hook: int | None = None  # the slot
    retains_grad_hook: int | None = None  # the slot


@dataclass
class GraphSpec:
    num_threads: int
    nodes: list
    num_leaves: int
    leaf_hooks: list  # leaf indices with a post-accumulate-grad hook
    mode: str  # "backward", "backward_inputs", "grad"
    roots: list  # node indices
    outputs: list = field(default_factory=list)  # (("node", k) | ("leaf", j), input_nr)
    runs: int = 1


def random_spec(seed):
    """A GraphSpec drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    # A third of the specs are all plain nodes or all gradient-free nodes:
    # the graphs a chain-rule oracle reads, and graphs of owner-driven
    # nodes alone.
    flavour = rng.choices(["mixed", "plain", "gradient_free"], [4, 1, 1])[0]
    num_nodes = rng.randint(1, 9)
    num_leaves = rng.randint(1, 3)
    num_threads = rng.randint(1, 3)
    num_inputs = [rng.randint(1, 2) for _ in range(num_nodes)]
    nodes = []
    for k in range(num_nodes):
        if flavour == "mixed":
            kind = rng.choices(["plain", "raise", "gradient_free", "callback", "nested"],
                               [20, 1, 2, 1, 1])[0]
        else:
            kind = flavour
        edges = []
        for _ in range(rng.randint(0, 3)):
            if rng.random() < 0.1:
                edges.append(None)
                continue
            # All gradient-free: no leaf either, or the compiled core's own
            # loop would not take the graph.
            to_node_odds = 1.0 if flavour == "gradient_free" else 0.7
            if k + 1 < num_nodes and rng.random() < to_node_odds:
                target_index = rng.randint(k + 1, num_nodes - 1)
                target, input_nr = ("node", target_index), rng.randrange(num_inputs[target_index])
            elif flavour != "gradient_free":
                target, input_nr = ("leaf", rng.randrange(num_leaves)), 0
            else:
                continue
            coefficient = None if rng.random() < 0.1 else rng.choice(COEFFICIENTS)
            edges.append(EdgeSpec(target, input_nr, coefficient))
        nodes.append(NodeSpec(
            thread=rng.randrange(num_threads), kind=kind, num_inputs=num_inputs[k], edges=edges,
            # Hooks that change gradients only where no chain-rule oracle reads them.
            pre_hook=flavour != "plain" and rng.random() < 0.15, post_hook=rng.random() < 0.15,
            tensor_pre_hook=(rng.randrange(num_inputs[k])
                             if flavour != "plain" and rng.random() < 0.15 else None),
            retains_grad_hook=rng.randrange(num_inputs[k]) if rng.random() < 0.15 else None))
    roots = [0] if num_nodes == 1 or rng.random() < 0.7 else [0, rng.randint(1, num_nodes - 1)]
    mode = ("backward" if flavour != "mixed"
            else rng.choices(["backward", "backward_inputs", "grad"], [3, 1, 2])[0])
    outputs = []
    if mode == "backward_inputs":
        outputs = [(("leaf", j), 0) for j in sorted(rng.sample(range(num_leaves),
                                                                rng.randint(1, num_leaves)))]
    elif mode == "grad":
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.5:
                outputs.append((("leaf", rng.randrange(num_leaves)), 0))
            else:
                k = rng.randrange(num_nodes)
                outputs.append((("node", k), rng.randrange(num_inputs[k])))
    leaf_hooks = [j for j in range(num_leaves) if rng.random() < 0.3]
    return GraphSpec(num_threads=num_threads, nodes=nodes, num_leaves=num_leaves,
                     leaf_hooks=leaf_hooks, mode=mode, roots=roots, outputs=outputs,
                     runs=rng.choice([1, 1, 2]))


# -- the cores ---------------------------------------------------------------------------

def load_core(name):
    """The classes and engine of one core: ``compiled`` or ``pure``. Raises
    ImportError where the compiled core is not built."""
    if name == "compiled":
        node_module = importlib.import_module("pyengine._node")
        engine_module = importlib.import_module("pyengine._engine")
        state_module = importlib.import_module("pyengine._state")
    else:
        node_module = importlib.import_module("pyengine._pure.node")
        engine_module = importlib.import_module("pyengine._pure.engine")
        state_module = importlib.import_module("pyengine._pure.state")
    core = SimpleNamespace(
        name=name, NodeBase=node_module.NodeBase, Edge=node_module.Edge,
        GradientFreeNodeBase=node_module.GradientFreeNodeBase,
        AccumulateGradBase=node_module.AccumulateGradBase, LeafState=node_module.LeafState,
        set_sequence_nr=node_module._set_sequence_nr,
        accumulate_grad_sequence_nr=node_module.ACCUMULATE_GRAD_SEQUENCE_NR,
        Engine=engine_module.Engine, state=state_module)
    core.SpecNode, core.SpecGradientFreeNode, core.SpecAccumulateGrad = _node_classes(core)
    return core


def _node_classes(core):
    class SpecNode(core.NodeBase):
        """A plain node of a spec (also its ``raise`` and ``callback`` kinds)."""

        def __init__(self, label, kind, coefficients, next_edges, num_inputs, log, engine):
            super().__init__(next_edges=next_edges, input_metadata=[np.zeros(SHAPE)] * num_inputs)
            self.label, self.kind, self.coefficients = label, kind, coefficients
            self.log, self.engine = log, engine

        def name(self):
            return self.label

        def apply(self, grads):
            self.log.append(("run", self.label, [as_bytes(g) for g in grads],
                             core.state.is_grad_enabled(), core.state.is_checkpoint_valid()))
            if self.kind == "nested":
                self.run_nested()
            if self.kind == "raise":
                raise ValueError(f"{self.label} failed")
            if self.kind == "callback":
                label, log = self.label, self.log
                self.engine.queue_callback(lambda: log.append(("callback", label)))
            total = None
            for grad in grads:
                if grad is not None:
                    total = grad if total is None else total + grad
            return [None if total is None or coefficient is None else total * coefficient
                    for coefficient in self.coefficients]

        def run_nested(self):
            variable = Variable(f"{self.label}.x")
            accumulator = SpecAccumulateGrad(variable)
            inner = SpecNode(f"{self.label}.inner", "plain", [2.0],
                             [core.Edge(accumulator, 0)], 1, self.log, self.engine)
            outer = SpecNode(f"{self.label}.outer", "plain", [0.5],
                             [core.Edge(inner, 0)], 1, self.log, self.engine)
            self.engine.execute([core.Edge(outer, 0)], [np.ones(SHAPE)], False, False, True)
            self.log.append(("nested", self.label, as_bytes(variable.grad)))

    class SpecGradientFreeNode(core.GradientFreeNodeBase):
        def name(self):
            return self.owner.label

    class SpecAccumulateGrad(core.AccumulateGradBase):
        def __init__(self, variable):
            super().__init__(next_edges=(), input_metadata=[np.zeros(SHAPE)])
            core.set_sequence_nr(self, core.accumulate_grad_sequence_nr)
            self.variable = variable
            self.leaf_state = core.LeafState()

        def name(self):
            return f"AccumulateGrad({self.variable.label})"

    return SpecNode, SpecGradientFreeNode, SpecAccumulateGrad


class Variable:
    """A leaf tensor: what AccumulateGrad reads and writes."""

    def __init__(self, label):
        self.label = label
        self.grad = None
        self.data = np.zeros(SHAPE)


class Owner:
    """The owner of a gradient-free node: logs when its method runs."""

    def __init__(self, label, log):
        self.label, self.log = label, log

    def run(self):
        self.log.append(("run", self.label, "gradient-free"))


def as_bytes(value):
    if value is None:
        return None
    array = np.asarray(value)
    return (str(array.dtype), array.shape, array.tobytes())


# -- building ----------------------------------------------------------------------------

def build(core, spec, log, engine):
    """The nodes (``nodes[k]``) and leaves (``leaves[j]``: (variable,
    AccumulateGrad)) of ``spec`` in ``core``; node k made on its builder
    thread, after every node its edges lead to."""
    variables = [Variable(f"x{j}") for j in range(spec.num_leaves)]
    accumulators = [core.SpecAccumulateGrad(variable) for variable in variables]
    for j in spec.leaf_hooks:
        def leaf_hook(variable, j=j):
            log.append(("post_accumulate_grad", j, as_bytes(variable.grad)))
        accumulators[j].leaf_state.post_accumulate_grad_hooks = [(0, leaf_hook)]

    nodes = [None] * len(spec.nodes)

    def target_node(target):
        kind, index = target
        return nodes[index] if kind == "node" else accumulators[index]

    def make(k):
        node_spec = spec.nodes[k]
        label = f"N{k}"
        edges = [None if edge is None else core.Edge(target_node(edge.target), edge.input_nr)
                 for edge in node_spec.edges]
        if node_spec.kind == "gradient_free":
            node = core.SpecGradientFreeNode(Owner(label, log), "run", edges,
                                             [np.zeros(SHAPE)] * node_spec.num_inputs)
        else:
            coefficients = [None if edge is None else edge.coefficient for edge in node_spec.edges]
            node = core.SpecNode(label, node_spec.kind, coefficients, edges, node_spec.num_inputs,
                                 log, engine)
        add_hooks(node, node_spec, label, log)
        return node

    # Fresh threads for each build: their sequence counters start alike.
    builders = [ThreadPoolExecutor(max_workers=1) for _ in range(spec.num_threads)]
    try:
        for k in reversed(range(len(spec.nodes))):
            nodes[k] = builders[spec.nodes[k].thread].submit(make, k).result()
    finally:
        for builder in builders:
            builder.shutdown()
    return nodes, variables, accumulators


def add_hooks(node, node_spec, label, log):
    if node_spec.pre_hook:
        def pre_hook(grads):
            log.append(("pre", label, [as_bytes(g) for g in grads]))
            return tuple(None if g is None else g * 2.0 for g in grads)
        node._pre_hooks = [(0, pre_hook)]
    if node_spec.post_hook:
        def post_hook(grad_inputs, grad_outputs):
            log.append(("post", label, [as_bytes(g) for g in grad_inputs],
                        [as_bytes(g) for g in grad_outputs]))
        node._post_hooks = [(0, post_hook)]
    if node_spec.tensor_pre_hook is not None:
        def tensor_pre_hook(grad):
            log.append(("tensor_pre", label, as_bytes(grad)))
            return None if grad is None else grad * 0.5
        node._tensor_pre_hooks = [(0, node_spec.tensor_pre_hook, tensor_pre_hook)]
    if node_spec.retains_grad_hook is not None:
        def retains_grad_hook(grad):
            log.append(("retains_grad", label, as_bytes(grad)))
        node._retains_grad_hooks = {node_spec.retains_grad_hook: retains_grad_hook}


# -- running -----------------------------------------------------------------------------

ROOT_GRADIENT = np.array([1.0, -0.5])


def run_spec(core, spec):
    """Build ``spec`` in ``core`` and run it; everything observable, as plain data."""
    log = []
    engine = core.Engine()
    nodes, variables, accumulators = build(core, spec, log, engine)

    def edge_to(target, input_nr):
        kind, index = target
        return core.Edge(nodes[index] if kind == "node" else accumulators[index], input_nr)

    roots = [core.Edge(nodes[k], 0) for k in spec.roots]
    grads = [ROOT_GRADIENT * (i + 1) for i in range(len(roots))]
    outputs = [edge_to(target, input_nr) for target, input_nr in spec.outputs] or None
    runs = []
    for run in range(spec.runs):
        keep_graph = run + 1 < spec.runs
        error = captured = None
        try:
            captured = engine.execute(roots, grads, keep_graph, False, spec.mode != "grad", outputs)
        except Exception as caught:  # noqa: BLE001 - compared across the cores
            error = (type(caught).__name__, str(caught))
        runs.append({
            "log": list(log),
            "error": error,
            "captured": None if captured is None else [as_bytes(g) for g in captured],
            "leaf_grads": [as_bytes(variable.grad) for variable in variables],
        })
        log.clear()
        if error is not None:
            break
    return runs
