"""The twin's reentrant pool: a hand-off wakes an idle pool thread, never a
caller that waits for its own pool thread to come back. See Note [A hand-off
wakes a pool thread] in ``pyengine/_pure/thread_pool.py``.

The thread fuzz found it on the twin (a program whose callers on device
workers handed reentrant backwards to the pool hung). Here the pool's own
functions run graph tasks with an engine whose ``_run_pool_task`` the test
controls, so that each thread is where the hang needs it, in turn: two idle pool
threads; a caller whose graph task completed while its pool thread is still
busy, waiting for that thread; the other pool thread woken for nothing (as
a condition may wake) and waiting again, after that caller; then a second
hand-off. Oracle: its graph task runs and the hand-off returns.

The compiled pool's hand-off is a cdef function, and its threads wait on
two C++ condition variables: twin only.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref

import pytest

import pyengine

pytestmark = pytest.mark.skipif(pyengine.IMPLEMENTATION != "pure",
                                reason="the compiled pool's functions are cdef")

TIMEOUT_S = 5.0


def until(condition, what):
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def condition_wait(thread, called_from):
    """The frame of the twin's ``Condition.wait`` that ``thread`` blocks in,
    called by a function named ``called_from``; None if it blocks elsewhere."""
    from pyengine._pure.condition import Condition

    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if (frame.f_code.co_name == "wait" and isinstance(frame.f_locals.get("self"), Condition)
                and frame.f_back is not None and frame.f_back.f_code.co_name == called_from):
            return frame
        frame = frame.f_back
    return None


def test_a_hand_off_wakes_an_idle_pool_thread_while_a_caller_waits_for_its_thread():
    from pyengine._pure import thread_pool as tp
    from pyengine._pure.graph_task import GraphTask
    from pyengine._pure.ready_queue import ReadyQueue

    pool = tp._ThreadPoolShared()
    names, ran = {}, []
    second_running, release_busy = threading.Event(), threading.Event()

    def run_graph_task(graph_task):
        name = names[id(graph_task)]
        ran.append(name)
        graph_task.mark_as_completed_and_run_post_processing()
        if name == "first":  # two pool threads: this one stays until the second runs
            assert second_running.wait(TIMEOUT_S)
        elif name == "second":
            second_running.set()
        elif name == "busy":  # completed, and its pool thread busy until the test ends
            release_busy.wait(60.0)

    class Engine:
        """What the pool calls back, held weakly as it holds an engine."""
        _run_pool_task = staticmethod(run_graph_task)

    engine = Engine()

    def hand_off(name):
        graph_task = GraphTask(False, False, 1, ReadyQueue())
        names[id(graph_task)] = name
        thread = threading.Thread(target=tp.add_thread_pool_task,
                                  args=(pool, graph_task, 8, weakref.ref(engine)), daemon=True)
        thread.start()
        return thread

    def idle_threads():
        return [t for t in list(pool.threads) if condition_wait(t, "_reentrant_thread_main")]

    try:
        first = hand_off("first")
        until(lambda: "first" in ran, "the first pool thread")
        second = hand_off("second")
        first.join(TIMEOUT_S)
        second.join(TIMEOUT_S)
        until(lambda: len(idle_threads()) == 2, "two idle pool threads")

        caller = hand_off("busy")
        until(lambda: condition_wait(caller, "add_thread_pool_task") is not None,
              "the caller waiting for its pool thread to come back")
        (idle,) = idle_threads()
        frame = condition_wait(idle, "_reentrant_thread_main")
        waiting_on, waiter = frame.f_locals["self"], frame.f_locals["waiter"]
        del frame
        with pool.condition:
            waiting_on.notify()  # the idle thread, woken for nothing

        def waits_again():
            frame = condition_wait(idle, "_reentrant_thread_main")
            return frame is not None and frame.f_locals["waiter"] is not waiter

        until(waits_again, "the idle thread waiting again")

        late = hand_off("late")
        late.join(TIMEOUT_S)
        assert "late" in ran and not late.is_alive(), (
            "a graph task handed off while an idle pool thread was left over never ran: "
            "the hand-off woke the caller waiting for its pool thread instead")
    finally:
        release_busy.set()
        for thread in tp.stop_thread_pool(pool):
            thread.join(TIMEOUT_S)
