"""What a running node may ask about the graph task that runs it:
``task_should_compute_output`` (PyTorch's Node method) and
``task_buffered_gradient`` (Chainer's ``backward_accumulate`` input), the
checks of their arguments and their errors.

Shared by the compiled core and the twin (See Note [Slow paths are
shared]): each core's ``NodeBase`` method finds the graph task running the
node on this thread (the compiled one in C, from the thread state). For
``task_should_compute_output``, asked once per input of every node a
frontend's formulas run, that graph task's ``should_compute_output``
answers an int index in range itself and calls
``checked_output_edge_index`` here for anything else; for
``task_buffered_gradient``, ``buffered_gradient`` here checks the index and
asks the graph task's ``buffered_gradient``.

Note [Queries a running node makes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
PyTorch's ``Node::task_should_compute_output(i)`` reads the exec_info of
the graph task current on the calling thread: False when next edge ``i``
is missing, or when ``grad(inputs=)`` / ``backward(inputs=)`` prunes the
node it leads to (no entry, or one that neither runs nor captures), True
otherwise. A node uses it to skip computing a gradient nobody will read.
PyTorch only asserts that some graph task is current, and reads that
task's exec_info even from a node that task does not run. Here the
engine records, per thread, the node it runs (from just before the node's
hooks to just after its gradients were passed on) and the graph task that
runs it; a query answers only for that node under that task, else it
raises RuntimeError naming the node and what does run: outside any
backward, from another node (a node's query from inside a backward nested
in its ``apply`` answers for the nested task's node, not for it), from a
final callback or from an owner graph's walk (each changes the current
graph task but runs no Node). Each thread has its own record, so two
backward calls on one graph, on two threads, each see their own pruning.

``task_buffered_gradient(i)`` is the sum that the InputBuffer of the node
next edge ``i`` leads to holds so far at that edge's ``input_nr``: the
gradients of the producers that ran before this one, in the engine's
order, or None where none arrived yet (or the edge is missing, or the
node is pruned, or it has a single producer: the engine makes its buffer
only for a second gradient). It is read under the graph task's mutex and
copied there by the value's backend (See Note [Accumulating under the
graph task lock] in pyengine/_engine.pyx), because the engine may add the
next gradient into that very array in place: the caller owns the copy.
"""

import operator

from ..backends import backend_of
from .messages import node_name


def not_running_message(node, query, running_node):
    """The RuntimeError of a query made by ``node`` while ``running_node``
    (None: no node) runs on this thread."""
    what_runs = ("no node runs on this thread" if running_node is None
                 else f"{node_name(running_node)} runs on this thread")
    return (f"{node_name(node)}.{query}() can only be called while the engine runs "
            f"{node_name(node)} (from its apply or its hooks), but {what_runs}")


def checked_output_edge_index(node, query, output_edge_index):
    """``output_edge_index`` as an index of one of ``node``'s next edges:
    TypeError for a non-integer, IndexError (naming the node, the index and
    the number of edges) outside ``0 <= index < len(next_edges)``, where
    PyTorch's unsigned index fails its check too."""
    try:
        index = operator.index(output_edge_index)
    except TypeError:
        raise TypeError(f"{node_name(node)}.{query}(): output_edge_index must be an int, got "
                        f"{type(output_edge_index).__name__}") from None
    num_edges = len(node._next_edges)
    if not 0 <= index < num_edges:
        raise IndexError(f"{node_name(node)}.{query}(): output_edge_index {index} is out of range "
                         f"for {node_name(node)}'s {num_edges} next edges")
    return index


def buffered_copy(buffer, input_nr):
    """A copy of ``buffer[input_nr]`` (an InputBuffer's list, read under its
    graph task's mutex), made by the value's backend; None for an empty
    slot or one beyond the list."""
    if buffer is None or not 0 <= input_nr < len(buffer):
        return None
    value = buffer[input_nr]
    if value is None:
        return None
    backend = backend_of(value)
    if backend is None:
        raise TypeError(f"no value backend for {type(value).__name__}, buffered at slot {input_nr}")
    return backend.copy(value)


def buffered_gradient(node, graph_task, output_edge_index):
    """``node.task_buffered_gradient(output_edge_index)`` under
    ``graph_task``, the task running ``node``. See Note [Queries a running
    node makes]."""
    index = checked_output_edge_index(node, "task_buffered_gradient", output_edge_index)
    edge = node._next_edges[index]
    if edge is None:
        return None
    return graph_task.buffered_gradient(edge.node, edge.input_nr)
