"""The child program of tests/test_running_backward_reach.py's sweep: from
each place where a running backward runs Python code, each callable and
each field of each object that code reaches, called or written with none,
odd or other objects' arguments; then the backward goes on.

Run as ``python running_backward_sweep.py FIRST [FILTER]``: the cases from
index FIRST on (whose key contains FILTER), each announced by a ``BEGIN``
line and answered by a line ``INDEX KEY -> OUTCOME``, so that the parent
knows which case crashed or hung the interpreter and goes on after it in a
new one. OUTCOME: what the call answered (``returns`` and a digest of the
value, or the error's type and words), what the backward then gave (the
leaves' gradients: analytic, 2 and 50 times the root gradient, or an
error), and whether a good backward after it gives its exact gradient.

The case list is the same in both cores: the members of each object are
those of the compiled class (and of the Python layer above it), so that
the parent compares the two cores case by case. ``PYENGINE_REACH_FULL=1``
calls each method with more arguments and writes more values (about
100,000 cases per core, minutes); without it the sweep is the test's.

Places (where the action runs, once per backward): a node's ``apply``, a
final callback, ``release_variables``, a node's pre and post hooks, a leaf's
tensor and post-accumulate hooks, the profiler's callback, a node of a
backward nested in a node and handed to a reentrant pool thread (an Engine
with ``max_recursion_depth=0``), a node on a fake device's worker thread
(once the caller's thread waits for it, or, with
``PYENGINE_REACH_DEVICE_ORDER=caller_busy``, while that thread runs a node),
and an owner graph's backward; each under ``backward`` and ``grad(inputs=)``
(an owner graph: writes and returns modes). Objects (targets): the
running graph task (``get_current_graph_task()``), its CPU ready queue and
root, the running node (``get_current_node()``), the node whose ``apply``
or hooks run (``mid``) and the node waiting for its gradient in
``not_ready`` (``other``), a leaf's AccumulateGrad and LeafState, the
engine, the one InputBuffer ``gc`` finds, and the running OwnerGraph.
"""
import copy
import gc
import inspect
import os
import re
import sys
import threading
import time

import numpy as np

import pyengine
import pyengine._core as core
from pyengine import Edge, Node
from pyengine import fake_device as fd

state = core.state_module
DEVICE = fd.device(0)
FIRST = int(sys.argv[1]) if len(sys.argv) > 1 else 0
ONLY = sys.argv[2] if len(sys.argv) > 2 else None
FULL = os.environ.get("PYENGINE_REACH_FULL", "") not in ("", "0")
# The device place's order, ``PYENGINE_REACH_DEVICE_ORDER`` (See Note [A
# case whose answer is a race] in tests/test_running_backward_reach.py):
# ``caller_idle`` (the default), Dev runs its case once the caller's thread
# has run Other and sent b its gradient (its graph task's count of
# outstanding tasks down to Dev's own) and waits for Dev's work;
# ``caller_busy``, while the caller's thread runs Other, which waits for the
# case to have run.
DEVICE_ORDER = os.environ.get("PYENGINE_REACH_DEVICE_ORDER") or "caller_idle"
if DEVICE_ORDER not in ("caller_idle", "caller_busy"):
    raise SystemExit(f"PYENGINE_REACH_DEVICE_ORDER: caller_idle or caller_busy, not {DEVICE_ORDER!r}")
CALLER_BUSY = DEVICE_ORDER == "caller_busy"
CASE_RAN = threading.Event()
# How long the caller's thread gets, after its last decrement, to go back
# to its queue and wait there (a few steps: the compiled core's are C, with
# the GIL held, which Dev needs); and how long a thread waits for the other
# to get where the order says before it goes on (a case that keeps the
# other thread from getting there).
SETTLE_SECONDS = 0.02
WAIT_SECONDS = 2.0


