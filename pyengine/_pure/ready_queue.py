"""NodeTask, CompareNodeTaskTime and ReadyQueue: what runs next on one thread.

Twin of ``pyengine/_ready_queue.pyx``.

Note [Ready queue order]
~~~~~~~~~~~~~~~~~~~~~~~~
A ReadyQueue pops, in this order (PyTorch's CompareNodeTaskTime):

1. shutdown tasks, so that a worker stops promptly;
2. empty wake-up tasks (no node), so that an owner blocked in ``pop`` sees
   promptly that its graph task completed elsewhere;
3. tasks of a deeper reentrant backward, so that a nested backward finishes
   before its parent's queued work (See Note [Reentrant backward]);
4. the node with the higher ``sequence_nr``: the node created later in the
   forward pass runs first, which frees its gradients early and makes the
   order deterministic; AccumulateGrad has the highest sequence number of
   all (See Note [AccumulateGrad first]);
5. among equals, first in first out.

Depth and sequence number are copied into the task when it is made, so
comparing two tasks never touches a node.
"""

import heapq
import threading


class NodeTask:
    """One unit of work: run ``node`` of ``graph_task`` on ``inputs``, the list
    of gradients its InputBuffer summed (one per input slot).

    ``node is None`` marks an empty wake-up task; ``is_shutdown`` a task that
    stops the worker popping it. Immutable after construction.
    """

    __slots__ = ("graph_task", "node", "inputs", "is_shutdown", "reentrant_depth", "sequence_nr")

    def __init__(self, graph_task, node, inputs, is_shutdown=False):
        self.graph_task = graph_task
        self.node = node
        self.inputs = inputs
        self.is_shutdown = is_shutdown
        self.reentrant_depth = graph_task.reentrant_depth if graph_task is not None else 0
        self.sequence_nr = node._sequence_nr if node is not None else 0

    @classmethod
    def shutdown(cls):
        return cls(None, None, None, is_shutdown=True)


def compare_node_task_time(task1, task2):
    """True when ``task1`` runs after ``task2`` (the comparator of a max-heap).

    See Note [Ready queue order]; first-in-first-out among equals is the
    queue's insertion counter, not part of this comparison.
    """
    if task2.is_shutdown:
        return True
    if task1.node is None or task1.is_shutdown:
        return False
    if task2.node is None:
        return True
    if task1.reentrant_depth == task2.reentrant_depth:
        return task1.sequence_nr < task2.sequence_nr
    return task1.reentrant_depth < task2.reentrant_depth


def _heap_key(task):
    # heapq is a min-heap: the smallest key pops first. This key orders
    # exactly as compare_node_task_time.
    if task.is_shutdown:
        return (0, 0, 0)
    if task.node is None:
        return (1, 0, 0)
    return (2, -task.reentrant_depth, -task.sequence_nr)


class ReadyQueue:
    """A priority queue of NodeTasks under a lock and a condition variable.

    ``_heap`` and ``_counter`` are guarded by ``_not_empty``'s lock.
    """

    def __init__(self):
        self._not_empty = threading.Condition(threading.Lock())
        self._heap = []
        self._counter = 0

    def push(self, task, increment_outstanding_tasks=True):
        """Queue ``task``; count it as outstanding in its graph task unless it is
        a wake-up or shutdown task or ``increment_outstanding_tasks`` is false."""
        with self._not_empty:
            if increment_outstanding_tasks and task.node is not None:
                task.graph_task.increment_outstanding_tasks()
            heapq.heappush(self._heap, (_heap_key(task), self._counter, task))
            self._counter += 1
            self._not_empty.notify()

    def push_shutdown(self):
        self.push(NodeTask.shutdown())

    def pop(self):
        """The next task; waits (without the GIL) while the queue is empty."""
        with self._not_empty:
            while not self._heap:
                self._not_empty.wait()
            return heapq.heappop(self._heap)[2]

    def discard_graph_task(self, graph_task):
        """Drop every queued task of ``graph_task`` (after it failed); return how many."""
        with self._not_empty:
            kept = [entry for entry in self._heap if entry[2].graph_task is not graph_task]
            dropped = len(self._heap) - len(kept)
            heapq.heapify(kept)
            self._heap = kept
        return dropped

    def __len__(self):
        with self._not_empty:
            return len(self._heap)

    def empty(self):
        return len(self) == 0
