"""What copies and pickles: See Note [Copying and pickling the engine's
objects] in ``pyengine/_pure/node.py``. Runs on both cores; the oracles are
the exact error each refusal raises, the fields of a copied OwnerGraph
against the original's, and the analytic gradients of a backward through
the copy.

Cython's generated ``__setstate_cython__`` set a compiled object's C
fields from a tuple it indexed without a bound check:
``Engine().__setstate_cython__(())`` and the same call on a NodeTask, an
InputBuffer and an OwnerGraph crashed the interpreter. The build no longer
generates it.
"""

from __future__ import annotations

import copy
import importlib
import pickle

import numpy as np
import pytest
from conftest import run_on_this_core

import pyengine
from pyengine import Edge, Node, _core

thread_pool_module = importlib.import_module(
    "pyengine._pure.thread_pool" if pyengine.IMPLEMENTATION == "pure" else "pyengine._thread_pool")


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


REFUSED = {
    "Node": Sink,
    "a Node subclass used as it is": Node,
    "AccumulateGrad": lambda: pyengine.AccumulateGrad(Variable()),
    "GraphRoot": lambda: _core.GraphRoot([Edge(Sink(), 0)], [np.ones(3)]),
    "GraphTask": lambda: _core.GraphTask(False, False, 0, _core.ReadyQueue()),
    "ExecInfo": _core.graph_task_module.ExecInfo,
    "ReadyQueue": _core.ReadyQueue,
    "NodeTask": lambda: _core.NodeTask(None, None, None),
    "InputBuffer": lambda: _core.InputBuffer(2),
    "Engine": _core.Engine,
    "the engine's reentrant pool": thread_pool_module._ThreadPoolShared,
    "a thread's WorkerState": _core.engine_module.WorkerState,
    "a leaf's GradLock": _core.GradLock,
}
if _core.IMPLEMENTATION == "compiled":
    # The compiled core's alone: See Note [The worker state's thread-local
    # pointer] in pyengine/_engine.pyx.
    REFUSED["the keeper of a thread's WorkerState"] = _core.engine_module.WorkerStateKeeper

COPIES = {"copy": copy.copy, "deepcopy": copy.deepcopy,
          "pickle": lambda value: pickle.loads(pickle.dumps(value))}


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("what", sorted(REFUSED))
def test_the_engine_objects_are_neither_copied_nor_pickled(what, how):
    value = REFUSED[what]()
    with pytest.raises(TypeError, match=f"^cannot pickle '{type(value).__name__}' object$"):
        COPIES[how](value)


# A micrograd-style program: each owner writes its parents' gradients.
class Value:
    def __init__(self, data, parents=(), backward=None):
        self.data = data
        self.grad = 0.0
        self.parents = parents
        self._backward = backward or (lambda: None)

    def __mul__(self, other):
        out = Value(self.data * other.data, (self, other))

        def backward():
            self.grad += other.data * out.grad
            other.grad += self.data * out.grad
        out._backward = backward
        return out

    def run_backward(self):
        self._backward()


class NamedOwnerGraph(pyengine.OwnerGraph):
    """A subclass with an attribute of its own, which a copy keeps."""


FIELDS = ("parents", "backward_", "mode", "returns", "num_inputs", "metadata", "accumulate",
          "visit", "needs_no_gradient", "pre_hook", "post_hook", "should_compute_output",
          "gradient_policy", "accumulates", "unpack_grads", "dense_gradient")


def graph_fields(graph):
    return {name: getattr(graph, name) for name in FIELDS}


@pytest.mark.parametrize("how", sorted(COPIES))
def test_an_owner_graph_copies_through_its_init(how):
    graph = NamedOwnerGraph("parents", "run_backward")
    graph.label = "mine"
    copied = COPIES[how](graph)
    assert type(copied) is NamedOwnerGraph and copied is not graph
    assert graph_fields(copied) == graph_fields(graph)
    assert copied.label == "mine"
    # The copy runs a backward: z = x * y at x = 2, y = -3 (dz/dx = y, dz/dy = x).
    x, y = Value(2.0), Value(-3.0)
    z = x * y
    z.grad = 1.0
    copied.backward(z)
    assert (x.grad, y.grad) == (-3.0, 2.0)


def test_an_owner_graph_copies_its_returns_mode_options():
    graph = pyengine.OwnerGraph("parents", "backward", mode="returns", num_inputs=len,
                                should_compute_output=True, gradient_policy="exact",
                                accumulates=True, unpack_grads=True)
    copied = copy.deepcopy(graph)
    assert graph_fields(copied) == graph_fields(graph)
    assert copied.returns and copied.gradient_policy == "exact"


def test_an_owner_graph_made_by_new_alone_copies_with_its_init_error():
    uninitialized = pyengine.OwnerGraph.__new__(pyengine.OwnerGraph)
    with pytest.raises(TypeError, match="^parents must be a str"):
        copy.copy(uninitialized)


class NotAGraph:
    pass


class CraftedOwnerGraphPickle:
    """Pickles as an OwnerGraph's reduce does, naming a class that is not one."""

    def __reduce__(self):
        graph = pyengine.OwnerGraph("parents", "run_backward")
        function, arguments, state = graph.__reduce__()
        return function, (arguments[0], NotAGraph, *arguments[2:]), state


def test_a_pickle_that_names_another_class_is_refused():
    # The compiled OwnerGraph's tp_new refuses a class that is not an
    # OwnerGraph; the twin's made a NotAGraph and ran OwnerGraph.__init__ on
    # it. See Note [A class's __new__ called with another class].
    name = "pyengine._owner_graph.OwnerGraph"
    with pytest.raises(TypeError) as error:
        pickle.loads(pickle.dumps(CraftedOwnerGraphPickle()))
    assert str(error.value) == (f"{name}.__new__(NotAGraph): NotAGraph is not a subtype of {name}")


def test_no_class_of_either_core_has_cythons_pickle_methods():
    modules = [_core.engine_module, _core.graph_task_module, _core.input_buffer_module,
               _core.node_module, _core.owner_graph_module, _core.ready_queue_module,
               _core.state_module, _core.validate_outputs_module, thread_pool_module]
    classes = {value for module in modules for value in vars(module).values()
               if isinstance(value, type) and value.__module__ == module.__name__}
    assert len(classes) >= 12
    assert [(cls.__name__, name) for cls in classes for name in dir(cls)
            if name.endswith("_cython__")] == []


def test_no_state_setter_of_cythons_own_is_left():
    # In a child process: the calls crashed the interpreter before.
    lines = run_on_this_core('''
import pyengine
from pyengine import _core
for make in (_core.Engine, lambda: _core.NodeTask(None, None, None),
             lambda: _core.InputBuffer(2), lambda: pyengine.OwnerGraph("a", "b"),
             _core.graph_task_module.ExecInfo, _core.ReadyQueue):
    value = make()
    for name in ("__setstate_cython__", "__reduce_cython__"):
        try:
            getattr(value, name)(())
        except AttributeError as error:
            print(type(value).__name__, name, "AttributeError")
''', timeout=60)
    assert lines == [f"{name} {method} AttributeError"
                     for name in ("Engine", "NodeTask", "InputBuffer", "OwnerGraph", "ExecInfo",
                                  "ReadyQueue")
                     for method in ("__setstate_cython__", "__reduce_cython__")]
