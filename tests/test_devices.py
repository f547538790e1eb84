"""Devices on the CPU: fake devices own worker threads and streams exactly as
a GPU would, so routing, cross-device graphs, stream synchronization,
errors on device threads, shutdown and fork are tested without a GPU.

Oracles: each graph is a chain or diamond of scalings, so the exact gradient
is the product (or sum of products) of the factors; the thread that ran each
node is the device's worker or the caller; a planted missing sync must turn
the result into NaN.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest
from conftest import run_on_this_core

import pyengine
from pyengine import fake_device as fd
from pyengine import streams
from pyengine.backends import NumpyBackend
from pyengine.device import CPU

F0, F1 = fd.device(0), fd.device(1)


class Leaf:
    def __init__(self, data):
        self.data = data
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


def on(value, device):
    """``value`` (numpy or fake) as a value on ``device``."""
    current = getattr(value, "device", CPU)
    if current == device:
        return value
    host = value.numpy() if isinstance(value, fd.FakeArray) else np.asarray(value)
    return host if device == CPU else fd.to_fake(host, device)


class Scale(pyengine.Node):
    """Backward of ``y = factor * x`` where x lives on ``input_device`` and y
    on the device of this node's input slot; logs the thread it ran on and
    the stream that was current on its device."""

    log: list = []

    def __init__(self, edge, device, factor, input_device, shape=(3,)):
        super().__init__([edge], [pyengine.InputMetadata(shape, np.float64, device)])
        self.factor = factor
        self.device = device
        self.input_device = input_device

    def apply(self, grads):
        current = (fd.RUNTIME.current_stream(self.device) if self.device != CPU else None)
        Scale.log.append((self.factor, threading.current_thread().name, current))
        return [on(grads[0] * self.factor, self.input_device)]


def host(value):
    return value.numpy() if isinstance(value, fd.FakeArray) else value


@pytest.fixture(autouse=True)
def clear_log():
    Scale.log = []
    fd.RUNTIME.log.clear()
    yield


def cross_device_chain(leaf_device=CPU):
    """leaf (on leaf_device) <- cpu node <- fake:0 node <- fake:1 node <- root."""
    x = Leaf(on(np.ones(3), leaf_device))
    n_cpu = Scale(pyengine.gradient_edge(x), CPU, 2.0, leaf_device)
    n0 = Scale(pyengine.Edge(n_cpu, 0), F0, 3.0, CPU)
    n1 = Scale(pyengine.Edge(n0, 0), F1, 5.0, F0)
    return x, n1


def run(root, grad, **kwargs):
    pyengine.get_default_engine().execute([pyengine.Edge(root, 0)], [grad], False, False, True)


@pytest.mark.parametrize("delayed", [False, True])
def test_cross_device_chain_is_exact_and_each_node_runs_on_its_device_thread(delayed):
    x, root = cross_device_chain()
    with fd.set_delayed(delayed):
        run(root, on(np.ones(3), F1))
    np.testing.assert_array_equal(host(x.grad), [30.0, 30.0, 30.0])
    threads = {factor: thread for factor, thread, _ in Scale.log}
    assert threads == {5.0: "pyengine-fake:1", 3.0: "pyengine-fake:0",
                       2.0: threading.current_thread().name}


class NoGradient(pyengine.Node):
    """Returns None for each next edge; logs the thread it ran on."""

    log: list = []

    def apply(self, grads):
        NoGradient.log.append((self, threading.current_thread().name))
        return [None] * len(self.next_edges)


@pytest.mark.parametrize("how", ["setter", "add_input_metadata"])
def test_a_node_whose_metadata_moves_to_a_device_after_creation_runs_there(how):
    # A node whose only gradient is None runs where its input metadata says
    # (node_device): the routing reads a flag kept with that metadata, which
    # must follow each way the metadata can be set after the node was made.
    # A gradient on a device would route the node there by itself.
    NoGradient.log = []
    x = Leaf(np.ones(3))
    middle = NoGradient([pyengine.gradient_edge(x)], [((3,), np.float64)])
    moved = pyengine.InputMetadata((3,), np.float64, F0)
    if how == "setter":
        middle._input_metadata = (moved,)
    else:
        middle._input_metadata = ()
        assert middle.add_input_metadata(moved) == 0
    root = NoGradient([pyengine.Edge(middle, 0)], [pyengine.InputMetadata((3,), np.float64, F1)])
    run(root, on(np.ones(3), F1))
    assert x.grad is None
    assert NoGradient.log == [(root, "pyengine-fake:1"), (middle, "pyengine-fake:0")]


def test_cpu_nodes_run_on_the_calling_thread_even_from_another_thread():
    results = {}

    def caller():
        x, root = cross_device_chain()
        run(root, on(np.ones(3), F1))
        results["grad"] = host(x.grad)

    thread = threading.Thread(target=caller, name="a-caller")
    thread.start()
    thread.join(30)
    np.testing.assert_array_equal(results["grad"], [30.0] * 3)
    assert {thread for factor, thread, _ in Scale.log if factor == 2.0} == {"a-caller"}


def test_leaf_on_a_device_accumulates_there():
    x, root = cross_device_chain(leaf_device=F0)
    with fd.set_delayed(True):
        run(root, on(np.ones(3), F1))
    assert isinstance(x.grad, fd.FakeArray) and x.grad.device == F0
    np.testing.assert_array_equal(x.grad.numpy(), [30.0] * 3)


def test_multithreading_disabled_runs_everything_on_the_caller():
    x, root = cross_device_chain()
    with pyengine.set_multithreading_enabled(False):
        assert not pyengine.is_multithreading_enabled()
        run(root, on(np.ones(3), F1))
    assert pyengine.is_multithreading_enabled()
    np.testing.assert_array_equal(host(x.grad), [30.0] * 3)
    assert {thread for _, thread, _ in Scale.log} == {threading.current_thread().name}


def test_diamond_across_devices_sums_both_branches():
    # root (fake:0) fans out to a fake:0 branch and a fake:1 branch that join
    # at a CPU node before the leaf: 2 * (3 + 7) * 11 = 220.
    x = Leaf(np.ones(3))
    join = Scale(pyengine.gradient_edge(x), CPU, 11.0, CPU)
    left = Scale(pyengine.Edge(join, 0), F0, 3.0, CPU)
    right = Scale(pyengine.Edge(join, 0), F1, 7.0, CPU)

    class Fork(pyengine.Node):
        def apply(self, grads):
            return [grads[0] * 2.0, on(grads[0] * 2.0, F1)]

    fork = Fork([pyengine.Edge(left, 0), pyengine.Edge(right, 0)],
                [pyengine.InputMetadata((3,), np.float64, F0)])
    with fd.set_delayed(True):
        run(fork, on(np.ones(3), F0))
    np.testing.assert_array_equal(x.grad, [220.0] * 3)


class SlowAddArray(np.ndarray):
    """A numpy array whose sums sleep, so the thread adding it into an
    InputBuffer holds its graph task's lock without the GIL meanwhile."""


