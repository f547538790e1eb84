"""The twin's condition variable (``pyengine/_pure/condition.py``): what
``threading.Condition`` does, and no lock held, no waiter left behind and no
notification lost where Ctrl-C cuts a wait or a notify short (See Note [An
interrupt in the twin's condition variable]).

Oracles: ``threading.Condition``'s documented results (a timed-out wait
returns False, a notified one True, ``notify(n)`` wakes n waiters); and,
for every place of a wait and a notify where CPython can raise
KeyboardInterrupt (``tests/interrupt_sweep.py``), the lock free afterwards
and a notification given to the interrupted waiter reaching the other one.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time

import pytest
from conftest import run_on_core
from interrupt_sweep import SWEEP_PYTHON

from pyengine._pure.condition import Condition

TESTS = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 5.0


def waiting(condition, count):
    """Wait until ``count`` threads wait on ``condition``."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        with condition:
            if len(condition._waiters) >= count:
                return
        assert time.monotonic() < deadline, "the waiters never waited"
        time.sleep(0.001)


def test_a_wait_times_out_with_the_lock_held_again():
    condition = Condition()
    with condition:
        assert condition.wait(0.01) is False
        assert condition._lock._is_owned()
        assert condition._waiters == []


def test_notify_wakes_as_many_waiters_as_asked_and_notify_all_the_rest():
    condition = Condition()
    results = []

    def wait():
        with condition:
            results.append(condition.wait(TIMEOUT_S))

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for thread in threads:
        thread.start()
    waiting(condition, 3)
    with condition:
        condition.notify(2)
    deadline = time.monotonic() + TIMEOUT_S
    while len(results) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    with condition:
        assert results == [True, True] and len(condition._waiters) == 1
        condition.notify_all()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert results == [True, True, True]


def test_wait_and_notify_need_the_lock():
    condition = Condition()
    with pytest.raises(RuntimeError, match="un-acquired lock"):
        condition.wait(0.01)
    with pytest.raises(RuntimeError, match="un-acquired lock"):
        condition.notify()


def test_a_shared_lock_must_be_an_rlock():
    Condition(threading.RLock())
    with pytest.raises(TypeError, match="must be a threading.RLock, not lock"):
        Condition(threading.Lock())


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason=SWEEP_PYTHON)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the sweep forks a child per place")
def test_an_interrupt_at_each_place_of_a_wait_loses_no_notification():
    # The main thread and then another thread wait for one token; a third
    # gives it and notifies once, which wakes the main thread first.
    # Whatever place of the main thread's wait (or of its with blocks) the
    # interrupt comes out at, the lock ends free and the token is taken: by
    # the main thread, or, where the interrupt cut its wait short after the
    # notification came, by the other waiter, to which it must pass on.
    lines = run_on_core(textwrap.dedent(f'''
        import json, sys, threading, time
        sys.path.insert(0, {TESTS!r})
        import interrupt_sweep
        from pyengine._pure.condition import Condition

        run = {{}}

        def scenario():
            condition = Condition()
            tokens, given, stop, main_done, taken_in_time = [0], [False], [False], [False], [False]

            def take_a_token():
                with condition:
                    while not tokens[0] and not stop[0]:
                        condition.wait()
                    if tokens[0]:
                        tokens[0] -= 1

            def give_a_token():
                # Once both wait (or the main thread gave up), one token and
                # one notification; once it is taken (or after a while:
                # then a notification was lost), every waiter goes.
                deadline = time.monotonic() + {TIMEOUT_S}
                while time.monotonic() < deadline:
                    with condition:
                        if len(condition._waiters) == 2 or (main_done[0] and condition._waiters):
                            tokens[0] += 1
                            given[0] = True
                            condition.notify()
                            break
                    time.sleep(0.0002)
                while tokens[0] and time.monotonic() < deadline:
                    time.sleep(0.0002)
                taken_in_time[0] = not tokens[0]
                with condition:
                    stop[0] = True
                    condition.notify_all()

            def take_a_token_after_the_main_thread():
                # Second in the list: the notification goes to the main thread.
                deadline = time.monotonic() + {TIMEOUT_S}
                while time.monotonic() < deadline:
                    with condition:
                        if condition._waiters or main_done[0]:
                            break
                    time.sleep(0.0002)
                take_a_token()

            other = threading.Thread(target=take_a_token_after_the_main_thread)
            giver = threading.Thread(target=give_a_token)
            run.update(condition=condition, given=given, taken_in_time=taken_in_time, other=other,
                       giver=giver)
            try:
                other.start()
                giver.start()
                take_a_token()
            finally:
                main_done[0] = True

        def check():
            problems = []
            if "condition" not in run:
                return problems  # interrupted before the scenario made anything
            condition = run["condition"]
            if condition._lock._is_owned():
                problems.append("the lock left held by the main thread")
            for thread in (run["giver"], run["other"]):
                if thread.ident is not None:
                    thread.join({2 * TIMEOUT_S})
                    if thread.is_alive():
                        problems.append(f"{{thread.name}} never ended")
            if run["given"][0] and not run["taken_in_time"][0]:
                problems.append("the token not taken until every waiter was woken: a "
                                "notification was lost")
            if not condition._lock.acquire(False):
                problems.append("the lock left held")
            else:
                condition._lock.release()
            if condition._waiters:
                problems.append(f"waiters left in the list: {{condition._waiters}}")
            return problems

        places, failures = interrupt_sweep.sweep(scenario, check)
        print(json.dumps({{"places": places, "failures": failures}}))
    '''), pure=True, timeout=300)
    report = json.loads(lines[-1])
    assert report["places"] >= 12, report["places"]
    assert not report["failures"], report["failures"][:10]
