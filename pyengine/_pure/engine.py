"""The engine: runs a backward graph task to completion.

Twin of ``pyengine/_engine.pyx``: ``GraphRoot``, ``call_function``, and
``Engine`` with ``execute``, ``thread_main``, ``evaluate_function`` and
reentrant backward; its thread pool is ``pyengine/_pure/thread_pool.py``
(See Note [Reentrant backward] there) and ``compute_dependencies`` is in
``pyengine/_pure/dependencies.py``. Read it beside PyTorch's
``torch/csrc/autograd/engine.cpp``.

Note [CPU work runs on the caller]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The thread that calls ``execute`` drives the graph task itself: it pushes
the root task onto a ReadyQueue of its own (one per thread, made on first
use) and runs ``thread_main`` until the graph task completes. It never hands
CPU work to another thread, so a backward with only CPU nodes takes no
thread switch at all.

Note [Cancelling a graph task]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A caller that stops waiting for its graph task (Ctrl-C in a wait: See Note
[Waits honour signals] in ``pyengine/_locks.pxd``; a pool thread that could
not start) cancels it with ``cancel_graph_task`` and raises the error
itself:

- ``set_exception`` marks the task failed and completes its future, so every
  thread skips its remaining tasks (``thread_main`` runs no node of a task
  with an error) and a pool thread running it returns once its current
  node does; the task does not keep the error, whose traceback the caller
  raises;
- its tasks queued in its CPU queue (the caller's) are discarded;
- a node of it still running on a device thread may queue tasks for the
  owner after it left: that worker, seeing the error, discards them from
  the owner's queue (counting them as done), and a wake-up it sends holds
  no graph task, so nothing left in a queue keeps a cancelled task alive.

A caller whose hand-off is interrupted while a pool thread still runs the
graph task also fails every graph task it drives: See Note [A backward that
raises leaves its ready queue].

Only a wait raises in the compiled core's loop (and letting go of the
tasks a discard dropped, once they are all let go of: See Note [What a
failed graph task leaves is let go of in slices] in
``pyengine/_pure/graph_task.py``); the twin's main thread may see
KeyboardInterrupt between any two bytecodes, so ``thread_main`` cancels its
graph task whatever escapes its loop, and ``discard_graph_task`` rebuilds
the queue's heap. Pool and device threads never see a signal: they keep
serving, and the engine works afterwards.

Note [A raised error must not name itself in its frame]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A backward that fails raises the error its graph task kept, after taking
it off the task (the task must not keep its own error's traceback). When
the twin raises it, the raising frame joins the error's traceback; had
that frame kept the error in a local, the error, its traceback and the
frame would make a reference cycle, and the frame's other locals (the
graph task, the roots, with them the whole graph and its saved values)
would wait for the garbage collector, as a torch user would not expect:
torch, and the compiled core (whose frames in a traceback hold no locals),
free them by reference counting as soon as the caller lets go of the
error. So the twin deletes its name for the error as it raises
(``execute``, and ``execute_owner_graph`` in ``owner_graph.py``).

Note [A backward that raises leaves its ready queue]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A caller interrupted while a pool thread runs the graph task it handed off
(Ctrl-C in ``add_thread_pool_task``'s wait) cancels that graph task and
raises, but the pool thread finishes the node it is in, and the reentrant
backwards nested in that node run on to completion on it and on other pool
threads (See Note [Cancelling a graph task]); all of them serve the
caller's CPU ReadyQueue. PyTorch's engine lets one loop at a time serve a
queue: a thread that waits for a hand-off does not pop. If the caller's
next backward used that queue, two loops would serve it at once: one pops
and runs a task of the other's graph task (a deeper task sorts first), and
completes it, while the other sleeps in ``pop`` for it; the wake-up goes only
to an owner on another device (both loops are CPU_DEVICE), so the sleeper
stays there, and with it its pool thread and the caller above that, until
the pool is full. So a thread's outermost backward that raises (through
its loop, or with its graph task's error) leaves its ReadyQueue to whoever
still serves it, and the thread's next backward makes a new one; in the
twin, ``leave_ready_queue`` also puts back the per-thread state (See Note
[Where the twin's main thread sees an interrupt]).

A node may catch the KeyboardInterrupt of the backward nested in it and
return normally. In PyTorch that KeyboardInterrupt comes only once the
nested backward is done (its C++ wait ignores Ctrl-C), and the outer
backward goes on. Here the pool threads still serve the queue, so the
thread can no longer serve it; nor can it wait for them before it pops
again, since what runs nested in the cancelled graph task may take as
long as it likes, and Ctrl-C must end that wait too. So pyengine ends
every backward the thread drives with the interruption: where a hand-off's
wait raises while a pool thread still runs its cancelled graph task
(``on_pool_thread``, which a pool thread sets as it takes the task from
the pool's queue; one that finds the task completed never pops),
``fail_driven_graph_tasks``, before the node sees the error, sets it on
each graph task whose loop runs on this thread (``driven_graph_tasks``,
outermost first; the task keeps the error so that its ``execute`` raises
it, taking it off first: See Note [A raised error must not name itself in
its frame]), drops their tasks from the queue, and sets
``handoff_interrupted``. A node that catches the error and returns finds
its loop's graph task completed, and the loop ends without popping again;
each level's ``execute`` raises the same KeyboardInterrupt into the node
that called it, and the outermost one raises it to the caller, leaves the
queue and clears ``handoff_interrupted`` (a pool thread clears it as its
task ends). Until then, a reentrant backward started on the thread (a
node that caught the error and tries again) raises RuntimeError before it queues anything. A
node that catches the KeyboardInterrupt can clean up, as in a ``finally``,
but the backward ends with it: Ctrl-C stays a KeyboardInterrupt up to the
caller (rather than an error chained from it), whose handler for it runs.
None of this is on the per-node path: the list grows by one item per
backward this thread runs, and the checks are on the error paths and at a
level's exit. ``tests/test_interrupted_handoff.py`` shows the hang this
prevents: the thread and a pool thread each ran one of a node's two next
nodes, the pool thread completed the graph task, and the thread slept in
``pop``.

Note [Where the twin's main thread sees an interrupt]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
CPython runs signal handlers on the main thread only, where its bytecode
checks for them: on entering a Python function, on a loop's back edge,
after a call returns, and in a blocking lock acquire or wait. What the
handler raises (KeyboardInterrupt) comes out there. The compiled core's
engine is C, so there it only comes out of a wait or a call into Python
(See Note [Waits honour signals]); the twin's engine is Python, so on the
main thread it comes out between almost any two of its steps, including
ones that must both happen or neither. Each such pair is made safe:

- a task popped and not run, or counted and not queued, belongs to a graph
  task that the interrupted thread drives, and fails with it: the loop
  cancels its graph task whatever escapes it, and the error goes up
  through the node of each enclosing level (See Note [Cancelling a graph
  task]);
- the per-node state (grad mode, current graph task and node, checkpoint
  valid) and the thread's ``worker_device``, depths, held task, driven
  graph tasks and ``handoff_interrupted``, whose restores an interrupt may
  cut short, are put back by the outermost backward as it raises
  (``leave_ready_queue``: See Note [A backward that raises leaves its
  ready queue]);
- the reentrant pool's slots and queue: See Note [A slot taken for a pool
  thread] in ``pyengine/_pure/thread_pool.py``;
- an owner graph's walk, and its leaves' lock entries: See Note [An
  owner's thread state comes back] and Note [An interrupt in the twin's
  leaf locks] in ``pyengine/_pure/owner_graph.py``.

- the twin's condition variables and the leaf's GradLock, Python code
  around C locks: See Note [An interrupt in the twin's condition variable]
  in ``pyengine/_pure/condition.py`` and Note [An interrupt in the twin's
  GradLock] in ``pyengine/_pure/node.py``.

``tests/test_interrupt_windows.py`` raises KeyboardInterrupt at these
places, one at a time, with a trace function, and
``tests/test_interrupt_sweep.py`` at every place of a backward where
CPython can raise it. Not covered: a second interrupt while the first is
being handled; and a heap push or pop cut short on a queue that other
threads' tasks share (a device's), which can leave a task there twice.

Note [A shutdown task is the device worker's]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``Engine.stop`` pushes one shutdown task onto each device's queue, for the
device's worker, whose outermost ``thread_main`` (the one with no graph
task) ends when it pops it. Other loops serve that queue too: a reentrant
backward run inline on the worker, and a pool thread that runs a graph
task handed off from it (See Note [Reentrant backward] in
``pyengine/_pure/thread_pool.py``). Such a loop that pops the shutdown task
and ends with it (as PyTorch's ``thread_main`` does, with a TODO) leaves its
graph task unfinished: the worker, waiting for it, never comes back to its
own loop, and stays alive after ``stop``. So a loop that drives a graph
task holds the shutdown task instead and goes on until its graph task
completes (a task that needs a stopped device has already failed: ``stop``
failed it), then pushes it back as it leaves; each loop out passes it on,
and the worker's own loop consumes it. The shutdown task sorts first, so
it is always the next task the outer loop pops.

Note [A device worker outlives its loop's errors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A node's error fails its graph task (``thread_main``'s ``try`` around
``evaluate_function``). A device worker's own loop can raise too, outside
any node: where memory runs out in its bookkeeping, or where an
asynchronous exception (``PyThreadState_SetAsyncExc``) lands in its Python
code. Had the thread ended with it, as PyTorch's worker ends the process,
its device's queue would stay registered with no thread to serve it, and
every later backward on that device would wait forever. So the worker
outlives such an error. Raised while it ran a task, the error fails that
task's graph task (``fail_in_flight_graph_task``), whose caller raises it,
woken if it waits in another queue; the worker serves on. Raised between
tasks (in ``_DeviceThreads._run_worker``, in
``pyengine/_shared/device_threads.py``), or after that graph task had
completed, it belongs to no backward, and the worker reports it through
``threading.excepthook``, as Python reports a thread's uncaught error, and
serves on; the tasks still queued are run on its next turn. A loop that
drives a graph task (a caller's, a pool thread's, a reentrant backward's)
fails that graph task instead and raises, as before. In the compiled
core, the loop's bookkeeping is C, which raises only where a C++
allocation fails (dropping a failed graph task's tasks from its owner's
queue, by then completed); the Python around the loop (the wait, the
engine's weak reference) raises where the twin's would, and so does the
anomaly note the loop puts on a node's error before it fails the graph
task with it: where the note cannot be added (the node's error has a
``__notes__`` that is not a list) the task in flight fails, in both cores,
with that TypeError, the node's error as its context. (A ``name()`` that
raises does not: See Note [A name() that raises] in
``pyengine/_shared/messages.py``.)

Note [The owner's queue is the graph task's]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A graph task's *owner* is the thread that drives it: the caller (its own
CPU queue), or, for a reentrant backward, the thread it was started on: a
device worker or a pool thread, which serves that device's queue. In every
case the owner waits in the queue the graph task was made with,
``cpu_ready_queue`` (``execute`` takes the thread's ``local_ready_queue``;
a pool thread serves the ``cpu_ready_queue`` of the graph task handed to
it). A thread that runs one of its tasks and is not the owner (a device
worker) must, on completing it, wake the owner there, and on an error
discard the tasks it queued for it there. PyTorch finds that queue by the
owner's device index (``ready_queue_by_index``), in the one engine's table.
Here each ``Engine`` has device workers of its own and numbers its devices
in the order it first uses them, so with two engines at once (a node run by
one engine's device worker calls ``backward``, which goes to the default
engine) an index named another thread of the completing engine, often the
completing thread itself, which then woke no one: the nested backward waited
forever. So the engine goes by the queue itself: a thread is the owner if it
serves the graph task's ``cpu_ready_queue``, and wakes the owner, and
discards from it, through that queue (``owner_queue``); ``stop`` wakes the
owners of the graph tasks it fails the same way. ``owner`` only says whether
a thread drives the graph task at all (``NO_DEVICE``: none) and, on a pool
thread, which device's work the thread does. ``tests/test_two_engines.py``
shows the hang.

Note [One thread completes a graph task]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The thread whose task takes a graph task's count of outstanding tasks to
zero completes it (``mark_as_completed_and_run_post_processing``: the final
callbacks, then the future). ``thread_main`` goes by the count that its own
decrement left (``decrement_outstanding_tasks`` returns it), not by the
count read again afterwards, as PyTorch does (``--outstanding_tasks_``,
then ``completed()``). Read again, two threads that ran the graph task's
last two tasks at once (the caller its last CPU task, a device worker its
last device task) can both see zero: in the twin a thread can be switched
out between the decrement and the read. The one that comes second waits in
``mark_as_completed_and_run_post_processing`` until the other has run the
final callbacks; a callback that runs a backward needing that thread (a
device worker) then waits for it forever. Going by its own decrement, a
thread left with more than zero goes back to its queue and serves that
backward. The compiled core does the same with ``fetch_sub``'s result (its
decrement and read are C with the GIL held, where no other thread runs in
between, but the algorithm is the twin's). ``tests/test_one_completer.py``
holds the device worker between its decrement and the read. A graph task
that exits on its first error completes on any thread that sees the error:
no final callback runs after an error. A count below zero completes the
graph task too: only Python code that called
``decrement_outstanding_tasks`` itself (it is public) takes it there, and
the engine's next decrement must then end the backward, as a count read
again did, rather than leave it waiting forever.

Note [AccumulateGrad first]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
AccumulateGrad nodes carry the largest sequence number, so a leaf's
gradient is written (and the InputBuffer holding it freed) as soon as it is
ready, before any other node runs.

Note [Next edges while a node runs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Python code that runs while a node runs (its tensor pre-hooks, pre-hooks,
``apply``, post-hooks, ``release_variables``) can replace the node's
``next_edges``. The engine reads them once, just before the node's hooks
and ``apply`` run, and uses that one tuple for everything that follows:
``validate_outputs`` checks the gradients against it, and the gradients go
along it. A change made while the node runs takes effect the next time the
node runs (a retained graph). PyTorch reads ``fn.next_edges`` again after
``call_function``, but no hook of a C++ node can change its edges, and a
Python node's edges are fixed once made; here they can change, and
reading them twice would let a hook hand the engine gradients checked
against one set of edges and routed along another (the compiled engine
would then read past the end of a shorter tuple). The dependency counts
were taken from the edges before the backward started; an edge a node
gains into a node outside them is the error "dependency not found", as in
PyTorch.

Note [The next task skips the queue]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A running node that makes a child ready for the thread's own queue (on a
CPU chain, every node) does not push it: ``queue_task`` holds the task
back in the thread's ``WorkerState.next_task``, and ``thread_main``, where
it would pop next, hands it to ``ReadyQueue.push_pop`` instead: with
nothing queued that is the task itself, with no lock, no heap and no wake-up
(PyTorch pushes and pops); else it is pushed and the front popped under
one lock. The order is that of pushing every task: a held task is always
the last task the thread queued, anywhere, because any other push the
thread makes (``queue_task`` for another child or another device's queue,
a root in ``execute_with_graph_task``, a wake-up) pushes the held one
first, and it is pushed when the loop ends (its graph task completed or
failed, Ctrl-C), before the queue's tasks of a failed task are discarded.
Between the hold and the pop, the thread runs no node and pops nothing; a
push another thread makes meanwhile lands as if made just after the pop,
which is one of the orders the threads' race allows anyway. Only the
thread itself pops its own queue while it runs a loop on it (a pool
thread serves a caller's queue while the caller waits in ``apply``), so
no thread waits for a task held back.

Note [A held task takes over its maker's count]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A graph task completes when its count of outstanding tasks falls to zero:
a task counts from its push until it has run (PyTorch's
``outstanding_tasks_``). A task held back in ``next_task`` (Note [The next
task skips the queue]) is not counted when ``queue_task`` holds it: the
node that made it still counts while it runs, so the count cannot fall to
zero meanwhile, and no other thread can see the task. When that node has
run, ``thread_main`` lets the held task take over the node's count (marks
it counted and does not decrement) where it would decrement once for the
node and have incremented once for the task: on a CPU chain, two atomic
read-modify-write instructions per node fewer in the compiled core
(benchmarks/RESULTS.md, "Issue 19: a held task takes over its maker's
count"). A held task that leaves before then, pushed by
``flush_next_task`` (the node queued another task, a loop ended, Ctrl-C),
is counted as it is pushed, before another thread can pop it; the pop at
the top of the loop counts one that is still not counted, which no path
leaves. Only the running node's routing holds a task, for the node's own
graph task: a backward nested in that routing (Python code in an add)
pushes the held task before it queues anything, and ends its loop by
pushing whatever it held itself.

Note [Reusing a task's gradients list]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A node whose one gradient flows into a node with no other edge into it
hands that node a new list (``single_gradient``), and the list the node
itself ran on is freed once it ran: on a chain, one list made and one
freed per node. So when a task has run and nothing but the task refers
to its list (the node did not keep it, return it, or let anything else
take it: its reference count says so, a count that no other thread can
raise while this one holds the GIL), ``keep_spare_list`` sets its slots
to None and keeps it in the thread's ``WorkerState.spare_list``, and the
next ``single_gradient`` of that size takes it instead of a new list
(``take_spare_list``), after looking at the count again: anything that
took a reference meanwhile (``gc.get_objects``) keeps the list, and the
engine makes a new one; so does a slot that is no longer None (Python
code that reached the list and let it go again, such as a ``__del__``
that ran while the slots were cleared, may have written one). A node's
``apply`` receives a list that is its own for as long as it runs, as
before, holding only its own gradients; one it keeps is never reused.

Note [Checking execute's arguments]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``execute`` checks all of its arguments before it makes a graph task: each
of ``roots`` and of ``outputs`` must be an Edge (TypeError naming the index
and the type), ``grads`` one gradient per root, each checked against its
root's slot as ``validate_outputs`` checks a node's (RuntimeError). Nothing
has run when one is wrong, and the compiled engine never reads an object of
the wrong type as an Edge.
"""

