"""Large graphs: long chains and wide graphs run without RecursionError or a
stack overflow, give exact gradients, and can be freed (``del`` then
``gc.collect()``) without overflowing the stack in the deallocator.

Each scenario runs in a fresh interpreter (same core: ``PYENGINE_PURE`` is
inherited and checked), so that a C stack overflow shows up as a failed test
with the signal named instead of killing the whole test run. The scenarios
are plain functions of this module; the subprocess imports it and calls one.

Oracles are analytic: a chain whose every third node scales by -1 (the others
pass the same array on) multiplies by ``(-1) ** ceil(n / 3)``; in the wide
graph, branch ``b`` multiplies by ``(b % 7 + 1) * (-1) ** (depth - 1)`` and
the add tree passes the root gradient to every branch unchanged.

The 1,000,000-node versions are marked ``slow``; 100,000-node ones are not.
The twin runs the 1M chain (grad and backward) and leaves the other 1M
versions to the compiled core: its wide graph, reference cycle and
deallocation are the same Python code at 100k, which runs on both cores in
the default run, and the three took about 5 of its 7 slow minutes in CI.
"""

import gc
import json
import os
import signal
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


G = (1.0, -2.0)


# -- scenarios (run in the subprocess) --------------------------------------------------------

def _setup(expected_implementation):
    sys.path.insert(0, HERE)
    import pyengine

    assert pyengine.IMPLEMENTATION == expected_implementation, \
        f"subprocess runs the {pyengine.IMPLEMENTATION} core, the test the {expected_implementation}"
    import linear_graphs

    return pyengine, linear_graphs


def _chain_sign(n):
    return (-1.0) ** sum(1 for i in range(n) if i % 3 == 0)


def _report(**fields):
    print("SCENARIO " + json.dumps(fields))


def scenario_chain(implementation, n, cycle=False, passes=("grad", "inputs", "backward")):
    pyengine, lg = _setup(implementation)
    timings = {}
    start = time.perf_counter()
    x = lg.Leaf(np.zeros(2))
    top = lg.chain(n, x, lambda i: -1.0 if i % 3 == 0 else None)
    middle = top
    for _ in range(n // 2):
        middle = middle.next_edges[0].node
    probes = [weakref.ref(top), weakref.ref(middle),
              weakref.ref(pyengine.gradient_edge(x).node)]
    del middle
    if cycle:
        # Close a reference cycle through the whole chain: only gc can free it.
        bottom = pyengine.gradient_edge(x).node
        bottom.metadata["top"] = top
        del bottom
    timings["build"] = time.perf_counter() - start
    g = np.array(G)
    want = _chain_sign(n) * g
    out = lg.Value(np.zeros(2), top, 0)

    if "grad" in passes:
        start = time.perf_counter()
        (got,) = pyengine.grad(out, x, grad_outputs=g, retain_graph=True)
        timings["grad"] = time.perf_counter() - start
        assert (got == want).all(), (got, want)
        assert x.grad is None
    runs = 0
    if "inputs" in passes:
        start = time.perf_counter()
        pyengine.backward(out, grad_tensors=g, retain_graph=True, inputs=[x])
        timings["backward_inputs"] = time.perf_counter() - start
        runs += 1
    if "backward" in passes:
        start = time.perf_counter()
        pyengine.backward(out, grad_tensors=g)
        timings["backward"] = time.perf_counter() - start
        runs += 1
    assert runs == 0 or (x.grad == runs * want).all(), (x.grad, want)
    assert (g == G).all()

    start = time.perf_counter()
    del top, out
    if cycle:
        assert all(probe() is not None for probe in probes), "the cycle was freed without gc"
    gc.collect()
    timings["free"] = time.perf_counter() - start
    assert all(probe() is None for probe in probes), "the chain was not freed"
    _report(**timings)


def _add_tree(pyengine, lg, tops):
    """Binary tree of 'add' backward nodes (each passes its gradient, the same
    object, to both children) over the Edges ``tops``; returns the root node."""
    level = list(tops)
    while len(level) > 1:
        paired = []
        for i in range(0, len(level) - 1, 2):
            paired.append(pyengine.Edge(lg.ScaleNode((level[i], level[i + 1]), None), 0))
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0].node


