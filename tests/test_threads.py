"""Several Python threads calling backward / grad at once.

On disjoint graphs each thread's leaves get exactly its own gradients; on one
shared graph (``retain_graph=True``) the leaves get exactly the sum over all
calls (AccumulateGrad takes a per-node lock). The oracle is the exact
reverse accumulation of ``linear_graphs``. CPU work runs on the calling
thread (Note [CPU work runs on the caller]), and every thread the test started
is gone after the joins; only the engine's reentrant pool threads (daemon,
named "pyengine-reentrant") may outlive a test.
"""

import os
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import linear_graphs as lg  # noqa: E402

import pyengine  # noqa: E402
from pyengine.backends import NumpyBackend  # noqa: E402

N_THREADS = 8
JOIN_TIMEOUT = 120


class YieldingNode(lg.LinearNode):
    """A LinearNode that gives the GIL away before it computes, so that the
    threads' graph tasks interleave node by node (switch intervals alone give
    a thread whole backward calls)."""

    __slots__ = ()

    def apply(self, grads):
        time.sleep(0)
        return super().apply(grads)


def _build(spec, **kwargs):
    return lg.build(spec, node_class=YieldingNode, **kwargs)


def _engine_threads_excluded():
    return [thread for thread in threading.enumerate() if thread.name != "pyengine-reentrant"]


@pytest.fixture
def fast_switching():
    """Switch threads as often as possible, so that the threads interleave
    inside the engine and not only between backward calls."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


@pytest.fixture
def no_thread_left_behind():
    # Threads the test started and left running, by identity: a thread of an
    # earlier test may still be on its way out when the test starts (seen
    # on a loaded machine), and its end is not this test's doing.
    before = set(_engine_threads_excluded())
    yield
    left_behind = set(_engine_threads_excluded()) - before
    assert not left_behind, f"threads left behind: {left_behind}"


def _run_threads(targets):
    """Start one thread per target behind a barrier; join; re-raise the first error."""
    barrier = threading.Barrier(len(targets))
    errors = []

    def wrap(target, index):
        def run():
            try:
                barrier.wait(JOIN_TIMEOUT)
                target(index)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append((index, error))
        return run

    threads = [threading.Thread(target=wrap(target, i), name=f"caller-{i}")
               for i, target in enumerate(targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"threads did not finish: {stuck}"
    return errors


def _leaf_grads_equal(graph, expected, scale):
    for i, leaf in enumerate(graph.leaves):
        want = expected[("leaf", i)]
        if want is not None:
            want = [v * scale for v in want]
        assert lg.equal(leaf.grad, want), f"leaf {i}: {lg.describe(leaf.grad, want)}"


def _backward(graph, roots, retain_graph):
    pyengine.backward([graph.tensor(ref) for ref, _ in roots],
                      grad_tensors=lg.root_grad_arrays(roots), retain_graph=retain_graph)


@pytest.mark.parametrize("n_threads", [4, N_THREADS])
def test_disjoint_graphs_at_once(n_threads, fast_switching, no_thread_left_behind):
    repeats = 15
    cases = [lg.seeded_case(100 + i, n_ops=25, repeats=repeats) for i in range(n_threads)]
    logs = [[] for _ in range(n_threads)]
    graphs = [_build(spec, log=log) for (spec, _, _), log in zip(cases, logs)]

    def work(i):
        _, roots, _ = cases[i]
        for r in range(repeats):
            _backward(graphs[i], roots, retain_graph=r < repeats - 1)

    errors = _run_threads([work] * n_threads)
    assert not errors, errors
    for i, (graph, (_, _, expected)) in enumerate(zip(graphs, cases)):
        _leaf_grads_equal(graph, expected, repeats)
        # Every node of thread i's graph ran on thread i.
        assert logs[i], "no node ran"
        assert {name for _, name in logs[i]} == {f"caller-{i}"}


def test_shared_graph_with_retain_graph(fast_switching, no_thread_left_behind):
    repeats = 10
    spec, roots, expected = lg.seeded_case(7, n_ops=30, repeats=repeats * N_THREADS,
                                           min_reached_leaves=3)
    graph = _build(spec)

    def work(i):
        for _ in range(repeats):
            _backward(graph, roots, retain_graph=True)

    errors = _run_threads([work] * N_THREADS)
    assert not errors, errors
    _leaf_grads_equal(graph, expected, repeats * N_THREADS)


def test_shared_graph_backward_and_grad_mixed(fast_switching, no_thread_left_behind):
    repeats = 8
    spec, roots, expected = lg.seeded_case(11, n_ops=25, repeats=repeats * N_THREADS)
    graph = _build(spec)
    # grad() with respect to every leaf and every op output, from half the threads.
    refs = spec.all_refs()
    results = [[] for _ in range(N_THREADS)]

    def work(i):
        for _ in range(repeats):
            if i % 2 == 0:
                _backward(graph, roots, retain_graph=True)
            else:
                results[i].append(pyengine.grad(
                    [graph.tensor(ref) for ref, _ in roots],
                    [graph.tensor(ref) for ref in refs],
                    grad_outputs=lg.root_grad_arrays(roots), retain_graph=True,
                    allow_unused=True))

    errors = _run_threads([work] * N_THREADS)
    assert not errors, errors
    n_backward = repeats * len(range(0, N_THREADS, 2))
    _leaf_grads_equal(graph, expected, n_backward)
    for i in range(1, N_THREADS, 2):
        assert len(results[i]) == repeats
        for result in results[i]:
            for ref, got in zip(refs, result):
                assert lg.equal(got, expected[ref]), f"{ref}: {lg.describe(got, expected[ref])}"


class Boom(Exception):
    pass


class Failing(pyengine.Node):
    def apply(self, grads):
        raise Boom("from a node")


def test_error_in_one_thread_does_not_disturb_the_others(fast_switching, no_thread_left_behind):
    repeats = 10
    cases = [lg.seeded_case(300 + i, n_ops=20, repeats=repeats) for i in range(N_THREADS)]
    graphs = [_build(spec) for spec, _, _ in cases]
    caught = []

    def work(i):
        _, roots, _ = cases[i]
        for _ in range(repeats):
            if i % 3 == 0:
                # A graph whose node fails, between good calls.
                x = lg.Leaf(np.zeros(2))
                bad = Failing(next_edges=(pyengine.gradient_edge(x),))
                with pytest.raises(Boom):
                    pyengine.backward(lg.Value(np.zeros(2), bad, 0), grad_tensors=np.ones(2))
                caught.append(i)
                assert x.grad is None
            _backward(graphs[i], roots, retain_graph=True)

    errors = _run_threads([work] * N_THREADS)
    assert not errors, errors
    assert len(caught) == repeats * len(range(0, N_THREADS, 3))
    for graph, (_, _, expected) in zip(graphs, cases):
        _leaf_grads_equal(graph, expected, repeats)


class Reentrant(pyengine.Node):
    """Returns ``grads[0]`` plus the gradient of an inner graph, computed by a
    reentrant ``grad`` call."""

    def __init__(self, next_edges, inner, inner_roots, inner_inputs):
        super().__init__(next_edges=next_edges)
        self.inner = inner
        self.inner_roots = inner_roots
        self.inner_inputs = inner_inputs

    def apply(self, grads):
        results = pyengine.grad([self.inner.tensor(ref) for ref, _ in self.inner_roots],
                                [self.inner.tensor(ref) for ref in self.inner_inputs],
                                grad_outputs=lg.root_grad_arrays(self.inner_roots),
                                retain_graph=True, allow_unused=True)
        extra = sum(float(np.sum(r)) for r in results if r is not None)
        return [grads[0] + extra]


def test_reentrant_backward_in_several_threads(fast_switching, no_thread_left_behind):
    repeats = 5
    spec, roots, expected = lg.seeded_case(23, n_ops=15)
    inner_inputs = [ref for ref in spec.all_refs() if expected[ref] is not None]
    extra = sum(float(sum(expected[ref])) for ref in inner_inputs)
    leaves = [lg.Leaf(np.zeros(2)) for _ in range(N_THREADS)]

    def work(i):
        inner = _build(spec)
        node = Reentrant((pyengine.gradient_edge(leaves[i]),), inner, roots, inner_inputs)
        for _ in range(repeats):
            pyengine.backward(lg.Value(np.zeros(2), node, 0), grad_tensors=np.array([1.0, 2.0]),
                              retain_graph=True)

    errors = _run_threads([work] * N_THREADS)
    assert not errors, errors
    for leaf in leaves:
        assert (leaf.grad == repeats * (np.array([1.0, 2.0]) + extra)).all(), leaf.grad


class YieldingArray(np.ndarray):
    """A numpy array whose backend gives the GIL away inside every operation
    the engine and AccumulateGrad use on it, so that two threads interleave
    inside AccumulateGrad's read-modify-write of ``.grad``."""


