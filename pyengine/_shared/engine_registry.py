"""Every Engine made, held weakly: each is stopped at interpreter exit and
gets fresh threads in a forked child; its threads hold it weakly too, and
end once it is collected.

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
that nothing else refers to is collected (See Note [An engine's threads
hold it weakly]). It is a list, not a WeakSet, so that an Engine subclass
need not be hashable; dead references are pruned as engines are
registered. ``_lock`` guards the list against two threads that register
at once; a forked child makes a new one, since the parent's may have been
held by a thread the child does not have.

Note [An engine's threads hold it weakly]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An engine starts a device worker per device and reentrant pool threads
when a backward first needs them, and they serve until ``Engine.stop``.
Each ran a method of its engine for as long as it lived, so an engine
whose threads had started was never collected: a program that made an
Engine per model, or a test suite one per test, kept every idle thread and
everything its engines held (20 engines made and dropped, 20 pool threads).

Now a thread holds its engine only while it has work, and a weak
reference between: a device worker waits for its queue's next task
(``ReadyQueue.wait_for_task``), then takes its engine and runs the queue
until it is empty (``Engine._device_thread_main``); a pool thread takes it
for each graph task handed off (``run_pool_task``, in each core's pool
module: a Python function in the compiled core would put a Python frame,
and the interpreter's own failures where memory runs out, on every
hand-off's path). No task comes for an
engine that is gone: a backward's caller holds its engine while it runs.
An idle thread looks at its engine every ``IDLE_CHECK_S`` seconds and ends
once it has been collected.

An idle thread may wake while the interpreter finalizes (one whose engine
was collected is not stopped at exit). It takes the GIL back only as the
end of a ``with nogil`` block does (``PyEval_RestoreThread``), which
CPython turns into the end of a daemon thread once finalizing; never with
Cython's ``with gil`` (``PyGILState_Ensure``), which late in finalization
makes a thread state for an interpreter that is gone (CI's ThreadSanitizer
stage: a segfault in ``new_threadstate`` at the end of a test process).

Not a finalizer that stops the threads at once: it may run from the cyclic
garbage collector, on any thread, in the middle of a critical section of
that engine's own locks (in the twin, the queue's and the pool's are
Python locks around Python code), where taking the lock again would hang
the thread. A look at a weak reference takes no lock. The cost: an idle
thread wakes once every ``IDLE_CHECK_S``; a device worker whose queue ran
dry calls a weak reference and a method before its next task.
"""

import atexit
import os
import threading
import weakref

# How often an idle device or pool thread looks whether its engine was
# collected: See Note [An engine's threads hold it weakly].
IDLE_CHECK_S = 1.0

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
