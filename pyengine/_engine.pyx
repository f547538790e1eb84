"""The engine: runs a backward graph task to completion.

The compiled twin of ``pyengine/_pure/engine.py``, whose Notes explain the
design: Note [CPU work runs on the caller], Note [AccumulateGrad first],
Note [Ready queue order]; a backward nested too deep goes to the reentrant
pool of ``pyengine/_thread_pool.pyx`` (See Note [Reentrant backward] in
``pyengine/_pure/thread_pool.py``), and ``compute_dependencies`` and
``init_to_execute`` are in
``pyengine/_dependencies.pyx``. Per node and per edge
everything here is C: records move through the ReadyQueue, dependencies
are a C++ map keyed by node pointer, a numpy gradient of the right shape,
dtype and device is checked in C, and a node without hooks is called
directly. Hooks, broadcast reductions, casts, other value types and anomaly
mode go through the functions of ``pyengine/_shared`` that the twin calls
too (See Note [Slow paths are shared]).

Note [Accumulating under the graph task lock]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
As in PyTorch, a gradient is added into the InputBuffer of the node it
flows into while the GraphTask mutex is held: two producers on different
threads may feed one buffer. The sum calls the value backend (numpy's add,
or a framework's under ``create_graph``). It may release the GIL (a large
numpy add does); a thread that then wants the same mutex waits without the
GIL, so nothing deadlocks, and Ctrl-C ends the wait of the main thread.

The engine runs no node, hook or callback under the mutex, but Python code
may still run there: a backend's add, and the ``__del__`` of anything the
routing lets go of (the gradient a buffer replaces). If that code asks
for the same mutex (a running node's query; a nested backward whose loop
runs one of this graph task's nodes), the thread would wait for itself:
the mutex knows its holder and raises RuntimeError instead, in both cores
(``lock_mutex``; the twin's ``refuse_lock_taken_again``). See Note [A lock
the GIL guards] in _gil_guarded_lock.h and tests/test_graph_task_lock.py.
"""

cimport cython
cimport numpy as cnp
from cpython.list cimport PyList_CheckExact, PyList_GET_ITEM, PyList_GET_SIZE, PyList_SET_ITEM
from cpython.object cimport PyObject, Py_TYPE
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_REFCNT
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cython.operator cimport dereference as deref
from libcpp.utility cimport pair

from pyengine._graph_task cimport (Capture, ExecInfoEntry, GraphTask, InputBufferPtr, NodePtr,
                                   link_enclosing_graph_task,
                                   cancel_graph_task, lock_mutex, new_graph_task,
                                   release_leftovers, task_should_execute)
from pyengine._dependencies cimport compute_dependencies, init_to_execute
from pyengine._input_buffer cimport InputBuffer, new_input_buffer
from pyengine._interrupts cimport NODES_BETWEEN_YIELDS, WORK_BETWEEN_YIELDS, let_others_run
from pyengine._locks cimport is_main_thread, lock_releasing_gil
from pyengine._node cimport Edge, GradientFreeNodeBase, InputMetadata, NodeBase, has_numpy_backend
from pyengine._ready_queue cimport NodeTaskRecord, ReadyQueue, make_record, release_record
from pyengine._validate_outputs cimport gradient_passes_as_is, validate_outputs_impl
from pyengine._thread_pool cimport _ThreadPoolShared, add_thread_pool_task
from pyengine._thread_pool import stop_thread_pool
from pyengine._state cimport (ThreadState, anomaly_check_nan, anomaly_enabled, profiler,
                              thread_state)

import os
import threading
import weakref
from time import perf_counter_ns as _perf_counter_ns

from pyengine import backends as _backends
from pyengine import streams as _streams
from pyengine._shared import hooks as _hooks
from pyengine._shared.device_threads import SHUTDOWN_ERROR, _DeviceThreads, node_device
from pyengine._shared.engine_registry import register_engine
from pyengine._shared.messages import (ENGINE_INITIALIZED_WHY, QUEUE_FULL_MESSAGE,
                                      cannot_pickle_message,
                                      gradients_changed_message, handoff_interrupted_message,
                                      initialized_once_message, input_buffer_list_gone_message,
                                      no_ready_queue_message, raise_error, total_depth_message)
from pyengine._validate_outputs import plain_error_format, validate_outputs
from pyengine.indexed import IndexedGradient

cnp.import_array()

from pyengine.device import CPU as _CPU

# worker_device values: the thread runs no engine loop, or the CPU loop.
# Device workers use the device index.
DEF NO_DEVICE = -2
DEF CPU_DEVICE = -1

# Levels of reentrant backward run inline on one thread before a pool thread
# takes over; levels of reentrant backward in all; threads of the reentrant
# pool. See Note [Reentrant backward] and Note [Bounds on reentrant backward] in
# pyengine/_pure/thread_pool.py.
MAX_RECURSION_DEPTH = 60
MAX_TOTAL_DEPTH = 4096
MAX_POOL_THREADS = 256


cdef extern from "Python.h":
    # itemlist NULL deletes the slice.
    int list_set_slice "PyList_SetSlice"(object list, Py_ssize_t low, Py_ssize_t high,
                                         PyObject* itemlist) except -1


cdef inline int clear_list(list items) except -1:
    """``items.clear()`` without looking the method up: once per backward."""
    return list_set_slice(items, 0, PyList_GET_SIZE(items), NULL)


# -- per-thread worker state --------------------------------------------------------

@cython.final
cdef class WorkerState:
    """The engine's per-thread state; one object per thread, so unguarded."""
    cdef int worker_device
    # Reentrant levels running inline on this thread.
    cdef int current_depth
    # Reentrant levels in all, on this thread and the threads that handed off to it.
    cdef int total_depth
    cdef ReadyQueue local_ready_queue
    # Whether this thread runs signal handlers: See Note [Waits honour signals].
    cdef bint on_main_thread
    # The last task this thread queued, when it is for local_ready_queue:
    # held back until the thread pops. See Note [The next task skips the
    # queue] in pyengine/_pure/engine.py.
    cdef NodeTaskRecord next_task
    cdef bint has_next_task
    # Whether next_task is counted in its graph task's outstanding tasks:
    # See Note [A held task takes over its maker's count] in
    # pyengine/_pure/engine.py.
    cdef bint next_task_counted
    # A gradients list a task left that nothing else refers to, for the
    # next single_gradient. See Note [Reusing a task's gradients list] in
    # pyengine/_pure/engine.py.
    cdef list spare_list
    # Whether a hand-off of this thread's was interrupted while a pool thread
    # ran its graph task: until its outermost backward raises, every
    # backward it drives has failed and no new one starts. See Note [A
    # backward that raises leaves its ready queue] in pyengine/_pure/engine.py.
    cdef bint handoff_interrupted
    # The graph tasks whose loops (thread_main) run on this thread,
    # outermost first; never None. See Note [A backward that raises leaves
    # its ready queue] in pyengine/_pure/engine.py.
    cdef list driven_graph_tasks

    def __cinit__(self):
        self.worker_device = NO_DEVICE
        self.on_main_thread = is_main_thread()
        self.driven_graph_tasks = []

    def __dealloc__(self):
        if self.has_next_task:
            release_record(&self.next_task)

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))


