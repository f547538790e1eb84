"""The two cores answer odd arguments alike: each public constructor, core
function and method of an instance, called with none, one or two values
from a pool of odd ones
(None, negative and huge ints, floats, strings, empty and wrong
containers, arrays, a node, an edge...), either returns in both cores or
raises the same exception type in both, and neither crashes.

The oracle is the other core, and a clean exit: each core runs the sweep in
a fresh interpreter (a crash fails the test with its exit status). The
exception types are compared, not the words: Cython's argument errors and
the twin's differ in module paths and phrasing. This sweep found None read
as an extension type (SIGSEGV) in five functions, a write into None, and
the twin accepting what the compiled core refuses (issue notes of
2026-12-02).

The sweeps after it compare words as well (but a wrong count of arguments,
which Cython and Python word apart): each method of each public instance;
what an object whose ``__init__`` never ran reads; each field written and
deleted; ``X.__new__(cls)`` with another class; and a second ``__init__``.
Not compared, and where the cores still differ, because the twin's classes
are Python's (heap types) and the compiled ones static types: assigning
``__class__`` (refused on a static type; a property on the twin's
``__class__`` would run on every ``isinstance`` that fails), and the type
name CPython's own ``object.__format__`` error prints.
"""

from __future__ import annotations

import importlib.util

import pytest
from conftest import run_on_core

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pyengine._engine") is None,
                                reason="no compiled core to compare with")

_SWEEP = r'''
import gc
import itertools

import numpy as np

import pyengine
import pyengine._core as core
from pyengine import Edge, InputMetadata, Node


class Sink(Node):
    def __init__(self):
        super().__init__(input_metadata=[((3,), np.float64)])

    def apply(self, grads):
        return ()


class Variable:
    def __init__(self):
        self.data = np.ones(3)
        self.grad = None
        self.requires_grad = True


POOL = {"None": lambda: None, "0": lambda: 0, "-1": lambda: -1, "2**64": lambda: 2**64,
        "1.5": lambda: 1.5, "'x'": lambda: "x", "()": lambda: (), "[]": lambda: [],
        "[None]": lambda: [None], "(3,)": lambda: (3,), "object()": object,
        "array": lambda: np.ones(3), "0-d": lambda: np.float64(1.0), "True": lambda: True,
        "int8": lambda: np.int8(3), "dtype": lambda: np.float64, "node": Sink,
        "edge": lambda: Edge(Sink(), 0), "metadata": lambda: InputMetadata((3,), np.float64),
        "variable": Variable}
def outcome(function, names):
    try:
        function(*(POOL[name]() for name in names))
    except Exception as error:
        return type(error).__name__
    return "returns"


TARGETS = {
    "Edge": core.Edge, "InputMetadata": core.InputMetadata, "InputBuffer": core.InputBuffer,
    "LeafState": core.LeafState, "OwnerGraph": core.OwnerGraph, "GraphRoot": core.GraphRoot,
    "AccumulateGrad": pyengine.AccumulateGrad, "GradientFreeNode": pyengine.GradientFreeNode,
    "ReadyQueue": core.ReadyQueue, "NodeTask": core.NodeTask, "Engine": core.Engine,
    "GraphTask(...).buffered_gradient": lambda *args: core.GraphTask(
        False, False, 0, core.ReadyQueue()).buffered_gradient(*args),
    "validate_outputs": core.validate_outputs, "set_sequence_nr": core.set_sequence_nr,
    "gradient_edge": pyengine.gradient_edge, "grad_accumulator": pyengine.grad_accumulator,
    "retain_grad": pyengine.retain_grad, "register_tensor_hook": pyengine.register_tensor_hook,
    "register_post_accumulate_grad_hook": pyengine.register_post_accumulate_grad_hook,
    "keep_indexed_grad": pyengine.keep_indexed_grad, "densify": pyengine.densify,
    "IndexedGradient": pyengine.IndexedGradient, "Device": pyengine.Device,
    "GradientEdge": pyengine.GradientEdge,
    "ReadyQueue().push": lambda *args: core.ReadyQueue().push(*args),
    "ReadyQueue().push_pop": lambda *args: core.ReadyQueue().push_pop(*args),
    "InputBuffer(2).add": lambda *args: core.InputBuffer(2).add(*args),
}



for target, function in TARGETS.items():
    for count in range(3):
        for names in itertools.product(sorted(POOL), repeat=count):
            print(f"{target}({', '.join(names)}) -> {outcome(function, names)}")
    gc.collect()
'''


