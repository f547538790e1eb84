# cython: language_level=3
"""The least a count can do on a chain: follow each node's only next edge to
the end, reading the node's fields the count reads first (its sequence_nr,
beside the edge), and nothing else: no table, no stack, no reference taken;
``walk_prefetched`` also asks for the node eight steps on, as the count does
(Note [Prefetching along a chain's stride] in pyengine/_stride_prefetch.h).
``benchmarks/cold_walk.py`` builds this file and times it beside the count;
see its docstring for why. Not part of pyengine."""

from cpython.object cimport PyObject
from pyengine._node cimport NodeBase


cdef extern from "_stride_prefetch.h":
    void prefetch_along_stride "pyengine_prefetch_along_stride"(
        PyObject* node, PyObject* next_node, size_t fields_offset) noexcept nogil


def walk(NodeBase root):
    """The nodes from ``root`` down its only next edges, counted, and the sum
    of their sequence_nr (returned, so that the reads cannot be left out)."""
    cdef PyObject* node = <PyObject*>root
    cdef Py_ssize_t nodes = 0
    cdef unsigned long long total = 0
    while node != <PyObject*>None:
        # Borrowed: the caller holds the root, each node holds the next.
        total += (<NodeBase>node)._sequence_nr
        node = <PyObject*>(<NodeBase>node)._only_next_node
        nodes += 1
    return nodes, total


def walk_prefetched(NodeBase root):
    """``walk``, with the count's prefetch of the node eight steps on at each
    step (its head and the line of the fields the count reads)."""
    cdef PyObject* node = <PyObject*>root
    cdef PyObject* next_node
    cdef Py_ssize_t nodes = 0
    cdef unsigned long long total = 0
    cdef size_t fields_offset = <char*>&root._dependency_slot_ - <char*><PyObject*>root
    while node != <PyObject*>None:
        total += (<NodeBase>node)._sequence_nr
        next_node = <PyObject*>(<NodeBase>node)._only_next_node
        if next_node != <PyObject*>None:
            prefetch_along_stride(node, next_node, fields_offset)
        node = next_node
        nodes += 1
    return nodes, total