# Note [The worker state's thread-local pointer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each backward starts by finding its thread's WorkerState. Reading it from
# a threading.local costs a tenth of a one-node backward's engine work (the
# thread's dict of locals, then the local's own), so the thread's C state
# holds it (ThreadState.worker_state), with a reference of its own: no
# Python code can free it under the pointer. What the threading.local
# keeps is a WorkerStateKeeper, whose only use is to be freed with the
# thread's locals, on that thread, when it ends (or when a fork's child
# replaces the local): it then takes the pointer back and lets go of the
# WorkerState. A keeper freed on another thread (a finalizing interpreter
# clears its remaining threads' locals from its own) leaves that pointer
# alone: its thread runs no more Python code, and what it held is left to
# the process's end rather than freed under a thread that may still read it.
cdef object _thread_local = threading.local()


@cython.final
cdef class WorkerStateKeeper:
    """Ends its thread's WorkerState when the thread's locals are freed:
    See Note [The worker state's thread-local pointer]."""
    cdef PyObject* worker

    def __dealloc__(self):
        cdef ThreadState* state = thread_state()
        if self.worker != NULL and state.worker_state == self.worker:
            state.worker_state = NULL
            Py_DECREF(<object>self.worker)

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))


cdef WorkerState get_worker_state():
    cdef ThreadState* state = thread_state()
    if state.worker_state != NULL:
        return <WorkerState>state.worker_state
    worker = WorkerState()
    keeper = WorkerStateKeeper()
    _thread_local.state = keeper
    # The pointer's reference, which the keeper gives back.
    Py_INCREF(worker)
    state.worker_state = <PyObject*>worker
    (<WorkerStateKeeper>keeper).worker = <PyObject*>worker
    return worker


# -- GraphRoot ----------------------------------------------------------------------

cdef class GraphRoot(NodeBase):
    """The node a backward with several roots starts from: it returns the
    root gradients along the root edges."""
    cdef public list outputs
    # Immutable after construction; read by gradient_stream, which indexes
    # it in C: a tuple from __cinit__ on, even in a GraphRoot whose
    # __init__ never ran (made by __new__, then initialized as a NodeBase).
    cdef readonly tuple _root_streams

    def __cinit__(self, *args, **kwargs):
        self._root_streams = ()

    def __init__(self, roots, grads):
        super().__init__(next_edges=roots)
        self.outputs = list(grads)
        # The root gradients were written on the caller's current streams, one
        # per root and device: each is the producer stream of its own root
        # gradient (not the first root's for all). See Note [Streaming backwards].
        # A loop, not a list comprehension: See Note [Python allocations
        # that fail].
        root_streams = []
        for grad in grads:
            root_streams.append(_streams.value_stream(grad))
        self._root_streams = tuple(root_streams)
        self._stream = next((stream for stream in self._root_streams if stream is not None), None)

    def apply(self, grads):
        return list(self.outputs)

    def name(self):
        return "GraphRoot"


# -- call_function ------------------------------------------------------------------



cdef inline bint has_tensor_pre_hooks(NodeBase node) noexcept:
    return bool(node._tensor_pre_hooks or node._retains_grad_hooks)


cdef inline bint has_hooks(NodeBase node) noexcept:
    return bool(node._tensor_pre_hooks or node._retains_grad_hooks or node._pre_hooks
                or node._post_hooks)


cdef inline int release_variables(NodeBase node) except -1:
    """Mark the node released, then ``type(node).release_variables(node)``
    where the node's class overrode it when the node was made, else what
    NodeBase's does, with no lookup. See Note [Overriding release
    variables] in ``pyengine/_pure/node.py`` and Note [A node is marked
    released before it is cleared] in ``pyengine/_pure/engine.py``."""
    node._released_ = True
    if node._overrides_release_variables_:
        type(node).release_variables(node)
    else:
        node._saved_values = None  # NodeBase.release_variables
    return 0


cdef object _IndexedGradient = IndexedGradient


@cython.boundscheck(True)
cdef int capture_inputs(GraphTask graph_task, Py_ssize_t captures, list inputs) except -1:
    """Give each output that ``captures`` (an index into the task's
    exec_captures, which only init_to_execute sets and fills) names its
    gradient among ``inputs``. Bounds checked, and ``captured_vars`` written
    as an object: Python code may have set it to None or a shorter list,
    and the write then fails in the twin's words."""
    cdef Capture capture
    lock_mutex(graph_task)
    try:
        for capture in graph_task.exec_captures[captures]:
            if capture.first < len(inputs):
                (<object>graph_task.captured_vars)[capture.second] = inputs[capture.first]
    finally:
        graph_task.mutex_.unlock()
    return 0


cdef inline bint has_indexed(list inputs) noexcept:
    """The twin's ``has_indexed``: a type comparison per input."""
    cdef PyObject* indexed_type = <PyObject*>_IndexedGradient
    cdef Py_ssize_t i
    for i in range(PyList_GET_SIZE(inputs)):
        if <PyObject*>Py_TYPE(<object>PyList_GET_ITEM(inputs, i)) == indexed_type:
            return True
    return False


cdef int densify_inputs(NodeBase node, list inputs) except -1:
    # Out of line: the common path through call_function stays short.
    _hooks.densify_inputs(node, inputs)
    return 0


cdef list call_function(GraphTask graph_task, NodeBase node, list inputs, tuple next_edges,
                        NodeBase only_next_node, Py_ssize_t only_input_nr):
    """A node without hooks: ``apply`` and ``validate_outputs`` against
    ``next_edges``, the node's edges from before it ran (See Note [Next edges
    while a node runs] in ``pyengine/_pure/engine.py``), here. With hooks:
    the shared ``call_function``, which runs them in PyTorch's order.
    IndexedGradients are densified for a node that does not accept them
    (the shared ``densify_inputs``). ``only_next_node`` and
    ``only_input_nr``: the node's only next edge, read with ``next_edges``
    (See Note [A node's only next edge] in ``pyengine/_pure/node.py``)."""
    if has_hooks(node):
        return _hooks.call_function(graph_task, node, inputs, next_edges, validate_outputs)
    if has_indexed(inputs):
        densify_inputs(node, inputs)
    outputs = node.apply(inputs)
    if type(outputs) is not list:
        if not isinstance(outputs, (tuple, list)):
            raise TypeError(f"Function {_hooks.node_name(node)}.apply must return a tuple or list "
                            f"of gradients, got {type(outputs).__name__}")
        outputs = list(outputs)
    cdef list checked = <list>outputs
    # The only next edge's gradient passes as it is without a look at the
    # edges tuple and the Edge; anything else takes the whole check.
    if (only_next_node is None or PyList_GET_SIZE(checked) != 1
            or not gradient_passes_as_is(only_next_node, only_input_nr,
                                         <object>PyList_GET_ITEM(checked, 0))):
        validate_outputs_impl(next_edges, checked, None, node, False)
    return checked


# -- the engine -------------------------------------------------------------------------

