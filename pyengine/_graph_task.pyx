"""GraphTask: the state of one backward or grad call.

A GraphTask lives from ``execute`` until its caller has read its result;
NodeTask records point back to it. Twin: ``pyengine/_pure/graph_task.py``,
whose ``init_to_execute`` this one calls (See Note [Slow paths are shared]).
"""

cimport cython
from cpython.object cimport PyObject
from cpython.ref cimport Py_XDECREF
from libcpp.mutex cimport mutex, unique_lock

from pyengine._graph_task cimport NodePtr
from pyengine._locks cimport lock_releasing_gil
from pyengine._ready_queue cimport ReadyQueue
from pyengine._state cimport ThreadState, thread_state

from pyengine._pure import graph_task as _twin
from pyengine.streams import current_streams


@cython.final
cdef class GraphTask:
    """See the twin's docstring for each field; the .pxd says how each is guarded."""

    def __init__(self, bint keep_graph, bint grad_mode, int reentrant_depth,
                 ReadyQueue cpu_ready_queue, bint exit_on_error=False, bint multithreading=True):
        self.keep_graph = keep_graph
        self.grad_mode = grad_mode
        self.reentrant_depth = reentrant_depth
        self.cpu_ready_queue = cpu_ready_queue
        self.exit_on_error = exit_on_error
        self.multithreading = multithreading
        self.caller_current_streams = current_streams()
        self.owner = -2
        self.exec_info = {}
        self.captured_vars = []
        self.leaf_streams = []
        self.final_callbacks = []
        self.outstanding_tasks_.store(0)
        self.has_error_.store(0)
        self.future_completed_.store(0)

    def __dealloc__(self):
        self.clear_not_ready()

    cdef void clear_not_ready(self) noexcept:
        for entry in self.not_ready_:
            Py_XDECREF(entry.second)
        self.not_ready_.clear()

    # -- read-only views, for tests and debugging --

    @property
    def outstanding_tasks(self):
        return self.outstanding_tasks_.load()

    @property
    def has_error(self):
        return bool(self.has_error_.load())

    @property
    def future_completed(self):
        return bool(self.future_completed_.load())

    @property
    def exception(self):
        return self.exception_


    # -- outstanding tasks --

    def increment_outstanding_tasks(self):
        self.outstanding_tasks_.fetch_add(1)

    def decrement_outstanding_tasks(self):
        self.outstanding_tasks_.fetch_sub(1)

    def completed(self):
        """All tasks ran (or failed, when the task exits on the first error)."""
        return self.outstanding_tasks_.load() == 0 or (self.exit_on_error and self.has_error_.load())

    def add_leaf_stream(self, stream):
        """Remember a stream a leaf gradient was written on (under ``mutex_``)."""
        lock_releasing_gil(self.mutex_)
        try:
            if stream not in self.leaf_streams:
                self.leaf_streams.append(stream)
        finally:
            self.mutex_.unlock()

    def can_checkpoint(self):
        """A reentrant checkpoint needs every node to run: no pruning."""
        return not self.exec_info

    # -- execution plan --

    def init_to_execute(self, graph_root, outputs, accumulate_grad):
        """Mark the nodes on a path from ``graph_root`` to an edge of ``outputs``;
        see the twin's docstring for the algorithm."""
        _twin.GraphTask.init_to_execute(self, graph_root, outputs, accumulate_grad)

    # -- completion --

    def set_exception(self, exception):
        """Record the first error and complete the task's future with it."""
        lock_releasing_gil(self.completion_mutex)
        self.has_error_.store(1)
        if not self.future_completed_.load():
            self.exception_ = exception
            # No final callback runs after an error.
            self.completing = True
            self.future_completed_.store(1)
            self.completed_cv.notify_all()
        self.completion_mutex.unlock()

    def mark_as_completed_and_run_post_processing(self):
        """Run the final callbacks and complete the future, once, on one thread;
        another thread that gets here waits until that is done."""
        lock_releasing_gil(self.completion_mutex)
        if self.completing:
            self.completion_mutex.unlock()
            self.wait()
            return
        self.completing = True
        self.completion_mutex.unlock()
        try:
            self.exec_post_processing()
        except BaseException as error:
            self.set_exception(error)
            return
        lock_releasing_gil(self.completion_mutex)
        if not self.future_completed_.load():
            self.future_completed_.store(1)
            self.completed_cv.notify_all()
        self.completion_mutex.unlock()

    def exec_post_processing(self):
        """Make the caller's streams wait on the leaf streams, then run final
        callbacks; a callback may queue more, which run too."""
        if self.leaf_streams:
            _twin.sync_leaf_streams(self)
        cdef ThreadState* thread = thread_state()
        cdef PyObject* previous = thread.current_graph_task
        thread.current_graph_task = <PyObject*>self
        try:
            i = 0
            while i < len(self.final_callbacks):
                self.final_callbacks[i]()
                i += 1
        finally:
            thread.current_graph_task = previous

    def wait(self):
        """Block, without the GIL, until the future completed."""
        cdef unique_lock[mutex] lock
        if self.future_completed_.load():
            return
        with nogil:
            lock = unique_lock[mutex](self.completion_mutex)
            while not self.future_completed_.load():
                self.completed_cv.wait(lock)
