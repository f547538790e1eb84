"""Dependencies: the count of the edges into each node of a backward graph,
made before any node runs, the refusal of a cycle, and under
``grad(inputs=)`` the marking of the nodes that run.

Twin of ``pyengine/_dependencies.pyx``. The engine calls
``compute_dependencies``, or ``init_to_execute`` when it has outputs, once
per graph task, before any node runs.
"""

from .._shared.messages import init_to_execute_refused_message, node_name, not_initialized_message
from .graph_task import ExecInfo, GraphTask, task_should_execute
from .node import Edge, NodeBase
from .static_types import c_type_name, check_argument

# Note [Cycles in the backward graph]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A backward graph made by a forward pass has no cycle, but next_edges
# can be set by hand, and a cycle has no order to run in: its nodes
# would wait for each other. So compute_dependencies counts the edges
# into each node in a depth-first search that keeps each node's state
# (not seen, on the search's path, finished), and an edge to a node on
# the path closes a cycle through that node: the search raises before
# any node has run, naming it. The search reads each node's next_edges
# once, when it first reaches the node, and follows the edges in their
# order, so both cores name the same node. The compiled core keeps the
# state beside the count in the DependencyMap's slot.
#
# That search costs more per node than a plain count (a frame per node,
# read again on the way up), and most graphs cannot have a cycle: a
# forward pass makes each node after the nodes its edges lead to, so
# its edges lead to lower sequence numbers (or to an AccumulateGrad,
# which has none of its own). A cycle needs an edge to a node made no
# earlier that has next edges itself, since sequence numbers cannot
# fall all the way around it. So compute_dependencies first counts
# plainly (count_dependencies) and checks that rule on every edge; only
# at the first edge that breaks it (nodes made on several threads, whose
# sequence numbers are per thread, or edges set by hand) does it start
# again with the depth-first search (search_dependencies).


# Note [Marking exec info in the dependency search]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under grad(inputs=) and backward(inputs=), PyTorch counts the
# dependencies, then init_to_execute walks the graph a second time to mark
# the nodes on a path to an output: such a node runs (is needed), the
# others are skipped. A node is needed when one of its edges leads to a
# node that is needed or captures, which is known once the search below
# it is done. The depth-first search of search_dependencies knows exactly
# that moment (it marks the node finished), so here init_to_execute makes
# the outputs' entries and the root's, then runs that search, which marks
# each node as it finishes: one walk over the graph's nodes and edges
# instead of two. On a graph too large for the cache, the second walk read
# every node, tuple and Edge again from memory; see benchmarks/RESULTS.md.
#
# The search costs a little more per node than the plain count it
# replaces (a frame per node), and it refuses a cycle, which a second walk
# never had to. Entries are made in the order their nodes finish, in both
# cores. The compiled core marks a needed node with a bit of its
# DependencyMap slot (the slot the search has in hand), so marking and the
# engine's "does it run" lookups probe no second table; its exec_info
# table keeps the outputs' and the root's entries. Planning a graph task
# twice, or one that has started, would change the counts its nodes read,
# so init_to_execute is refused then, and while another call (on another
# thread, which the search lets run) plans it.


def init_to_execute(graph_root, graph_task, outputs, accumulate_grad):
    """Mark the nodes on a path from ``graph_root`` to an edge of ``outputs``
    in ``graph_task.exec_info_``, and count the dependencies, in one search.

    An output edge's node is captured (``grad``) or run (``backward(inputs=)``,
    ``accumulate_grad``). A node runs when it is needed or captures; the
    others are skipped. See Note [Marking exec info in the dependency
    search]. Refused on a graph task already planned or started, or while
    another call plans it.
    """
    # The compiled signature's ``NodeBase graph_root not None, GraphTask
    # graph_task not None``.
    for name, value, expected in (("graph_root", graph_root, NodeBase),
                                  ("graph_task", graph_task, GraphTask)):
        if value is None:
            raise TypeError(f"Argument '{name}' must not be None")
        check_argument(name, value, expected)
    if graph_task.planning:
        raise RuntimeError(init_to_execute_refused_message("planning"))
    if graph_task.exec_info_:
        raise RuntimeError(init_to_execute_refused_message("planned"))
    if graph_task.outstanding_tasks != 0 or graph_task.future_completed:
        raise RuntimeError(init_to_execute_refused_message("started"))
    # A tuple of our own, as the compiled core's: the loop may run Python
    # code (a collection), which could change a list it walks.
    outputs = tuple(outputs)
    exec_info = graph_task.exec_info_
    graph_task.planning = True
    try:
        for output_idx, edge in enumerate(outputs):
            if not isinstance(edge, Edge):  # the compiled core's <Edge?> cast
                raise TypeError(f"Cannot convert {c_type_name(type(edge))} to pyengine._node.Edge")
            info = exec_info.get(id(edge.node))
            if info is None:
                info = exec_info[id(edge.node)] = ExecInfo()
            if accumulate_grad:
                info.needed_ = True
            else:
                info.captures_.append((edge.input_nr, output_idx))
        graph_task.captured_vars = [None] * len(outputs)
        if id(graph_root) not in exec_info:
            exec_info[id(graph_root)] = ExecInfo()
        search_dependencies(graph_root, graph_task)
    finally:
        graph_task.planning = False


