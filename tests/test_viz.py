"""pyengine.graph_to_dot / render_graph: the DOT text parsed back against known graphs.

Oracles: graphs built here, whose nodes, edges, slots, sequence numbers and
devices are known; for ``inputs=``, which nodes the engine itself runs
under ``grad(inputs=)`` and ``backward(inputs=)`` on random graphs; for
collapsing, that every node of the graph is drawn or counted in exactly one
collapsed box; where Graphviz's ``dot`` is installed, its own parse of the
text (``dot -Tplain``) and the SVG it renders.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree

import numpy as np
import pytest
from minitensor import leaf

import pyengine
from pyengine import fake_device as fd
from pyengine import viz

HAVE_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAVE_DOT, reason="Graphviz's dot program is not installed")

# -- a parser for the DOT subset graph_to_dot writes (one statement per line) --------------

_STATEMENT = re.compile(r'^\s*(?P<a>[A-Za-z_]\w*)(?:\s*->\s*(?P<b>[A-Za-z_]\w*))?\s*\[(?P<attrs>.*)\];$')
_ATTRIBUTE = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^,\s\]]+)')
_KEYWORDS = {"graph", "node", "edge"}


def _unquote(text):
    if not text.startswith('"'):
        return text
    out, i, body = [], 0, text[1:-1]
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            out.append("\n" if body[i + 1] == "n" else body[i + 1])
            i += 2
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


class Dot:
    """Nodes (id -> attributes) and edges ((a, b, attributes)) of DOT text."""

    def __init__(self, text):
        assert text.startswith("digraph backward {") and text.rstrip().endswith("}")
        self.nodes, self.edges, self.text = {}, [], text
        for line in text.splitlines()[1:-1]:
            match = _STATEMENT.match(line)
            if match is None or match["a"] in _KEYWORDS:
                continue
            attributes = {key: _unquote(value) for key, value in _ATTRIBUTE.findall(match["attrs"])}
            if match["b"] is None:
                assert match["a"] not in self.nodes, f"node {match['a']} declared twice"
                self.nodes[match["a"]] = attributes
            else:
                self.edges.append((match["a"], match["b"], attributes))
        for a, b, _ in self.edges:
            assert a in self.nodes and b in self.nodes, f"edge {a} -> {b} to an undeclared node"

    def with_class(self, word):
        return {name: attrs for name, attrs in self.nodes.items()
                if word in attrs.get("class", "").split()}

    def label_lines(self, name):
        return self.nodes[name]["label"].split("\n")

    def find(self, first_line):
        found = [name for name in self.nodes if self.label_lines(name)[0] == first_line]
        assert len(found) == 1, (first_line, found)
        return found[0]

    def edges_between(self, a, b):
        return [attrs["label"] for x, y, attrs in self.edges if (x, y) == (a, b)]


def dot_plain_counts(text):
    """(nodes, edges) as Graphviz's own parser counts them."""
    result = subprocess.run(["dot", "-Tplain"], input=text.encode(), capture_output=True,
                            check=True, timeout=120)
    lines = result.stdout.decode().splitlines()
    return (sum(line.startswith("node ") for line in lines),
            sum(line.startswith("edge ") for line in lines))


def check_with_dot(text, dot):
    if HAVE_DOT:
        assert dot_plain_counts(text) == (len(dot.nodes), len(dot.edges))


# -- graphs ------------------------------------------------------------------------------

class Tensor:
    """The tensor protocol, nothing more."""

    def __init__(self, data, grad_fn=None, output_nr=0):
        self.data = data
        self.grad = None
        self.grad_fn = grad_fn
        self.output_nr = output_nr
        self.requires_grad = True


class Op(pyengine.Node):
    """Sends its first slot's gradient along every next edge; logs that it ran."""

    def __init__(self, inputs, slots=1, device=None, name=None, log=None):
        metadata = [pyengine.InputMetadata((3,), np.float64, device or pyengine.CPU)
                    for _ in range(slots)]
        super().__init__([pyengine.gradient_edge(t) for t in inputs], metadata)
        self.label = name
        self.log = log

    def name(self):
        return self.label or "Op"

    def apply(self, grads):
        if self.log is not None:
            self.log.append(self)
        return [grads[0]] * len(self.next_edges)