def wait_for_the_caller():
    """Until the running graph task's one task left is Dev's own (the
    caller's thread has run Other, and b's accumulation where there is one),
    then SETTLE_SECONDS."""
    graph_task = state.get_current_graph_task()
    deadline = time.monotonic() + WAIT_SECONDS
    while graph_task.outstanding_tasks > 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(SETTLE_SECONDS)


class Leaf:
    def __init__(self):
        self.data = np.ones(3)
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


def words(error):
    text = re.sub(" at 0x[0-9a-fA-F]+", " at 0x...", str(error))
    text = re.sub("sequence_nr=[0-9]+", "sequence_nr=...", text)
    text = re.sub(r"'pyengine\._[a-z_]+\.", "'", text)
    text = re.sub(r"pyengine\._pure\.[a-z_]+\.|pyengine\._[a-z_]+\.", "", text)
    return f"{type(error).__name__}: {text}"[:300]


def digest(value):
    if isinstance(value, np.ndarray):
        return f"array{tuple(value.ravel().tolist())}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{', '.join(digest(item) for item in value)}]"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def outcome(function):
    try:
        return f"returns {digest(function())}"
    except Exception as error:
        return words(error)


class Top(Node):
    def apply(self, grads):
        # 7 times its gradient to Other: Other's InputBuffer, which waits in
        # not_ready while Mid runs, holds 7s, the root's 1s.
        return [grads[0], grads[0] * 7]


class Mid(Node):
    """Runs ``ACT`` (once) where the case's place says."""

    def apply(self, grads):
        if PLACE == "apply":
            act()
        elif PLACE == "final_callback":
            pyengine.queue_callback(act)
        elif PLACE in ("pool", "pool_apply"):
            nested()
        return [grads[0] * 2, grads[0] * 3]

    def release_variables(self):
        if PLACE == "release_variables":
            act()


class Other(Node):
    def apply(self, grads):
        if PLACE == "device" and CALLER_BUSY:
            CASE_RAN.wait(WAIT_SECONDS)
        return [grads[0] * 5]


class Dev(Node):
    def apply(self, grads):
        if PLACE == "device":
            if not CALLER_BUSY:
                wait_for_the_caller()
            act()
            CASE_RAN.set()
        return [grads[0].numpy() * 2]


class Inner(Node):
    def apply(self, grads):
        act()
        return [grads[0] * 7]


def nested():
    leaf = Leaf()
    node = Inner([pyengine.gradient_edge(leaf)], [((3,), np.float64)])
    pyengine.get_default_engine().execute([Edge(node, 0)], [np.ones(3)], False, False, True)
    RESULT.append(digest(leaf.grad))


PLACE = None
ACTION = None
DONE = []
RESULT = []


def act():
    if DONE:
        return
    DONE.append(1)
    RESULT.append(outcome(ACTION))


def build(place):
    """The graph: Top -> Mid (-> a, -> Other), Top -> Other -> b; Other waits in
    not_ready while Mid runs."""
    a, b = Leaf(), Leaf()
    other = Other([pyengine.gradient_edge(b)], [((3,), np.float64)])
    if place == "device":
        mid = Dev([pyengine.gradient_edge(a)], [pyengine.InputMetadata((3,), np.float64, DEVICE)])
        top = DevTop([Edge(mid, 0), Edge(other, 0)], [((3,), np.float64)])
    else:
        mid = Mid([pyengine.gradient_edge(a), Edge(other, 0)], [((3,), np.float64)])
        top = Top([Edge(mid, 0), Edge(other, 0)], [((3,), np.float64)])
    return top, mid, other, a, b


class DevTop(Node):
    def apply(self, grads):
        return [fd.to_fake(grads[0], DEVICE), grads[0]]


class Owner:
    def __init__(self, *parents):
        self.parents = list(parents)
        self.grad = None

    def backward_writes(self):
        if self is OWNERS[1]:
            act()
        for parent in self.parents:
            parent.grad = (parent.grad if parent.grad is not None else 0) + self.grad * 2


def owner_backward(owner, grads):
    if owner is OWNERS[1]:
        act()
    return [grads[0] * 2 for _ in owner.parents]