class SlowAddBackend(NumpyBackend):
    name = "slow-add-numpy"

    def add(self, a, b):
        time.sleep(0.0002)
        return super().add(a, b)

    def add_(self, a, b):
        time.sleep(0.0002)
        return super().add_(a, b)


class Emit(pyengine.Node):
    """On ``device``: passes ``factor`` times its gradient to a CPU slot, as a SlowAddArray."""

    def __init__(self, edge, device, factor):
        super().__init__([edge], [pyengine.InputMetadata((3,), np.float64, device)])
        self.factor = factor

    def apply(self, grads):
        return [(host(grads[0]) * self.factor).view(SlowAddArray)]


def test_device_threads_waiting_for_the_graph_task_lock_lose_no_gradient():
    # Sixteen producers on two device threads feed one CPU node. Each sum
    # into its buffer sleeps under the graph task's lock without the GIL,
    # so the other device thread, routing its own producer's gradient,
    # finds the lock held and waits for it (See Note [A lock the GIL
    # guards] in pyengine/_gil_guarded_lock.h). Oracle: the sum of the
    # factors, exactly, every time (a sum made without the lock loses
    # adds); and every backward returns (a wake-up lost leaves a device
    # thread waiting for ever).
    factors = [float(i + 1) for i in range(16)]
    devices = [(F0, F1)[i % 2] for i in range(len(factors))]

    class Fork(pyengine.Node):
        def apply(self, grads):
            return [on(host(grads[0]), device) for device in devices]

    leaves = []

    def backward_calls():
        for _ in range(10):
            x = Leaf(np.zeros(3))
            join = Scale(pyengine.gradient_edge(x), CPU, 1.0, CPU)
            producers = [Emit(pyengine.Edge(join, 0), device, factor)
                         for device, factor in zip(devices, factors)]
            fork = Fork([pyengine.Edge(producer, 0) for producer in producers],
                        [pyengine.InputMetadata((3,), np.float64, F0)])
            run(fork, on(np.ones(3), F0))
            leaves.append(x)

    previous = pyengine.register_backend(SlowAddArray, SlowAddBackend())
    try:
        caller = threading.Thread(target=backward_calls, daemon=True)
        caller.start()
        caller.join(timeout=60)
        assert not caller.is_alive(), "a backward waits for ever: a wake-up was lost"
    finally:
        pyengine.unregister_backend(SlowAddArray)
        if previous is not None:
            pyengine.register_backend(SlowAddArray, previous)
    assert len(leaves) == 10, "a backward raised (its error is in the thread's output)"
    for x in leaves:
        np.testing.assert_array_equal(np.asarray(x.grad), [sum(factors)] * 3)


