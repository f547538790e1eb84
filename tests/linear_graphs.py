"""Random graphs of linear pyengine Nodes, and an independent exact oracle.

A graph is first described by a plain *spec* (no pyengine objects), as a
forward pass would create it: leaves, then operations in creation order, each
taking forward inputs from earlier values (a leaf, an earlier op's output, or
a constant that does not require grad) and producing one or more outputs.
:func:`build` turns a spec into pyengine Nodes: one :class:`LinearNode` per
operation, whose ``apply`` maps the gradients of its outputs (its input slots)
to gradients of its forward inputs (its next edges) with fixed coefficients:

- ``("identity",)``: the incoming gradient is passed on *as the same object*
  (so the engine sees arrays that a node handed out and must not write into);
- ``("scalar", c)``: ``c * g`` with ``c`` a small integer or a power of two;
- ``("matrix", rows)``: ``M @ g`` with a small integer matrix.

All values are float64 with small integer (or dyadic) entries, so every sum
the engine computes is exact in any order and results compare with ``==``.
:func:`exactness_bits` bounds the bits that exactness needs.

The oracle (:func:`oracle`) never looks at a pyengine object: it runs reverse
accumulation over the spec with Python ``Fraction``s. Operations are numbered
in creation order and every input refers to an earlier value, so the reversed
creation order is a topological order of the backward graph. A slot that no
gradient reaches is ``None`` (the engine then leaves ``.grad`` as ``None``).

Value references (``ref``) are tuples: ``("leaf", i)`` or ``("op", k, out_nr)``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

import pyengine
from pyengine import _core

F64 = np.dtype(np.float64)

SCALARS = (1, -1, 2, -2, 3, 0.5, -0.5)


# -- tensors with the tensor protocol ------------------------------------------------

class Leaf:
    """A leaf tensor: ``grad_fn=None``, ``requires_grad=True``."""

    def __init__(self, data, requires_grad=True, name=None):
        self.data = data
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = requires_grad
        self.name = name

    def __repr__(self):
        return f"Leaf({self.name})"


class Value:
    """A non-leaf tensor: output ``output_nr`` of the op whose backward is ``grad_fn``."""

    def __init__(self, data, grad_fn, output_nr):
        self.data = data
        self.grad = None
        self.grad_fn = grad_fn
        self.output_nr = output_nr
        self.requires_grad = True

    def __repr__(self):
        return f"Value({self.grad_fn!r}, {self.output_nr})"


# -- the node -------------------------------------------------------------------------

class LinearNode(pyengine.Node):
    """``apply`` returns, for each next edge ``j``, the sum over ``terms[j]``
    (pairs ``(slot, coefficient)``) of ``coefficient . grads[slot]``, or None
    when no term has a gradient. ``coefficient`` is ``None`` (identity: the
    same object), a Python scalar, or a 2-d numpy matrix.

    ``log``, when not None, is a list that ``apply`` appends ``(self.tag,
    thread name)`` to; ``handed_out``, when not None, a list that every array
    ``apply`` returns is appended to, with a copy, so that a test can check
    that the engine never wrote into it.
    """

    __slots__ = ("terms", "tag", "log", "handed_out")

    def __init__(self, next_edges, input_metadata, terms, tag=None, log=None, handed_out=None):
        super().__init__(next_edges=next_edges, input_metadata=input_metadata)
        self.terms = terms
        self.tag = tag
        self.log = log
        self.handed_out = handed_out

    def name(self):
        return f"LinearNode[{self.tag}]"

    def apply(self, grads):
        if self.log is not None:
            self.log.append((self.tag, threading.current_thread().name))
        outputs = []
        for term_list in self.terms:
            acc = None
            for slot, coefficient in term_list:
                g = grads[slot] if slot < len(grads) else None
                if g is None:
                    continue
                if coefficient is None:
                    value = g
                elif isinstance(coefficient, np.ndarray):
                    value = coefficient @ g
                else:
                    value = coefficient * g
                acc = value if acc is None else acc + value
            outputs.append(acc)
        if self.handed_out is not None:
            for value in outputs:
                if value is not None:
                    self.handed_out.append((value, value.copy()))
        return outputs


# -- specs ----------------------------------------------------------------------------

@dataclass
class OpSpec:
    # Per forward input: a ref, or ("const", dim) for an input that does not
    # require grad (its next edge is None; the node still returns a gradient
    # for it, which the engine must ignore).
    inputs: list
    # Per forward output (= backward input slot): its length.
    out_dims: list
    # Per forward input j: list of (slot, coefficient spec).
    terms: list
    # How many input slots declare metadata (the rest grow on demand);
    # a declared slot may also be None (not checked).
    declared_slots: int = -1
    unchecked_slots: tuple = ()


@dataclass
class GraphSpec:
    leaf_dims: list
    ops: list = field(default_factory=list)

    def dim(self, ref):
        if ref[0] == "leaf":
            return self.leaf_dims[ref[1]]
        if ref[0] == "const":
            return ref[1]
        return self.ops[ref[1]].out_dims[ref[2]]

    def all_refs(self):
        refs = [("leaf", i) for i in range(len(self.leaf_dims))]
        for k, op in enumerate(self.ops):
            refs.extend(("op", k, i) for i in range(len(op.out_dims)))
        return refs


def _coefficient_array(coefficient):
    kind = coefficient[0]
    if kind == "identity":
        return None
    if kind == "scalar":
        return coefficient[1]
    return np.array(coefficient[1], dtype=F64)


class LinearGraph:
    """The pyengine objects built from a spec."""

    def __init__(self, spec, leaves, nodes, values):
        self.spec = spec
        self.leaves = leaves
        self.nodes = nodes
        self.values = values

    def tensor(self, ref):
        if ref[0] == "leaf":
            return self.leaves[ref[1]]
        return self.values[ref[1]][ref[2]]

    def edge(self, ref):
        """The Edge a gradient for ``ref`` enters the graph at."""
        return pyengine.gradient_edge(self.tensor(ref))


def build(spec, sequence_nrs=None, log=None, handed_out=None, node_class=None):
    """Build the Nodes of ``spec``. ``sequence_nrs`` (one per op) overrides
    the creation-order sequence numbers: the engine must be correct for any.
    ``node_class`` may be a subclass of LinearNode."""
    node_class = node_class or LinearNode
    leaves = [Leaf(np.zeros(d, dtype=F64), name=f"x{i}") for i, d in enumerate(spec.leaf_dims)]
    nodes = []
    values = []
    for k, op in enumerate(spec.ops):
        next_edges = []
        for ref in op.inputs:
            if ref[0] == "const":
                next_edges.append(None)
            elif ref[0] == "leaf":
                next_edges.append(pyengine.gradient_edge(leaves[ref[1]]))
            else:
                next_edges.append(pyengine.Edge(nodes[ref[1]], ref[2]))
        declared = len(op.out_dims) if op.declared_slots < 0 else op.declared_slots
        metadata = [None if i in op.unchecked_slots else ((d,), F64)
                    for i, d in enumerate(op.out_dims[:declared])]
        terms = [[(slot, _coefficient_array(c)) for slot, c in term_list] for term_list in op.terms]
        node = node_class(next_edges, metadata, terms, tag=k, log=log, handed_out=handed_out)
        if sequence_nrs is not None:
            _core.set_sequence_nr(node, sequence_nrs[k])
        nodes.append(node)
        values.append([Value(np.zeros(d, dtype=F64), node, i) for i, d in enumerate(op.out_dims)])
    return LinearGraph(spec, leaves, nodes, values)


# -- the oracle -----------------------------------------------------------------------

def _apply_coefficient(coefficient, vector):
    kind = coefficient[0]
    if kind == "identity":
        return list(vector)
    if kind == "scalar":
        c = Fraction(coefficient[1])
        return [c * v for v in vector]
    return [sum((Fraction(m) * v for m, v in zip(row, vector)), Fraction(0)) for row in coefficient[1]]


def _add(a, b):
    if a is None:
        return list(b)
    return [x + y for x, y in zip(a, b)]


def oracle(spec, roots):
    """Reverse accumulation over ``spec`` from ``roots``, pairs ``(ref, vector)``
    (repeated refs sum). Returns a dict ref -> list of Fractions, or None for a
    value no gradient reaches, for every leaf and every op output."""
    slots = {ref: None for ref in spec.all_refs()}
    for ref, vector in roots:
        slots[ref] = _add(slots[ref], [Fraction(v) for v in vector])
    for k in reversed(range(len(spec.ops))):
        op = spec.ops[k]
        incoming = [slots[("op", k, i)] for i in range(len(op.out_dims))]
        for ref, term_list in zip(op.inputs, op.terms):
            if ref[0] == "const":
                continue
            acc = None
            for slot, coefficient in term_list:
                if incoming[slot] is not None:
                    acc = _add(acc, _apply_coefficient(coefficient, incoming[slot]))
            if acc is not None:
                slots[ref] = _add(slots[ref], acc)
    return slots


def _abs_coefficient(coefficient):
    kind = coefficient[0]
    if kind == "scalar":
        return ("scalar", abs(coefficient[1]))
    if kind == "matrix":
        return ("matrix", [[abs(m) for m in row] for row in coefficient[1]])
    return coefficient


def _halvings(coefficient):
    if coefficient[0] == "scalar" and Fraction(coefficient[1]).denominator != 1:
        return Fraction(coefficient[1]).denominator.bit_length() - 1
    return 0


def exactness_bits(spec, roots, repeats=1):
    """Bits of mantissa that every partial sum the engine may form needs, with
    the backward run ``repeats`` times into the same leaves. float64 is exact
    while this stays at most 53."""
    abs_spec = GraphSpec(spec.leaf_dims, [
        OpSpec(op.inputs, op.out_dims, [[(s, _abs_coefficient(c)) for s, c in t] for t in op.terms])
        for op in spec.ops])
    bounds = oracle(abs_spec, [(ref, [abs(v) for v in vector]) for ref, vector in roots])
    # Halvings: the largest number of 1/2 factors along any path into a slot.
    halvings = {ref: 0 for ref in spec.all_refs()}
    for k in reversed(range(len(spec.ops))):
        op = spec.ops[k]
        top = max((halvings[("op", k, i)] for i in range(len(op.out_dims))), default=0)
        for ref, term_list in zip(op.inputs, op.terms):
            if ref[0] == "const":
                continue
            for _, coefficient in term_list:
                halvings[ref] = max(halvings[ref], top + _halvings(coefficient))
    worst = 0
    for ref, bound in bounds.items():
        if bound is None:
            continue
        biggest = max(bound, default=Fraction(0)) * repeats
        scaled = biggest * 2 ** halvings[ref]
        worst = max(worst, int(scaled).bit_length() + 1)
    return worst


def as_array(vector):
    """An oracle vector as the float64 array the engine should produce (exactly)."""
    return np.array([float(v) for v in vector], dtype=F64)


def equal(array, vector):
    """Exact comparison of an engine result with an oracle vector (None with None)."""
    if vector is None or array is None:
        return vector is None and array is None
    array = np.asarray(array)
    return array.dtype == F64 and array.shape == (len(vector),) and bool(
        (array == as_array(vector)).all())


def describe(array, vector):
    return f"engine={None if array is None else np.asarray(array).tolist()} oracle=" \
           f"{None if vector is None else [float(v) for v in vector]}"


# -- hypothesis strategies -----------------------------------------------------------

def _strategies():
    from hypothesis import strategies as st

    @st.composite
    def coefficient(draw, out_dim, in_dim):
        kinds = ["scalar", "matrix"] + (["identity"] if out_dim == in_dim else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "identity":
            return ("identity",)
        if kind == "scalar" and out_dim == in_dim:
            return ("scalar", draw(st.sampled_from(SCALARS)))
        entries = st.integers(-2, 2)
        return ("matrix", [[draw(entries) for _ in range(in_dim)] for _ in range(out_dim)])

    @st.composite
    def graph_specs(draw, max_leaves=4, max_ops=10, dims=(1, 2, 3)):
        n_leaves = draw(st.integers(1, max_leaves))
        spec = GraphSpec([draw(st.sampled_from(dims)) for _ in range(n_leaves)])
        refs = [("leaf", i) for i in range(n_leaves)]
        n_ops = draw(st.integers(1, max_ops))
        for k in range(n_ops):
            n_inputs = draw(st.integers(1, 3))
            inputs = []
            for _ in range(n_inputs):
                choice = draw(st.integers(0, 9))
                if choice <= 4:
                    # Prefer recent values: deeper graphs.
                    inputs.append(refs[-1 - draw(st.integers(0, min(3, len(refs) - 1)))])
                elif choice <= 6:
                    inputs.append(draw(st.sampled_from(refs)))
                elif choice <= 8:
                    inputs.append(("leaf", draw(st.integers(0, n_leaves - 1))))
                else:
                    inputs.append(("const", draw(st.sampled_from(dims))))
            out_dims = [draw(st.sampled_from(dims)) for _ in range(draw(st.integers(1, 3)))]
            terms = []
            for ref in inputs:
                in_dim = spec.dim(ref)
                # Each slot feeds this input with probability 3/4; none at all
                # (a None gradient along this edge) happens too.
                slots = [slot for slot in range(len(out_dims)) if draw(st.integers(0, 3)) != 3]
                terms.append([(slot, draw(coefficient(in_dim, out_dims[slot]))) for slot in slots])
            declared = -1
            unchecked = ()
            if draw(st.integers(0, 4)) == 0:
                declared = draw(st.integers(0, len(out_dims)))
            elif draw(st.integers(0, 4)) == 0:
                unchecked = (draw(st.integers(0, len(out_dims) - 1)),)
            spec.ops.append(OpSpec(inputs, out_dims, terms, declared, unchecked))
            refs.extend(("op", k, i) for i in range(len(out_dims)))
        return spec

    @st.composite
    def root_lists(draw, spec, max_roots=3, allow_leaf_roots=True):
        """Pairs (ref, integer vector); mostly op outputs, late ones preferred."""
        op_refs = [ref for ref in spec.all_refs() if ref[0] == "op"]
        candidates = spec.all_refs() if allow_leaf_roots else op_refs
        roots = []
        for _ in range(draw(st.integers(1, max_roots))):
            choice = draw(st.integers(0, 9))
            if choice <= 4:
                ref = op_refs[-1 - draw(st.integers(0, min(2, len(op_refs) - 1)))]
            elif choice <= 8:
                ref = draw(st.sampled_from(op_refs))
            else:
                ref = draw(st.sampled_from(candidates))
            vector = [draw(st.integers(-4, 4)) for _ in range(spec.dim(ref))]
            roots.append((ref, vector))
        return roots

    return graph_specs, root_lists


def graph_specs(**kwargs):
    """Hypothesis strategy of GraphSpecs."""
    return _strategies()[0](**kwargs)


def root_lists(spec, **kwargs):
    """Hypothesis strategy of root lists for ``spec``."""
    return _strategies()[1](spec, **kwargs)


def root_grad_arrays(roots, read_only=False):
    """The root gradients as float64 arrays. Writable by default: numpy's
    backend quietly adds out of place into a read-only array, so only a
    writable one shows (by comparison with a copy) that the engine wrote
    into an array it did not allocate."""
    arrays = []
    for _, vector in roots:
        array = np.array(vector, dtype=F64)
        array.flags.writeable = not read_only
        arrays.append(array)
    return arrays


# -- seeded graphs (outside hypothesis) ------------------------------------------------

def random_spec(rng, n_leaves=3, n_ops=12, dims=(1, 2, 3)):
    """A GraphSpec drawn with ``rng`` (a ``random.Random``), like
    :func:`graph_specs` but for tests that need a fixed graph of a given size."""
    spec = GraphSpec([rng.choice(dims) for _ in range(n_leaves)])
    refs = [("leaf", i) for i in range(n_leaves)]
    for k in range(n_ops):
        inputs = []
        for _ in range(rng.randint(1, 3)):
            choice = rng.randint(0, 9)
            if choice <= 4:
                inputs.append(refs[-1 - rng.randint(0, min(3, len(refs) - 1))])
            elif choice <= 6:
                inputs.append(rng.choice(refs))
            elif choice <= 8:
                inputs.append(("leaf", rng.randrange(n_leaves)))
            else:
                inputs.append(("const", rng.choice(dims)))
        out_dims = [rng.choice(dims) for _ in range(rng.randint(1, 3))]
        terms = []
        for ref in inputs:
            in_dim = spec.dim(ref)
            term_list = []
            for slot in range(len(out_dims)):
                if rng.randint(0, 3) == 3:
                    continue
                kinds = ["scalar", "matrix"] + (["identity"] if in_dim == out_dims[slot] else [])
                kind = rng.choice(kinds)
                if kind == "identity":
                    coefficient = ("identity",)
                elif kind == "scalar" and in_dim == out_dims[slot]:
                    coefficient = ("scalar", rng.choice(SCALARS))
                else:
                    coefficient = ("matrix", [[rng.randint(-2, 2) for _ in range(out_dims[slot])]
                                              for _ in range(in_dim)])
                term_list.append((slot, coefficient))
            terms.append(term_list)
        spec.ops.append(OpSpec(inputs, out_dims, terms))
        refs.extend(("op", k, i) for i in range(len(out_dims)))
    return spec


def random_roots(rng, spec, n_roots=2):
    """Root pairs on the outputs of the last ops, with small integer gradients."""
    op_refs = [ref for ref in spec.all_refs() if ref[0] == "op"]
    roots = []
    for _ in range(n_roots):
        ref = op_refs[-1 - rng.randint(0, min(2, len(op_refs) - 1))]
        roots.append((ref, [rng.randint(-3, 3) for _ in range(spec.dim(ref))]))
    return roots


def seeded_case(seed, n_leaves=3, n_ops=12, n_roots=2, repeats=1, min_reached_leaves=1):
    """(spec, roots, oracle) for the first seed at or after ``seed`` whose graph
    gives at least ``min_reached_leaves`` leaves a gradient and stays exact
    for ``repeats`` runs; deterministic."""
    import random

    while True:
        rng = random.Random(seed)
        spec = random_spec(rng, n_leaves, n_ops)
        roots = random_roots(rng, spec, n_roots)
        expected = oracle(spec, roots)
        reached = sum(expected[("leaf", i)] is not None for i in range(n_leaves))
        if reached >= min_reached_leaves and exactness_bits(spec, roots, repeats) <= 53:
            return spec, roots, expected
        seed += 1000003


# -- fixed shapes: chains and wide graphs --------------------------------------------

class ScaleNode(pyengine.Node):
    """One slot in, ``len(next_edges)`` gradients out: ``coefficient * g`` along
    each edge (``coefficient`` None passes the same object on)."""

    __slots__ = ("coefficient",)

    def __init__(self, next_edges, coefficient=None, metadata=None):
        super().__init__(next_edges=next_edges, input_metadata=(metadata,))
        self.coefficient = coefficient

    def apply(self, grads):
        g = grads[0]
        if g is None:
            return [None] * len(self._next_edges)
        value = g if self.coefficient is None else self.coefficient * g
        return [value] * len(self._next_edges)


def chain(n, leaf, coefficients):
    """A chain of ``n`` ScaleNodes ending in ``leaf``'s accumulator; node ``i``
    (from the leaf end, 0-based) scales by ``coefficients(i)``. Returns the
    node at the root end. Built iteratively."""
    edge = pyengine.gradient_edge(leaf)
    node = None
    for i in range(n):
        node = ScaleNode((edge,), coefficients(i))
        edge = pyengine.Edge(node, 0)
    return node


# -- reentrant chains ------------------------------------------------------------------

class ReentrantLevel(pyengine.Node):
    """Level ``k`` of a reentrant chain (see :func:`reentrant_chain`)."""

    __slots__ = ("k", "below", "below_leaf", "log", "error")

    def __init__(self, k, leaf, below, below_leaf, log=None, error=None):
        super().__init__(next_edges=(pyengine.gradient_edge(leaf),))
        self.k = k
        self.below = below
        self.below_leaf = below_leaf
        self.log = log
        self.error = error

    def name(self):
        return f"ReentrantLevel[{self.k}]"

    def apply(self, grads):
        if self.log is not None:
            thread = threading.current_thread()
            self.log.append((self.k, thread.ident, thread.name))
        if self.error is not None:
            raise self.error
        g = grads[0]
        if self.below is None:
            return [g]
        (inner,) = pyengine.grad(Value(np.zeros(2), self.below, 0), self.below_leaf,
                                 grad_outputs=g)
        return [g + inner]


def reentrant_chain(n, log=None, fail_at=None, error=None):
    """Levels 1..n, each with its own leaf of shape (2,). Level k's node starts
    a reentrant ``grad`` on level k - 1's graph and returns ``g + that``, so
    level k returns ``k * g`` and a backward from level n gives its leaf
    ``n * g`` (and no other leaf anything). ``log`` gets ``(k, thread ident,
    thread name)`` per level run; level ``fail_at`` raises ``error``.
    Returns ``(nodes, leaves)``, level 1 first."""
    nodes, leaves = [], []
    for k in range(1, n + 1):
        leaf = Leaf(np.zeros(2), name=f"level{k}")
        below, below_leaf = (nodes[-1], leaves[-1]) if nodes else (None, None)
        nodes.append(ReentrantLevel(k, leaf, below, below_leaf, log,
                                    error if k == fail_at else None))
        leaves.append(leaf)
    return nodes, leaves