OWNERS = []


def build_owners(mode):
    """root -> mid (-> a, -> b), root -> b; each passes twice its gradient on."""
    a, b = Owner(), Owner()
    mid = Owner(a, b)
    root = Owner(mid, b)
    OWNERS[:] = [root, mid, a, b]
    if mode == "writes":
        graph = pyengine.OwnerGraph("parents", "backward_writes")
    else:
        graph = pyengine.OwnerGraph("parents", owner_backward, mode="returns")
    return graph, root, mid, a, b


def objects_of(type_):
    return [o for o in gc.get_objects() if type(o) is type_]


def targets(graph):
    gt = state.get_current_graph_task()
    if PLACE == "owner_graph":
        owner_graph, root, mid, a, b = graph
        return {"graph_task": gt, "ready_queue": getattr(gt, "cpu_ready_queue", None),
                "graph_root": getattr(gt, "graph_root", None),
                "current_node": state.get_current_node(), "owner_graph": owner_graph,
                "mid": None, "other": None, "engine": pyengine.get_default_engine()}
    top, mid, other, a, b = graph
    found = {
        "graph_task": gt,
        "ready_queue": getattr(gt, "cpu_ready_queue", None),
        "graph_root": getattr(gt, "graph_root", None),
        "current_node": state.get_current_node(),
        "mid": mid,
        "other": other,
        "accumulate": pyengine.grad_accumulator(a),
        "leaf_state": pyengine.grad_accumulator(a).leaf_state,
        "engine": pyengine.get_default_engine(),
        "input_buffer": None,
        "root_buffer": None,
    }
    # The InputBuffers gc finds: Other's, in the graph task's not_ready,
    # and the root's, which execute holds.
    for buffer in objects_of(core.InputBuffer):
        first = buffer.buffer[0] if buffer.buffer else None
        if isinstance(first, np.ndarray) and first.tolist() == [7.0] * 3:
            found["input_buffer"] = buffer
        elif isinstance(first, np.ndarray) and first.tolist() == [1.0] * 3:
            found["root_buffer"] = buffer
    return found


# -- actions ------------------------------------------------------------------------

def fresh_graph_task():
    return core.GraphTask(False, False, 0, core.ReadyQueue())


ARGS = {
    "None": lambda t: None, "-1": lambda t: -1, "0": lambda t: 0, "2**64": lambda t: 2**64,
    "'x'": lambda t: "x", "[]": lambda t: [], "graph_task": lambda t: t["graph_task"],
    "mid": lambda t: t["mid"], "other": lambda t: t["other"],
    "ready_queue": lambda t: t["ready_queue"],
    "task": lambda t: core.NodeTask(t["graph_task"], t["other"], [np.ones(3)]),
    "fresh_task": lambda t: core.NodeTask(fresh_graph_task(), t["other"], [np.ones(3)]),
    "fresh_graph_task": lambda t: fresh_graph_task(),
}
PAIRS = [("None", "None"), ("0", "0"), ("mid", "0"), ("other", "0"), ("graph_task", "mid"),
         ("graph_task", "0"), ("task", "None"), ("-1", "ready_queue"), ("0", "ready_queue")]
VALUES = {"None": lambda t: None, "0": lambda t: 0, "-1": lambda t: -1, "'x'": lambda t: "x",
          "[]": lambda t: [], "[None]": lambda t: [None], "()": lambda t: (),
          "object()": lambda t: object(), "graph_task": lambda t: t["graph_task"],
          "mid": lambda t: t["mid"]}
IN_PLACE = ("clear", "pop", "append", "insert")
# The values __init__ and the special cases name: all of them, always.
ALL_ARGS = dict(ARGS)
if not FULL:
    # The test's sweep: each method with no argument, None, the running
    # graph task and a task of it, and one pair; each field written with
    # None and an object of another type, deleted, and cleared in place.
    ARGS = {name: ARGS[name] for name in ("None", "graph_task", "task")}
    PAIRS = [("other", "0")]
    VALUES = {name: VALUES[name] for name in ("None", "object()")}
    IN_PLACE = ("clear", "append")