# -- streams ---------------------------------------------------------------------------

def two_stream_chain():
    """leaf (fake:0, made on the default stream) <- consumer (stream b) <-
    producer (stream a) <- root: every hop changes streams."""
    x = Leaf(on(np.ones(3), F0))
    accumulator = pyengine.grad_accumulator(x)
    a, b = fd.FakeStream(F0, "a"), fd.FakeStream(F0, "b")
    with streams.stream_guard(b):
        consumer = Scale(pyengine.Edge(accumulator, 0), F0, 3.0, F0)
    with streams.stream_guard(a):
        producer = Scale(pyengine.Edge(consumer, 0), F0, 5.0, F0)
    return x, producer, consumer, accumulator, a, b


def test_nodes_record_and_run_on_their_creation_stream():
    x, producer, consumer, accumulator, a, b = two_stream_chain()
    assert producer.stream is a and consumer.stream is b
    assert accumulator.stream is fd.RUNTIME.default_stream(F0)
    with fd.set_delayed(True):
        run(producer, on(np.ones(3), F0))
    assert [stream for _, _, stream in Scale.log] == [a, b]
    np.testing.assert_array_equal(x.grad.numpy(), [15.0] * 3)


def test_a_graph_root_whose_init_never_ran_passes_its_gradient_on_a_stream():
    # A GraphRoot made by __new__ and initialized as a plain node has no root
    # streams: its gradient into a node with a stream takes the streamed path,
    # which reads the root's streams in C. They must be a tuple (empty: the
    # producer's stream stands in), never None.
    x = Leaf(on(np.ones(3), F0))
    consumer_stream = fd.FakeStream(F0, "b")
    with streams.stream_guard(consumer_stream):
        consumer = Scale(pyengine.gradient_edge(x), F0, 3.0, F0)
    root = pyengine.GraphRoot.__new__(pyengine.GraphRoot)
    super(pyengine.GraphRoot, root).__init__(next_edges=[pyengine.Edge(consumer, 0)])
    assert root._root_streams == () and root.outputs is None
    root.outputs = [on(np.full(3, 2.0), F0)]
    run(root, None)
    np.testing.assert_array_equal(x.grad.numpy(), [6.0] * 3)
    assert [stream for _, _, stream in Scale.log] == [consumer_stream]


def test_consumer_stream_waits_on_an_event_of_the_producer_stream():
    x, producer, consumer, accumulator, a, b = two_stream_chain()
    with fd.set_delayed(True):
        run(producer, on(np.ones(3), F0))
    waits = [(entry[1], entry[2].stream) for entry in fd.RUNTIME.log if entry[0] == "wait"]
    assert (b, a) in waits  # consumer's stream waited on the producer's
    assert (fd.RUNTIME.default_stream(F0), b) in waits  # the leaf's on the consumer's