def op(inputs, **kwargs):
    node = Op(inputs, **kwargs)
    return Tensor(np.ones(3), node)


def parse(roots, **kwargs):
    text = pyengine.graph_to_dot(roots, **kwargs)
    dot = Dot(text)
    check_with_dot(text, dot)
    return dot


# -- known graphs -------------------------------------------------------------------------

def test_a_small_graph_has_every_node_edge_slot_and_leaf():
    x, w = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    y = (x * w).exp().sum()
    dot = parse(y, params={"x": x, "w": w})
    # 3 op nodes + 2 accumulators + 2 leaves + the root output.
    assert len(dot.nodes) == 8
    assert len(dot.with_class("node")) == 3 and len(dot.with_class("accumulate")) == 2
    assert len(dot.with_class("leaf")) == 2 and len(dot.with_class("root")) == 1
    sum_node, exp_node = y.grad_fn, y.grad_fn.next_edges[0].node
    mul_node = exp_node.next_edges[0].node
    for node in (sum_node, exp_node, mul_node):
        name = dot.find(node.name())
        lines = dot.label_lines(name)
        assert lines[1] == f"seq {node.sequence_nr}"
        assert lines[-1] == "cpu"
    assert dot.label_lines(dot.find("SumBackward"))[2] == "in 0: () float64"
    assert dot.label_lines(dot.find("MulBackward"))[2] == "in 0: (2,) float64"
    mul = dot.find("MulBackward")
    accumulators = {dot.edges_between(mul, b)[0]: b for b in dot.with_class("accumulate")}
    assert set(accumulators) == {"0→0", "1→0"}
    leaf_of = {a: b for a, b, attrs in dot.edges if attrs["label"] == "grad"}
    assert dot.label_lines(leaf_of[accumulators["0→0"]])[0] == "x"
    assert dot.label_lines(leaf_of[accumulators["1→0"]])[0] == "w"
    assert dot.label_lines(leaf_of[accumulators["0→0"]])[1] == "(2,) float64"
    # AccumulateGrad has no meaningful sequence number: none is shown.
    assert not any(line.startswith("seq") for name in dot.with_class("accumulate")
                   for line in dot.label_lines(name))
    root = next(iter(dot.with_class("root")))
    assert dot.label_lines(root) == ["output 0", "() float64"]
    assert dot.edges_between(root, dot.find("SumBackward")) == ["→0"]
    # 4 graph edges, 2 accumulator -> leaf edges, 1 root edge.
    assert len(dot.edges) == 7


def test_a_node_used_twice_gets_one_edge_per_use():
    x = leaf([1.0, 2.0])
    y = x * x
    dot = parse(y)
    mul = dot.find("MulBackward")
    (accumulator,) = dot.with_class("accumulate")
    assert sorted(dot.edges_between(mul, accumulator)) == ["0→0", "1→0"]


def test_edges_name_the_input_slot_of_a_multi_output_node():
    x = Tensor(np.ones(3))
    x.requires_grad = True
    split = Op([x], slots=3, name="Split")
    a = Op([Tensor(np.ones(3), split, output_nr=2)], name="UsesSlot2")
    b = Op([Tensor(np.ones(3), split, output_nr=0)], name="UsesSlot0")
    top = Op([Tensor(np.ones(3), a), Tensor(np.ones(3), b)], name="Top")
    dot = parse(top)
    assert dot.edges_between(dot.find("UsesSlot2"), dot.find("Split")) == ["0→2"]
    assert dot.edges_between(dot.find("UsesSlot0"), dot.find("Split")) == ["0→0"]
    assert dot.edges_between(dot.find("Top"), dot.find("UsesSlot0")) == ["1→0"]
    assert dot.label_lines(dot.find("Split"))[2:5] == [f"in {i}: (3,) float64" for i in range(3)]
    # A Node as a root: no output ellipse, and the graph starts at it.
    assert not dot.with_class("root")


