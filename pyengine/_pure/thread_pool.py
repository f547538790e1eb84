"""The reentrant thread pool: graph tasks handed off by a reentrant backward
nested too deep to run inline, and the threads that run them.

Twin of ``pyengine/_thread_pool.pyx``. The engine hands a graph task off
with ``add_thread_pool_task`` once per hand-off, never per node; a pool
thread runs the task through the engine's ``_run_pool_task``, a call back
into the engine, which it holds weakly (See Note [An engine's threads hold
it weakly] in pyengine/_shared/engine_registry.py), so this module needs
nothing else from it.

Note [Reentrant backward]
~~~~~~~~~~~~~~~~~~~~~~~~~
A backward started inside a node's ``apply`` (or a hook) is reentrant. Its
graph task gets ``reentrant_depth`` one more than the task that was running,
shares the caller's ReadyQueue, and runs on the same thread, recursively:
its tasks sort before the parent's (See Note [Ready queue order]), so the
child completes before the parent's queued work continues. Each level costs
Python and C stack, so past ``max_recursion_depth`` levels on one thread the
child graph task goes to a pool thread that serves the same queue, with a
fresh stack, while the caller blocks (with the GIL released) until the child
completes. A pool thread may in turn go ``max_recursion_depth`` levels deep
before handing off again, so chains thousands of levels deep complete.

Note [Bounds on reentrant backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A hook that calls backward on its own retained graph nests without end,
and every ``max_recursion_depth`` levels it takes one more pool thread: left
alone it starts threads until the system refuses one. PyTorch's engine.cpp
has no bound here (``total_depth`` only orders the ready queue; its pool
grows by a thread per hand-off), so pyengine sets three:

- ``max_total_depth`` (default ``MAX_TOTAL_DEPTH``, 4096): a reentrant
  backward nested deeper than that raises RecursionError before it queues
  anything, naming the depth and the attribute that raises the limit. The
  error goes up through every level as that level's error, so the outermost
  backward raises it, after at most about ``max_total_depth /
  (max_recursion_depth + 1)`` pool threads (68 with the defaults) took part.
- ``max_pool_threads`` (default ``MAX_POOL_THREADS``, 256): a hand-off that
  finds no idle pool thread and this many threads started raises
  RuntimeError instead of waiting, since the busy threads may all be waiting
  for it (a deadlock). Several threads that each nest deeply at once share
  the pool, so it is larger than one chain needs.
- A pool thread that fails to start (``threading.Thread.start`` raises) is
  taken off the pool's list and its slot given back, the graph task handed
  off is taken back and cancelled (See Note [Cancelling a graph task]),
  and the reentrant ``execute`` raises RuntimeError naming the depth, from
  the original error. A pool thread that ends for any reason takes itself
  off the list, so ``stop`` joins only threads that ran.

Note [A pool thread is back before its caller]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pool thread completes its graph task from inside ``thread_main``, and the
caller waiting in ``add_thread_pool_task`` wakes at once, while the thread
still has to unwind and count itself idle. Without more, a caller that
returns and hands off again at once (the next backward, or the next level)
can find that thread not yet idle: PyTorch's unbounded pool would start one
more thread, but a pool at ``max_pool_threads`` raises "all N threads ...
are busy" although none is (See Note [Bounds on reentrant backward]). So
the thread marks its task ``on_pool_thread`` in the critical section
that takes it from the queue, and clears the mark in the one that counts
it idle again; the caller, once its task completed, waits for the mark to
clear. Marked any later, the caller of a task that completed before its
thread marked it (another thread ran its last node) returned at once,
reading the mark while the thread wrote it outside the lock: a data race
the ThreadSanitizer stage's thread fuzz reported. The wait is short (the
thread needs only the GIL, which the caller does not hold), and
a backward that returns has every pool thread it used idle again. A caller
that cancels its task (Ctrl-C, a thread that did not start) does not wait;
if a pool thread still runs the task, the caller's backward ends: See Note
[A backward that raises leaves its ready queue] in
``pyengine/_pure/engine.py``.

Note [A hand-off wakes a pool thread]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two kinds of thread wait on the pool: an idle pool thread for a graph task
(``work``), and a caller whose task completed for its pool thread to come
back (``released``: See Note [A pool thread is back before its caller]).
They wait on two conditions of the one lock, as the compiled core's
two condition variables. On one condition, a hand-off that finds an idle
thread left over for it wakes one waiter, the longest waiting, which may be
a caller waiting for its thread: it waits again, the idle thread sleeps on,
and the task waits in ``graph_tasks`` for a wake-up that comes only when
some pool thread finishes a task. If each busy pool thread waits for a task
in that queue (a reentrant backward of its own, handed off), none comes,
and every caller waits forever. The thread fuzz found it (a caller on a
device worker, its pool thread in a nested hand-off);
``tests/test_reentrant_pool.py`` shows it with the pool's functions.

Note [A slot taken for a pool thread]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A hand-off that starts a thread takes its slot in ``num_threads`` under
the pool's lock, and the thread gives it back as it ends. A thread that
never starts must give it back at once, or the pool loses a slot for good
and, a few slots later, refuses every hand-off as full. Ctrl-C can come
while Python code makes the thread (``threading.Thread()``, in both cores)
and, in the twin, on the main thread between any two steps (See Note
[Where the twin's main thread sees an interrupt] in
``pyengine/_pure/engine.py``). So the thread is made inside the ``try``
that gives the slot back, and the slot is held in a one-item list,
``slot``, whose item is True from the step that takes it until the new
thread, first thing, takes it under the pool's lock: whoever sets it back
to False (the thread, or an ``except`` of its starter) has the slot,
exactly once. Setting an item allocates nothing, so a MemoryError cannot
come between taking the slot and holding it (the compiled core makes the
list before it takes the lock, under which nothing allocates). Whether the thread
started cannot tell: Ctrl-C may come while ``start()`` waits for a thread
that runs but has not yet set its ``ident`` (a starter that judged by it
gave the slot back for a thread that then ran, counted idle but not among
the threads). A thread that finds its slot given back ends at once. For
the same reason the graph task is queued inside the ``try`` that
withdraws and cancels it, so an interrupt never leaves a graph task queued
for the pool that its caller gave up.

Note [Stopping the pool]
~~~~~~~~~~~~~~~~~~~~~~~~
``Engine.stop`` (at interpreter exit, or called by hand) ends the pool
threads: ``stop_thread_pool`` sets ``stopping``, and an idle thread that
sees it returns without taking another graph task. A graph task handed off
after that, or handed off before it but taken by no thread yet, would wait
forever for a thread that never comes, and its caller with it (an atexit
handler that runs a deep reentrant backward after the engine's own stopped
hung the exit). So, under the pool's lock that sets ``stopping``:

- ``add_thread_pool_task`` refuses a hand-off once ``stopping`` is set:
  the graph task is cancelled (See Note [Cancelling a graph task] in
  ``pyengine/_pure/engine.py``) and the reentrant ``execute`` raises
  RuntimeError saying that the pool threads have stopped, as a device task
  after ``stop`` raises that the device threads have;
- ``stop_thread_pool`` takes every graph task still queued off the queue
  and fails it with that RuntimeError, after dropping its tasks from its
  CPU queue: its caller, waiting in ``add_thread_pool_task``, wakes and
  raises it from its ``execute``.

A graph task a pool thread already took runs to completion (or fails on a
stopped device: See Note [A shutdown task is the device worker's] in
``pyengine/_pure/engine.py``); the thread then sees ``stopping`` and ends.
"""