def test_a_missing_sync_gives_a_wrong_result(monkeypatch):
    # The oracle that the sync above is needed: without it, the consumer reads
    # the producer's gradient before it is written.
    monkeypatch.setattr(streams, "sync_streams", lambda consumer, producer: None)
    x, producer, consumer, accumulator, a, b = two_stream_chain()
    with fd.set_delayed(True):
        run(producer, on(np.ones(3), F0))
    assert np.isnan(x.grad.numpy()).all()


def test_caller_stream_waits_on_the_leaf_stream_before_backward_returns():
    # The leaf accumulates on stream c; the caller reads .grad on its current
    # stream (the default one) right after backward, without a manual sync.
    x = Leaf(on(np.ones(3), F0))
    c = fd.FakeStream(F0, "c")
    with streams.stream_guard(c):
        accumulator = pyengine.grad_accumulator(x)
        node = Scale(pyengine.Edge(accumulator, 0), F0, 3.0, F0)
    with fd.set_delayed(True):
        run(node, on(np.ones(3), F0))
        np.testing.assert_array_equal(x.grad.numpy(), [3.0] * 3)
    waits = [(entry[1], entry[2].stream) for entry in fd.RUNTIME.log if entry[0] == "wait"]
    assert (fd.RUNTIME.default_stream(F0), c) in waits


def test_without_the_leaf_stream_sync_the_caller_reads_garbage(monkeypatch):
    from pyengine._shared import node_streams

    monkeypatch.setattr(node_streams, "sync_leaf_streams", lambda graph_task: None)
    x = Leaf(on(np.ones(3), F0))
    c = fd.FakeStream(F0, "c")
    with streams.stream_guard(c):
        accumulator = pyengine.grad_accumulator(x)
        node = Scale(pyengine.Edge(accumulator, 0), F0, 3.0, F0)
    with fd.set_delayed(True):
        run(node, on(np.ones(3), F0))
        assert np.isnan(x.grad.numpy()).all()


# -- errors, validation, reentrancy -------------------------------------------------------

class Boom(pyengine.Node):
    def apply(self, grads):
        raise KeyError("boom on " + threading.current_thread().name)


def test_error_on_a_device_thread_reaches_the_caller_with_its_type():
    x = Leaf(np.ones(3))
    boom = Boom([pyengine.gradient_edge(x)], [pyengine.InputMetadata((3,), np.float64, F0)])
    with pytest.raises(KeyError, match="boom on pyengine-fake:0"):
        run(boom, on(np.ones(3), F0))
    assert x.grad is None
    x2, root = cross_device_chain()
    run(root, on(np.ones(3), F1))
    np.testing.assert_array_equal(host(x2.grad), [30.0] * 3)


def test_gradient_on_the_wrong_device_is_refused_with_node_and_index():
    x = Leaf(on(np.ones(3), F0))

    class WrongDevice(pyengine.Node):
        def apply(self, grads):
            return [np.ones(3)]

    node = WrongDevice([pyengine.gradient_edge(x)], [((3,), np.float64, F0)])
    with pytest.raises(RuntimeError, match=r"Function WrongDevice returned an invalid gradient at "
                                           r"index 0 - expected device fake:0 but got cpu"):
        run(node, on(np.ones(3), F0))


def test_zero_dim_gradients_are_moved_to_the_slot_device():
    x = Leaf(on(np.ones(()), F0))

    class HostScalar(pyengine.Node):
        def apply(self, grads):
            return [np.array(4.0)]

    node = HostScalar([pyengine.gradient_edge(x)], [(( ), np.float64, F0)])
    run(node, on(np.ones(()), F0))
    assert x.grad.device == F0 and x.grad.numpy() == 4.0


