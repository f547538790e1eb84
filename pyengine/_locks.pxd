# Locking rules of the compiled core, in one place.
#
# Note [Locks and the GIL]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Engine mutexes are C++ std::mutex. A thread never blocks on one while it
# holds the GIL: it tries the lock, and only if that fails releases the GIL
# to wait for it (lock_releasing_gil). A thread holding an engine mutex runs
# no user code (node, hook, callback), so it never waits for the GIL in a
# way that another waiter could be blocking. GraphTask locks are taken
# before ReadyQueue locks, never the reverse.

from libcpp.mutex cimport mutex


cdef inline void lock_releasing_gil(mutex& m) noexcept:
    """Lock ``m`` from a thread that holds the GIL. See Note [Locks and the GIL]."""
    if not m.try_lock():
        with nogil:
            m.lock()
