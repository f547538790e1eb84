"""A picture of the backward graph: Graphviz DOT text, and SVG/PNG through Graphviz.

::

    print(pyengine.graph_to_dot(loss))                     # DOT text, no dependencies
    pyengine.render_graph(loss, "graph.svg")                # needs Graphviz's `dot`
    pyengine.render_graph(loss, "graph.svg", inputs=[w])    # what grad(loss, [w]) prunes, faded

This module owns drawing the graph reachable from given roots; it reads
nodes and never changes them (a leaf without an AccumulateGrad is not given
one, as ``gradient_edge`` would).

What is drawn (the choices made here)
-------------------------------------
- Each node is a box: its ``name()``, ``seq N`` (its sequence number; not
  shown for AccumulateGrad, whose number is the largest there is, see Note
  [AccumulateGrad first]), one line per input slot with the shape and dtype
  of the forward output it stands for (``in 0: (3,) float64``; at most
  :data:`MAX_SLOTS_SHOWN`), and its device (from its input metadata, as the
  engine routes it: the first non-CPU device among its slots, else ``cpu``).
- An AccumulateGrad is a filled box of its own colour, and the leaf tensor it
  writes to is a separate ellipse below it (``params={"w": w}`` names leaves),
  joined by a dashed ``grad`` edge. A root given as a tensor or an Edge is an
  ellipse (``output k``) with an edge into the slot its gradient enters.
- Edges run the way gradients flow, from a node to the next node, and are
  labelled ``i→j``: the node's ``i``-th gradient (its next edge ``i``) enters
  input slot ``j`` of the next node.
- ``inputs=`` (tensors or Edges, as for ``grad``): the nodes that
  ``grad(roots, inputs)`` would not run are drawn faded (class ``pruned``);
  a node that it would reach only to capture the gradient flowing into it,
  without running its ``apply``, gets a double border (class ``captured``).
  ``accumulate_grad=True`` asks the same of ``backward(inputs=)``, where the
  inputs' nodes run. This is the engine's ``init_to_execute`` rule: a node
  runs when an input's node can be reached from it.
- Every DOT node carries a ``class`` attribute (``node``, ``accumulate``,
  ``leaf``, ``root``, ``group``, ``more``, plus ``pruned`` / ``captured``),
  which SVG output keeps, so a stylesheet or a test can find them.

Large graphs: collapsing repeated chains
----------------------------------------
Graphs above ``collapse_above`` nodes (500; ``collapse=True``/``False``
forces it) are drawn with repeated chains collapsed, so a 100k-node graph
becomes a picture of tens of boxes and the text takes a second or two:

1. Every node with exactly one edge into it *belongs* to the node that edge
   comes from; the others (the roots, nodes shared by several edges) are
   *anchors*. Belonging makes a forest of trees hanging from the anchors.
2. Each tree is cut into heavy paths (each node continues along the child
   with the largest subtree). A node's *shape* is its name, slot metadata,
   device and pruning status, plus the exact shape of the subtrees hanging
   off the path at it and which anchors it points to; sequence numbers and
   leaf names do not count.
3. Along each heavy path, a block of 1 to ``max_period`` consecutive shapes
   repeated ``min_repeats`` times or more becomes one 3-D box
   (``×N  ReluBackward → AddmmBackward``, with the sequence-number range and
   how many side nodes each repeat carries), and the subtrees hanging off
   it are folded into it. Its edges to anchors are drawn once, labelled
   with how many edges they stand for (``×N``).

If more than ``max_nodes`` boxes remain, the first ``max_nodes`` in
breadth-first order from the roots are drawn and one ``more`` box says how
many were left out.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
from collections import deque

from ._core import NodeBase
from ._shared.messages import node_name
from .autograd import _try_get_grad_accumulator
from .backends import backend_of
from .device import CPU
from .node import AccumulateGrad, Edge

__all__ = ["graph_to_dot", "render_graph", "GraphvizNotFound", "MAX_SLOTS_SHOWN"]

MAX_SLOTS_SHOWN = 4

_ACCUMULATE_GRAD_SEQUENCE_NR = 2**64 - 1

_STYLE_NODE = {"shape": "box", "style": "rounded,filled", "fillcolor": "#eef3fb", "color": "#4a6fa5"}
_STYLE_ACCUMULATE = {"shape": "box", "style": "filled", "fillcolor": "#cfe2f3", "color": "#1f4e79"}
_STYLE_LEAF = {"shape": "ellipse", "style": "filled", "fillcolor": "#d9ead3", "color": "#38761d"}
_STYLE_ROOT = {"shape": "ellipse", "style": "filled", "fillcolor": "#fce5cd", "color": "#b45f06"}
_STYLE_GROUP = {"shape": "box3d", "style": "filled", "fillcolor": "#fff2cc", "color": "#7f6000"}
_STYLE_MORE = {"shape": "note", "style": "filled", "fillcolor": "#eeeeee", "color": "#666666"}
_STYLE_PRUNED = {"fillcolor": "#f7f7f7", "color": "#c8c8c8", "fontcolor": "#a0a0a0"}
_STYLE_CAPTURED = {"peripheries": "2", "color": "#b45f06"}
_EDGE_PRUNED = {"color": "#d0d0d0", "fontcolor": "#b0b0b0"}
_EDGE_LEAF = {"label": "grad", "style": "dashed", "arrowhead": "empty"}

# Statuses under inputs=: runs, captures only, pruned.
_RUNS, _CAPTURES, _PRUNED = "runs", "captures", "pruned"


class GraphvizNotFound(RuntimeError):
    """Rendering needs Graphviz's ``dot`` program, which is not installed."""


