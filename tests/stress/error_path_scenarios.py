"""The failure modes of ``test_error_path_leaks.py``: backward calls that
fail, each on a fresh graph, for the leak checks there to repeat.

A scenario's ``call(track)`` builds its own graph, makes one backward fail
(or fail inside and succeed outside, where its docstring says so), swallows
the expected error and hands ``track`` everything that must die with the
call: nodes (an AccumulateGrad among them), leaves, hooks, callbacks, the
gradients a node returned and the error. ``track`` returns what it is given.
A scenario asserts itself what the failure leaves in a leaf's ``.grad``
(as it was, or, where PyTorch accumulates before the failure, the sum).

``SCENARIOS`` maps a test id to a :class:`Scenario`. What a scenario needs
for all the calls of one test (an engine of its own, a registered backend,
SIGINT handling) is a context of its ``resources``, which must leave
nothing behind: no pool thread, no registration, no pending interrupt.

The graphs: ``diamond`` is root -> (a, b) -> n1 -> leaf, run in the order
root, b, a, n1, AccumulateGrad, so a failure at a leaves n1's input buffer
half filled; owner-graph scenarios build the same shape of ``Owner``s.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
from conftest import signals_not_swallowed
from minitensor import leaf as minitensor_leaf

import pyengine
from pyengine import Edge, InputMetadata, Node, gradient_edge
from pyengine import fake_device as fd


class Leaf:
    """A leaf tensor of the tensor protocol."""

    def __init__(self, data, grad=None):
        self.data = np.asarray(data, dtype=np.float64)
        self.grad = grad
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


class Value:
    """A non-leaf tensor: what a node's output slot stands for."""

    def __init__(self, node, output_nr=0, shape=(3,)):
        self.data = np.zeros(shape)
        self.grad = None
        self.grad_fn = node
        self.output_nr = output_nr
        self.requires_grad = True


class BadGradValue(Value):
    """A non-leaf whose .grad cannot be written: its retains-grad hook raises."""

    @property
    def grad(self):
        return None

    @grad.setter
    def grad(self, value):
        if value is not None:
            raise LookupError("grad refused")


class Boom(Exception):
    """What the scenarios raise: unlike a built-in exception, it takes a weak
    reference, so the check sees whether the error itself was let go."""


class FunctionNode(Node):
    """apply is ``fn(self, grads)``."""

    def __init__(self, edges, fn, shape=(3,), device=None, n_slots=1):
        meta = [InputMetadata(shape, np.float64, device) if device is not None
                else (shape, np.float64)] * n_slots
        super().__init__(next_edges=edges, input_metadata=meta)
        self.fn = fn

    def apply(self, grads):
        return self.fn(self, grads)


def passes(node, grads):
    return [None if g is None else g * 1.0 for g in grads[:1]] * len(node.next_edges)


def raises(node, grads):
    raise Boom("apply raised")


def expect(exc_types, call):
    try:
        call()
    except exc_types as error:
        return error
    raise AssertionError(f"expected {exc_types}, nothing raised")


def diamond(track, fail_at, fn_fail=raises, leaf_grad=None):
    """root -> (a, b) -> n1 -> leaf. Runs root, b, a, n1, AccumulateGrad.
    fail_at in {"root", "b", "a", "n1"}: that node's apply is fn_fail."""
    x = track(Leaf(np.arange(3.0), grad=leaf_grad))
    n1 = FunctionNode([gradient_edge(x)], fn_fail if fail_at == "n1" else passes)
    a = FunctionNode([Edge(n1, 0)], fn_fail if fail_at == "a" else passes)
    b = FunctionNode([Edge(n1, 0)], fn_fail if fail_at == "b" else passes)
    root = FunctionNode([Edge(a, 0), Edge(b, 0)], fn_fail if fail_at == "root" else passes)
    track(n1, a, b, root, n1.next_edges[0].node)  # the last: x's AccumulateGrad
    return x, root


def run(root, grad=None, **kw):
    pyengine.backward(Value(root), np.ones(3) if grad is None else grad, **kw)


# -- scenarios: each builds a fresh graph, fails once, tracks what must die --------------

def apply_at(where):
    def scenario(track):
        before = np.array([5.0, 5.0, 5.0])
        x, root = diamond(track, where, leaf_grad=before)
        track(expect(Boom, lambda: run(root)))
        assert x.grad is before and (before == 5.0).all(), x.grad
    return scenario


def wrong_count(track):
    def two(node, grads):
        g1, g2 = track(np.ones(3), np.ones(3))
        return [g1, g2]
    x, root = diamond(track, "a", fn_fail=two)
    track(expect(RuntimeError, lambda: run(root)))
    assert x.grad is None


def wrong_shape(track):
    def bad(node, grads):
        return [track(np.ones(4))]
    x, root = diamond(track, "a", fn_fail=bad)
    track(expect(RuntimeError, lambda: run(root)))
    assert x.grad is None


