#!/usr/bin/env python
"""How long backward keeps other Python threads waiting for the GIL.

    python benchmarks/gil_stalls.py [--chain 1000000] [--pruned 2000000] \\
        [--owners 1000000] [--fan 1000000] [--roots 1000000] [--grad-fan 1000000] \\
        [--failed 1000000] [--half-filled 1000000] [--grad-failed 1000000] \\
        [--repeats 5] [--only chain,pruned,owners,fan,roots,grad-fan,failed,half-filled,grad-failed]

A second thread counts in pure Python, noting the longest gap between two
of its steps, while the main thread runs one backward:

- ``chain``: ``Engine.execute`` on a chain of ``--chain`` Python nodes
  (``pyengine.bench.graphs.chain``);
- ``pruned``: ``Engine.execute`` with ``outputs=`` (``grad(inputs=)``) on a
  chain of ``--pruned`` Python nodes: compute_dependencies, then the
  pruning pass init_to_execute, then the nodes;
- ``owners``: ``pyengine.execute_owner_graph`` on a chain of ``--owners``
  micrograd-style owners (each passes its ``grad`` on to its child);
- ``fan``: one Python node whose gradient goes to ``--fan`` leaves: the
  count, the validation and routing of its edges, then the leaves'
  AccumulateGrad nodes, all C;
- ``roots``: ``Engine.execute`` with ``--roots`` root edges into leaves;
- ``grad-fan``: ``fan``'s graph under ``grad(inputs=)`` of every leaf
  (``--grad-fan``): init_to_execute's loop over its outputs;
- ``failed``: one Python node whose gradient goes to ``--failed`` Python
  nodes that raise: the first to run fails the graph task, which drops
  the others' tasks from its queue and lets go of them;
- ``half-filled``: one Python node whose gradients (one array each) go to
  input 0 of ``--half-filled`` two-input Python nodes and to a node that
  raises before their input 1 comes: the failed graph task lets go of
  that many InputBuffers waiting in its not_ready;
- ``grad-failed``: ``grad(inputs=)`` of ``--grad-failed`` leaves, each
  sent an array of its own and captured, before a node on the path to
  the first raises: the failed graph task lets go of the captured arrays.

Printed per workload, over ``--repeats`` runs: the median (min-max) of the
counter's rate relative to its idle rate (measured first, the main thread
asleep), of its longest stall in milliseconds, and of the backward's wall
time. The goal (issue 15): a longest stall of at most 20 ms during any
backward. A thread that waits for the GIL gets it after the switch
interval (``sys.getswitchinterval()``, 5 ms by default) once the holder
offers it, so about 5 ms is the floor with the default interval. The
cyclic GC is off while a backward runs (a collection is the main thread's
own stall, not the engine's), and graphs are built before the counter
starts.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time

import numpy as np

import pyengine
from pyengine.bench.graphs import DTYPE, SHAPE, Leaf, build


class CountingThread(threading.Thread):
    """Counts in pure Python until stopped; notes the longest gap between
    two steps."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stopped = False
        self.steps = 0
        self.longest = 0.0
        self.elapsed = 0.0
        self.started_counting = threading.Event()

    def run(self):
        clock = time.perf_counter
        start = last = clock()
        longest = 0.0
        steps = 0
        self.started_counting.set()
        while not self.stopped:
            now = clock()
            if now - last > longest:
                longest = now - last
            last = now
            steps += 1
        self.steps, self.longest, self.elapsed = steps, longest, clock() - start


def counted(work):
    """Run ``work()`` with a counting thread: ``(steps per second, longest
    stall in seconds, work's wall time)``."""
    counter = CountingThread()
    counter.start()
    counter.started_counting.wait()
    begin = time.perf_counter()
    try:
        work()
    finally:
        wall = time.perf_counter() - begin
        counter.stopped = True
        counter.join()
    return counter.steps / counter.elapsed, counter.longest, wall


class Owner:
    """A micrograd-style value: its children, and a method that passes its
    gradient on to them (assigned, not added, so that every run gives 1)."""

    __slots__ = ("children", "grad")

    def __init__(self, children):
        self.children = children
        self.grad = 0.0

    def backward(self):
        for child in self.children:
            child.grad = self.grad