cdef class Engine:
    """PyTorch's autograd engine. One default instance serves every thread;
    see :func:`pyengine.get_default_engine`.

    An engine made here starts its device worker threads and its reentrant
    pool threads when a backward first needs them. They serve until
    :meth:`stop` (every engine is stopped at interpreter exit), or until
    the engine is collected: they hold it only while they run its tasks,
    and end within about a second once nothing else refers to it (See Note
    [An engine's threads hold it weakly] in
    pyengine/_shared/engine_registry.py). (PyTorch has one engine only,
    which lives as long as the process.)"""
    cdef public int max_recursion_depth
    cdef public int max_total_depth
    cdef public int max_pool_threads
    cdef _ThreadPoolShared _pool
    cdef object _devices
    # Held weakly by the engine registry (pyengine/_shared/engine_registry.py).
    cdef object __weakref__

    def __init__(self, int max_recursion_depth=MAX_RECURSION_DEPTH,
                 int max_total_depth=MAX_TOTAL_DEPTH, int max_pool_threads=MAX_POOL_THREADS):
        """``max_recursion_depth``: reentrant levels run inline on one thread;
        ``max_total_depth``: reentrant levels in all, past which a reentrant
        backward raises RecursionError; ``max_pool_threads``: threads of the
        reentrant pool, past which a hand-off raises RuntimeError. See
        Note [Bounds on reentrant backward]."""
        if self._pool is not None:
            raise TypeError(initialized_once_message(self, ENGINE_INITIALIZED_WHY))
        self.max_recursion_depth = max_recursion_depth
        self.max_total_depth = max_total_depth
        self.max_pool_threads = max_pool_threads
        self._pool = _ThreadPoolShared()
        self._devices = _DeviceThreads(ReadyQueue)
        # See Note [Every engine is stopped at exit and reset after fork] in
        # pyengine/_shared/engine_registry.py.
        register_engine(self)

    # -- entry point --

    # Bounds checked: the root gradients are read after validate_outputs,
    # whose casts and replaced values' __del__ run Python code that may reach
    # the list; an IndexError, as the twin's, where the build's default
    # would read past its end.
    @cython.boundscheck(True)
    def execute(self, roots, grads, keep_graph, create_graph, accumulate_grad, outputs=None):
        """Run backward from ``roots`` (Edges) with ``grads`` (one per root).

        ``outputs`` (Edges or None): with ``accumulate_grad=False`` (``grad``),
        return the gradient flowing into each; with ``accumulate_grad=True``
        (``backward(inputs=)``), run only the nodes on a path to them.
        Returns the captured gradients (empty without ``outputs``).
        """
        # Every argument is checked before anything runs: See Note [Checking
        # execute's arguments] in pyengine/_pure/engine.py.
        cdef tuple root_edges = tuple(roots)
        # A list's slice is its cheapest copy (list() of a list extends an empty one).
        cdef list root_grads = (<list>grads)[:] if PyList_CheckExact(grads) else list(grads)
        cdef list output_edges = None if outputs is None else list(outputs)
        cdef bint keep = keep_graph
        cdef bint grad_mode = create_graph
        if not root_edges:
            raise RuntimeError("execute needs at least one root edge")
        # See Note [Long passes let other threads run] in _interrupts.pxd.
        cdef Py_ssize_t work_left = WORK_BETWEEN_YIELDS
        for i, root in enumerate(root_edges):
            let_others_run(&work_left)
            if not isinstance(root, Edge):
                raise TypeError(f"roots[{i}] must be an Edge, got {type(root).__name__}")
        if output_edges is not None:
            for i, output in enumerate(output_edges):
                let_others_run(&work_left)
                if not isinstance(output, Edge):
                    raise TypeError(f"outputs[{i}] must be an Edge, got {type(output).__name__}")
        validate_outputs_impl(root_edges, root_grads, plain_error_format, None, False)

        cdef WorkerState worker = get_worker_state()
        if worker.local_ready_queue is None:
            worker.local_ready_queue = ReadyQueue()
        cdef GraphTask graph_task = new_graph_task(
            keep, grad_mode, 0 if worker.worker_device == NO_DEVICE else worker.total_depth + 1,
            worker.local_ready_queue, False, thread_state().multithreading_enabled)

        # A single root starts the task itself; several hang off a GraphRoot.
        cdef NodeBase graph_root
        cdef InputBuffer input_buffer
        cdef Edge root_edge
        if len(root_edges) == 1:
            root_edge = <Edge>root_edges[0]
            graph_root = root_edge.node
            input_buffer = new_input_buffer(len(graph_root._input_metadata))
            root_grad = root_grads[0]
            if graph_root._stream is None and (root_grad is None or type(root_grad) is cnp.ndarray):
                input_buffer.add(root_edge.input_nr, root_grad, grad_mode)
            else:
                accumulate_on_streams(input_buffer, root_edge.input_nr, root_grad, grad_mode,
                                      _streams.value_stream(root_grad), graph_root._stream)
        else:
            graph_root = GraphRoot(root_edges, root_grads)
            input_buffer = new_input_buffer(0)
        graph_task.graph_root = graph_root
        if output_edges:
            init_to_execute(graph_root, graph_task, output_edges, accumulate_grad)
        else:
            compute_dependencies(graph_root, graph_task)

        link_enclosing_graph_task(graph_task, thread_state())
        self.execute_with_graph_task(worker, graph_task, graph_root, task_inputs(input_buffer))
        try:
            graph_task.wait()
        except BaseException as error:
            cancel_graph_task(graph_task, error)
            raise
        if graph_task.exception_ is not None:
            # Take the error off the task: the traceback must not keep the task alive.
            error = graph_task.exception_
            graph_task.exception_ = None
            # Its gradients waiting for nodes that will not run, and those
            # captured: See Note [What a failed graph task leaves is let go
            # of in slices] in pyengine/_pure/graph_task.py.
            release_leftovers(graph_task)
            if not isinstance(error, BaseException):
                raise_error(error)
            raise error
        return graph_task.captured_vars

    cdef int execute_with_graph_task(self, WorkerState worker, GraphTask graph_task,
                                     NodeBase graph_root, list inputs) except -1:
        """Queue the root task and drive the graph task: inline on this thread,
        or on a pool thread past the reentrant depth limit. ``worker``: this
        thread's state."""
        cdef ReadyQueue queue = self.route(graph_task, graph_root, inputs)
        if worker.worker_device == NO_DEVICE:
            # Not inside the engine: this thread drives the graph task.
            # See Note [CPU work runs on the caller].
            worker.worker_device = CPU_DEVICE
            graph_task.owner = CPU_DEVICE
            flush_next_task(worker)
            try:
                # Inside: a push that fails (See Note [C++ allocations that
                # fail]) leaves this thread outside the engine, as the twin.
                push_task(queue, graph_task, graph_root, inputs)
                worker.driven_graph_tasks.append(graph_task)
                self.thread_main(worker, graph_task)
                if graph_task.has_error_.load():
                    # It raises its error: See Note [A backward that raises
                    # leaves its ready queue] in pyengine/_pure/engine.py.
                    leave_ready_queue(worker)
            except BaseException:
                leave_ready_queue(worker)
                raise
            finally:
                worker.worker_device = NO_DEVICE
                clear_list(worker.driven_graph_tasks)
        else:
            # A reentrant backward. See Note [Reentrant backward].
            if graph_task.reentrant_depth > self.max_total_depth:
                # See Note [Bounds on reentrant backward].
                raise RecursionError(total_depth_message(graph_task.reentrant_depth,
                                                         self.max_total_depth))
            if worker.handoff_interrupted:
                # See Note [A backward that raises leaves its ready queue] in
                # pyengine/_pure/engine.py.
                raise RuntimeError(handoff_interrupted_message())
            graph_task.owner = worker.worker_device
            flush_next_task(worker)
            push_task(queue, graph_task, graph_root, inputs)
            if worker.current_depth >= self.max_recursion_depth:
                try:
                    add_thread_pool_task(self._pool, graph_task, self.max_pool_threads,
                                         weakref.ref(self))
                except BaseException as error:
                    if graph_task.on_pool_thread:
                        # Cancelled, and still run by a pool thread that
                        # serves this thread's queue: See Note [A backward
                        # that raises leaves its ready queue] in
                        # pyengine/_pure/engine.py.
                        fail_driven_graph_tasks(worker, error)
                    raise
            else:
                worker.total_depth += 1
                worker.current_depth += 1
                worker.driven_graph_tasks.append(graph_task)
                try:
                    self.thread_main(worker, graph_task)
                finally:
                    leave_driven_graph_task(worker, graph_task)
                    worker.current_depth -= 1
                    worker.total_depth -= 1
        return 0

    # -- the loop --

    cdef int thread_main(self, WorkerState worker, GraphTask graph_task) except -1:
        """Pop and run tasks until ``graph_task`` completes; for None (a device
        worker), until its queue has no task or a shutdown task comes, and
        return whether the worker serves on: 1 where its queue ran dry, or
        where an error outside any node failed the graph task of the task it
        ran (See Note [A device worker outlives its loop's errors] in
        pyengine/_pure/engine.py); 0 after a shutdown task. ``worker``: this
        thread's state."""
        cdef ReadyQueue queue = worker.local_ready_queue
        cdef NodeTaskRecord record
        cdef GraphTask local_graph_task
        cdef ThreadState* thread = thread_state()
        cdef ThreadState previous
        # See Note [Waits honour signals].
        cdef bint on_main_thread = graph_task is not None and worker.on_main_thread
        # A shutdown task this loop popped and holds for the device worker:
        # See Note [A shutdown task is the device worker's] in
        # pyengine/_pure/engine.py.
        cdef bint shutdown_held = False
        cdef bint serve_on = False
        cdef bint not_owner
        cdef Py_ssize_t left, dropped
        # Nodes of C alone (AccumulateGrad) run with no bytecode boundary:
        # See Note [Long passes let other threads run] in _interrupts.pxd.
        cdef Py_ssize_t work_left = NODES_BETWEEN_YIELDS
        try:
            while graph_task is None or not graph_task.future_completed_.load():
                if worker.has_next_task:
                    # See Note [The next task skips the queue].
                    worker.has_next_task = False
                    record = worker.next_task
                    if not worker.next_task_counted:
                        (<GraphTask>record.graph_task).outstanding_tasks_.fetch_add(1)
                    queue.push_pop_record(&record)
                elif not queue.try_pop_record(&record):
                    if graph_task is None:
                        # A device worker waits for its next task without
                        # its engine: See Note [An engine's threads hold it
                        # weakly] in pyengine/_shared/engine_registry.py.
                        serve_on = True
                        break
                    with nogil:
                        queue.pop_record(&record, on_main_thread)
                if record.is_shutdown:
                    release_record(&record)
                    if graph_task is None:
                        break
                    shutdown_held = True
                    continue
                if record.node == NULL:
                    # A wake-up task: loop back and look at graph_task again.
                    release_record(&record)
                    continue
                local_graph_task = <GraphTask>record.graph_task
                # The graph task's thread-local state while its node runs, as
                # PyTorch's ThreadLocalStateGuard.
                previous = thread[0]
                thread.current_graph_task = record.graph_task
                # See Note [Queries a running node makes] in pyengine/_shared/task_queries.py.
                thread.current_node = record.node
                thread.current_node_graph_task = record.graph_task
                thread.grad_enabled = local_graph_task.grad_mode
                # ANDed with the enclosing task's: See Note [Checkpoint valid
                # in nested backward] in pyengine/_pure/state.py.
                thread.checkpoint_valid = (local_graph_task.exec_info_.empty()
                                           and previous.checkpoint_valid)
                try:
                    if not local_graph_task.has_error_.load():
                        # In the try: an interrupt there fails the graph
                        # task as one its node raised would.
                        let_others_run(&work_left, NODES_BETWEEN_YIELDS)
                        # One check per node when nobody profiles.
                        if profiler() == NULL:
                            self.evaluate_function(worker, local_graph_task,
                                                   <NodeBase>record.node, <list>record.inputs)
                        else:
                            self.evaluate_profiled(worker, local_graph_task,
                                                   <NodeBase>record.node, <list>record.inputs)
                except BaseException as error:
                    if anomaly_enabled():
                        _hooks.add_anomaly_note(error, <object>record.node)
                    local_graph_task.set_exception(error)
                finally:
                    thread[0] = previous
                    # Drop the task's references before the graph task may complete.
                    keep_spare_list(worker, &record)
                    release_record(&record)
                if (worker.has_next_task and not worker.next_task_counted
                        and worker.next_task.graph_task == <PyObject*>local_graph_task):
                    # See Note [A held task takes over its maker's count] in
                    # pyengine/_pure/engine.py.
                    worker.next_task_counted = True
                    left = 1  # the held task
                else:
                    left = local_graph_task.outstanding_tasks_.fetch_sub(1) - 1
                # Whether this thread is the owner: See Note [The owner's
                # queue is the graph task's] in pyengine/_pure/engine.py.
                not_owner = queue is not local_graph_task.cpu_ready_queue
                if not_owner and local_graph_task.has_error_.load():
                    # Tasks this node queued for an owner that may have gone:
                    # See Note [Cancelling a graph task].
                    dropped = (owner_queue(local_graph_task)
                               .discard_graph_task_records(local_graph_task))
                    if dropped:
                        left = local_graph_task.outstanding_tasks_.fetch_sub(dropped) - dropped
                # By the count this thread's decrement left, not the count
                # now; below zero only after Python code decremented it: See
                # Note [One thread completes a graph task] in
                # pyengine/_pure/engine.py.
                if (left <= 0
                        or (local_graph_task.exit_on_error and local_graph_task.has_error_.load())):
                    local_graph_task.mark_as_completed_and_run_post_processing()
                    if not_owner:
                        # The owner may sleep in pop(): wake it up. A wake-up
                        # holds no graph task, so that one left in the queue of
                        # an owner that has gone keeps nothing alive.
                        flush_next_task(worker)
                        push_wake_up(owner_queue(local_graph_task))
                # Let go of the task now: a worker about to sleep in pop() must not
                # keep its last graph alive until the next task comes.
                local_graph_task = None
        except BaseException as error:
            # A wait interrupted (See Note [Waits honour signals]), or an error
            # outside any node: the graph task this loop drives ends with it.
            flush_next_task(worker)
            if shutdown_held:
                queue.push_shutdown()
            if graph_task is not None:
                cancel_graph_task(graph_task, error)
                raise
            if local_graph_task is None or local_graph_task.future_completed_.load():
                raise
            # A device worker's, while it ran a task: See Note [A device
            # worker outlives its loop's errors] in pyengine/_pure/engine.py.
            # (It falls through: See Note [Python allocations that fail], a
            # return in an except clause.)
            fail_in_flight_graph_task(queue, local_graph_task, error)
            serve_on = True
        # A task held back for the loop goes to the queue, as if never held.
        flush_next_task(worker)
        if shutdown_held:
            queue.push_shutdown()
        if graph_task is not None and graph_task.has_error_.load():
            queue.discard_graph_task_records(graph_task)
        return serve_on

    cdef int evaluate_function(self, WorkerState worker, GraphTask graph_task, NodeBase node,
                               list inputs) except -1:
        """Run one node on ``inputs`` (its InputBuffer's list of gradients) and
        pass its gradients on to the nodes they flow into. ``worker``: this
        thread's state, which holds back the last task queued for this
        thread (See Note [The next task skips the queue])."""
        cdef const ExecInfoEntry* info
        cdef bint needed
        cdef Py_ssize_t captures
        if not graph_task.exec_info_.empty():
            info = graph_task.exec_info_.find(<PyObject*>node)
            # Read without the mutex: no thread writes a running node's slot
            # (its count reached zero before it was queued, and remove
            # leaves a zero count as it is), and the map never grows once
            # the task has started.
            needed = graph_task.dependencies_.needed(<PyObject*>node, node._dependency_slot_)
            if info == NULL and not needed:
                return 0
            # Copied out: the entry is only valid until the next make_entry.
            needed = needed or info.needed
            captures = info.captures if info != NULL else -1
            if not needed and has_tensor_pre_hooks(node):
                # Tensor pre-hooks run exactly once: here, or in call_function.
                _hooks.call_tensor_pre_hooks(node, inputs)
            if captures >= 0:
                capture_inputs(graph_task, captures, inputs)
                if node._stream is not None:
                    graph_task.add_leaf_stream(node._stream)
            if not needed:
                return 0

        cdef object producer_stream = node._stream
        cdef list outputs
        # The edges the node's gradients go along: those it had before it
        # ran. See Note [Next edges while a node runs] in pyengine/_pure/engine.py.
        # With them, the only one, if so: See Note [A node's only next edge]
        # in pyengine/_pure/node.py.
        cdef tuple next_edges = node._next_edges
        cdef NodeBase only_next_node = node._only_next_node
        cdef Py_ssize_t only_input_nr = node._only_input_nr
        if producer_stream is None:
            outputs = call_function(graph_task, node, inputs, next_edges, only_next_node,
                                    only_input_nr)
        else:
            # See Note [Streaming backwards]: apply runs on the node's stream.
            # Not a ``with``: See Note [Python allocations that fail].
            guard = _streams.stream_guard(producer_stream)
            guard.__enter__()
            try:
                outputs = call_function(graph_task, node, inputs, next_edges, only_next_node,
                                        only_input_nr)
            finally:
                guard.__exit__(None, None, None)
        if not graph_task.keep_graph:
            release_variables(node)
        cdef Py_ssize_t num_outputs = PyList_GET_SIZE(outputs)
        if num_outputs == 0:
            if producer_stream is not None:
                graph_task.add_leaf_stream(producer_stream)
            return 0
        if anomaly_enabled() and anomaly_check_nan():
            _hooks.check_nan(node, outputs)

        cdef bint grad_mode = graph_task.grad_mode
        cdef Edge edge
        cdef NodeBase next_node
        cdef PyObject* key
        cdef bint is_ready
        cdef int remaining
        cdef InputBuffer input_buffer
        cdef object gradient
        cdef bint streamed
        # validate_outputs checked that there is one gradient per edge. The
        # node may keep the list it returned and change it while this loop
        # lets other threads run (a large add releases the GIL): each
        # gradient is read with a bound check, into a reference of our own.
        cdef Py_ssize_t next_input_nr
        cdef Py_ssize_t num_edges = (1 if only_next_node is not None
                                     else PyTuple_GET_SIZE(next_edges))
        if num_outputs != num_edges:
            raise RuntimeError(f"Function {_hooks.node_name(node)} returned {num_outputs} "
                               f"gradients for {num_edges} next edges")
        # A node with many edges routes them with no bytecode boundary: See
        # Note [Long passes let other threads run] in _interrupts.pxd (under
        # the lock too: a thread that wants it waits without the GIL, See
        # Note [Accumulating under the graph task lock]).
        cdef Py_ssize_t work_left = WORK_BETWEEN_YIELDS
        # See Note [Accumulating under the graph task lock].
        lock_mutex(graph_task)
        try:
            for i in range(num_outputs):
                if only_next_node is not None:
                    next_node = only_next_node
                    next_input_nr = only_input_nr
                else:
                    let_others_run(&work_left)
                    edge_object = <object>PyTuple_GET_ITEM(next_edges, i)
                    if edge_object is None:
                        continue
                    edge = <Edge>edge_object
                    next_node = edge.node
                    next_input_nr = edge.input_nr
                if i >= PyList_GET_SIZE(outputs):
                    raise RuntimeError(gradients_changed_message(node))
                gradient = <object>PyList_GET_ITEM(outputs, i)
                key = <PyObject*>next_node
                remaining = graph_task.dependencies_.remove(key, next_node._dependency_slot_)
                if remaining < 0:
                    raise RuntimeError(f"dependency not found for {_hooks.node_name(next_node)}")
                is_ready = remaining == 1

                buffered = graph_task.not_ready_.find(key)
                streamed = producer_stream is not None or next_node._stream is not None
                if buffered == graph_task.not_ready_.end():
                    if not task_should_execute(graph_task, key, next_node._dependency_slot_):
                        continue
                    if not streamed and is_ready:
                        # Its only gradient: what InputBuffer's first add
                        # would hold, without the InputBuffer.
                        gradients = single_gradient(
                            worker, PyTuple_GET_SIZE(next_node._input_metadata), next_input_nr,
                            gradient)
                        queue_task(worker, self.route(graph_task, next_node, gradients),
                                   graph_task, next_node, gradients)
                        continue
                    # A buffer even for a None gradient, as the twin's: See
                    # Note [Gradients left in not ready] in pyengine/_pure/graph_task.py.
                    input_buffer = new_input_buffer(PyTuple_GET_SIZE(next_node._input_metadata))
                    if not is_ready:
                        # insert, not operator[]: See Note [C++ allocations
                        # that fail]. The map's reference once it is in.
                        graph_task.not_ready_.insert(
                            pair[NodePtr, InputBufferPtr](key, <PyObject*>input_buffer))
                        Py_INCREF(input_buffer)
                else:
                    input_buffer = <InputBuffer>deref(buffered).second
                    if is_ready:
                        graph_task.not_ready_.erase(buffered)
                        # The map's reference; input_buffer still holds one.
                        Py_DECREF(input_buffer)
                if streamed:
                    accumulate_on_streams(input_buffer, next_input_nr, gradient, grad_mode,
                                          producer_stream, next_node._stream, node, i)
                else:
                    input_buffer.add(next_input_nr, gradient, grad_mode)
                if is_ready:
                    gradients = task_inputs(input_buffer)
                    queue_task(worker, self.route(graph_task, next_node, gradients),
                               graph_task, next_node, gradients)
        finally:
            graph_task.mutex_.unlock()
        return 0

    cdef int evaluate_profiled(self, WorkerState worker, GraphTask graph_task, NodeBase node,
                               list inputs) except -1:
        """evaluate_function, timed and reported to the profiler even if it fails."""
        cdef PyObject* listening = profiler()
        if listening == NULL:  # stopped since thread_main looked
            return self.evaluate_function(worker, graph_task, node, inputs)
        callback = <object>listening
        start = _perf_counter_ns()
        try:
            self.evaluate_function(worker, graph_task, node, inputs)
        finally:
            callback(node, start, _perf_counter_ns())
        return 0

    # -- devices --

    cdef ReadyQueue route(self, GraphTask graph_task, NodeBase node, list gradients):
        """The queue ``node``'s task goes to: its device's worker, or, on the
        CPU or with multithreading disabled, the graph task's CPU queue."""
        if not graph_task.multithreading:
            return graph_task.cpu_ready_queue
        cdef PyObject* gradient
        cdef Py_ssize_t i = 0
        if node._on_cpu_:
            # Borrowed items, and the size read on each turn: the list holds
            # them while this loop runs no Python code, and
            # has_numpy_backend's lookup runs some only for a key of
            # backend_of's cache whose metaclass defines __eq__ and whose
            # hash collides with the gradient type's.
            while i < PyList_GET_SIZE(gradients):
                gradient = PyList_GET_ITEM(gradients, i)
                if (gradient != <PyObject*>None
                        and <PyObject*>Py_TYPE(<object>gradient) != <PyObject*>cnp.ndarray
                        and not has_numpy_backend(<object>gradient)):
                    break
                i += 1
            else:
                return graph_task.cpu_ready_queue
        return self.ready_queue(graph_task, node_device(node, gradients))

    def ready_queue(self, GraphTask graph_task not None, device):
        """The queue a task of ``graph_task`` for ``device`` goes to, starting
        the device's worker thread on first use."""
        if device == _CPU or not graph_task.multithreading:
            return graph_task.cpu_ready_queue
        if graph_task.cpu_ready_queue is None:
            # A device's worker wakes the owner through it (stop() too).
            raise ValueError(no_ready_queue_message())
        return self._devices.queue_for(device, graph_task, weakref.ref(self))

    def _device_thread_main(self, int device_id, ReadyQueue queue not None):
        """Run the tasks of ``queue``, device ``device_id``'s, on this thread,
        its worker, until it has none or a shutdown task comes; return
        whether the worker serves on (``thread_main``'s answer)."""
        cdef WorkerState worker = get_worker_state()
        worker.worker_device = device_id
        worker.local_ready_queue = queue
        return self.thread_main(worker, None) == 1

    # -- reentrant pool --

    def _run_pool_task(self, GraphTask graph_task not None):
        """Run ``graph_task``, handed off to the reentrant pool, on this pool
        thread until it completes: the pool's call back into the engine
        (See Note [Reentrant backward] in pyengine/_pure/thread_pool.py)."""
        if graph_task.cpu_ready_queue is None:  # thread_main would pop from it
            raise ValueError(no_ready_queue_message())
        cdef WorkerState worker = get_worker_state()
        worker.worker_device = graph_task.owner
        worker.local_ready_queue = graph_task.cpu_ready_queue
        worker.total_depth = graph_task.reentrant_depth
        worker.current_depth = 0
        try:
            worker.driven_graph_tasks.append(graph_task)
            self.thread_main(worker, graph_task)
        finally:
            worker.local_ready_queue = None
            worker.worker_device = NO_DEVICE
            # The outermost backward of a pool thread: See Note [A backward
            # that raises leaves its ready queue] in pyengine/_pure/engine.py.
            clear_list(worker.driven_graph_tasks)
            worker.handoff_interrupted = False

    def stop(self, timeout=1.0):
        """Stop the device and pool threads (at interpreter exit). A backward
        still waiting for device work fails with a RuntimeError instead of
        waiting forever."""
        in_flight, device_queues, device_threads = self._devices.stop()
        error = RuntimeError(SHUTDOWN_ERROR)
        cdef GraphTask graph_task
        for task in in_flight:
            # Checked: ready_queue() adds only GraphTasks with a CPU queue,
            # but Python code can reach the set (through gc).
            graph_task = <GraphTask?>task
            if not graph_task.future_completed_.load():
                graph_task.set_exception(error)
                if graph_task.owner != NO_DEVICE:  # else no thread drives it, none waits in pop
                    push_wake_up(owner_queue(graph_task))
        for queue in device_queues:
            (<ReadyQueue>queue).push_shutdown()
        # See Note [Stopping the pool] in pyengine/_pure/thread_pool.py.
        threads = stop_thread_pool(self._pool)
        for thread in device_threads + threads:
            if thread.ident is not None:  # not one that another thread is starting
                thread.join(timeout)

    def _reset_after_fork(self):
        # The child has only the forking thread: the pool's and the devices'
        # threads are gone, and their mutexes may have been held by them.
        self._pool = _ThreadPoolShared()
        self._devices = _DeviceThreads(ReadyQueue)

    # -- callbacks --

    def queue_callback(self, callback):
        """Run ``callback`` once the current backward completes."""
        cdef PyObject* graph_task = thread_state().current_graph_task
        if graph_task == NULL:
            raise RuntimeError("Final callbacks can only be installed during backward pass.")
        (<GraphTask>graph_task).final_callbacks.append(callback)

    # Last of the methods: profile_chain.py and callgrind_steps.py name
    # execute by its place among them (Engine_3execute).
    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))


