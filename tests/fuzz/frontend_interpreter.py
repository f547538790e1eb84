"""Runs a program of ``frontend_programs.py`` under torch or under
``pyengine.frontend`` and writes what happened as a transcript: a list of
JSON-able events, the same list under both libraries when the frontend
behaves as torch.

Events: ``["v", k, value, is_leaf]`` for each value a statement makes;
``["exc", k, type name]`` when statement ``k`` raises; hook calls in the
order they happen, with what the hook saw (``["th", t, grad]`` a tensor
hook of value ``t``, ``["ths", t]`` one that scales, ``["nh", t,
grad_inputs, grad_outputs]`` a ``grad_fn`` post-hook, ``["np", t,
grad_outputs]`` a pre-hook, ``["pah", t, grad]`` a post-accumulate-grad
hook, ``["nofn", t]`` where the value has no ``grad_fn``); ``["grad", k,
results]`` and ``["gg", k, results]`` (the second-order gradient) for
``grad`` calls; ``["skip", k]`` for a statement whose operand a failed
statement did not make; and at the end (unless a ``backward`` or ``grad``
raised: the program ends there) ``["g", i, grad]`` for every leaf and
every value that retains its gradient. A value is ``{"shape", "v"}`` (floats,
NaN and infinities included) with ``"rg"`` (requires_grad) where the library
hands over a Tensor that has the flag.

The frontend refuses two things torch does, by design (Note [Views and the
version counter] in ``pyengine/frontend/tensor.py``; the errors are raised
in ``Tensor._inplace`` there and ``needs_graph`` in
``pyengine/frontend/graph.py``): an in-place operation on a view that takes
part in autograd, and using a view whose base got a new history in place.
Where the frontend raises either, the transcript ends with ``["refused",
k]`` and the comparison stops there.

``python frontend_interpreter.py`` (the fuzz's child process) reads a JSON
list of programs on stdin and prints ``{"i": index, "t": transcript}`` per
program, run on the pyengine core this process imported
(``PYENGINE_FUZZ_EXPECT``, ``compiled`` or ``pure``, names the one it must
be). The parent imports this module for torch and never imports pyengine.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings

import numpy as np

# The frontend's two refusals (see the module docstring), by the start of
# their messages.
REFUSALS = ("an in-place operation on a view that takes part in autograd is not supported",
            "this view was taken before its base was modified by an in-place operation")


class TorchLibrary:
    def __init__(self):
        import torch

        self.torch = torch
        self.Tensor = torch.Tensor
        self.no_grad = torch.no_grad
        self.grad = torch.autograd.grad

    def tensor(self, data, shape, requires_grad):
        return self.torch.tensor(np.asarray(data, dtype=np.float64).reshape(shape),
                                 requires_grad=requires_grad)

    def full(self, shape, value):
        return self.torch.full(tuple(shape), value, dtype=self.torch.float64)

    def array(self, value):
        # force: a second-order gradient may be torch's ZeroTensor, which
        # numpy() alone refuses.
        return value.detach().numpy(force=True)

    def dense(self, value):
        return value

    def shape_op(self, op, x, c):
        torch = self.torch
        if op == "reshape":
            return x.reshape(c)
        if op == "broadcast_to":
            return torch.broadcast_to(x, tuple(c))
        if op == "transpose":
            return x.permute(1, 0)
        if op == "sum":
            return x.sum(dim=c)
        if op == "sum_keep":
            return x.sum(dim=c, keepdim=True)
        if op == "mean":
            return x.mean(dim=c)
        if op == "max":
            return torch.amax(x) if c is None else torch.amax(x, dim=c)
        if op == "softmax":
            return torch.softmax(x, dim=-1)
        if op == "log_softmax":
            return torch.log_softmax(x, dim=-1)
        raise AssertionError(op)


class FrontendLibrary:
    def __init__(self):
        import pyengine
        import pyengine.frontend as frontend

        self.pyengine = pyengine
        self.frontend = frontend
        self.Tensor = frontend.Tensor
        self.no_grad = pyengine.no_grad
        self.grad = frontend.grad

    def tensor(self, data, shape, requires_grad):
        return self.frontend.tensor(np.asarray(data, dtype=np.float64).reshape(shape),
                                    requires_grad=requires_grad)

    def full(self, shape, value):
        return self.frontend.full(tuple(shape), value)

    def array(self, value):
        return np.asarray(value.data)

    def dense(self, value):
        # A lookup's gradient (x[[0, 0, 2]]) stays an IndexedGradient where
        # torch's is dense (See Note [Where an indexed gradient goes] in
        # pyengine/indexed.py; the frontend hands it to hooks and grad()'s
        # caller as it is: ``_tensor_hook`` in pyengine/frontend/tensor.py,
        # ``grad`` in pyengine/frontend/autograd.py). It is compared, and
        # scaled by hooks, densified.
        if isinstance(value, self.pyengine.IndexedGradient):
            return value.to_dense()
        return value

    def shape_op(self, op, x, c):
        if op == "reshape":
            return x.reshape(tuple(c))
        if op == "broadcast_to":
            return x.broadcast_to(tuple(c))
        if op == "transpose":
            return x.transpose()
        if op == "sum":
            return x.sum(axis=c)
        if op == "sum_keep":
            return x.sum(axis=c, keepdims=True)
        if op == "mean":
            return x.mean(axis=c)
        if op == "max":
            return x.max(axis=c)
        if op == "softmax":
            return x.softmax(axis=-1)
        if op == "log_softmax":
            return x.log_softmax(axis=-1)
        raise AssertionError(op)


def _index(x, c):
    if c == "row0" or c == "first":
        return x[0]
    if c == "col0":
        return x[:, 0]
    if c == "tail":
        return x[1:]
    return x[list(c)]


UNARY = {
    "exp": lambda x, c: x.exp(), "tanh": lambda x, c: x.tanh(),
    "sigmoid": lambda x, c: x.sigmoid(), "relu": lambda x, c: x.relu(),
    "neg": lambda x, c: -x, "abs": lambda x, c: abs(x), "clone": lambda x, c: x.clone(),
    "square": lambda x, c: x ** 2, "cube": lambda x, c: x ** 3, "scale": lambda x, c: x * c,
    "shift": lambda x, c: x + c, "rsub": lambda x, c: c - x, "radd": lambda x, c: c + x,
    "rmul": lambda x, c: c * x, "rpow": lambda x, c: abs(c) ** x,
    "rdiv": lambda x, c: c / (x * x + 1.0),
    "log1psq": lambda x, c: (x * x + 1.0).log(), "sqrt1psq": lambda x, c: (x * x + 1.0).sqrt(),
    "detach": lambda x, c: x.detach(), "sumall": lambda x, c: x.sum(),
    "meanall": lambda x, c: x.mean(), "index": _index,
}
BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b * b + 1.0), "matmul": lambda a, b: a @ b,
}


class Run:
    def __init__(self, lib, program):
        self.lib = lib
        self.program = program
        self.events = []
        self.values = [lib.tensor(leaf["data"], leaf["shape"], bool(leaf["rg"]))
                       for leaf in program["leaves"]]
        self.out = None
        # The shape of the gradient an "out" statement gives its output
        # (0.5 everywhere), or None for the implicit one.
        self.gradient_shape = None

    def value(self, v, flag=False):
        """``v`` as JSON: None, a list, or ``{"shape", "v"[, "rg"]}``."""
        if v is None:
            return None
        if isinstance(v, (tuple, list)):
            return [self.value(x, flag) for x in v]
        v = self.lib.dense(v)
        is_tensor = isinstance(v, self.lib.Tensor)
        array = np.asarray(self.lib.array(v) if is_tensor else v, dtype=np.float64)
        out = {"shape": list(array.shape), "v": [float(x) for x in array.ravel()]}
        if flag and is_tensor:
            out["rg"] = bool(v.requires_grad)
        return out

    def log(self, *event):
        self.events.append(list(event))

    def run(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k, stmt in enumerate(self.program["stmts"]):
                try:
                    self.statement(k, stmt)
                except Exception as error:  # noqa: BLE001 - the oracle compares them
                    if isinstance(self.lib, FrontendLibrary) and isinstance(error, RuntimeError) \
                            and str(error).startswith(REFUSALS):
                        self.log("refused", k)
                        return self.events
                    self.log("exc", k, type(error).__name__)
                    if stmt["s"] in ("backward", "grad"):
                        # What a failed backward leaves behind (the .grad
                        # of inputs reached before the failing node) depends
                        # on where it failed, which differs where torch's
                        # graph has other nodes (composites such as matmul):
                        # the program ends here.
                        return self.events
                    if stmt["s"] in ("op", "out"):
                        self.values.append(None)
            for i, v in enumerate(self.values):
                if v is not None and (v.is_leaf or v.retains_grad):
                    self.log("g", i, self.value(v.grad, True))
        return self.events

    def hook(self, k, stmt):
        t, kind, c = stmt["t"], stmt["kind"], stmt["c"]
        x = self.values[t]
        if kind == "log":
            x.register_hook(lambda g: self.log("th", t, self.value(g, True)))
        elif kind == "scale":
            x.register_hook(lambda g: (self.log("ths", t), self.lib.dense(g) * c)[1])
        elif kind == "retain":
            x.retain_grad()
        elif kind == "pah":
            x.register_post_accumulate_grad_hook(lambda v: self.log("pah", t, self.value(v.grad)))
        elif x.grad_fn is None:
            self.log("nofn", t)
        elif kind == "post":
            x.grad_fn.register_hook(lambda gi, go: self.log("nh", t, self.value(gi),
                                                            self.value(go)))
        elif kind == "post_scale":
            x.grad_fn.register_hook(lambda gi, go: tuple(None if g is None else self.lib.dense(g) * c
                                                         for g in gi))
        elif kind == "pre":
            x.grad_fn.register_prehook(lambda go: self.log("np", t, self.value(go)))

    def statement(self, k, stmt):
        s = stmt["s"]
        operands = [stmt[key] for key in ("a", "b", "t", "value") if stmt.get(key) is not None]
        operands += [i for i, _ in stmt.get("terms", ())]
        operands += stmt.get("inputs") or []
        if any(self.values[i] is None for i in operands) or (
                s in ("backward", "grad") and self.out is None):
            self.log("skip", k)
            if s in ("op", "out"):
                self.values.append(None)
            return
        if s == "hook":
            return self.hook(k, stmt)
        if s in ("op", "inplace"):
            with self.lib.no_grad() if stmt["ng"] else contextlib.nullcontext():
                a, c = self.values[stmt["a"]], stmt["c"]
                if s == "inplace":
                    op = stmt["op"]
                    getattr(a, op)(*((c,) if op in ("mul_", "add_") else ()))
                    self.log("v", k, self.value(a, True), a.is_leaf)
                    return
                op = stmt["op"]
                if stmt["b"] is not None:
                    result = BINARY[op](a, self.values[stmt["b"]])
                elif op in UNARY:
                    result = UNARY[op](a, c)
                else:
                    result = self.lib.shape_op(op, a, c)
            self.values.append(result)
            self.log("v", k, self.value(result, True), result.is_leaf)
            return
        if s == "out":
            self.out = self.gradient_shape = None
            if "value" in stmt:
                out = self.values[stmt["value"]]
                self.gradient_shape = tuple(out.shape)
            else:
                out = sum((self.values[i] * w).sum() for i, w in stmt["terms"])
            self.out = out
            self.values.append(out)
            self.log("v", k, self.value(out, True), out.is_leaf)
            return
        inputs = stmt["inputs"] and [self.values[i] for i in stmt["inputs"]]
        # A new gradient tensor for each call: torch's AccumulateGrad may
        # keep a view of the one it was given as a leaf's .grad (a view's
        # own use count is 1), and a later backward's in-place sum into that
        # .grad then changes the tensor a program passes again. pyengine
        # never aliases it (tests/test_api.py,
        # test_first_gradient_does_not_alias_grad_tensors); the fuzz
        # compares the engines, not that.
        gradient = None if self.gradient_shape is None else self.lib.full(self.gradient_shape, 0.5)
        if s == "backward":
            self.out.backward(gradient, retain_graph=stmt["retain"],
                              create_graph=stmt["create"], inputs=inputs)
            return
        grads = self.lib.grad(self.out, inputs, gradient, retain_graph=stmt["retain"],
                              create_graph=stmt["create"], allow_unused=stmt["unused"],
                              materialize_grads=stmt["materialize"])
        self.log("grad", k, self.value(grads, True))
        if stmt["second"]:
            terms = [(g * g).sum() for g in grads if g is not None]
            if not terms:
                return
            again = self.lib.grad(sum(terms), inputs, allow_unused=True)
            self.log("gg", k, self.value(again, True))


def transcript(lib, program):
    return Run(lib, program).run()


def main():
    lib = FrontendLibrary()
    expected = os.environ.get("PYENGINE_FUZZ_EXPECT")
    if expected and lib.pyengine.IMPLEMENTATION != expected:
        sys.exit(f"expected the {expected} core, imported {lib.pyengine.IMPLEMENTATION} from "
                 f"{lib.pyengine.__file__}")
    for i, program in enumerate(json.load(sys.stdin)):
        print(json.dumps({"i": i, "t": transcript(lib, program)}), flush=True)


if __name__ == "__main__":
    main()