def chain_workload(n):
    graph = build("chain", n)
    graph.run_checked()

    def run():
        graph.reset()
        graph.run()

    return run, graph.check


def pruned_workload(n):
    graph = build("chain", n)
    graph.run_checked()
    leaf_edge = pyengine.gradient_edge(graph.leaf)
    engine = pyengine.get_default_engine()
    captured = []

    def run():
        captured[:] = engine.execute([graph.root_edge], [graph.grad], False, False, False,
                                     outputs=[leaf_edge])

    def check():
        np.testing.assert_array_equal(captured[0], graph.expected)

    return run, check


def owners_workload(n):
    leaf = Owner(())
    top = leaf
    for _ in range(n):
        top = Owner((top,))

    def run():
        leaf.grad = 0.0
        top.grad = 1.0
        pyengine.execute_owner_graph(top, "children", "backward")

    def check():
        assert leaf.grad == 1.0, leaf.grad

    return run, check


class Split(pyengine.Node):
    """Its one gradient to each of its next edges."""

    def apply(self, grads):
        return [grads[0]] * len(self.next_edges)


def _leaves(n):
    return [Leaf(np.zeros(SHAPE, DTYPE)) for _ in range(n)]


def _all_got(leaves, value):
    for leaf in leaves:
        np.testing.assert_array_equal(leaf.grad, np.full(SHAPE, value, DTYPE))


def fan_workload(n):
    leaves = _leaves(n)
    root = Split(next_edges=[pyengine.gradient_edge(leaf) for leaf in leaves],
                 input_metadata=[pyengine.InputMetadata(SHAPE, DTYPE)])
    engine = pyengine.get_default_engine()

    def run():
        for leaf in leaves:
            leaf.grad = None
        engine.execute([pyengine.Edge(root, 0)], [np.ones(SHAPE, DTYPE)], False, False, True)

    return run, lambda: _all_got(leaves, 1.0)


def roots_workload(n):
    leaves = _leaves(n)
    roots = [pyengine.gradient_edge(leaf) for leaf in leaves]
    grads = [np.ones(SHAPE, DTYPE)] * n
    engine = pyengine.get_default_engine()

    def run():
        for leaf in leaves:
            leaf.grad = None
        engine.execute(roots, grads, False, False, True)

    return run, lambda: _all_got(leaves, 1.0)


def grad_fan_workload(n):
    leaves = _leaves(n)
    edges = [pyengine.gradient_edge(leaf) for leaf in leaves]
    root = Split(next_edges=edges, input_metadata=[pyengine.InputMetadata(SHAPE, DTYPE)])
    engine = pyengine.get_default_engine()
    captured = []

    def run():
        captured[:] = engine.execute([pyengine.Edge(root, 0)], [np.ones(SHAPE, DTYPE)], False,
                                     False, False, outputs=edges)

    def check():
        assert len(captured) == n
        for gradient in captured:
            np.testing.assert_array_equal(gradient, np.ones(SHAPE, DTYPE))

    return run, check


class Raises(pyengine.Node):
    """Fails its graph task."""

    def apply(self, grads):
        raise PlantedError


class PlantedError(Exception):
    """What a ``Raises`` node raises."""


class Distinct(pyengine.Node):
    """An array of its own to each of its next edges."""

    def apply(self, grads):
        return [np.ones(SHAPE, DTYPE) for _ in self.next_edges]


class Sink(pyengine.Node):
    def apply(self, grads):
        return []


def failing(root, **execute_options):
    """The run and check of a backward from ``root`` that must raise
    PlantedError (``Engine.execute``'s keyword options: ``outputs``)."""
    engine = pyengine.get_default_engine()
    accumulate_grad = "outputs" not in execute_options
    raised = []

    def run():
        try:
            engine.execute([pyengine.Edge(root, 0)], [np.ones(SHAPE, DTYPE)], False, False,
                           accumulate_grad, **execute_options)
        except PlantedError as error:
            raised.append(error)

    def check():
        assert len(raised) == 1, raised
        raised.clear()

    return run, check


