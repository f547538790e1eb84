"""GraphTask: the state of one backward or grad call.

Twin of ``pyengine/_graph_task.pyx``. A GraphTask lives from ``execute`` until
its caller has read its result; NodeTasks point back to it.
"""

import sys
import threading
import weakref

from .. import streams
from .._shared import node_streams, task_queries
from .._shared.messages import (
    GRAPH_TASK_INITIALIZED_WHY,
    cannot_pickle_message,
    initialized_once_message,
    lock_taken_again_message,
    node_name,
    not_ready_message,
    waits_for_itself_message,
)
from . import state
from .condition import Condition
from .node import NodeBase, _checked_field, _free_field, _not_list, _read_only_field, _read_only_property
from .ready_queue import is_main_thread, wait_honouring_signals
from .static_types import as_ssize_t, c_int_attribute, check_argument, check_new, final


@final
class ExecInfo:
    """Whether a node runs under ``grad(inputs=)`` / ``backward(inputs=)``
    pruning, and which of its inputs to capture as results.

    ``captures`` holds ``(input_nr, output_idx)`` pairs. Written only by
    ``init_to_execute``, before any task runs. The compiled core keeps the
    same fields per node in a C table keyed by node pointer
    (``GraphTask.exec_info_``, ``pyengine/_exec_info_map.h``) and makes
    ExecInfo objects only as copies for Python.
    """

    __slots__ = ("needed_", "captures_")

    # Read only to Python code, as the compiled copies' fields: the engine
    # writes the slots.
    needed = _read_only_field("needed", "needed_")
    captures = _read_only_field("captures", "captures_")

    def __new__(cls):
        # The fields at allocation, as the compiled class's __cinit__ makes
        # them; its __init__ is object's, which a second call, with any
        # arguments, leaves as it was. See Note [A class's __new__ called
        # with another class] in pyengine/_pure/static_types.py.
        if cls.__new__ is not ExecInfo.__new__:
            check_new(ExecInfo, cls)
        self = object.__new__(cls)
        self.needed_ = False
        self.captures_ = []
        return self

    def should_execute(self):
        return self.needed_ or bool(self.captures_)

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))


def copy_exec_info(info):
    """A copy of exec_info entry ``info``, its own captures list: what the
    compiled core makes for Python, which can change a copy but never the
    entry the engine reads."""
    copy = ExecInfo()
    copy.needed_ = info.needed_
    copy.captures_ = list(info.captures_)
    return copy


def refuse_lock_taken_again(graph_task):
    """Raise RuntimeError where this thread holds ``graph_task.mutex``:
    called before each ``with graph_task.mutex``. Python code may run under
    the lock (a backend's add, a dropped value's ``__del__``), and if it
    asks for the lock again, the thread would wait for itself forever. The
    lock is a ``threading.RLock`` only so that its owner can be asked; it is
    never taken twice. A signal ends its wait for another thread's hold
    (KeyboardInterrupt), as it ends any lock's wait. The compiled core's
    ``lock_mutex`` gives the same two answers: See Note [A lock the GIL
    guards] in ``pyengine/_gil_guarded_lock.h``."""
    # _is_owned: the C RLock's own check, which threading.Condition uses.
    if graph_task.mutex._is_owned():
        raise RuntimeError(lock_taken_again_message())


# Note [A graph task's fields from Python]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Python code reaches a running graph task (a node asks
# ``state.get_current_graph_task()``) and may write its fields. The
# compiled GraphTask keeps them in C: most are ``readonly`` or read-only
# views of C state (``outstanding_tasks``, ``has_error``,
# ``future_completed``, ``exception``, ``exec_info``), AttributeError when
# written; ``owner`` is a ``public int`` (converted as any C int: See Note
# [The engine's bounds are C ints]); ``captured_vars``, ``leaf_streams`` and
# ``final_callbacks`` are ``public list`` (a list or None, else TypeError;
# deleting one stores None); ``graph_root`` takes any object (deleting it
# stores None). ``exec_info`` and ``find_exec_info`` give copies, their
# own ExecInfo objects and captures lists, in both cores: the twin gave its
# live dict before, which a node could clear or fill (the rest of its
# backward then captured nothing, or pruned every node). The twin
# refuses and converts the same, through properties over attributes with a
# trailing "_" that the engine itself writes: it took any value before,
# and failed later (a str as captured_vars) or waited forever (a running
# task's outstanding_tasks written). Those attributes, and the twin's
# ``mutex``, ``dependencies``, ``not_ready``, ``planning`` and
# ``on_pool_thread``, are the state the compiled core keeps in C, out of
# Python's reach: the twin's are plain Python, so code that writes them
# changes its engine's state (``outstanding_tasks_`` written still leaves a
# backward waiting), as writing any private attribute of a Python library
# may.