def wrong_dtype(track):
    def bad(node, grads):
        return [track(np.ones(3, dtype=np.complex128))]
    x, root = diamond(track, "n1", fn_fail=bad)
    track(expect((RuntimeError, TypeError), lambda: run(root)))
    assert x.grad is None


def wrong_type(track):
    def bad(node, grads):
        return [track(Boom("not a value"))]
    x, root = diamond(track, "a", fn_fail=bad)
    track(expect((RuntimeError, TypeError), lambda: run(root)))


def not_a_list(track):
    def bad(node, grads):
        return track(np.ones(3))
    x, root = diamond(track, "a", fn_fail=bad)
    track(expect(TypeError, lambda: run(root)))


def hook(kind):
    def scenario(track):
        x, root = diamond(track, None)
        a = root.next_edges[0].node
        n1 = a.next_edges[0].node

        def fail(*args):
            raise Boom(kind)
        track(fail)
        if kind == "prehook":
            a.register_prehook(fail)
        elif kind == "posthook":
            a.register_hook(fail)
        elif kind == "tensor_prehook":
            pyengine.register_tensor_hook(Value(n1), fail)
        elif kind == "leaf_hook":
            pyengine.register_tensor_hook(x, fail)
        elif kind == "post_accumulate":
            pyengine.register_post_accumulate_grad_hook(x, fail)
        before = np.full(3, 7.0)
        x.grad = before
        track(expect(Boom, lambda: run(root)))
        if kind == "post_accumulate":
            # PyTorch: the accumulation happened, then the hook raised.
            assert (x.grad == 7.0 + 2.0).all(), x.grad
        else:
            assert x.grad is before and (before == 7.0).all()
    return scenario


def retains_grad_raises(track):
    x, root = diamond(track, None)
    a = root.next_edges[0].node
    v = BadGradValue(a)
    pyengine.retain_grad(v)
    track(v, expect(LookupError, lambda: run(root)))
    assert x.grad is None


def final_callback(track):
    def queue(node, grads):
        cb = track(lambda: 1 / 0)
        pyengine.queue_callback(cb)
        return [grads[0]] * len(node.next_edges)
    x, root = diamond(track, "a", fn_fail=queue)
    track(expect(ZeroDivisionError, lambda: run(root)))
    # PyTorch runs the callback after every node: the leaf got its gradient.
    assert (x.grad == 2.0).all(), x.grad


def grad_unreachable(track):
    x, root = diamond(track, None)
    z = track(Leaf(np.ones(3)))
    track(expect(RuntimeError, lambda: pyengine.grad(Value(root), [x, z], np.ones(3))))
    assert x.grad is None


def grad_capture_then_fail(track):
    # The capture of x's gradient is made, then a later node fails.
    x = track(Leaf(np.ones(3)))
    late = FunctionNode([gradient_edge(x)], raises)
    early = FunctionNode([gradient_edge(x)], passes)
    root = FunctionNode([Edge(early, 0), Edge(late, 0)], passes)
    track(late, early, root)
    early, late = None, None
    track(expect(Boom, lambda: pyengine.grad(Value(root), [Value(root.next_edges[0].node), x], np.ones(3),
                                         allow_unused=True)))


class Saving(Node):
    def __init__(self, edges):
        super().__init__(next_edges=edges, input_metadata=[((3,), np.float64)])
        self.save_for_backward(np.ones(3))

    def apply(self, grads):
        (s,) = self.saved_values
        return [grads[0] * s] * len(self.next_edges)


def freed_graph(track):
    x = track(Leaf(np.ones(3)))
    n = track(Saving([gradient_edge(x)]))
    root = track(Saving([Edge(n, 0)]))
    run(root)
    track(expect(RuntimeError, lambda: run(root)))
    assert (x.grad == 1.0).all()


def cycle(track):
    a = FunctionNode([], passes)
    b = FunctionNode([Edge(a, 0)], passes)
    a.next_edges = [Edge(b, 0)]
    root = FunctionNode([Edge(a, 0)], passes)
    track(a, b, root)
    track(expect(RuntimeError, lambda: run(root)))


def keyboard_interrupt(track):
    def ki(node, grads):
        raise KeyboardInterrupt
    before = np.full(3, 2.0)
    x, root = diamond(track, "a", fn_fail=ki, leaf_grad=before)
    track(expect(KeyboardInterrupt, lambda: run(root)))
    assert x.grad is before


def buffer_add_fails(track):
    # Two gradients of shapes that do not add, into a slot without metadata.
    x = track(Leaf(np.ones(3)))

    class NoMeta(Node):
        def apply(self, grads):
            return [np.ones(3)]
    sink = NoMeta(next_edges=[gradient_edge(x)], input_metadata=[None])
    g1, g2 = track(np.ones(3), np.ones(2))
    a = FunctionNode([Edge(sink, 0)], lambda node, grads: [g1])
    b = FunctionNode([Edge(sink, 0)], lambda node, grads: [g2])
    root = FunctionNode([Edge(a, 0), Edge(b, 0)], passes)
    track(sink, a, b, root)
    track(expect(ValueError, lambda: run(root)))