class YieldingBackend(NumpyBackend):
    name = "yielding-numpy"

    def add(self, a, b):
        time.sleep(0)
        return super().add(a, b)

    def add_(self, a, b):
        time.sleep(0)
        return super().add_(a, b)

    def copy(self, value):
        time.sleep(0)
        return super().copy(value)


pyengine.register_backend(YieldingArray, YieldingBackend())


def test_concurrent_accumulation_into_one_leaf_loses_nothing(no_thread_left_behind):
    repeats = 40
    x = lg.Leaf(np.zeros(3))
    # Roots on the leaf itself and on a pass-through node into it: every call
    # ends in the same AccumulateGrad.
    through = YieldingNode([pyengine.gradient_edge(x)], [((3,), np.float64)],
                           [[(0, None)]], tag="through")
    out = lg.Value(np.zeros(3), through, 0)

    def grad_array(i, r):
        return (np.array([1.0, 2.0, 4.0]) * (i + 1) * (r % 3 + 1)).view(YieldingArray)

    def work(i):
        for r in range(repeats):
            if (i + r) % 2:
                pyengine.backward(x, grad_tensors=grad_array(i, r))
            else:
                pyengine.backward(out, grad_tensors=grad_array(i, r), retain_graph=True)

    errors = _run_threads([work] * N_THREADS)
    assert not errors, errors
    total = sum((i + 1) * (r % 3 + 1) for i in range(N_THREADS) for r in range(repeats))
    assert np.array_equal(np.asarray(x.grad), np.array([1.0, 2.0, 4.0]) * total), x.grad


def test_deep_reentrant_chains_in_several_threads_share_the_pool(no_thread_left_behind):
    # Each thread runs a reentrant chain deeper than max_recursion_depth, so
    # that the threads hand graph tasks to the pool at the same time.
    depth = 3 * pyengine.get_default_engine().max_recursion_depth + 7
    chains = [lg.reentrant_chain(depth) for _ in range(4)]
    g = np.array([1.0, -2.0])

    def work(i):
        nodes, _ = chains[i]
        pyengine.backward(lg.Value(np.zeros(2), nodes[-1], 0), grad_tensors=(i + 1) * g)

    errors = _run_threads([work] * len(chains))
    assert not errors, errors
    for i, (_, leaves) in enumerate(chains):
        assert (leaves[-1].grad == depth * (i + 1) * g).all()
        assert all(x.grad is None for x in leaves[:-1])