def test_both_cores_answer_odd_arguments_alike():
    compiled = run_on_core(_SWEEP, pure=False, timeout=300)
    pure = run_on_core(_SWEEP, pure=True, timeout=300)
    assert len(compiled) == len(pure) > 10_000
    differences = [(a, b) for a, b in zip(compiled, pure) if a != b]
    assert differences == [], f"{len(differences)} calls differ, the first: {differences[:5]}"


_METHOD_SWEEP = _SWEEP.split("TARGETS = {")[0] + r'''
MAKERS = {
    "node": Sink,
    "accumulate": lambda: pyengine.AccumulateGrad(Variable()),
    "free": lambda: pyengine.GradientFreeNode(Variable(), "x"),
    "root": lambda: core.GraphRoot([Edge(Sink(), 0)], [np.ones(3)]),
    "edge": lambda: Edge(Sink(), 0),
    "metadata": lambda: InputMetadata((3,), np.float64),
    "buffer": lambda: core.InputBuffer(2),
    "leaf_state": core.LeafState,
    "graph_task": lambda: core.GraphTask(False, False, 0, core.ReadyQueue()),
    "owner_graph": lambda: pyengine.OwnerGraph("items", lambda o, g: g, mode="returns"),
    "indexed": lambda: pyengine.IndexedGradient(np.array([0]), np.ones((1, 3)), (2, 3)),
}
# Methods that wait for work that never comes (a queue's pop, a graph task's
# wait) or end the engine's threads.
WAITS = {"wait", "pop", "thread_main", "stop", "execute_with_graph_task"}



for maker_name, make in MAKERS.items():
    instance = make()
    for attribute in sorted(dir(instance)):
        if attribute.startswith("__") or attribute in WAITS:
            continue
        if not callable(getattr(instance, attribute)):
            continue
        for count in range(3):
            for names in itertools.product(sorted(POOL), repeat=count):
                def call(*args, attribute=attribute):
                    return getattr(make(), attribute)(*args)
                print(f"{maker_name}.{attribute}({', '.join(names)}) -> {outcome(call, names)}")
    gc.collect()
'''


def test_both_cores_answer_odd_method_calls_alike():
    def answers(pure):
        lines = run_on_core(_METHOD_SWEEP, pure=pure, timeout=300)
        return dict(line.split(" -> ") for line in lines)

    compiled, pure = answers(False), answers(True)
    # The twin may have helpers of its own (it is plain Python); every
    # compiled method must have its twin.
    assert set(compiled) <= set(pure)
    assert len(compiled) > 20_000
    differences = [(call, compiled[call], pure[call]) for call in compiled
                   if compiled[call] != pure[call]]
    assert differences == [], f"{len(differences)} calls differ, the first: {differences[:5]}"