# Note [C++ allocations that fail]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The core's C++ containers (the dependency and exec_info tables,
# not_ready, the ready queues' heaps, the search's stacks) allocate with
# operator new, which throws std::bad_alloc where memory runs out: under an
# address-space limit (ulimit -v, RLIMIT_AS, common on shared clusters),
# long before the machine's memory is gone. A C++ exception that reaches a
# Cython function not declared ``except +``, or a CPython frame, ends the
# process (std::terminate); one that Cython turns into an error inside a
# ``noexcept`` function is only printed, and what the function held (a
# mutex, a task) is lost. So each allocation sits where its failure becomes
# MemoryError with nothing left half done:
# - a method that allocates is declared ``except +`` (the tables' growth,
#   ``make_entry``, ``record_marked``, ``use_kept_table``; not_ready's
#   ``insert``, never ``operator[]``) and changes nothing until its
#   allocation succeeded;
# - a constructor that runs while CPython makes an object (a GraphTask's
#   DependencyMap) never throws: without memory it makes no table, and the
#   count's first call makes one or raises;
# - a push whose heap cannot grow leaves the heap, the mutex and the task's
#   count as they were and raises (``push_record``, ``push_task``): the
#   node that made the task ready fails with it, as with any error of its
#   own. A held task that cannot be pushed stays held, and this thread's
#   loop runs it next (``flush_next_task``, ``queue_task``); where
#   ``push_pop_record`` cannot push, its task runs before the queued ones
#   instead. Only the order among ready tasks differs (See Note [Ties in
#   the ready queue] in pyengine/_pure/ready_queue.py): their dependencies
#   are met;
# - a wake-up task for an owner (a device thread completed the owner's
#   graph task) must wake it even where the heap cannot grow, or the owner
#   sleeps in pop() for good; and a shutdown task (``Engine.stop``, at
#   exit; a device thread's loop that held one) must end its device thread.
#   Neither holds anything to run, so a flag of the queue stands for each
#   where its heap cannot take it, and pops as that task, in its place in
#   the order (``pop_next`` in _node_task.h): ``push_record`` never refuses
#   them. Many wake-ups that find no room pop as one, as do shutdowns:
#   one wakes a sleeping thread as well as many, and one ends a device
#   thread's loop. ``wake()`` sets the wake-up flag itself.
# The twin's lists raise MemoryError where they cannot grow, and it takes
# the same paths. tests/test_allocation_failures.py fails each C++
# allocation of a backward in turn (tests/fail_new.cpp).


