# Owner graphs, compiled; see _owner_graph.pyx.

from pyengine._graph_task cimport GraphTask

cdef int run_owner_graph(object root, str children, str method,
                         GraphTask graph_task) except -1