def test_a_gradient_reduced_to_zero_dim_is_moved_to_the_slot_device():
    # PyTorch's validate_outputs reduces a broadcast gradient first and then
    # asks grad.dim() of the reduced one: a (3,) host gradient for a 0-dim
    # slot on fake:0 is summed to 0-dim and moved, not refused.
    x = Leaf(on(np.ones(()), F0))

    class HostVector(pyengine.Node):
        def apply(self, grads):
            return [np.array([1.0, 2.0, 4.0])]

    node = HostVector([pyengine.gradient_edge(x)], [((), np.float64, F0)])
    run(node, on(np.ones(()), F0))
    assert x.grad.device == F0 and x.grad.numpy() == 7.0
    # The rule looks at the reduced dim: a (2, 3) gradient for a (3,) slot
    # on another device is still refused.
    y = Leaf(on(np.ones(3), F0))

    class HostMatrix(pyengine.Node):
        def apply(self, grads):
            return [np.ones((2, 3))]

    node = HostMatrix([pyengine.gradient_edge(y)], [((3,), np.float64, F0)])
    with pytest.raises(RuntimeError, match=r"Function HostMatrix returned an invalid gradient at "
                                           r"index 0 - expected device fake:0 but got cpu"):
        run(node, on(np.ones(3), F0))


@pytest.mark.parametrize("levels", [3, 100])
def test_reentrant_backward_from_a_device_thread(levels):
    x = Leaf(np.ones(()))

    class Reenter(pyengine.Node):
        def __init__(self, depth):
            super().__init__([pyengine.gradient_edge(x)], [((), np.float64, F0)])
            self.depth = depth

        def apply(self, grads):
            if self.depth > 0:
                run(Reenter(self.depth - 1), on(np.ones(()), F0))
            return [host(grads[0])]

    run(Reenter(levels), on(np.ones(()), F0))
    assert x.grad == levels + 1


def test_no_thread_leaks_over_a_thousand_backward_calls():
    x, root = cross_device_chain()
    run(root, on(np.ones(3), F1))  # starts the device workers
    baseline = set(threading.enumerate())
    for _ in range(1000):
        x, root = cross_device_chain()
        run(root, on(np.ones(3), F1))
    # Compared as sets: an earlier test's engine may end its threads meanwhile.
    assert not set(threading.enumerate()) - baseline
    np.testing.assert_array_equal(host(x.grad), [30.0] * 3)


# -- shutdown and fork, in subprocesses ----------------------------------------------------

PRELUDE = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    sys.path.insert(0, {tests!r})
    import pyengine
    from pyengine import fake_device as fd
    from test_devices import Leaf, Scale, cross_device_chain, host, on, run, F0, F1
    expected = {implementation!r}
    assert pyengine.IMPLEMENTATION == expected, pyengine.IMPLEMENTATION
