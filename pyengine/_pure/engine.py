"""The engine: runs a backward graph task to completion.

Twin of ``pyengine/_engine.pyx``: ``GraphRoot``,
``call_function``, and ``Engine`` with ``execute``, ``compute_dependencies``,
``thread_main``, ``evaluate_function``, reentrant backward and its thread
pool. Read it beside PyTorch's ``torch/csrc/autograd/engine.cpp``.

Note [CPU work runs on the caller]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The thread that calls ``execute`` drives the graph task itself: it pushes
the root task onto a ReadyQueue of its own (one per thread, made on first
use) and runs ``thread_main`` until the graph task completes. It never hands
CPU work to another thread, so a backward with only CPU nodes takes no
thread switch at all.

Note [Reentrant backward]
~~~~~~~~~~~~~~~~~~~~~~~~~
A backward started inside a node's ``apply`` (or a hook) is reentrant. Its
graph task gets ``reentrant_depth`` one more than the task that was running,
shares the caller's ReadyQueue, and runs on the same thread, recursively:
its tasks sort before the parent's (See Note [Ready queue order]), so the
child completes before the parent's queued work continues. Each level costs
Python and C stack, so past ``max_recursion_depth`` levels on one thread the
child graph task goes to a pool thread that serves the same queue, with a
fresh stack, while the caller blocks (with the GIL released) until the child
completes. A pool thread may in turn go ``max_recursion_depth`` levels deep
before handing off again, so chains thousands of levels deep complete.

Note [AccumulateGrad first]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
AccumulateGrad nodes carry the largest sequence number, so a leaf's
gradient is written (and the InputBuffer holding it freed) as soon as it is
ready, before any other node runs.
"""

import atexit
import os
import threading
import time
import weakref

from .. import streams
from ..device import CPU
from . import state
from .graph_task import GraphTask
from .hooks import add_anomaly_note, call_function, call_tensor_pre_hooks, check_nan, node_name
from .input_buffer import InputBuffer
from .node import Edge, GradientFreeNodeBase, NodeBase, node_device, not_initialized_message
from .owner_graph import execute_translated
from .ready_queue import NodeTask, ReadyQueue
from .validate_outputs import validate_outputs

# worker_device values: the thread runs no engine loop, or the CPU loop.
# Device workers (issue: devices) use the device index.
NO_DEVICE = -2
CPU_DEVICE = -1

# Levels of reentrant backward run inline on one thread before a pool thread
# takes over. See Note [Reentrant backward].
MAX_RECURSION_DEPTH = 60


class _WorkerState(threading.local):
    """The engine's per-thread state; each attribute is per thread."""

    worker_device = NO_DEVICE
    # Reentrant levels running inline on this thread.
    current_depth = 0
    # Reentrant levels in all, on this thread and the threads that handed off to it.
    total_depth = 0
    local_ready_queue = None


_worker_state = _WorkerState()


# -- GraphRoot --------------------------------------------------------------

class GraphRoot(NodeBase):
    """The node a backward with several roots starts from: it returns the
    root gradients along the root edges."""

    def __init__(self, roots, grads):
        super().__init__(next_edges=roots)
        self.outputs = list(grads)
        # The root gradients were written on the caller's streams: the nodes
        # they flow into wait on those. See Note [Streaming backwards].
        self._stream = next((stream for stream in map(streams.value_stream, grads)
                             if stream is not None), None)

    def apply(self, grads):
        return list(self.outputs)

    def name(self):
        return "GraphRoot"


# -- the reentrant thread pool -------------------------------------------------

class _ThreadPoolShared:
    """Graph tasks handed off by a too-deep reentrant backward, and the pool
    threads that run them. ``graph_tasks``, ``num_idle`` and ``threads`` are
    guarded by ``condition``'s lock."""

    def __init__(self):
        self.condition = threading.Condition(threading.Lock())
        self.graph_tasks = []
        self.num_idle = 0
        self.threads = []
        self.stopping = False


# -- device threads -----------------------------------------------------------