_UNINITIALIZED_SWEEP = _SWEEP.split("TARGETS = {")[0] + r'''
# Made by __new__ alone: a subclass whose __init__ forgot its base's. Each
# attribute read, and each method called with none or one odd value, and
# the node handed to what takes one.
for cls in (Node, pyengine.AccumulateGrad, pyengine.GradientFreeNode, pyengine.OwnerGraph,
            core.LeafState, pyengine.GraphRoot, pyengine.InputMetadata):
    for attribute in sorted(dir(cls)):
        # The twin's slots behind its properties end in "_": not the API.
        if attribute.startswith("__") or attribute.endswith("_"):
            continue
        print(f"{cls.__name__}.{attribute} -> {outcome(lambda: getattr(cls.__new__(cls), attribute), ())}")
        if not callable(getattr(cls, attribute, None)):
            continue
        for count in range(2):
            for names in itertools.product(sorted(POOL), repeat=count):
                def call(*args, attribute=attribute):
                    return getattr(cls.__new__(cls), attribute)(*args)
                print(f"{cls.__name__}.{attribute}({', '.join(names)}) -> {outcome(call, names)}")
    for name, use in [("Edge", lambda node: Edge(node, 0)),
                      ("gradient_edge", lambda node: pyengine.gradient_edge(node)),
                      ("execute", lambda node: pyengine.get_default_engine().execute(
                          [Edge(Sink(), 0)], [np.ones(3)], False, False, True,
                          outputs=[node])),
                      ("validate_outputs", lambda node: core.validate_outputs(
                          (None,), [None], None, node)),
                      ("repr", repr), ("copy", lambda node: __import__("copy").copy(node)),
                      ("deepcopy", lambda node: __import__("copy").deepcopy(node))]:
        print(f"{name}({cls.__name__}.__new__) -> {outcome(lambda: use(cls.__new__(cls)), ())}")
    gc.collect()
# A core class's instance has no __dict__; its Python subclasses' have one.
for cls in (core.NodeBase, core.AccumulateGradBase, core.GradientFreeNodeBase, core.GraphRoot,
            Node, pyengine.AccumulateGrad, pyengine.GradientFreeNode):
    print(f"vars({cls.__name__}.__new__) -> {outcome(lambda: vars(cls.__new__(cls)), ())}")
# And made whole: copied (a GradientFreeNode only) as the compiled core does.
for name, make in [("Node", Sink), ("AccumulateGrad", lambda: pyengine.AccumulateGrad(Variable())),
                   ("GradientFreeNode", lambda: pyengine.GradientFreeNode(Variable(), "x")),
                   ("Edge", lambda: Edge(Sink(), 0))]:
    for how in ("copy", "deepcopy"):
        print(f"{how}({name}) -> {outcome(lambda: getattr(__import__('copy'), how)(make()), ())}")
'''


def test_what_an_init_did_not_initialize_reads_alike_in_both_cores():
    compiled = dict(line.split(" -> ") for line in run_on_core(_UNINITIALIZED_SWEEP, pure=False,
                                                                timeout=300))
    pure = dict(line.split(" -> ") for line in run_on_core(_UNINITIALIZED_SWEEP, pure=True,
                                                            timeout=300))
    # Attributes of one core only (the twin's private slots, as
    # LeafState._owned_grad) are not the API: the calls both cores have.
    common = [call for call in compiled if call in pure]
    assert len(common) > 300
    differences = [(call, compiled[call], pure[call]) for call in common
                   if compiled[call] != pure[call]]
    assert differences == [], f"{len(differences)} differ, the first: {differences[:8]}"


