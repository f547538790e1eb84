"""A thread's WorkerState: made by its first backward, gone with the thread.

The compiled core keeps a pointer to it in the thread's C state (See Note
[The worker state's thread-local pointer] in pyengine/_engine.pyx); these
tests hold it to what the twin's threading.local does, and check that no
Python code can free it under that pointer.
"""

from __future__ import annotations

import gc
import sys
import threading

import numpy as np
import pytest

import pyengine
from pyengine import _core
from pyengine.bench import graphs

THREADS = 300


def one_backward_on_a_new_thread():
    graph = graphs.chain(3)
    failures = []

    def run():
        try:
            graph.run()
            graph.check()
        except BaseException as error:  # noqa: BLE001 - reported to the test
            failures.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not failures, failures


def test_a_thread_that_ends_takes_its_worker_state_with_it():
    # Each thread makes a WorkerState, its ready queue and lists: kept past
    # the thread, they would be several blocks per thread.
    for _ in range(50):
        one_backward_on_a_new_thread()
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(THREADS):
        one_backward_on_a_new_thread()
    gc.collect()
    grown = sys.getallocatedblocks() - before
    assert grown < THREADS // 2, f"{grown} blocks more after {THREADS} threads"


def engine_locals_of_other_threads():
    """The dicts of the compiled engine's threading.local, one per thread
    that has one: reached the way any Python code can, through gc."""
    found = []
    for obj in gc.get_objects():
        if type(obj) is not threading.local:
            continue
        for referent in gc.get_referents(obj):
            if not isinstance(referent, dict):
                continue
            for value in referent.values():
                if (isinstance(value, dict)
                        and type(value.get("state")).__name__ == "WorkerStateKeeper"):
                    found.append(value)
    return found


@pytest.mark.skipif(_core.IMPLEMENTATION != "compiled",
                    reason="the compiled core's pointer to the worker state")
def test_a_worker_state_let_go_of_from_another_thread_still_serves_its_thread():
    graph = graphs.chain(3)
    ran_once, cleared, results = threading.Event(), threading.Event(), []

    def run():
        graph.run()
        results.append(graph.leaf.grad.copy())
        graph.reset()
        ran_once.set()
        cleared.wait(30)
        graph.run()
        results.append(graph.leaf.grad.copy())

    thread = threading.Thread(target=run)
    thread.start()
    assert ran_once.wait(30)
    gc.collect()
    engine_locals = engine_locals_of_other_threads()
    assert engine_locals, "the thread's engine local was not found"
    for local in engine_locals:
        local.clear()  # frees the keepers here, on this thread
    cleared.set()
    thread.join(30)
    assert not thread.is_alive()
    assert len(results) == 2
    for got in results:
        np.testing.assert_array_equal(got, graph.expected)
    # And this thread's own state, if cleared above, is made again.
    graph.reset()
    pyengine.get_default_engine().execute([graph.root_edge], [graph.grad], False, False, True)
    graph.check()
