"""The fuzz's child process: runs a batch of programs on one pyengine core.

``python fuzz_interpreter.py`` reads a JSON list of programs (see
``fuzz_programs.py`` for their form) on stdin and prints one JSON line per
program: ``{"i": index, "exc": exception type name or None, "stage": where
it was raised, "message": its ``str`` (when one was raised), "grads": the
leaves' gradients, "captured": what grad() returned, "owner": an owner
graph's gradients, "check": "ok" or what the reference backward after the
program found wrong}``. The reference backward
runs a fresh small graph after every program: the engine must still give the
right gradient, leave grad mode and anomaly mode as they were, and leave no
thread behind.

A program that runs longer than ``PYENGINE_FUZZ_PROGRAM_TIMEOUT`` seconds
(default 20) is a hang: faulthandler prints every thread's stack on stderr
and the process exits with status 1, so the parent sees a missing line.
``PYENGINE_FUZZ_EXPECT`` (``compiled`` or ``pure``) names the core this
process must have imported.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import subprocess
import sys
import threading
import warnings

import numpy as np

import pyengine
from pyengine import fake_device as fd
from pyengine._core import state_module

# tests/, after this folder: the checks shared with the interrupt sweep.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from thread_state import thread_state_problems  # noqa: E402

SHAPE = (2,)


class FuzzError(Exception):
    """What a node or hook that is told to raise raises."""


class Leaf:
    """A tensor with the protocol ``backward`` and ``grad`` read."""

    def __init__(self, data):
        self.data = np.asarray(data, dtype=np.float64)
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


class FuzzNode(pyengine.Node):
    """A node whose ``apply`` and ``release_variables`` do what its program says."""

    def __init__(self, program, index, next_edges, input_metadata):
        super().__init__(next_edges=next_edges, input_metadata=input_metadata)
        self.program = program
        self.index = index

    def apply(self, grads):
        return self.program.apply(self, grads)

    def release_variables(self):
        super().release_variables()
        self.program.release(self)


def _linear(weights, grads):
    """``out[j] = sum_k weights[j][k] * grads[k]``, a missing gradient as 0."""
    outs = []
    for row in weights:
        total = np.zeros(SHAPE)
        for k, weight in enumerate(row):
            if k < len(grads) and grads[k] is not None:
                total = total + weight * np.asarray(grads[k], dtype=np.float64)
        outs.append(total)
    return outs


def _generator(values):
    yield from values


def odd_return(action, values):
    """``values`` (a list of arrays) changed as ``action`` says; None for an
    action that is not about the returned value."""
    if action == "none":
        return None
    if action == "nones":
        return [None] * len(values)
    if action == "more":
        return list(values) + [np.ones(SHAPE)]
    if action == "fewer":
        return list(values)[:-1]
    if action == "shape":
        return [np.ones((3,)) for _ in values]
    if action == "f32":
        return [np.asarray(v, dtype=np.float32) for v in values]
    if action == "i64":
        return [np.ones(SHAPE, dtype=np.int64) for _ in values]
    if action == "scalar":
        return [1.0 for _ in values]
    if action == "np_scalar":
        # What numpy gives for arithmetic on 0-d arrays: the numpy-scalar
        # paths (routing, the InputBuffers' sums) and the refusal of a ()
        # gradient for a (2,) slot.
        return [np.float64(1.5) for _ in values]
    if action == "str":
        return ["x" for _ in values]
    if action == "bare_str":
        return "xy"
    if action == "int":
        return 3
    if action == "tuple":
        return tuple(values)
    if action == "generator":
        return _generator(values)
    if action == "nan":
        return [np.full(SHAPE, np.nan) for _ in values]
    if action == "indexed":
        # Row 0 of each gradient as an IndexedGradient: the shared slow path
        # of validate_outputs, InputBuffer sums of two kinds, densify at a leaf.
        return [pyengine.IndexedGradient(np.array([0]), np.asarray(v, dtype=np.float64)[:1], SHAPE)
                for v in values]
    if action == "indexed_shape":
        return [pyengine.IndexedGradient(np.array([2]), np.ones(1), (3,)) for _ in values]
    return None


class Program:
    """One program's objects: leaves, nodes, hook handles."""

    def __init__(self, spec):
        self.spec = spec
        self.leaves = [Leaf(np.arange(1.0, 3.0) * (i + 1)) for i in range(spec["leaves"])]
        self.nodes = []
        self.handles = []
        self.stage = "build"
        # What nodes, hooks and callbacks saw (compared between the cores).
        self.log = []
        self.reentrant_depth = 0

    # -- values a program names --

    def target(self, spec):
        kind = spec[0]
        if kind == "node":
            return self.nodes[spec[1] % len(self.nodes)] if self.nodes else object()
        if kind == "leaf":
            return pyengine.grad_accumulator(self.leaves[spec[1] % len(self.leaves)])
        if kind == "none":
            return None
        return object()

    def input_nr(self, spec):
        kind = spec[0]
        if kind == "int":
            return spec[1]
        if kind == "str":
            return str(spec[1])
        if kind == "float":
            return float(spec[1])
        if kind == "bool":
            return bool(spec[1])
        if kind == "np":
            return np.int64(spec[1])
        return None

    def edge(self, spec):
        if spec is None:
            return None
        if spec == "object":
            return object()
        return pyengine.Edge(self.target(spec["to"]), self.input_nr(spec["nr"]))

    def odd_field_value(self, node, field, name):
        edges = node._next_edges if isinstance(node, pyengine.Node) else ()
        leaf_edge = pyengine.gradient_edge(self.leaves[0])
        if field == "_next_edges":
            return {"tuple_object": (object(),), "list": list(edges), "none": None,
                    "tuple_str": ("x",), "tuple_none": (None,), "empty": (),
                    "leaf": (leaf_edge,), "doubled": tuple(edges) * 2,
                    "self": (pyengine.Edge(node, 0),)}.get(name, None)
        return {"none": None, "tuple": tuple(node._input_metadata), "list_object": [object()],
                "list_spec": [(SHAPE, np.float64)], "list_none": [None], "empty": [],
                "wrong_shape": [pyengine.InputMetadata((3,), np.float64)],
                "f32": [pyengine.InputMetadata(SHAPE, np.float32)]}.get(name, None)

    # -- graph mutations (from hooks, apply, release_variables, or up front) --

    def mutate(self, node, action):
        """Change the graph as ``action`` says; True if it was a mutation."""
        if not isinstance(node, pyengine.Node):
            return False
        if action == "shorten":
            node.next_edges = tuple(node.next_edges)[:-1]
        elif action == "extend":
            node.next_edges = tuple(node.next_edges) + (pyengine.gradient_edge(self.leaves[0]),)
        elif action == "cycle":
            node.next_edges = (pyengine.Edge(self.nodes[-1], 0),) + tuple(node.next_edges)[1:]
        elif action == "private_edges":
            node._next_edges = (object(),)
        elif action == "private_meta":
            node._input_metadata = [object()]
        elif action == "clear_meta":
            node._input_metadata = []
        elif action == "remove_hooks":
            for handle in self.handles:
                handle.remove()
        elif action == "raise":
            raise FuzzError(f"{action} in node {getattr(node, 'index', '?')}")
        elif action == "remove_twice":
            for handle in self.handles:
                handle.remove()
                handle.remove()
        elif action.startswith("callback"):
            self.queue_callback(node, action)
        elif action.startswith("reentrant"):
            self.reentrant(node, action)
        elif action.startswith("query_"):
            # A running node's questions to its graph task; asked from a hook
            # on another node or from release_variables, they are misuse.
            query, which = action.split("_")[1:]
            index = {"0": 0, "last": len(node.next_edges) - 1, "out": 7, "str": "0"}[which]
            if query == "should":
                self.log.append(["should", node.index, node.task_should_compute_output(index)])
            else:
                self.log.append(["buffered", node.index,
                                 _encode(node.task_buffered_gradient(index))])
        elif action == "grad_mode_off":
            # The engine sets grad mode per node, and puts the caller's back.
            pyengine.set_grad_enabled(False)
        elif action.startswith("task_"):
            # The running graph task's fields, as Python code may set them.
            graph_task = state_module.get_current_graph_task()
            if action == "task_captured_none":
                graph_task.captured_vars = None
            elif action == "task_leaf_streams_none":
                graph_task.leaf_streams = None
            else:
                graph_task.set_exception(5)
        else:
            return False
        return True

    def queue_callback(self, node, action):
        name = f"cb{len(self.log)}"

        def callback():
            self.log.append(["callback", name])
            if action == "callback_raise":
                raise FuzzError(f"callback {name}")
            if action == "callback_nested":
                # A final callback that queues another: PyTorch runs it too.
                pyengine.queue_callback(lambda: self.log.append(["nested", name]))
            if action == "callback_backward":
                self.small_backward()

        pyengine.queue_callback(callback)

    def small_backward(self):
        """A backward on a fresh one-node graph into leaf 0 (adds 3 * [1, 1])."""
        node = _Scale([pyengine.gradient_edge(self.leaves[0])], [(SHAPE, np.float64)])
        pyengine.backward([pyengine.Edge(node, 0)], [np.ones(SHAPE)])

    def reentrant(self, node, action):
        """A backward called from inside the engine: on a fresh graph, or (at
        most three levels deep) on this program's own graph again."""
        if self.reentrant_depth >= 3:
            return
        self.reentrant_depth += 1
        try:
            if action == "reentrant":
                self.small_backward()
            elif action == "reentrant_grad":
                fresh = _Scale([pyengine.gradient_edge(self.leaves[0])], [(SHAPE, np.float64)])
                (captured,) = pyengine.grad([pyengine.Edge(fresh, 0)], [self.leaves[0]],
                                            [np.ones(SHAPE)])
                self.log.append(["reentrant_grad", _encode(captured)])
            elif action == "reentrant_same":
                roots = self.roots(self.spec["call"])
                grads = [self.root_grad(spec) for spec in self.spec["call"]["grads"]]
                pyengine.backward(roots, grads, retain_graph=True)
        finally:
            self.reentrant_depth -= 1

    # -- what nodes do --

    def apply(self, node, grads):
        spec = self.spec["nodes"][node.index]
        action = spec["apply"]
        if action == "raise":
            raise FuzzError(f"apply of node {node.index}")
        self.mutate(node, action)
        values = _linear(spec["w"], list(grads))
        odd = odd_return(action, values)
        return values if odd is None and action not in ("none",) else odd

    def release(self, node):
        action = self.spec["nodes"][node.index].get("release")
        if action:
            self.mutate(node, action)

    def hook(self, hook_spec, node, value, kind):
        action = hook_spec["action"]
        if action == "none":
            return None
        if hook_spec.get("node") is not None and self.nodes:
            node = self.nodes[hook_spec["node"] % len(self.nodes)]
        if self.mutate(node, action):
            return None
        if kind in ("tensor", "post_acc"):
            if kind == "post_acc":
                return {"scale": 1, "str": "x"}.get(action)  # a post-accumulate hook returns nothing
            if action == "scale":
                return value * 2.0
            odd = odd_return(action, [value])
            if isinstance(odd, list):
                return odd[0] if odd else None
            return odd
        values = [None if v is None else np.asarray(v) for v in value]
        if action == "scale":
            return [None if v is None else v * 2.0 for v in values]
        return odd_return(action, [v if v is not None else np.zeros(SHAPE) for v in values])

    # -- building and running --

    def build(self):
        for index, node_spec in enumerate(self.spec["nodes"]):
            edges = [self.edge(edge) for edge in node_spec["edges"]]
            metadata = [(SHAPE, np.float64) if has else None for has in node_spec["meta"]]
            self.nodes.append(FuzzNode(self, index, edges, metadata))
        self.stage = "hooks"
        for hook_spec in self.spec.get("hooks", ()):
            self.add_hook(hook_spec)
        self.stage = "mutations"
        for mutation in self.spec.get("mutations", ()):
            node = self.nodes[mutation["node"] % len(self.nodes)]
            if mutation["op"] == "set_next_edges":
                node.next_edges = tuple(self.edge(edge) for edge in mutation["edges"])
            elif mutation["op"] == "private":
                setattr(node, mutation["field"],
                        self.odd_field_value(node, mutation["field"], mutation["value"]))

    def add_hook(self, hook_spec):
        kind = hook_spec["kind"]
        node = self.nodes[hook_spec["target"] % len(self.nodes)]
        leaf = self.leaves[hook_spec["target"] % len(self.leaves)]
        if kind == "pre":
            handle = node.register_prehook(lambda grads: self.hook(hook_spec, node, grads, "pre"))
        elif kind == "post":
            handle = node.register_hook(
                lambda grad_inputs, grad_outputs: self.hook(hook_spec, node, grad_inputs, "post"))
        elif kind == "tensor_pre":
            handle = node.register_tensor_prehook(
                hook_spec.get("slot", 0), lambda grad: self.hook(hook_spec, node, grad, "tensor"))
        elif kind == "leaf_tensor":
            handle = pyengine.register_tensor_hook(
                leaf, lambda grad: self.hook(hook_spec, node, grad, "tensor"))
        elif kind == "post_acc":
            handle = pyengine.register_post_accumulate_grad_hook(
                leaf, lambda tensor: self.hook(hook_spec, node, tensor, "post_acc"))
        else:
            return
        self.handles.append(handle)

    def root_grad(self, spec):
        kind = spec[0]
        if kind == "ok":
            return np.asarray(spec[1], dtype=np.float64)
        if kind == "shape":
            return np.ones((3,))
        if kind == "f32":
            return np.ones(SHAPE, dtype=np.float32)
        if kind == "i64":
            return np.ones(SHAPE, dtype=np.int64)
        if kind == "str":
            return "x"
        if kind == "scalar":
            return 1.0
        if kind == "np_scalar":
            return np.float64(1.5)
        return None

    def roots(self, call):
        return [self.edge(root) for root in call["roots"]]

    def run(self):
        call = self.spec["call"]
        with contextlib.ExitStack() as stack:
            if call.get("mode") == "anomaly_build":
                # Nodes made in anomaly mode keep their forward traceback,
                # which an error's note then quotes.
                stack.enter_context(pyengine.detect_anomaly())
            self.build()
            self.stage = "retain_grad"
            retained = self.retained_tensors(call.get("retain_grad", ()))
            if call.get("engine") is not None:
                self.stage = "engine"
                engine = pyengine.Engine(*call["engine"])
                previous = pyengine.set_default_engine(engine)

                def restore():
                    pyengine.set_default_engine(previous)
                    engine.stop()

                stack.callback(restore)
            if call.get("mode") == "anomaly":
                stack.enter_context(pyengine.detect_anomaly())
            elif call.get("mode") == "profile":
                prof = pyengine.profile()
                # Read once the profile has stopped (the exit stack's order).
                stack.callback(lambda: self.log.append(
                    ["profile", prof.runs, [[event.name, event.executed] for event in prof.events]]))
                stack.enter_context(prof)
            try:
                return self.calls(call)
            finally:
                for tensor in retained:
                    self.log.append(["retained", _encode(tensor.grad)])

    def retained_tensors(self, specs):
        """Non-leaf tensors (a node's output ``k``) that keep their gradient."""
        tensors = []
        for j, k in specs:
            tensor = Leaf(np.zeros(SHAPE))
            tensor.grad_fn, tensor.output_nr = self.nodes[j % len(self.nodes)], k
            pyengine.retain_grad(tensor)
            tensors.append(tensor)
        return tensors

    def calls(self, call):
        api = call["api"]
        captured = None
        create = call.get("create", False)
        for repeat in range(call.get("repeat", 1)):
            self.stage = f"call{repeat}"
            retain = call.get("retain", False) or repeat + 1 < call.get("repeat", 1)
            roots = self.roots(call)
            grads = [self.root_grad(spec) for spec in call["grads"]]
            if api == "backward":
                inputs = call.get("binputs")
                if inputs is not None:
                    inputs = [self.leaves[i % len(self.leaves)] for i in inputs]
                pyengine.backward(roots, grads, retain_graph=retain, create_graph=create,
                                  inputs=inputs)
            elif api == "grad":
                inputs = [self.leaves[i % len(self.leaves)] for i in call["inputs"]]
                captured = pyengine.grad(roots, inputs, grads, retain_graph=retain,
                                         create_graph=create, allow_unused=True)
            else:
                outputs = call.get("outputs")
                if isinstance(outputs, list):
                    outputs = [self.edge(edge) for edge in outputs]
                elif outputs == "str":
                    outputs = "ab"
                elif outputs == "int":
                    outputs = 5
                engine = pyengine.get_default_engine()
                if call.get("roots_kind") == "empty":
                    roots = []
                elif call.get("roots_kind") == "generator":
                    roots = _generator(roots)
                captured = engine.execute(roots, grads, retain, create,
                                          call.get("accumulate", True), outputs)
        return captured


