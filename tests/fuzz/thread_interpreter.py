"""The thread fuzz's child process: runs thread programs on one pyengine core.

``python thread_interpreter.py`` reads a JSON list of programs (see
``thread_fuzz.py`` for their form) on stdin and prints one JSON line per
program::

    {"i": index,
     "calls": [[{"exc", "message", "captured"}, ...] per thread],
     "grads": the leaves' .grad, "lazy": the lazy leaves' .grad,
     "counts": {"applies": per node, "post": per node, "post_acc": per leaf,
                "leaf_hook": per leaf, "callbacks": n},
     "stuck": [what was still running after the joins],
     "profiled": how many ThreadNode applies a profile saw, or None,
     "grad_mode_wrong": where grad mode was not as it should be (at most 5),
     "intact": arrays the engine was handed (constant outputs, shared root
               gradients) that changed,
     "check": "ok" or what the reference backwards after the program found wrong}

Each program: its leaves and nodes are built (edges, hooks and, where the
program says so, an Engine with small bounds made the default) before any
thread starts; then ``K`` Python threads run their calls on the shared graph
(``retain_graph=True``), some behind a barrier, some ("late") once a node
of another call has started to run. After the joins: no thread the program
started may still run, and no engine thread may still be in this file's
code (``quiesce``); the reference backwards (a fresh CPU graph, one through
each fake device) are exact, and global state is as it was.

A program that runs longer than ``PYENGINE_FUZZ_PROGRAM_TIMEOUT`` seconds
(default 20) is a hang: faulthandler prints every thread's stack and the
process exits with status 1, so the parent sees a missing line.
``PYENGINE_THREAD_FUZZ_PLANT`` plants a fault (``PLANTS``), to show that
the parent's oracles can fail.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
import weakref

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fuzz_interpreter as fi  # noqa: E402

import pyengine  # noqa: E402
from pyengine import fake_device as fd  # noqa: E402
from pyengine._shared.engine_registry import IDLE_CHECK_S  # noqa: E402

SHAPE = fi.SHAPE


def encode(value):
    """A gradient of a program of width ``w`` (``w`` copies of a pair, see
    ``Program.tile``) as the pair; a value whose copies differ (a sum torn
    by a race) as ``{"type": "torn"}`` with its distinct pairs."""
    value = to_host(value)
    if isinstance(value, np.ndarray) and value.dtype == np.float64 and value.size % 2 == 0 \
            and value.size > 2:
        pairs = value.reshape(-1, 2)
        if not (pairs == pairs[0]).all():
            return {"type": "torn", "value": np.unique(pairs, axis=0)[:4].tolist()}
        value = pairs[0]
    return fi._encode(value)
QUIESCE_S = float(os.environ.get("PYENGINE_THREAD_FUZZ_QUIESCE_S", "3"))
JOIN_S = float(os.environ.get("PYENGINE_THREAD_FUZZ_JOIN_S", "10"))
LATE_WAIT_S = 0.5
THIS_FILE = os.path.abspath(__file__)

# A planted fault and the oracle that must catch it (test-only).
PLANTS = {
    "unlocked_accumulate": "leaves summed by a node without a lock: the exact leaf gradients",
    "drop": "every third apply drops its gradients: the exact leaf gradients / captured",
    "swallow": "backward/grad/execute return normally where they raised: the call outcomes",
    "hang": "a node blocks forever: the per-program timeout",
    "crash": "the process aborts in a node: a negative status",
    "engine_kept": "execute_dropped's Engine kept alive: the collected engines' check",
    "thread_left": "a caller thread that never ends: the stuck check",
    "extra_callback": "a final callback run twice: the counts",
}
PLANT = os.environ.get("PYENGINE_THREAD_FUZZ_PLANT", "")


class FuzzError(Exception):
    """What a node or callback that a program tells to raise raises."""


def device_of(index):
    return pyengine.device.CPU if index < 0 else fd.device(index)


def to_host(value):
    return value.numpy() if isinstance(value, fd.FakeArray) else value


def on_device(value, device):
    if device < 0 or not isinstance(value, np.ndarray):
        return value
    return fd.to_fake(value, fd.device(device))


class UnlockedAccumulate(pyengine.Node):
    """The planted fault "unlocked_accumulate": a leaf's sink that reads,
    yields and writes ``.grad`` with no lock."""

    def __init__(self, leaf):
        super().__init__(next_edges=(), input_metadata=[(leaf.data.shape, np.float64)])
        self.leaf = leaf

    def apply(self, grads):
        old = self.leaf.grad
        time.sleep(0.001)  # another thread's sum lands here, and is lost
        self.leaf.grad = np.array(grads[0]) if old is None else old + grads[0]
        return []


class ThreadNode(pyengine.Node):
    def __init__(self, program, index, next_edges, input_metadata):
        super().__init__(next_edges=next_edges, input_metadata=input_metadata)
        self.program = program
        self.index = index

    def apply(self, grads):
        return self.program.apply(self, grads)


class Program:
    def __init__(self, spec):
        self.spec = spec
        # Gradients are ``width`` copies of a pair: wide ones make numpy
        # release the GIL in the engine's adds.
        self.width = spec.get("width", 1)
        self.shape = (2 * self.width,)
        self.leaves = [fi.Leaf(self.tile(np.arange(1.0, 3.0) * (i + 1)))
                       for i in range(spec["leaves"])]
        self.lazy = [fi.Leaf(np.zeros(self.shape)) for _ in range(spec.get("lazy_leaves", 0))]
        self.nodes = []
        self.handles = []
        self.sinks = {}
        n = len(spec["nodes"])
        # Counters: list.append is atomic, the lengths are counted after the joins.
        self.applies = [[] for _ in range(n)]
        self.post = [[] for _ in range(n)]
        self.post_acc = [[] for _ in self.leaves]
        self.leaf_hook = [[] for _ in self.leaves]
        self.callbacks = []
        self.started = threading.Event()
        self.engine = None
        self.previous_engine = None
        self.apply_count = [0]
        self.profiled = None
        self.grad_mode_wrong = []
        self.constants = {i: self.tile(node["const"]) for i, node in enumerate(spec["nodes"])
                          if node.get("const") is not None}
        self.shared_grads = {}
        self.engine2 = None
        # Weak references to the Engines of execute_dropped calls.
        self.dropped = []

    def tile(self, pair):
        return np.tile(np.asarray(pair, dtype=np.float64), self.width)

    def linear(self, weights, grads):
        """``out[j] = sum_k weights[j][k] * grads[k]``, a missing gradient as 0."""
        outs = []
        for row in weights:
            total = np.zeros(self.shape)
            for k, weight in enumerate(row):
                if k < len(grads) and grads[k] is not None:
                    total = total + weight * grads[k]
            outs.append(total)
        return outs

    # -- the graph --

    def leaf_edge(self, index):
        leaf = self.leaves[index]
        if PLANT == "unlocked_accumulate":
            if index not in self.sinks:
                self.sinks[index] = UnlockedAccumulate(leaf)
            return pyengine.Edge(self.sinks[index], 0)
        return pyengine.gradient_edge(leaf)

    def edge(self, spec):
        if spec is None:
            return None
        kind, j = spec["to"]
        if kind == "leaf":
            return self.leaf_edge(j)
        return pyengine.Edge(self.nodes[j], spec["nr"])

    def build(self):
        for index, node_spec in enumerate(self.spec["nodes"]):
            device = device_of(node_spec["device"])
            metadata = [pyengine.InputMetadata(self.shape, np.float64, device)
                        for _ in range(node_spec["n_in"])]
            edges = [self.edge(edge) for edge in node_spec["edges"]]
            node = ThreadNode(self, index, edges, metadata)
            # apply reads its weights back: a released node raises.
            node.save_for_backward(np.asarray(node_spec["w"], dtype=np.float64))
            self.nodes.append(node)
        for hook in self.spec["hooks"]:
            self.add_hook(hook)
        for rewire in self.spec.get("rewires", ()):
            if rewire.get("in") == "hook":
                self.nodes[rewire["by"]].register_prehook(
                    lambda grads, rewire=rewire: self.rewire(rewire))
        for node, node_spec in zip(self.nodes, self.spec["nodes"]):
            if node_spec.get("reentrant") is not None and node_spec.get("reentrant_in") == "hook":
                nested = node_spec["reentrant"]
                node.register_prehook(lambda grads, nested=nested: self.nested_backward(nested))

    def add_hook(self, hook):
        kind = hook["kind"]
        if kind == "pre":
            node = self.nodes[hook["node"]]
            handle = node.register_prehook(
                lambda grads: [None if g is None else g * 2.0 for g in grads])
        elif kind == "tensor_pre":
            node = self.nodes[hook["node"]]
            handle = node.register_tensor_prehook(0, lambda g: None if g is None else g * 0.5)
        elif kind == "post":
            index = hook["node"]
            handle = self.nodes[index].register_hook(
                lambda grad_inputs, grad_outputs: self.post[index].append(1))
        elif kind == "post_acc":
            index = hook["leaf"]
            handle = pyengine.register_post_accumulate_grad_hook(
                self.leaves[index], lambda tensor: self.post_acc[index].append(1))
        elif kind == "leaf_hook":
            index = hook["leaf"]
            handle = pyengine.register_tensor_hook(
                self.leaves[index], lambda grad: self.leaf_hook[index].append(1))
        else:
            raise ValueError(kind)
        self.handles.append(handle)

    # -- what nodes do --

    def apply(self, node, grads):
        i = node.index
        spec = self.spec["nodes"][i]
        self.applies[i].append(1)
        self.started.set()
        if pyengine.is_grad_enabled():  # off in a node of a backward without create_graph
            self.grad_mode_wrong.append(f"grad mode on in node {i}")
        if spec.get("sleep0"):
            time.sleep(0)
        host = [to_host(g) for g in grads]
        misuse = self.spec.get("misuse") or {}
        if PLANT == "hang" and i == 0:
            threading.Event().wait()
        if PLANT == "crash" and i == 0:
            os.abort()
        reentrant = spec.get("reentrant")
        if reentrant is not None:
            where = spec.get("reentrant_in", "apply")
            if where == "apply":
                self.nested_backward(reentrant)
            elif where == "callback":
                pyengine.queue_callback(lambda: self.nested_backward(reentrant))
        if spec.get("callback"):
            pyengine.queue_callback(lambda: self.callbacks.append(i))
            if PLANT == "extra_callback":
                pyengine.queue_callback(lambda: self.callbacks.append(i))
        if misuse.get("kind") == "callback_raise" and misuse["node"] == i:
            def raising():
                raise FuzzError(f"callback of node {i}")
            pyengine.queue_callback(raising)
        if misuse.get("kind") == "raise" and misuse["node"] == i:
            raise FuzzError(f"apply of node {i}")
        for rewire in self.spec.get("rewires", ()):
            if rewire["by"] == i and rewire.get("in", "apply") == "apply":
                self.rewire(rewire)
        for churn in self.spec.get("hook_churn", ()):
            if churn["by"] == i:
                # Hooks of every kind added to and removed from a node that
                # other threads may be running; they change nothing.
                target = self.nodes[churn["node"]]
                handles = [target.register_prehook(lambda grads: None),
                           target.register_hook(lambda grad_inputs, grad_outputs: None),
                           target.register_tensor_prehook(0, lambda grad: None)]
                time.sleep(0)
                for handle in handles[::-1] if churn["node"] % 2 else handles:
                    handle.remove()
        (weights,) = node.saved_values
        outs = self.linear(weights.tolist(), host)
        if spec.get("const") is not None and outs:
            # The same array, the node's own, to every call of every thread:
            # the engine must never write into it.
            outs[0] = self.constants[i]
        if PLANT == "drop":
            self.apply_count[0] += 1
            if self.apply_count[0] % 3 == 0:
                outs = [np.zeros(self.shape) for _ in outs]
        if misuse.get("kind") == "shape" and misuse["node"] == i:
            outs = [np.ones((3,)) for _ in outs]
        result = []
        for out, edge in zip(outs, spec["edges"]):
            if edge is not None and edge["to"][0] == "node":
                out = on_device(out, self.spec["nodes"][edge["to"][1]]["device"])
            result.append(out)
        return result

    def nested_backward(self, nested):
        """A backward from node ``j``'s slot ``k`` with ``grad``, inside the
        engine (a node, a hook, a final callback)."""
        j, slot, value = nested
        grad = on_device(self.tile(value), self.spec["nodes"][j]["device"])
        pyengine.backward([pyengine.Edge(self.nodes[j], slot)], [grad], retain_graph=True)

    def mutate_until(self, done):
        nodes = self.nodes
        k = 0
        while not done.is_set():
            node = nodes[k % len(nodes)]
            k += 1
            node._next_edges = tuple(None if e is None else pyengine.Edge(e.node, e.input_nr)
                                     for e in node._next_edges)
            node._input_metadata = tuple(pyengine.InputMetadata(m.shape, m.dtype, m.device)
                                         for m in node._input_metadata)
            leaf = self.leaves[k % len(self.leaves)]
            handles = [node.register_prehook(lambda grads: None),
                       pyengine.register_tensor_hook(leaf, lambda grad: None),
                       pyengine.register_post_accumulate_grad_hook(leaf, lambda tensor: None)]
            time.sleep(0)
            for handle in handles:
                handle.remove()

    def rewire(self, rewire):
        """Replace a node's ``next_edges`` while other threads may run it:
        with new Edges to the same places ("same": the gradients do not
        change), or one fewer / one more ("shorten", "extend": misuse)."""
        node = self.nodes[rewire["node"]]
        edges = tuple(node.next_edges)
        if rewire["how"] == "same":
            node.next_edges = tuple(None if e is None else pyengine.Edge(e.node, e.input_nr)
                                    for e in edges)
        elif rewire["how"] == "shorten":
            node.next_edges = edges[:-1]
        else:
            node.next_edges = edges + (self.leaf_edge(0),)

    # -- the calls --

    def root_grad(self, value, node_index):
        device = self.spec["nodes"][node_index]["device"]
        if self.spec.get("shared_grads") and value != "bad":
            # One array per value and device, passed by every thread that
            # uses that value: the engine must never write into it.
            key = (tuple(value), device)
            if key not in self.shared_grads:
                self.shared_grads[key] = on_device(self.tile(value), device)
            return self.shared_grads[key]
        array = np.ones((3,)) if value == "bad" else self.tile(value)
        return on_device(array, device)

    def intact(self):
        """The arrays the engine was handed and must not write into, as they were."""
        problems = []
        for i, array in self.constants.items():
            if encode(array) != self.spec["nodes"][i]["const"]:
                problems.append(f"node {i}'s constant output became {encode(array)}")
        for (value, _), array in self.shared_grads.items():
            if encode(array) != list(value):
                problems.append(f"root gradient {list(value)} became {encode(array)}")
        return problems

    def call(self, call):
        api = call["api"]
        retain = call.get("retain", True)
        if api == "stop_other":
            # Misuse: the second Engine stopped while other threads use it.
            self.engine2.stop()
            return None
        if api == "fresh":
            # A fresh one-node graph into a lazy leaf: the threads make its
            # AccumulateGrad (gradient_edge) at once.
            leaf = self.lazy[call["leaf"]]
            node = fi._Scale([pyengine.gradient_edge(leaf)], [(self.shape, np.float64)])
            pyengine.backward([pyengine.Edge(node, 0)], [self.tile(call["grads"][0])])
            return None
        roots = [pyengine.Edge(self.nodes[j], slot) for j, slot in call["roots"]]
        grads = [self.root_grad(value, j) for value, (j, _) in zip(call["grads"], call["roots"])]
        inputs = [self.leaves[k] for k in call.get("inputs", ())]
        if api == "backward":
            pyengine.backward(roots, grads, retain_graph=retain)
            return None
        if api == "backward_inputs":
            pyengine.backward(roots, grads, retain_graph=retain, inputs=inputs)
            return None
        if api == "execute_other":
            # A second Engine at once with the default one (reentrant
            # backwards in its nodes go to the default engine).
            return self.engine2.execute(roots, grads, retain, False, True, None)
        if api == "execute_dropped":
            # An Engine of the call's own, dropped after it: collected while
            # the other threads run, and its threads end (See Note [An
            # engine's threads hold it weakly] in
            # pyengine/_shared/engine_registry.py).
            engine = pyengine.Engine(*self.spec.get("engine2") or ())
            self.dropped.append(weakref.ref(engine))
            if PLANT == "engine_kept":
                _kept.append(engine)
            return engine.execute(roots, grads, retain, False, True, None)
        if api == "grad":
            return pyengine.grad(roots, inputs, grads, retain_graph=retain, allow_unused=True)
        engine = pyengine.get_default_engine()
        if api == "execute":
            return engine.execute(roots, grads, retain, False, True, None)
        outputs = [self.leaf_edge(k) for k in call["inputs"]]
        return engine.execute(roots, grads, retain, False, False, outputs)

    def thread_body(self, calls, late, no_grad, single, barrier, outcomes):
        try:
            if late:
                self.started.wait(LATE_WAIT_S)
            else:
                barrier.wait(JOIN_S)
        except threading.BrokenBarrierError:
            pass
        if PLANT == "thread_left" and outcomes is self.first_outcomes:
            threading.Event().wait(60)
        # A thread's grad mode is its own: a backward leaves it as it found it.
        mode = not no_grad
        pyengine.set_grad_enabled(mode)
        if single:
            # This thread's backwards run their device nodes on it (per thread).
            pyengine.set_multithreading_enabled(False)
        for call in calls:
            outcome = {"exc": None, "message": None, "captured": None}
            try:
                captured = self.call(call)
                if captured is not None:
                    outcome["captured"] = [encode(v) for v in captured]
            except BaseException as error:  # reported to the parent, never lost
                if PLANT != "swallow":
                    outcome["exc"] = type(error).__name__
                    outcome["message"] = fi.message_of(error)
                    if not isinstance(error, (FuzzError, RuntimeError)):
                        outcome["traceback"] = "".join(traceback.format_exception(error))[-3000:]
                del error
            if pyengine.is_grad_enabled() != mode:
                self.grad_mode_wrong.append(f"grad mode {mode} became {not mode} in a caller")
                pyengine.set_grad_enabled(mode)
            outcomes.append(outcome)

    def run(self):
        spec = self.spec
        self.build()
        if spec.get("engine") is not None:
            self.engine = pyengine.Engine(*spec["engine"])
            self.previous_engine = pyengine.set_default_engine(self.engine)
        self.engine2 = pyengine.Engine(*spec.get("engine2") or ())
        prof = None
        if spec.get("profile"):
            prof = pyengine.profile()
            prof.start()
        if spec.get("anomaly"):
            pyengine.set_detect_anomaly(True)
        switch = sys.getswitchinterval()
        if spec.get("switch"):
            sys.setswitchinterval(spec["switch"])
        threads_spec = spec["threads"]
        barrier = threading.Barrier(sum(1 for t in threads_spec if not t["late"]) or 1)
        outcomes = [[] for _ in threads_spec]
        self.first_outcomes = outcomes[0]
        threads = [threading.Thread(target=self.thread_body,
                                    args=(t["calls"], t["late"], t.get("no_grad", False),
                                          t.get("single", False), barrier, outcomes[k]),
                                    name=f"fuzz-caller-{k}", daemon=True)
                   for k, t in enumerate(threads_spec)]
        stuck = []
        done = threading.Event()
        if spec.get("mutator"):
            # A thread that, while the others run, swaps the nodes' private
            # fields for equal new objects and adds and removes hooks: it runs
            # wherever the engine lets go of the GIL (its waits, numpy's wide
            # adds, Python code), and the gradients must not change.
            threads.append(threading.Thread(target=self.mutate_until, args=(done,),
                                            name="fuzz-mutator", daemon=True))
        try:
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + JOIN_S
            for thread in threads:
                if thread.name == "fuzz-mutator":
                    done.set()
                thread.join(max(0.0, deadline - time.monotonic()))
            stuck = [f"{t.name} still running" for t in threads if t.is_alive()]
        finally:
            sys.setswitchinterval(switch)
            if spec.get("anomaly"):
                pyengine.set_detect_anomaly(False)
        busy = quiesce()
        if busy:
            stuck.append(busy)
        if prof is not None:
            prof.stop()
            self.profiled = sum(1 for event in prof.events
                                if event.name == "ThreadNode" and event.executed)
        if self.engine is not None:
            pyengine.set_default_engine(self.previous_engine)
            self.engine.stop()
        self.engine2.stop()
        for handle in self.handles:
            handle.remove()
        return outcomes, stuck


def engine_threads():
    return [t for t in threading.enumerate() if t.name.startswith("pyengine")]


def quiesce():
    """Waits until no engine thread runs this file's code; names those that
    still do after QUIESCE_S."""
    deadline = time.monotonic() + QUIESCE_S
    while True:
        frames = sys._current_frames()
        busy = []
        for thread in engine_threads():
            frame = frames.get(thread.ident)
            while frame is not None:
                if frame.f_code.co_filename == THIS_FILE:
                    busy.append(thread)
                    break
                frame = frame.f_back
        if not busy:
            return None
        if time.monotonic() > deadline:
            return "; ".join(f"{t.name} stuck in: " + "".join(
                traceback.format_stack(frames[t.ident])[-4:]) for t in busy if t.ident in frames)
        time.sleep(0.005)


# The threads of collected engines (execute_dropped's), with when their
# engine was first seen collected: each must end within about IDLE_CHECK_S
# (See Note [An engine's threads hold it weakly] in
# pyengine/_shared/engine_registry.py). A later program reports one that
# ran on past ENDING_S; until then the thread count does not count them.
_ending = {}
ENDING_S = IDLE_CHECK_S + 5.0
# The plant "engine_kept"'s engines.
_kept = []


def threads_of_collected_engines():
    """The engine threads whose engine was collected: a device worker's and
    a pool thread's arguments hold their engine's weak reference."""
    return [thread for thread in engine_threads()
            if any(isinstance(arg, weakref.ref) and arg() is None
                   for arg in getattr(thread, "_args", ()))]


def collected_engines_problems(dropped):
    """That each Engine dropped after its call was collected; that the
    threads of collected engines end."""
    problems = []
    if any(ref() is not None for ref in dropped):
        problems.append("an Engine dropped after its call (execute_dropped) was not collected")
    now = time.monotonic()
    for thread in threads_of_collected_engines():
        _ending.setdefault(thread, now)
    for thread, since in list(_ending.items()):
        if not thread.is_alive():
            del _ending[thread]
        elif now - since > ENDING_S:
            problems.append(f"{thread.name}, a thread of a collected Engine, still ran "
                            f"{now - since:.1f} s after")
            del _ending[thread]
    return problems


def run_one(index, spec, baseline_threads):
    program = Program(spec)
    outcomes, stuck = program.run()
    dropped = program.dropped
    result = {"i": index, "calls": outcomes, "stuck": stuck,
              "grads": [encode(leaf.grad) for leaf in program.leaves],
              "lazy": [encode(leaf.grad) for leaf in program.lazy],
              "counts": {"applies": [len(c) for c in program.applies],
                         "post": [len(c) for c in program.post],
                         "post_acc": [len(c) for c in program.post_acc],
                         "leaf_hook": [len(c) for c in program.leaf_hook],
                         "callbacks": len(program.callbacks)},
              "profiled": program.profiled, "grad_mode_wrong": program.grad_mode_wrong[:5],
              "intact": program.intact()}
    del program
    gc.collect()
    problems = fi.device_reference()
    problems += collected_engines_problems(dropped)
    check = fi.reference_check(baseline_threads + sum(t.is_alive() for t in _ending))
    if check != "ok":
        problems.append(check)
    result["check"] = "ok" if not problems else "; ".join(problems)
    return result


def main():
    # The default engine's device workers start once, before the thread count.
    return fi.serve(run_one, warm_up=fi.device_reference)


if __name__ == "__main__":
    sys.exit(main())
