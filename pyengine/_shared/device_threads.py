"""Device threads: one ReadyQueue and one worker thread per non-CPU device,
and the device a node's task goes to.

Shared by the compiled core and the twin (See Note [Slow paths are
shared]): starting a thread per device is rare and costs the same in
either; each core passes its own ReadyQueue type.
"""

import sys
import threading

import numpy as np

from ..backends import backend_of
from ..device import CPU
from .engine_registry import IDLE_CHECK_S
from .weak_members import WeakMembers


def node_device(node, gradients):
    """Where ``node`` runs: the first non-CPU device among its input slots,
    else among the gradients it received, else the CPU."""
    for metadata in node._input_metadata:
        if metadata is not None and metadata.device != CPU:
            return metadata.device
    for gradient in gradients:
        if gradient is not None and type(gradient) is not np.ndarray:
            backend = backend_of(gradient)
            if backend is not None:
                device = backend.device(gradient)
                if device != CPU:
                    return device
    return CPU


# Who stops an engine's threads: a user's call, or the engine registry at
# exit (pyengine/_shared/engine_registry.py). An engine's threads never
# start again.
STOPPED_BY = "Engine.stop(), which runs at interpreter exit"


# Note [A device worker's claim]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The first task for a device starts its worker on the thread that routes
# it, often the main thread, where Ctrl-C can raise KeyboardInterrupt
# between any two steps of queue_for, or inside thread.start(), which waits
# for the new thread. The device must end up registered with a worker that
# serves its queue, or not registered at all: a queue registered without a
# worker makes every later backward on that device wait forever; a
# worker running for a queue that is not registered is a thread that never
# ends (stop() does not know it). Whether an interrupted start() started the
# thread cannot be told from outside (See Note [A slot taken for a pool
# thread] in pyengine/_pure/thread_pool.py). So the thread is given a
# one-item list, its claim, holding its device's index, and takes it under
# ``lock`` before it serves; the starter registers the device under the same
# lock, after start() returns. The new thread cannot take its claim before the
# starter lets go of the lock, so a starter that is interrupted, still
# holding it, finds the claim there, empties it and takes back what it
# registered; a thread that then runs finds nothing to claim and ends.


def report_worker_error():
    """Report the error being handled, which a device worker outlives, as
    Python reports an error that ends a thread (``threading.excepthook``)."""
    error_type, error, traceback = sys.exc_info()
    try:
        threading.excepthook(threading.ExceptHookArgs(
            (error_type, error, traceback, threading.current_thread())))
    except BaseException:
        # The worker serves on even where the report cannot be made: its
        # device's work matters more than the lost report.
        pass


class _DeviceThreads:
    """One ReadyQueue and one worker thread per non-CPU device, started the
    first time a graph task sends that device a task. A device's worker
    state calls it by its index in ``devices`` (its ``worker_device``).

    Guarded by ``lock``: ``ids``, ``devices``, ``queues``, ``threads``,
    ``stopping``. ``graph_tasks`` (the graph tasks that sent work to a
    device, held weakly, so that ``stop`` can fail them rather than leave
    their callers waiting forever) is guarded by ``lock`` too; See Note [No
    weak reference callback on an engine path] in
    pyengine/_shared/weak_members.py.
    """

    def __init__(self, ready_queue_type):
        self.lock = threading.Lock()
        self.ids = {}
        self.devices = []
        self.queues = []
        self.threads = []
        self.stopping = False
        self.graph_tasks = WeakMembers()
        self._ready_queue_type = ready_queue_type

    def queue_for(self, device, graph_task, engine_ref):
        """The queue of ``device``, for a task of ``graph_task``; on first use,
        starts the device's worker thread, which serves the queue with the
        engine ``engine_ref`` (a weak reference) refers to. See Note [A
        device worker's claim]."""
        with self.lock:
            if self.stopping:
                raise RuntimeError(f"cannot run a task on {device}: the engine's device "
                                   f"threads have stopped ({STOPPED_BY})")
            self.graph_tasks.add(graph_task)
            device_id = self.ids.get(device)
            if device_id is None:
                device_id = len(self.devices)
                queue = self._ready_queue_type()
                claim = [device_id]
                thread = threading.Thread(target=self._run_worker, args=(claim, queue, engine_ref),
                                          name=f"pyengine-{device}", daemon=True)
                try:
                    thread.start()
                    self.devices.append(device)
                    self.queues.append(queue)
                    self.threads.append(thread)
                    self.ids[device] = device_id
                except BaseException:
                    # Interrupted: the device stays unstarted, and a thread
                    # that did start finds its claim gone.
                    claim.clear()
                    del self.devices[device_id:], self.queues[device_id:], self.threads[device_id:]
                    raise
            return self._checked_queue(self.queues[device_id])

    def _run_worker(self, claim, queue, engine_ref):
        """A device worker thread's body: serve ``queue`` if its starter
        registered it (See Note [A device worker's claim]), until a shutdown
        task or until its engine is collected; an error of its own loop
        does not end it (See Note [A device worker outlives its loop's
        errors] in pyengine/_pure/engine.py). It holds the engine only
        while tasks are queued: See Note [An engine's threads hold it
        weakly] in pyengine/_shared/engine_registry.py."""
        with self.lock:
            if not claim:
                return
            device_id = claim.pop()
        serve_on = True
        while serve_on:
            try:
                queued = queue.wait_for_task(IDLE_CHECK_S, False)
                engine = engine_ref()
                if engine is None:
                    return
                if queued:
                    # Runs the queue's tasks until it is empty, or until
                    # an error outside any node failed the backward it ran
                    # (True), or until a shutdown task (False).
                    serve_on = engine._device_thread_main(device_id, queue)
            except BaseException:
                # An error of no backward's: See Note [A device worker
                # outlives its loop's errors] in pyengine/_pure/engine.py.
                report_worker_error()
            # Let go of the engine before the wait, or this thread would keep
            # it alive while it idles.
            engine = None

    def _checked_queue(self, queue):
        # Python code can reach this object (through gc) and change its
        # lists; the compiled engine calls the queue's C methods.
        if type(queue) is not self._ready_queue_type:
            raise RuntimeError(f"the engine's device queues were changed: a "
                               f"{type(queue).__name__} where a ReadyQueue was")
        return queue

    def stop(self):
        """Refuse new device work; return the graph tasks that may still wait
        on device work, and the workers' queues and threads."""
        with self.lock:
            self.stopping = True
            return (self.graph_tasks.members(), [self._checked_queue(queue) for queue in self.queues],
                    list(self.threads))


SHUTDOWN_ERROR = f"pyengine's device threads stopped ({STOPPED_BY}) while this backward was running"