# Note [Python allocations that fail]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Where memory runs out, CPython's allocators return NULL too, and nearly
# every line of the core that touches an object may raise MemoryError: a
# list's append, an int past the small ones, a bound method, a traceback.
# Most of them are plain errors of a function declared to raise, which
# fail the node or the backward as any error does. What went wrong was
# elsewhere:
# - Cython's ``except`` clause: Cython adds the function's frame to the
#   traceback before the clause runs, and where that allocation fails the
#   caught error has no traceback; a ``return`` inside the clause then
#   releases the missing traceback (a NULL pointer) and the process
#   crashes (Cython 3.3's code; a clause that ends by falling through or
#   raising releases it with a NULL check). The error caught may also be
#   that MemoryError in place of the one the clause matched. So no clause
#   in the core returns: it sets what the function returns after it
#   (``get_worker_state`` asks getattr with a default, and has none).
#   A ``with`` statement passes a missing traceback to ``__exit__`` as a
#   NULL item of its arguments, which crashed too, where a node or an add
#   raised on a stream and that error's traceback could not be made. So
#   the core enters and exits its stream guards itself, in a ``try`` and
#   ``finally`` (``stream_guard.__exit__`` reads no error and swallows
#   none); the twin's ``with`` statements are Python's, which have no such
#   path.
# - Cython's list comprehension whose item is a new object (a call's
#   result): where the list cannot grow, its append releases the item and
#   the error path releases it again (Cython 3.3's ListComp_AppendAndDecref),
#   and an object still in use is freed (a node made while memory ran out
#   freed the InputMetadata its caller held, and the heap was corrupt
#   after). The core makes such lists with a loop and ``append``, which
#   releases the item once.
# - an error of the engine's own on a pool thread (the thread's first
#   WorkerState, its driven_graph_tasks' append) ended the thread and left
#   the graph task incomplete, and its caller waited for good: the pool
#   thread fails the task with it (``_reentrant_thread_main``).
# - a C++ mutex taken by hand stays held where what follows raises: no
#   Python object is made under the reentrant pool's mutex (a hand-off's
#   slot is a list made before it, whose item is set), and where one must
#   be (``stop_thread_pool``'s orphans), a ``finally`` unlocks.
# The ``noexcept`` functions that run with the GIL make no Python object:
# their errors would be printed ("Exception ignored in") and lost.
# CPython's own code raises other errors where its allocations fail:
# threading.local a SystemError, for a new thread's dictionary; a
# RuntimeError from MemoryError is the engine's word for a pool thread
# that could not start. tests/test_pymem_failures.py fails each Python
# allocation of a backward in turn (tests/fail_pymem.c), in the compiled
# core: the twin, Python code throughout, has none of Cython's paths, and
# its allocations fail in CPython's threading as often as in the engine.