def failed_workload(n):
    metadata = pyengine.InputMetadata(SHAPE, DTYPE)
    raisers = [Raises(input_metadata=[metadata]) for _ in range(n)]
    return failing(Split(next_edges=[pyengine.Edge(node, 0) for node in raisers],
                         input_metadata=[metadata]))


def half_filled_workload(n):
    metadata = pyengine.InputMetadata(SHAPE, DTYPE)
    pairs = [Sink(input_metadata=[metadata, metadata]) for _ in range(n)]
    second = Split(next_edges=[pyengine.Edge(pair, 1) for pair in pairs],
                   input_metadata=[metadata])
    raiser = Raises(next_edges=[pyengine.Edge(second, 0)], input_metadata=[metadata])
    return failing(Distinct(next_edges=[pyengine.Edge(pair, 0) for pair in pairs]
                            + [pyengine.Edge(raiser, 0)], input_metadata=[metadata]))


def grad_failed_workload(n):
    edges = [pyengine.gradient_edge(leaf) for leaf in _leaves(n)]
    metadata = pyengine.InputMetadata(SHAPE, DTYPE)
    raiser = Raises(next_edges=edges[:1], input_metadata=[metadata])
    return failing(Distinct(next_edges=edges + [pyengine.Edge(raiser, 0)],
                            input_metadata=[metadata]), outputs=edges)


WORKLOADS = {
    "chain": ("backward, chain of {n:,} Python nodes", chain_workload),
    "pruned": ("grad(inputs=), chain of {n:,} Python nodes", pruned_workload),
    "owners": ("owner graph, chain of {n:,} owners", owners_workload),
    "fan": ("backward, one node into {n:,} leaves", fan_workload),
    "roots": ("backward, {n:,} root edges into leaves", roots_workload),
    "grad-fan": ("grad(inputs=), one node into {n:,} leaves", grad_fan_workload),
    "failed": ("backward, one node into {n:,} that raise", failed_workload),
    "half-filled": ("backward failing with {n:,} buffers half filled", half_filled_workload),
    "grad-failed": ("grad(inputs=) failing, {n:,} captured", grad_failed_workload),
}


def summary(values, scale=1.0, digits=1):
    values = [v * scale for v in values]
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", type=int, default=1_000_000)
    parser.add_argument("--pruned", type=int, default=2_000_000)
    parser.add_argument("--owners", type=int, default=1_000_000)
    parser.add_argument("--fan", type=int, default=1_000_000)
    parser.add_argument("--roots", type=int, default=1_000_000)
    parser.add_argument("--grad-fan", type=int, default=1_000_000)
    parser.add_argument("--failed", type=int, default=1_000_000)
    parser.add_argument("--half-filled", type=int, default=1_000_000)
    parser.add_argument("--grad-failed", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default=",".join(WORKLOADS))
    args = parser.parse_args(argv)

    print(f"pyengine {pyengine.IMPLEMENTATION} core, Python {sys.version.split()[0]}, "
          f"switch interval {sys.getswitchinterval() * 1e3:g} ms")
    idles = [counted(lambda: time.sleep(0.5)) for _ in range(3)]
    idle = statistics.median(rate for rate, _, _ in idles)
    print(f"counter, idle: {idle / 1e6:.2f}M steps/s, longest stall "
          f"{summary([stall for _, stall, _ in idles], 1e3)} ms (the machine's own)")
    print(f"{'workload':<44} {'rate vs idle %':>20} {'longest stall ms':>22} {'backward s':>20}")
    for name in args.only.split(","):
        title, make = WORKLOADS[name]
        n = getattr(args, name.replace("-", "_"))
        run, check = make(n)
        rates, stalls, walls = [], [], []
        for _ in range(args.repeats):
            gc.collect()
            gc.disable()
            try:
                rate, stall, wall = counted(run)
            finally:
                gc.enable()
            check()
            rates.append(rate / idle)
            stalls.append(stall)
            walls.append(wall)
        print(f"{title.format(n=n):<44} {summary(rates, 100):>20} "
              f"{summary(stalls, 1e3):>22} {summary(walls, 1, 2):>20}", flush=True)
        del run, check
        gc.collect()


if __name__ == "__main__":
    main()