import threading

from .._shared.engine_registry import IDLE_CHECK_S
from .._shared.messages import (
    POOL_ENGINE_GONE_MESSAGE,
    cannot_pickle_message,
    pool_full_message,
    pool_stopped_message,
)
from .condition import Condition
from .graph_task import cancel_graph_task
from .static_types import check_argument


class _ThreadPoolShared:
    """Graph tasks handed off by a too-deep reentrant backward, and the pool
    threads that run them. ``graph_tasks``, ``num_idle``, ``num_threads``
    (started or starting, not yet ended: at most the engine's
    ``max_pool_threads``), ``threads`` (the started ones, for ``stop`` to
    join) and ``stopping`` are guarded by ``condition``'s lock. Idle pool
    threads wait on ``work``, callers for their pool thread on
    ``released``, two conditions of that lock: See Note [A hand-off wakes
    a pool thread]."""

    def __init__(self):
        lock = threading.RLock()
        self.condition = Condition(lock)
        self.work = Condition(lock)
        self.released = Condition(lock)
        self.graph_tasks = []
        self.num_idle = 0
        self.num_threads = 0
        self.threads = []
        self.stopping = False

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))


def add_thread_pool_task(pool, graph_task, max_pool_threads, engine_ref):
    """Hand ``graph_task`` to a pool thread and block until it completes.
    The pool thread runs it with the engine ``engine_ref`` (a weak
    reference) refers to. See Note [Reentrant backward] and Note [Bounds on
    reentrant backward]."""
    refused = None
    # The slot taken in num_threads for a thread that has not taken it yet:
    # True while it is ours to give back. See Note [A slot taken for a pool
    # thread].
    slot = [False]
    try:
        with pool.condition:
            # PyTorch's rule: a new thread unless an idle one is left over for it.
            start_thread = pool.num_idle <= len(pool.graph_tasks)
            if pool.stopping:
                # See Note [Stopping the pool].
                refused = pool_stopped_message(graph_task.reentrant_depth)
            elif start_thread and pool.num_threads >= max_pool_threads:
                refused = pool_full_message(graph_task.reentrant_depth, max_pool_threads)
            else:
                # First: where it raises MemoryError, nothing changed (See
                # Note [C++ allocations that fail] in pyengine/_engine.pyx).
                pool.graph_tasks.append(graph_task)
                if start_thread:
                    pool.num_threads += 1
                    slot[0] = True
        if refused is not None:
            raise RuntimeError(refused)
        if start_thread:
            start_pool_thread(pool, graph_task, engine_ref, slot)
        with pool.condition:
            pool.work.notify()  # See Note [A hand-off wakes a pool thread].
        graph_task.wait()
    except BaseException as error:
        # Refused, a thread that did not start, or Ctrl-C (while waiting,
        # or, in the twin, anywhere): the child ends here. See Note
        # [Cancelling a graph task] in pyengine/_pure/engine.py.
        give_back_slot(pool, slot)
        withdraw_pool_task(pool, graph_task)
        cancel_graph_task(graph_task, error)
        raise
    # See Note [A pool thread is back before its caller].
    with pool.condition:
        while graph_task.on_pool_thread:
            pool.released.wait()


