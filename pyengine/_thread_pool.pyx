"""The reentrant thread pool: graph tasks handed off by a reentrant backward
nested too deep to run inline, and the threads that run them.

The compiled twin of ``pyengine/_pure/thread_pool.py``, whose Notes explain
it: Note [Reentrant backward], Note [Bounds on reentrant backward], Note [A
pool thread is back before its caller], Note [Stopping the pool]. The
engine hands a graph task off with ``add_thread_pool_task`` once per
hand-off, never per node; a pool thread runs the task through the
engine's ``_run_pool_task``, a Python call back into the engine, which it
holds weakly (See Note [An engine's threads hold it weakly] in
pyengine/_shared/engine_registry.py), so this module needs nothing else
from it.
"""

cimport cython
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from cython.operator cimport dereference as deref
from libcpp.condition_variable cimport cv_status
from libcpp.deque cimport deque
from libcpp.mutex cimport mutex, unique_lock

from pyengine._graph_task cimport GraphTask, cancel_graph_task
from pyengine._locks cimport lock_releasing_gil, milliseconds

import threading

from pyengine._shared.engine_registry import IDLE_CHECK_S
from pyengine._shared.messages import (POOL_ENGINE_GONE_MESSAGE, cannot_pickle_message,
                                       pool_full_message, pool_stopped_message)

# See Note [An engine's threads hold it weakly] in pyengine/_shared/engine_registry.py.
cdef long long IDLE_CHECK_MS = <long long>(IDLE_CHECK_S * 1000)


@cython.final
cdef class _ThreadPoolShared:
    """Graph tasks handed off by a too-deep reentrant backward, and the pool
    threads that run them. ``graph_tasks`` (owned references), ``num_idle``,
    ``num_threads`` (started or starting, not yet ended: at most the
    engine's ``max_pool_threads``) and ``stopping`` are guarded by
    ``mutex_``; ``work`` is signalled under it, and ``released`` when a
    thread goes back to idle after a task. ``threads`` (the started ones,
    for ``stop`` to join) is guarded by the GIL."""

    def __cinit__(self):
        self.threads = []

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))

    def __dealloc__(self):
        while not self.graph_tasks.empty():
            Py_DECREF(<object>self.graph_tasks.front())
            self.graph_tasks.pop_front()


cdef int add_thread_pool_task(_ThreadPoolShared pool, GraphTask graph_task,
                              Py_ssize_t max_pool_threads, object engine_ref) except -1:
    """Hand ``graph_task`` to a pool thread and block, without the GIL, until
    it completes. The pool thread runs it with the engine ``engine_ref`` (a
    weak reference) refers to. See Note [Reentrant backward] and Note
    [Bounds on reentrant backward]."""
    cdef unique_lock[mutex] lock
    # The slot taken in num_threads for a thread that has not taken it yet:
    # See Note [A slot taken for a pool thread] in the twin. Made before the
    # lock: nothing under it allocates (See Note [Python allocations that
    # fail] in pyengine/_engine.pyx).
    cdef list slot = [False]
    lock_releasing_gil(pool.mutex_)
    # PyTorch's rule: a new thread unless an idle one is left over for it.
    cdef bint start_thread = pool.num_idle <= pool.graph_tasks.size()
    if pool.stopping:
        # See Note [Stopping the pool] in the twin.
        pool.mutex_.unlock()
        error = RuntimeError(pool_stopped_message(graph_task.reentrant_depth))
        cancel_graph_task(graph_task, error)
        raise error
    if start_thread and pool.num_threads >= max_pool_threads:
        pool.mutex_.unlock()
        error = RuntimeError(pool_full_message(graph_task.reentrant_depth, max_pool_threads))
        cancel_graph_task(graph_task, error)
        raise error
    try:
        # First: where it raises MemoryError, nothing changed (See Note [C++
        # allocations that fail] in pyengine/_engine.pyx).
        pool.graph_tasks.push_back(<PyObject*>graph_task)
    except MemoryError as error:
        pool.mutex_.unlock()
        cancel_graph_task(graph_task, error)
        raise
    Py_INCREF(graph_task)
    if start_thread:
        pool.num_threads += 1
        slot[0] = True
    pool.mutex_.unlock()
    try:
        if start_thread:
            start_pool_thread(pool, graph_task, engine_ref, slot)
        pool.work.notify_one()
        graph_task.wait()
    except BaseException as error:
        # A thread that did not start, or Ctrl-C while waiting: the
        # child ends here. See Note [Cancelling a graph task] in
        # pyengine/_pure/engine.py.
        withdraw_pool_task(pool, graph_task)
        cancel_graph_task(graph_task, error)
        raise
    # See Note [A pool thread is back before its caller] in the twin.
    with nogil:
        lock = unique_lock[mutex](pool.mutex_)
        while graph_task.on_pool_thread:
            pool.released.wait(lock)
        lock.unlock()
    return 0


