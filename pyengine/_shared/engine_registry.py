"""Every Engine made, held weakly: each is stopped at interpreter exit and
gets fresh threads in a forked child.

Shared by the compiled core and the twin (See Note [Slow paths are
shared]): an Engine registers itself once, when it is made, and the two
hooks below serve the engines of both cores (a process may load both).

Note [Every engine is stopped at exit and reset after fork]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A forked child has only the thread that forked: an engine's pool and
device threads are gone, their queues may hold tasks of the parent and
their locks may have been held. An engine that still counts on them hangs
the child's first backward that needs a thread. ``Engine._reset_after_fork``
gives it fresh ones, and ``Engine.stop`` fails a backward still waiting for
device work at exit; both ran for the default engine only, so an
``Engine()`` a user made hung in a forked child and was never stopped.
So every Engine registers itself here from ``__init__``, and the hooks
below run for each live one, in the order they were made.

The registry holds weak references, so it keeps no engine alive: one
that nothing else refers to is collected as before (one whose device or
pool threads started lives on with them: each runs a method of its
engine). It is a list, not a WeakSet, so that an Engine subclass need not
be hashable; dead references are pruned as engines are registered.
``_lock`` guards the list against two threads that register at once; a
forked child makes a new one, since the parent's may have been held by a
thread the child does not have.
"""

import atexit
import os
import threading
import weakref

_lock = threading.Lock()
# weakref.ref to each Engine made, in the order made; guarded by _lock.
_engines = []


def register_engine(engine):
    """Stop ``engine`` at exit and reset it in a forked child, for as long as
    it lives."""
    with _lock:
        _engines[:] = [ref for ref in _engines if ref() is not None]
        _engines.append(weakref.ref(engine))


def live_engines():
    """The engines registered and not yet collected, in the order made."""
    with _lock:
        refs = list(_engines)
    return [engine for engine in (ref() for ref in refs) if engine is not None]


def _stop_engines():
    for engine in live_engines():
        engine.stop()


def _reset_engines_after_fork():
    global _lock
    _lock = threading.Lock()
    for engine in live_engines():
        engine._reset_after_fork()


atexit.register(_stop_engines)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_engines_after_fork)
