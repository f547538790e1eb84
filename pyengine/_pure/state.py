"""Per-thread and global engine state: grad mode, anomaly mode, the graph
task running on this thread, whether a reentrant checkpoint is valid here.

Twin of ``pyengine/_state.pyx``. Grad mode and the current graph task are
per thread; anomaly mode is global, as in PyTorch.

Note [Checkpoint valid in nested backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A reentrant checkpoint recomputes its forward inside backward and runs a
nested backward over it; that is only right when every node of every
backward on this thread's stack runs, since a pruned one (``grad``,
``inputs=``) would skip what the checkpoint relies on. So while a node runs,
``checkpoint_valid`` is the node's graph task's ``can_checkpoint()`` ANDed
with the value the thread had before, as PyTorch's CheckpointValidGuard
(engine.cpp, ``call_function``) sets it: a plain ``backward()`` nested in a
node of a ``grad()`` call, and anything nested below it, sees False. The
value is restored when the node returns; final callbacks see the value of
whoever completes the task (True outside any backward).
"""

import threading

from .static_types import check_new


class _ThreadState(threading.local):
    # Each attribute is per thread: no lock needed.
    grad_enabled = True
    # The GraphTask whose node this thread is running, or None outside backward.
    current_graph_task = None
    # False while a node of a pruning graph task (grad, inputs=) runs.
    checkpoint_valid = True
    # Whether device work goes to device threads (else all on the caller).
    multithreading_enabled = True
    # The node the engine runs on this thread and the graph task running
    # it: See Note [Queries a running node makes] in
    # pyengine/_shared/task_queries.py.
    current_node = None
    current_node_graph_task = None


_thread_state = _ThreadState()

# Global, written rarely, read per node: guarded by the GIL.
_anomaly_enabled = False
_anomaly_check_nan = True


# Called after every node when set: guarded by the GIL.
_profiler = None


def set_profiler(callback):
    """Call ``callback(node, start_ns, end_ns)`` on the thread that ran it,
    after every node any engine runs (``time.perf_counter_ns`` clock); None
    stops. Returns the previous callback. See pyengine.profiler."""
    global _profiler
    previous, _profiler = _profiler, callback
    return previous


def profiler():
    return _profiler


def is_grad_enabled() -> bool:
    return _thread_state.grad_enabled


def set_grad_enabled(enabled: bool) -> None:
    _thread_state.grad_enabled = bool(enabled)


def is_anomaly_enabled() -> bool:
    return _anomaly_enabled


def is_anomaly_check_nan_enabled() -> bool:
    return _anomaly_check_nan


def set_anomaly_enabled(enabled: bool, check_nan: bool = True) -> None:
    global _anomaly_enabled, _anomaly_check_nan
    _anomaly_enabled = bool(enabled)
    _anomaly_check_nan = bool(check_nan)


class RestoreOnExit:
    """A base for context managers that put something back on exit:
    ``__exit__`` calls ``restore(*restore_args)`` where ``restore`` is not
    None. The compiled class's ``__exit__`` is C; this one is a Python
    frame, at whose entry Ctrl-C can still come out before the restore.
    See Note [A mode context under an interrupt] in pyengine/grad_mode.py."""

    restore = None
    restore_args = ()

    def __new__(cls, *args, **kwargs):
        # See Note [A class's __new__ called with another class] in
        # pyengine/_pure/static_types.py.
        if cls.__new__ is not RestoreOnExit.__new__:
            check_new(RestoreOnExit, cls)
        return object.__new__(cls)

    def __exit__(self, *exc_info):
        restore = self.restore
        if restore is not None:
            restore(*self.restore_args)
        return False


def is_checkpoint_valid() -> bool:
    """False while a node of a backward that prunes nodes (``grad``,
    ``inputs=``), or of a backward nested in one, runs on this thread; True
    elsewhere. See Note [Checkpoint valid in nested backward]."""
    return _thread_state.checkpoint_valid


def swap_checkpoint_valid(valid):
    """Set whether a checkpoint is valid on this thread; return the previous value."""
    previous = _thread_state.checkpoint_valid
    _thread_state.checkpoint_valid = valid
    return previous


def is_multithreading_enabled() -> bool:
    return _thread_state.multithreading_enabled


def set_multithreading_enabled(enabled: bool) -> None:
    _thread_state.multithreading_enabled = bool(enabled)


def get_current_graph_task():
    return _thread_state.current_graph_task


def set_current_graph_task(graph_task):
    """Make ``graph_task`` current on this thread; return the previous one."""
    previous = _thread_state.current_graph_task
    _thread_state.current_graph_task = graph_task
    return previous


def get_current_node():
    """The node the engine runs on this thread under the current graph
    task, or None: See Note [Queries a running node makes] in
    pyengine/_shared/task_queries.py."""
    thread = _thread_state
    if thread.current_graph_task is None or thread.current_node_graph_task is not thread.current_graph_task:
        return None
    return thread.current_node


def set_current_node(node, graph_task):
    """Record that the engine runs ``node`` of ``graph_task`` on this thread
    (None, None: none); return the previous pair."""
    thread = _thread_state
    previous = (thread.current_node, thread.current_node_graph_task)
    thread.current_node = node
    thread.current_node_graph_task = graph_task
    return previous
