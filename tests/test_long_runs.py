"""Backward graphs whose work in C is long though their nodes are few (one
node with a million edges, a million root edges, a million leaves, whose
AccumulateGrad nodes run with no Python code): other threads run, and
Ctrl-C comes out, while it goes. See Note [Long passes let other threads
run] in ``pyengine/_interrupts.pxd``.

Oracles:

- other threads: a pure-Python counter thread never waits longer than a
  fraction of the backward, as it would if the engine held the GIL
  throughout (the measure of ``test_graph_passes.py``'s count);
- Ctrl-C: a SIGALRM that a root node's ``apply`` starts raises
  KeyboardInterrupt out of the backward (an engine frame in its
  traceback) before the leaves all have their gradients, which they would
  if the engine only honoured it once it returned; afterwards the thread's
  state is as it was, and the same graph gives every leaf exactly one
  more gradient of ones.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

import numpy as np
import pytest
from minitensor import leaf
from stalls import longest_stall_while
from test_graph_passes import interrupt_after, stop_interrupts
from thread_state import thread_state_problems

import pyengine
from pyengine import Edge, Node

COMPILED = pyengine.IMPLEMENTATION == "compiled"
# Leaves or edges: a backward of about 0.1 s on either core (the twin runs
# a node about 30 times slower).
WIDTH = 100_000 if COMPILED else 5_000
ENGINE_FILES = os.path.dirname(os.path.abspath(pyengine.__file__)) + os.sep


def engine():
    return pyengine.get_default_engine()


class Split(Node):
    """Its one gradient to each of its next edges."""

    def apply(self, grads):
        return [grads[0]] * len(self.next_edges)


class Sink(Node):
    """A node with no next edges."""

    def apply(self, grads):
        return []


def leaves(n):
    return [leaf([1.0]) for _ in range(n)]


def split_into_leaves():
    xs = leaves(WIDTH)
    root = Split(next_edges=[pyengine.gradient_edge(x) for x in xs], input_metadata=[xs[0].data])
    return xs, lambda: engine().execute([Edge(root, 0)], [np.ones(1)], False, False, True)


def root_edges_of_leaves():
    xs = leaves(WIDTH)
    roots = [pyengine.gradient_edge(x) for x in xs]
    grads = [np.ones(1)] * WIDTH
    return xs, lambda: engine().execute(roots, grads, False, False, True)


def grad_of_leaves():
    xs = leaves(WIDTH)
    edges = [pyengine.gradient_edge(x) for x in xs]
    root = Split(next_edges=edges, input_metadata=[xs[0].data])

    def run():
        got = engine().execute([Edge(root, 0)], [np.ones(1)], False, False, False, outputs=edges)
        assert len(got) == WIDTH and all(np.array_equal(g, [1.0]) for g in got[:: WIDTH // 100])

    return [], run


def split_into_one_sink():
    sink = Sink(input_metadata=[np.ones(1)])
    root = Split(next_edges=[Edge(sink, 0)] * WIDTH, input_metadata=[np.ones(1)])
    return [], lambda: engine().execute([Edge(root, 0)], [np.ones(1)], False, False, True)


@pytest.mark.parametrize("build", [split_into_leaves, root_edges_of_leaves, grad_of_leaves,
                                   split_into_one_sink])
def test_other_threads_run_during_a_long_backward(build):
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    xs, run = build()
    try:
        tries = []
        # A stall of the OS's own can make one try fail: the best of three.
        for runs in range(1, 4):
            tries.append(longest_stall_while(run))
            # Every leaf got its gradient, once a run.
            assert all(np.array_equal(x.grad, [float(runs)]) for x in xs[:: WIDTH // 100])
    finally:
        sys.setswitchinterval(interval)
    stall, elapsed = min(tries)
    # An engine that held the GIL would stall the counter for nearly all of
    # the backward, which must last many switch intervals (1 ms) to show it.
    assert elapsed > 0.01, tries
    assert stall < min(0.5, elapsed / 4), tries


def raised_in_the_engine(error):
    return any(frame.filename.startswith(ENGINE_FILES)
               for frame in traceback.extract_tb(error.__traceback__))


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_ctrl_c_while_nodes_of_c_run():
    xs = leaves(WIDTH)
    started = []

    class StartsTheAlarm(Split):
        def apply(self, grads):
            if not started:
                started.append(interrupt_after(0.005))
            return super().apply(grads)

    root = StartsTheAlarm(next_edges=[pyengine.gradient_edge(x) for x in xs],
                          input_metadata=[xs[0].data])
    error = None
    try:
        engine().execute([Edge(root, 0)], [np.ones(1)], False, False, True)
    except KeyboardInterrupt as interrupt:
        error = interrupt
    finally:
        if started:
            stop_interrupts(started[0])
    assert error is not None, "Ctrl-C was not honoured during backward"
    assert raised_in_the_engine(error), traceback.format_tb(error.__traceback__)
    had = [x.grad is not None for x in xs]
    assert not all(had), "the backward ran to its end before Ctrl-C came out"
    error = None
    assert thread_state_problems() == []
    # Nothing left behind: the same graph gives each leaf one more gradient.
    started.append(None)  # no alarm this time
    engine().execute([Edge(root, 0)], [np.ones(1)], False, False, True)
    for x, before in zip(xs, had):
        np.testing.assert_array_equal(x.grad, [2.0] if before else [1.0])