def start_pool_thread(pool, graph_task, engine_ref, slot):
    """Start a pool thread, its slot in ``num_threads`` already taken (and
    held in ``slot`` until the thread takes it); if it cannot start, give
    the slot back and raise RuntimeError. See Note [A slot taken for a pool
    thread]."""
    thread = None
    try:
        thread = threading.Thread(target=_reentrant_thread_main,
                                  args=(pool, engine_ref, slot),
                                  name="pyengine-reentrant", daemon=True)
        with pool.condition:
            pool.threads.append(thread)
        thread.start()
    except BaseException as error:
        # Started or not (Ctrl-C may come while start() waits for the new
        # thread), the slot goes back unless the thread took it; a thread
        # that finds it gone ends at once.
        give_back_slot(pool, slot, thread)
        if not isinstance(error, Exception):
            raise
        raise RuntimeError(
            f"could not start a reentrant pool thread for a backward nested "
            f"{graph_task.reentrant_depth} levels deep: {error}") from error


def give_back_slot(pool, slot, thread=None):
    """Give back the slot in ``num_threads`` that ``slot`` holds, if the
    thread it was taken for has not taken it (and take ``thread`` off the
    pool's list: it never runs as a pool thread)."""
    with pool.condition:
        if slot[0]:
            pool.num_threads -= 1
            slot[0] = False
            if thread is not None and thread in pool.threads:
                pool.threads.remove(thread)