@final
class GraphTask:
    """Fields and how they are guarded:

    Immutable after ``execute`` pushed the first task: ``keep_graph``,
    ``grad_mode``, ``reentrant_depth``, ``cpu_ready_queue``, ``owner``,
    ``exec_info``, ``multithreading``, ``caller_current_streams``.

    Guarded by ``mutex``: ``dependencies`` and ``not_ready`` (both keyed by
    ``id(node)``: nodes are kept alive by the graph, and a user's ``__eq__``
    must not matter), ``captured_vars``, ``leaf_streams``.

    Guarded by ``_outstanding_lock`` (it stands for C++'s std::atomic):
    ``outstanding_tasks``.

    Set once, under ``_completion``'s lock: ``future_completed``,
    ``exception``, ``_completing``; ``has_error`` is written under it and read without it.

    ``final_callbacks``: appended and iterated under the GIL.

    What Python code may write, as in the compiled class: See Note [A graph
    task's fields from Python]: ``owner`` (a C int), ``graph_root``, and
    ``captured_vars``, ``leaf_streams``, ``final_callbacks`` (a list or
    None); the rest is read only, kept in a slot with a trailing "_".
    """

    # No __dict__, as the compiled class has none: a name it lacks is an
    # AttributeError when written.
    __slots__ = ("keep_graph_", "grad_mode_", "reentrant_depth_", "cpu_ready_queue_",
                 "exit_on_error_", "multithreading_", "caller_current_streams_", "owner_",
                 "graph_root_", "on_pool_thread", "mutex", "dependencies", "not_ready",
                 "exec_info_", "planning", "captured_vars_", "leaf_streams_", "final_callbacks_",
                 "outstanding_tasks_", "_outstanding_lock", "has_error_", "exception_",
                 "future_completed_", "_completing", "_completion", "initialized_",
                 "enclosing_graph_task_", "__weakref__")

    keep_graph = _read_only_field("keep_graph", "keep_graph_")
    grad_mode = _read_only_field("grad_mode", "grad_mode_")
    reentrant_depth = _read_only_field("reentrant_depth", "reentrant_depth_")
    cpu_ready_queue = _read_only_field("cpu_ready_queue", "cpu_ready_queue_")
    exit_on_error = _read_only_field("exit_on_error", "exit_on_error_")
    multithreading = _read_only_field("multithreading", "multithreading_")
    caller_current_streams = _read_only_field("caller_current_streams", "caller_current_streams_")
    outstanding_tasks = _read_only_field("outstanding_tasks", "outstanding_tasks_")
    has_error = _read_only_field("has_error", "has_error_")
    exception = _read_only_field("exception", "exception_")
    future_completed = _read_only_field("future_completed", "future_completed_")
    owner = c_int_attribute("owner_")
    graph_root = _free_field("graph_root", "graph_root_")
    captured_vars = _checked_field("captured_vars", "captured_vars_", _not_list, "list")
    leaf_streams = _checked_field("leaf_streams", "leaf_streams_", _not_list, "list")
    final_callbacks = _checked_field("final_callbacks", "final_callbacks_", _not_list, "list")

    def __new__(cls, *args, **kwargs):
        # What the compiled type's allocation makes, __init__ or not (C's
        # zeroes and None; its C++ members constructed): the plan, the
        # tables, the locks and the error are not __init__'s, so that a
        # second __init__ leaves a planned task's plan as the compiled one
        # does.
        if cls.__new__ is not GraphTask.__new__:
            check_new(GraphTask, cls)
        self = object.__new__(cls)
        self.keep_graph_ = self.grad_mode_ = self.exit_on_error_ = self.multithreading_ = False
        self.reentrant_depth_ = self.owner_ = self.outstanding_tasks_ = 0
        self.cpu_ready_queue_ = self.caller_current_streams_ = self.graph_root_ = None
        self.captured_vars_ = self.leaf_streams_ = self.final_callbacks_ = None
        self.on_pool_thread = self.has_error_ = self.future_completed_ = False
        self.exception_ = None
        # A weak reference to the graph task whose node or final callback
        # started this one (the thread's current graph task when it was
        # made), or None: See Note [A graph task waits for itself].
        self.enclosing_graph_task_ = None
        # An RLock only to be asked its owner: See refuse_lock_taken_again.
        self.mutex = threading.RLock()
        self.dependencies = {}
        self.not_ready = {}
        self.exec_info_ = {}
        # Set while init_to_execute plans the task: a second call is refused.
        self.planning = False
        self._outstanding_lock = threading.Lock()
        self._completing = False
        self._completion = Condition()
        self.initialized_ = False
        return self

    def __init__(self, keep_graph, grad_mode, reentrant_depth, cpu_ready_queue, exit_on_error=False,
                 multithreading=True):
        if self.initialized_:
            raise TypeError(initialized_once_message(self, GRAPH_TASK_INITIALIZED_WHY))
        # The compiled _init_fields' fields: See GraphTask.__new__.
        self.initialized_ = True
        self.keep_graph_ = keep_graph
        self.grad_mode_ = grad_mode
        self.reentrant_depth_ = reentrant_depth
        self.cpu_ready_queue_ = cpu_ready_queue
        self.exit_on_error_ = exit_on_error
        # Whether device tasks go to device threads; else all to cpu_ready_queue.
        self.multithreading_ = multithreading
        # The caller's current stream per device, stashed when the task is
        # made. See Note [Streaming backwards].
        self.caller_current_streams_ = streams.current_streams()
        # NO_DEVICE (pyengine/_pure/engine.py) until execute sets it.
        self.owner_ = -2
        # Guarded by the engine's pool lock. See Note [A pool thread is back
        # before its caller] in pyengine/_pure/thread_pool.py.
        self.on_pool_thread = False
        self.captured_vars_ = []
        self.leaf_streams_ = []
        self.final_callbacks_ = []
        self.outstanding_tasks_ = 0
        self.has_error_ = False
        self.future_completed_ = False

    # -- outstanding tasks ------------------------------------------------

    def increment_outstanding_tasks(self):
        with self._outstanding_lock:
            self.outstanding_tasks_ += 1

    def decrement_outstanding_tasks(self):
        """One task fewer; returns how many are left: See Note [One thread
        completes a graph task] in pyengine/_pure/engine.py."""
        with self._outstanding_lock:
            self.outstanding_tasks_ -= 1
            return self.outstanding_tasks_

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))

    def completed(self):
        """All tasks ran (or failed, when the task exits on the first error)."""
        return self.outstanding_tasks == 0 or (self.exit_on_error and self.has_error)

    def add_leaf_stream(self, stream):
        """Remember a stream a leaf gradient was written on (under ``mutex``)."""
        refuse_lock_taken_again(self)
        with self.mutex:
            if stream not in self.leaf_streams:
                self.leaf_streams.append(stream)

    def can_checkpoint(self):
        """A reentrant checkpoint needs every node to run: no pruning."""
        return not self.exec_info_

    # -- exec_info, for Python: copies, as the compiled core's (See Note [A
    # graph task's fields from Python]) --

    # ``{id(node): ExecInfo}`` in the order the entries were made: a copy,
    # for tests and debugging.
    exec_info = _read_only_property("exec_info", lambda self: {
        key: copy_exec_info(info) for key, info in self.exec_info_.items()})

    def find_exec_info(self, node):
        """A copy of ``node``'s entry of exec_info, or None."""
        info = self.exec_info_.get(id(node))
        return None if info is None else copy_exec_info(info)

    # -- what a running node asks: Node.task_should_compute_output and
    # Node.task_buffered_gradient (See Note [Queries a running node makes]
    # in pyengine/_shared/task_queries.py) --

    def should_execute(self, node):
        """Whether ``node`` runs or captures in this task: every node does
        without exec_info."""
        refuse_lock_taken_again(self)
        with self.mutex:
            return task_should_execute(self, id(node))

    def should_compute_output(self, node, output_edge_index):
        """``node.task_should_compute_output(output_edge_index)``, ``node``
        being a node this task runs: whether next edge ``output_edge_index``
        leads to a node that runs or captures (every node does without
        exec_info), False for a missing edge. Same name, same steps in the
        compiled core."""
        check_argument("node", node, NodeBase)
        edges = node._next_edges
        index = -1
        if type(output_edge_index) is int:
            # The usual call: a frontend's formulas ask once per input of
            # every node they run.
            index = output_edge_index
        if not 0 <= index < len(edges):
            # The index's __index__ may run Python code that sets the
            # node's edges: read them again after it, and check the index
            # against them here too, as no unchecked index reaches
            # PyTuple_GET_ITEM.
            index = task_queries.checked_output_edge_index(
                node, "task_should_compute_output", output_edge_index)
            edges = node._next_edges
            if not 0 <= index < len(edges):
                raise RuntimeError(f"{node_name(node)}'s next edges changed during "
                                   "task_should_compute_output")
        edge = edges[index]
        if edge is None:
            return False
        refuse_lock_taken_again(self)
        with self.mutex:
            return task_should_execute(self, id(edge.node))

    def buffered_gradient(self, node, input_nr):
        """A copy of what ``node``'s InputBuffer in not_ready holds at
        ``input_nr``, made under the mutex; None where it holds nothing."""
        input_nr = as_ssize_t(input_nr)
        refuse_lock_taken_again(self)
        with self.mutex:
            input_buffer = self.not_ready.get(id(node))
            if input_buffer is None:
                return None
            return task_queries.buffered_copy(input_buffer.buffer, input_nr)

    # -- execution plan ---------------------------------------------------

    def init_to_execute(self, graph_root, outputs, accumulate_grad):
        """Mark the nodes on a path from ``graph_root`` to an edge of
        ``outputs`` (a sequence of Edges) in exec_info, counting the
        dependencies in the same search: ``init_to_execute`` in
        ``pyengine/_pure/dependencies.py``, which the engine calls."""
        from .dependencies import init_to_execute
        init_to_execute(graph_root, self, outputs, accumulate_grad)

    # -- completion -------------------------------------------------------

    def set_exception(self, exception):
        """Record the first error and complete the task's future with it."""
        with self._completion:
            self.has_error_ = True
            if not self.future_completed:
                self.exception_ = exception
                # No final callback runs after an error.
                self._completing = True
                self.future_completed_ = True
                self._completion.notify_all()

    def mark_as_completed_and_run_post_processing(self):
        """Run the final callbacks and complete the future, once, on one thread;
        another thread that gets here waits until that is done."""
        with self._completion:
            completing = self._completing
            self._completing = True
        if completing:
            self.wait()
            return
        try:
            self.exec_post_processing()
        except BaseException as error:
            self.set_exception(error)
        else:
            with self._completion:
                if not self.future_completed:
                    self.future_completed_ = True
                    self._completion.notify_all()

    def exec_post_processing(self):
        """Make the caller's streams wait on the leaf streams, then run final
        callbacks; a callback may queue more, which run too. Callbacks run
        under the graph task's grad mode (off, or on under ``create_graph``),
        as PyTorch's run under the graph task's thread-local state: whoever
        completes the task (its caller, a device thread, a nested task's
        node) may have another grad mode. First, a node that got some of its
        gradients but never ran fails the task: See Note [Gradients left in
        not ready]."""
        check_not_ready_empty(self)
        # Only when there are any (as the compiled core, which calls no
        # Python code otherwise): None, which Python code may set, is none.
        if self.leaf_streams:
            node_streams.sync_leaf_streams(self)
        previous = state.set_current_graph_task(self)
        previous_grad_mode = state.is_grad_enabled()
        state.set_grad_enabled(self.grad_mode)
        try:
            i = 0
            while i < len(self.final_callbacks):
                self.final_callbacks[i]()
                i += 1
        finally:
            state.set_grad_enabled(previous_grad_mode)
            state.set_current_graph_task(previous)

    def wait(self):
        """Block until the future completed. On the main thread a signal
        handler's exception (KeyboardInterrupt) ends the wait: See Note [Waits
        honour signals] in ``pyengine/_locks.pxd``; the caller cancels what it
        waited for. Refused where the task waits for this thread: See Note
        [A graph task waits for itself]."""
        if self.future_completed:
            return
        current = running = state.get_current_graph_task()
        while running is not None:
            if running is self:
                raise RuntimeError(waits_for_itself_message(nested=current is not self))
            # A reference that died ends the chain: what it named completed.
            link = running.enclosing_graph_task_
            running = link() if link is not None else None
        on_main_thread = is_main_thread()
        with self._completion:
            while not self.future_completed:
                wait_honouring_signals(self._completion, on_main_thread)


