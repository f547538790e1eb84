"""Dependencies: the count of the edges into each node of a backward graph,
made before any node runs, and the refusal of a cycle.

Twin of ``pyengine/_dependencies.pyx``. The engine calls
``compute_dependencies`` once per graph task, before any node runs.
"""

from .._shared.messages import node_name, not_initialized_message


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
    first edge that breaks that rule. Iterative, each node once."""
    dependencies = graph_task.dependencies
    seen = {id(graph_root)}
    stack = [graph_root]
    while stack:
        node = stack.pop()
        if not getattr(node, "_initialized", False):
            raise RuntimeError(not_initialized_message(node))
        for edge in node._next_edges:
            if edge is None:
                continue
            next_node = edge.node
            if next_node._sequence_nr >= node._sequence_nr and next_node._next_edges:
                return False
            key = id(next_node)
            dependencies[key] = dependencies.get(key, 0) + 1
            if key not in seen:
                seen.add(key)
                stack.append(next_node)
    return True


def search_dependencies(graph_root, graph_task):
    """compute_dependencies' count in a depth-first search that refuses a
    cycle, for a graph count_dependencies could not vouch for.
    Iterative: any depth."""
    on_path, finished = 1, 2
    dependencies = graph_task.dependencies
    search_state = {id(graph_root): on_path}
    if not getattr(graph_root, "_initialized", False):
        raise RuntimeError(not_initialized_message(graph_root))
    # Frames: [node, its next edges as first read, the index of the next edge].
    stack = [[graph_root, graph_root._next_edges, 0]]
    while stack:
        frame = stack[-1]
        node, edges, start = frame
        for index in range(start, len(edges)):
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
                stack.append([next_node, next_node._next_edges, 0])
                break  # search below next_node first; this frame resumes after it
            if state == on_path:
                raise RuntimeError(
                    f"the backward graph has a cycle: {node_name(next_node)} is reachable "
                    "from itself through next_edges; backward needs a graph without cycles")
        else:
            search_state[id(node)] = finished
            stack.pop()
