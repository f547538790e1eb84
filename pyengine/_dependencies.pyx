"""Dependencies: the count of the edges into each node of a backward graph,
made before any node runs, the refusal of a cycle, and under
``grad(inputs=)`` the marking of the nodes that run (the compiled twin of
``pyengine/_pure/dependencies.py``, whose Notes [Cycles in the backward
graph] and [Marking exec info in the dependency search] explain the
passes). The engine cimports ``compute_dependencies`` and
``init_to_execute``; one of them runs once per graph task, not per node.
"""

from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport int32_t, uint32_t
from libcpp.vector cimport vector

from pyengine._graph_task cimport (Capture, ExecInfoEntry, GraphTask, SEARCH_FINISHED,
                                   SEARCH_NOT_SEEN, SEARCH_ON_PATH, SearchState)
from pyengine._interrupts cimport WORK_BETWEEN_YIELDS, let_others_run, yield_to_other_threads
from pyengine._node cimport Edge, NodeBase

from pyengine._shared import hooks as _hooks
from pyengine._shared.messages import init_to_execute_refused_message, not_initialized_message


cdef extern from "_dependency_map.h":
    ctypedef struct DependencyFrame "pyengine_DependencyFrame":
        PyObject* node
        PyObject* edges
        Py_ssize_t next
        size_t slot
        bint needed
        bint only_edge

cdef extern from "_frame_stack.h":
    cppclass DependencyFrameStack "pyengine_FrameStack<pyengine_DependencyFrame>":
        bint empty()
        DependencyFrame& back()
        void push_back(const DependencyFrame& frame) except +
        void pop_back()
    cppclass DependencyFrameStackLease "pyengine_FrameStackLease<pyengine_DependencyFrame>":
        DependencyFrameStackLease()
        DependencyFrameStack& stack()

cdef extern from "_stride_prefetch.h":
    void prefetch_along_stride "pyengine_prefetch_along_stride"(
        PyObject* node, PyObject* next_node, size_t fields_offset) noexcept nogil

cdef extern from "Python.h":
    # On the frames' borrowed pointers, without a reference per use.
    Py_ssize_t tuple_size "PyTuple_GET_SIZE"(PyObject* tuple) nogil
    PyObject* tuple_item "PyTuple_GET_ITEM"(PyObject* tuple, Py_ssize_t i) nogil
    void decref "Py_DECREF"(PyObject* obj)


cdef inline int push_dependency_frame(DependencyFrameStack& stack, NodeBase node,
                                      size_t slot) except -1:
    """Start the search below ``node`` (reached for the first time, its map
    slot at index ``slot``): the frame holds its next edges, or the node of
    its only next edge (See Note [A node's only next edge] in
    pyengine/_pure/node.py)."""
    if not node._initialized_:
        raise RuntimeError(not_initialized_message(node))
    cdef object edges = node._only_next_node
    cdef DependencyFrame frame
    frame.only_edge = edges is not None
    if not frame.only_edge:
        edges = node._next_edges
    frame.node = <PyObject*>node
    frame.edges = <PyObject*>edges
    frame.next = 0
    frame.slot = slot
    frame.needed = False
    stack.push_back(frame)
    Py_INCREF(node)
    Py_INCREF(edges)
    return 0


cdef inline void prefetch_ahead(PyObject* node, PyObject* next_node) noexcept:
    """Ask for the node that ``next_node``'s step from ``node`` would reach
    a few nodes further on (See Note [Prefetching along a chain's stride]
    in pyengine/_stride_prefetch.h): its head and its count's fields,
    which lie around ``_dependency_slot_``."""
    prefetch_along_stride(node, next_node,
                          <char*>&(<NodeBase>node)._dependency_slot_ - <char*>node)


cdef inline void pop_dependency_frame(DependencyFrameStack& stack):
    """Drop the top frame and its references. Last: dropping them may run
    Python code (a node freed with them)."""
    cdef PyObject* node = stack.back().node
    cdef PyObject* edges = stack.back().edges
    stack.pop_back()
    if edges != NULL:
        decref(edges)
    decref(node)