def compute_dependencies(graph_root, graph_task):
    """Count, for each node reachable from ``graph_root``, the edges into
    it, and refuse a cycle before any node runs: the plain count, and the
    depth-first search only where the count cannot rule a cycle out. See
    Note [Cycles in the backward graph]."""
    if not count_dependencies(graph_root, graph_task):
        graph_task.dependencies.clear()
        search_dependencies(graph_root, graph_task)


def count_dependencies(graph_root, graph_task):
    """Count the edges into each node reachable from ``graph_root`` while
    every edge leads to a node made earlier (a lower sequence_nr) or to a
    node without next edges. Returns False, the count unfinished, at the
    first edge that breaks that rule. Iterative, each node once. A node's
    only next edge is read from the node itself (See Note [A node's only
    next edge] in ``pyengine/_pure/node.py``)."""
    seen = {id(graph_root)}
    stack = [graph_root]
    while stack:
        node = stack.pop()
        if not getattr(node, "_initialized", False):
            raise RuntimeError(not_initialized_message(node))
        next_node = node._only_next_node
        if next_node is not None:
            if not count_edge(graph_task, node, next_node, seen, stack):
                return False
            continue
        for edge in node._next_edges:
            if edge is None:
                continue
            if not count_edge(graph_task, node, edge.node, seen, stack):
                return False
    return True


def count_edge(graph_task, node, next_node, seen, stack):
    """Count the edge from ``node`` into ``next_node``, and push
    ``next_node`` the first time an edge reaches it; False, nothing
    counted, where the edge breaks count_dependencies' rule."""
    if next_node._sequence_nr >= node._sequence_nr and next_node._next_edges:
        return False
    dependencies = graph_task.dependencies
    key = id(next_node)
    dependencies[key] = dependencies.get(key, 0) + 1
    if key not in seen:
        seen.add(key)
        stack.append(next_node)
    return True


def search_dependencies(graph_root, graph_task):
    """compute_dependencies' count in a depth-first search that refuses a
    cycle, for a graph count_dependencies could not vouch for; under
    init_to_execute (exec_info has entries), it also marks each node that
    runs as it finishes. Iterative: any depth."""
    on_path, finished = 1, 2
    dependencies = graph_task.dependencies
    exec_info = graph_task.exec_info_
    marking = bool(exec_info)
    search_state = {id(graph_root): on_path}
    if not getattr(graph_root, "_initialized", False):
        raise RuntimeError(not_initialized_message(graph_root))
    stack = [search_frame(graph_root)]
    while stack:
        frame = stack[-1]
        node, edges, start, _, only_edge = frame
        for index in range(start, 1 if only_edge else len(edges)):
            if only_edge:
                next_node = edges  # the only next edge's node
            else:
                edge = edges[index]
                if edge is None:
                    continue
                next_node = edge.node
            key = id(next_node)
            dependencies[key] = dependencies.get(key, 0) + 1
            state = search_state.get(key)
            if state is None:
                if not getattr(next_node, "_initialized", False):
                    raise RuntimeError(not_initialized_message(next_node))
                search_state[key] = on_path
                frame[2] = index + 1
                stack.append(search_frame(next_node))
                break  # search below next_node first; this frame resumes after it
            if state == finished:
                if marking and not frame[3]:
                    frame[3] = task_should_execute(graph_task, key)
            elif state == on_path:
                raise RuntimeError(
                    f"the backward graph has a cycle: {node_name(next_node)} is reachable "
                    "from itself through next_edges; backward needs a graph without cycles")
        else:
            search_state[id(node)] = finished
            executes = marking and mark_exec_info(graph_task, frame)
            stack.pop()
            if executes and stack:
                stack[-1][3] = True


def search_frame(node):
    """A frame of the search: [node, its next edges as first read (or the
    node of its only next edge: See Note [A node's only next edge] in
    ``pyengine/_pure/node.py``), the index of the next edge, whether an edge
    followed so far leads to a node that runs, whether the second item is
    the only next edge's node]."""
    only_next_node = node._only_next_node
    if only_next_node is not None:
        return [node, only_next_node, 0, False, True]
    return [node, node._next_edges, 0, False, False]


def mark_exec_info(graph_task, frame):
    """The search below ``frame``'s node is done: make it needed in
    exec_info if a node below it runs or captures. Returns whether it runs
    or captures itself (needed, or an output's entry)."""
    node, _, _, needed, _ = frame
    if not needed:
        return task_should_execute(graph_task, id(node))
    info = graph_task.exec_info_.get(id(node))
    if info is None:
        info = graph_task.exec_info_[id(node)] = ExecInfo()
    info.needed_ = True
    return True
