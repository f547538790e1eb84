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
import pytest
from plain_tensors import Leaf

import pyengine
from pyengine import fake_device as fd
from pyengine import streams
from pyengine.device import CPU

F0, F1 = fd.device(0), fd.device(1)


class Move(pyengine.Node):
    """Backward of moving x from ``to`` onto ``here`` after scaling it by
    ``factor``: scales the gradient there, then moves it onto ``to`` (the
    CPU through a host read, a fake device with to_fake, which launches the
    copy on the destination's current stream, as cupy.asarray would)."""

    def __init__(self, edge, here, to, factor):
        super().__init__([edge], [pyengine.InputMetadata((3,), np.float64, here)])
        self.to, self.factor = to, factor

    def apply(self, grads):
        g = grads[0] * self.factor
        if self.to == CPU:
            return [g.numpy()]
        return [g if g.device == self.to else fd.to_fake(g, self.to)]


def execute(roots, grads):
    pyengine.get_default_engine().execute(
        [pyengine.Edge(root, 0) for root in roots], grads, False, False, True)


def host(value):
    return value.numpy() if isinstance(value, fd.FakeArray) else value


# -- a gradient that crosses devices: InputBuffer::add's five cases ---------------------

@pytest.mark.parametrize("producer_device", [CPU, F0], ids=["cpu-producer", "fake0-producer"])
def test_a_gradient_moved_onto_the_consumer_device_is_waited_for_there(producer_device):
    # Case (3): the gradient is on the consumer's device, not the producer's.
    # The producer moved it there on its current stream of that device (the
    # default one), so the consumer's side stream waits on that stream, not
    # on the producer's stream on another device (or on none, for the CPU).
    x = Leaf(np.ones(3))
    side = fd.FakeStream(F1, "side")
    with streams.stream_guard(side):
        consumer = Move(pyengine.gradient_edge(x), F1, CPU, 3.0)
    producer = Move(pyengine.Edge(consumer, 0), producer_device, F1, 2.0)
    grad = np.ones(3) if producer_device == CPU else fd.to_fake(np.ones(3), producer_device)
    with fd.set_delayed(True):
        execute([producer], [grad])
    np.testing.assert_array_equal(x.grad, [6.0] * 3)


def test_a_fan_out_from_the_cpu_onto_side_streams_of_many_devices():
    # Case (3) on each device: audit5/many_devices.py, without its errors.
    devices = [fd.device(i) for i in range(4)]
    x = Leaf(np.ones(3))
    accumulator = pyengine.grad_accumulator(x)
    edges = []
    for i, device in enumerate(devices):
        with streams.stream_guard(fd.FakeStream(device, f"s{i}")):
            edges.append(pyengine.Edge(Move(pyengine.Edge(accumulator, 0), device, CPU,
                                            float(i + 1)), 0))

    class Fan(pyengine.Node):
        def apply(self, grads):
            return [fd.to_fake(grads[0], device) for device in devices]

    fan = Fan(edges, [pyengine.InputMetadata((3,), np.float64)])
    with fd.set_delayed(True):
        for _ in range(5):
            x.grad = None
            execute([fan], [np.ones(3)])
            np.testing.assert_array_equal(x.grad, [10.0] * 3)


def test_a_gradient_left_on_the_producer_device_is_synced_onto_its_default_stream():
    # Case (4): the gradient stays on the producer's device (fake:0, written on
    # side stream a); its consumer has no stream there, so it reads it on the
    # current (default) stream of fake:0. That stream waits on a.
    x = Leaf(np.ones(3))
    a = fd.FakeStream(F0, "a")

    class HostRead(pyengine.Node):
        def apply(self, grads):
            return [grads[0].numpy() * 3.0]

    consumer = HostRead([pyengine.gradient_edge(x)], [None])
    assert consumer.stream is None
    with streams.stream_guard(a):
        producer = Move(pyengine.Edge(consumer, 0), F0, F0, 2.0)
    with fd.set_delayed(True):
        execute([producer], [fd.to_fake(np.ones(3), F0)])
    np.testing.assert_array_equal(x.grad, [6.0] * 3)
    waits = [(entry[1], entry[2].stream) for entry in fd.RUNTIME.log if entry[0] == "wait"]
    assert (fd.RUNTIME.default_stream(F0), a) in waits


