"""Programs for the fuzz, as plain data (JSON), and their exact gradients.

A *graph program* (run by ``fuzz_interpreter.Program``)::

    {"leaves": L,                      # leaves x_i = (i+1) * [1, 2], float64
     "nodes": [{"edges": [edge or None, ...],   # one per gradient apply returns
                "meta": [bool, ...],            # per input slot: metadata (2,) float64 or None
                "w": [[w_jk]],                  # apply: out_j = sum_k w_jk * grad_k
                "apply": action, "release": action or None}, ...],
     "hooks": [{"kind": pre|post|tensor_pre|leaf_tensor|post_acc, "target": i,
                "action": action, "node": i or None, "slot": k}, ...],
     "mutations": [{"op": "set_next_edges", "node": i, "edges": [...]}
                   | {"op": "private", "node": i, "field": "_next_edges"|"_input_metadata",
                      "value": name}, ...],
     "call": {"api": backward|grad|execute, "roots": [edge, ...], "grads": [grad, ...],
              "inputs": [leaf, ...], "outputs": [edge, ...] | None | "str" | "int",
              "roots_kind": None|"empty"|"generator", "accumulate": bool,
              "retain": bool, "repeat": 1|2}}

An edge is ``{"to": ["node", j] | ["leaf", j] | ["object"] | ["none"], "nr":
["int", n] | ["str", s] | ["float", f] | ["bool", b] | ["np", n] | ["none"]}``
(or ``"object"``: not an Edge at all); a root gradient ``["ok", [a, b]]``
or an odd one (``["shape"]``, ``["f32"]``, ``["i64"]``, ``["str"]``,
``["scalar"]``, ``["np_scalar"]``, ``["none"]``). An *owner program* (``{"kind": "owner"}``)
is a graph of values with ``children`` collections of any kind, a method
name, and collections that change while the walk reads them or while the
methods run.

*Well-formed* graph programs (every node a known linear map, edges only to
earlier nodes and leaves, valid slots, no misuse) have exact gradients:
``analytic`` computes them, as the fuzz's oracle beside the other core.
"""

from __future__ import annotations

from hypothesis import strategies as st

WEIGHTS = [-2.0, -1.0, 0.5, 1.0, 2.0, 3.0]
MUTATIONS = ["shorten", "extend", "cycle", "private_edges", "private_meta", "clear_meta",
             "remove_hooks", "raise", "task_captured_none", "task_leaf_streams_none",
             "task_exception"]
RETURNS = ["none", "nones", "more", "fewer", "shape", "f32", "i64", "scalar", "np_scalar", "str",
           "bare_str", "int", "tuple", "generator", "nan", "indexed", "indexed_shape"]
# What a node, hook or release_variables may do besides changing the graph:
# final callbacks (that raise, queue more, or run a backward), reentrant
# backward (on a fresh graph, or on the program's own up to three levels),
# a running node's queries (from another node's hook or release_variables
# they are misuse), removing hook handles twice, grad mode turned off.
SIDE_EFFECTS = ["remove_twice", "callback", "callback_raise", "callback_nested",
                "callback_backward", "reentrant", "reentrant_grad", "reentrant_same",
                "query_should_0", "query_should_last", "query_should_out", "query_should_str",
                "query_buffered_0", "query_buffered_out", "grad_mode_off"]
HOOK_ACTIONS = ["none", "scale"] + MUTATIONS + RETURNS + SIDE_EFFECTS
APPLY_ACTIONS = ["raise"] + MUTATIONS + RETURNS + SIDE_EFFECTS
# Engine(max_recursion_depth, max_total_depth, max_pool_threads) for the call:
# small bounds send reentrant backward to the pool, or past the total depth.
# Odd ones are values, not a wrong count of arguments: Cython words an
# argument count otherwise than CPython (see tests/test_surface_agreement.py).
ENGINE_BOUNDS = [[0, 1, 1], [1, 2, 1], [1, 8, 2], [2, 3, 0], [60, 4096, 256]]
ODD_ENGINE_BOUNDS = [[-1, 8, 2], [1, -1, 2], [1, 8, -1], ["x", 8, 2], [1.5, 8, 2], [None, 8, 2],
                     [2 ** 31, 8, 2], [1, 2 ** 63, 2], [True, 8, 2]]
MODES = ["anomaly", "anomaly_build", "profile"]
ODD_NEXT_EDGES = ["tuple_object", "list", "none", "tuple_str", "tuple_none", "empty", "leaf",
                  "doubled", "self"]
ODD_METADATA = ["none", "tuple", "list_object", "list_spec", "list_none", "empty", "wrong_shape",
                "f32"]