def release_variables_raises(track):
    class Rel(FunctionNode):
        def release_variables(self):
            raise Boom("release")
    x = track(Leaf(np.ones(3)))
    n = Rel([gradient_edge(x)], passes)
    root = FunctionNode([Edge(n, 0)], passes)
    track(n, root)
    track(expect(Boom, lambda: run(root)))


def root_grad_bad(track):
    x, root = diamond(track, None)
    g = track(np.ones(5))
    track(expect(RuntimeError, lambda: run(root, g)))


def multi_root(track):
    x, root = diamond(track, "n1")
    x2, root2 = diamond(track, None)
    track(expect(Boom, lambda: pyengine.backward([Value(root), Value(root2)], [np.ones(3), np.ones(3)])))


def inputs_backward(track):
    x, root = diamond(track, "a")
    track(expect(Boom, lambda: pyengine.backward(Value(root), np.ones(3), inputs=[x])))


def retain_graph_fail(track):
    x, root = diamond(track, "a")
    track(expect(Boom, lambda: run(root, retain_graph=True)))


def nan_anomaly(track):
    def nan(node, grads):
        return [track(np.full(3, np.nan))]
    with pyengine.detect_anomaly():
        x, root = diamond(track, "a", fn_fail=nan)
        track(expect(RuntimeError, lambda: run(root)))


def anomaly_apply(track):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pyengine.detect_anomaly():
            x, root = diamond(track, "a")
            track(expect(Boom, lambda: run(root)))


def profiled(track):
    with pyengine.profile():
        x, root = diamond(track, "a")
        track(expect(Boom, lambda: run(root)))


def profiled_final_callback(track):
    with pyengine.profile():
        final_callback(track)


def reentrant_depth1(track):
    def inner(node, grads):
        ix, iroot = diamond(track, "a")
        run(iroot)
        return grads
    x, root = diamond(track, "a", fn_fail=inner)
    track(expect(Boom, lambda: run(root)))


def reentrant_caught(track):
    def inner(node, grads):
        ix, iroot = diamond(track, "a")
        try:
            run(iroot)
        except Boom as e:
            track(e)
        return [grads[0]]
    x, root = diamond(track, "a", fn_fail=inner)
    run(root)
    assert (x.grad == 2.0).all()


def nested_chain(track, levels, innermost_raises=True):
    """A node whose apply runs a backward through a node whose apply ... for
    ``levels`` levels; the innermost raises (or, where not
    ``innermost_raises``, returns: an engine's bound must raise)."""
    def make(level):
        def fn(node, grads):
            if level == 0:
                if innermost_raises:
                    raise Boom("innermost")
                return grads
            ix = track(Leaf(np.ones(3)))
            inner = track(FunctionNode([gradient_edge(ix)], make(level - 1)))
            run(inner)
            return grads
        return fn
    x = track(Leaf(np.ones(3)))
    root = track(FunctionNode([gradient_edge(x)], make(levels)))
    return x, root


def reentrant_pool(track):
    engine = pyengine.Engine(max_recursion_depth=1)
    previous = pyengine.set_default_engine(engine)
    try:
        x, root = nested_chain(track, 4)
        track(expect(Boom, lambda: run(root)))
    finally:
        pyengine.set_default_engine(previous)
        engine.stop()


def reentrant_pool_shared(track):
    """The same, on one engine for every call (its pool threads reused):
    run on POOL_ENGINE."""
    x, root = nested_chain(track, 4)
    track(expect(Boom, lambda: run(root)))


def fake_device(kind):
    f0 = fd.device(0)

    def scenario(track):
        x = track(Leaf(np.ones(3)))
        if kind == "raise":
            fn = raises
        else:
            def fn(node, grads):
                return [track(np.ones(4))]
        node = FunctionNode([gradient_edge(x)], fn, device=f0)
        mid = FunctionNode([Edge(node, 0)], lambda n, g: [g[0]], device=f0)
        track(node, mid)
        track(expect((Boom, RuntimeError),
                 lambda: pyengine.backward(Value(mid), fd.to_fake(np.ones(3), f0))))
        assert x.grad is None
    return scenario


def fake_device_reentrant(track):
    f0 = fd.device(0)
    x = track(Leaf(np.ones(3)))

    def fn(node, grads):
        ix, iroot = diamond(track, "a")
        run(iroot)
        return [grads[0].numpy()]
    node = track(FunctionNode([gradient_edge(x)], fn, device=f0))
    track(expect(Boom, lambda: pyengine.backward(Value(node), fd.to_fake(np.ones(3), f0))))


class Owner:
    def __init__(self, parents=(), fail=False):
        self.parents = list(parents)
        self.fail = fail
        self.data = np.ones(3)
        self.grad = None


class ParentsFail(Owner):
    @property
    def parents(self):
        raise Boom("parents")

    @parents.setter
    def parents(self, value):
        pass