def test_a_host_gradient_needs_no_stream_sync():
    # Case (1): a numpy gradient, read back to the host by its producer (which
    # synchronized its stream), flows into the CPU slot of a consumer that has
    # a stream on fake:1 (its other slot's device): nothing waits for it.
    x = Leaf(np.ones(3))
    a, b = fd.FakeStream(F0, "a"), fd.FakeStream(F1, "b")

    class FromCpuSlot(pyengine.Node):
        def apply(self, grads):
            assert grads[0] is None
            return [grads[1] * 3.0]

    with streams.stream_guard(b):
        consumer = FromCpuSlot([pyengine.gradient_edge(x)],
                               [pyengine.InputMetadata((3,), np.float64, F1),
                                pyengine.InputMetadata((3,), np.float64)])

    class ToHost(pyengine.Node):
        def apply(self, grads):
            return [(grads[0] * 2.0).numpy()]

    with streams.stream_guard(a):
        producer = ToHost([pyengine.Edge(consumer, 1)], [pyengine.InputMetadata((3,), np.float64, F0)])
    assert producer.stream is a and consumer.stream is b
    fd.RUNTIME.log.clear()
    with fd.set_delayed(True):
        execute([producer], [fd.to_fake(np.ones(3), F0)])
    np.testing.assert_array_equal(x.grad, [6.0] * 3)
    waits = [(entry[1], entry[2].stream) for entry in fd.RUNTIME.log if entry[0] == "wait"]
    assert (b, a) not in waits


# -- roots on several devices -------------------------------------------------------------

def test_every_root_gradient_is_waited_for_on_its_own_device():
    # The root gradients were written on the caller's current streams of two
    # devices (a side stream c on fake:1); each root node waits on the stream
    # of its own root gradient, not only the first root's.
    x = Leaf(fd.to_fake(np.ones(3), F0))
    accumulator = pyengine.grad_accumulator(x)
    n0 = Move(pyengine.Edge(accumulator, 0), F0, F0, 2.0)
    with streams.stream_guard(fd.FakeStream(F1, "side")):
        n1 = Move(pyengine.Edge(accumulator, 0), F1, F0, 3.0)
    c = fd.FakeStream(F1, "c")
    with fd.set_delayed(True):
        g0 = fd.to_fake(np.ones(3), F0)
        with streams.stream_guard(c):
            g1 = fd.to_fake(np.ones(3), F1)
            execute([n0, n1], [g0, g1])
        np.testing.assert_array_equal(x.grad.numpy(), [5.0] * 3)


def test_each_root_stream_is_waited_for_when_a_pool_thread_runs_the_graph_root():
    # A reentrant backward past the inline depth runs on a pool thread, whose
    # current stream of fake:1 is the default one, not the caller's c: only
    # the stream each root gradient was recorded with says where it was written.
    engine = pyengine.Engine(max_recursion_depth=0)
    x = Leaf(fd.to_fake(np.ones(3), F0))
    accumulator = pyengine.grad_accumulator(x)
    n0 = Move(pyengine.Edge(accumulator, 0), F0, F0, 2.0)
    with streams.stream_guard(fd.FakeStream(F1, "side")):
        n1 = Move(pyengine.Edge(accumulator, 0), F1, F0, 3.0)
    c = fd.FakeStream(F1, "c")

    class Outer(pyengine.Node):
        def apply(self, grads):
            g0 = fd.to_fake(np.ones(3), F0)
            with streams.stream_guard(c):
                g1 = fd.to_fake(np.ones(3), F1)
                engine.execute([pyengine.Edge(n0, 0), pyengine.Edge(n1, 0)], [g0, g1],
                               False, False, True)
            return [None]

    outer = Outer([None], [pyengine.InputMetadata((3,), np.float64)])
    try:
        with fd.set_delayed(True):
            engine.execute([pyengine.Edge(outer, 0)], [np.ones(3)], False, False, True)
            np.testing.assert_array_equal(x.grad.numpy(), [5.0] * 3)
    finally:
        engine.stop()


def test_roots_on_the_cpu_and_a_device_side_stream():
    x = Leaf(np.ones(3))
    accumulator = pyengine.grad_accumulator(x)

    class Scale(pyengine.Node):
        def apply(self, grads):
            return [grads[0] * 4.0]

    n_cpu = Scale([pyengine.Edge(accumulator, 0)], [pyengine.InputMetadata((3,), np.float64)])
    with streams.stream_guard(fd.FakeStream(F1, "side")):
        n1 = Move(pyengine.Edge(accumulator, 0), F1, CPU, 3.0)
    with fd.set_delayed(True):
        execute([n_cpu, n1], [np.ones(3), fd.to_fake(np.ones(3), F1)])
    np.testing.assert_array_equal(x.grad, [7.0] * 3)


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