ODD_INPUT_NRS = [["int", -1], ["int", -2], ["int", -1000], ["int", 5], ["int", 2 ** 31],
                 ["int", 2 ** 40], ["int", 2 ** 63], ["int", -(2 ** 63) - 1], ["str", "0"],
                 ["float", 1.5], ["float", 0.0], ["bool", True], ["np", 1], ["none"]]
ODD_GRADS = [["shape"], ["f32"], ["i64"], ["str"], ["scalar"], ["np_scalar"], ["none"]]

grad_values = st.lists(st.sampled_from([-1.0, 0.5, 1.0, 2.0]), min_size=2, max_size=2)


@st.composite
def well_formed(draw, max_nodes=6):
    """A DAG of linear nodes over leaves, run by backward, grad or execute."""
    leaves = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_nodes))
    nodes = []
    for i in range(n):
        n_in = draw(st.integers(1, 2))
        n_out = draw(st.integers(0, 3))
        edges = []
        for _ in range(n_out):
            choice = draw(st.integers(0, 4))
            if choice == 0:
                edges.append(None)
            elif i == 0 or choice == 1:
                edges.append({"to": ["leaf", draw(st.integers(0, leaves - 1))], "nr": ["int", 0]})
            else:
                j = draw(st.integers(0, i - 1))
                edges.append({"to": ["node", j], "nr": ["int", draw(st.integers(0, nodes[j]["n_in"] - 1))]})
        nodes.append({"n_in": n_in, "edges": edges,
                      "meta": [draw(st.booleans()) or k == 0 for k in range(n_in)],
                      "w": [[draw(st.sampled_from(WEIGHTS)) for _ in range(n_in)] for _ in range(n_out)],
                      "apply": "linear", "release": None})
    roots = [{"to": ["node", n - 1], "nr": ["int", 0]}]
    if n > 1 and draw(st.booleans()):
        j = draw(st.integers(0, n - 2))
        roots.append({"to": ["node", j], "nr": ["int", draw(st.integers(0, nodes[j]["n_in"] - 1))]})
    api = draw(st.sampled_from(["backward", "grad", "execute"]))
    call = {"api": api, "roots": roots, "grads": [["ok", draw(grad_values)] for _ in roots],
            "retain": draw(st.booleans()), "repeat": draw(st.sampled_from([1, 1, 2]))}
    if api == "grad":
        call["inputs"] = draw(st.lists(st.integers(0, leaves - 1), min_size=1, max_size=3))
    if api == "execute":
        call["outputs"] = None
        call["accumulate"] = True
    hooks = []
    for _ in range(draw(st.integers(0, 2))):
        hooks.append({"kind": draw(st.sampled_from(["pre", "post", "tensor_pre", "leaf_tensor",
                                                    "post_acc"])),
                      "target": draw(st.integers(0, 10)), "action": "none", "node": None, "slot": 0})
    return {"leaves": leaves, "nodes": nodes, "hooks": hooks, "mutations": [], "call": call}


def _odd_edge(draw, n_nodes, leaves):
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return None
    if kind == 1:
        return "object"
    to = draw(st.sampled_from([["node", draw(st.integers(0, n_nodes - 1))],
                               ["leaf", draw(st.integers(0, leaves - 1))], ["object"], ["none"]]))
    if kind < 5:
        nr = ["int", draw(st.integers(0, 2))]
    else:
        nr = draw(st.sampled_from(ODD_INPUT_NRS))
    return {"to": to, "nr": nr}