_WRITE_SWEEP = _METHOD_SWEEP.split("# Methods that wait")[0] + r'''
import inspect
import re


class Pass(Node):
    """A node between a root and a leaf: its apply runs ``during`` first."""

    def __init__(self, leaf, during=None):
        super().__init__(next_edges=(Edge(leaf, 0),), input_metadata=[((3,), np.float64)])
        self.during = during

    def apply(self, grads):
        if self.during is not None:
            self.during()
        return (grads[0] * 2,)


def digest(value):
    """What a use returned, short and comparable across cores."""
    if isinstance(value, np.ndarray):
        return f"array{tuple(value.ravel().tolist())}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{', '.join(digest(item) for item in value)}]"
    return type(value).__name__


def words(error):
    """An error's type and words, with what differs between the two
    processes made alike: object addresses, node sequence numbers, and the
    module of a core class that Python itself names (CPython names a type by
    its tp_name, which for a compiled class includes its module and for the
    twin's is its bare name: "'pyengine._node.Edge' object is not iterable")."""
    text = re.sub(" at 0x[0-9a-fA-F]+", " at 0x...", str(error))
    text = re.sub("sequence_nr=[0-9]+", "sequence_nr=...", text)
    text = re.sub(r"'pyengine\._[a-z_]+\.", "'", text)
    return f"{type(error).__name__}: {text}"


def outcome(function, names):
    try:
        function(*(POOL[name]() for name in names))
    except Exception as error:
        return words(error)
    return "returns"


def result(function):
    try:
        return f"returns {digest(function())}"
    except Exception as error:
        return words(error)


def execute(roots, outputs=None, engine=None):
    engine = engine or pyengine.get_default_engine()
    return engine.execute(roots, [np.ones(3)] * len(roots), False, False, outputs is None,
                          outputs=outputs)


def run_through_node(node):
    return execute([Edge(node, 0)])


def run_through_accumulate(accumulate):
    execute([Edge(accumulate, 0)])
    return accumulate.variable.grad


def run_through_leaf_state(leaf_state):
    return run_through_accumulate(LEAF_STATE_OWNERS[id(leaf_state)])


LEAF_STATE_OWNERS = {}


def leaf_state():
    accumulate = pyengine.AccumulateGrad(Variable())
    LEAF_STATE_OWNERS[id(accumulate.leaf_state)] = accumulate
    return accumulate.leaf_state


def add_twice(buffer):
    buffer.add(0, np.ones(3), False)
    buffer.add(0, np.ones(3), False)
    buffer.add(1, np.ones(3), False)
    return buffer.buffer


def push_pop(task):
    queue = core.ReadyQueue()
    queue.push(task)
    return queue.pop().inputs


def run_engine(engine):
    return execute([Edge(Sink(), 0)], engine=engine)


# Each instance, and what a use of it does after one of its attributes was
# written (None: the write's outcome alone).
WRITE_MAKERS = {
    "node": (Sink, run_through_node),
    "accumulate": (lambda: pyengine.AccumulateGrad(Variable()), run_through_accumulate),
    "free": (MAKERS["free"], run_through_node),
    "root": (MAKERS["root"], lambda root: root.apply([])),
    "edge": (MAKERS["edge"], None),
    "metadata": (MAKERS["metadata"], None),
    "buffer": (MAKERS["buffer"], add_twice),
    "leaf_state": (leaf_state, run_through_leaf_state),
    "graph_task": (MAKERS["graph_task"], None),
    "owner_graph": (MAKERS["owner_graph"], None),
    "indexed": (MAKERS["indexed"], lambda indexed: pyengine.densify(indexed)),
    "ready_queue": (core.ReadyQueue, lambda queue: queue.push_pop(
        core.NodeTask(None, None, None, True))),
    "node_task": (lambda: core.NodeTask(core.GraphTask(False, False, 0, core.ReadyQueue()),
                                        Sink(), [np.ones(3)]), push_pop),
    "engine": (core.Engine, run_engine),
    "exec_info": (core.graph_task_module.ExecInfo, lambda info: info.should_execute()),
}


def fields(instance):
    """The attributes Python code may try to write: not methods, dunders,
    or the twin's slots behind its properties (a trailing "_")."""
    for attribute in sorted(dir(instance)):
        if attribute.startswith("__") or attribute.endswith("_"):
            continue
        try:
            value = getattr(instance, attribute)
        except Exception:
            value = None
        if not inspect.isroutine(value):
            yield attribute


for maker_name, (make, use) in WRITE_MAKERS.items():
    for attribute in fields(make()):
        for name in sorted(POOL):
            instance = make()
            written = outcome(lambda: setattr(instance, attribute, POOL[name]()), ())
            line = f"{maker_name}.{attribute} = {name} -> {written}"
            if use is not None:
                line += f"; then {result(lambda: use(instance))}"
            print(line)
        # Deleted, then read and used: a Cython public object field
        # deleted holds None (the twin's slots were deleted, which only a
        # later read told apart).
        instance = make()
        line = (f"del {maker_name}.{attribute} -> {outcome(lambda: delattr(instance, attribute), ())}"
                f"; reads {result(lambda: getattr(instance, attribute))}")
        if use is not None:
            line += f"; then {result(lambda: use(instance))}"
        print(line)
    # A name the class does not have: a compiled class without a __dict__
    # refuses it.
    print(f"{maker_name}.not_a_field = 0 -> "
          f"{outcome(lambda: setattr(make(), 'not_a_field', 0), ())}")
    gc.collect()


# The graph task a node runs under, written from the node: then the rest of
# that backward runs (a capture for grad(inputs=), a leaf's accumulation, a
# final callback).
# The fields the compiled GraphTask shows (the twin's has more, plain
# attributes the compiled core keeps in C, as its completion flags: written,
# those would leave a backward waiting forever, and only the twin has them).
def task_fields():
    import pyengine._graph_task as compiled
    return list(fields(compiled.GraphTask))


for attribute in task_fields():
    for name in sorted(POOL):
        for mode in ("grad", "backward"):
            written = []

            def during():
                task = core.state_module.get_current_graph_task()
                written.append(outcome(lambda: setattr(task, attribute, POOL[name]()), ()))
                if mode == "backward":
                    # Appended to what was written, if final_callbacks.
                    pyengine.queue_callback(lambda: None)

            accumulate = pyengine.AccumulateGrad(Variable())
            root = Edge(Pass(accumulate, during), 0)
            if mode == "grad":
                used = result(lambda: execute([root], outputs=[Edge(accumulate, 0)]))
            else:
                used = result(lambda: (execute([root]), accumulate.variable.grad)[1])
            print(f"running graph_task.{attribute} = {name} ({mode}) -> "
                  f"{written[0] if written else 'not run'}; then {used}")
    gc.collect()
'''