def test_roots_as_edges_tensors_and_several_at_once():
    x = leaf([1.0])
    y, z = x.exp(), x * 2.0
    dot = parse([y, pyengine.Edge(z.grad_fn, 0)])
    assert len(dot.with_class("root")) == 2
    exp_node, mul_node = dot.find("ExpBackward"), dot.find("MulBackward")
    roots = {dot.label_lines(r)[0]: r for r in dot.with_class("root")}
    assert dot.edges_between(roots["output 0"], exp_node) == ["→0"]
    assert dot.edges_between(roots["output 1"], mul_node) == ["→0"]
    # The two paths share x's accumulator: one box, two edges into it.
    (accumulator,) = dot.with_class("accumulate")
    assert [b for a, b, _ in dot.edges if a in (exp_node, mul_node)] == [accumulator] * 2


def test_device_comes_from_the_input_metadata():
    x = Tensor(np.ones(3))
    on_device = Op([x], device=fd.device(1), name="OnFake1")
    top = Op([Tensor(np.ones(3), on_device)], name="OnCpu")
    dot = parse(top)
    assert dot.label_lines(dot.find("OnFake1"))[-1] == "fake:1"
    assert dot.label_lines(dot.find("OnCpu"))[-1] == "cpu"


def test_nothing_is_created_or_run():
    x = leaf([1.0, 2.0])
    y = x * 3.0
    no_accumulator = leaf([5.0])  # never used: it has no AccumulateGrad
    pyengine.graph_to_dot([y, no_accumulator])
    assert getattr(no_accumulator, "_pyengine_leaf", None) is None
    pyengine.backward(y.sum())
    np.testing.assert_array_equal(x.grad, [3.0, 3.0])


def test_bad_roots_are_refused():
    with pytest.raises(TypeError, match="roots\\[0\\]"):
        pyengine.graph_to_dot(np.ones(3))
    with pytest.raises(ValueError):
        pyengine.graph_to_dot([])


# -- inputs=: what grad and backward(inputs=) prune, against the engine --------------------

def random_graph(rng, ops, leaves=4):
    """Random DAG of Op nodes over ``leaves`` leaves; every op is returned."""
    log = []
    values = [Tensor(np.ones(3)) for _ in range(leaves)]
    tensors = []
    for i in range(ops):
        inputs = rng.sample(values, rng.randint(1, min(3, len(values))))
        tensor = op(inputs, name=f"Op{i}", log=log)
        values.append(tensor)
        tensors.append(tensor)
    return values[:leaves], tensors, log


@pytest.mark.parametrize("seed", range(12))
def test_faded_nodes_are_exactly_those_grad_inputs_does_not_run(seed):
    rng = random.Random(seed)
    leaves, tensors, log = random_graph(rng, rng.randint(3, 25))
    root = tensors[-1]
    candidates = leaves + tensors[:-1]
    inputs = rng.sample(candidates, rng.randint(1, min(3, len(candidates))))
    dot = parse(root, inputs=inputs)
    results = pyengine.grad(root, inputs, grad_outputs=np.ones(3), retain_graph=True,
                            allow_unused=True)
    ran = {node.name() for node in log}
    by_status = {"runs": set(), "captured": set(), "pruned": set()}
    for name in dot.with_class("node"):
        classes = dot.nodes[name]["class"].split()
        status = "pruned" if "pruned" in classes else "captured" if "captured" in classes else "runs"
        by_status[status].add(dot.label_lines(name)[0])
    assert by_status["runs"] == ran
    # A captured node is one the gradient of an input enters.
    drawn = set().union(*by_status.values())
    input_nodes = {t.grad_fn.name() for t in inputs if t.grad_fn is not None}
    assert by_status["captured"] == (input_nodes & drawn) - ran
    # An input gets a gradient exactly when its node is in the picture (reachable).
    for value, result in zip(inputs, results):
        if value.grad_fn is not None:
            assert (result is not None) == (value.grad_fn.name() in drawn)


@pytest.mark.parametrize("seed", range(8))
def test_accumulate_grad_true_matches_backward_inputs(seed):
    rng = random.Random(100 + seed)
    leaves, tensors, log = random_graph(rng, rng.randint(3, 20))
    root = tensors[-1]
    # backward(inputs=) leaves: their AccumulateGrads run when reachable.
    for value in leaves:
        pyengine.gradient_edge(value)
    inputs = rng.sample(leaves, rng.randint(1, len(leaves)))
    dot = parse(root, inputs=inputs, accumulate_grad=True)
    pyengine.backward(root, np.ones(3), retain_graph=True, inputs=inputs)
    ran = {node.name() for node in log}
    drawn_running = {dot.label_lines(name)[0] for name in dot.with_class("node")
                     if "pruned" not in dot.nodes[name]["class"].split()}
    assert drawn_running == ran
    accumulators = dot.with_class("accumulate")
    running_leaves = sum("pruned" not in dot.nodes[name]["class"].split() for name in accumulators)
    assert running_leaves == sum(value.grad is not None for value in leaves)


