"""The twin's condition variable: one that a KeyboardInterrupt cannot leave
half taken or half waited.

The compiled core waits on C++ condition variables under C++ mutexes (See
Note [Locks and the GIL] in ``pyengine/_locks.pxd``): C code, which no
interrupt enters between two steps. This class stands in for them in the
twin, as ``threading.Condition`` did before it. See Note [An interrupt in
the twin's condition variable].

Note [An interrupt in the twin's condition variable]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
From Python 3.10 on, CPython runs a signal handler on the main thread at a
Python function's entry, after a call returns and on a loop's back edge
(and in a blocking lock acquire), and what the handler raises
(KeyboardInterrupt) comes out there. ``threading.Condition`` is Python code
around a C lock, and an interrupt at those places broke the twin:

- in its ``__enter__``, after the lock's acquire returned: the with
  statement never began, the lock stayed taken, and the thread's next
  ``with`` on it (the cancel that the interrupt starts) waited for itself
  for good;
- at its ``__exit__``'s entry: the same, with the with block's body done;
- in ``wait``, after the release and before its ``try``: the with block
  around the wait let go of a lock that it no longer held (RuntimeError in
  place of the KeyboardInterrupt);
- in ``notify``, between taking a waiter out of the list and releasing it:
  that thread waited for good.

``tests/test_interrupt_sweep.py`` found them all, raising KeyboardInterrupt
at each such place of a backward in turn. This class closes them:

- ``__enter__`` and ``__exit__`` are the C lock's own methods (properties
  hand them out), so that a with block takes and lets go of the lock with
  no Python frame between the lock and the block;
- ``wait`` takes the lock back, in C, in a ``finally`` that begins before
  the release; whatever ends the wait, it ends holding the lock, with its
  waiter out of the list, and a wait that raises passes a notification on
  (one may have come for it, which another waiter must then get: the
  twin's waits all sit in loops that check what they wait for, so one
  more wake-up costs a look);
- ``notify`` takes its waiters out of the list and releases them in one C
  call with no Python frame, made ready before the list changes.

The lock is a ``threading.RLock``, only so that ``wait`` and ``notify`` can
ask whether this thread holds it (C); no thread takes it twice.

Left: a second interrupt while ``wait`` handles the first (its lock's
acquire, blocking, honours signals; See Note [Where the twin's main thread
sees an interrupt] in ``pyengine/_pure/engine.py``, which leaves second
interrupts out).
"""

from __future__ import annotations

import threading

from .._shared.messages import cannot_pickle_message
from .._shared.uninterrupted import run_all

__all__ = ["Condition"]

_allocate_lock = threading.Lock
_release = type(threading.Lock()).release
_RLock = type(threading.RLock())


class Condition:
    """A condition variable on a ``threading.RLock`` (its own, or one that
    several conditions share, as ``threading.Condition(lock)``): ``with``,
    ``wait``, ``notify`` and ``notify_all`` as ``threading.Condition``'s.
    See Note [An interrupt in the twin's condition variable]."""

    __slots__ = ("_lock", "_waiters")

    def __init__(self, lock=None):
        if lock is None:
            lock = threading.RLock()
        elif not isinstance(lock, _RLock):
            raise TypeError(f"a Condition's lock must be a threading.RLock, not "
                            f"{type(lock).__name__}")
        self._lock = lock
        self._waiters = []

    # The lock's own C methods: a with block takes and lets go of the lock
    # with no Python frame around the acquire or before the release.
    @property
    def __enter__(self):
        return self._lock.__enter__

    @property
    def __exit__(self):
        return self._lock.__exit__

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))

    def wait(self, timeout=None):
        """Let go of the lock, wait for a notification (at most ``timeout``
        seconds), take the lock back; return whether one came. This thread
        must hold the lock. An exception (KeyboardInterrupt on the main
        thread) ends the wait with the lock held again."""
        lock = self._lock
        if not lock._is_owned():
            raise RuntimeError("cannot wait on un-acquired lock")
        waiter = _allocate_lock()
        waiter.acquire()
        notified = False
        try:
            self._waiters.append(waiter)
            lock.release()
            try:
                notified = waiter.acquire(True, -1 if timeout is None else timeout)
            finally:
                lock.acquire()
            # A notification took the waiter out; a timeout left it in.
            self._withdraw(waiter)
        except BaseException:
            # The wait was cut short, maybe at the lock's acquire, maybe
            # after a notification came: the lock comes back first, so that
            # the with block around lets go of it; a notification taken for
            # this waiter goes to another one.
            if not lock._is_owned():
                lock.acquire()
            self._withdraw(waiter)
            self.notify()
            raise
        return notified

    def _withdraw(self, waiter):
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def notify(self, n=1):
        """Wake up to ``n`` waiting threads. This thread must hold the lock."""
        if not self._lock._is_owned():
            raise RuntimeError("cannot notify on un-acquired lock")
        waiters = self._waiters
        woken = waiters[:n]
        # Made before the list changes (a call, after which an interrupt may
        # come out); nothing between the del and the one call that runs it.
        releases = map(_release, woken)
        del waiters[:n]
        run_all(releases)

    def notify_all(self):
        """Wake every waiting thread. This thread must hold the lock."""
        self.notify(len(self._waiters))