# -- reading roots, inputs and nodes --------------------------------------------------

def _as_list(values):
    if values is None:
        return []
    if isinstance(values, (list, tuple)):
        return list(values)
    return [values]


def _root_start(root, index):
    """``(node or None, input_nr or None, leaf or None, description)`` for a root."""
    if isinstance(root, Edge):
        return root.node, root.input_nr, None, f"output {index}"
    if isinstance(root, NodeBase):
        return root, None, None, None
    grad_fn = getattr(root, "grad_fn", None)
    if grad_fn is not None:
        return grad_fn, getattr(root, "output_nr", 0), None, f"output {index}"
    if getattr(root, "requires_grad", False):
        accumulator = _try_get_grad_accumulator(root)
        if accumulator is not None:
            return accumulator, 0, None, f"output {index}"
        return None, None, root, None
    raise TypeError(f"roots[{index}] is neither a Node, an Edge, nor a tensor that requires grad "
                    f"(got {type(root).__name__})")


def _input_edge(value, index):
    """The ``(node, input_nr)`` whose gradient ``grad`` would capture for ``value``."""
    if isinstance(value, Edge):
        return value.node, value.input_nr
    grad_fn = getattr(value, "grad_fn", None)
    if grad_fn is not None:
        return grad_fn, getattr(value, "output_nr", 0)
    if getattr(value, "requires_grad", False):
        accumulator = _try_get_grad_accumulator(value)
        return (accumulator, 0) if accumulator is not None else (None, 0)
    raise TypeError(f"inputs[{index}] is neither an Edge nor a tensor that requires grad "
                    f"(got {type(value).__name__})")


_texts = {}


def _dtype_text(dtype):
    """``str(dtype)``, remembered: numpy's is slow and a graph has few dtypes."""
    try:
        return _texts[dtype]
    except (KeyError, TypeError):
        text = str(dtype)
    try:
        if len(_texts) < 1024:
            _texts[dtype] = text
    except TypeError:  # an unhashable framework dtype
        pass
    return text


def _metadata_key(node):
    """Per input slot ``(shape, dtype, device)`` as text, or None for an undeclared slot."""
    slots = []
    for metadata in getattr(node, "_input_metadata", ()) or ():
        if metadata is None:
            slots.append(None)
        else:
            slots.append((tuple(metadata.shape), _dtype_text(metadata.dtype),
                          _dtype_text(metadata.device)))
    return tuple(slots)


def _device_text(slots):
    for slot in slots:
        if slot is not None and slot[2] != str(CPU):
            return slot[2]
    return str(CPU)


def _shape_text(shape):
    return "(" + ", ".join(str(size) for size in shape) + ("," if len(shape) == 1 else "") + ")"


def _slot_lines(slots):
    lines = []
    for i, slot in enumerate(slots[:MAX_SLOTS_SHOWN]):
        lines.append(f"in {i}: ?" if slot is None else f"in {i}: {_shape_text(slot[0])} {slot[1]}")
    if len(slots) > MAX_SLOTS_SHOWN:
        lines.append(f"... {len(slots) - MAX_SLOTS_SHOWN} more slots")
    return lines