def test_both_cores_answer_attribute_writes_alike():
    """Each field of each public instance written with each odd value (and
    deleted): the write, and a use of the instance after it, answer alike in
    both cores, and neither crashes. A deleted field is read too: the twin's
    free fields (a node's _stream and _saved_values, AccumulateGrad's
    variable, a LeafState's accumulator and hook lists) were deleted slots,
    an AttributeError where the compiled field holds None."""
    def answers(pure):
        lines = run_on_core(_WRITE_SWEEP, pure=pure, timeout=300)
        return dict(line.split(" -> ") for line in lines)

    compiled, pure = answers(False), answers(True)
    # The twin may have fields of its own (plain attributes the compiled
    # core keeps in C): the fields both cores have.
    common = [write for write in compiled if write in pure]
    assert len(common) > 1_000
    differences = [(write, compiled[write], pure[write]) for write in common
                   if compiled[write] != pure[write]]
    assert differences == [], f"{len(differences)} differ, the first: {differences[:8]}"


_NEW_SWEEP = _WRITE_SWEEP.split("def execute(")[0] + r'''
# Each class's __new__ called with each class (and a few non-classes): the
# core's classes, the public ones built on them, user subclasses with and
# without a __new__ of their own, and unrelated types. Edge's takes a node.
class Plain:
    pass


CLASSES = {name: value for name, value in vars(core).items()
           if isinstance(value, type) and value.__module__.startswith("pyengine")}
CLASSES["ExecInfo"] = core.graph_task_module.ExecInfo
for name in ("Node", "AccumulateGrad", "GradientFreeNode", "OwnerGraph"):
    CLASSES["pyengine." + name] = getattr(pyengine, name)
SUBCLASSES = {}
for name, cls in CLASSES.items():
    try:
        SUBCLASSES["Sub" + name] = type("Sub" + name, (cls,), {})
        SUBCLASSES["New" + name] = type("New" + name, (cls,), {
            "__new__": lambda cls, *args, **kwargs: super(cls.__mro__[1], cls).__new__(cls)})
    except TypeError:
        pass  # final: no subclass, in either core
ARGUMENTS = {**CLASSES, **SUBCLASSES, "Plain": Plain, "int": int, "dict": dict, "3": 3,
             "None": None, "'x'": "x"}

for name, cls in sorted(CLASSES.items()):
    for argument_name, argument in sorted(ARGUMENTS.items()):
        extra = (Sink(),) if cls is Edge else ()
        def make(cls=cls, argument=argument, extra=extra):
            return cls.__new__(argument, *extra)
        print(f"{name}.__new__({argument_name}) -> {result(make)}")
'''