cdef void push_wake_up(ReadyQueue queue) noexcept:
    """Queue an empty wake-up task for the thread that may sleep in
    ``queue``'s pop. Never fails: where the heap cannot grow, a flag stands
    for the task (See Note [C++ allocations that fail])."""
    queue.push_record(make_record(None, None, None, 0, 0))  # holds no reference


cdef inline int push_task(ReadyQueue queue, GraphTask graph_task, NodeBase node,
                          list inputs) except -1:
    """Queue a task of ``graph_task``, counted before another thread can pop
    it; where the queue cannot grow, neither queued nor counted (See Note
    [C++ allocations that fail])."""
    graph_task.outstanding_tasks_.fetch_add(1)
    cdef NodeTaskRecord record = make_record(graph_task, node, inputs,
                                             graph_task.reentrant_depth, node._sequence_nr)
    if not queue.push_record(record):
        release_record(&record)
        graph_task.outstanding_tasks_.fetch_sub(1)
        raise MemoryError(QUEUE_FULL_MESSAGE)
    return 0


cdef inline int queue_task(WorkerState worker, ReadyQueue queue, GraphTask graph_task,
                           NodeBase node, list inputs) except -1:
    """push_task for a task a running node made ready: one for this thread's
    own queue is held back in ``worker.next_task`` until the thread pops; a
    task held before it is pushed first. See Note [The next task skips the
    queue] in ``pyengine/_pure/engine.py``."""
    flush_next_task(worker)
    if queue is not worker.local_ready_queue or worker.has_next_task:
        # The second: the task held before could not be pushed (See Note
        # [C++ allocations that fail]), and stays held.
        return push_task(queue, graph_task, node, inputs)
    # Not counted yet: See Note [A held task takes over its maker's count]
    # in pyengine/_pure/engine.py.
    worker.next_task = make_record(graph_task, node, inputs, graph_task.reentrant_depth,
                                   node._sequence_nr)
    worker.has_next_task = True
    worker.next_task_counted = False
    return 0