cdef int start_pool_thread(_ThreadPoolShared pool, GraphTask graph_task,
                           object engine_ref, list slot) except -1:
    """Start a pool thread, its slot in ``num_threads`` already taken (and
    held in ``slot`` until the thread takes it); if it cannot start, give
    the slot back and raise RuntimeError. Ctrl-C may come while Python code
    makes or starts the thread: See Note [A slot taken for a pool thread]
    in the twin."""
    thread = None
    try:
        thread = threading.Thread(target=_reentrant_thread_main,
                                  args=(pool, engine_ref, slot),
                                  name="pyengine-reentrant", daemon=True)
        pool.threads.append(thread)
        thread.start()
    except BaseException as error:
        # Started or not, the slot goes back unless the thread took it; a
        # thread that finds it gone ends at once.
        lock_releasing_gil(pool.mutex_)
        gave_back = slot[0]
        if gave_back:
            pool.num_threads -= 1
            slot[0] = False
        pool.mutex_.unlock()
        # The thread never runs as a pool thread. Outside the lock, as the
        # thread's own removal: a list's removal may allocate.
        if gave_back and thread is not None and thread in pool.threads:
            pool.threads.remove(thread)
        if not isinstance(error, Exception):
            raise
        raise RuntimeError(
            f"could not start a reentrant pool thread for a backward nested "
            f"{graph_task.reentrant_depth} levels deep: {error}") from error
    return 0


cdef int run_pool_task(object engine_ref, GraphTask graph_task) except -1:
    """Run ``graph_task``, handed off to the pool, with the engine
    ``engine_ref`` (a weak reference) refers to: a pool thread's call back
    into the engine. See Note [An engine's threads hold it weakly] in
    pyengine/_shared/engine_registry.py."""
    engine = engine_ref()
    if engine is None:
        raise RuntimeError(POOL_ENGINE_GONE_MESSAGE)
    engine._run_pool_task(graph_task)
    return 0