class _DeviceThreads:
    """One ReadyQueue and one worker thread per non-CPU device, started the
    first time a graph task sends that device a task. A device's worker
    state calls it by its index in ``devices`` (its ``worker_device``).

    Guarded by ``lock``: ``ids``, ``devices``, ``queues``, ``threads``,
    ``stopping``. ``graph_tasks`` (a WeakSet of graph tasks that sent work to
    a device, so that ``stop`` can fail them rather than leave their callers
    waiting forever) is guarded by ``lock`` too.
    """

    def __init__(self, ready_queue_type):
        self.lock = threading.Lock()
        self.ids = {}
        self.devices = []
        self.queues = []
        self.threads = []
        self.stopping = False
        self.graph_tasks = weakref.WeakSet()
        self._ready_queue_type = ready_queue_type

    def queue_for(self, device, graph_task, worker_main):
        """The queue of ``device``, for a task of ``graph_task``; on first use,
        starts the device's worker thread, which runs
        ``worker_main(device_id, queue)``."""
        with self.lock:
            if self.stopping:
                raise RuntimeError(f"cannot run a task on {device}: the engine's device "
                                   "threads have stopped (interpreter shutdown)")
            self.graph_tasks.add(graph_task)
            device_id = self.ids.get(device)
            if device_id is None:
                device_id = self.ids[device] = len(self.devices)
                queue = self._ready_queue_type()
                thread = threading.Thread(target=worker_main, args=(device_id, queue),
                                          name=f"pyengine-{device}", daemon=True)
                self.devices.append(device)
                self.queues.append(queue)
                self.threads.append(thread)
                thread.start()
            return self.queues[device_id]

    def queue_by_index(self, device_id):
        with self.lock:
            return self.queues[device_id]

    def stop(self):
        """Refuse new device work; return the graph tasks that may still wait
        on device work, and the workers' queues and threads."""
        with self.lock:
            self.stopping = True
            return list(self.graph_tasks), list(self.queues), list(self.threads)


SHUTDOWN_ERROR = ("pyengine's device threads stopped (interpreter shutdown) while this "
                  "backward was running")


# -- the engine -------------------------------------------------------------

