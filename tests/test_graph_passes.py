"""The whole-graph passes: ``compute_dependencies`` and the owner graph's
search. See Note [Cycles in the backward graph] in
``pyengine/_pure/dependencies.py``, Note [Long passes let other threads run] in
``pyengine/_interrupts.pxd`` and Note [Owner graphs] in
``pyengine/_pure/owner_graph.py``.

Oracles:

- cycles: the error names the node that the depth-first search, following
  next_edges in their order, finds on its own path (worked out by hand for
  each graph below); no node, hook or ``.grad`` was touched;
- Ctrl-C: the KeyboardInterrupt comes out of the pass itself (its frame is
  in the traceback), and afterwards a backward gives the analytic gradient;
- other threads: a pure-Python counter thread never waits longer than a
  fraction of the pass, as it would if the pass held the GIL throughout;
- owner graphs whose collections change while the search runs: a
  recursive depth-first topological sort (micrograd's ``build_topo``) that
  reads each collection once, when it first reaches its owner.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import traceback

import numpy as np
import pytest
from conftest import Counter
from minitensor import leaf
from stalls import longest_stall_while

import pyengine
from pyengine import Edge, Node

COMPILED = pyengine.IMPLEMENTATION == "compiled"
# The checkout (or install) a child process imports pyengine from.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pyengine.__file__)))


def engine():
    return pyengine.get_default_engine()


# -- cycles -----------------------------------------------------------------------------------------


class Named(Counter):
    """A pass-through node that counts its calls, named by its tag."""

    def name(self):
        return self.tag


def named(tag, x, next_edges=None):
    """A Named node over leaf ``x`` (next edges: ``next_edges``, or the leaf's)."""
    edges = [pyengine.gradient_edge(x)] if next_edges is None else next_edges
    return Named(next_edges=edges, input_metadata=[x.data], tag=tag)


def cycle_of_two(x):
    """``a -> b -> a``, made through the next_edges setter, each also into ``x``."""
    a = named("a", x)
    b = named("b", x, [Edge(a, 0), pyengine.gradient_edge(x)])
    a.next_edges = [Edge(b, 0), pyengine.gradient_edge(x)]
    return a, b


def assert_refused(nodes, x, run, name):
    """``run()`` raises the cycle error naming ``name``, before any node,
    pre-hook or post-hook ran and before any ``.grad`` was written."""
    calls = []
    for node in nodes:
        node.register_prehook(lambda grads, node=node: calls.append(("pre", node.tag)))
        node.register_hook(lambda grads_in, grads_out, node=node: calls.append(("post", node.tag)))
    with pytest.raises(RuntimeError) as info:
        run()
    assert str(info.value) == (
        f"the backward graph has a cycle: {name} is reachable from itself through next_edges; "
        "backward needs a graph without cycles")
    assert [node.calls for node in nodes] == [0] * len(nodes)
    assert calls == []
    assert x.grad is None


def test_a_cycle_through_the_root():
    x = leaf([1.0, 2.0])
    a, b = cycle_of_two(x)
    assert_refused([a, b], x, lambda: engine().execute([Edge(a, 0)], [np.ones(2)], False, False, True),
                   "a")


def test_a_cycle_below_the_root():
    x = leaf([1.0, 2.0])
    a, b = cycle_of_two(x)
    root = named("root", x, [pyengine.gradient_edge(x), Edge(b, 0)])
    # root -> x, then root -> b -> a -> b: b is on the path.
    assert_refused([root, a, b], x,
                   lambda: engine().execute([Edge(root, 0)], [np.ones(2)], False, False, True), "b")


def test_a_self_loop():
    x = leaf([1.0, 2.0])
    a = named("a", x)
    a.next_edges = [pyengine.gradient_edge(x), Edge(a, 0)]
    root = named("root", x, [Edge(a, 0)])
    assert_refused([root, a], x,
                   lambda: engine().execute([Edge(root, 0)], [np.ones(2)], False, False, True), "a")


def test_a_cycle_reachable_only_through_a_second_root():
    x = leaf([1.0, 2.0])
    first = named("first", x)
    a, b = cycle_of_two(x)
    second = named("second", x, [Edge(a, 0)])
    assert_refused([first, second, a, b], x,
                   lambda: engine().execute([Edge(first, 0), Edge(second, 0)],
                                            [np.ones(2), np.ones(2)], False, False, True), "a")


def test_a_cycle_under_grad_with_inputs():
    x = leaf([1.0, 2.0])
    y = leaf([3.0, 4.0])
    a = named("a", x, [pyengine.gradient_edge(x), pyengine.gradient_edge(y)])
    b = named("b", x, [Edge(a, 0)])
    a.next_edges = [pyengine.gradient_edge(x), Edge(b, 0)]
    root = named("root", x, [Edge(a, 0)])
    assert_refused([root, a, b], x,
                   lambda: engine().execute([Edge(root, 0)], [np.ones(2)], False, False, False,
                                            outputs=[pyengine.gradient_edge(x)]), "a")
    assert y.grad is None


# -- a long compute_dependencies: Ctrl-C, and other threads ---------------------------------------


def test_edges_to_later_nodes_without_a_cycle():
    """Edges that lead to nodes made later (set by hand, as nodes made on
    another thread would have) rule out the plain count's shortcut: the
    depth-first search counts instead, and the gradients are the graph's.
    x <- c <- b <- a, where c and b are made after a."""
    x = leaf([1.0, 2.0])
    a = named("a", x, [])
    b = named("b", x, [])
    c = named("c", x)  # into x
    b.next_edges = [Edge(c, 0), pyengine.gradient_edge(x)]
    a.next_edges = [Edge(b, 0), Edge(c, 0)]
    assert b.sequence_nr > a.sequence_nr and c.sequence_nr > a.sequence_nr
    engine().execute([Edge(a, 0)], [np.array([1.0, 1.0])], False, False, True, None)
    # a passes 1 to b and to c; b passes 1 to c and to x; c gets 2, passes 2 to x.
    np.testing.assert_array_equal(x.grad, [3.0, 3.0])
    assert (a.calls, b.calls, c.calls) == (1, 1, 1)


class Refuse(Node):
    """A root whose apply raises: backward ends as soon as the pass is done."""

    def apply(self, grads):
        raise RuntimeError("the root ran")


# Edges per fan node, and fan nodes: a pass of about 0.1 s on either core
# (the twin follows an edge about 60 times slower), built cheaply.
FAN_WIDTH, FANS = (200_000, 50) if COMPILED else (100_000, 3)


@pytest.fixture(scope="module")
def fan_graph():
    """A root over ``FANS`` nodes in a line, each with ``FAN_WIDTH`` edges
    to the next: a long compute_dependencies from few nodes."""
    x = leaf([1.0])
    node = Node(next_edges=[pyengine.gradient_edge(x)], input_metadata=[x.data])
    for _ in range(FANS):
        node = Node(next_edges=(Edge(node, 0),) * FAN_WIDTH, input_metadata=[x.data])
    root = Refuse(next_edges=[Edge(node, 0)], input_metadata=[x.data])
    return Edge(root, 0)


def run_refused(edge):
    with pytest.raises(RuntimeError, match="the root ran"):
        engine().execute([edge], [np.ones(1)], False, False, True)


def raised_in(error, function):
    """Whether ``function`` (a twin's function, or a compiled module's) is
    in ``error``'s traceback."""
    return any(frame.name == function or frame.name.endswith("." + function)
               for frame in traceback.extract_tb(error.__traceback__))


def interrupt_after(delay):
    """SIGALRM after ``delay`` seconds raises KeyboardInterrupt, as Ctrl-C would."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, handler)
    # Re-enabled by stop_interrupts: See signals_not_swallowed in conftest.
    gc.disable()
    signal.setitimer(signal.ITIMER_REAL, delay)
    return previous


def stop_interrupts(previous):
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
    gc.enable()


def assert_engine_works():
    """A plain backward and a reentrant one, with the analytic gradients."""
    x = leaf([1.0, 2.0])
    inner = leaf([5.0])

    class Reentrant(Counter):
        def apply(self, grads):
            y = Counter(next_edges=[pyengine.gradient_edge(inner)], input_metadata=[inner.data])
            engine().execute([Edge(y, 0)], [np.ones(1)], False, False, True)
            return super().apply(grads)

    node = Reentrant(next_edges=[pyengine.gradient_edge(x)], input_metadata=[x.data])
    engine().execute([Edge(node, 0)], [np.full(2, 2.0)], False, False, True)
    np.testing.assert_array_equal(x.grad, [2.0, 2.0])
    np.testing.assert_array_equal(inner.grad, [1.0])


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_ctrl_c_during_compute_dependencies(fan_graph):
    threads_before = set(threading.enumerate())
    error = None
    # The signal may land before the pass starts on a busy machine: a few tries.
    for _ in range(5):
        previous = interrupt_after(0.01)
        try:
            run_refused(fan_graph)
        except KeyboardInterrupt as interrupt:
            error = interrupt
        finally:
            stop_interrupts(previous)
        if error is not None and raised_in(error, "compute_dependencies"):
            break
    assert error is not None, "Ctrl-C was not honoured during backward"
    assert raised_in(error, "compute_dependencies"), traceback.format_tb(error.__traceback__)
    error = None
    # Nothing left behind: the same graph runs to its end, then other graphs.
    run_refused(fan_graph)
    assert_engine_works()
    # No thread left that was not there before (an earlier test's engine may
    # end its threads meanwhile: not an equality of counts).
    assert not set(threading.enumerate()) - threads_before


def test_other_threads_run_during_compute_dependencies(fan_graph):
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        # A stall of the OS's own can make one try fail: the best of three.
        tries = [longest_stall_while(lambda: run_refused(fan_graph)) for _ in range(3)]
    finally:
        sys.setswitchinterval(interval)
    stall, elapsed = min(tries)
    # A pass that held the GIL would stall the counter for all of it. The
    # pass must last many switch intervals (1 ms here) for that to show; on a
    # quiet machine it takes about 0.03 s.
    assert elapsed > 0.01, tries
    assert stall < min(0.5, elapsed / 4), tries


_CUT_WHILE_PASSING = """
import sys, threading, time
import numpy as np
import pyengine
from pyengine import Edge, Node


class Pass(Node):
    def apply(self, grads):
        return grads


def chain(n):
    # Every other node is held only by the Edge into it, so that cutting
    # the edges of the node above frees it.
    bottom = Pass(input_metadata=[((3,), np.float64)])
    edge, held = Edge(bottom, 0), []
    for i in range(n):
        node = Pass(next_edges=[edge], input_metadata=[((3,), np.float64)])
        if i % 2 == 0:
            held.append(node)
        edge = Edge(node, 0)
    return edge, bottom, held


for attempt in range(3):
    root, bottom, held = chain(300_000)
    go = threading.Event()

    def cut():
        go.wait()
        time.sleep(0.002)  # ask for the GIL once the pass has started
        for node in held:  # from the bottom up, towards the pass
            node.next_edges = []

    thread = threading.Thread(target=cut)
    thread.start()
    go.set()
    try:
        if sys.argv[1] == "grad":
            pyengine.grad(root, Edge(bottom, 0), np.ones(3), allow_unused=True)
        else:
            pyengine.backward(root, np.ones(3))
        print("ran")
    except RuntimeError as error:
        print(error)
    thread.join()
"""


@pytest.mark.stress
@pytest.mark.parametrize("call", ["grad", "backward"])
def test_edges_cut_by_another_thread_while_the_pass_yields(call):
    # Another thread cuts the chain below the node the pass yields at (its
    # switch interval elapsed): the node the cut edge led to may then be
    # held by the pass alone. The compiled search held the edges tuple and
    # not the node, let go of the tuple and then read the node: a crash
    # (SIGSEGV) on the first try of grad(inputs=). Each call now runs, or
    # fails with the error of a node whose edges changed before it ran
    # (See Note [Next edges while a node runs] in pyengine/_pure/engine.py),
    # and the process ends normally.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    if pyengine.IMPLEMENTATION == "pure":
        env["PYENGINE_PURE"] = "1"
    else:
        env.pop("PYENGINE_PURE", None)
    # From the folder of the pyengine imported here: See run_on_core in conftest.py.
    proc = subprocess.run([sys.executable, "-c", _CUT_WHILE_PASSING, call], env=env,
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    allowed = {"ran", "Function Pass returned an invalid number of gradients - expected 0, but got 1"}
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and set(lines) <= allowed, proc.stdout


# -- chains whose nodes lie in any order ------------------------------------------------------------

# The count and the search ask the memory system for the node a chain's
# step would reach a few nodes further on, a guess never read (See Note
# [Prefetching along a chain's stride] in pyengine/_stride_prefetch.h). On
# chains linked in another order than their nodes were made, the guesses
# land on other nodes, on other objects and past the heap: the passes
# count as on any chain. Linked backwards or shuffled, an edge leads to a
# node made later, so the count gives way to the search (See Note [Cycles
# in the backward graph] in pyengine/_pure/dependencies.py): both run.


def chain_linked_in(order, n=3000):
    """``n`` pass-through nodes made first and linked afterwards, in
    ``order``, above leaf ``x``: ``(x, root edge, nodes)``."""
    x = leaf(np.arange(3.0))
    nodes = [Counter(input_metadata=[x.data]) for _ in range(n)]
    if order == "reversed":
        nodes.reverse()
    elif order == "shuffled":
        nodes = [nodes[i] for i in np.random.default_rng(19).permutation(n)]
    edge = pyengine.gradient_edge(x)
    for node in nodes:
        node.next_edges = [edge]
        edge = Edge(node, 0)
    return x, edge, nodes


@pytest.mark.parametrize("order", ["made", "reversed", "shuffled"])
@pytest.mark.parametrize("call", ["backward", "grad"])
def test_a_chain_whose_nodes_lie_in_any_order(order, call):
    x, root, nodes = chain_linked_in(order)
    gradient = np.array([1.0, -2.0, 0.5])
    if call == "backward":
        engine().execute([root], [gradient], False, False, True)
        np.testing.assert_array_equal(x.grad, gradient)
    else:
        (result,) = engine().execute([root], [gradient], False, False, False,
                                     [pyengine.gradient_edge(x)])
        np.testing.assert_array_equal(result, gradient)
        assert x.grad is None
    assert [node.calls for node in nodes] == [1] * len(nodes)


# -- owner graphs -----------------------------------------------------------------------------------


class Owner:
    """A value of an owner graph; ``backward()`` records that it ran."""

    def __init__(self, tag, children=(), log=None):
        self.tag = tag
        self.children = children
        self.log = log

    def backward(self):
        self.log.append(self.tag)


class Meddler(Owner):
    """An owner whose ``children`` lookup runs ``meddle()`` first, once per
    lookup: code that changes other owners' collections mid-search."""

    def __init__(self, tag, children=(), log=None, meddle=None):
        super().__init__(tag, children, log)
        self.meddle = meddle

    @property
    def children(self):
        self.meddle()
        return self._children

    @children.setter
    def children(self, children):
        self._children = children


def snapshot_order(root):
    """micrograd's order (the reverse of a recursive depth-first post-order,
    leaves left out), reading each collection once, into a tuple, when the
    search first reaches its owner: Note [Owner graphs]'s semantics."""
    topo, visited = [], set()

    def build_topo(owner):
        if id(owner) not in visited:
            visited.add(id(owner))
            children = tuple(owner.children)
            for child in children:
                build_topo(child)
            if children:
                topo.append(owner)

    build_topo(root)
    return [owner.tag for owner in reversed(topo)]


def meddled_graph(kind, log):
    """``root`` over ``a`` and ``b``; looking up ``a``'s children adds a new
    owner to root's collection while the search walks it. Returns the root
    and a function that puts root's collection back as it was made."""
    x = Owner("x", kind(), log)
    b = Owner("b", kind([x]), log)
    late = Owner("late", kind([x]), log)
    root = Owner("root", None, log)

    def meddle():
        if isinstance(root.children, set):
            root.children.add(late)
        else:
            root.children.append(late)

    a = Meddler("a", kind([x]), log, meddle)

    def reset():
        root.children = kind([a, b])

    reset()
    return root, reset


@pytest.mark.parametrize("kind", [set, list])
def test_a_collection_changed_during_the_search(kind):
    log = []
    root, reset = meddled_graph(kind, log)
    pyengine.execute_owner_graph(root, "children", "backward")
    reset()
    expected = snapshot_order(root)
    assert log == expected
    # Root's collection was read before a's lookup changed it: late never ran.
    assert sorted(expected) == ["a", "b", "root"]


class Bare:
    """A leaf owner, as small as an owner gets."""

    __slots__ = ()
    children = ()


# Leaves under one root: a search of about 0.05 s on either core.
OWNER_LEAVES = 1_000_000 if COMPILED else 100_000


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_ctrl_c_during_the_owner_graph_search():
    log = []
    root = Owner("root", [Bare() for _ in range(OWNER_LEAVES)], log)
    function = "search"
    error = None
    for _ in range(5):
        previous = interrupt_after(0.005)
        try:
            pyengine.execute_owner_graph(root, "children", "backward")
        except KeyboardInterrupt as interrupt:
            error = interrupt
        finally:
            stop_interrupts(previous)
        if error is not None and raised_in(error, function):
            break
        log.clear()
    assert error is not None, "Ctrl-C was not honoured during the owner graph's search"
    assert raised_in(error, function), traceback.format_tb(error.__traceback__)
    assert log == []  # interrupted before any method ran
    error = None
    pyengine.execute_owner_graph(root, "children", "backward")
    assert log == ["root"]
    assert_engine_works()