import os
import sys
import threading
import time
import weakref

import numpy as np

from .. import streams
from .._shared import hooks
from .._shared.device_threads import SHUTDOWN_ERROR, _DeviceThreads, node_device
from .._shared.engine_registry import register_engine
from .._shared.hooks import add_anomaly_note, call_tensor_pre_hooks, check_nan
from .._shared.messages import (
    ENGINE_INITIALIZED_WHY,
    cannot_pickle_message,
    gradients_changed_message,
    handoff_interrupted_message,
    initialized_once_message,
    input_buffer_list_gone_message,
    no_ready_queue_message,
    node_name,
    total_depth_message,
)
from ..device import CPU
from . import state
from .dependencies import compute_dependencies, init_to_execute
from .graph_task import (
    GraphTask,
    cancel_graph_task,
    link_enclosing_graph_task,
    refuse_lock_taken_again,
    release_leftovers,
    task_should_execute,
)
from .input_buffer import InputBuffer
from .node import (
    Edge,
    NodeBase,
    _checked_field,
    _not_list,
    _read_only_field,
    has_numpy_backend,
    new_node_base,
)
from .ready_queue import ReadyQueue, is_main_thread, make_record
from .static_types import as_c_int, c_int_attribute, c_type_name, check_argument, check_new, refuse_write
from .thread_pool import _ThreadPoolShared, add_thread_pool_task, stop_thread_pool
from .validate_outputs import validate_outputs