def scenario_wide(implementation, branches, depth, with_grad=True):
    pyengine, lg = _setup(implementation)
    timings = {}
    start = time.perf_counter()
    x = lg.Leaf(np.zeros(2))
    acc = pyengine.gradient_edge(x)
    tops = []
    for b in range(branches):
        edge = acc
        for level in range(depth):
            node = lg.ScaleNode((edge,), float(b % 7 + 1) if level == 0 else -1.0)
            edge = pyengine.Edge(node, 0)
        tops.append(edge)
    root = _add_tree(pyengine, lg, tops)
    del tops, edge, node
    probes = [weakref.ref(root), weakref.ref(acc.node)]
    del acc
    timings["build"] = time.perf_counter() - start
    g = np.array(G)
    factor = sum(float(b % 7 + 1) for b in range(branches)) * (-1.0) ** (depth - 1)
    want = factor * g
    out = lg.Value(np.zeros(2), root, 0)

    start = time.perf_counter()
    pyengine.backward(out, grad_tensors=g, retain_graph=True)
    timings["backward"] = time.perf_counter() - start
    assert (x.grad == want).all(), (x.grad, want)

    if with_grad:
        start = time.perf_counter()
        (got,) = pyengine.grad(out, x, grad_outputs=g)
        timings["grad"] = time.perf_counter() - start
        assert (got == want).all(), (got, want)
        assert (x.grad == want).all()
    assert (g == G).all()

    start = time.perf_counter()
    del root, out
    gc.collect()
    timings["free"] = time.perf_counter() - start
    assert all(probe() is None for probe in probes), "the graph was not freed"
    _report(**timings)


def scenario_deallocate_only(implementation, n):
    """Build a chain and free it without any backward: the deallocator alone."""
    pyengine, lg = _setup(implementation)
    x = lg.Leaf(np.zeros(2))
    top = lg.chain(n, x, lambda i: None)
    probe = weakref.ref(top)
    del top
    gc.collect()
    assert probe() is None
    # pyengine.Node itself (no __slots__ subclass) between the Edges.
    node = lg.ScaleNode(())
    for _ in range(n):
        node = pyengine.Node(next_edges=(pyengine.Edge(node, 0),))
    probe = weakref.ref(node)
    del node
    gc.collect()
    assert probe() is None
    # The core's own node type, with no Python subclass (whose deallocator
    # has the trashcan) in the chain.
    from pyengine._core import NodeBase

    node = NodeBase()
    for _ in range(n):
        node = NodeBase(next_edges=(pyengine.Edge(node, 0),))
    probe = weakref.ref(node)
    del node
    gc.collect()
    assert probe() is None
    _report()


# -- the tests ------------------------------------------------------------------------------

def _run(scenario, *args, timeout):
    import pyengine

    code = (f"import test_large_graphs as t; "
            f"t.{scenario}({pyengine.IMPLEMENTATION!r}, *{args!r})")
    # The same pyengine as this process (installed, or the checkout), and this
    # directory for the scenarios; run from here so that the checkout's
    # pyengine cannot shadow an installed one.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(pyengine.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_parent, HERE, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        how = f"exit status {proc.returncode}"
        if proc.returncode < 0:
            how = f"killed by {signal.Signals(-proc.returncode).name}"
        pytest.fail(f"{scenario}{args} failed ({how}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SCENARIO ")]
    assert lines, f"{scenario}{args} did not finish:\n{proc.stdout[-2000:]}"
    return json.loads(lines[-1][len("SCENARIO "):])


def test_chain_100k():
    _run("scenario_chain", 100_000, timeout=300)


def test_chain_100k_in_a_reference_cycle():
    _run("scenario_chain", 100_000, True, ("backward",), timeout=300)


def test_wide_1000_branches_of_depth_10():
    _run("scenario_wide", 1000, 10, timeout=300)


def test_wide_100k_nodes():
    _run("scenario_wide", 10_000, 10, False, timeout=300)


def test_deallocating_a_100k_chain():
    _run("scenario_deallocate_only", 100_000, timeout=300)


@pytest.mark.slow
def test_chain_1m():
    _run("scenario_chain", 1_000_000, False, ("grad", "backward"), timeout=900)


# See the module's docstring.
compiled_core_only = pytest.mark.skipif(
    os.environ.get("PYENGINE_PURE", "") not in ("", "0"),
    reason="the twin's 1M run is test_chain_1m; this code runs on it at 100k")


@pytest.mark.slow
@compiled_core_only
def test_chain_1m_in_a_reference_cycle():
    _run("scenario_chain", 1_000_000, True, ("backward",), timeout=900)


@pytest.mark.slow
@compiled_core_only
def test_wide_1m_nodes():
    # 1,000 branches of depth 1,000 joined by an add tree: 1,000,999 nodes.
    _run("scenario_wide", 1000, 1000, timeout=900)


@pytest.mark.slow
@compiled_core_only
def test_deallocating_a_1m_chain():
    _run("scenario_deallocate_only", 1_000_000, timeout=900)


def test_a_chain_deeper_than_the_recursion_limit_in_process():
    # In this process too (no subprocess): 20x the recursion limit.
    sys.path.insert(0, HERE)
    import linear_graphs as lg

    import pyengine

    n = 20 * sys.getrecursionlimit()
    x = lg.Leaf(np.zeros(2))
    top = lg.chain(n, x, lambda i: 0.5 if i % 2 else 2.0)
    pyengine.backward(lg.Value(np.zeros(2), top, 0), grad_tensors=np.array(G))
    assert (x.grad == np.array(G)).all()
    probe = weakref.ref(top)
    del top
    gc.collect()
    assert probe() is None