@st.composite
def misuse(draw):
    """A well-formed program with one to three kinds of misuse mixed in."""
    program = draw(well_formed())
    nodes, leaves = program["nodes"], program["leaves"]
    n = len(nodes)
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["edge", "set_next_edges", "private", "hook", "apply",
                                     "release", "call", "roots", "outputs", "grads", "engine",
                                     "mode", "create", "binputs", "retain_grad"]))
        i = draw(st.integers(0, n - 1))
        if what == "edge":
            edges = nodes[i]["edges"]
            edge = _odd_edge(draw, n, leaves)
            if edges and draw(st.booleans()):
                edges[draw(st.integers(0, len(edges) - 1))] = edge
            else:
                edges.append(edge)
                for row in [nodes[i]["w"]]:
                    row.append([1.0] * nodes[i]["n_in"])
        elif what == "set_next_edges":
            program["mutations"].append({"op": "set_next_edges", "node": i,
                                         "edges": [_odd_edge(draw, n, leaves)
                                                   for _ in range(draw(st.integers(0, 3)))]})
        elif what == "private":
            field = draw(st.sampled_from(["_next_edges", "_input_metadata"]))
            values = ODD_NEXT_EDGES if field == "_next_edges" else ODD_METADATA
            program["mutations"].append({"op": "private", "node": i, "field": field,
                                         "value": draw(st.sampled_from(values))})
        elif what == "hook":
            program["hooks"].append({
                "kind": draw(st.sampled_from(["pre", "post", "tensor_pre", "leaf_tensor", "post_acc"])),
                "target": i, "action": draw(st.sampled_from(HOOK_ACTIONS)),
                "node": draw(st.one_of(st.none(), st.integers(0, n - 1))),
                "slot": draw(st.sampled_from([0, 0, 1, 5, -1]))})
        elif what == "apply":
            nodes[i]["apply"] = draw(st.sampled_from(APPLY_ACTIONS))
        elif what == "release":
            nodes[i]["release"] = draw(st.sampled_from(MUTATIONS + SIDE_EFFECTS))
            program["call"]["retain"] = False
        elif what == "call":
            program["call"]["api"] = draw(st.sampled_from(["backward", "grad", "execute"]))
            program["call"].setdefault("inputs", [0])
            program["call"].setdefault("outputs", None)
        elif what == "roots":
            program["call"]["api"] = "execute"
            program["call"]["roots_kind"] = draw(st.sampled_from(["empty", "generator", None]))
            if draw(st.booleans()):
                program["call"]["roots"].append(_odd_edge(draw, n, leaves))
                program["call"]["grads"].append(["ok", [1.0, 1.0]])
        elif what == "outputs":
            program["call"]["api"] = "execute"
            program["call"]["accumulate"] = draw(st.booleans())
            program["call"]["outputs"] = draw(st.one_of(
                st.sampled_from([None, "str", "int"]),
                st.lists(st.sampled_from([{"to": ["leaf", 0], "nr": ["int", 0]}, None, "object",
                                          {"to": ["leaf", 0], "nr": ["int", 3]},
                                          {"to": ["node", 0], "nr": ["int", 0]}]), max_size=3)))
        elif what == "grads":
            calls = program["call"]["grads"]
            if draw(st.booleans()) or not calls:
                calls.append(draw(st.sampled_from(ODD_GRADS)))
            else:
                calls[draw(st.integers(0, len(calls) - 1))] = draw(st.sampled_from(ODD_GRADS))
        elif what == "engine":
            program["call"]["engine"] = draw(st.sampled_from(ENGINE_BOUNDS * 2 + ODD_ENGINE_BOUNDS))
        elif what == "mode":
            program["call"]["mode"] = draw(st.sampled_from(MODES))
        elif what == "create":
            program["call"]["create"] = True
        elif what == "binputs":
            program["call"]["binputs"] = draw(st.lists(st.integers(0, leaves - 1), max_size=2))
        elif what == "retain_grad":
            program["call"]["retain_grad"] = draw(st.lists(
                st.tuples(st.integers(0, n - 1), st.sampled_from([0, 0, 1, 5])).map(list),
                min_size=1, max_size=2))
    program["call"].setdefault("inputs", [0])
    return program


@st.composite
def owner_program(draw):
    """An owner graph: values whose ``children`` collections point at earlier
    values. Clean (tuples and lists, exact gradients), odd (collections of
    any kind pointing anywhere, cycles included, missing attributes), or
    changing (sets, lists and dicts that a property read by the walk, or a
    method run by it, changes: most often the collection the walk is
    iterating)."""
    n = draw(st.integers(1, 6))
    mode = draw(st.sampled_from(["clean", "odd", "changing", "changing"]))
    values = []
    for i in range(n):
        if mode == "odd":
            kids = draw(st.lists(st.integers(0, n - 1), max_size=3))
            kind = draw(st.sampled_from(["tuple", "list", "set", "dict", "none", "int", "str",
                                         "objects"]))
        else:
            kids = draw(st.lists(st.integers(0, i - 1), max_size=3)) if i else []
            kinds = ["tuple", "list"] if mode == "clean" else ["set", "set", "list", "dict", "tuple"]
            kind = draw(st.sampled_from(kinds))
        values.append({"kids": kids, "kind": kind})
    ops = (["add", "remove", "clear", "rebind", "raise"] if mode == "odd"
           else ["add", "add", "remove", "clear", "rebind"])
    mutation = st.fixed_dictionaries({
        "at": st.integers(0, n - 1), "value": st.integers(0, n - 1), "other": st.integers(0, n - 1),
        "op": st.sampled_from(ops), "parent": st.sampled_from([True, True, False])})
    program = {"kind": "owner", "values": values, "w": draw(st.sampled_from(WEIGHTS)),
               "children": "kids", "method": "back"}
    if mode == "odd":
        program["children"] = draw(st.sampled_from(["kids", "pkids", "kids", "missing"]))
        program["method"] = draw(st.sampled_from(["back", "back", "missing", "index"]))
    if mode != "clean":
        if mode == "changing" or draw(st.booleans()):
            program["children"] = "pkids"
            program["walk_mutation"] = draw(mutation)
        if draw(st.booleans()):
            program["back_mutation"] = draw(mutation)
    return program


