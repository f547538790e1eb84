# Locking rules of the compiled core, in one place.
#
# Note [Locks and the GIL]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Engine mutexes are C++ std::mutex, but for the GraphTask's and a leaf's
# GradLock, a GILGuardedLock (See Note [A lock the GIL guards] in
# _gil_guarded_lock.h).
# A thread never blocks on one while it holds the GIL: it tries the lock,
# and only if that fails releases the GIL to wait for it
# (lock_releasing_gil; GILGuardedLock.lock waits so by itself). A thread
# holding an engine mutex runs no user code (node, hook, callback), so it
# never waits for the GIL in a way that another waiter could be blocking;
# under the GraphTask's, a backend's add or a __del__ may still run, which
# is why that lock refuses its own holder (See Note [Accumulating under the
# graph task lock] in _engine.pyx). GraphTask locks are taken before
# ReadyQueue locks, never the reverse.

from cpython.pystate cimport PyThreadState
from libcpp.mutex cimport mutex

cdef extern from "_gil_guarded_lock.h":
    # Lock and unlock with the GIL held: See Note [A lock the GIL guards]
    # in _gil_guarded_lock.h.
    cppclass GILGuardedLock "pyengine_GILGuardedLock":
        # 0 locked; 1 this thread holds it; -1 a signal handler raised.
        int lock()
        # Never waits: false where any thread holds it, this one included.
        bint try_lock()
        void unlock()
        bint held_by(PyThreadState* tstate)


cdef inline void lock_releasing_gil(mutex& m) noexcept:
    """Lock ``m`` from a thread that holds the GIL. See Note [Locks and the GIL]."""
    if not m.try_lock():
        with nogil:
            m.lock()


# Note [Waits honour signals]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A thread that waits for the engine (for a task in its ReadyQueue, for a
# graph task to complete, for a pool thread) waits on a C++ condition
# variable without the GIL. A signal (Ctrl-C) only sets a flag there:
# CPython runs the handler on the main thread, at its next bytecode. So the
# main thread never waits unbounded: it waits in slices of WAIT_SLICE_MS,
# and between slices, with the engine mutex released, it takes the GIL and
# calls PyErr_CheckSignals(), which runs pending handlers and raises what
# they raise (KeyboardInterrupt) out of the wait; a wait ends on a
# notification as before, so a slice costs nothing when work comes. Other
# threads never run signal handlers, so they wait without slices: they
# would take the GIL every slice for nothing.
#
# The pure twin waits the same way (wait_honouring_signals in
# pyengine/_pure/ready_queue.py): Condition.wait(timeout) in slices on the
# main thread; an interrupted Condition.wait re-takes its lock before it
# raises, so the twin's waits end with the same exception and no lock held.
#
# Whoever waited then cancels what it waited for (See Note [Cancelling a
# graph task] in pyengine/_pure/engine.py) and lets the exception go on:
# backward raises KeyboardInterrupt within about a slice.

from libcpp.condition_variable cimport condition_variable, cv_status
from libcpp.mutex cimport unique_lock
from cpython.exc cimport PyErr_CheckSignals

cdef extern from "<chrono>" namespace "std::chrono" nogil:
    cppclass milliseconds:
        milliseconds(long long count)

# Short enough for Ctrl-C to feel immediate (the goal is 100 ms), long
# enough that an idle main thread takes the GIL only 50 times a second.
cdef enum:
    WAIT_SLICE_MS = 20


cdef inline bint is_main_thread() except -1:
    """Whether this thread runs signal handlers (CPython's main thread);
    needs the GIL. See Note [Waits honour signals]."""
    import threading
    return threading.get_ident() == threading.main_thread().ident


cdef inline int wait_honouring_signals(condition_variable& cv, unique_lock[mutex]& lock,
                                       bint on_main_thread) except -1 nogil:
    """``cv.wait(lock)`` without the GIL; on the main thread, one slice of it,
    then signal handlers run (with ``lock`` released while they do), raising
    out of the wait with ``lock`` not held. See Note [Waits honour signals]."""
    if not on_main_thread:
        cv.wait(lock)
        return 0
    cv.wait_for(lock, milliseconds(WAIT_SLICE_MS))
    lock.unlock()
    with gil:
        PyErr_CheckSignals()
    lock.lock()
    return 0


# The longest single wait_for: steady_clock's now plus a longer one could
# pass its 64-bit count of nanoseconds.
cdef enum:
    LONGEST_WAIT_MS = 86400000


cdef inline long long wait_for_honouring_signals(condition_variable& cv, unique_lock[mutex]& lock,
                                                 bint on_main_thread,
                                                 long long left_ms) except -1 nogil:
    """``wait_honouring_signals``, bounded: wait at most ``left_ms``
    milliseconds (more than 0); return the milliseconds left, 0 once they
    ran out. A wait that a notification (or a spurious wake-up) ends early
    counts as none: the caller looks at what it waits for, and waits again
    for at most what is left."""
    cdef long long slice_ms = min(left_ms, WAIT_SLICE_MS if on_main_thread else LONGEST_WAIT_MS)
    cdef bint timed_out = cv.wait_for(lock, milliseconds(slice_ms)) == cv_status.timeout
    if on_main_thread:
        lock.unlock()
        with gil:
            PyErr_CheckSignals()
        lock.lock()
    return left_ms - slice_ms if timed_out else left_ms