class Engine:
    """PyTorch's autograd engine. One default instance serves every thread;
    see :func:`pyengine.get_default_engine`."""

    def __init__(self, max_recursion_depth=MAX_RECURSION_DEPTH):
        self.max_recursion_depth = max_recursion_depth
        self._pool = _ThreadPoolShared()
        self._devices = _DeviceThreads(ReadyQueue)

    # -- entry point --

    def execute(self, roots, grads, keep_graph, create_graph, accumulate_grad, outputs=None):
        """Run backward from ``roots`` (Edges) with ``grads`` (one per root).

        ``outputs`` (Edges or None): with ``accumulate_grad=False`` (``grad``),
        return the gradient flowing into each; with ``accumulate_grad=True``
        (``backward(inputs=)``), run only the nodes on a path to them.
        Returns the captured gradients (empty without ``outputs``).
        """
        roots = list(roots)
        grads = list(grads)
        if not roots:
            raise RuntimeError("execute needs at least one root edge")
        for i, root in enumerate(roots):
            if root is None or not hasattr(root, "node") or not isinstance(root.node, NodeBase):
                raise TypeError(f"roots[{i}] must be an Edge, got {type(root).__name__}")
        validate_outputs(roots, grads, lambda message: message)

        worker = _worker_state
        if worker.local_ready_queue is None:
            worker.local_ready_queue = ReadyQueue()
        graph_task = GraphTask(
            keep_graph, create_graph,
            0 if worker.worker_device == NO_DEVICE else worker.total_depth + 1,
            worker.local_ready_queue, multithreading=state.is_multithreading_enabled())

        # A single root starts the task itself; several hang off a GraphRoot.
        if len(roots) == 1:
            graph_root = roots[0].node
            input_buffer = InputBuffer(len(graph_root._input_metadata))
            self._accumulate(input_buffer, roots[0].input_nr, grads[0], create_graph,
                             streams.value_stream(grads[0]), graph_root._stream)
        else:
            graph_root = GraphRoot(roots, grads)
            input_buffer = InputBuffer(0)
        graph_task.graph_root = graph_root
        self.compute_dependencies(graph_root, graph_task)
        if outputs:
            graph_task.init_to_execute(graph_root, list(outputs), accumulate_grad)

        self.execute_with_graph_task(graph_task, graph_root, input_buffer)
        graph_task.wait()
        if graph_task.exception is not None:
            # Take the error off the task: the traceback must not keep the task alive.
            error, graph_task.exception = graph_task.exception, None
            raise error
        return graph_task.captured_vars

    def execute_owner_graph(self, root, children, method):
        """Run backward over the owner graph under ``root``: call
        ``owner.<method>()`` for it and every owner below it through the
        ``children`` collections that has children itself, each once every
        owner above it ran, in the order of a framework's depth-first
        topological sort. See Note [Owner graphs] in
        ``pyengine/_pure/owner_graph.py``: here, the translation runs."""
        execute_translated(self, root, children, method, GradientFreeNodeBase, Edge)

    def execute_with_graph_task(self, graph_task, graph_root, input_buffer):
        """Queue the root task and drive the graph task: inline on this thread,
        or on a pool thread past the reentrant depth limit."""
        worker = _worker_state
        queue = self.ready_queue(graph_task, node_device(graph_root, input_buffer.buffer))
        if worker.worker_device == NO_DEVICE:
            # Not inside the engine: this thread drives the graph task.
            # See Note [CPU work runs on the caller].
            worker.worker_device = CPU_DEVICE
            graph_task.owner = CPU_DEVICE
            queue.push(NodeTask(graph_task, graph_root, input_buffer.buffer))
            try:
                self.thread_main(graph_task)
            finally:
                worker.worker_device = NO_DEVICE
        else:
            # A reentrant backward. See Note [Reentrant backward].
            graph_task.owner = worker.worker_device
            queue.push(NodeTask(graph_task, graph_root, input_buffer.buffer))
            if worker.current_depth >= self.max_recursion_depth:
                self.add_thread_pool_task(graph_task)
            else:
                worker.total_depth += 1
                worker.current_depth += 1
                try:
                    self.thread_main(graph_task)
                finally:
                    worker.current_depth -= 1
                    worker.total_depth -= 1

    def compute_dependencies(self, graph_root, graph_task):
        """Count, for each node reachable from ``graph_root``, the edges into it."""
        dependencies = graph_task.dependencies
        seen = {id(graph_root)}
        stack = [graph_root]
        while stack:
            node = stack.pop()
            if not getattr(node, "_initialized", False):
                raise RuntimeError(not_initialized_message(node))
            for edge in node._next_edges:
                if edge is None:
                    continue
                key = id(edge.node)
                dependencies[key] = dependencies.get(key, 0) + 1
                if key not in seen:
                    seen.add(key)
                    stack.append(edge.node)

    # -- the loop --

    def thread_main(self, graph_task):
        """Pop and run tasks until ``graph_task`` completes (forever for None)."""
        worker = _worker_state
        queue = worker.local_ready_queue
        while graph_task is None or not graph_task.future_completed:
            task = queue.pop()
            if task.is_shutdown:
                break
            local_graph_task = task.graph_task
            if task.node is None:
                # A wake-up task: loop back and look at graph_task again.
                continue
            previous_graph_task = state.set_current_graph_task(local_graph_task)
            previous_grad_mode = state.is_grad_enabled()
            state.set_grad_enabled(local_graph_task.grad_mode)
            previous_checkpoint_valid = state.swap_checkpoint_valid(local_graph_task.can_checkpoint())
            try:
                if not local_graph_task.has_error:
                    profiler = state.profiler()
                    if profiler is None:
                        self.evaluate_function(local_graph_task, task.node, task.inputs)
                    else:
                        self.evaluate_profiled(profiler, local_graph_task, task.node, task.inputs)
            except BaseException as error:
                if state.is_anomaly_enabled():
                    add_anomaly_note(error, task.node)
                local_graph_task.set_exception(error)
            finally:
                state.swap_checkpoint_valid(previous_checkpoint_valid)
                state.set_grad_enabled(previous_grad_mode)
                state.set_current_graph_task(previous_graph_task)
            # Drop the task's references before the graph task may complete.
            del task
            local_graph_task.decrement_outstanding_tasks()
            if local_graph_task.completed():
                local_graph_task.mark_as_completed_and_run_post_processing()
                owner = local_graph_task.owner
                if worker.worker_device != owner:
                    # The owner may sleep in pop(): wake it up.
                    self.ready_queue_by_index(local_graph_task.cpu_ready_queue, owner).push(
                        NodeTask(local_graph_task, None, None))
            # Let go of the task now: a worker about to sleep in pop() must not
            # keep its last graph alive until the next task comes.
            local_graph_task = None
        if graph_task is not None and graph_task.has_error:
            queue.discard_graph_task(graph_task)

    def evaluate_profiled(self, profiler, graph_task, node, inputs):
        """evaluate_function, timed and reported to the profiler even if it fails."""
        start = time.perf_counter_ns()
        try:
            self.evaluate_function(graph_task, node, inputs)
        finally:
            profiler(node, start, time.perf_counter_ns())

    def evaluate_function(self, graph_task, node, inputs):
        """Run one node on ``inputs`` (its InputBuffer's list of gradients) and
        pass its gradients on to the nodes they flow into."""
        exec_info = graph_task.exec_info
        if exec_info:
            info = exec_info.get(id(node))
            if info is None:
                return
            if not info.needed:
                # Tensor pre-hooks run exactly once: here, or in call_function.
                call_tensor_pre_hooks(node, inputs)
            if info.captures:
                with graph_task.mutex:
                    for input_nr, output_idx in info.captures:
                        if input_nr < len(inputs):
                            graph_task.captured_vars[output_idx] = inputs[input_nr]
                if node._stream is not None:
                    graph_task.add_leaf_stream(node._stream)
            if not info.needed:
                return

        producer_stream = node._stream
        # See Note [Streaming backwards]: apply runs on the node's stream.
        with streams.stream_guard(producer_stream):
            outputs = call_function(graph_task, node, inputs)
        if not graph_task.keep_graph:
            # Looked up on the class, as a C++ virtual method is (the compiled
            # engine's lookup is then cheap): a function set on the node
            # itself is not an override.
            type(node).release_variables(node)
            node._released = True
        if not outputs:
            if producer_stream is not None:
                graph_task.add_leaf_stream(producer_stream)
            return
        if state.is_anomaly_enabled() and state.is_anomaly_check_nan_enabled():
            check_nan(node, outputs)

        next_edges = node._next_edges
        grad_mode = graph_task.grad_mode
        with graph_task.mutex:
            dependencies = graph_task.dependencies
            not_ready = graph_task.not_ready
            for i, output in enumerate(outputs):
                edge = next_edges[i]
                if edge is None:
                    continue
                next_node = edge.node
                key = id(next_node)
                remaining = dependencies.get(key)
                if remaining is None:
                    raise RuntimeError(f"dependency not found for {node_name(next_node)}")
                is_ready = remaining == 1
                if is_ready:
                    del dependencies[key]
                else:
                    dependencies[key] = remaining - 1

                input_buffer = not_ready.get(key)
                if input_buffer is None:
                    if not _should_execute(exec_info, key):
                        continue
                    input_buffer = InputBuffer(len(next_node._input_metadata))
                    self._accumulate(input_buffer, edge.input_nr, output, grad_mode,
                                     producer_stream, next_node._stream)
                    if is_ready:
                        self._push_ready(graph_task, next_node, input_buffer.buffer)
                    else:
                        not_ready[key] = input_buffer
                else:
                    self._accumulate(input_buffer, edge.input_nr, output, grad_mode,
                                     producer_stream, next_node._stream)
                    if is_ready:
                        del not_ready[key]
                        self._push_ready(graph_task, next_node, input_buffer.buffer)

    @staticmethod
    def _accumulate(input_buffer, input_nr, gradient, grad_mode, producer_stream, consumer_stream):
        """Add a gradient into a consumer's buffer on the consumer's stream, once
        that stream waited for the producer's. See Note [Streaming backwards]."""
        if producer_stream is None and consumer_stream is None:
            input_buffer.add(input_nr, gradient, grad_mode)
            return
        streams.sync_streams(consumer_stream, producer_stream)
        with streams.stream_guard(consumer_stream):
            input_buffer.add(input_nr, gradient, grad_mode)

    def _push_ready(self, graph_task, node, gradients):
        self.ready_queue(graph_task, node_device(node, gradients)).push(
            NodeTask(graph_task, node, gradients))

    # -- devices --

    def ready_queue(self, graph_task, device):
        """The queue a task of ``graph_task`` for ``device`` goes to: the
        device's worker, or, for the CPU or with multithreading disabled, the
        graph task's CPU queue (the caller's)."""
        if device == CPU or not graph_task.multithreading:
            return graph_task.cpu_ready_queue
        return self._devices.queue_for(device, graph_task, self._device_thread_main)

    def ready_queue_by_index(self, cpu_ready_queue, device_id):
        """The queue of the thread whose ``worker_device`` is ``device_id``."""
        if device_id == CPU_DEVICE:
            return cpu_ready_queue
        return self._devices.queue_by_index(device_id)

    def _device_thread_main(self, device_id, queue):
        worker = _worker_state
        worker.worker_device = device_id
        worker.local_ready_queue = queue
        self.thread_main(None)

    # -- reentrant pool --

    def add_thread_pool_task(self, graph_task):
        """Hand ``graph_task`` to a pool thread and block until it completes.
        See Note [Reentrant backward]."""
        pool = self._pool
        with pool.condition:
            pool.graph_tasks.append(graph_task)
            if pool.num_idle < len(pool.graph_tasks):
                thread = threading.Thread(target=self._reentrant_thread_main,
                                          name="pyengine-reentrant", daemon=True)
                pool.threads.append(thread)
                thread.start()
            pool.condition.notify()
        graph_task.wait()

    def _reentrant_thread_main(self):
        pool = self._pool
        worker = _worker_state
        while True:
            with pool.condition:
                pool.num_idle += 1
                while not pool.graph_tasks and not pool.stopping:
                    pool.condition.wait()
                pool.num_idle -= 1
                if pool.stopping:
                    pool.threads.remove(threading.current_thread())
                    return
                graph_task = pool.graph_tasks.pop(0)
            worker.worker_device = graph_task.owner
            worker.local_ready_queue = graph_task.cpu_ready_queue
            worker.total_depth = graph_task.reentrant_depth
            worker.current_depth = 0
            self.thread_main(graph_task)
            worker.local_ready_queue = None
            worker.worker_device = NO_DEVICE
            del graph_task

    def stop(self, timeout=1.0):
        """Stop the device and pool threads (at interpreter exit). A backward
        still waiting for device work fails with a RuntimeError instead of
        waiting forever."""
        in_flight, device_queues, device_threads = self._devices.stop()
        error = RuntimeError(SHUTDOWN_ERROR)
        for graph_task in in_flight:
            if not graph_task.future_completed:
                graph_task.set_exception(error)
                self.ready_queue_by_index(graph_task.cpu_ready_queue, graph_task.owner).push(
                    NodeTask(graph_task, None, None))
        for queue in device_queues:
            queue.push_shutdown()
        pool = self._pool
        with pool.condition:
            pool.stopping = True
            threads = list(pool.threads)
            pool.condition.notify_all()
        for thread in device_threads + threads:
            thread.join(timeout)

    def _reset_after_fork(self):
        # The child has only the forking thread: the pool's and the devices'
        # threads are gone, and their locks may have been held by them.
        self._pool = _ThreadPoolShared()
        self._devices = _DeviceThreads(ReadyQueue)

    # -- callbacks --

    def queue_callback(self, callback):
        """Run ``callback`` once the current backward completes."""
        graph_task = state.get_current_graph_task()
        if graph_task is None:
            raise RuntimeError("Final callbacks can only be installed during backward pass.")
        graph_task.final_callbacks.append(callback)


def _should_execute(exec_info, key):
    """Whether the node ``key`` (its id) runs or captures: every node does
    without exec_info."""
    if not exec_info:
        return True
    info = exec_info.get(key)
    return info is not None and info.should_execute()


def _reset_worker_state_after_fork():
    global _worker_state
    _worker_state = _WorkerState()


def _register_engine(engine):
    """Stop ``engine``'s pool at exit and reset it in a forked child."""
    atexit.register(engine.stop)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=engine._reset_after_fork)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_worker_state_after_fork)
