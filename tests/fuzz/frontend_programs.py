"""Random programs of ``pyengine.frontend`` ops, as plain data (JSON), for
the fuzz against torch (``test_frontend_against_torch.py``).

A program::

    {"leaves": [{"shape": [...], "data": [float, ...], "rg": requires_grad}, ...],
     "stmts": [statement, ...]}

Values are numbered: the leaves first, then each statement that makes one
(``op``, ``out``) appends one. A statement is one of::

    {"s": "op", "op": name, "a": i, "b": j or None, "c": constant, "ng": in no_grad}
    {"s": "inplace", "op": "mul_"|"add_"|"exp_"|"zero_", "a": i, "c": constant, "ng": bool}
    {"s": "hook", "kind": log|scale|retain|post|post_scale|pre|pah, "t": i, "c": constant}
    {"s": "out", "terms": [[i, weight], ...]}      # sum of (weight * V[i]).sum()
    {"s": "out", "value": i}                       # V[i] itself, with gradient 0.5
    {"s": "backward", "retain": None|bool, "create": bool, "inputs": [i, ...] or None}
    {"s": "grad", "inputs": [i, ...], "retain": None|bool, "create": bool,
     "unused": None|bool, "materialize": bool, "second": bool}

``backward`` and ``grad`` differentiate the latest ``out``; ``second`` takes
the gradient of the sum of the squared first-order gradients (a
second-order gradient). ``frontend_interpreter.py`` runs a program under
either library; ``render`` writes it as Python for a failure message.
"""

from __future__ import annotations

from hypothesis import strategies as st

SHAPES = [(), (3,), (2, 3), (2, 1), (1, 3)]
DATA = [-1.5, -1.0, -0.5, 0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 2.0]
CONSTANTS = [-1.0, 0.5, 2.0, 3.0]
UNARY = ["exp", "tanh", "sigmoid", "relu", "neg", "abs", "clone", "square", "cube", "scale",
         "shift", "rsub", "radd", "rmul", "rpow", "rdiv", "log1psq", "sqrt1psq", "detach",
         "sumall", "meanall"]
BINARY = ["add", "sub", "mul", "div"]
HOOKS = ["log", "scale", "retain", "post", "post_scale", "pre", "pah"]
INPLACE = ["mul_", "add_", "exp_", "zero_"]
# Ops whose grad_fn has other inputs in torch, so that a post-hook sees
# other grad_inputs; they get pre-hooks instead. matmul is a composite in
# torch (Note [Backward formulas in PyTorch's order] in
# pyengine/frontend/graph.py).
OTHER_NODES = ("matmul",)