def test_pruned_nodes_and_their_edges_look_faded():
    x, w = leaf([1.0]), leaf([2.0])
    y = (x * w).sum()
    dot = parse(y, inputs=[x])
    # w's accumulator and w itself; nothing else.
    assert sorted(attrs["class"] for attrs in dot.with_class("pruned").values()) == [
        "accumulate pruned", "leaf pruned"]
    (pruned,) = set(dot.with_class("pruned")) & set(dot.with_class("accumulate"))
    assert dot.nodes[pruned]["fontcolor"] == viz._STYLE_PRUNED["fontcolor"]
    faded = [attrs for a, b, attrs in dot.edges if b == pruned]
    assert faded and all(attrs["color"] == viz._EDGE_PRUNED["color"] for attrs in faded)
    captured = [n for n in dot.with_class("accumulate") if "captured" in dot.nodes[n]["class"]]
    assert len(captured) == 1 and dot.nodes[captured[0]]["peripheries"] == "2"


# -- large graphs --------------------------------------------------------------------------

def chain(n, name="Pass"):
    x = Tensor(np.ones(3))
    t = x
    for _ in range(n):
        t = op([t], name=name)
    return x, t


def mlp_like(layers):
    """Per layer: Addmm -> (bias accumulator, Relu of the layer below, T -> weight
    accumulator): 5 nodes per layer (2 of them AccumulateGrads)."""
    x = Tensor(np.ones(3))
    x.requires_grad = False
    t = x
    for _ in range(layers):
        weight, bias = Tensor(np.ones(3)), Tensor(np.ones(3))
        transposed = op([weight], name="TBackward")
        t = op([bias, t, transposed], name="AddmmBackward")
        t = op([t], name="ReluBackward")
    return t


def check_conservation(dot, total):
    """Every graph node is drawn as a box or counted in exactly one group."""
    boxes = len(dot.with_class("node")) + len(dot.with_class("accumulate"))
    grouped = sum(int(dot.label_lines(name)[-1].split()[0]) for name in dot.with_class("group"))
    assert boxes + grouped == total


def test_small_chains_are_not_collapsed():
    _, top = chain(10)
    dot = parse(top)
    assert len(dot.with_class("node")) == 10 and not dot.with_class("group")


def test_a_100k_chain_collapses_into_one_box():
    x, top = chain(100_000)
    started = time.perf_counter()
    text = pyengine.graph_to_dot(top)
    elapsed = time.perf_counter() - started
    dot = Dot(text)
    check_with_dot(text, dot)
    (group,) = dot.with_class("group")
    lines = dot.label_lines(group)
    assert lines[0] == "×100000  Pass"
    assert lines[-1] == "100000 nodes"
    first, last = top.grad_fn.sequence_nr, top.grad_fn.sequence_nr - 99_999
    assert f"seq {first} … {last}" in lines
    assert len(dot.nodes) == 4 and len(dot.edges) == 3  # root, group, accumulator (no leaf: x has none)
    assert elapsed < 60, f"graph_to_dot took {elapsed:.1f}s on a 100k chain"


def test_repeated_layers_collapse_with_their_side_branches():
    layers = 20_000  # 100k nodes, 40k of them AccumulateGrads
    top = mlp_like(layers)
    dot = parse(top)
    groups = dot.with_class("group")
    assert len(groups) == 1
    lines = dot.label_lines(next(iter(groups)))
    # The top layer's Relu starts the path; one repeat is (Relu, Addmm) with 3 side nodes.
    assert lines[0] in (f"×{layers}  ReluBackward → AddmmBackward",
                        f"×{layers - 1}  ReluBackward → AddmmBackward")
    assert lines[1] == "(+3 side nodes each)"
    check_conservation(dot, total=5 * layers)
    assert len(dot.nodes) < 30