# -- owner graphs --

class Value:
    """A value of a framework's own graph (micrograd's Value, roughly)."""

    def __init__(self, graph, index):
        self.graph = graph
        self.index = index
        self.grad = 0.0
        self.kids = ()

    def __hash__(self):
        # The same set order in both child processes (not the id's).
        return self.index

    def back(self):
        self.graph.back(self)

    @property
    def pkids(self):
        # Read by the walk: runs the program's mutation first.
        self.graph.during_walk(self)
        return self.kids

    def __repr__(self):
        return f"V{self.index}"


class OwnerGraph:
    def __init__(self, spec):
        self.spec = spec
        self.values = [Value(self, i) for i in range(len(spec["values"]))]
        self.mutated = False

    def collection(self, kind, members):
        if kind == "tuple":
            return tuple(members)
        if kind == "list":
            return list(members)
        if kind == "set":
            return set(members)
        if kind == "dict":
            return dict.fromkeys(members)
        if kind == "none":
            return None
        if kind == "int":
            return 3
        if kind == "str":
            return "ab"
        if kind == "objects":
            return (object(),) + tuple(members)
        return tuple(members)

    def build(self):
        for value, value_spec in zip(self.values, self.spec["values"]):
            members = [self.values[k % len(self.values)] for k in value_spec["kids"]]
            value.kids = self.collection(value_spec["kind"], members)

    def apply_mutation(self, mutation, at=None):
        target = self.values[mutation["value"] % len(self.values)]
        if mutation.get("parent") and at is not None:
            # A collection that holds ``at``: the one the walk may be iterating now.
            target = next((value for value in self.values
                           if isinstance(value.kids, (tuple, list, set, dict)) and at in value.kids),
                          target)
        other = self.values[mutation["other"] % len(self.values)]
        kids = target.kids
        op = mutation["op"]
        if op == "add":
            if isinstance(kids, set):
                kids.add(Value(self, len(self.values)))
            elif isinstance(kids, list):
                kids.append(other)
            elif isinstance(kids, dict):
                kids[Value(self, len(self.values))] = None
        elif op == "remove":
            if isinstance(kids, (set, list, dict)) and kids:
                if isinstance(kids, set):
                    kids.pop()
                elif isinstance(kids, dict):
                    kids.pop(next(iter(kids)))
                else:
                    kids.pop()
        elif op == "clear":
            if isinstance(kids, (set, list, dict)):
                kids.clear()
        elif op == "rebind":
            target.kids = (other,)
        elif op == "raise":
            raise FuzzError("owner graph mutation")

    def during_walk(self, value):
        mutation = self.spec.get("walk_mutation")
        if mutation and value.index == mutation["at"] % len(self.values):
            self.apply_mutation(mutation, value)

    def back(self, value):
        for kid in self.kids_of(value):
            if isinstance(kid, Value):
                kid.grad += self.spec["w"] * value.grad
        mutation = self.spec.get("back_mutation")
        if mutation and value.index == mutation["at"] % len(self.values):
            self.apply_mutation(mutation)

    def kids_of(self, value):
        kids = value.kids
        return list(kids) if isinstance(kids, (tuple, list, set, dict)) else []

    def run(self):
        self.build()
        root = self.values[-1]
        root.grad = 1.0
        pyengine.execute_owner_graph(root, self.spec["children"], self.spec["method"])
        return [value.grad for value in self.values]