# worker_device values: the thread runs no engine loop, or the CPU loop.
# Device workers (issue: devices) use the device index.
NO_DEVICE = -2
CPU_DEVICE = -1

# Levels of reentrant backward run inline on one thread before a pool thread
# takes over; levels of reentrant backward in all; threads of the reentrant
# pool. See Note [Reentrant backward] and Note [Bounds on reentrant backward] in
# pyengine/_pure/thread_pool.py.
MAX_RECURSION_DEPTH = 60
MAX_TOTAL_DEPTH = 4096
MAX_POOL_THREADS = 256


class WorkerState(threading.local):
    """The engine's per-thread state; each attribute is per thread."""

    worker_device = NO_DEVICE
    # Reentrant levels running inline on this thread.
    current_depth = 0
    # Reentrant levels in all, on this thread and the threads that handed off to it.
    total_depth = 0
    local_ready_queue = None
    # The last task this thread queued, when it is for local_ready_queue:
    # held back until the thread pops. See Note [The next task skips the queue].
    next_task = None
    # Whether next_task is counted in its graph task's outstanding tasks:
    # See Note [A held task takes over its maker's count].
    next_task_counted = False
    # A gradients list a task left that nothing else refers to, for the next
    # single_gradient. See Note [Reusing a task's gradients list].
    spare_list = None
    # Whether a hand-off of this thread's was interrupted while a pool thread
    # ran its graph task: until its outermost backward raises, every
    # backward it drives has failed and no new one starts. See Note [A
    # backward that raises leaves its ready queue].
    handoff_interrupted = False

    def __init__(self):
        # Whether this thread runs signal handlers: See Note [Waits honour signals].
        self.on_main_thread = is_main_thread()
        # The graph tasks whose loops (thread_main) run on this thread,
        # outermost first. See Note [A backward that raises leaves its ready
        # queue].
        self.driven_graph_tasks = []

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))


_worker_state = WorkerState()


# -- GraphRoot --------------------------------------------------------------