""")


def run_script(body, timeout=60):
    script = PRELUDE.format(tests=os.path.dirname(__file__),
                            implementation=pyengine.IMPLEMENTATION) + textwrap.dedent(body)
    # Not from the repository root: there, "-c" would import the source tree
    # (without the compiled modules) instead of the installed package.
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(entry)
                                            for entry in env["PYTHONPATH"].split(os.pathsep))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout, cwd=os.path.dirname(__file__), env=env)


def test_exit_while_a_device_worker_is_busy_does_not_hang():
    result = run_script("""
        class Slow(pyengine.Node):
            def apply(self, grads):
                time.sleep(0.5)
                return [host(grads[0])]
        x = Leaf(np.ones(3))
        node = Slow([pyengine.gradient_edge(x)], [pyengine.InputMetadata((3,), np.float64, F0)])
        errors = []
        def backward():
            try:
                run(node, on(np.ones(3), F0))
            except RuntimeError as error:
                errors.append(error)
        threading.Thread(target=backward, daemon=True).start()
        time.sleep(0.1)
        print("exiting")
    """)
    assert result.returncode == 0, result.stderr
    assert "exiting" in result.stdout


def test_a_backward_waiting_on_stopped_device_threads_gets_an_error():
    result = run_script("""
        class Slow(pyengine.Node):
            def apply(self, grads):
                time.sleep(0.5)
                return [host(grads[0])]
        x = Leaf(np.ones(3))
        node = Slow([pyengine.gradient_edge(x)], [pyengine.InputMetadata((3,), np.float64, F0)])
        errors = []
        def backward():
            try:
                run(node, on(np.ones(3), F0))
            except RuntimeError as error:
                errors.append(str(error))
        thread = threading.Thread(target=backward)
        thread.start()
        time.sleep(0.1)
        pyengine.get_default_engine().stop()
        thread.join(10)
        print("alive" if thread.is_alive() else "joined", errors)
    """)
    assert result.returncode == 0, result.stderr
    assert "joined" in result.stdout and "device threads stopped" in result.stdout


def test_a_device_backward_on_an_engine_a_user_stopped_names_engine_stop():
    # The message named only interpreter shutdown, where a user's stop() had
    # stopped the threads (they never start again).
    engine = pyengine.Engine()
    engine.stop()
    x = Leaf(np.ones(3))
    node = Scale(pyengine.gradient_edge(x), F0, 2.0, CPU)
    with pytest.raises(RuntimeError, match=re.escape(
            "cannot run a task on fake:0: the engine's device threads have stopped "
            "(Engine.stop(), which runs at interpreter exit)")):
        engine.execute([pyengine.Edge(node, 0)], [on(np.ones(3), F0)], False, False, True)
    assert x.grad is None


@pytest.mark.parametrize("max_recursion_depth", [0, 60])
def test_stop_ends_a_device_worker_whose_reentrant_backward_is_running(max_recursion_depth):
    # A device node runs a reentrant backward (on a pool thread with
    # max_recursion_depth 0, else inline on the device worker) when stop()
    # pushes the worker's shutdown task: the nested loop popped it and ended
    # without finishing its graph task, and the worker, waiting for that
    # task, stayed alive forever. See Note [A shutdown task is the device
    # worker's].
    result = run_script(f"""
        pyengine.get_default_engine().max_recursion_depth = {max_recursion_depth}
        entered, release = threading.Event(), threading.Event()
        y = Leaf(np.ones(3))
        class Held(pyengine.Node):
            def apply(self, grads):
                entered.set()
                release.wait(10)
                return [2.0 * grads[0]]
        class Reenter(pyengine.Node):
            def apply(self, grads):
                held = Held([pyengine.gradient_edge(y)], [pyengine.InputMetadata((3,), np.float64)])
                run(held, np.ones(3))
                return [host(grads[0])]
        x = Leaf(np.ones(3))
        node = Reenter([pyengine.gradient_edge(x)], [pyengine.InputMetadata((3,), np.float64, F1)])
        errors = []
        def backward():
            try:
                run(node, on(np.ones(3), F1))
            except RuntimeError as error:
                errors.append(str(error))
        thread = threading.Thread(target=backward)
        thread.start()
        entered.wait(10)
        pyengine.get_default_engine().stop(timeout=0.1)
        release.set()
        thread.join(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                t.name.startswith("pyengine-") for t in threading.enumerate()):
            time.sleep(0.01)
        print("backward", "alive" if thread.is_alive() else "joined", errors)
        print("child grad", y.grad if y.grad is None else y.grad.tolist(), "outer grad", x.grad)
        print("threads left", [t.name for t in threading.enumerate() if t.name.startswith("pyengine-")])
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("backward joined") and "device threads stopped" in lines[0]
    # The nested backward ran to the end; the outer one was stopped.
    assert lines[1:] == ["child grad [2.0, 2.0, 2.0] outer grad None", "threads left []"]


def test_fork_after_device_backward_gives_the_child_a_fresh_engine():
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    result = run_script("""
        import warnings
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        x, root = cross_device_chain()
        run(root, on(np.ones(3), F1))
        pid = os.fork()
        if pid == 0:
            x, root = cross_device_chain()
            run(root, on(np.ones(3), F1))
            ok = (host(x.grad) == 30.0).all()
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """)
    assert result.returncode == 0, result.stderr
    assert "child 0" in result.stdout


