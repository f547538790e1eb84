"""Device threads: one ReadyQueue and one worker thread per non-CPU device,
and the device a node's task goes to.

Shared by the compiled core and the twin (See Note [Slow paths are
shared]): starting a thread per device is rare and costs the same in
either; each core passes its own ReadyQueue type.
"""

import threading
import weakref

import numpy as np

from ..backends import backend_of
from ..device import CPU


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


class _DeviceThreads:
    """One ReadyQueue and one worker thread per non-CPU device, started the
    first time a graph task sends that device a task. A device's worker
    state calls it by its index in ``devices`` (its ``worker_device``).

    Guarded by ``lock``: ``ids``, ``devices``, ``queues``, ``threads``,
    ``stopping``. ``graph_tasks`` (a WeakSet of graph tasks that sent work to
    a device, so that ``stop`` can fail them rather than leave their callers
    waiting forever) is guarded by ``lock`` too.
    """

    def __init__(self, ready_queue_type):
        self.lock = threading.Lock()
        self.ids = {}
        self.devices = []
        self.queues = []
        self.threads = []
        self.stopping = False
        self.graph_tasks = weakref.WeakSet()
        self._ready_queue_type = ready_queue_type

    def queue_for(self, device, graph_task, worker_main):
        """The queue of ``device``, for a task of ``graph_task``; on first use,
        starts the device's worker thread, which runs
        ``worker_main(device_id, queue)``."""
        with self.lock:
            if self.stopping:
                raise RuntimeError(f"cannot run a task on {device}: the engine's device "
                                   f"threads have stopped ({STOPPED_BY})")
            self.graph_tasks.add(graph_task)
            device_id = self.ids.get(device)
            if device_id is None:
                device_id = self.ids[device] = len(self.devices)
                queue = self._ready_queue_type()
                thread = threading.Thread(target=worker_main, args=(device_id, queue),
                                          name=f"pyengine-{device}", daemon=True)
                self.devices.append(device)
                self.queues.append(queue)
                self.threads.append(thread)
                thread.start()
            return self._checked_queue(self.queues[device_id])

    def queue_by_index(self, device_id):
        with self.lock:
            return self._checked_queue(self.queues[device_id])

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
            return (list(self.graph_tasks), [self._checked_queue(queue) for queue in self.queues],
                    list(self.threads))


SHUTDOWN_ERROR = f"pyengine's device threads stopped ({STOPPED_BY}) while this backward was running"