cdef void fail_in_flight_graph_task(ReadyQueue queue, GraphTask graph_task, object error) noexcept:
    """A device worker's loop (serving ``queue``) raised ``error`` outside
    any node while it ran a task of ``graph_task``: that graph task fails
    with it, and its owner, if another thread, is woken to raise it. See
    Note [A device worker outlives its loop's errors] in
    pyengine/_pure/engine.py."""
    graph_task.set_exception(error)
    cdef ReadyQueue owner = graph_task.cpu_ready_queue
    # thread_main's except clause has pushed the held task already, as the
    # loop does before any wake-up.
    if owner is not None and owner is not queue:
        push_wake_up(owner)


cdef ReadyQueue owner_queue(GraphTask graph_task):
    """The queue that the thread driving ``graph_task`` waits in: its CPU
    queue, whatever device that thread serves; never None (its callers call
    its C methods). See Note [The owner's queue is the graph task's] in
    pyengine/_pure/engine.py."""
    cdef ReadyQueue queue = graph_task.cpu_ready_queue
    if queue is None:  # an owner graph's, or one made with cpu_ready_queue=None
        raise ValueError(no_ready_queue_message())
    return queue


cdef inline void leave_ready_queue(WorkerState worker) noexcept:
    """Leave the thread's ReadyQueue to the pool threads that may still
    serve it: See Note [A backward that raises leaves its ready queue] in
    ``pyengine/_pure/engine.py``. The twin also puts back per-thread state
    that an interrupt may have left half restored there; here nothing is
    interrupted between two steps."""
    worker.local_ready_queue = None
    # The thread's next backward serves its new queue alone.
    worker.handoff_interrupted = False


cdef int fail_driven_graph_tasks(WorkerState worker, object error) except -1:
    """A hand-off of this thread's was interrupted (``error``) while a pool
    thread ran its graph task, which serves this thread's queue until it is
    back: every graph task this thread drives fails with ``error`` (kept,
    so that each one's ``execute`` raises it), its tasks dropped from its
    queue, and no new backward starts here until the outermost one raises.
    See Note [A backward that raises leaves its ready queue] in
    ``pyengine/_pure/engine.py``."""
    cdef GraphTask graph_task
    worker.handoff_interrupted = True
    # A copy: set_exception may run Python code that starts or ends a level.
    cdef list driven_graph_tasks = list(worker.driven_graph_tasks)
    # All failed before any discard, which may raise: See Note [What a
    # failed graph task leaves is let go of in slices] in
    # pyengine/_pure/graph_task.py.
    for driven in driven_graph_tasks:
        (<GraphTask>driven).set_exception(error)
    for driven in driven_graph_tasks:
        graph_task = <GraphTask>driven
        graph_task.cpu_ready_queue.discard_graph_task_records(graph_task)
    return 0