def _reentrant_thread_main(_ThreadPoolShared pool not None, engine_ref, list slot not None):
    """A pool thread: take the slot its starter took for it (``slot``), then
    run the graph tasks handed off, with the engine ``engine_ref`` (a weak
    reference) refers to, until the pool stops or that engine is collected
    (See Note [An engine's threads hold it weakly] in
    pyengine/_shared/engine_registry.py)."""
    cdef PyObject* next_graph_task = NULL
    cdef bint idle_check_due
    cdef GraphTask graph_task
    cdef unique_lock[mutex] lock
    lock_releasing_gil(pool.mutex_)
    if not slot[0]:
        # Its starter gave the slot back: See Note [A slot taken for a pool
        # thread] in the twin.
        pool.mutex_.unlock()
        if threading.current_thread() in pool.threads:
            pool.threads.remove(threading.current_thread())
        return
    slot[0] = False
    pool.num_idle += 1
    pool.mutex_.unlock()
    # Whether this thread is counted in num_idle: from its start, and
    # again from the moment it finishes a task (See Note [A pool thread
    # is back before its caller] in the twin).
    cdef bint counted_idle = True
    try:
        while True:
            with nogil:
                lock = unique_lock[mutex](pool.mutex_)
                idle_check_due = False
                while pool.graph_tasks.empty() and not pool.stopping and not idle_check_due:
                    idle_check_due = (pool.work.wait_for(lock, milliseconds(IDLE_CHECK_MS))
                                      == cv_status.timeout)
                idle_check_due = pool.graph_tasks.empty() and not pool.stopping
                if not idle_check_due:
                    pool.num_idle -= 1
                    counted_idle = False
                    if pool.stopping:
                        next_graph_task = NULL
                    else:
                        next_graph_task = pool.graph_tasks.front()
                        pool.graph_tasks.pop_front()
                        # Marked as it leaves the queue, under the lock its
                        # caller reads the mark with: See Note [A pool thread
                        # is back before its caller] in the twin.
                        (<GraphTask>next_graph_task).on_pool_thread = True
                lock.unlock()
            if idle_check_due:
                # Out of the nogil block, not in a ``with gil``: that takes
                # the GIL through PyGILState_Ensure, which crashes a daemon
                # thread that wakes while the interpreter finalizes (its
                # thread state gone); the block's end takes it back as
                # CPython ends such a thread. See Note [An engine's
                # threads hold it weakly] in pyengine/_shared/engine_registry.py.
                if engine_ref() is None:
                    return
                continue
            if next_graph_task == NULL:
                return
            graph_task = <GraphTask>next_graph_task
            Py_DECREF(graph_task)  # the pool's reference; graph_task holds one
            try:
                run_pool_task(engine_ref, graph_task)
            except BaseException as error:
                # An error of the engine's own (a MemoryError where it
                # keeps its state: See Note [Python allocations that fail] in
                # pyengine/_engine.pyx), not a node's, which fail the task
                # where they are caught: it fails the task here, or the
                # caller waited for it for good. The thread serves on.
                graph_task.set_exception(error)
            finally:
                lock_releasing_gil(pool.mutex_)
                graph_task.on_pool_thread = False
                pool.num_idle += 1
                counted_idle = True
                pool.mutex_.unlock()
                pool.released.notify_all()
            graph_task = None
    finally:
        # However it ends, it leaves no dead thread in the pool.
        pool.threads.remove(threading.current_thread())
        lock_releasing_gil(pool.mutex_)
        pool.num_threads -= 1
        if counted_idle:
            pool.num_idle -= 1
        pool.mutex_.unlock()


cdef int withdraw_pool_task(_ThreadPoolShared pool, GraphTask graph_task) except -1:
    """Take ``graph_task`` back from the pool's queue if no thread took it yet."""
    cdef deque[PyObject*].iterator it
    cdef bint found = False
    lock_releasing_gil(pool.mutex_)
    it = pool.graph_tasks.begin()
    while it != pool.graph_tasks.end():
        if deref(it) == <PyObject*>graph_task:
            pool.graph_tasks.erase(it)
            found = True
            break
        it += 1
    pool.mutex_.unlock()
    if found:
        Py_DECREF(graph_task)  # the pool's reference
    return 0


def stop_thread_pool(_ThreadPoolShared pool not None):
    """Make every pool thread end once it has no graph task, refuse new
    hand-offs, and fail the graph tasks handed off that no thread took;
    return the pool's threads, for ``Engine.stop`` to join. See Note
    [Stopping the pool] in the twin."""
    cdef list orphans = []
    cdef GraphTask graph_task
    lock_releasing_gil(pool.mutex_)
    pool.stopping = True
    try:
        while not pool.graph_tasks.empty():
            # The pool's reference goes to the list (append takes its own;
            # where it raises MemoryError, the graph task stays queued).
            orphans.append(<object>pool.graph_tasks.front())
            Py_DECREF(<object>pool.graph_tasks.front())
            pool.graph_tasks.pop_front()
    finally:
        # Whatever raised, the idle threads see ``stopping``: See Note
        # [Python allocations that fail] in pyengine/_engine.pyx.
        pool.mutex_.unlock()
        pool.work.notify_all()
    threads = list(pool.threads)
    interrupt = None
    for orphan in orphans:
        graph_task = <GraphTask>orphan
        try:
            graph_task.cpu_ready_queue.discard_graph_task_records(graph_task)
        except BaseException as error:
            # Raised once every orphan has failed: See Note [What a failed
            # graph task leaves is let go of in slices] in
            # pyengine/_pure/graph_task.py.
            if interrupt is None:
                interrupt = error
        graph_task.set_exception(RuntimeError(pool_stopped_message(graph_task.reentrant_depth)))
    if interrupt is not None:
        raise interrupt
    return threads
