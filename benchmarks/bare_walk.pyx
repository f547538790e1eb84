# cython: language_level=3
"""The least a count can do on a chain: follow each node's only next edge to
the end, reading the node's fields the count reads first (its sequence_nr,
beside the edge), and nothing else: no table, no stack, no reference taken.
``benchmarks/cold_walk.py`` builds this file and times it beside the count;
see its docstring for why. Not part of pyengine."""

from cpython.object cimport PyObject
from pyengine._node cimport NodeBase


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