def broadcast(a, b):
    """numpy's broadcast shape of ``a`` and ``b``, or None."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


def matmul_shape(a, b):
    if not a or not b or len(a) > 2 or len(b) > 2:
        return None
    if a[-1] != (b[0] if len(b) == 1 else b[-2]):
        return None
    return a[:-1] + b[1:] if len(b) == 2 else a[:-1]


def _shape_ops(shape):
    """``(op, constant, result shape)`` for the shape and indexing ops on ``shape``."""
    size = 1
    for n in shape:
        size *= n
    ops = [("reshape", [-1], (size,)), ("broadcast_to", [2, *shape], (2, *shape))]
    if size % 2 == 0 and size > 2:
        ops.append(("reshape", [2, size // 2], (2, size // 2)))
    if len(shape) == 2:
        ops += [("transpose", None, shape[::-1]), ("index", "row0", shape[1:]),
                ("index", "col0", shape[:1]), ("sum", 0, shape[1:]), ("sum", -1, shape[:1]),
                ("sum_keep", 0, (1,) + shape[1:]), ("mean", 1, shape[:1]), ("max", -1, shape[:1]),
                ("softmax", None, shape), ("log_softmax", None, shape)]
    if len(shape) >= 1:
        ops += [("max", None, ()),
                ("index", [0, 0, shape[0] - 1], (3,) + shape[1:])]
    if len(shape) >= 1 and shape[0] >= 2:
        ops.append(("index", "tail", (shape[0] - 1,) + shape[1:]))  # never empty
    if len(shape) == 1:
        ops.append(("index", "first", ()))
    return ops


@st.composite
def programs(draw, max_ops=8):
    leaves = []
    shapes = []
    for _ in range(draw(st.integers(1, 3))):
        shape = draw(st.sampled_from(SHAPES))
        size = 1
        for n in shape:
            size *= n
        data = draw(st.lists(st.sampled_from(DATA), min_size=size, max_size=size))
        leaves.append({"shape": list(shape), "data": data, "rg": draw(st.integers(0, 7)) > 0})
        shapes.append(shape)
    stmts = []
    read_only = set()
    made_by = {}
    base_of = {}  # views and the tensors they look into: their base
    stale_views = set()  # views taken before an in-place op on their base or a sibling
    for _ in range(draw(st.integers(1, max_ops))):
        a = draw(st.integers(0, len(shapes) - 1))
        sa = shapes[a]
        kind = draw(st.sampled_from(["unary", "binary", "binary", "shape", "matmul", "inplace"]))
        ng = draw(st.integers(0, 9)) == 0
        stmt = {"s": "op", "a": a, "b": None, "c": draw(st.sampled_from(CONSTANTS)), "ng": ng}
        shape = sa
        if kind == "binary":
            partners = [j for j, sb in enumerate(shapes) if broadcast(sa, sb) is not None]
            b = draw(st.sampled_from(partners))
            stmt.update(op=draw(st.sampled_from(BINARY)), b=b)
            shape = broadcast(sa, shapes[b])
        elif kind == "matmul" and any(matmul_shape(sa, sb) is not None for sb in shapes):
            b = draw(st.sampled_from([j for j, sb in enumerate(shapes)
                                      if matmul_shape(sa, sb) is not None]))
            stmt.update(op="matmul", b=b)
            shape = matmul_shape(sa, shapes[b])
        elif kind == "shape":
            op, constant, shape = draw(st.sampled_from(_shape_ops(sa)))
            # Not under no_grad: torch makes a view of a leaf that requires
            # grad there a leaf that requires grad, the frontend one that
            # does not (pyengine/frontend/tensor.py's docstring).
            stmt.update(op=op, c=constant, ng=False)
            if op == "broadcast_to" or (a in read_only and op in ("reshape", "transpose",
                                                                  "index")):
                read_only.add(len(shapes))
            if op in ("reshape", "transpose", "broadcast_to") or (
                    op == "index" and not isinstance(constant, list)):
                base = base_of.get(a, a)
                base_of[len(shapes)] = base
                base_of[base] = base
        elif kind == "inplace" and a in read_only:
            # The frontend's broadcast_to is a read-only numpy view (its
            # docstring, pyengine/frontend/shape.py): writing into it (or
            # a view of it) raises numpy's ValueError where torch's zero_
            # works and mul_ raises RuntimeError. Left out.
            continue
        elif kind == "inplace":
            # Not under no_grad on a view or a tensor with views: torch then
            # gives the views a new history, the frontend does not (Note
            # [Views and the version counter] in pyengine/frontend/tensor.py;
            # in grad mode the frontend refuses instead).
            stmts.append({"s": "inplace", "op": draw(st.sampled_from(INPLACE)), "a": a,
                          "c": stmt["c"], "ng": ng and a not in base_of})
            family = base_of.get(a, a)
            stale_views.update(v for v, base in base_of.items() if base == family and v not in (a, base))
            continue
        else:
            op = draw(st.sampled_from(UNARY))
            stmt["op"] = op
            if op == "detach" and a in read_only:
                read_only.add(len(shapes))
            if op in ("sumall", "meanall"):
                shape = ()
        stmts.append(stmt)
        shapes.append(tuple(shape))
        made_by[len(shapes) - 1] = stmt["op"]
        while draw(st.integers(0, 2)) == 0:
            t = draw(st.integers(0, len(shapes) - 1))
            if t in stale_views:
                # torch 2.13 crashes (SIGSEGV in Tensor.register_hook) on a
                # view whose base was modified in place after the view was
                # taken; the frontend refuses to use such a view.
                continue
            kind = draw(st.sampled_from(HOOKS))
            if kind in ("post", "post_scale") and made_by.get(t) in OTHER_NODES:
                kind = "pre"
            stmts.append({"s": "hook", "kind": kind, "t": t, "c": draw(st.sampled_from(CONSTANTS))})
    made = list(range(len(leaves), len(shapes))) or [0]
    for call in range(draw(st.integers(1, 3))):
        if call == 0 or draw(st.booleans()):
            if draw(st.integers(0, 4)) == 0:
                stmts.append({"s": "out", "value": draw(st.sampled_from(made))})
            else:
                terms = draw(st.lists(st.sampled_from(made), min_size=1, max_size=3))
                stmts.append({"s": "out", "terms": [[i, draw(st.sampled_from(CONSTANTS))]
                                                    for i in terms]})
            shapes.append(None)
        everything = [i for i, shape in enumerate(shapes) if shape is not None]
        retain = draw(st.sampled_from([None, True, False]))
        create = draw(st.integers(0, 2)) == 0
        if draw(st.booleans()):
            inputs = (draw(st.lists(st.sampled_from(everything), min_size=1, max_size=3))
                      if draw(st.integers(0, 2)) == 0 else None)
            stmts.append({"s": "backward", "retain": retain, "create": create, "inputs": inputs})
        else:
            stmts.append({"s": "grad", "retain": retain, "create": create,
                          "inputs": draw(st.lists(st.sampled_from(everything), min_size=1,
                                                  max_size=3)),
                          "unused": draw(st.sampled_from([None, True, False])),
                          "materialize": draw(st.integers(0, 1)) == 0,
                          "second": create and draw(st.integers(0, 3)) > 0})
    return {"leaves": leaves, "stmts": stmts}


def batches(size):
    return st.lists(programs(), min_size=size, max_size=size)


def render(program) -> str:
    """The program as Python-like lines (frontend spelling), for a failure message."""
    lines = [f"v{i} = tensor({leaf['data']}, shape={tuple(leaf['shape'])}, "
             f"requires_grad={bool(leaf['rg'])})" for i, leaf in enumerate(program["leaves"])]
    n = len(program["leaves"])
    for k, stmt in enumerate(program["stmts"]):
        s = stmt["s"]
        if s == "op":
            line = (f"v{n} = {stmt['op']}(v{stmt['a']}"
                    + (f", v{stmt['b']}" if stmt["b"] is not None else "")
                    + f", c={stmt['c']})" + ("  # under no_grad" if stmt["ng"] else ""))
            n += 1
        elif s == "out":
            line = f"out = v{n} = " + (f"v{stmt['value']}  # gradient 0.5" if "value" in stmt else
                                       " + ".join(f"({w} * v{i}).sum()" for i, w in stmt["terms"]))
            n += 1
        else:
            line = ", ".join(f"{key}={value}" for key, value in stmt.items() if key != "s")
            line = f"{s}({line})"
        lines.append(f"{line}  # statement {k}")
    return "\n".join(lines)