class GraphRoot(NodeBase):
    """The node a backward with several roots starts from: it returns the
    root gradients along the root edges."""

    __slots__ = ("outputs_", "_root_streams_")

    # A list or None, as the compiled class's typed field.
    outputs = _checked_field("outputs", "outputs_", _not_list, "list")
    # Immutable after construction; read by gradient_stream.
    _root_streams = _read_only_field("_root_streams", "_root_streams_")

    def __new__(cls, *args, **kwargs):
        # The compiled class's fields before __init__ (its __cinit__'s and
        # C's None): a GraphRoot whose __init__ never ran reads alike in
        # both cores, and its _root_streams is a tuple.
        if cls.__new__ is not GraphRoot.__new__:
            check_new(GraphRoot, cls)
        self = new_node_base(cls)
        object.__setattr__(self, "outputs_", None)
        object.__setattr__(self, "_root_streams_", ())
        return self

    def __init__(self, roots, grads):
        super().__init__(next_edges=roots)
        self.outputs = list(grads)
        # The root gradients were written on the caller's current streams, one
        # per root and device: each is the producer stream of its own root
        # gradient (not the first root's for all). See Note [Streaming backwards].
        object.__setattr__(self, "_root_streams_",
                           tuple([streams.value_stream(grad) for grad in grads]))
        self._stream = next((stream for stream in self._root_streams if stream is not None), None)

    def __setattr__(self, name, value):
        # The compiled GraphRoot has no __dict__: Python code writes only its
        # fields (a Python subclass, with a __dict__, writes what it likes).
        if type(self) is GraphRoot and not hasattr(getattr(GraphRoot, name, None), "__set__"):
            refuse_write(self, name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if type(self) is GraphRoot and not hasattr(getattr(GraphRoot, name, None), "__delete__"):
            refuse_write(self, name)
        object.__delattr__(self, name)

    def apply(self, grads):
        return list(self.outputs)

    def name(self):
        return "GraphRoot"


# Note [A node is marked released before it is cleared]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Threads that run backward on one graph without retain_graph race: one
# runs a node and releases it while another is about to run it. The loser
# must get PyTorch's "Trying to backward through the graph a second time",
# never a half-released node (its saved values None while ``_released``
# still says False: "'NoneType' object is not iterable" from its apply).
# Between two writes, another thread may run (the twin's bytecodes; in
# either core, the release of the old saved values, which can run Python
# code). So the engine writes the flag first and clears after, and a
# reader takes the saved values first and asks the flag after
# (``Node.saved_values``, the frontend's nodes): a reader that finds the
# flag unset holds values from before any clearing.


def release_variables(node):
    """Mark the node released, then ``type(node).release_variables(node)``
    where the node's class overrode it when the node was made, else what
    NodeBase's does, with no lookup. See Note [Overriding release
    variables] in ``pyengine/_pure/node.py`` and Note [A node is marked
    released before it is cleared]."""
    node._released = True
    if node._overrides_release_variables:
        type(node).release_variables(node)
    else:
        node._saved_values_ = None  # NodeBase.release_variables


def has_tensor_pre_hooks(node):
    return bool(node._tensor_pre_hooks or node._retains_grad_hooks)


def has_hooks(node):
    return bool(node._tensor_pre_hooks or node._retains_grad_hooks or node._pre_hooks
                or node._post_hooks)


def call_function(graph_task, node, inputs, next_edges):
    """A node without hooks: ``apply`` and ``validate_outputs`` against
    ``next_edges``, the node's edges from before it ran (See Note [Next
    edges while a node runs]), here. With hooks: the shared
    ``call_function``, which runs them in PyTorch's order. IndexedGradients
    are densified for a node that does not accept them (the shared
    ``densify_inputs``)."""
    if has_hooks(node):
        return hooks.call_function(graph_task, node, inputs, next_edges, validate_outputs)
    if hooks.has_indexed(inputs):
        hooks.densify_inputs(node, inputs)
    outputs = node.apply(inputs)
    outputs = hooks.outputs_as_list(node, outputs)
    validate_outputs(next_edges, outputs, hooks.returned_error_format(node), node=node)
    return outputs


# -- the engine -------------------------------------------------------------

class Engine:
    """PyTorch's autograd engine. One default instance serves every thread;
    see :func:`pyengine.get_default_engine`.

    An engine made here starts its device worker threads and its reentrant
    pool threads when a backward first needs them. They serve until
    :meth:`stop` (every engine is stopped at interpreter exit), or until
    the engine is collected: they hold it only while they run its tasks,
    and end within about a second once nothing else refers to it (See Note
    [An engine's threads hold it weakly] in
    pyengine/_shared/engine_registry.py). (PyTorch has one engine only,
    which lives as long as the process.)"""

    # The compiled Engine's fields, and no others: its methods cannot be
    # replaced on an instance, nor attributes added (a subclass may).
    __slots__ = ("_max_recursion_depth", "_max_total_depth", "_max_pool_threads", "_pool",
                 "_devices", "__weakref__")

    def __new__(cls, *args, **kwargs):
        # See Note [A class's __new__ called with another class] in
        # pyengine/_pure/static_types.py.
        if cls.__new__ is not Engine.__new__:
            check_new(Engine, cls)
        return object.__new__(cls)

    def __init__(self, max_recursion_depth=MAX_RECURSION_DEPTH, max_total_depth=MAX_TOTAL_DEPTH,
                 max_pool_threads=MAX_POOL_THREADS):
        """``max_recursion_depth``: reentrant levels run inline on one thread;
        ``max_total_depth``: reentrant levels in all, past which a reentrant
        backward raises RecursionError; ``max_pool_threads``: threads of the
        reentrant pool, past which a hand-off raises RuntimeError. See
        Note [Bounds on reentrant backward]."""
        # Converted first, as the compiled signature's C ints are.
        max_recursion_depth = as_c_int(max_recursion_depth)
        max_total_depth = as_c_int(max_total_depth)
        max_pool_threads = as_c_int(max_pool_threads)
        if getattr(self, "_pool", None) is not None:
            raise TypeError(initialized_once_message(self, ENGINE_INITIALIZED_WHY))
        self.max_recursion_depth = max_recursion_depth
        self.max_total_depth = max_total_depth
        self.max_pool_threads = max_pool_threads
        self._pool = _ThreadPoolShared()
        self._devices = _DeviceThreads(ReadyQueue)
        # See Note [Every engine is stopped at exit and reset after fork] in
        # pyengine/_shared/engine_registry.py.
        register_engine(self)

    # The bounds are C ints in the compiled core: See Note [The engine's
    # bounds are C ints] in pyengine/_pure/static_types.py.
    max_recursion_depth = c_int_attribute("_max_recursion_depth")
    max_total_depth = c_int_attribute("_max_total_depth")
    max_pool_threads = c_int_attribute("_max_pool_threads")

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))

    # -- entry point --

    def execute(self, roots, grads, keep_graph, create_graph, accumulate_grad, outputs=None):
        """Run backward from ``roots`` (Edges) with ``grads`` (one per root).

        ``outputs`` (Edges or None): with ``accumulate_grad=False`` (``grad``),
        return the gradient flowing into each; with ``accumulate_grad=True``
        (``backward(inputs=)``), run only the nodes on a path to them.
        Returns the captured gradients (empty without ``outputs``).
        """
        # Every argument is checked before anything runs: See Note [Checking
        # execute's arguments].
        roots = tuple(roots)
        grads = list(grads)
        outputs = None if outputs is None else list(outputs)
        if not roots:
            raise RuntimeError("execute needs at least one root edge")
        for i, root in enumerate(roots):
            if not isinstance(root, Edge):
                raise TypeError(f"roots[{i}] must be an Edge, got {type(root).__name__}")
        if outputs is not None:
            for i, output in enumerate(outputs):
                if not isinstance(output, Edge):
                    raise TypeError(f"outputs[{i}] must be an Edge, got {type(output).__name__}")
        validate_outputs(roots, grads, lambda message: message)

        worker = _worker_state
        if worker.local_ready_queue is None:
            worker.local_ready_queue = ReadyQueue()
        graph_task = GraphTask(
            keep_graph, create_graph,
            0 if worker.worker_device == NO_DEVICE else worker.total_depth + 1,
            worker.local_ready_queue, multithreading=state.is_multithreading_enabled())

        # A single root starts the task itself; several hang off a GraphRoot.
        if len(roots) == 1:
            graph_root = roots[0].node
            input_buffer = InputBuffer(len(graph_root._input_metadata))
            accumulate_on_streams(input_buffer, roots[0].input_nr, grads[0], create_graph,
                                  streams.value_stream(grads[0]), graph_root._stream)
        else:
            graph_root = GraphRoot(roots, grads)
            input_buffer = InputBuffer(0)
        graph_task.graph_root = graph_root
        if outputs:
            init_to_execute(graph_root, graph_task, outputs, accumulate_grad)
        else:
            compute_dependencies(graph_root, graph_task)

        link_enclosing_graph_task(graph_task)
        self.execute_with_graph_task(graph_task, graph_root, input_buffer)
        try:
            graph_task.wait()
        except BaseException as error:
            cancel_graph_task(graph_task, error)
            raise
        if graph_task.exception is not None:
            # Take the error off the task: the traceback must not keep the task alive.
            error, graph_task.exception_ = graph_task.exception, None
            try:
                # Its gradients waiting for nodes that will not run, and
                # those captured: See Note [What a failed graph task leaves
                # is let go of in slices] in pyengine/_pure/graph_task.py.
                release_leftovers(graph_task)
                raise error
            finally:
                # See Note [A raised error must not name itself in its frame].
                del error
        return graph_task.captured_vars

    def execute_with_graph_task(self, graph_task, graph_root, input_buffer):
        """Queue the root task and drive the graph task: inline on this thread,
        or on a pool thread past the reentrant depth limit."""
        worker = _worker_state
        inputs = task_inputs(input_buffer)
        queue = self.ready_queue(graph_task, node_device(graph_root, inputs))
        if worker.worker_device == NO_DEVICE:
            # Not inside the engine: this thread drives the graph task.
            # See Note [CPU work runs on the caller].
            # What thread_main changes per node, as it is out here: See Note
            # [A backward that raises leaves its ready queue].
            outside = (state.is_grad_enabled(), state.get_current_graph_task(),
                       state.is_checkpoint_valid(), state.is_multithreading_enabled())
            try:
                worker.worker_device = CPU_DEVICE
                graph_task.owner = CPU_DEVICE
                flush_next_task(worker)
                queue.push(make_record(graph_task, graph_root, inputs))
                worker.driven_graph_tasks.append(graph_task)
                self.thread_main(graph_task)
                if graph_task.has_error:
                    # It raises its error: See Note [A backward that raises
                    # leaves its ready queue].
                    leave_ready_queue(worker, outside)
            except BaseException:
                # See Note [A backward that raises leaves its ready queue].
                leave_ready_queue(worker, outside)
                raise
            finally:
                worker.worker_device = NO_DEVICE
                worker.driven_graph_tasks.clear()
        else:
            # A reentrant backward. See Note [Reentrant backward].
            if graph_task.reentrant_depth > self.max_total_depth:
                # See Note [Bounds on reentrant backward].
                raise RecursionError(total_depth_message(graph_task.reentrant_depth,
                                                         self.max_total_depth))
            if worker.handoff_interrupted:
                # See Note [A backward that raises leaves its ready queue].
                raise RuntimeError(handoff_interrupted_message())
            graph_task.owner = worker.worker_device
            flush_next_task(worker)
            queue.push(make_record(graph_task, graph_root, inputs))
            if worker.current_depth >= self.max_recursion_depth:
                try:
                    add_thread_pool_task(self._pool, graph_task, self.max_pool_threads,
                                         weakref.ref(self))
                except BaseException as error:
                    if graph_task.on_pool_thread:
                        # Cancelled, and still run by a pool thread that
                        # serves this thread's queue: See Note [A backward
                        # that raises leaves its ready queue].
                        fail_driven_graph_tasks(worker, error)
                    raise
            else:
                worker.total_depth += 1
                worker.current_depth += 1
                worker.driven_graph_tasks.append(graph_task)
                try:
                    self.thread_main(graph_task)
                finally:
                    leave_driven_graph_task(worker, graph_task)
                    worker.current_depth -= 1
                    worker.total_depth -= 1

    # -- the loop --

    def thread_main(self, graph_task):
        """Pop and run tasks until ``graph_task`` completes; for None (a device
        worker), until its queue has no task or a shutdown task comes, and
        return whether the worker serves on: True where its queue ran dry,
        or where an error outside any node failed the graph task of the task
        it ran (See Note [A device worker outlives its loop's errors]);
        False after a shutdown task."""
        # Here and in evaluate_function and route, the engine reads its
        # graph tasks' slots, not the properties that check Python code's
        # writes (See Note [A graph task's fields from Python]).
        worker = _worker_state
        queue = worker.local_ready_queue
        # See Note [Waits honour signals].
        on_main_thread = graph_task is not None and worker.on_main_thread
        # A shutdown task this loop popped and holds for the device worker:
        # See Note [A shutdown task is the device worker's].
        shutdown_held = False
        serve_on = False
        local_graph_task = None
        try:
            while graph_task is None or not graph_task.future_completed_:
                if worker.next_task is not None:
                    # See Note [The next task skips the queue].
                    task, worker.next_task = worker.next_task, None
                    task = queue.push_pop(
                        task, increment_outstanding_tasks=not worker.next_task_counted)
                else:
                    if graph_task is None and queue.empty():
                        # A device worker waits for its next task without
                        # its engine: See Note [An engine's threads hold it
                        # weakly] in pyengine/_shared/engine_registry.py.
                        serve_on = True
                        break
                    task = queue.pop(on_main_thread)
                if task.is_shutdown:
                    if graph_task is None:
                        break
                    shutdown_held = True
                    continue
                local_graph_task = task.graph_task
                if task.node is None:
                    # A wake-up task: loop back and look at graph_task again.
                    continue
                previous_graph_task = state.set_current_graph_task(local_graph_task)
                # See Note [Queries a running node makes] in pyengine/_shared/task_queries.py.
                previous_node = state.set_current_node(task.node, local_graph_task)
                previous_grad_mode = state.is_grad_enabled()
                state.set_grad_enabled(local_graph_task.grad_mode_)
                # ANDed with the enclosing task's: See Note [Checkpoint valid
                # in nested backward] in pyengine/_pure/state.py.
                previous_checkpoint_valid = state.swap_checkpoint_valid(
                    local_graph_task.can_checkpoint() and state.is_checkpoint_valid())
                # Kept: a node may set it for good, and PyTorch's
                # ThreadLocalStateGuard puts it back as the rest.
                previous_multithreading = state.is_multithreading_enabled()
                try:
                    if not local_graph_task.has_error_:
                        if state.profiler() is None:
                            self.evaluate_function(worker, local_graph_task, task.node,
                                                   task.inputs)
                        else:
                            self.evaluate_profiled(worker, local_graph_task, task.node,
                                                   task.inputs)
                except BaseException as error:
                    if state.is_anomaly_enabled():
                        add_anomaly_note(error, task.node)
                    local_graph_task.set_exception(error)
                finally:
                    state.set_multithreading_enabled(previous_multithreading)
                    state.swap_checkpoint_valid(previous_checkpoint_valid)
                    state.set_grad_enabled(previous_grad_mode)
                    state.set_current_node(*previous_node)
                    state.set_current_graph_task(previous_graph_task)
                # Drop the task's references before the graph task may complete.
                keep_spare_list(worker, task)
                del task
                if (worker.next_task is not None and not worker.next_task_counted
                        and worker.next_task.graph_task is local_graph_task):
                    # See Note [A held task takes over its maker's count].
                    worker.next_task_counted = True
                    left = 1  # the held task
                else:
                    left = local_graph_task.decrement_outstanding_tasks()
                # Whether this thread is the owner: See Note [The owner's
                # queue is the graph task's].
                not_owner = queue is not local_graph_task.cpu_ready_queue_
                if not_owner and local_graph_task.has_error_:
                    # Tasks this node queued for an owner that may have gone:
                    # See Note [Cancelling a graph task].
                    dropped = owner_queue(local_graph_task).discard_graph_task(local_graph_task)
                    for _ in range(dropped):
                        left = local_graph_task.decrement_outstanding_tasks()
                # By the count this thread's decrement left, not the count
                # now; below zero only after Python code decremented it: See
                # Note [One thread completes a graph task].
                if left <= 0 or (local_graph_task.exit_on_error_ and local_graph_task.has_error_):
                    local_graph_task.mark_as_completed_and_run_post_processing()
                    if not_owner:
                        # The owner may sleep in pop(): wake it up. A wake-up
                        # holds no graph task, so that one left in the queue of
                        # an owner that has gone keeps nothing alive.
                        flush_next_task(worker)
                        push_wake_up(owner_queue(local_graph_task))
                # Let go of the task now: a worker about to sleep in pop() must not
                # keep its last graph alive until the next task comes.
                local_graph_task = None
        except BaseException as error:
            # A wait interrupted (See Note [Waits honour signals]), or an error
            # outside any node: the graph task this loop drives ends with it.
            flush_next_task(worker)
            if shutdown_held:
                queue.push_shutdown()
            if graph_task is not None:
                cancel_graph_task(graph_task, error)
                raise
            if local_graph_task is None or local_graph_task.future_completed_:
                raise
            # A device worker's, while it ran a task: See Note [A device
            # worker outlives its loop's errors].
            fail_in_flight_graph_task(queue, local_graph_task, error)
            serve_on = True
        # A task held back for the loop goes to the queue, as if never held.
        flush_next_task(worker)
        if shutdown_held:
            queue.push_shutdown()
        if graph_task is not None and graph_task.has_error_:
            queue.discard_graph_task(graph_task)
        return serve_on

    def evaluate_profiled(self, worker, graph_task, node, inputs):
        """evaluate_function, timed and reported to the profiler even if it fails."""
        callback = state.profiler()
        if callback is None:  # stopped since thread_main looked
            return self.evaluate_function(worker, graph_task, node, inputs)
        start = time.perf_counter_ns()
        try:
            self.evaluate_function(worker, graph_task, node, inputs)
        finally:
            callback(node, start, time.perf_counter_ns())

    def evaluate_function(self, worker, graph_task, node, inputs):
        """Run one node on ``inputs`` (its InputBuffer's list of gradients) and
        pass its gradients on to the nodes they flow into. ``worker``: this
        thread's state, which holds back the last task queued for this
        thread (See Note [The next task skips the queue])."""
        exec_info = graph_task.exec_info_
        if exec_info:
            info = exec_info.get(id(node))
            if info is None:
                return
            if not info.needed and has_tensor_pre_hooks(node):
                # Tensor pre-hooks run exactly once: here, or in call_function.
                call_tensor_pre_hooks(node, inputs)
            if info.captures:
                capture_inputs(graph_task, info.captures, inputs)
                if node._stream_ is not None:
                    graph_task.add_leaf_stream(node._stream_)
            if not info.needed:
                return

        producer_stream = node._stream_
        # The edges the node's gradients go along: those it had before it
        # ran. See Note [Next edges while a node runs]. With them, the only
        # one, if so: See Note [A node's only next edge] in node.py.
        next_edges = node._next_edges
        only_next_node, only_input_nr = node._only_next_node, node._only_input_nr
        # See Note [Streaming backwards]: apply runs on the node's stream.
        with streams.stream_guard(producer_stream):
            outputs = call_function(graph_task, node, inputs, next_edges)
        if not graph_task.keep_graph_:
            release_variables(node)
        if not outputs:
            if producer_stream is not None:
                graph_task.add_leaf_stream(producer_stream)
            return
        if state.is_anomaly_enabled() and state.is_anomaly_check_nan_enabled():
            check_nan(node, outputs)

        grad_mode = graph_task.grad_mode_
        # validate_outputs checked the count; the node's release_variables
        # or a hook may have changed the list since.
        num_outputs = len(outputs)
        num_edges = 1 if only_next_node is not None else len(next_edges)
        if num_outputs != num_edges:
            raise RuntimeError(f"Function {node_name(node)} returned {num_outputs} "
                               f"gradients for {num_edges} next edges")
        refuse_lock_taken_again(graph_task)
        with graph_task.mutex:
            dependencies = graph_task.dependencies
            not_ready = graph_task.not_ready
            # The node may keep the list it returned and change it while
            # this loop runs Python code (a backend's add): each gradient
            # is read with a look at the list's size.
            for i in range(num_outputs):
                if only_next_node is not None:
                    next_node, next_input_nr = only_next_node, only_input_nr
                else:
                    edge = next_edges[i]
                    if edge is None:
                        continue
                    next_node, next_input_nr = edge.node, edge.input_nr
                if i >= len(outputs):
                    raise RuntimeError(gradients_changed_message(node))
                output = outputs[i]
                key = id(next_node)
                remaining = dependencies.get(key)
                if remaining is None:
                    raise RuntimeError(f"dependency not found for {node_name(next_node)}")
                is_ready = remaining == 1
                if is_ready:
                    del dependencies[key]
                else:
                    dependencies[key] = remaining - 1

                input_buffer = not_ready.get(key)
                if input_buffer is None:
                    if not task_should_execute(graph_task, key):
                        continue
                    streamed = producer_stream is not None or next_node._stream_ is not None
                    if not streamed and is_ready:
                        # Its only gradient: what InputBuffer's first add
                        # would hold, without the InputBuffer.
                        gradients = single_gradient(worker, len(next_node._input_metadata),
                                                    next_input_nr, output)
                        queue_task(worker, self.route(graph_task, next_node, gradients),
                                   graph_task, next_node, gradients)
                        continue
                    input_buffer = InputBuffer(len(next_node._input_metadata))
                    accumulate_on_streams(input_buffer, next_input_nr, output, grad_mode,
                                          producer_stream, next_node._stream_, node, i)
                    if is_ready:
                        gradients = task_inputs(input_buffer)
                        queue_task(worker, self.route(graph_task, next_node, gradients),
                                   graph_task, next_node, gradients)
                    else:
                        not_ready[key] = input_buffer
                else:
                    accumulate_on_streams(input_buffer, next_input_nr, output, grad_mode,
                                          producer_stream, next_node._stream_, node, i)
                    if is_ready:
                        del not_ready[key]
                        gradients = task_inputs(input_buffer)
                        queue_task(worker, self.route(graph_task, next_node, gradients),
                                   graph_task, next_node, gradients)

    # -- devices --

    def route(self, graph_task, node, gradients):
        """The queue ``node``'s task goes to: its device's worker, or, on the
        CPU or with multithreading disabled, the graph task's CPU queue."""
        if not graph_task.multithreading_:
            return graph_task.cpu_ready_queue_
        if node._on_cpu_:
            for gradient in gradients:
                if (gradient is not None and type(gradient) is not np.ndarray
                        and not has_numpy_backend(gradient)):
                    break
            else:
                return graph_task.cpu_ready_queue_
        return self.ready_queue(graph_task, node_device(node, gradients))

    def ready_queue(self, graph_task, device):
        """The queue a task of ``graph_task`` for ``device`` goes to: the
        device's worker, or, for the CPU or with multithreading disabled, the
        graph task's CPU queue (the caller's)."""
        check_argument("graph_task", graph_task, GraphTask)
        if device == CPU or not graph_task.multithreading:
            return graph_task.cpu_ready_queue
        if graph_task.cpu_ready_queue is None:
            # A device's worker wakes the owner through it (stop() too).
            raise ValueError(no_ready_queue_message())
        return self._devices.queue_for(device, graph_task, weakref.ref(self))

    def _device_thread_main(self, device_id, queue):
        """Run the tasks of ``queue``, device ``device_id``'s, on this thread,
        its worker, until it has none or a shutdown task comes; return
        whether the worker serves on (``thread_main``'s answer)."""
        check_argument("queue", queue, ReadyQueue)
        worker = _worker_state
        worker.worker_device = device_id
        worker.local_ready_queue = queue
        return self.thread_main(None)

    # -- reentrant pool --

    def _run_pool_task(self, graph_task):
        """Run ``graph_task``, handed off to the reentrant pool, on this pool
        thread until it completes: the pool's call back into the engine
        (See Note [Reentrant backward] in pyengine/_pure/thread_pool.py)."""
        check_argument("graph_task", graph_task, GraphTask)
        if graph_task.cpu_ready_queue is None:  # thread_main would pop from it
            raise ValueError(no_ready_queue_message())
        worker = _worker_state
        worker.worker_device = graph_task.owner
        worker.local_ready_queue = graph_task.cpu_ready_queue
        worker.total_depth = graph_task.reentrant_depth
        worker.current_depth = 0
        try:
            worker.driven_graph_tasks.append(graph_task)
            self.thread_main(graph_task)
        finally:
            worker.local_ready_queue = None
            worker.worker_device = NO_DEVICE
            # The outermost backward of a pool thread: See Note [A backward
            # that raises leaves its ready queue].
            worker.driven_graph_tasks.clear()
            worker.handoff_interrupted = False

    def stop(self, timeout=1.0):
        """Stop the device and pool threads (at interpreter exit). A backward
        still waiting for device work fails with a RuntimeError instead of
        waiting forever."""
        in_flight, device_queues, device_threads = self._devices.stop()
        error = RuntimeError(SHUTDOWN_ERROR)
        for graph_task in in_flight:
            # Checked as the compiled core's <GraphTask?> cast: Python code
            # can reach the set (through gc).
            if type(graph_task) is not GraphTask:
                raise TypeError(f"Cannot convert {c_type_name(type(graph_task))} to "
                                "pyengine._graph_task.GraphTask")
            if not graph_task.future_completed:
                graph_task.set_exception(error)
                if graph_task.owner != NO_DEVICE:  # else no thread drives it, none waits in pop
                    push_wake_up(owner_queue(graph_task))
        for queue in device_queues:
            queue.push_shutdown()
        # See Note [Stopping the pool] in pyengine/_pure/thread_pool.py.
        threads = stop_thread_pool(self._pool)
        for thread in device_threads + threads:
            if thread.ident is not None:  # not one that another thread is starting
                thread.join(timeout)

    def _reset_after_fork(self):
        # The child has only the forking thread: the pool's and the devices'
        # threads are gone, and their locks may have been held by them.
        self._pool = _ThreadPoolShared()
        self._devices = _DeviceThreads(ReadyQueue)

    # -- callbacks --

    def queue_callback(self, callback):
        """Run ``callback`` once the current backward completes."""
        graph_task = state.get_current_graph_task()
        if graph_task is None:
            raise RuntimeError("Final callbacks can only be installed during backward pass.")
        graph_task.final_callbacks.append(callback)