# Note [A graph task waits for itself]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# While a thread runs a node, a hook or a final callback of graph task T
# (T is its current graph task), T cannot complete without that thread: the
# node's task is one of T's outstanding tasks until it returns, and a final
# callback runs inside T's completion. So ``T.wait()`` there would wait for
# itself forever (or until another thread's error ended T). PyTorch's
# GraphTask is out of Python's reach; here a node reaches it
# (``get_current_graph_task()``) and may call ``wait()``, or
# ``mark_as_completed_and_run_post_processing()``, which waits where
# another call already completes the task: from a final callback, itself.
# Both cores refuse the wait with a RuntimeError, which the node or
# callback raises as its own error.
#
# So is a wait for T from a backward nested in one of T's nodes or final
# callbacks, on any thread that runs the nested backward's work (its own,
# a pool thread it handed off to, a device thread): the node that started
# the nested backward waits for it, so T cannot complete before it does.
# The thread's current graph task is then the nested one, N; execute (and
# an owner graph's walk) records in N the thread's current graph task when
# it made N (``link_enclosing_graph_task``), and wait() walks that chain
# from the thread's current graph task. The chain is one link per level
# of nesting, walked once per wait. A link is a weak reference: N, kept by
# Python code after its backward, keeps no enclosing task alive, and a
# link whose task is gone ends the chain (that task completed). Not
# caught: a wait across threads the engine does not know of (a node that
# starts a Python thread, which runs a backward and waits for T, and joins
# it); on the main thread Ctrl-C ends such a wait.