def run_pool_task(engine_ref, graph_task):
    """Run ``graph_task``, handed off to the pool, with the engine
    ``engine_ref`` (a weak reference) refers to: a pool thread's call back
    into the engine. See Note [An engine's threads hold it weakly] in
    pyengine/_shared/engine_registry.py."""
    engine = engine_ref()
    if engine is None:
        raise RuntimeError(POOL_ENGINE_GONE_MESSAGE)
    engine._run_pool_task(graph_task)


def _reentrant_thread_main(pool, engine_ref, slot):
    """A pool thread: take the slot its starter took for it (``slot``), then
    run the graph tasks handed off, with the engine ``engine_ref`` (a weak
    reference) refers to, until the pool stops or that engine is collected
    (See Note [An engine's threads hold it weakly] in
    pyengine/_shared/engine_registry.py)."""
    check_argument("pool", pool, _ThreadPoolShared)
    with pool.condition:
        if not slot[0]:
            # Its starter gave the slot back: See Note [A slot taken for a
            # pool thread].
            if threading.current_thread() in pool.threads:
                pool.threads.remove(threading.current_thread())
            return
        slot[0] = False
        pool.num_idle += 1
    # Whether this thread is counted in num_idle: from its start, and
    # again from the moment it finishes a task (See Note [A pool thread
    # is back before its caller]).
    counted_idle = True
    try:
        while True:
            with pool.condition:
                idle_check_due = False
                while not pool.graph_tasks and not pool.stopping and not idle_check_due:
                    idle_check_due = not pool.work.wait(IDLE_CHECK_S)
                idle_check_due = not pool.graph_tasks and not pool.stopping
                if not idle_check_due:
                    pool.num_idle -= 1
                    counted_idle = False
                    if pool.stopping:
                        return
                    graph_task = pool.graph_tasks.pop(0)
                    # Marked as it leaves the queue, under the lock its
                    # caller reads the mark with: See Note [A pool thread is
                    # back before its caller].
                    graph_task.on_pool_thread = True
            if idle_check_due:
                # Out of the lock, as the compiled core looks out of its
                # nogil block: See Note [An engine's threads hold it weakly]
                # in pyengine/_shared/engine_registry.py.
                if engine_ref() is None:
                    return
                continue
            try:
                run_pool_task(engine_ref, graph_task)
            except BaseException as error:
                # An error of the engine's own, not a node's: See the
                # compiled core's _reentrant_thread_main.
                graph_task.set_exception(error)
            finally:
                with pool.condition:
                    graph_task.on_pool_thread = False
                    pool.num_idle += 1
                    counted_idle = True
                    pool.released.notify_all()
            del graph_task
    finally:
        # However it ends, it leaves no dead thread in the pool.
        with pool.condition:
            pool.threads.remove(threading.current_thread())
            pool.num_threads -= 1
            if counted_idle:
                pool.num_idle -= 1


def withdraw_pool_task(pool, graph_task):
    """Take ``graph_task`` back from the pool's queue if no thread took it yet."""
    with pool.condition:
        for i, queued in enumerate(pool.graph_tasks):
            if queued is graph_task:
                del pool.graph_tasks[i]
                break


def stop_thread_pool(pool):
    """Make every pool thread end once it has no graph task, refuse new
    hand-offs, and fail the graph tasks handed off that no thread took;
    return the pool's threads, for ``Engine.stop`` to join. See Note
    [Stopping the pool]."""
    check_argument("pool", pool, _ThreadPoolShared)
    with pool.condition:
        pool.stopping = True
        # Before what allocates: whatever raises then, the idle threads see
        # ``stopping`` (See Note [Python allocations that fail] in
        # pyengine/_engine.pyx).
        pool.work.notify_all()
        orphans, pool.graph_tasks = pool.graph_tasks, []
        threads = list(pool.threads)
    interrupt = None
    for graph_task in orphans:
        try:
            graph_task.cpu_ready_queue.discard_graph_task(graph_task)
        except BaseException as error:
            # Raised once every orphan has failed: See Note [What a failed
            # graph task leaves is let go of in slices] in
            # pyengine/_pure/graph_task.py.
            if interrupt is None:
                interrupt = error
        graph_task.set_exception(RuntimeError(pool_stopped_message(graph_task.reentrant_depth)))
    if interrupt is not None:
        raise interrupt
    return threads