# -- the reference backward, and the loop --

def _encode(value):
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        if value.dtype == np.float64:
            return [float(v) for v in value.ravel()]
        return {"type": f"ndarray[{value.dtype}]", "value": [float(v) for v in value.ravel()]}
    if isinstance(value, float):
        return {"type": "float", "value": value}
    if isinstance(value, pyengine.IndexedGradient):
        return {"type": "IndexedGradient", "value": _encode(value.to_dense())}
    if isinstance(value, bool):
        return value
    return {"type": type(value).__name__}


class _Scale(pyengine.Node):
    def apply(self, grads):
        return [grads[0] * 3.0]


def reference_check(baseline_threads):
    """The engine still works: a fresh graph's exact gradient, global state
    as it was, no thread left behind."""
    problems = thread_state_problems(multithreading=False)
    try:
        x = Leaf([1.0, 2.0])
        node = _Scale([pyengine.gradient_edge(x)], [(SHAPE, np.float64)])
        pyengine.backward([pyengine.Edge(node, 0)], [np.ones(SHAPE)])
        if not (isinstance(x.grad, np.ndarray) and (x.grad == 3.0).all()):
            problems.append(f"reference backward gave {x.grad!r}")
        (captured,) = pyengine.grad([pyengine.Edge(node, 0)], [x], [np.ones(SHAPE)],
                                    retain_graph=True)
        if not (captured == 3.0).all():
            problems.append(f"reference grad gave {captured!r}")
    except BaseException as error:  # reported, never lost
        problems.append(f"reference backward raised {type(error).__name__}: {error}")
    threads = threading.active_count()
    if threads > baseline_threads:
        problems.append(f"{threads - baseline_threads} thread(s) left running")
    return "ok" if not problems else "; ".join(problems)