cpdef int init_to_execute(NodeBase graph_root, GraphTask graph_task, outputs,
                          bint accumulate_grad) except -1:
    """Mark the nodes on a path from ``graph_root`` to an edge of ``outputs``
    (a sequence of Edges) in ``graph_task.exec_info_``, and count the
    dependencies, in one search: the twin's algorithm, in C (See Note
    [Marking exec info in the dependency search] in the twin). Refused on a
    graph task already planned or started, or while another call plans
    it."""
    # What `not None` would say, which a cpdef function cannot declare: the
    # search writes into both objects.
    if graph_root is None:
        raise TypeError("Argument 'graph_root' must not be None")
    if graph_task is None:
        raise TypeError("Argument 'graph_task' must not be None")
    if graph_task.planning:
        raise RuntimeError(init_to_execute_refused_message("planning"))
    if not graph_task.exec_info_.empty():
        raise RuntimeError(init_to_execute_refused_message("planned"))
    if graph_task.outstanding_tasks_.load() != 0 or graph_task.future_completed_.load():
        raise RuntimeError(init_to_execute_refused_message("started"))
    # A tuple of our own: the loop runs Python code (an append may collect),
    # which could shrink a list while its size is read once.
    cdef tuple output_edges = tuple(outputs)
    cdef Py_ssize_t output_idx
    cdef Edge edge
    cdef ExecInfoEntry* entry
    graph_task.planning = True
    # See Note [Long passes let other threads run] in _interrupts.pxd; another
    # thread that plans this task meanwhile is refused (planning).
    cdef Py_ssize_t work_left = WORK_BETWEEN_YIELDS
    try:
        for output_idx in range(PyTuple_GET_SIZE(output_edges)):
            let_others_run(&work_left)
            edge = <Edge?><object>PyTuple_GET_ITEM(output_edges, output_idx)
            entry = &graph_task.exec_info_.make_entry(<PyObject*>edge.node)
            if accumulate_grad:
                entry.needed = True
                continue
            if entry.captures < 0:
                # Set once its vector is there: the engine reads it unchecked.
                graph_task.exec_captures.push_back(vector[Capture]())
                entry.captures = <int32_t>(graph_task.exec_captures.size() - 1)
            graph_task.exec_captures[entry.captures].push_back(Capture(edge.input_nr, output_idx))
        graph_task.captured_vars = [None] * PyTuple_GET_SIZE(output_edges)
        graph_task.exec_info_.make_entry(<PyObject*>graph_root)
        graph_task.dependencies_.use_kept_table()
        search_dependencies(graph_root, graph_task)
    finally:
        graph_task.planning = False
    return 0


cdef int compute_dependencies(NodeBase graph_root, GraphTask graph_task) except -1:
    """Count, for each node reachable from ``graph_root``, the edges into it,
    and refuse a cycle before any node runs: the plain count, and the
    depth-first search only where the count cannot rule a cycle out (See
    Note [Cycles in the backward graph] in ``pyengine/_pure/dependencies.py``).
    Both let other threads run as they go (See Note [Long passes let other
    threads run]). The count starts on a table this thread kept (See Note
    [Generations of a DependencyMap] in _dependency_map.h)."""
    graph_task.dependencies_.use_kept_table()
    if count_dependencies(graph_root, graph_task):
        return 0
    graph_task.dependencies_.reset()
    search_dependencies(graph_root, graph_task)
    return 0


cdef bint count_dependencies(NodeBase graph_root, GraphTask graph_task) except -1:
    """Count the edges into each node reachable from ``graph_root``, while
    every edge leads to a node made earlier (a
    lower sequence_nr) or to a node without next edges: then no cycle is
    possible. Returns False, the count unfinished, at the first edge that
    breaks that rule. Iterative, in any order: each node once, from a
    stack that owns its nodes. A node's only next edge is read from the
    node itself (See Note [A node's only next edge] in the twin)."""
    cdef vector[PyObject*] stack
    cdef NodeBase node
    cdef NodeBase next_node
    cdef tuple edges
    cdef PyObject* edge
    cdef Py_ssize_t work_left = WORK_BETWEEN_YIELDS
    keep_slot(graph_root, graph_task.dependencies_.enter(<PyObject*>graph_root))
    # The stack's reference once it is in (push_back may raise MemoryError).
    stack.push_back(<PyObject*>graph_root)
    Py_INCREF(graph_root)
    try:
        while not stack.empty():
            node = <NodeBase>stack.back()
            stack.pop_back()
            decref(<PyObject*>node)  # the stack's reference; node holds one
            if not node._initialized_:
                raise RuntimeError(not_initialized_message(node))
            # A reference of our own: count_edge may let other threads run,
            # which may set the node's next edges.
            next_node = node._only_next_node
            if next_node is not None:
                prefetch_ahead(<PyObject*>node, <PyObject*>next_node)
                let_others_run(&work_left)
                if not count_edge(graph_task, node, next_node, stack):
                    return False
                continue
            # A unit for the node, and one per edge: a node with no next
            # edges is work too (a million leaves below one node).
            let_others_run(&work_left)
            edges = node._next_edges
            for i in range(PyTuple_GET_SIZE(edges)):
                let_others_run(&work_left)
                edge = PyTuple_GET_ITEM(edges, i)
                if edge == <PyObject*>None:
                    continue
                # Held by the Edge, which edges holds.
                if not count_edge(graph_task, node, (<Edge>edge).node, stack):
                    return False
    finally:
        # What an early return or an error (Ctrl-C) left.
        while not stack.empty():
            decref(stack.back())
            stack.pop_back()
    return True


cdef inline void keep_slot(NodeBase node, size_t slot) noexcept:
    """Keep in ``node`` its slot's index in the graph task's DependencyMap,
    for the run's lookups (See Note [A node keeps its slot's index] in
    pyengine/_dependency_map.h). Written only when it changed: a graph
    counted again on the same kept table finds every index as it was, and
    its nodes' cache lines stay clean."""
    if node._dependency_slot_ != <uint32_t>slot:
        node._dependency_slot_ = <uint32_t>slot