programs = st.one_of(well_formed(), misuse(), misuse(), owner_program())
batches = st.lists(programs, min_size=20, max_size=20)


# -- the exact gradients of well-formed programs --------------------------------

def is_well_formed(program):
    if program.get("kind") == "owner":
        return (program["children"] == "kids" and program["method"] == "back"
                and all(v["kind"] in ("tuple", "list") for v in program["values"])
                and not program.get("walk_mutation") and not program.get("back_mutation")
                and all(k < i for i, v in enumerate(program["values"]) for k in v["kids"]))
    nodes = program["nodes"]
    if program["mutations"] or any(h["action"] != "none" for h in program["hooks"]):
        return False
    for i, node in enumerate(nodes):
        if node["apply"] != "linear" or node["release"] or len(node["w"]) != len(node["edges"]):
            return False
        for edge in node["edges"]:
            if edge is None:
                continue
            if edge == "object" or edge["nr"][0] != "int":
                return False
            kind, j = edge["to"][0], edge["to"][-1]
            nr = edge["nr"][1]
            if kind == "node" and not (j < i and 0 <= nr < nodes[j]["n_in"]):
                return False
            if kind == "leaf" and not (j < program["leaves"] and nr == 0):
                return False
            if kind not in ("node", "leaf"):
                return False
    call = program["call"]
    if call.get("roots_kind") or call.get("outputs") not in (None,):
        return False
    if call.get("binputs") is not None or call.get("engine") not in (None, *ENGINE_BOUNDS):
        return False
    if len(call["grads"]) != len(call["roots"]) or any(g[0] != "ok" for g in call["grads"]):
        return False
    for root in call["roots"]:
        if root is None or root == "object" or root["to"][0] != "node" or root["nr"][0] != "int":
            return False
        j, nr = root["to"][1], root["nr"][1]
        if not (j < len(nodes) and 0 <= nr < nodes[j]["n_in"]):
            return False
    if call["api"] == "execute" and call.get("accumulate", True) is not True:
        return False
    return True


def analytic(program):
    """What a well-formed program must give: per leaf, its ``.grad`` (a list,
    or None), and for ``grad`` the captured gradient of each input."""
    if program.get("kind") == "owner":
        values = program["values"]
        grads = [0.0] * len(values)
        grads[-1] = 1.0
        reachable = [False] * len(values)
        reachable[-1] = True
        for i in range(len(values) - 1, -1, -1):
            if not reachable[i]:
                continue
            for k in values[i]["kids"]:
                grads[k] += program["w"] * grads[i]
                reachable[k] = True
        return {"owner": grads}
    nodes, call = program["nodes"], program["call"]
    slots = [[None] * node["n_in"] for node in nodes]
    reached = [False] * len(nodes)
    leaves = [None] * program["leaves"]

    def add(total, value):
        return list(value) if total is None else [a + b for a, b in zip(total, value)]

    for root, grad in zip(call["roots"], call["grads"]):
        j, nr = root["to"][1], root["nr"][1]
        slots[j][nr] = add(slots[j][nr], grad[1])
        reached[j] = True
    for i in range(len(nodes) - 1, -1, -1):
        if not reached[i]:
            continue
        for row, edge in zip(nodes[i]["w"], nodes[i]["edges"]):
            out = [0.0, 0.0]
            for weight, grad in zip(row, slots[i]):
                if grad is not None:
                    out = [o + weight * g for o, g in zip(out, grad)]
            if edge is None:
                continue
            kind, j = edge["to"]
            if kind == "leaf":
                leaves[j] = add(leaves[j], out)
            else:
                nr = edge["nr"][1]
                slots[j][nr] = add(slots[j][nr], out)
                reached[j] = True
    repeat = call.get("repeat", 1)
    if call["api"] == "grad":
        return {"grads": [None] * program["leaves"],
                "captured": [leaves[i] for i in call["inputs"]]}
    return {"grads": [None if g is None else [v * repeat for v in g] for g in leaves],
            "captured": [] if call["api"] == "execute" else None}