def message_of(error):
    """``str(error)`` and its notes (anomaly mode's), the words the parent
    compares between the cores (a long one cut, to keep the line short)."""
    notes = getattr(error, "__notes__", None)
    text = str(error) if not isinstance(notes, list) else "\n".join([str(error)] + notes)
    return text[:2000]


def run_one(index, spec, baseline_threads):
    result = {"i": index, "exc": None, "stage": None, "grads": None, "captured": None,
              "owner": None, "log": None}
    if spec.get("kind") == "owner":
        graph = OwnerGraph(spec)
        try:
            result["owner"] = graph.run()
        except Exception as error:
            result["exc"], result["stage"] = type(error).__name__, "owner"
            result["message"] = message_of(error)
    else:
        program = Program(spec)
        try:
            captured = program.run()
            if captured is not None:
                result["captured"] = [_encode(value) for value in captured]
        except Exception as error:
            result["exc"], result["stage"] = type(error).__name__, program.stage
            result["message"] = message_of(error)
        result["grads"] = [_encode(leaf.grad) for leaf in program.leaves]
        result["log"] = program.log
        for handle in program.handles:
            handle.remove()
        del program
    gc.collect()
    result["check"] = reference_check(baseline_threads)
    return result


def child_env(core, program_timeout):
    """The environment a parent runs this interpreter (or another fuzz
    child built on it) in: ``core`` (``compiled`` or ``pure``) selected and
    expected, the hang timeout, and ``PYTHONPATH`` made absolute (the child
    runs from this folder)."""
    env = dict(os.environ)
    env["PYENGINE_PURE"] = "1" if core == "pure" else "0"
    env["PYENGINE_FUZZ_EXPECT"] = core
    env["PYENGINE_FUZZ_PROGRAM_TIMEOUT"] = str(program_timeout)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(entry)
                                            for entry in env["PYTHONPATH"].split(os.pathsep))
    return env