def owner(kind):
    def scenario(track):
        leaf = track(Owner())
        mid_a = track(Owner([leaf]))
        mid_b = track(Owner([leaf], fail=(kind == "raise")))
        root = track(Owner([mid_a, mid_b]))

        def vjp(o, grads):
            if o.fail:
                raise Boom("owner")
            if kind == "count" and o is mid_b:
                return [track(np.ones(3))] * 2
            if kind == "callback" and o is root:
                pyengine.queue_callback(track(lambda: 1 / 0))
            return [track(grads[0] * 1.0)] * len(o.parents)
        options = {}
        if kind == "pre_hook":
            def pre(o, grads):
                if o is mid_b:
                    raise Boom("pre")
            options["pre_hook"] = pre
        if kind == "accumulate":
            def acc(o, grad):
                raise Boom("acc")
            options["accumulate"] = acc
        if kind == "cycle":
            leaf.parents.append(root)
        if kind == "parents":
            mid_b.__class__ = ParentsFail
        track(vjp)
        graph = pyengine.OwnerGraph("parents", vjp, mode="returns", **options)
        track(expect((Boom, RuntimeError, ZeroDivisionError, TypeError),
                 lambda: graph.backward(root, np.ones(3))))
        if kind == "cycle":
            leaf.parents.clear()
    return scenario


def create_graph_fail(track):
    x = track(minitensor_leaf([1.0, 2.0, 3.0]))
    y = x * x
    z = y * 2.0
    track(z.grad_fn, y.grad_fn)
    mid = FunctionNode([gradient_edge(z)], raises)
    top = FunctionNode([Edge(mid, 0), gradient_edge(y)], lambda n, g: [g[0], g[0]])
    track(mid, top)
    track(expect(Boom, lambda: pyengine.backward(Value(top), np.ones(3), create_graph=True)))
    assert x.grad is None


def create_graph_fail_late(track):
    # Gradients already recorded a graph (T values) when the last node fails.
    x = track(minitensor_leaf([1.0, 2.0, 3.0]))
    y = x * x
    z = y * 2.0

    class FailOnT(Node):
        def apply(self, grads):
            track(grads[0])
            raise Boom("late")
    sink = FailOnT(next_edges=[], input_metadata=[((3,), np.float64)])
    top = FunctionNode([Edge(sink, 0), gradient_edge(z)], lambda n, g: [g[0], g[0]])
    track(sink, top, y.grad_fn, z.grad_fn)
    track(expect(Boom, lambda: pyengine.backward(Value(top), np.ones(3), create_graph=True)))


