# Long passes of the compiled core: letting other threads run, and honouring
# signals (Ctrl-C), while a pass holds the GIL.
#
# Note [Long passes let other threads run]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A whole-graph pass in C (compute_dependencies, init_to_execute, the owner
# graph's search) touches a million nodes in a fraction of a second, all
# with the GIL held and no bytecode boundary at which the interpreter
# would hand the GIL to another thread or run a signal handler. So every
# such pass counts its work and, every WORK_BETWEEN_YIELDS units (a node
# visited, an edge followed), calls let_others_run: it releases the GIL for
# a moment, which hands it over to any thread that asked for it (CPython
# switches on request once a thread has waited its switch interval), and
# then runs pending signal handlers, raising what they raise
# (KeyboardInterrupt) out of the pass.
#
# While the GIL is released, other threads run Python code and may change
# the graph: a pass must own a reference to everything it reads after a
# yield (the tuples of next edges on its stack, the collections of an owner
# graph), never borrow one. Pointers it only compares (the keys of a
# DependencyMap) may be borrowed.
#
# The pure twin needs no such call: the interpreter switches threads and
# runs signal handlers between bytecodes of its passes by itself.

from cpython.exc cimport PyErr_CheckSignals

# About a millisecond of work in the fastest pass.
cdef enum:
    WORK_BETWEEN_YIELDS = 4096


cdef inline int let_others_run(Py_ssize_t* work_left) except -1:
    """Count one unit of a long pass's work in ``work_left`` (start it at
    WORK_BETWEEN_YIELDS); once it runs out, let other threads take the GIL
    and run signal handlers. See Note [Long passes let other threads run]."""
    work_left[0] -= 1
    if work_left[0] > 0:
        return 0
    work_left[0] = WORK_BETWEEN_YIELDS
    with nogil:
        pass
    PyErr_CheckSignals()
    return 0