class OnDevice(pyengine.Node):
    """``grad * 3`` on its fake device, noting the thread that ran it."""

    def __init__(self, edges, metadata):
        super().__init__(edges, metadata)
        self.ran_on = []

    def apply(self, grads):
        self.ran_on.append(threading.current_thread().name)
        return [grads[0].numpy() * 3.0]


def device_reference():
    """A backward through a node on each fake device, exact, run by that
    device's worker."""
    problems = []
    for index in (0, 1):
        x = Leaf(np.zeros(SHAPE))
        node = OnDevice([pyengine.gradient_edge(x)],
                        [pyengine.InputMetadata(SHAPE, np.float64, fd.device(index))])
        try:
            pyengine.backward([pyengine.Edge(node, 0)],
                              [fd.to_fake(np.ones(SHAPE), fd.device(index))])
            if not (isinstance(x.grad, np.ndarray) and (x.grad == 3.0).all()):
                problems.append(f"device {index} reference gave {x.grad!r}")
            if node.ran_on != [f"pyengine-fake:{index}"]:
                problems.append(f"device {index} reference ran on {node.ran_on}")
        except Exception as error:
            problems.append(f"device {index} reference raised {type(error).__name__}: {error}")
    return problems


def run_in_children(interpreter, items, env, program_timeout, payload=lambda batch: batch):
    """Runs ``items`` through the child ``interpreter`` (a script in this
    folder that reads ``payload(batch)`` as JSON on stdin and writes a JSON
    line ``{"i": ...}`` per item, ``i`` counted within the batch) in the
    environment ``env``; after a crash or a hang, a new child runs the
    items after the one it died on. Returns ``(results by index, crashes)``,
    a crash being ``{"i", "why", "stderr"}``."""
    results, crashes, start = {}, [], 0
    while start < len(items):
        batch = items[start:]
        timeout = 30.0 + program_timeout * 2 + 2.0 * len(batch)
        # From this folder: there the package imported is the one on PYTHONPATH.
        process = subprocess.Popen([sys.executable, interpreter], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   cwd=os.path.dirname(os.path.abspath(__file__)), env=env)
        try:
            out, err = process.communicate(json.dumps(payload(batch)), timeout=timeout)
            code = process.returncode
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            code = None
        done = 0
        for line in out.splitlines():
            try:
                result = json.loads(line)
            except ValueError:
                continue
            if isinstance(result, dict) and "i" in result:
                result["i"] += start
                results[result["i"]] = result
                done = max(done, result["i"] - start + 1)
        if done == len(batch) and code == 0:
            break
        why = ("a hang (the batch timed out)" if code is None
               else f"a crash (status {code})" if code < 0
               # The status ThreadSanitizer gives a process that reported
               # (TSAN_OPTIONS: .ci/sanitized's thread mode sets it); the
               # report is on stderr, or where its log_path option says.
               else "a ThreadSanitizer report (status 66)" if code == 66 and "TSAN_OPTIONS" in env
               else f"a hang or exit (status {code}, per-program timeout)")
        if done == len(batch):
            # Every item ran, and then the child failed: a crash at its exit
            # (the engine's threads at interpreter shutdown), or the status
            # a sanitizer gives a process it reported on (ThreadSanitizer's
            # 66). Charged to the last item, as run_batch in test_fuzz.py
            # does, so that a crash's "i" always indexes ``items``.
            done -= 1
            why += ", at its exit, after its last item"
        crashes.append({"i": start + done, "why": why, "stderr": err[-6000:]})
        start += done + 1
    return results, crashes