def threads_fail(track):
    """Two threads fail on one shared graph at once."""
    x, root = diamond(track, "a")
    errors = []

    def go():
        try:
            run(root, retain_graph=True)
        except Boom as e:
            errors.append(e)
    threads = [threading.Thread(target=go) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(errors) == 2
    track(*errors)


class NoMeta(Node):
    """Passes its gradient on; its slot has no metadata (any shape arrives)."""

    def apply(self, grads):
        return [np.ones(3)] * len(self.next_edges)


class ThreeWay(Node):
    def apply(self, grads):
        return list(self.track(np.ones(3), np.ones(3), np.ones(2)))


def route_fails_after_held(track):
    """R routes to P1 (ready: held), P2 (ready: P1 pushed, P2 held), then
    into S, whose buffer holds a (3,) gradient, a (2,) one: the add fails
    under the graph task lock with a task held and one queued."""
    x = track(Leaf(np.ones(3)))
    s = NoMeta(next_edges=[gradient_edge(x)], input_metadata=[None])
    p1 = FunctionNode([gradient_edge(x)], passes)
    p2 = FunctionNode([gradient_edge(x)], passes)
    r = ThreeWay(next_edges=[Edge(p1, 0), Edge(p2, 0), Edge(s, 0)], input_metadata=[None])
    r.track = track
    first = FunctionNode([Edge(s, 0)], lambda node, g: [track(np.ones(3))])
    root = FunctionNode([Edge(first, 0), Edge(r, 0)], lambda node, g: [np.ones(3), np.ones(3)])
    track(s, p1, p2, r, first, root)
    track(expect(ValueError, lambda: run(root)))
    assert x.grad is None


def nested_diamonds(track, levels):
    def make(level):
        def fn(node, grads):
            if level == 0:
                raise Boom("innermost")
            ix, iroot = diamond(track, "a", fn_fail=make(level - 1))
            run(iroot)
            return grads
        return fn
    return diamond(track, "a", fn_fail=make(levels))


def reentrant_pool_diamonds(track):
    """Diamonds nested four deep, the innermost failing: run on POOL_ENGINE."""
    x, root = nested_diamonds(track, 4)
    track(expect(Boom, lambda: run(root)))


def reentrant_pool_caught(track):
    """A pool thread's child fails and its parent (on the pool) catches it:
    run on POOL_ENGINE."""

    def outer(node, grads):
        def catching(node2, grads2):
            ix, iroot = diamond(track, "a")
            try:
                run(iroot)
            except Boom as e:
                track(e)
            return [grads2[0]]
        jx, jroot = diamond(track, "a", fn_fail=catching)
        run(jroot)
        return [grads[0]]
    x, root = diamond(track, "a", fn_fail=outer)
    run(root)
    assert (x.grad == 2.0).all()


class FailingAdd(np.ndarray):
    """A gradient type whose backend's add raises."""


class FailingAddBackend(pyengine.ArrayBackend):
    name = "failing-add"

    def shape(self, value):
        return value.shape

    def dtype(self, value):
        return value.dtype

    def device(self, value):
        return pyengine.CPU

    def dtype_kind(self, dtype):
        return np.dtype(dtype).kind

    def add(self, a, b):
        raise Boom("backend add")

    def sum_to(self, value, shape):
        raise Boom("backend sum_to")

    def cast(self, value, dtype):
        raise Boom("backend cast")

    def copy(self, value):
        return value.copy()

    def to_device(self, value, device):
        return value

    def zeros(self, shape, dtype, device):
        return np.zeros(shape, dtype)


@contextlib.contextmanager
def failing_add_backend():
    """FailingAddBackend registered for FailingAdd for one test's calls."""
    previous = pyengine.register_backend(FailingAdd, FailingAddBackend())
    try:
        yield
    finally:
        if previous is None:
            pyengine.unregister_backend(FailingAdd)
        else:
            pyengine.register_backend(FailingAdd, previous)


def backend_fails(op):
    """Run with failing_add_backend."""
    def scenario(track):
        x = track(Leaf(np.ones(3)))
        n1 = FunctionNode([gradient_edge(x)], passes)
        if op == "add":
            def make(node, g):
                return [track(np.ones(3).view(FailingAdd))]
        elif op == "sum_to":
            def make(node, g):
                return [track(np.ones((2, 3)).view(FailingAdd))]
        else:
            def make(node, g):
                return [track(np.ones(3, dtype=np.float32).view(FailingAdd))]
        a = FunctionNode([Edge(n1, 0)], make)
        b = FunctionNode([Edge(n1, 0)], make)
        root = FunctionNode([Edge(a, 0), Edge(b, 0)], passes)
        track(n1, a, b, root)
        track(expect(Boom, lambda: run(root)))
        assert x.grad is None
    return scenario


def hook_returns_bad(kind):
    def scenario(track):
        x, root = diamond(track, None)
        a = root.next_edges[0].node
        n1 = a.next_edges[0].node
        if kind == "post":
            a.register_hook(lambda gi, go: [track(np.ones(5))])
        elif kind == "pre":
            a.register_prehook(lambda g: [track(np.ones(3)), track(np.ones(3))])
        else:
            pyengine.register_tensor_hook(Value(n1), lambda g: track(np.ones(5)))
        track(expect((RuntimeError, TypeError, ValueError), lambda: run(root)))
        assert x.grad is None
    return scenario


def capture_hook_raises(track):
    """A tensor pre-hook on a node grad(inputs=) only captures at raises."""
    x, root = diamond(track, None)
    a = root.next_edges[0].node
    v = Value(a)

    def fail(g):
        raise Boom("capture hook")
    track(fail)
    pyengine.register_tensor_hook(v, fail)
    track(expect(Boom, lambda: pyengine.grad(Value(root), [v], np.ones(3))))


def name_raises(track):
    """name() raises while the engine words a node's wrong shape: the shape's
    error, naming the node by its class (See Note [A name() that raises] in
    pyengine/_shared/messages.py); name()'s Boom is caught there."""
    class BadName(FunctionNode):
        def name(self):
            raise Boom("name")
    x = track(Leaf(np.ones(3)))
    n = BadName([gradient_edge(x)], lambda node, g: [track(np.ones(4))])
    root = FunctionNode([Edge(n, 0)], passes)
    track(n, root)
    # The words only: the error kept in a local here would be a cycle
    # (its traceback's frames lead back to this one).
    message = str(track(expect(RuntimeError, lambda: run(root))))
    assert "BadName (its name() raised Boom)" in message, message


def interrupt_device_wait(track):
    """apply on fake:0 interrupts the main thread, which waits for it."""
    f0 = fd.device(0)
    x = track(Leaf(np.ones(3)))
    cpu = FunctionNode([gradient_edge(x)], passes)
    caught = threading.Event()

    def fn(node, grads):
        _thread.interrupt_main()
        caught.wait(2.0)
        return [track(grads[0].numpy() * 1.0)]
    dev = FunctionNode([Edge(cpu, 0)], fn, device=f0)
    track(cpu, dev)
    try:
        pyengine.backward(Value(dev), fd.to_fake(np.ones(3), f0))
    except KeyboardInterrupt as e:
        track(e)
    else:
        raise AssertionError("no interrupt")
    finally:
        caught.set()
    # Wait for the device worker to let go of its task.
    sync = FunctionNode([gradient_edge(Leaf(np.ones(3)))], lambda n, g: [g[0].numpy()], device=f0)
    pyengine.backward(Value(sync), fd.to_fake(np.ones(3), f0))
    assert x.grad is None


def interrupt_pool_wait(track):
    """A pool thread three levels down interrupts the main thread, which
    waits for the outermost backward: run on POOL_ENGINE."""
    caught = threading.Event()
    done = threading.Event()

    def make(level):
        def fn(node, grads):
            if level == 0:
                _thread.interrupt_main()
                caught.wait(2.0)
                done.set()
                return grads
            ix, iroot = diamond(track, None)
            inner = FunctionNode([Edge(iroot, 0)], make(level - 1))
            track(inner)
            run(inner)
            return grads
        return fn
    x, root = diamond(track, "a", fn_fail=make(3))
    try:
        run(root)
    except KeyboardInterrupt as e:
        track(e)
    else:
        raise AssertionError("no interrupt")
    finally:
        caught.set()
    assert done.wait(2.0)
    # The pool thread's loop ends after the node: give it a moment.
    time.sleep(0.005)


def owner_more(kind):
    def scenario(track):
        leaf = track(Owner())
        mid_a = track(Owner([leaf]))
        mid_b = track(Owner([leaf]))
        root = track(Owner([mid_a, mid_b]))

        def vjp(o, grads):
            if kind == "reentrant" and o is mid_b:
                ix, iroot = diamond(track, "a")
                run(iroot)
            if kind == "shape" and o is mid_b:
                return [track(np.ones(4))]
            return [track(grads[0] * 1.0)] * len(o.parents)

        def fail(*args):
            raise Boom(kind)
        options = {}
        if kind in ("visit", "needs_no_gradient", "post_hook"):
            options[kind] = lambda *a: fail() if mid_b in a else None
        if kind == "metadata":
            options["metadata"] = lambda o: fail() if o is leaf else [((3,), np.float64)]
        if kind == "shape":
            options["metadata"] = lambda o: [((3,), np.float64)]
        track(vjp)
        graph = pyengine.OwnerGraph("parents", vjp, mode="returns", **options)
        with (pyengine.profile() if kind == "profiled" else contextlib.nullcontext()):
            if kind == "profiled":
                mid_b.parents = [leaf, 7]
            if kind != "grad":
                track(expect((Boom, RuntimeError, TypeError, AttributeError),
                         lambda: graph.backward(root, np.ones(3))))
        if kind == "grad":
            z = Owner()
            track(z, expect(RuntimeError, lambda: graph.grad(root, np.ones(3), [leaf, z])))
    return scenario


class Writer:
    def __init__(self, parents=(), fail=False):
        self.parents = list(parents)
        self.fail = fail
        self.grad = None

    def backward(self):
        if self.fail:
            raise Boom("writer")
        for p in self.parents:
            p.grad = np.ones(3)


def owner_writes(track):
    leaf = track(Writer())
    a = track(Writer([leaf], fail=True))
    root = track(Writer([a, leaf]))
    graph = pyengine.OwnerGraph("parents", "backward", mode="writes")
    track(expect(Boom, lambda: graph.backward(root)))


def create_graph_retain_fail(track):
    """create_graph with a T gradient held in a pending buffer at the failure."""
    x = track(minitensor_leaf([1.0, 2.0, 3.0]))
    y = x * x
    sink_a = FunctionNode([gradient_edge(y)], passes)
    sink_b = FunctionNode([gradient_edge(y)], raises)
    top = FunctionNode([Edge(sink_a, 0), Edge(sink_b, 0)], lambda n, g: [g[0] * 2.0, g[0] * 3.0])
    track(y.grad_fn, sink_a, sink_b, top)
    track(expect(Boom, lambda: pyengine.backward(Value(top), np.ones(3), create_graph=True)))



def total_depth_exceeded(track):
    """Run on TOTAL_DEPTH_ENGINE."""
    x, root = nested_chain(track, 9, innermost_raises=False)
    track(expect(RecursionError, lambda: run(root)))
    assert x.grad is None


def pool_full(track):
    """Run on ONE_POOL_THREAD_ENGINE."""
    x, root = nested_chain(track, 4, innermost_raises=False)
    track(expect(RuntimeError, lambda: run(root)))
    assert x.grad is None




def cut(b, grads):
    b.next_edges = [None]
    return [grads[0] * 1.0]


def not_ready_left(track):
    """a (runs first) takes b's edge away: n1 waits for a gradient that never
    comes, and the task ends with 'could not compute gradients'."""
    x = track(Leaf(np.ones(3)))
    n1 = FunctionNode([gradient_edge(x)], passes)
    b = FunctionNode([Edge(n1, 0)], passes)
    a = FunctionNode([Edge(n1, 0)], lambda node, grads: cut(b, grads))
    root = FunctionNode([Edge(b, 0), Edge(a, 0)], passes)
    track(n1, a, b, root)
    track(expect(RuntimeError, lambda: run(root)))
    assert x.grad is None


def callback_chain(kind):
    def scenario(track):
        def queue(node, grads):
            def first():
                def second():
                    if kind == "ki":
                        raise KeyboardInterrupt
                    raise Boom("second callback")
                pyengine.queue_callback(track(second))
            pyengine.queue_callback(track(first))
            return [grads[0]] * len(node.next_edges)
        x, root = diamond(track, "a", fn_fail=queue)
        track(expect((Boom, KeyboardInterrupt), lambda: run(root)))
    return scenario


def retained_rerun(track):
    """A failed retained backward, then the same graph again: PyTorch's sum."""
    state = {"fail": True}

    def maybe(node, grads):
        if state["fail"]:
            raise Boom("once")
        return [grads[0] * 1.0]
    x, root = diamond(track, "a", fn_fail=maybe)
    track(expect(Boom, lambda: run(root, retain_graph=True)))
    state["fail"] = False
    run(root)
    assert (x.grad == 2.0).all(), x.grad


# -- what the calls of one test share --------------------------------------------------------

class PrivateEngine:
    """An Engine that the calls of one test share, so that its reentrant pool
    threads are reused from call to call, as a long-lived engine's are. It
    exists only while ``running()`` is entered, and is stopped at its exit:
    no pool thread outlives the test."""

    def __init__(self, **bounds):
        self.bounds = bounds
        self.engine = None

    @contextlib.contextmanager
    def running(self):
        self.engine = pyengine.Engine(**self.bounds)
        try:
            yield
        finally:
            engine, self.engine = self.engine, None
            engine.stop()

    def as_default(self, body):
        """``body`` with this engine as the default one, the previous default
        put back after every call."""
        def call(track):
            previous = pyengine.set_default_engine(self.engine)
            try:
                body(track)
            finally:
                pyengine.set_default_engine(previous)
        call.__doc__ = body.__doc__
        return call


POOL_ENGINE = PrivateEngine(max_recursion_depth=1)
TOTAL_DEPTH_ENGINE = PrivateEngine(max_recursion_depth=2, max_total_depth=5)
ONE_POOL_THREAD_ENGINE = PrivateEngine(max_recursion_depth=1, max_pool_threads=1)


@contextlib.contextmanager
def interrupts_kept_inside():
    """For scenarios that interrupt the main thread (``_thread.interrupt_main``
    from an engine thread) and catch the KeyboardInterrupt themselves.

    SIGINT must raise for the calls (``signals_not_swallowed``: a background
    job starts with SIGINT ignored, and a gc callback could swallow it). A
    KeyboardInterrupt that reaches pytest ends the whole session, so none
    may leave: one that escapes a scenario (the engine raised it somewhere
    the scenario does not catch) becomes an AssertionError, and an interrupt
    still pending at the end (delivered after the scenario stopped waiting
    for it) is run under a handler that only records it, then reported."""
    stray = []
    with signals_not_swallowed():
        try:
            yield
        except KeyboardInterrupt as error:
            raise AssertionError("a KeyboardInterrupt escaped the scenario") from error
        finally:
            previous = signal.signal(signal.SIGINT, lambda signum, frame: stray.append(signum))
            try:
                # Python runs a pending handler between bytecodes: a loop's
                # backward jumps and a short sleep give it the chance.
                for _ in range(1000):
                    pass
                time.sleep(0.01)
            finally:
                signal.signal(signal.SIGINT, previous)
    assert not stray, "an interrupt arrived after its scenario stopped waiting for it"


@dataclass(frozen=True)
class Scenario:
    """One failure mode. ``resources``: context factories entered, in order,
    around all the calls of one test. ``own_cycle``: the scenario's own
    objects form a reference cycle (a graph that is a cycle; a list in a
    closure that the threads fill with the errors), so only the cyclic
    collector frees them, whatever the engine does."""

    call: Callable
    resources: tuple = ()
    own_cycle: bool = False


SCENARIOS: dict[str, Scenario] = {
    # A node's apply raises: at the root, with n1's buffer half filled (a, b),
    # before the leaf's AccumulateGrad (n1).
    "apply-raises-at-root": Scenario(apply_at("root")),
    "apply-raises-at-a-buffer-pending": Scenario(apply_at("a")),
    "apply-raises-at-b": Scenario(apply_at("b")),
    "apply-raises-before-accumulate-grad": Scenario(apply_at("n1")),
    # What apply returns fails validation.
    "wrong-count": Scenario(wrong_count),
    "wrong-shape": Scenario(wrong_shape),
    "wrong-dtype": Scenario(wrong_dtype),
    "wrong-type": Scenario(wrong_type),
    "not-a-list": Scenario(not_a_list),
    # Hooks and callbacks raise.
    "pre-hook": Scenario(hook("prehook")),
    "post-hook": Scenario(hook("posthook")),
    "tensor-pre-hook": Scenario(hook("tensor_prehook")),
    "leaf-tensor-hook": Scenario(hook("leaf_hook")),
    "post-accumulate-hook": Scenario(hook("post_accumulate")),
    "retains-grad-hook": Scenario(retains_grad_raises),
    "final-callback": Scenario(final_callback),
    # grad(), the graph itself, the engine's own checks.
    "grad-unreachable-input": Scenario(grad_unreachable),
    "grad-capture-then-fail": Scenario(grad_capture_then_fail),
    "freed-graph": Scenario(freed_graph),
    "cycle": Scenario(cycle, own_cycle=True),
    "keyboard-interrupt-in-apply": Scenario(keyboard_interrupt),
    "input-buffer-add-fails": Scenario(buffer_add_fails),
    "release-variables-raises": Scenario(release_variables_raises),
    "bad-root-grad": Scenario(root_grad_bad),
    "multi-root": Scenario(multi_root),
    "backward-inputs": Scenario(inputs_backward),
    "retain-graph": Scenario(retain_graph_fail),
    # Modes that record more per node.
    "anomaly-nan": Scenario(nan_anomaly),
    "anomaly-apply": Scenario(anomaly_apply),
    "profiler": Scenario(profiled),
    "profiler-final-callback": Scenario(profiled_final_callback),
    # Reentrant backward, inline and on the pool.
    "reentrant-depth-1": Scenario(reentrant_depth1),
    "reentrant-caught": Scenario(reentrant_caught),
    "reentrant-pool-fresh-engine": Scenario(reentrant_pool),
    "reentrant-pool-shared-engine": Scenario(POOL_ENGINE.as_default(reentrant_pool_shared),
                                             (POOL_ENGINE.running,)),
    # Fake devices (their worker threads).
    "fake-device-raise": Scenario(fake_device("raise")),
    "fake-device-validate": Scenario(fake_device("validate")),
    "fake-device-reentrant": Scenario(fake_device_reentrant),
    # Owner graphs.
    "owner-raise": Scenario(owner("raise")),
    "owner-count": Scenario(owner("count")),
    "owner-callback": Scenario(owner("callback")),
    "owner-pre-hook": Scenario(owner("pre_hook")),
    "owner-accumulate": Scenario(owner("accumulate")),
    "owner-cycle": Scenario(owner("cycle")),
    "owner-parents": Scenario(owner("parents")),
    # create_graph: gradients that record a graph of their own.
    "create-graph-fail": Scenario(create_graph_fail),
    "create-graph-fail-late": Scenario(create_graph_fail_late),
    "two-threads-fail": Scenario(threads_fail, own_cycle=True),
    # The held task, the routing loop, backends, hooks' return values.
    "routing-fails-with-a-held-task": Scenario(route_fails_after_held),
    "reentrant-pool-diamonds": Scenario(POOL_ENGINE.as_default(reentrant_pool_diamonds),
                                        (POOL_ENGINE.running,)),
    "reentrant-pool-caught": Scenario(POOL_ENGINE.as_default(reentrant_pool_caught),
                                      (POOL_ENGINE.running,)),
    "backend-add-raises": Scenario(backend_fails("add"), (failing_add_backend,)),
    "backend-sum-to-raises": Scenario(backend_fails("sum_to"), (failing_add_backend,)),
    "backend-cast-raises": Scenario(backend_fails("cast"), (failing_add_backend,)),
    "post-hook-returns-bad": Scenario(hook_returns_bad("post")),
    "pre-hook-returns-bad": Scenario(hook_returns_bad("pre")),
    "tensor-hook-returns-bad": Scenario(hook_returns_bad("tensor")),
    "capture-only-tensor-hook-raises": Scenario(capture_hook_raises),
    "name-raises-in-an-error": Scenario(name_raises),
    # Ctrl-C while the main thread waits for a device worker or a pool thread.
    "interrupt-device-wait": Scenario(interrupt_device_wait, (interrupts_kept_inside,)),
    "interrupt-pool-wait": Scenario(POOL_ENGINE.as_default(interrupt_pool_wait),
                                    (POOL_ENGINE.running, interrupts_kept_inside)),
    # Owner graphs' options.
    "owner-reentrant": Scenario(owner_more("reentrant")),
    "owner-shape-metadata": Scenario(owner_more("shape")),
    "owner-visit-raises": Scenario(owner_more("visit")),
    "owner-needs-no-gradient-raises": Scenario(owner_more("needs_no_gradient")),
    "owner-post-hook-raises": Scenario(owner_more("post_hook")),
    "owner-metadata-raises": Scenario(owner_more("metadata")),
    "owner-bad-item-profiled": Scenario(owner_more("profiled")),
    "owner-grad-unreachable": Scenario(owner_more("grad")),
    "owner-writes-mode-raises": Scenario(owner_writes),
    "create-graph-pending-t-buffer": Scenario(create_graph_retain_fail),
    # The engine's bounds on reentrant backward.
    "reentrant-max-total-depth-exceeded": Scenario(TOTAL_DEPTH_ENGINE.as_default(total_depth_exceeded),
                                                   (TOTAL_DEPTH_ENGINE.running,)),
    "reentrant-pool-full": Scenario(ONE_POOL_THREAD_ENGINE.as_default(pool_full),
                                    (ONE_POOL_THREAD_ENGINE.running,)),
    # The end of a task, callbacks, a retained graph run again.
    "not-ready-left-at-the-end": Scenario(not_ready_left),
    "callback-queues-a-raising-callback": Scenario(callback_chain("boom")),
    "callback-chain-keyboard-interrupt": Scenario(callback_chain("ki")),
    "retained-graph-rerun-after-failure": Scenario(retained_rerun),
}