INIT_ARGS = {
    "graph_task": [(), ("None",), ("0", "0", "0", "ready_queue")],
    "engine": [(), ("0",)],
    "ready_queue": [(), ("None",)],
    "input_buffer": [(), ("0",), ("None",)],
    "root_buffer": [(), ("0",), ("None",)],
    "owner_graph": [(), ("'x'", "'x'")],
}
# Methods that wait for what never comes on this thread, or loop until a
# shutdown task: special cases below.
WAITS = {"wait", "pop", "_device_thread_main", "thread_main", "execute_with_graph_task"}
# Calls that leave the running backward waiting forever by what they ask:
# a count of outstanding tasks that never reaches zero again (a task
# counted and never run: increment_outstanding_tasks, push_pop of a task
# that comes back to the caller, discard_graph_task of the running task's
# queued tasks), this thread's own loop run again on a task that waits for
# the node that runs it (_run_pool_task), a device loop on a queue no
# thread serves that takes the task the engine held back for this thread,
# a pop or a CPU loop on another thread's queue, which takes its owner's
# task (the cores differ in what then happens, as the two threads race for
# it). Each is what a lock taken twice by one thread is: asked for. Not
# run: the report of the sweep that found them lists them.
KNOWN_WAITS = ("graph_task.increment_outstanding_tasks()", "ready_queue.push_pop(task)",
               # The full sweep's: a task queued for the running graph task
               # comes back to the caller in its place, and never runs.
               "ready_queue.push_pop(fresh_task)",
               "ready_queue.discard_graph_task(graph_task)", "engine._run_pool_task(",
               "profiler/backward: engine._device_thread_main(", "profiler/grad: "
               "engine._device_thread_main(",
               # From another thread than the queue's: a pop that takes the
               # owner's task, which then never runs (or runs only in part,
               # as the owner's thread and this one race for it).
               "device/backward: ready_queue.push_shutdown+pop",
               "device/grad: ready_queue.push_shutdown+pop", "pool/backward: ready_queue.push_shutdown+pop",
               "pool/grad: ready_queue.push_shutdown+pop",
               "device/backward: engine._device_thread_main(-1, running queue)",
               "device/grad: engine._device_thread_main(-1, running queue)",
               # From a device thread, a task for a node of the running
               # graph task pushed to its owner's queue: the node runs twice,
               # the second time before or after the first as the two
               # threads race (the full sweep saw the cores answer apart).
               "device/backward: ready_queue.push(task", "device/grad: ready_queue.push(task")
TARGET_TYPES = {
    "graph_task": core.GraphTask, "ready_queue": core.ReadyQueue, "graph_root": None,
    "current_node": None, "mid": None, "other": None,
    "accumulate": pyengine.AccumulateGrad, "leaf_state": core.LeafState,
    "engine": core.Engine, "input_buffer": core.InputBuffer, "root_buffer": core.InputBuffer,
    "owner_graph": core.OwnerGraph,
}
OWNER_TARGETS = ("graph_task", "ready_queue", "owner_graph", "engine")


def compiled_class(name):
    """The compiled core's class of target ``name`` (its members name the
    cases in both cores), and the Python-layer class above it, if any."""
    import pyengine._engine as engine_module
    import pyengine._graph_task as graph_task_module
    import pyengine._input_buffer as input_buffer_module
    import pyengine._node as node_module
    import pyengine._owner_graph as owner_graph_module
    import pyengine._ready_queue as ready_queue_module
    python_layer = {"graph_root": None, "current_node": Mid, "mid": Mid, "other": Other,
                    "accumulate": pyengine.AccumulateGrad}.get(name)
    return {"graph_task": graph_task_module.GraphTask,
            "ready_queue": ready_queue_module.ReadyQueue,
            "graph_root": node_module.NodeBase, "current_node": node_module.NodeBase,
            "mid": node_module.NodeBase, "other": node_module.NodeBase,
            "accumulate": node_module.AccumulateGradBase, "leaf_state": node_module.LeafState,
            "engine": engine_module.Engine, "input_buffer": input_buffer_module.InputBuffer,
            "root_buffer": input_buffer_module.InputBuffer,
            "owner_graph": owner_graph_module.OwnerGraph}[name], python_layer