# Note [Gradients left in not ready]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A node's InputBuffer waits in ``not_ready`` from its first gradient until
# the last of the edges counted into it delivers. When every task ran and a
# buffer is still there, some edge counted by compute_dependencies never
# delivered: a hook or node changed a producer's next_edges after the count
# (See Note [Next edges while a node runs] in pyengine/_pure/engine.py), so
# the node never ran and gradients that reached it are lost. PyTorch 2.x
# fails the backward then, in ``GraphTask::exec_post_processing``, before any
# final callback runs, with "could not compute gradients for some
# functions"; so do both cores, and say how many nodes were left. A node
# that no gradient reached at all has no buffer and is not an error, as in
# PyTorch. The compiled core puts a buffer in ``not_ready`` for exactly the
# nodes the twin does (for a None gradient too), so that both fail alike.


# Note [What a failed graph task leaves is let go of in slices]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A graph task that fails (or is cancelled) may leave a million objects
# behind: tasks queued (its root's gradient sent to a million nodes, one of
# which raised), InputBuffers in ``not_ready`` (a million nodes that got
# one of their two gradients), or gradients that ``grad()`` captured for a
# million inputs before a node raised. Letting go of them frees their
# gradients, a few hundred nanoseconds each: a third of a second of C with
# the GIL held, in which other threads waited and after which Ctrl-C came
# out. So:
#
# - ``discard_graph_task`` copies, under the queue's lock, only the tasks
#   it keeps (into a new heap); the dropped ones stay in the old heap's
#   storage, which the compiled core compacts outside the lock (new storage
#   for a million records cost its fresh pages under the lock);
#   ``release_leftovers``, which ``execute`` calls before it raises the
#   task's error, takes the whole of not_ready and the list of captured
#   gradients under the task's lock, if that is free: another thread may
#   hold it as long as it likes (a node of the task still running on a
#   device, in an add that waits), and the error must not wait for it;
# - ``release_dropped_tasks`` and ``release_leftovers`` let them go outside
#   the lock, letting other threads run and signal handlers between slices
#   of them: Python loops in the twin, WORK_BETWEEN_YIELDS objects a slice
#   in the compiled core (See Note [Long passes let other threads run] in
#   ``pyengine/_interrupts.pxd``). The compiled core then frees the map's
#   own storage, a block per entry, without the GIL: glibc's malloc gathers
#   a million freed small blocks up at its next large free
#   (``malloc_consolidate``), which took 40 ms with the GIL held.
#
# What a signal handler raises there comes out once every object is let
# go of: the compiled core's records and map own references that nothing
# else would drop, and the twin's list or dict would live on in the
# traceback's frames. The slices after it run with no yield between them
# (a second Ctrl-C would be lost there). The caller then sees the error in
# place of the number of tasks dropped, or of the task's own error: the
# callers that go on to other graph tasks (``fail_driven_graph_tasks``,
# ``stop_thread_pool``) fail them all before they raise it, and the one
# that counts the tasks dropped runs on a device's worker thread, which
# runs no signal handler (and where an error fails the graph task: See
# Note [A device worker outlives its loop's errors] in
# ``pyengine/_pure/engine.py``). A task whose not_ready still holds
# buffers when its last reference goes (its lock was held, it was
# cancelled while another thread ran it, or Python code made it) lets go
# of them in its deallocation, at once: a deallocation cannot raise what a
# signal handler raises.


