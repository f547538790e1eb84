# Dependencies of a backward graph; see _dependencies.pyx.

from pyengine._graph_task cimport GraphTask
from pyengine._node cimport NodeBase


cdef int compute_dependencies(NodeBase graph_root, GraphTask graph_task) except -1
cpdef int init_to_execute(NodeBase graph_root, GraphTask graph_task, outputs,
                          bint accumulate_grad) except -1