def members(name):
    """Each member's name and whether it is a method."""
    base, python_layer = compiled_class(name)
    found = {}
    for attribute in dir(base):
        found[attribute] = inspect.getattr_static(base, attribute, None)
    for klass in (python_layer.__mro__ if python_layer is not None else ()):
        if not klass.__module__.startswith("pyengine._"):
            for attribute, member in vars(klass).items():
                found.setdefault(attribute, member)
    return [(attribute, inspect.isroutine(member) or isinstance(member, (classmethod,
                                                                          staticmethod)))
            for attribute, member in sorted(found.items())
            if not attribute.startswith("__") and not attribute.endswith("_")
            and attribute not in WAITS]


def call(name, attribute, arg_names):
    def run():
        t = targets(GRAPH)
        obj = t[name]
        args = [ALL_ARGS[a](t) for a in arg_names]
        return getattr(obj, attribute)(*args)
    return run


def special_actions(name):
    def queue_pop_after_shutdown():
        t = targets(GRAPH)
        t["ready_queue"].push_shutdown()
        return t["ready_queue"].pop()

    def device_loop(device_id, own_queue):
        def run():
            t = targets(GRAPH)
            queue = t["ready_queue"] if own_queue else core.ReadyQueue()
            queue.push_shutdown()
            return t["engine"]._device_thread_main(device_id, queue)
        return run

    def execute_through(node_name, keep):
        def run():
            t = targets(GRAPH)
            return t["engine"].execute([Edge(t[node_name], 0)], [np.ones(3)], keep, False, True)
        return run

    def reduce_and_make():
        t = targets(GRAPH)
        reduced = t[name].__reduce_ex__(2)
        made = reduced[0](*reduced[1])
        if len(reduced) > 2 and reduced[2] is not None:
            made.__setstate__(reduced[2])
        return made

    actions = {
        "reduce_ex+make": reduce_and_make,
        "copy.copy": lambda: copy.copy(targets(GRAPH)[name]),
        "copy.deepcopy": lambda: copy.deepcopy(targets(GRAPH)[name]),
        "__new__": lambda: type(targets(GRAPH)[name]).__new__(type(targets(GRAPH)[name])),
        "__setstate__(None)": call(name, "__setstate__", ("None",)),
        "__setstate__({})": lambda: targets(GRAPH)[name].__setstate__({}),
    }
    if name == "graph_task":
        # The running graph task's own wait: refused, not a hang (See Note
        # [A graph task waits for itself] in pyengine/_pure/graph_task.py).
        actions["wait()"] = call(name, "wait", ())
    if name == "ready_queue":
        actions["push_shutdown+pop"] = queue_pop_after_shutdown
    if name == "engine":
        actions["_device_thread_main(0, new queue)"] = device_loop(0, False)
        actions["_device_thread_main(-1, running queue)"] = device_loop(-1, True)
        actions["_device_thread_main(0, running queue)"] = device_loop(0, True)
        actions["_device_thread_main(-2, new queue)"] = device_loop(-2, False)
        for node_name in ("mid", "other", "accumulate"):
            for keep in (False, True):
                actions[f"execute([{node_name}], keep={keep})"] = execute_through(node_name, keep)
    return actions