def push_wake_up(queue):
    """Queue an empty wake-up task for the thread that may sleep in
    ``queue``'s pop. Never fails: where the heap cannot grow, a flag stands
    for the task (See Note [C++ allocations that fail] in
    pyengine/_engine.pyx)."""
    queue.push(make_record(None, None, None))


def push_task(queue, graph_task, node, inputs):
    queue.push(make_record(graph_task, node, inputs))


def queue_task(worker, queue, graph_task, node, inputs):
    """push_task for a task a running node made ready: one for this thread's
    own queue is held back in ``worker.next_task`` until the thread pops; a
    task held before it is pushed first. See Note [The next task skips the
    queue]."""
    flush_next_task(worker)
    if queue is not worker.local_ready_queue or worker.next_task is not None:
        # The second: the task held before could not be pushed (See Note
        # [C++ allocations that fail] in pyengine/_engine.pyx), and stays held.
        push_task(queue, graph_task, node, inputs)
        return
    # Not counted yet: See Note [A held task takes over its maker's count].
    worker.next_task = make_record(graph_task, node, inputs)
    worker.next_task_counted = False


def fail_in_flight_graph_task(queue, graph_task, error):
    """A device worker's loop (serving ``queue``) raised ``error`` outside
    any node while it ran a task of ``graph_task``: that graph task fails
    with it, and its owner, if another thread, is woken to raise it. See
    Note [A device worker outlives its loop's errors]."""
    graph_task.set_exception(error)
    owner = graph_task.cpu_ready_queue_
    # thread_main's except clause has pushed the held task already, as the
    # loop does before any wake-up.
    if owner is not None and owner is not queue:
        push_wake_up(owner)


