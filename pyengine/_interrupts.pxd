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
# visited, an edge followed), calls let_others_run, which calls a Python
# function that does nothing (``pyengine._bytecode_boundary``). Entering it
# is a bytecode boundary: there the interpreter hands the GIL to a thread
# that has asked for it (a thread asks once it has waited its switch
# interval, 5 ms by default) and runs pending signal handlers, raising what
# they raise (KeyboardInterrupt) out of the pass. So another thread waits
# at most about a switch interval plus the work between two calls.
#
# The run is such a pass too where its nodes' work is C alone: a node of
# Python code reaches a bytecode boundary in its apply, but a million
# leaves' AccumulateGrad nodes, or one node's million edges, would hold the
# GIL for a second (benchmarks/RESULTS.md, "Long runs of C in the run").
# So a worker's loop counts its nodes (NODES_BETWEEN_YIELDS between yields,
# inside the node's try: an interrupt there fails the graph task as the
# node raising would), and the routing of a node's gradients, their
# validation, execute's and init_to_execute's loops over their arguments
# and the checks of a node's next edges and input metadata count their
# edges, and what a failed graph task leaves (its queued tasks, its
# gradients waiting for nodes that will not run or captured) is let go of
# in slices (See Note [What a failed graph task leaves is let go of in
# slices] in ``pyengine/_pure/graph_task.py``). What is left: the growth
# of a vector of a million entries (the ready queue's heap,
# init_to_execute's captures), one copy of tens of megabytes, 10 to 20 ms,
# once per doubling.
#
# Releasing the GIL for a moment (``with nogil: pass``) looks like the same
# thing and is not: the waiting thread wakes up, finds the GIL taken back
# already, and starts its switch interval again, so it rarely gets the GIL,
# while the pass pays for the wake-ups. benchmarks/RESULTS.md has both
# measured (gil_stalls.py).
#
# While another thread holds the GIL, it runs Python code and may change
# the graph: a pass must own a reference to everything it reads after a
# yield (the tuples of next edges on its stack, the collections of an owner
# graph), never borrow one. Pointers it only compares (the keys of a
# DependencyMap) may be borrowed.
#
# The pure twin needs no such call: the interpreter switches threads and
# runs signal handlers between bytecodes of its passes by itself.


cdef int yield_to_other_threads() except -1

# About a millisecond of work in the fastest pass.
cdef enum:
    WORK_BETWEEN_YIELDS = 4096

# Nodes a worker's loop runs between two yields: about a millisecond of nodes
# of C alone (an AccumulateGrad's, about 2 us).
cdef enum:
    NODES_BETWEEN_YIELDS = 512


cdef inline object yield_keeping_interrupt(object interrupt):
    """A yield for a loop that must finish whatever a signal handler raises
    (See Note [What a failed graph task leaves is let go of in slices] in
    ``pyengine/_pure/graph_task.py``): with ``interrupt`` kept already, none
    and ``interrupt`` back; else what the yield raised, or None."""
    if interrupt is not None:
        return interrupt
    try:
        yield_to_other_threads()
    except BaseException as error:
        return error
    return None


cdef inline int let_others_run(Py_ssize_t* work_left,
                               Py_ssize_t between=WORK_BETWEEN_YIELDS) except -1:
    """Count one unit of a long pass's work in ``work_left`` (start it at
    ``between``, the units between two yields); once it runs out, let other
    threads take the GIL and run signal handlers. See Note [Long passes let
    other threads run]."""
    work_left[0] -= 1
    if work_left[0] > 0:
        return 0
    work_left[0] = between
    return yield_to_other_threads()