def field_actions(name, attribute):
    def write(value):
        def run():
            t = targets(GRAPH)
            setattr(t[name], attribute, VALUES[value](t))
        return run

    def delete():
        delattr(targets(GRAPH)[name], attribute)

    def in_place(how):
        def run():
            value = getattr(targets(GRAPH)[name], attribute)
            if isinstance(value, list):
                if how == "clear":
                    value.clear()
                elif how == "pop":
                    value.pop()
                elif how == "append":
                    value.append(None)
                elif how == "insert":
                    value.insert(0, object())
                return len(value)
            if isinstance(value, dict):
                if how == "clear":
                    value.clear()
                elif how == "pop":
                    value.popitem()
                elif how == "append":
                    value[object()] = None
                elif how == "insert":
                    value[0] = object()
                return len(value)
            return f"not a container: {type(value).__name__}"
        return run

    actions = {f"= {value}": write(value) for value in VALUES}
    actions["del"] = delete
    for how in IN_PLACE:
        actions[f".{how}()"] = in_place(how)
    return actions


def cases_of(name, light):
    """The actions on target ``name``; ``light``: each method called with no
    argument, each field set to None, deleted and cleared."""
    cases = {}
    for args in INIT_ARGS.get(name, [(), ("None",)]):
        cases[f"__init__({', '.join(args)})"] = call(name, "__init__", args)
    cases.update(special_actions(name))
    for attribute, is_method in members(name):
        if is_method:
            cases[f"{attribute}()"] = call(name, attribute, ())
            for arg in () if light else ARGS:
                cases[f"{attribute}({arg})"] = call(name, attribute, (arg,))
            for pair in () if light else PAIRS:
                cases[f"{attribute}({', '.join(pair)})"] = call(name, attribute, pair)
        else:
            for key, action in field_actions(name, attribute).items():
                if not light or key in ("= None", "del", ".clear()"):
                    cases[f"{attribute} {key}"] = action
    return cases


# The test's sweep (not FULL): from a node's apply, every target it reaches
# with the test's arguments under backward, and lightly (See cases_of)
# under grad(inputs=); from each other place, under one of the two, the
# objects every place reaches (the graph task, its queue, the engine) and
# the one the place is about, lightly.
ALL_TARGETS = ("graph_task", "ready_queue", "graph_root", "current_node", "mid", "other",
               "accumulate", "leaf_state", "engine", "input_buffer", "root_buffer")
APPLY_TARGETS = ("graph_task", "ready_queue", "mid", "other", "engine", "input_buffer",
                 "root_buffer")
LIGHT_PLACES = {
    "final_callback": ("backward", ()), "release_variables": ("grad", ()),
    "pre_hook": ("backward", ()), "post_hook": ("grad", ()),
    "tensor_hook": ("grad", ("leaf_state",)), "post_accumulate": ("backward", ("accumulate",)),
    "profiler": ("grad", ()), "pool": ("backward", ()), "device": ("backward", ()),
    "owner_graph": ("returns", ("owner_graph",)),
}


def plan():
    """(place, mode, target, light) in the order the cases run."""
    for place in PLACES:
        modes = OWNER_MODES if place == "owner_graph" else MODES
        names = OWNER_TARGETS if place == "owner_graph" else ALL_TARGETS
        for mode in modes:
            for name in names:
                if FULL:
                    yield place, mode, name, False
                elif place == "apply":
                    if name in APPLY_TARGETS:
                        yield place, mode, name, mode == "grad"
                elif mode == LIGHT_PLACES[place][0] and (
                        name in ("graph_task", "ready_queue", "engine")
                        or name in LIGHT_PLACES[place][1]):
                    yield place, mode, name, True


PLACES = ["apply", "final_callback", "release_variables", "pre_hook", "post_hook",
          "tensor_hook", "post_accumulate", "profiler", "pool", "device", "owner_graph"]
MODES = ["backward", "grad"]
OWNER_MODES = ["writes", "returns"]


def install(place, graph):
    top, mid, other, a, b = graph
    handles = []
    if place == "pre_hook":
        handles.append(mid.register_prehook(lambda grads: act()))
    elif place == "post_hook":
        handles.append(mid.register_hook(lambda grad_inputs, grad_outputs: act()))
    elif place == "tensor_hook":
        handles.append(pyengine.register_tensor_hook(a, lambda grad: act()))
    elif place == "post_accumulate":
        handles.append(pyengine.register_post_accumulate_grad_hook(a, lambda tensor: act()))
    elif place == "profiler":
        state.set_profiler(lambda node, start, end: act() if node is mid else None)
    return handles