def owner_queue(graph_task):
    """The queue that the thread driving ``graph_task`` waits in: its CPU
    queue, whatever device that thread serves. See Note [The owner's queue
    is the graph task's]."""
    queue = graph_task.cpu_ready_queue_
    if queue is None:  # an owner graph's, or one made with cpu_ready_queue=None
        raise ValueError(no_ready_queue_message())
    return queue


def leave_ready_queue(worker, outside):
    """Leave the thread's ReadyQueue to the pool threads that may still
    serve it, and put the engine's per-thread state back as it was outside
    the backward (``outside``: grad mode, current graph task, checkpoint
    valid, multithreading; no node runs there). See Note [A backward that
    raises leaves its ready queue]."""
    worker.local_ready_queue = None
    # The thread's next backward serves its new queue alone.
    worker.handoff_interrupted = False
    # The twin only: an interrupt may have cut a restore short (See Note
    # [Where the twin's main thread sees an interrupt]).
    worker.next_task = None
    worker.current_depth = 0
    worker.total_depth = 0
    grad_mode, graph_task, checkpoint_valid, multithreading = outside
    state.set_current_node(None, None)
    state.set_current_graph_task(graph_task)
    state.swap_checkpoint_valid(checkpoint_valid)
    state.set_grad_enabled(grad_mode)
    state.set_multithreading_enabled(multithreading)


