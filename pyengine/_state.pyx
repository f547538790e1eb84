"""Per-thread and global engine state: grad mode, anomaly mode, the graph
task running on this thread, whether a reentrant checkpoint is valid here.

Grad mode and the current graph task are C++ ``thread_local`` variables, so
that the engine loop sets and restores them per task for free; anomaly mode
is global, as in PyTorch. ``current graph task`` is a borrowed pointer: it is
set only while a task of that graph task runs, and the task holds a
reference to it.
"""

from cpython.object cimport PyObject

cdef extern from *:
    """
    static thread_local int pyengine_grad_enabled = 1;
    static thread_local PyObject *pyengine_current_graph_task = NULL;
    /* False while a node of a pruning graph task (grad, inputs=) runs. */
    static thread_local int pyengine_checkpoint_valid = 1;
    /* Global; written under the GIL, read per node. */
    static int pyengine_anomaly_enabled = 0;
    static int pyengine_anomaly_check_nan = 1;
    """
    int pyengine_grad_enabled
    PyObject* pyengine_current_graph_task
    int pyengine_checkpoint_valid
    int pyengine_anomaly_enabled
    int pyengine_anomaly_check_nan


cdef bint grad_enabled() noexcept nogil:
    return pyengine_grad_enabled


cdef void set_grad_mode(bint enabled) noexcept nogil:
    global pyengine_grad_enabled
    pyengine_grad_enabled = enabled


cdef bint anomaly_enabled() noexcept nogil:
    return pyengine_anomaly_enabled


cdef bint anomaly_check_nan() noexcept nogil:
    return pyengine_anomaly_check_nan


cdef bint checkpoint_valid() noexcept nogil:
    return pyengine_checkpoint_valid


cdef bint swap_checkpoint_valid(bint valid) noexcept nogil:
    global pyengine_checkpoint_valid
    cdef bint previous = pyengine_checkpoint_valid
    pyengine_checkpoint_valid = valid
    return previous


cdef PyObject* current_graph_task() noexcept nogil:
    return pyengine_current_graph_task


cdef PyObject* swap_current_graph_task(PyObject* graph_task) noexcept nogil:
    global pyengine_current_graph_task
    cdef PyObject* previous = pyengine_current_graph_task
    pyengine_current_graph_task = graph_task
    return previous


def is_grad_enabled():
    return bool(pyengine_grad_enabled)


def set_grad_enabled(enabled):
    set_grad_mode(bool(enabled))


def is_anomaly_enabled():
    return bool(pyengine_anomaly_enabled)


def is_anomaly_check_nan_enabled():
    return bool(pyengine_anomaly_check_nan)


def set_anomaly_enabled(enabled, check_nan=True):
    global pyengine_anomaly_enabled, pyengine_anomaly_check_nan
    pyengine_anomaly_enabled = bool(enabled)
    pyengine_anomaly_check_nan = bool(check_nan)


def is_checkpoint_valid():
    """False while a node of a backward that prunes nodes (``grad``,
    ``inputs=``) runs on this thread; True elsewhere, final callbacks included."""
    return bool(pyengine_checkpoint_valid)


def get_current_graph_task():
    cdef PyObject* graph_task = pyengine_current_graph_task
    return None if graph_task == NULL else <object>graph_task