cdef inline int leave_driven_graph_task(WorkerState worker, GraphTask graph_task) except -1:
    """Take ``graph_task``, whose loop on this thread ended, off the
    thread's driven graph tasks: the last one."""
    cdef list driven = worker.driven_graph_tasks
    if PyList_GET_SIZE(driven) and PyList_GET_ITEM(driven, PyList_GET_SIZE(driven) - 1) == \
            <PyObject*>graph_task:
        driven.pop()
    return 0


cdef inline void flush_next_task(WorkerState worker) noexcept:
    """Push the task ``worker`` holds back, if any, onto its queue, where it
    would have been all along. Where the queue cannot grow, the task stays
    held, for this thread's loop to run next (See Note [C++ allocations that
    fail])."""
    if not worker.has_next_task:
        return
    cdef bint counting = not worker.next_task_counted
    if counting:
        # Before another thread can pop it.
        (<GraphTask>worker.next_task.graph_task).outstanding_tasks_.fetch_add(1)
    if not worker.local_ready_queue.push_record(worker.next_task):
        if counting:
            (<GraphTask>worker.next_task.graph_task).outstanding_tasks_.fetch_sub(1)
        return
    worker.has_next_task = False


cdef object gradient_stream(NodeBase node, Py_ssize_t i, object producer_stream):
    """The stream gradient ``i`` of ``node`` was written on: a GraphRoot's
    root ``i``'s, one per root (See Note [Streaming backwards]), else the
    stream ``node`` ran on. A root whose edges Python code changed since it
    was made may have more gradients than streams: ``producer_stream``
    stands in for the others."""
    if type(node) is not GraphRoot:
        return producer_stream
    cdef tuple root_streams = (<GraphRoot>node)._root_streams
    if i < PyTuple_GET_SIZE(root_streams):
        return <object>PyTuple_GET_ITEM(root_streams, i)
    return producer_stream


cdef int accumulate_on_streams(InputBuffer input_buffer, Py_ssize_t input_nr, object gradient,
                               bint grad_mode, object producer_stream, object consumer_stream,
                               NodeBase producer=None, Py_ssize_t output_nr=0) except -1:
    """Add a gradient into a consumer's buffer after the syncs it needs, on the
    stream they choose. See Note [Which stream waits where a gradient enters
    a buffer] in pyengine/streams.py. ``producer``: the node whose output
    ``output_nr`` the gradient is (None for a root gradient); the stream it
    was written on is chosen here, off a CPU node's path."""
    if producer is not None:
        producer_stream = gradient_stream(producer, output_nr, producer_stream)
    if producer_stream is None and consumer_stream is None:
        # No stream to sync or to add on, as the twin: accumulation_stream
        # would ask the gradient's backend its device for nothing (a root
        # gradient of a framework's type on the CPU, a GraphRoot's root
        # without a stream), one call more than the twin makes.
        input_buffer.add(input_nr, gradient, grad_mode)
        return 0
    # Not a ``with``: See Note [Python allocations that fail].
    guard = _streams.stream_guard(_streams.accumulation_stream(gradient, producer_stream,
                                                               consumer_stream))
    guard.__enter__()
    try:
        input_buffer.add(input_nr, gradient, grad_mode)
    finally:
        guard.__exit__(None, None, None)
    return 0


cdef inline list task_inputs(InputBuffer input_buffer):
    """``input_buffer``'s list, as the inputs of its node's task, which the
    engine reads in C: never None (See input_buffer_list_gone_message)."""
    cdef list inputs = input_buffer.buffer
    if inputs is None:
        raise RuntimeError(input_buffer_list_gone_message())
    return inputs


cdef list single_gradient(WorkerState worker, Py_ssize_t num_inputs, Py_ssize_t input_nr,
                          object gradient):
    """``num_inputs`` slots, all None but ``input_nr``, which holds
    ``gradient``: what an InputBuffer holds after that one add (which grows
    it to fit a gradient beyond its slots, but not a None). In the list
    ``worker`` keeps spare when it has that size."""
    cdef Py_ssize_t size = (num_inputs if gradient is None or input_nr < num_inputs
                            else input_nr + 1)
    cdef list gradients = take_spare_list(worker, size)
    if gradients is None:
        gradients = [None] * size
    if gradient is not None:
        # The slot holds None (either list): replace it, dropping that reference.
        Py_INCREF(gradient)
        Py_DECREF(<object>PyList_GET_ITEM(gradients, input_nr))
        PyList_SET_ITEM(gradients, input_nr, gradient)
    return gradients


cdef inline list take_spare_list(WorkerState worker, Py_ssize_t size):
    """The list ``worker`` keeps spare, if it has ``size`` slots and nothing
    else refers to it now; None otherwise. The spare is given up either way.
    See Note [Reusing a task's gradients list] in pyengine/_pure/engine.py."""
    cdef list spare = worker.spare_list
    if spare is None:
        return None
    worker.spare_list = None
    # Ours alone: ``spare`` is its one reference.
    if PyList_GET_SIZE(spare) != size or Py_REFCNT(spare) != 1:
        return None
    # Still all None: code that reached the list without keeping a
    # reference (a __del__ through gc.get_referrers) may have filled a slot.
    cdef Py_ssize_t i
    for i in range(size):
        if PyList_GET_ITEM(spare, i) != <PyObject*>None:
            return None
    return spare


cdef void keep_spare_list(WorkerState worker, NodeTaskRecord* record) noexcept:
    """Keep the gradients list of a task that ran, its slots set to None, in
    ``worker`` for the next ``single_gradient``, when nothing but the record
    refers to it and ``worker`` keeps none yet; the record lets go of it.
    Needs the GIL. See Note [Reusing a task's gradients list] in
    pyengine/_pure/engine.py."""
    cdef PyObject* inputs = record.inputs
    if (worker.spare_list is not None or inputs == NULL or not PyList_CheckExact(<object>inputs)
            or Py_REFCNT(<object>inputs) != 1):
        return
    cdef PyObject* item
    cdef Py_ssize_t i = 0
    # Dropping a gradient may run Python code (a __del__), which may take
    # references or change the list: each step looks again.
    while i < PyList_GET_SIZE(<object>inputs):
        item = PyList_GET_ITEM(<object>inputs, i)
        i += 1
        if item != <PyObject*>None:
            Py_INCREF(None)
            PyList_SET_ITEM(<object>inputs, i - 1, None)
            Py_DECREF(<object>item)
    if worker.spare_list is None and Py_REFCNT(<object>inputs) == 1:
        worker.spare_list = <list>inputs
        # The record's reference; worker.spare_list holds its own.
        record.inputs = NULL
        Py_DECREF(<object>inputs)


def _reset_worker_state_after_fork():
    global _thread_local
    _thread_local = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_worker_state_after_fork)