def imported_the_expected_core():
    """Whether this process imported the core ``PYENGINE_FUZZ_EXPECT``
    names (any, where it names none); says which it got where not."""
    expected = os.environ.get("PYENGINE_FUZZ_EXPECT")
    if expected and pyengine.IMPLEMENTATION != expected:
        print(f"expected the {expected} core, imported the {pyengine.IMPLEMENTATION} one",
              file=sys.stderr)
        return False
    return True


def serve(run_one, warm_up=None):
    """A fuzz child's main loop: the programs (JSON on stdin) run one after
    another, ``run_one(index, spec, baseline_threads)`` each, its result a
    JSON line; a program that runs past the timeout ends the child with
    every thread's stack. ``warm_up()`` runs first (threads it starts count
    in the baseline)."""
    if not imported_the_expected_core():
        return 2
    faulthandler.enable()  # a crash prints the stack of the program that made it
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    timeout = float(os.environ.get("PYENGINE_FUZZ_PROGRAM_TIMEOUT", "20"))
    programs = json.load(sys.stdin)
    if warm_up is not None:
        warm_up()
    baseline_threads = threading.active_count()
    for index, spec in enumerate(programs):
        faulthandler.dump_traceback_later(timeout, exit=True)
        result = run_one(index, spec, baseline_threads)
        faulthandler.cancel_dump_traceback_later()
        print(json.dumps(result), flush=True)
    return 0


def main():
    return serve(run_one)


if __name__ == "__main__":
    sys.exit(main())