cdef inline bint count_edge(GraphTask graph_task, NodeBase node, NodeBase next_node,
                            vector[PyObject*]& stack) except -1:
    """Count the edge from ``node`` into ``next_node``, and push
    ``next_node`` the first time an edge reaches it; False, nothing
    counted, where the edge breaks count_dependencies' rule."""
    cdef size_t slot
    if (next_node._sequence_nr >= node._sequence_nr
            and PyTuple_GET_SIZE(next_node._next_edges) != 0):
        return False
    if graph_task.dependencies_.full():
        # See pyengine/_table_growth.h.
        while not graph_task.dependencies_.grow_step():
            yield_to_other_threads()
    cdef SearchState state = graph_task.dependencies_.add_edge(<PyObject*>next_node, &slot)
    keep_slot(next_node, slot)
    if state == SEARCH_NOT_SEEN:
        stack.push_back(<PyObject*>next_node)
        Py_INCREF(next_node)
    return True


cdef int search_dependencies(NodeBase graph_root, GraphTask graph_task) except -1:
    """compute_dependencies' count in a depth-first search that refuses a
    cycle, for a graph ``count_dependencies`` could not vouch for; under
    init_to_execute (exec_info has entries), it also marks each node that
    runs as it finishes. Iterative: graphs of millions of nodes, deep or
    wide, use no C stack."""
    # The thread's kept frames: See _frame_stack.h.
    cdef DependencyFrameStackLease lease
    cdef DependencyFrameStack* stack = &lease.stack()
    cdef DependencyFrame* frame
    cdef PyObject* edges
    cdef PyObject* edge
    cdef PyObject* next_node
    cdef Py_ssize_t index, size
    cdef SearchState state
    cdef size_t slot
    cdef bint marking = not graph_task.exec_info_.empty()
    cdef bint executes
    cdef Py_ssize_t work_left = WORK_BETWEEN_YIELDS
    try:
        slot = graph_task.dependencies_.enter(<PyObject*>graph_root)
        keep_slot(graph_root, slot)
        push_dependency_frame(stack[0], graph_root, slot)
        while not stack.empty():
            frame = &stack.back()
            edges = frame.edges
            if edges == NULL:
                size = 0
            elif frame.only_edge:
                size = 1
            else:
                size = tuple_size(edges)
            index = frame.next
            next_node = NULL
            while index < size:
                let_others_run(&work_left)
                if frame.only_edge:
                    next_node = edges  # the only next edge's node
                    index += 1
                    prefetch_ahead(frame.node, next_node)
                else:
                    edge = tuple_item(edges, index)
                    index += 1
                    if edge == <PyObject*>None:
                        continue
                    next_node = <PyObject*>(<Edge>edge).node
                if graph_task.dependencies_.full():
                    # See pyengine/_table_growth.h.
                    while not graph_task.dependencies_.grow_step():
                        yield_to_other_threads()
                state = graph_task.dependencies_.add_edge(next_node, &slot)
                keep_slot(<NodeBase>next_node, slot)
                if state == SEARCH_NOT_SEEN:
                    break
                if state == SEARCH_FINISHED:
                    if marking and not frame.needed:
                        frame.needed = (graph_task.dependencies_.needed_at(slot)
                                        or graph_task.exec_info_.should_execute(next_node))
                elif state == SEARCH_ON_PATH:
                    raise RuntimeError(
                        f"the backward graph has a cycle: {_hooks.node_name(<object>next_node)} is "
                        "reachable from itself through next_edges; backward needs a graph without "
                        "cycles")
                next_node = NULL
            if next_node != NULL:
                # Search below next_node first; this frame resumes after it.
                frame.next = index
                if index == size:
                    # Its last edge: let go of its edges (or only next node)
                    # now, while they are in cache (a chain's frames all end
                    # so); only once next_node's frame holds it, as they may
                    # be all that does (another thread may have replaced
                    # them).
                    frame.edges = NULL
                    try:
                        push_dependency_frame(stack[0], <NodeBase>next_node, slot)
                    finally:
                        decref(edges)
                else:
                    push_dependency_frame(stack[0], <NodeBase>next_node, slot)
            else:
                let_others_run(&work_left)
                graph_task.dependencies_.finish(frame.node, frame.slot)
                executes = marking and mark_exec_info(graph_task, frame)
                pop_dependency_frame(stack[0])
                if executes and not stack.empty():
                    stack.back().needed = True
    finally:
        # The frames an error (a cycle, Ctrl-C) left.
        while not stack.empty():
            pop_dependency_frame(stack[0])
    return 0


cdef inline bint mark_exec_info(GraphTask graph_task, DependencyFrame* frame) except -1:
    """The search below ``frame``'s node is done: mark it needed if a node
    below it runs or captures (in its DependencyMap slot, the twin's
    exec_info entry). Returns whether it runs or captures itself (needed,
    or an output's entry)."""
    if not frame.needed:
        return graph_task.exec_info_.should_execute(frame.node)
    graph_task.dependencies_.mark_needed(frame.node, frame.slot)
    if graph_task.exec_info_.find(frame.node) == NULL:
        graph_task.exec_info_.record_marked(frame.node)
    return True