def test_both_cores_answer_new_with_another_class_alike():
    """``X.__new__(cls)`` for each core class X and each class, subclass and
    odd value as ``cls``: CPython refuses a ``cls`` that is not X or a
    subclass whose allocation is X's before a compiled class's tp_new runs,
    and the twin refuses it in the same words (Note [A class's __new__
    called with another class] in pyengine/_pure/static_types.py); the rest
    are made alike. The twin made an instance of any plain class before. A
    call with no class at all is left out: Python words the missing argument
    of the twin's ``__new__`` itself."""
    compiled = dict(line.split(" -> ") for line in run_on_core(_NEW_SWEEP, pure=False, timeout=300))
    pure = dict(line.split(" -> ") for line in run_on_core(_NEW_SWEEP, pure=True, timeout=300))
    assert compiled.keys() == pure.keys() and len(compiled) > 500
    assert sum(answer.startswith("returns") for answer in compiled.values()) > 50
    differences = [(call, compiled[call], pure[call]) for call in compiled
                   if compiled[call] != pure[call]]
    assert differences == [], f"{len(differences)} differ, the first: {differences[:8]}"


_REINIT_SWEEP = _WRITE_SWEEP.split("def execute(")[0] + r'''
# A second __init__ on each public instance, with none, one or two odd
# values: what it answers, and every field read after it.
ALL_MAKERS = dict(MAKERS)
ALL_MAKERS.update({"engine": core.Engine, "ready_queue": core.ReadyQueue,
                   "task": lambda: core.NodeTask(None, None, None),
                   "exec_info": core.graph_task_module.ExecInfo})


def state(instance):
    fields = []
    for attribute in sorted(dir(instance)):
        if attribute.startswith("__") or attribute.endswith("_"):
            continue
        try:
            value = getattr(instance, attribute)
        except Exception as error:
            fields.append(f"{attribute}={words(error)}")
            continue
        if not callable(value):
            fields.append(f"{attribute}={digest(value)}")
    return "; ".join(fields)


for maker_name, make in sorted(ALL_MAKERS.items()):
    for count in range(3):
        for names in itertools.product(sorted(POOL), repeat=count):
            instance = make()
            answer = outcome(lambda *args: instance.__init__(*args), names)
            # Cython and Python word a wrong count of arguments apart.
            if re.search("positional argument|keyword argument", answer):
                answer = "TypeError (the arguments' count)"
            print(f"{maker_name}.__init__({', '.join(names)}) -> {answer} | {state(instance)}")
    gc.collect()
'''


def test_both_cores_answer_a_second_init_alike():
    """``__init__`` called again on each public instance, with none, one or
    two odd values: the answer and every field both cores have read alike
    after it. Found the twin's ExecInfo refusing arguments the compiled
    class's (object's) ``__init__`` ignores, and the twin's InputBuffer
    wording a size past a ``Py_ssize_t`` as ``operator.index`` does."""
    def answers(pure):
        result = {}
        for line in run_on_core(_REINIT_SWEEP, pure=pure, timeout=300):
            call, rest = line.split(" -> ", 1)
            answer, fields = rest.split(" | ", 1)
            result[call] = answer, dict(field.split("=", 1) for field in fields.split("; ")
                                         if "=" in field)
        return result

    compiled, pure = answers(False), answers(True)
    assert compiled.keys() == pure.keys() and len(compiled) > 5_000
    differences = []
    for call, (answer, fields) in compiled.items():
        pure_answer, pure_fields = pure[call]
        # The twin's private fields (plain attributes the compiled core
        # keeps in C) are left out: the fields both cores have.
        common = sorted(fields.keys() & pure_fields.keys())
        if answer != pure_answer or [fields[f] for f in common] != [pure_fields[f] for f in common]:
            differences.append((call, answer, pure_answer))
    assert differences == [], f"{len(differences)} differ, the first: {differences[:8]}"