@pytest.mark.parametrize("devices", [(F0, F1), (CPU, F0), (F0, CPU)])
def test_a_slot_without_metadata_refuses_gradients_from_two_devices(devices):
    # No metadata, no device check before the sum: before, fake:0 + fake:1
    # said only "operands are on different devices", and a numpy array plus
    # a fake one failed later in a cast, naming neither slot nor device.
    class Consumer(pyengine.Node):
        def apply(self, grads):
            return [on(grads[0], CPU)]

    class Fork(pyengine.Node):
        def __init__(self, edges):
            super().__init__(edges, [pyengine.InputMetadata((3,), np.float64, CPU)])

        def apply(self, grads):
            return [on(grads[0], device) for device in devices]

    x = Leaf(np.ones(3))
    consumer = Consumer([pyengine.gradient_edge(x)], [None])
    fork = Fork([pyengine.Edge(consumer, 0), pyengine.Edge(consumer, 0)])
    with pytest.raises(RuntimeError, match=f"InputBuffer slot 0: gradients on two devices "
                                           f"\\({devices[0]} and {devices[1]}\\) cannot be summed"):
        pyengine.get_default_engine().execute([pyengine.Edge(fork, 0)], [np.ones(3)], False,
                                              False, True)
    assert x.grad is None
    # One device is fine: the oracle is the sum, 1 + 1 per element.
    devices = (F1, F1)
    pyengine.get_default_engine().execute([pyengine.Edge(fork, 0)], [np.ones(3)], False, False,
                                          True)
    np.testing.assert_array_equal(x.grad, [2.0, 2.0, 2.0])


