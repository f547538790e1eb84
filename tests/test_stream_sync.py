"""Which stream waits on which, where a gradient crosses devices or streams,
and the fake device's streams themselves (See Note [Streaming backwards]).

Every graph runs with delayed fake streams, where work not yet run leaves
NaN in its result: a missing sync is a NaN gradient, every time, not a race.
Oracles: the exact gradient, a product (or sum of products) of the factors;
for the fake device, the order a GPU stream runs its work in.
"""

from __future__ import annotations

import threading

import numpy as np

from pyengine import fake_device as fd
from pyengine import streams

F0, F1 = fd.device(0), fd.device(1)


def host(value):
    return value.numpy() if isinstance(value, fd.FakeArray) else value


# -- the fake device's streams behave as a GPU's ------------------------------------------

def blocking_work(started, release, done):
    def work(out):
        started.set()
        assert release.wait(10), "the test never released the work"
        out.fill(7.0)
        done.append("first")
    return work


def test_an_event_wait_returns_only_after_the_work_before_it_finished():
    a, b = fd.FakeStream(F0, "a"), fd.FakeStream(F0, "b")
    started, release, done = threading.Event(), threading.Event(), []
    with fd.set_delayed(True):
        with streams.stream_guard(a):
            y = fd.launch(F0, (3,), np.float64, blocking_work(started, release, done))
        drainer = threading.Thread(target=a.synchronize)
        drainer.start()
        assert started.wait(10)  # the drainer runs y's work, which blocks
        event = fd.RUNTIME.record_event(a)
        seen = []

        def wait_and_read():
            fd.RUNTIME.wait_event(b, event)
            with streams.stream_guard(b):
                seen.append(y.numpy())

        waiter = threading.Thread(target=wait_and_read)
        waiter.start()
        waiter.join(0.3)
        returned_early = not waiter.is_alive()
        release.set()
        waiter.join(10)
        drainer.join(10)
    assert not returned_early, "the event wait returned before the work before it finished"
    np.testing.assert_array_equal(seen[0], [7.0] * 3)


def test_work_of_one_stream_runs_in_order_and_one_item_at_a_time():
    a = fd.FakeStream(F0, "a")
    started, release, done = threading.Event(), threading.Event(), []
    with fd.set_delayed(True):
        with streams.stream_guard(a):
            first = fd.launch(F0, (3,), np.float64, blocking_work(started, release, done))
            second = fd.launch(F0, (3,), np.float64,
                               lambda out: (done.append("second"), np.copyto(out, first._buffer + 1)))
        one = threading.Thread(target=a.synchronize)
        one.start()
        assert started.wait(10)
        other = threading.Thread(target=a.synchronize)
        other.start()
        other.join(0.3)  # a second drainer must not start the next item meanwhile
        release.set()
        one.join(10)
        other.join(10)
    assert done == ["first", "second"]
    np.testing.assert_array_equal(host(second), [8.0] * 3)


def test_eager_launches_from_two_threads_keep_each_stream_in_order():
    # Eager mode: the launching thread runs the work; a thread that launches
    # while another's item of the same stream runs waits for it.
    a = fd.FakeStream(F0, "a")
    started, release, done = threading.Event(), threading.Event(), []

    def launch_on_a(work):
        with streams.stream_guard(a):
            fd.launch(F0, (3,), np.float64, work)

    first_thread = threading.Thread(target=launch_on_a,
                                    args=(blocking_work(started, release, done),))
    first_thread.start()
    assert started.wait(10)
    second_thread = threading.Thread(target=launch_on_a, args=(lambda out: done.append("second"),))
    second_thread.start()
    second_thread.join(0.3)
    release.set()
    first_thread.join(10)
    second_thread.join(10)
    assert done == ["first", "second"]
