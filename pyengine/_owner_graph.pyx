"""Owner graphs, compiled: the depth-first post-order of Note [Owner graphs]
(``pyengine/_pure/owner_graph.py``), and the loop that calls the owners'
methods in its reverse, without a node object per owner.

Twin: ``pyengine/_pure/owner_graph.py``, which also holds the translation
into gradient-free nodes that both cores run where this loop does not apply
(``Engine.execute_owner_graph`` decides).
"""

from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from libcpp.vector cimport vector

from pyengine._graph_task cimport (SEARCH_FINISHED, SEARCH_ON_PATH, DependencyMap, GraphTask,
                                   SearchState, running_thread_state)
from pyengine._interrupts cimport WORK_BETWEEN_YIELDS, let_others_run, yield_to_other_threads
from pyengine._state cimport ThreadState, thread_state

from pyengine._pure.owner_graph import cycle_error

cdef extern from "Python.h":
    object PyObject_CallMethodNoArgs(object obj, object name)
    # On the arena's owned pointers, without a reference per use.
    void decref "Py_DECREF"(PyObject* obj)


cdef struct Frame:
    PyObject* owner  # borrowed: the held list owns it
    # The owner's children are children[next:end] of the search's arena
    # (See post_order); the frame owns [start, end) there.
    size_t start
    size_t next
    size_t end
    size_t slot  # the owner's slot index in the search's map: a hint


cdef int push_frame(vector[Frame]& stack, vector[PyObject*]& arena, object owner, size_t slot,
                    object collection) except -1:
    """Start the search below ``owner``, whose collection of children is
    ``collection`` (not empty): snapshot it, through its own iteration, at
    the end of the arena, each child owned. See Note [Owner graphs]."""
    cdef Frame frame
    frame.owner = <PyObject*>owner
    frame.slot = slot
    frame.start = arena.size()
    for child in collection:
        # An error here leaves the children read so far in the arena, which
        # owns them: post_order releases them all.
        Py_INCREF(child)
        arena.push_back(<PyObject*>child)
    frame.next = frame.start
    frame.end = arena.size()
    stack.push_back(frame)
    return 0


cdef int post_order(object root, str children, list held, vector[PyObject*]& order) except -1:
    """Append to ``order`` the non-leaf owners under ``root`` in the
    depth-first post-order of Note [Owner graphs] (borrowed: ``held`` keeps
    every owner seen alive, so that no address is reused while the search
    runs attribute lookups). Each owner's collection is read once, into a
    snapshot the search owns: the frames' ranges of one arena, used as a
    stack, so that no object is made per owner. Iterative: any depth; it
    lets other threads run as it goes (See Note [Long passes let other
    threads run])."""
    cdef object collection = getattr(root, children)
    if not collection:
        return 0
    cdef DependencyMap seen  # only the search states; its counts go unused
    cdef vector[Frame] stack
    cdef vector[PyObject*] arena
    cdef Frame* frame
    cdef PyObject* child
    cdef SearchState state
    cdef Py_ssize_t work_left = WORK_BETWEEN_YIELDS
    cdef size_t i, slot
    held.append(root)
    slot = seen.enter(<PyObject*>root)
    try:
        push_frame(stack, arena, root, slot, collection)
        while not stack.empty():
            let_others_run(&work_left)
            frame = &stack.back()
            if frame.next == frame.end:
                order.push_back(frame.owner)
                seen.finish(frame.owner, frame.slot)
                for i in range(frame.start, frame.end):
                    decref(arena[i])
                arena.resize(frame.start)
                stack.pop_back()
                continue
            child = arena[frame.next]
            frame.next += 1
            if seen.full():
                # See pyengine/_table_growth.h.
                while not seen.grow_step():
                    yield_to_other_threads()
            state = seen.add_edge(child, &slot)
            if state == SEARCH_ON_PATH:
                raise cycle_error(<object>child, children)
            if state == SEARCH_FINISHED:
                continue
            held.append(<object>child)
            collection = getattr(<object>child, children)
            if not collection:
                seen.finish(child, slot)  # a leaf
                continue
            push_frame(stack, arena, <object>child, slot, collection)
    finally:
        # What an error (a cycle, an attribute, Ctrl-C) left.
        for i in range(arena.size()):
            decref(arena[i])
    return 0


cdef int run_owner_graph(object root, str children, str method,
                         GraphTask graph_task) except -1:
    """Call ``owner.<method>()`` for each non-leaf owner under ``root``, in
    the reverse of the post-order, as a node of ``graph_task`` runs: the
    order and state the translated graph would run in. See Note [Owner
    graphs]. The first error stops it and propagates."""
    cdef list held = []
    cdef vector[PyObject*] order
    post_order(root, children, held, order)
    cdef ThreadState* thread = thread_state()
    cdef ThreadState previous = thread[0]
    cdef ThreadState running = running_thread_state(graph_task)
    cdef Py_ssize_t i = <Py_ssize_t>order.size() - 1
    while i >= 0:
        thread[0] = running
        try:
            PyObject_CallMethodNoArgs(<object>order[i], method)
        finally:
            thread[0] = previous
        i -= 1
    return 0