def fail_driven_graph_tasks(worker, error):
    """A hand-off of this thread's was interrupted (``error``) while a pool
    thread ran its graph task, which serves this thread's queue until it is
    back: every graph task this thread drives fails with ``error`` (kept,
    so that each one's ``execute`` raises it), its tasks dropped from its
    queue, and no new backward starts here until the outermost one raises.
    See Note [A backward that raises leaves its ready queue]."""
    worker.handoff_interrupted = True
    driven = list(worker.driven_graph_tasks)
    # All failed before any discard, which may raise: See Note [What a
    # failed graph task leaves is let go of in slices] in
    # pyengine/_pure/graph_task.py.
    for graph_task in driven:
        graph_task.set_exception(error)
    for graph_task in driven:
        graph_task.cpu_ready_queue.discard_graph_task(graph_task)


def leave_driven_graph_task(worker, graph_task):
    """Take ``graph_task``, whose loop on this thread ended, off the
    thread's driven graph tasks (the last one, unless an interrupt in the
    twin left one behind it, which the outermost backward clears)."""
    driven = worker.driven_graph_tasks
    if driven and driven[-1] is graph_task:
        driven.pop()


def flush_next_task(worker):
    """Push the task ``worker`` holds back, if any, onto its queue, where it
    would have been all along. Where the queue cannot grow (MemoryError:
    it counted nothing), the task stays held, for this thread's loop to run
    next: See Note [C++ allocations that fail] in pyengine/_engine.pyx."""
    if worker.next_task is not None:
        try:
            # Counted, if not yet, before another thread can pop it.
            worker.local_ready_queue.push(
                worker.next_task, increment_outstanding_tasks=not worker.next_task_counted)
        except MemoryError:
            return
        worker.next_task = None