def _quote(text):
    """A DOT double-quoted string; lines are joined with ``\\n``."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _leaf_description(variable, fallback_slots):
    data = getattr(variable, "data", None)
    backend = backend_of(data) if data is not None else None
    if backend is not None:
        return f"{_shape_text(tuple(backend.shape(data)))} {_dtype_text(backend.dtype(data))}"
    if fallback_slots and fallback_slots[0] is not None:
        return f"{_shape_text(fallback_slots[0][0])} {fallback_slots[0][1]}"
    return ""


# -- the graph, as indices ---------------------------------------------------------------

class _Graph:
    """The nodes reachable from the roots, numbered in breadth-first order.

    ``nodes[k]``: the node; ``edges[k]``: ``(i, input_nr, j)`` per non-None
    next edge ``i`` of node ``k`` into node ``j``; ``indegree[j]``: edges into
    ``j``; ``is_root[k]``: whether a root starts at ``k``.
    """

    def __init__(self, starts):
        self.nodes = []
        self.index = {}
        self.edges = []
        queue = deque()
        for node in starts:
            self._add(node, queue)
        while queue:
            k = queue.popleft()
            out = []
            for i, edge in enumerate(self.nodes[k]._next_edges):
                if edge is None:
                    continue
                j = self._add(edge.node, queue)
                out.append((i, edge.input_nr, j))
            self.edges[k] = out
        self.indegree = [0] * len(self.nodes)
        for out in self.edges:
            for _, _, j in out:
                self.indegree[j] += 1
        self.is_root = [False] * len(self.nodes)
        for node in starts:
            self.is_root[self.index[id(node)]] = True

    def _add(self, node, queue):
        key = id(node)
        k = self.index.get(key)
        if k is None:
            k = self.index[key] = len(self.nodes)
            self.nodes.append(node)
            self.edges.append(())
            queue.append(k)
        return k


def _statuses(graph, inputs, accumulate_grad):
    """Per node: runs, captures (apply skipped) or pruned, as init_to_execute decides."""
    n = len(graph.nodes)
    needed = [False] * n
    captured = [False] * n
    for node, _ in inputs:
        if node is None:
            continue
        j = graph.index.get(id(node))
        if j is None:
            continue
        if accumulate_grad:
            needed[j] = True
        else:
            captured[j] = True
    # Post-order without recursion: a node after every node it has an edge to.
    for k in _post_order(graph):
        if not needed[k]:
            for _, _, j in graph.edges[k]:
                if needed[j] or captured[j]:
                    needed[k] = True
                    break
    return [_RUNS if needed[k] else _CAPTURES if captured[k] else _PRUNED for k in range(n)]


def _post_order(graph):
    """Every node after all nodes reachable from it (iterative depth-first search)."""
    n = len(graph.nodes)
    order = []
    visited = [False] * n
    for start in range(n):
        if visited[start]:
            continue
        visited[start] = True
        stack = [(start, 0)]
        while stack:
            k, position = stack[-1]
            out = graph.edges[k]
            while position < len(out) and visited[out[position][2]]:
                position += 1
            if position < len(out):
                stack[-1] = (k, position + 1)
                j = out[position][2]
                visited[j] = True
                stack.append((j, 0))
            else:
                stack.pop()
                order.append(k)
    return order


# -- collapsing repeated chains ------------------------------------------------------------

class _Interner(dict):
    """Exact small integer ids for hashable keys (no hash collisions can merge two shapes)."""

    def id(self, key):
        value = self.get(key)
        if value is None:
            value = self[key] = len(self)
        return value


def _collapse(graph, keys, max_period, min_repeats):
    """Groups of repeated chains and of identical sibling subtrees.

    Returns ``(member_of, groups)``: ``member_of[k]`` is the index of the
    group that hides node ``k`` (or -1). Each group is a dict: ``kind``
    (``chain``: consecutive nodes of a heavy path; ``siblings``: identical
    subtrees hanging off one node), ``members`` (the path nodes in order, or
    the subtrees' tops), ``period``, ``repeats``, and ``hidden`` (every node
    it hides, members first for a chain)."""
    n = len(graph.nodes)
    edges = graph.edges
    owner = [-1] * n
    for k in range(n):
        for _, _, j in edges[k]:
            if graph.indegree[j] == 1 and not graph.is_root[j]:
                owner[j] = k
    owned = [[] for _ in range(n)]
    for k in range(n):
        for _, _, j in edges[k]:
            if owner[j] == k:
                owned[k].append(j)

    # Subtree sizes in the belonging forest: children before parents.
    anchors = [k for k in range(n) if owner[k] == -1]
    forest_order = []
    for anchor in anchors:
        stack = [anchor]
        while stack:
            k = stack.pop()
            forest_order.append(k)
            stack.extend(owned[k])
    size = [1] * n
    for k in reversed(forest_order):
        if owner[k] != -1:
            size[owner[k]] += size[k]
    heavy = [-1] * n
    for k in range(n):
        best = -1
        for j in owned[k]:
            if best == -1 or size[j] > size[best]:
                best = j
        heavy[k] = best

    # Shapes: a tree's exact shape, and a path node's local shape (its heavy child left out).
    interner = _Interner()
    tree_shape = [0] * n
    local_shape = [0] * n
    for k in reversed(forest_order):
        full, local = [], []
        for i, input_nr, j in edges[k]:
            child = ("tree", tree_shape[j]) if owner[j] == k else ("anchor", j)
            full.append((i, input_nr, child))
            local.append((i, input_nr, "path") if j == heavy[k] else (i, input_nr, child))
        tree_shape[k] = interner.id((keys[k], tuple(full)))
        local_shape[k] = interner.id((keys[k], tuple(local), "local"))

    member_of = [-1] * n
    groups = []

    def fold(group, tops):
        """Hide ``tops`` and everything that belongs to them in ``group``."""
        group_index = len(groups)
        stack = list(tops)
        while stack:
            k = stack.pop()
            member_of[k] = group_index
            group["hidden"].append(k)
            stack.extend(owned[k])
        groups.append(group)

    def side_paths(k):
        """Start paths at ``k``'s light children, folding identical siblings."""
        light = [j for j in owned[k] if j != heavy[k]]
        by_shape = {}
        for j in light:
            by_shape.setdefault(tree_shape[j], []).append(j)
        for j in light:
            same = by_shape[tree_shape[j]]
            if len(same) < min_repeats:
                path_starts.append(j)
            elif same[0] == j:
                fold({"kind": "siblings", "members": same, "period": 1, "repeats": len(same),
                      "hidden": []}, same)

    path_starts = deque(anchors)
    while path_starts:
        start = path_starts.popleft()
        if member_of[start] != -1:
            continue
        path = [start]
        while heavy[path[-1]] != -1:
            path.append(heavy[path[-1]])
        for segment_start, length, period in _repeats([local_shape[k] for k in path],
                                                       max_period, min_repeats):
            segment = path[segment_start:segment_start + length]
            if period == 0:
                side_paths(segment[0])
                continue
            # The members, then the subtrees hanging off them (not the path's continuation).
            group = {"kind": "chain", "members": segment, "period": period,
                     "repeats": length // period, "hidden": list(segment)}
            for k in segment:
                member_of[k] = len(groups)
            fold(group, [j for k in segment for j in owned[k] if j != heavy[k]])
    return member_of, groups


def _repeats(shapes, max_period, min_repeats):
    """Cut ``shapes`` into ``(start, length, period)`` segments, greedily from the
    left: a block of ``period`` shapes repeated at least ``min_repeats`` times
    in a row (the period covering most wins, the shorter on a tie), or a
    single shape (``period`` 0)."""
    m = len(shapes)
    # same[p][j]: how many positions from j on have shapes[t] == shapes[t + p].
    same = {}
    for p in range(1, min(max_period, m // max(min_repeats, 1)) + 1):
        run = [0] * (m + 1)
        for j in range(m - p - 1, -1, -1):
            run[j] = run[j + 1] + 1 if shapes[j] == shapes[j + p] else 0
        same[p] = run
    segments = []
    i = 0
    while i < m:
        best_period, best_length = 0, 1
        for p, run in same.items():
            repeats = 1 + run[i] // p
            if repeats >= min_repeats and repeats * p > best_length:
                best_period, best_length = p, repeats * p
        segments.append((i, best_length, best_period))
        i += best_length
    return segments


# -- DOT text -----------------------------------------------------------------------------

def graph_to_dot(roots, inputs=None, *, accumulate_grad=False, params=None, collapse=None,
                 collapse_above=500, max_period=8, min_repeats=3, max_nodes=2000,
                 title=None) -> str:
    """The backward graph reachable from ``roots`` as Graphviz DOT text.

    ``roots``: tensors (their ``grad_fn``, or a leaf's AccumulateGrad),
    Edges, or Nodes, one or a list. ``inputs``: tensors or Edges as for
    ``grad``; the nodes it would prune are drawn faded (``accumulate_grad=True``:
    as ``backward(inputs=)``). ``params``: ``{name: leaf tensor}`` to name
    leaves. ``collapse``: collapse repeated chains (None: only above
    ``collapse_above`` nodes); see the module docstring for ``max_period``,
    ``min_repeats`` and ``max_nodes``. ``title``: a label for the picture.
    """
    # Tens of thousands of small tuples and no cycles: the cyclic GC would only
    # rescan the (large) graph over and over.
    gc_was_enabled = gc.isenabled()
    try:
        # Inside the try: Ctrl-C may come out as gc.disable() returns.
        gc.disable()
        return _graph_to_dot(roots, inputs, accumulate_grad, params, collapse, collapse_above,
                             max_period, min_repeats, max_nodes, title)
    finally:
        if gc_was_enabled:
            gc.enable()


def _graph_to_dot(roots, inputs, accumulate_grad, params, collapse, collapse_above, max_period,
                  min_repeats, max_nodes, title):
    root_values = _as_list(roots)
    if not root_values:
        raise ValueError("graph_to_dot needs at least one root")
    starts, root_entries, lone_leaves = [], [], []
    for index, root in enumerate(root_values):
        node, input_nr, leaf, description = _root_start(root, index)
        if node is not None:
            starts.append(node)
            root_entries.append((node, input_nr, description, root))
        elif leaf is not None:
            lone_leaves.append(leaf)
    graph = _Graph(starts)
    n = len(graph.nodes)

    input_edges = [_input_edge(value, i) for i, value in enumerate(_as_list(inputs))]
    statuses = _statuses(graph, input_edges, accumulate_grad) if input_edges else [_RUNS] * n

    leaf_names = {}
    if params:
        for name, tensor in dict(params).items():
            leaf_names[id(tensor)] = str(name)

    names = [node_name(node) for node in graph.nodes]
    slots = [_metadata_key(node) for node in graph.nodes]
    is_accumulate = [isinstance(node, AccumulateGrad) for node in graph.nodes]

    if collapse is None:
        collapse = n > collapse_above
    if collapse and n:
        keys = [(names[k], slots[k], statuses[k], is_accumulate[k]) for k in range(n)]
        member_of, groups = _collapse(graph, keys, max_period, max(2, min_repeats))
    else:
        member_of, groups = [-1] * n, []

    # Display items: a node k is "n{k}", a group g is "g{g}".
    def display_of(k):
        g = member_of[k]
        return f"g{g}" if g != -1 else f"n{k}"

    group_exits = [_group_exits(group, graph, display_of, statuses) for group in groups]
    display_order = _display_order(graph, starts, display_of, group_exits)
    drawn = set(display_order[:max_nodes])
    left_out = display_order[max_nodes:]

    lines = ["digraph backward {",
             '  graph [rankdir=TB, fontname="Helvetica", fontsize=11, labelloc=t];',
             '  node [fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=9];']
    summary = f"backward graph: {n} nodes"
    if groups:
        summary += (f", {sum(len(group['hidden']) for group in groups)} of them in "
                    f"{len(groups)} collapsed groups")
    if left_out:
        summary += f", {len(left_out)} boxes not drawn"
    lines.append(f"  label={_quote(title + chr(10) + summary if title else summary)};")
    edge_lines = []

    def add_node(name, attributes):
        lines.append(f"  {name} [{_attributes(attributes)}];")

    def add_edge(source, target, label, faded=False, extra=None):
        attributes = {"label": label}
        if extra:
            attributes.update(extra)
        if faded:
            attributes.update(_EDGE_PRUNED)
        edge_lines.append(f"  {source} -> {target if target in drawn else 'more'} "
                          f"[{_attributes(attributes)}];")

    leaf_count = 0
    for item in display_order[:max_nodes]:
        if item[0] == "g":
            g = int(item[1:])
            add_node(item, _group_attributes(groups[g], names, slots, statuses, graph))
            for target, (count, label, faded) in group_exits[g].items():
                add_edge(item, target, label if count == 1 else f"×{count}", faded)
            continue
        k = int(item[1:])
        node = graph.nodes[k]
        add_node(item, _node_attributes(node, names[k], slots[k], statuses[k], is_accumulate[k]))
        into_groups = {}
        for i, input_nr, j in graph.edges[k]:
            faded = statuses[k] == _PRUNED or statuses[j] == _PRUNED
            if member_of[j] == -1:
                add_edge(item, display_of(j), f"{i}→{input_nr}", faded)
                continue
            # Edges into one group are drawn once, with their count.
            entry = into_groups.get(member_of[j])
            if entry is None:
                into_groups[member_of[j]] = [1, f"{i}→{input_nr}", faded]
            else:
                entry[0] += 1
        for g, (count, label, faded) in into_groups.items():
            add_edge(item, f"g{g}", label if count == 1 else f"×{count}", faded)
        variable = getattr(node, "variable", None) if is_accumulate[k] else None
        if variable is not None:
            leaf_id = f"v{leaf_count}"
            leaf_count += 1
            drawn.add(leaf_id)
            add_node(leaf_id, _leaf_attributes(variable, slots[k], leaf_names, statuses[k]))
            add_edge(item, leaf_id, "grad", statuses[k] == _PRUNED, _EDGE_LEAF)
    for leaf in lone_leaves:
        add_node(f"v{leaf_count}", _leaf_attributes(leaf, (), leaf_names, _RUNS))
        leaf_count += 1
    for r, (node, input_nr, description, value) in enumerate(root_entries):
        if description is None:
            continue
        text = description
        data = None if isinstance(value, Edge) else getattr(value, "data", None)
        backend = backend_of(data) if data is not None else None
        if backend is not None:
            text += f"\n{_shape_text(tuple(backend.shape(data)))} {_dtype_text(backend.dtype(data))}"
        add_node(f"r{r}", {"label": text, "class": "root", **_STYLE_ROOT})
        add_edge(f"r{r}", display_of(graph.index[id(node)]), f"→{input_nr}")
    if left_out:
        hidden_nodes = sum(len(groups[int(item[1:])]["hidden"]) if item[0] == "g" else 1
                           for item in left_out)
        add_node("more", {"label": f"{len(left_out)} more boxes ({hidden_nodes} nodes) not drawn",
                          "class": "more", **_STYLE_MORE})
    lines.extend(edge_lines)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _group_exits(group, graph, display_of, statuses):
    """The edges out of a group, one per item they go to: ``{item: [count,
    label of the first, whether it comes from a pruned node]}``."""
    inside = set(group["hidden"])
    exits = {}
    for k in group["hidden"]:
        for i, input_nr, j in graph.edges[k]:
            if j in inside:
                continue
            target = display_of(j)
            entry = exits.get(target)
            if entry is None:
                exits[target] = [1, f"{i}→{input_nr}", statuses[k] == _PRUNED]
            else:
                entry[0] += 1
    return exits


def _display_order(graph, starts, display_of, group_exits):
    """Display items (nodes and groups) breadth-first from the roots."""
    order, seen = [], set()
    queue = deque(display_of(graph.index[id(node)]) for node in starts)
    while queue:
        item = queue.popleft()
        if item in seen:
            continue
        seen.add(item)
        order.append(item)
        if item[0] == "n":
            targets = [display_of(j) for _, _, j in graph.edges[int(item[1:])]]
        else:
            targets = list(group_exits[int(item[1:])])
        queue.extend(target for target in targets if target not in seen)
    return order


def _attributes(attributes):
    return ", ".join(f"{key}={_quote(str(value))}" for key, value in attributes.items())


def _with_status(attributes, kind, status):
    """``attributes`` with the class ``kind`` and the look of ``status``."""
    if status == _CAPTURES:
        attributes.update(_STYLE_CAPTURED)
        kind += " captured"
    elif status == _PRUNED:
        attributes.update(_STYLE_PRUNED)
        kind += " pruned"
    attributes["class"] = kind
    return attributes


def _node_attributes(node, name, slots, status, is_accumulate):
    lines = [name]
    sequence_nr = int(node.sequence_nr)
    if not is_accumulate or sequence_nr != _ACCUMULATE_GRAD_SEQUENCE_NR:
        lines.append(f"seq {sequence_nr}")
    lines.extend(_slot_lines(slots))
    lines.append(_device_text(slots))
    style = _STYLE_ACCUMULATE if is_accumulate else _STYLE_NODE
    return _with_status({"label": "\n".join(lines), **style},
                        "accumulate" if is_accumulate else "node", status)


def _leaf_attributes(variable, slots, leaf_names, status):
    name = leaf_names.get(id(variable), "leaf")
    description = _leaf_description(variable, slots)
    text = name + ("\n" + description if description else "")
    return _with_status({"label": text, **_STYLE_LEAF}, "leaf", status)


def _group_attributes(group, names, slots, statuses, graph):
    members, period, repeats = group["members"], group["period"], group["repeats"]
    side = (len(group["hidden"]) - len(members)) // repeats
    sequence_numbers = [int(graph.nodes[k].sequence_nr) for k in members]
    sequence_numbers = [number for number in sequence_numbers
                        if number != _ACCUMULATE_GRAD_SEQUENCE_NR]
    if group["kind"] == "siblings":
        size = len(group["hidden"]) // repeats
        lines = [f"×{repeats}  {names[members[0]]}", f"identical subtrees of {size} "
                 f"node{'s' if size != 1 else ''}"]
    else:
        lines = [f"×{repeats}  " + " → ".join(names[k] for k in members[:period])]
        if side:
            lines.append(f"(+{side} side node{'s' if side != 1 else ''} each)")
    if sequence_numbers:
        lines.append(f"seq {max(sequence_numbers)} … {min(sequence_numbers)}")
    lines.extend(_slot_lines(slots[members[0]]))
    lines.append(_device_text(slots[members[0]]))
    lines.append(f"{len(group['hidden'])} nodes")
    return _with_status({"label": "\n".join(lines), **_STYLE_GROUP}, "group",
                        statuses[members[0]])


# -- rendering ------------------------------------------------------------------------------

_TEXT_FORMATS = ("dot", "gv")

_NO_DOT = ("rendering the graph as {fmt} needs Graphviz's `dot` program, which is not installed "
           "(Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz; conda: conda "
           "install graphviz). Without it, write the DOT text instead: render_graph(roots, "
           "'graph.dot') or pyengine.graph_to_dot(roots), and open it with any Graphviz viewer.")


def _run_dot(text: str, fmt: str) -> bytes:
    """Lay out ``text`` with ``dot`` into ``fmt`` bytes: through the ``graphviz``
    package where it is installed, else by running ``dot`` directly."""
    try:
        import graphviz
    except ImportError:
        graphviz = None
    if graphviz is not None:
        try:
            return graphviz.Source(text).pipe(format=fmt)
        except graphviz.ExecutableNotFound as error:
            raise GraphvizNotFound(_NO_DOT.format(fmt=fmt)) from error
    program = shutil.which("dot")
    if program is None:
        raise GraphvizNotFound(_NO_DOT.format(fmt=fmt))
    result = subprocess.run([program, f"-T{fmt}"], input=text.encode("utf-8"),
                            capture_output=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"dot -T{fmt} failed: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout


def render_graph(roots, path, *, format=None, **options) -> str:
    """Write the backward graph of ``roots`` to ``path``; return ``path``.

    The format comes from ``format`` or the file's suffix: ``.dot``/``.gv``
    write the DOT text (no dependencies); ``.svg``, ``.png``, ``.pdf`` (any
    format ``dot -T`` knows) are laid out by Graphviz's ``dot`` program,
    through the ``graphviz`` package where it is installed; GraphvizNotFound
    (a RuntimeError) says how to install it where ``dot`` is missing.
    ``options`` go to :func:`graph_to_dot`.
    """
    fmt = (format or os.path.splitext(os.fspath(path))[1].lstrip(".")).lower()
    if not fmt:
        raise ValueError(f"cannot tell the format of {path!r}: give format= or a suffix "
                         "(.svg, .png, .pdf, .dot)")
    text = graph_to_dot(roots, **options)
    if fmt in _TEXT_FORMATS:
        with open(path, "w", encoding="utf-8") as file:
            file.write(text)
        return path
    data = _run_dot(text, fmt)
    with open(path, "wb") as file:
        file.write(data)
    return path