def run_owner_case(mode, action):
    global PLACE, ACTION, GRAPH
    engine = core.Engine()
    previous_engine = pyengine.get_default_engine()
    pyengine.set_default_engine(engine)
    PLACE, ACTION = "owner_graph", action
    DONE.clear()
    RESULT.clear()
    GRAPH = build_owners(mode)
    graph, root, mid, a, b = GRAPH
    root.grad = np.ones(3)
    try:
        if mode == "writes":
            then = outcome(lambda: (graph.backward(root), (a.grad, b.grad))[1])
        else:
            then = outcome(lambda: (graph.backward(root, np.ones(3)), (a.grad, b.grad))[1])
    finally:
        PLACE = None
        pyengine.set_default_engine(previous_engine)
        stop(engine)
    GRAPH = None
    return f"{'; '.join(RESULT) or 'not run'} | then {then} | after {good_after()}"


def stop(engine):
    try:
        engine.stop()
    except Exception as error:
        RESULT.append("stop: " + words(error))


def good_after():
    """The thread outside a backward (as a case may not leave it: grad mode
    on, no graph task current, the checkpoint flag on) and a good backward
    giving its exact gradient: ``ok``, else ``BAD AFTER`` and what was not."""
    left = [what for what, wrong in (
        ("grad mode off", not state.is_grad_enabled()),
        ("a graph task current", state.get_current_graph_task() is not None),
        ("the checkpoint flag off", not state.is_checkpoint_valid())) if wrong]
    state.set_grad_enabled(True)
    x = Leaf()
    good = Other([pyengine.gradient_edge(x)], [((3,), np.float64)])
    after = outcome(lambda: (pyengine.get_default_engine().execute(
        [Edge(good, 0)], [np.ones(3)], False, False, True), x.grad)[1])
    if after != "returns array(5.0, 5.0, 5.0)":
        left.append(after)
    return "ok" if not left else "BAD AFTER " + "; ".join(left)


def run_case(place, mode, action):
    global PLACE, ACTION, GRAPH
    if place == "owner_graph":
        return run_owner_case(mode, action)
    engine = core.Engine(max_recursion_depth=0 if place == "pool" else 60)
    previous_engine = pyengine.get_default_engine()
    pyengine.set_default_engine(engine)
    PLACE, ACTION = place, action
    DONE.clear()
    RESULT.clear()
    CASE_RAN.clear()
    GRAPH = build(place)
    top, mid, other, a, b = GRAPH
    install(place, GRAPH)
    try:
        if mode == "grad":
            then = outcome(lambda: engine.execute(
                [Edge(top, 0)], [np.ones(3)], False, False, False,
                outputs=[pyengine.gradient_edge(a), pyengine.gradient_edge(b)]))
        else:
            then = outcome(lambda: (engine.execute([Edge(top, 0)], [np.ones(3)], False, False,
                                                   True), (a.grad, b.grad))[1])
    finally:
        state.set_profiler(None)
        pyengine.set_default_engine(previous_engine)
        PLACE = None
        stop(engine)
    GRAPH = None
    return f"{'; '.join(RESULT) or 'not run'} | then {then} | after {good_after()}"


GRAPH = None
index = 0
for place, mode, name, light in plan():
    for action_name, action in cases_of(name, light).items():
        key = f"{place}/{mode}: {name}.{action_name}"
        if any(wait in key for wait in KNOWN_WAITS) or (
                # Outside any engine loop, it leaves this thread a device
                # worker for good (both cores).
                place == "owner_graph" and "_device_thread_main" in key):
            continue
        if index >= FIRST and (ONLY is None or ONLY in key):
            print(f"BEGIN {index} {key}", flush=True)
            print(f"{index} {key} -> {run_case(place, mode, action)}", flush=True)
        index += 1
print("END", index, flush=True)