def test_identical_branches_fold_into_one_box():
    shared = Tensor(np.ones(3))
    branches = []
    for _ in range(600):
        branches.append(Tensor(np.ones(3), Op([Tensor(np.ones(3), Op([shared], name="Inner"))],
                                              name="Outer")))
    top = op(branches, name="Fan")
    dot = parse(top)
    check_conservation(dot, total=1 + 2 * 600 + 1)
    labels = [dot.label_lines(name)[:2] for name in dot.with_class("group")]
    assert ["×599  Outer", "identical subtrees of 2 nodes"] in labels
    fan = dot.find("Fan")
    assert "×599" in [attrs["label"] for a, b, attrs in dot.edges if a == fan]


def test_collapsing_can_be_forced_on_and_off():
    _, top = chain(7)
    dot = parse(top, collapse=True)
    (group,) = dot.with_class("group")
    assert dot.label_lines(group)[0] == "×7  Pass"
    _, top = chain(700)
    assert len(parse(top, collapse=False).with_class("node")) == 700


def test_max_nodes_cuts_the_picture_with_a_note():
    _, top = chain(50)  # 50 nodes and the leaf's accumulator
    dot = parse(top, collapse=False, max_nodes=10)
    # Breadth-first from the root: the top 10 of the chain.
    drawn = [dot.label_lines(name)[1] for name in dot.with_class("node")]
    assert drawn == [f"seq {top.grad_fn.sequence_nr - i}" for i in range(10)]
    (more,) = dot.with_class("more")
    assert dot.label_lines(more)[0] == "41 more boxes (41 nodes) not drawn"
    assert dot.edges_between("n9", more) == ["0→0"]


def test_repeats_segments_cover_the_sequence():
    shapes = [9] + [1, 2] * 5 + [3] * 4 + [7]
    segments = viz._repeats(shapes, max_period=8, min_repeats=3)
    assert segments == [(0, 1, 0), (1, 10, 2), (11, 4, 1), (15, 1, 0)]
    assert viz._repeats([1, 1], 8, 3) == [(0, 1, 0), (1, 1, 0)]


# -- rendering -----------------------------------------------------------------------------

def small_graph():
    x, w = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    return (x * w).exp().sum()


def test_dot_files_need_no_graphviz(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    path = pyengine.render_graph(small_graph(), tmp_path / "g.dot")
    assert len(Dot(path.read_text()).with_class("node")) == 3


@needs_dot
def test_render_svg_has_every_node(tmp_path):
    y = small_graph()
    path = tmp_path / "graph.svg"
    assert pyengine.render_graph(y, path) == path
    root = ElementTree.parse(path).getroot()
    groups = [element for element in root.iter() if element.tag.endswith("}g")]
    node_classes = [element.get("class").split() for element in groups
                    if element.get("class", "").startswith("node")]
    assert len(node_classes) == 8
    assert sum("accumulate" in classes for classes in node_classes) == 2
    assert sum(element.get("class") == "edge" for element in groups) == 7
    texts = {element.text for element in root.iter() if element.tag.endswith("}text")}
    assert {"SumBackward", "ExpBackward", "MulBackward", "0→0", "1→0"} <= texts


@needs_dot
def test_render_png(tmp_path):
    path = pyengine.render_graph(small_graph(), str(tmp_path / "graph.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@needs_dot
def test_render_without_the_python_package_runs_dot(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)
    path = pyengine.render_graph(small_graph(), tmp_path / "graph.svg")
    assert b"MulBackward" in path.read_bytes()


@pytest.mark.parametrize("package", ["present", "absent"])
def test_a_missing_dot_program_says_how_to_install_it(tmp_path, monkeypatch, package):
    if package == "absent":
        monkeypatch.setitem(sys.modules, "graphviz", None)
    else:
        pytest.importorskip("graphviz")
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot on it
    with pytest.raises(viz.GraphvizNotFound, match="apt-get install graphviz") as error:
        pyengine.render_graph(small_graph(), tmp_path / "graph.svg")
    assert isinstance(error.value, RuntimeError)
    assert "graph_to_dot" in str(error.value)
    assert not (tmp_path / "graph.svg").exists()


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="format"):
        pyengine.render_graph(small_graph(), tmp_path / "graph")
