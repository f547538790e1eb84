"""Per-thread and global engine state: grad mode, anomaly mode, the graph
task running on this thread, whether a reentrant checkpoint is valid here.

The per-thread part is one C++ ``thread_local`` struct. ``thread_state()``
returns its address, which stays valid for the thread's life, so the engine
loop looks it up once and then sets and restores fields per task for free.
Anomaly mode is global, as in PyTorch. Twin: ``pyengine/_pure/state.py``.
"""

from cpython.object cimport PyObject
from cpython.ref cimport Py_XDECREF, Py_XINCREF

cdef extern from "_state_variables.h":
    ThreadState pyengine_thread_state
    int pyengine_anomaly_enabled
    int pyengine_anomaly_check_nan
    PyObject* pyengine_profiler


cdef ThreadState* thread_state() noexcept nogil:
    return &pyengine_thread_state


cdef PyObject* profiler() noexcept nogil:
    return pyengine_profiler


cdef bint anomaly_enabled() noexcept nogil:
    return pyengine_anomaly_enabled


cdef bint anomaly_check_nan() noexcept nogil:
    return pyengine_anomaly_check_nan


def is_grad_enabled():
    return bool(pyengine_thread_state.grad_enabled)


def set_grad_enabled(enabled):
    pyengine_thread_state.grad_enabled = bool(enabled)


def is_anomaly_enabled():
    return bool(pyengine_anomaly_enabled)


def is_anomaly_check_nan_enabled():
    return bool(pyengine_anomaly_check_nan)


def set_anomaly_enabled(enabled, check_nan=True):
    global pyengine_anomaly_enabled, pyengine_anomaly_check_nan
    pyengine_anomaly_enabled = bool(enabled)
    pyengine_anomaly_check_nan = bool(check_nan)


cdef class RestoreOnExit:
    """A base for context managers that put something back on exit:
    ``__exit__`` calls ``restore(*restore_args)`` (where ``restore`` is not
    None) from C, so that no Python frame of the context manager's own
    stands between a with block's end and the restore, where Ctrl-C could
    come out first. See Note [A mode context under an interrupt] in
    pyengine/grad_mode.py."""

    cdef public object restore
    cdef public object restore_args

    def __cinit__(self, *args, **kwargs):
        self.restore_args = ()

    def __exit__(self, *exc_info):
        restore = self.restore
        if restore is not None:
            restore(*self.restore_args)
        return False


def set_profiler(callback):
    """Call ``callback(node, start_ns, end_ns)`` on the thread that ran it,
    after every node any engine runs (``time.perf_counter_ns`` clock); None
    stops. Returns the previous callback. See pyengine.profiler."""
    global pyengine_profiler
    previous = None if pyengine_profiler == NULL else <object>pyengine_profiler
    Py_XINCREF(<PyObject*>callback if callback is not None else NULL)
    old = pyengine_profiler
    pyengine_profiler = <PyObject*>callback if callback is not None else NULL
    Py_XDECREF(old)
    return previous


def is_checkpoint_valid():
    """False while a node of a backward that prunes nodes (``grad``,
    ``inputs=``), or of a backward nested in one, runs on this thread; True
    elsewhere. See Note [Checkpoint valid in nested backward] in the twin."""
    return bool(pyengine_thread_state.checkpoint_valid)


def is_multithreading_enabled():
    return bool(pyengine_thread_state.multithreading_enabled)


def set_multithreading_enabled(enabled):
    pyengine_thread_state.multithreading_enabled = bool(enabled)


def get_current_graph_task():
    graph_task = pyengine_thread_state.current_graph_task
    return None if graph_task == NULL else <object>graph_task


def get_current_node():
    """The node the engine runs on this thread under the current graph
    task, or None: See Note [Queries a running node makes] in
    pyengine/_shared/task_queries.py."""
    cdef ThreadState* thread = &pyengine_thread_state
    if (thread.current_node == NULL or thread.current_graph_task == NULL
            or thread.current_node_graph_task != thread.current_graph_task):
        return None
    return <object>thread.current_node