def release_leftovers(graph_task):
    """Let go of what ``graph_task``, which failed, leaves: the InputBuffers
    that wait in its not_ready (their nodes will not run) and the gradients
    it captured for ``grad()``. See Note [What a failed graph task leaves is
    let go of in slices]."""
    # As the compiled core's try_lock: never waits, and false where any
    # thread holds the lock, this one included.
    if graph_task.mutex._is_owned() or not graph_task.mutex.acquire(blocking=False):
        # Another thread holds it, in a node of this task still running
        # (an add that takes its time, or waits): what is left goes with
        # the task, rather than this error wait for it.
        return
    try:
        # A thread still running a node of it buffers into the task's new
        # dict, and captures into its new list (a capture out of its range
        # fails that node, of a task that failed already).
        taken, graph_task.not_ready = graph_task.not_ready, {}
        captured, graph_task.captured_vars_ = graph_task.captured_vars_, []
    finally:
        graph_task.mutex.release()
    # Emptied only where nothing else holds it (the count: this name and
    # getrefcount's argument): Python code may have kept the list (or put
    # one of its own in its place).
    owned = type(captured) is list and sys.getrefcount(captured) == 2
    try:
        while taken:
            taken.popitem()
        while owned and captured:
            captured.pop()
    finally:
        taken.clear()
        if owned:
            captured.clear()