def task_inputs(input_buffer):
    """``input_buffer``'s list, as the inputs of its node's task, which the
    compiled engine reads in C: never None (See input_buffer_list_gone_message)."""
    inputs = input_buffer.buffer
    if inputs is None:
        raise RuntimeError(input_buffer_list_gone_message())
    return inputs


def capture_inputs(graph_task, captures, inputs):
    """Give each output that ``captures`` (a node's ``(input_nr,
    output_idx)`` pairs) names its gradient among ``inputs``, under the
    graph task's lock."""
    refuse_lock_taken_again(graph_task)
    with graph_task.mutex:
        for input_nr, output_idx in captures:
            if input_nr < len(inputs):
                graph_task.captured_vars[output_idx] = inputs[input_nr]


def single_gradient(worker, num_inputs, input_nr, gradient):
    """``num_inputs`` slots, all None but ``input_nr``, which holds
    ``gradient``: what an InputBuffer holds after that one add (which grows
    it to fit a gradient beyond its slots, but not a None). In the list
    ``worker`` keeps spare when it has that size."""
    size = num_inputs if gradient is None or input_nr < num_inputs else input_nr + 1
    gradients = take_spare_list(worker, size)
    if gradients is None:
        gradients = [None] * size
    if gradient is not None:
        gradients[input_nr] = gradient
    return gradients


def take_spare_list(worker, size):
    """The list ``worker`` keeps spare, if it has ``size`` slots and nothing
    else refers to it now; None otherwise. The spare is given up either way.
    See Note [Reusing a task's gradients list]."""
    spare = worker.spare_list
    if spare is None:
        return None
    worker.spare_list = None
    # Ours alone: the references are ``spare`` and getrefcount's argument.
    if len(spare) != size or sys.getrefcount(spare) != 2:
        return None
    # Still all None: code that reached the list without keeping a
    # reference (a __del__ through gc.get_referrers) may have filled a slot.
    for item in spare:
        if item is not None:
            return None
    return spare


def keep_spare_list(worker, task):
    """Keep the gradients list of a task that ran, its slots set to None, in
    ``worker`` for the next ``single_gradient``, when nothing but the task
    refers to it and ``worker`` keeps none yet. See Note [Reusing a task's
    gradients list]."""
    inputs = task.inputs
    # The task's reference, ``inputs`` and getrefcount's argument.
    if worker.spare_list is not None or type(inputs) is not list or sys.getrefcount(inputs) != 3:
        return
    # Dropping a gradient may run Python code (a __del__), which may take
    # references or change the list: each step looks again.
    i = 0
    while i < len(inputs):
        i += 1
        if inputs[i - 1] is not None:
            inputs[i - 1] = None
    if worker.spare_list is None and sys.getrefcount(inputs) == 3:
        worker.spare_list = inputs


def gradient_stream(node, i, producer_stream):
    """The stream gradient ``i`` of ``node`` was written on: a GraphRoot's
    root ``i``'s, one per root (See Note [Streaming backwards]), else the
    stream ``node`` ran on. A root whose edges Python code changed since it
    was made may have more gradients than streams: ``producer_stream``
    stands in for the others."""
    if type(node) is not GraphRoot:
        return producer_stream
    root_streams = node._root_streams
    if i < len(root_streams):
        return root_streams[i]
    return producer_stream


def accumulate_on_streams(input_buffer, input_nr, gradient, grad_mode, producer_stream, consumer_stream,
                          producer=None, output_nr=0):
    """Add a gradient into a consumer's buffer after the syncs it needs, on the
    stream they choose. See Note [Which stream waits where a gradient enters
    a buffer] in pyengine/streams.py. ``producer``: the node whose output
    ``output_nr`` the gradient is (None for a root gradient); the stream it
    was written on is chosen here, off a CPU node's path."""
    if producer is not None:
        producer_stream = gradient_stream(producer, output_nr, producer_stream)
    if producer_stream is None and consumer_stream is None:
        input_buffer.add(input_nr, gradient, grad_mode)
        return
    with streams.stream_guard(streams.accumulation_stream(gradient, producer_stream,
                                                          consumer_stream)):
        input_buffer.add(input_nr, gradient, grad_mode)


def _reset_worker_state_after_fork():
    global _worker_state
    _worker_state = WorkerState()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_worker_state_after_fork)