def test_fork_gives_an_engine_the_user_made_fresh_threads_too():
    # Only the default engine was reset after fork: the child's backward
    # on a user's engine waited for device and pool threads it does not
    # have. See Note [Every engine is stopped at exit and reset after fork].
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    result = run_script("""
        import signal, warnings
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        import linear_graphs as lg
        engine = pyengine.Engine(max_recursion_depth=0)  # every level on a pool thread
        def backward_on_both():
            x, root = cross_device_chain()
            engine.execute([pyengine.Edge(root, 0)], [on(np.ones(3), F1)], False, False, True)
            nodes, leaves = lg.reentrant_chain(3)
            previous = pyengine.set_default_engine(engine)  # the levels' own backward
            try:
                engine.execute([pyengine.Edge(nodes[-1], 0)], [np.ones(2)], False, False, True)
            finally:
                pyengine.set_default_engine(previous)
            return host(x.grad).tolist(), leaves[-1].grad.tolist()
        print("parent", backward_on_both(), flush=True)
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a hang ends the child with SIGALRM
            print("child", backward_on_both(), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["parent ([30.0, 30.0, 30.0], [3.0, 3.0])",
                                          "child ([30.0, 30.0, 30.0], [3.0, 3.0])",
                                          "child exit 0"]


def test_an_engine_the_user_made_is_stopped_at_exit():
    # Only the default engine was stopped at exit: a user's engine kept its
    # device threads and took device work after the engine's exit handler.
    lines = run_on_this_core(f"""
import atexit, sys, threading
def after_the_engines_exit_handler():  # registered first, so it runs last
    x = Leaf(np.ones(3))
    node = Scale(pyengine.gradient_edge(x), F0, 2.0, CPU)
    try:
        engine.execute([pyengine.Edge(node, 0)], [on(np.ones(3), F0)], False, False, True)
        print("device work ran after exit:", host(x.grad).tolist())
    except RuntimeError as error:
        print(error)
    print("threads left", [t.name for t in threading.enumerate() if t.name.startswith("pyengine-")])
atexit.register(after_the_engines_exit_handler)
sys.path.insert(0, {os.path.dirname(__file__)!r})
import numpy as np
import pyengine
from pyengine.device import CPU
from test_devices import Leaf, Scale, cross_device_chain, host, on, F0, F1
engine = pyengine.Engine()
x, root = cross_device_chain()
engine.execute([pyengine.Edge(root, 0)], [on(np.ones(3), F1)], False, False, True)
print(host(x.grad).tolist())
""", timeout=60)
    assert lines == ["[30.0, 30.0, 30.0]",
                     "cannot run a task on fake:0: the engine's device threads have stopped "
                     "(Engine.stop(), which runs at interpreter exit)",
                     "threads left []"]


def test_an_engine_is_held_weakly_and_still_collected():
    # Registered for exit and fork, and collected once unused. (One whose
    # device or pool threads started stays alive with them, as it did
    # before it was registered: a thread runs a method of its engine.)
    engine = pyengine.Engine()
    ref = weakref.ref(engine)
    x = Leaf(np.ones(3))
    node = Scale(pyengine.gradient_edge(x), CPU, 2.0, CPU)
    engine.execute([pyengine.Edge(node, 0)], [np.ones(3)], False, False, True)
    np.testing.assert_array_equal(x.grad, [2.0] * 3)
    del engine
    gc.collect()
    assert ref() is None


def test_the_runtime_log_keeps_the_latest_records_only():
    stream = fd.RUNTIME.default_stream(F0)
    positions = []
    for _ in range(2 * fd.LOG_LENGTH + 5):
        stream.launch(lambda: None)  # each event at its own position
        positions.append(fd.RUNTIME.record_event(stream).position)
    # Trimmed to the latest LOG_LENGTH at the (2 * LOG_LENGTH + 1)-th, then
    # four more.
    assert [entry[2] for entry in fd.RUNTIME.log] == positions[-fd.LOG_LENGTH - 4:]


def _interrupt_at_event(k):
    """A trace function that raises KeyboardInterrupt at the k-th call or
    return event of a Python frame on this thread (Ctrl-C lands between
    bytecodes, and a call or a return is where CPython looks for it);
    ``events`` counts them."""
    events = [0]

    def tracer(frame, event, arg):
        if event in ("call", "return"):
            events[0] += 1
            if events[0] == k:
                raise KeyboardInterrupt
        return tracer

    return tracer, events


@pytest.mark.parametrize("while_another_runs", [False, True], ids=["alone", "while_another_runs"])
def test_ctrl_c_in_a_fake_streams_wait_leaves_its_lock_free_and_runs_no_item_twice(while_another_runs):
    # See Note [An interrupt in a fake stream's wait] in pyengine/fake_device.py:
    # an interrupt in threading.Condition's __enter__ left the runtime's lock
    # held, and every later wait hung. For each k, KeyboardInterrupt at the
    # k-th call or return of a Python frame while synchronize() runs three
    # delayed items (and, in the second case, while another thread runs an
    # item of the stream first, so that synchronize waits for it). Then the
    # lock is free, a second synchronize ends, and the items ran in launch
    # order, each at most once: only the item the interrupt landed in may be
    # missing.
    k = 1
    while True:
        stream = fd.FakeStream(F0, f"interrupted-{k}")
        ran = []
        running, release = threading.Event(), threading.Event()
        other = None
        if while_another_runs:
            with fd.set_delayed():
                stream.launch(lambda running=running, release=release, ran=ran: (
                    running.set(), release.wait(10), ran.append("other")))
            other = threading.Thread(target=stream.synchronize, daemon=True)
            other.start()
            assert running.wait(10)
            threading.Timer(0.05, release.set).start()
        with fd.set_delayed():
            for i in range(3):
                stream.launch(lambda i=i, ran=ran: ran.append(i))
        tracer, events = _interrupt_at_event(k)
        sys.settrace(tracer)
        try:
            stream.synchronize()
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
        release.set()
        if other is not None:
            other.join(10)
            assert not other.is_alive()
        if not fd.RUNTIME.lock.acquire(timeout=5):
            fd.RUNTIME.lock.release()  # for the tests after this one (any thread may release a Lock)
            pytest.fail(f"the interrupt at event {k} left the fake runtime's lock held")
        fd.RUNTIME.lock.release()
        finisher = threading.Thread(target=stream.synchronize, daemon=True)
        finisher.start()
        finisher.join(10)
        assert not finisher.is_alive(), f"a wait hung after the interrupt at event {k}"
        expected = (["other"] if while_another_runs else []) + [0, 1, 2]
        if not interrupted:
            assert ran == expected
            break
        assert ran in [expected] + [expected[:i] + expected[i + 1:] for i in range(len(expected))], (k, ran)
        k += 1
    # The sweep passed every event of the run.
    assert k > 5 and events[0] == k - 1