def check_not_ready_empty(graph_task):
    """Raise RuntimeError if a node's gradients wait in ``not_ready`` when the
    task completes. See Note [Gradients left in not ready]."""
    refuse_lock_taken_again(graph_task)
    with graph_task.mutex:
        count = len(graph_task.not_ready)
    if count:
        raise RuntimeError(not_ready_message(count))


def link_enclosing_graph_task(graph_task):
    """Record in ``graph_task``, made by a backward that this thread starts,
    the graph task whose node or final callback this thread runs, if any:
    See Note [A graph task waits for itself]."""
    current = state.get_current_graph_task()
    if current is not None:
        graph_task.enclosing_graph_task_ = weakref.ref(current)


def cancel_graph_task(graph_task, error):
    """End ``graph_task`` with ``error``, which its caller raises itself: See
    Note [Cancelling a graph task] in pyengine/_pure/engine.py."""
    graph_task.set_exception(error)
    # The caller raises the error: the task must not keep it (and its traceback).
    if graph_task.exception is error:
        graph_task.exception_ = None
    graph_task.cpu_ready_queue.discard_graph_task(graph_task)


def task_should_execute(graph_task, key):
    """Whether the node of id ``key`` runs or captures in ``graph_task``:
    every node does without exec_info. Under the graph task's mutex, or
    before any task runs."""
    if not graph_task.exec_info_:
        return True
    info = graph_task.exec_info_.get(key)
    return info is not None and info.should_execute()
