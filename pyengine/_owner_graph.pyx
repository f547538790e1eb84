"""Owner graphs, compiled: the depth-first post-order of Note [Owner graphs]
(``pyengine/_pure/owner_graph.py``), and the loop that calls the owners'
methods in its reverse, without a node object per owner.

Twin: ``pyengine/_pure/owner_graph.py``, which also holds the translation
into gradient-free nodes that both cores run where this loop does not apply
(``Engine.execute_owner_graph`` decides).
"""

from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject, PyObject_IsTrue
from cpython.ref cimport Py_DECREF, Py_INCREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libcpp.vector cimport vector

from pyengine._graph_task cimport DependencyMap, GraphTask, running_thread_state
from pyengine._state cimport ThreadState, thread_state

from pyengine._pure.owner_graph import cycle_error

cdef extern from "Python.h":
    object PyObject_CallMethodNoArgs(object obj, object name)
    bint PyAnySet_CheckExact(object obj)

cdef extern from *:
    """
    /* The next item of a set or frozenset, in its iteration order, without
       an iterator object (which the cyclic GC would count: See Note [Owner
       graphs]). CPython 3.13 took _PySet_NextEntry out of its public
       headers; there, collections are copied into tuples instead. */
    #if PY_VERSION_HEX < 0x030D0000
    #define PYENGINE_SET_NEXT_ENTRY 1
    static inline int pyengine_set_next(PyObject *set, Py_ssize_t *position, PyObject **key) {
        Py_hash_t hash;
        return _PySet_NextEntry(set, position, key, &hash);
    }
    #else
    #define PYENGINE_SET_NEXT_ENTRY 0
    static inline int pyengine_set_next(PyObject *set, Py_ssize_t *position, PyObject **key) {
        (void)set; (void)position; (void)key;
        return 0;
    }
    #endif
    """
    bint SET_NEXT_ENTRY "PYENGINE_SET_NEXT_ENTRY"
    bint set_next "pyengine_set_next" (object collection, Py_ssize_t* position,
                                       PyObject** key) noexcept


# How a frame walks its owner's collection of children.
cdef enum CollectionKind:
    TUPLE_COLLECTION
    LIST_COLLECTION
    SET_COLLECTION


cdef struct Frame:
    PyObject* owner  # borrowed: the held list owns it
    PyObject* children  # owned: a tuple, a list, or a set or frozenset
    CollectionKind kind
    Py_ssize_t position


cdef inline Frame new_frame(object owner, object collection) except *:
    """The search's frame for ``owner``, whose (non-empty) collection of
    children is ``collection``: walked in place when it is a tuple, a list
    or (before CPython 3.13) a set, else copied into a tuple by its own
    iteration, as the twin's ``iter`` walks it."""
    cdef Frame frame
    cdef type collection_type = type(collection)
    if collection_type is tuple:
        frame.kind = TUPLE_COLLECTION
    elif collection_type is list:
        frame.kind = LIST_COLLECTION
    elif SET_NEXT_ENTRY and PyAnySet_CheckExact(collection):
        frame.kind = SET_COLLECTION
    else:
        collection = tuple(collection)
        frame.kind = TUPLE_COLLECTION
    Py_INCREF(collection)
    frame.owner = <PyObject*>owner
    frame.children = <PyObject*>collection
    frame.position = 0
    return frame


cdef inline PyObject* next_child(Frame* frame) noexcept:
    """The frame's next child (borrowed from its collection), or NULL."""
    cdef PyObject* child = NULL
    if frame.kind == TUPLE_COLLECTION:
        if frame.position < PyTuple_GET_SIZE(<object>frame.children):
            child = PyTuple_GET_ITEM(<object>frame.children, frame.position)
            frame.position += 1
    elif frame.kind == LIST_COLLECTION:
        # The size is read each time: an attribute lookup may run code.
        if frame.position < PyList_GET_SIZE(<object>frame.children):
            child = PyList_GET_ITEM(<object>frame.children, frame.position)
            frame.position += 1
    elif not set_next(<object>frame.children, &frame.position, &child):
        child = NULL
    return child


cdef int post_order(object root, str children, list held, vector[PyObject*]& order) except -1:
    """Append to ``order`` the non-leaf owners under ``root`` in the
    depth-first post-order of Note [Owner graphs] (borrowed: ``held`` keeps
    every owner seen alive, so that no address is reused while the search
    runs attribute lookups). Iterative: any depth."""
    cdef object collection = getattr(root, children)
    if not collection:
        return 0
    # Visits counted per owner: 1 while its search runs, 2 or more once it
    # finished (a leaf finishes at once).
    cdef DependencyMap seen
    cdef vector[Frame] stack
    cdef PyObject* child
    cdef Py_ssize_t visits
    held.append(root)
    seen.add(<PyObject*>root)
    stack.push_back(new_frame(root, collection))
    try:
        while not stack.empty():
            child = next_child(&stack.back())
            if child == NULL:
                order.push_back(stack.back().owner)
                seen.add(stack.back().owner)
                Py_DECREF(<object>stack.back().children)
                stack.pop_back()
                continue
            visits = seen.add_counting(child)
            if visits == 1:
                raise cycle_error(<object>child, children)
            if visits >= 2:
                continue
            held.append(<object>child)
            collection = getattr(<object>child, children)
            if not collection:
                seen.add(child)  # a leaf
                continue
            stack.push_back(new_frame(<object>child, collection))
    finally:
        # The frames an error left.
        while not stack.empty():
            Py_DECREF(<object>stack.back().children)
            stack.pop_back()
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
