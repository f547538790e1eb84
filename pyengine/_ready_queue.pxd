# NodeTask records, CompareNodeTaskTime, the heap algorithms and ReadyQueue;
# see _ready_queue.pyx.

from cpython.object cimport PyObject
from libc.stdint cimport uint64_t
from libcpp.atomic cimport atomic
from libcpp.condition_variable cimport condition_variable
from libcpp.mutex cimport mutex
from libcpp.vector cimport vector


cdef extern from "_node_task.h" nogil:
    ctypedef struct NodeTaskRecord "pyengine_NodeTaskRecord":
        PyObject* graph_task
        PyObject* node
        PyObject* inputs
        uint64_t sequence_nr
        int reentrant_depth
        bint is_shutdown

    cppclass CompareNodeTaskTime "pyengine_CompareNodeTaskTime":
        CompareNodeTaskTime()
        bint operator()(const NodeTaskRecord&, const NodeTaskRecord&)


# libstdc++'s heap algorithms, whatever the platform's standard library: See
# Note [Ties in the ready queue] in pyengine/_pure/ready_queue.py.
cdef extern from "_node_task.h" namespace "pyengine" nogil:
    void push_heap[Iter, Compare](Iter first, Iter last, Compare comp)
    void pop_heap[Iter, Compare](Iter first, Iter last, Compare comp)
    void make_heap[Iter, Compare](Iter first, Iter last, Compare comp)
    # A ReadyQueue's push and pop, without the GIL: see _node_task.h.
    bint heap_push(vector[NodeTaskRecord]& heap, const NodeTaskRecord& record) noexcept
    NodeTaskRecord heap_pop(vector[NodeTaskRecord]& heap) noexcept
    NodeTaskRecord pop_next(vector[NodeTaskRecord]& heap, int& woken, int& shutdown_pending) noexcept


cdef class NodeTask:
    cdef readonly object graph_task
    cdef readonly object node
    cdef readonly object inputs
    cdef readonly bint is_shutdown
    cdef readonly int reentrant_depth
    cdef readonly uint64_t sequence_nr


cdef class ReadyQueue:
    # heap is guarded by mutex_; not_empty is signalled under it.
    cdef vector[NodeTaskRecord] heap
    cdef mutex mutex_
    cdef condition_variable not_empty
    # A wake-up task and a shutdown task that the heap could not take, for
    # want of memory: guarded by mutex_. See Note [C++ allocations that
    # fail] in _engine.pyx.
    cdef bint woken
    cdef bint shutdown_pending
    # The tasks queued (the heap's, and those the flags stand for): written
    # under mutex_, read without it by push_pop_record.
    cdef atomic[size_t] queued

    cdef bint push_record(self, NodeTaskRecord record) noexcept
    cpdef void wake(self) noexcept
    cdef void push_pop_record(self, NodeTaskRecord* record) noexcept
    cdef int pop_record(self, NodeTaskRecord* record, bint on_main_thread) except -1 nogil
    cdef bint try_pop_record(self, NodeTaskRecord* record) noexcept nogil
    cdef Py_ssize_t discard_graph_task_records(self, object graph_task) except -1


cdef NodeTaskRecord make_record(object graph_task, object node, object inputs,
                                int reentrant_depth, uint64_t sequence_nr) noexcept
cdef void release_record(NodeTaskRecord* record) noexcept
