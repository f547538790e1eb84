"""The backward profiler: which nodes ran, in what order, on which thread, for how long.

::

    with pyengine.profile() as prof:
        loss.backward()
    prof.export_chrome_trace("trace.json")   # Perfetto, chrome://tracing
    prof.table()                              # a summary by node type

This module owns :class:`profile` and what it records. It builds on the
engine's one hook, ``pyengine._core.set_profiler(callback)``: while a
profile is active, every engine, compiled or pure, calls
``callback(node, start_ns, end_ns)`` on the thread that ran the node, after
the node, its hooks and the routing of its gradients (``time.perf_counter_ns``
clock). With no profile active the hook is unset and the compiled loop pays
one pointer test per node (benchmarks/profiler_overhead.py measures it).

What a profile records
----------------------
- One :class:`NodeEvent` per node task the engine evaluated while the
  profile was active: the node's ``name()``, ``sequence_nr``, device, the
  thread that ran it, start and end, which backward call (*run*: one per
  graph task, a reentrant backward is a run of its own) it belonged to, and
  whether its ``apply`` ran (``executed``; False for a node that
  ``grad(inputs=)`` reached only to capture the gradient flowing into it).
  A node's time includes its hooks and the routing of its outputs; a
  reentrant backward started inside ``apply`` is counted in the parent's
  total and taken out of its *self* time (children nested on the same thread).
- The device is read from the node's input metadata, as the engine's
  ``node_device(node, [])`` does: the first non-CPU device among its input
  slots, else ``cpu``. A node without device metadata that the engine routed
  by its gradients' device shows ``cpu`` here; its thread tells where it ran.
- One :class:`BackwardSpan` per call to the default engine's ``execute``
  (every ``pyengine.backward`` / ``grad``): while any profile is active, the
  default engine is wrapped in a timing proxy (``set_default_engine``) that
  forwards everything to it; it is put back when the last profile stops.
  These spans are the calling thread's track in the trace and the
  denominator of the table's shares. A backward through another engine's
  ``execute`` has no span; its run's extent (first node start to last node
  end) stands in for it.

Nested and concurrent profiles (the choice made here)
-----------------------------------------------------
Profiles may nest and may be active on several threads at once. Each active
profile records every node that any engine runs, on any thread, while it is
active (the hook is global, as the engine's worker threads are): an outer
profile sees the inner one's nodes too, and a profile started on one thread
sees the backward calls of other threads. One profile object records once:
entering it again, or again after it stopped, raises RuntimeError. With one
profile active the hook calls its recorder directly; with several, one
dispatcher calls each in turn. A callback that someone else had installed
with ``set_profiler`` before the first profile started keeps being called
and is put back when the last profile stops; do not call ``set_profiler``
while a profile is active.

Collecting from several threads
-------------------------------
Each thread appends to buffers of its own (no lock and no allocation of a
container on the per-node path; benchmarks/RESULTS.md has its cost per
node). A buffered entry keeps its node and graph task alive until it is
resolved into a :class:`NodeEvent` (name, device, run): after each backward through
the default engine, by its calling thread once the backward's span has
ended (so that the work is not counted in the backward's time); at the end
of every other graph task (another ``Engine``'s ``execute``, an
``OwnerGraph`` walk), by a final callback of that task; by a thread
whose buffer reaches :data:`FLUSH_EVENTS` entries in the middle of a
backward; and by the thread that stops the profile. So a profiled backward
lets its graph go by refcount when it returns, as without a profile: See
Note [Profiled graphs go by refcount]. Read results
(``events``, ``table``, ``export_chrome_trace``) after the profile stopped.
Every backward call that returned before the profile stopped is recorded
completely (the engine calls the hook before the graph task can complete);
nodes of a backward still running on another thread when the profile stops
may be recorded in part.
"""

from __future__ import annotations

import json
import operator
import os
import sys
import threading
import time
from typing import NamedTuple

from . import _core
from . import engine as _engine_module
from ._shared.messages import node_name
from ._shared.weak_members import WeakMembers

__all__ = ["profile", "NodeEvent", "BackwardSpan", "ThreadInfo", "NodeTypeSummary"]

# Raw entries a thread buffers before it resolves them into NodeEvents itself
# (in the middle of a backward, so rarely: most are resolved after each backward).
FLUSH_EVENTS = 131072

_perf_counter_ns = time.perf_counter_ns
_get_current_graph_task = _core.state_module.get_current_graph_task
_set_profiler = _core.set_profiler


class ThreadInfo(NamedTuple):
    """A thread that ran nodes or called backward: ``index`` numbers the
    threads of one profile in the order they first reported."""

    index: int
    name: str
    ident: int
    native_id: int


class NodeEvent(NamedTuple):
    """One node the engine evaluated. Times are ``time.perf_counter_ns``."""

    name: str
    sequence_nr: int
    device: str
    thread: ThreadInfo
    start_ns: int
    end_ns: int
    run: int
    executed: bool
    node_id: int

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class BackwardSpan(NamedTuple):
    """One call of the default engine's ``execute`` (a backward or grad)."""

    thread: ThreadInfo
    start_ns: int
    end_ns: int
    roots: int
    failed: bool

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class NodeTypeSummary(NamedTuple):
    """A row of :meth:`profile.summary`: the events of one node name.

    ``total_ns`` sums durations (a node's reentrant children included);
    ``self_ns`` leaves out time spent in node events nested inside it on the
    same thread; ``share`` is ``total_ns`` over the backward wall time.
    """

    name: str
    count: int
    total_ns: int
    self_ns: int
    mean_ns: float
    max_ns: int
    share: float


# Note [Profiled graphs go by refcount]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A profiled backward must free its graph when it returns, as it does
# without a profile, whichever engine runs it: the default engine, another
# Engine's execute, an OwnerGraph walk (the adapters' path), on any thread,
# reentrant or not. The buffered entries hold the node (or OwnerRun, and so
# the owner) and its graph task, so they must be resolved by then.
#
# Two ways were weighed. Recording at the event what a NodeEvent needs
# (name, sequence_nr, device, run, executed) instead of references would
# move the resolving onto the per-node path, inside the backward's time:
# name() and the device's metadata scan per node, a weak reference to the
# graph task for the run, exec_info's lookup for ``executed``. The choice
# here keeps the per-node path as it was plus one identity test: the first
# time a thread records a node of a graph task it has not seen since its
# last flush, it appends a final callback to that task (``_watch``), which
# resolves every buffer (``_flush_all``) when the task completes, before
# its execute or walk returns; the output is the same NodeEvents as before,
# resolved from the same references. Inside a default-engine backward on
# that thread (the proxy's depth is not 0) no callback is added: the proxy
# resolves after its span, outside the backward's time, as before, and a
# reentrant or nested task's entries go with it. Each flush forgets
# ``last_task``, so no buffer keeps a finished task alive, and a thread
# whose buffer another thread flushed mid-task only watches its task again
# (a second callback, a second, cheap, flush). A task that fails runs no
# final callbacks: its entries wait for the next flush (the next task's
# end, FLUSH_EVENTS, or stop), so at most the failed graph is kept.

# -- the registry of active profiles --------------------------------------------------

class _Registry:
    """The profiles recording now, and what they installed.

    ``active`` is a tuple replaced (never edited) under ``lock``, so the
    per-node path reads it without the lock. ``foreign`` (the callback
    set_profiler had before the first profile started) and ``engine_proxy``
    are guarded by ``lock``.
    """

    lock = threading.Lock()
    active: tuple = ()
    foreign = None
    engine_proxy = None


def _dispatch(node, start_ns, end_ns):
    """The hook while several recorders listen."""
    for recorder in _Registry.active:
        recorder._on_node(node, start_ns, end_ns)
    foreign = _Registry.foreign
    if foreign is not None:
        foreign(node, start_ns, end_ns)


def _install_hook_locked():
    active = _Registry.active
    if not active:
        _set_profiler(_Registry.foreign)
    elif len(active) == 1 and _Registry.foreign is None:
        _set_profiler(active[0]._on_node)
    else:
        _set_profiler(_dispatch)


# How many proxied execute calls are running on this thread (reentrant backward nests them).
_proxy_depth = threading.local()


class _TimedEngine:
    """Forwards everything to ``engine``; times each ``execute`` for the
    active profiles (their BackwardSpans)."""

    def __init__(self, engine):
        self.engine = engine

    def execute(self, roots, grads, *args, **kwargs):
        roots = list(roots)
        depth = _proxy_depth.value = getattr(_proxy_depth, "value", 0) + 1
        start = _perf_counter_ns()
        failed = True
        try:
            result = self.engine.execute(roots, grads, *args, **kwargs)
            failed = False
            return result
        finally:
            end = _perf_counter_ns()
            _proxy_depth.value = depth - 1
            for recorder in _Registry.active:
                recorder._on_backward(start, end, len(roots), failed)
                if depth == 1:
                    # Outside any backward of this thread: resolve what was
                    # buffered, so that it costs no backward's time.
                    recorder._flush_all()

    def queue_callback(self, callback):
        return self.engine.queue_callback(callback)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __repr__(self):
        return f"<profiling proxy of {self.engine!r}>"


def _install_engine_proxy_locked():
    if _Registry.engine_proxy is None:
        proxy = _TimedEngine(_engine_module.get_default_engine())
        _engine_module.set_default_engine(proxy)
        _Registry.engine_proxy = proxy


def _remove_engine_proxy_locked():
    proxy = _Registry.engine_proxy
    _Registry.engine_proxy = None
    # Put the engine back only if nobody replaced the proxy meanwhile.
    if proxy is not None and _engine_module.get_default_engine() is proxy:
        _engine_module.set_default_engine(proxy.engine)


# -- resolving raw entries --------------------------------------------------------------

_NOT_A_TASK = object()
_STDOUT = object()  # table()'s default file: sys.stdout as it is when called
_START, _END = operator.itemgetter(4), operator.itemgetter(5)
_START_OF_SPAN = operator.itemgetter(1)

# Node types whose name() is their class's (or a constant): their name is looked up once.
_names_by_type: dict = {}


def _fixed_name(node_type):
    from .node import AccumulateGrad, Node

    method = getattr(node_type, "name", None)
    if method is Node.name:
        return node_type.__name__
    if method is AccumulateGrad.name:
        return "AccumulateGrad"
    return None


def _node_name(node) -> str:
    node_type = type(node)
    try:
        name = _names_by_type[node_type]
    except KeyError:
        if len(_names_by_type) > 4096:  # types made on the fly: keep the cache small
            _names_by_type.clear()
        name = _names_by_type[node_type] = _fixed_name(node_type)
    if name is not None:
        return name
    # A name() that fails must not lose the event: See Note [A name() that raises].
    return node_name(node)


def _node_device(node) -> str:
    """The first non-CPU device among the input slots, as node_device(node, [])."""
    for metadata in node._input_metadata:
        if metadata is not None and not metadata.is_cpu:
            return str(metadata.device)
    return "cpu"


class _ThreadBuffer:
    """One thread's raw entries, appended to by that thread only: per node,
    ``nodes``, ``starts``, ``ends`` and ``tasks`` (its graph task) in that
    order, in parallel lists (no tuple per node, so no garbage-collector
    work during the backward); per backward span, a tuple in ``spans``."""

    __slots__ = ("thread", "nodes", "starts", "ends", "tasks", "spans", "last_task")

    def __init__(self, thread: ThreadInfo):
        self.thread = thread
        self.nodes, self.starts, self.ends, self.tasks = [], [], [], []
        self.spans = []
        # The graph task of this thread's latest entry, once its end is
        # watched; None after a flush. See Note [Profiled graphs go by refcount].
        self.last_task = None


class profile:
    """Record every node the engine runs while active; see the module docstring.

    ``with pyengine.profile() as prof: ...`` or ``prof = profile(); prof.start();
    ...; prof.stop()``. Afterwards: ``events``, ``backward_spans``,
    ``threads``, ``summary()``, ``table()``, ``export_chrome_trace(path)``.
    """

    def __init__(self):
        # Guards _buffers, _events, _spans, _runs and _run_count, and makes
        # flushes one at a time.
        self._lock = threading.Lock()
        # Per thread: that thread's _ThreadBuffer.
        self._local = threading.local()
        self._buffers: list[_ThreadBuffer] = []
        self._events: list[NodeEvent] = []
        self._spans: list[BackwardSpan] = []
        # Graph task -> run index, weakly: a finished backward must not stay
        # alive, and its death runs no Python code (See Note [No weak
        # reference callback on an engine path] in
        # pyengine/_shared/weak_members.py).
        self._runs = WeakMembers()
        self._run_count = 0
        # new -> recording -> stopping -> stopped; written under _Registry.lock
        # or _lock, read under the GIL alone.
        self._state = "new"
        # perf_counter_ns at start() and stop(); trace times count from start_ns.
        self.start_ns = None
        self.end_ns = None

    # -- recording --

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info):
        self.stop()
        return False

    def start(self) -> profile:
        if self._state != "new":
            raise RuntimeError(f"this profile is {self._state}; a profile records once: make a "
                               "new one")
        with _Registry.lock:
            if not _Registry.active:
                _Registry.foreign = _set_profiler(None)
                _install_engine_proxy_locked()
            self._state = "recording"
            self.start_ns = _perf_counter_ns()
            _Registry.active = _Registry.active + (self,)
            _install_hook_locked()
        return self

    def stop(self) -> None:
        if self._state != "recording":
            raise RuntimeError(f"this profile is {self._state}, not recording")
        with _Registry.lock:
            _Registry.active = tuple(recorder for recorder in _Registry.active
                                     if recorder is not self)
            _install_hook_locked()
            if not _Registry.active:
                _Registry.foreign = None
                _remove_engine_proxy_locked()
            self.end_ns = _perf_counter_ns()
            self._state = "stopping"
        self._flush_all()
        with self._lock:
            self._state = "stopped"
            self._runs.clear()
            # By start; on a tie the longer first, so that a parent precedes
            # the events nested in it (two stable sorts, both in C).
            self._events.sort(key=_END, reverse=True)
            self._events.sort(key=_START)
            self._spans.sort(key=_START_OF_SPAN)
            # Runs were numbered as their first node finished (a reentrant
            # backward's nodes finish before the node that started it): number
            # them by when they started instead.
            renumber = {-1: -1}
            for event in self._events:
                if event.run not in renumber:
                    renumber[event.run] = len(renumber) - 1
            if any(old != new for old, new in renumber.items()):
                self._events = [event._replace(run=renumber[event.run]) for event in self._events]

    def _thread_buffer(self) -> _ThreadBuffer:
        thread = threading.current_thread()
        with self._lock:
            info = ThreadInfo(len(self._buffers), thread.name, thread.ident,
                              getattr(thread, "native_id", None) or thread.ident)
            buffer = _ThreadBuffer(info)
            self._buffers.append(buffer)
        self._local.buffer = buffer
        return buffer

    def _on_node(self, node, start_ns, end_ns):
        """The hook: runs once per node, on the thread that ran it."""
        try:
            buffer = self._local.buffer
        except AttributeError:
            buffer = self._thread_buffer()
        buffer.nodes.append(node)
        buffer.starts.append(start_ns)
        buffer.ends.append(end_ns)
        task = _get_current_graph_task()
        tasks = buffer.tasks
        tasks.append(task)
        if task is not buffer.last_task:
            self._watch(buffer, task)
        if len(tasks) >= FLUSH_EVENTS:
            self._flush(buffer)

    def _watch(self, buffer, task):
        """The first entry of ``task`` on this thread since the last flush: make
        sure the entries are resolved when ``task`` completes. See Note
        [Profiled graphs go by refcount]."""
        if task is None:
            return
        buffer.last_task = task
        # Inside a default-engine backward the proxy resolves after its span.
        if not getattr(_proxy_depth, "value", 0):
            task.final_callbacks.append(self._on_task_end)

    def _on_task_end(self):
        """A final callback of a watched graph task: resolve every buffered
        entry, so that the task's graph can go when the backward returns."""
        self._flush_all()

    def _on_backward(self, start_ns, end_ns, roots, failed):
        try:
            buffer = self._local.buffer
        except AttributeError:
            buffer = self._thread_buffer()
        buffer.spans.append((start_ns, end_ns, roots, failed))

    def _flush_all(self) -> None:
        for buffer in list(self._buffers):
            self._flush(buffer)

    def _flush(self, buffer: _ThreadBuffer) -> None:
        """Resolve ``buffer``'s raw entries into events, dropping the nodes.

        Any thread may flush any buffer while its owner appends: the entries
        present now are copied and then deleted from the front of the lists
        (each an atomic list operation under the GIL), and the owner only
        ever appends at the end, so no entry is lost or resolved twice.
        Flushes are serialized by the profile's lock.
        """
        with self._lock:
            # Its owner watches the next task it sees again (a task watched
            # twice resolves twice, which is harmless).
            buffer.last_task = None
            spans = _take(buffer.spans, len(buffer.spans))
            # tasks is appended last: every list holds at least this many.
            count = len(buffer.tasks)
            nodes, starts = _take(buffer.nodes, count), _take(buffer.starts, count)
            ends, tasks = _take(buffer.ends, count), _take(buffer.tasks, count)
            if self._state == "stopped":
                # Nodes that finished after the profile stopped: not recorded.
                return
            thread = buffer.thread
            for span in spans:
                self._spans.append(BackwardSpan(thread, *span))
            append_event = self._events.append
            make_event = NodeEvent._make
            last_task, run, pruned = _NOT_A_TASK, -1, False
            for node, start_ns, end_ns, task in zip(nodes, starts, ends, tasks):
                if task is not last_task:
                    last_task = task
                    run = self._run_index(task)
                    # can_checkpoint: the task runs every node (no exec_info).
                    pruned = task is not None and not task.can_checkpoint()
                executed = True
                if pruned:
                    info = task.find_exec_info(node)
                    executed = info is not None and bool(info.needed)
                append_event(make_event((_node_name(node), node._sequence_nr, _node_device(node),
                                         thread, start_ns, end_ns, run, executed, id(node))))

    def _run_index(self, graph_task) -> int:
        """The run index of ``graph_task``, numbered as first seen."""
        if graph_task is None:
            return -1
        runs = self._runs
        run = runs.get(graph_task)
        if run is None:
            run = self._run_count
            runs.add(graph_task, run)
            self._run_count += 1
        return run

    # -- results --

    def _check_stopped(self):
        if self._state != "stopped":
            raise RuntimeError(f"this profile is {self._state}; read its results after it stopped "
                               "(after the with block)")

    @property
    def events(self) -> list[NodeEvent]:
        """Every node event, by start time."""
        self._check_stopped()
        return list(self._events)

    @property
    def backward_spans(self) -> list[BackwardSpan]:
        """Every default-engine ``execute`` call, by start time."""
        self._check_stopped()
        return list(self._spans)

    @property
    def threads(self) -> list[ThreadInfo]:
        """The threads that reported, in order of first report."""
        self._check_stopped()
        return [buffer.thread for buffer in self._buffers]

    @property
    def runs(self) -> int:
        """How many graph tasks (backward calls, reentrant ones included) ran nodes."""
        self._check_stopped()
        return self._run_count

    def backward_wall_ns(self) -> int:
        """The wall time during which a backward was running: the union of the
        backward spans and of each run's extent (first node start to last end)."""
        self._check_stopped()
        intervals = [(span.start_ns, span.end_ns) for span in self._spans]
        extents = {}
        for event in self._events:
            first, last = extents.get(event.run, (event.start_ns, event.end_ns))
            extents[event.run] = (min(first, event.start_ns), max(last, event.end_ns))
        intervals.extend(extents.values())
        return _union_length(intervals)

    def self_times_ns(self) -> list[int]:
        """Per event (in ``events`` order): its duration less the durations of
        the events nested directly inside it on the same thread."""
        self._check_stopped()
        events = self._events
        self_ns = [event.end_ns - event.start_ns for event in events]
        # Events are sorted by (start, -end): a parent comes before its children.
        open_by_thread: dict[int, list[int]] = {}
        for i, event in enumerate(events):
            stack = open_by_thread.setdefault(event.thread.index, [])
            while stack and events[stack[-1]].end_ns <= event.start_ns:
                stack.pop()
            if stack:
                self_ns[stack[-1]] -= event.end_ns - event.start_ns
            stack.append(i)
        return self_ns

    def summary(self) -> list[NodeTypeSummary]:
        """One row per node name, by total time, largest first."""
        self._check_stopped()
        wall = self.backward_wall_ns()
        rows: dict[str, list] = {}
        for event, self_ns in zip(self._events, self.self_times_ns()):
            duration = event.end_ns - event.start_ns
            row = rows.get(event.name)
            if row is None:
                rows[event.name] = [1, duration, self_ns, duration]
            else:
                row[0] += 1
                row[1] += duration
                row[2] += self_ns
                row[3] = max(row[3], duration)
        summary = [NodeTypeSummary(name, count, total, self_ns, total / count, longest,
                                   total / wall if wall else 0.0)
                   for name, (count, total, self_ns, longest) in rows.items()]
        summary.sort(key=lambda row: (-row.total_ns, row.name))
        return summary

    def table(self, file=_STDOUT, limit: int | None = None) -> str:
        """Print (to ``file``, sys.stdout by default; None: only return) and
        return a summary by node type, the ``limit`` largest (and one line for the rest):
        count, total, self, mean and longest time, and the share of the
        backward's wall time. Shares may add up to more than 100% when
        device threads run nodes in parallel."""
        self._check_stopped()
        rows = self.summary()
        shown = rows if limit is None else rows[:limit]
        wall = self.backward_wall_ns()
        headers = ["Node", "Count", "Total ms", "Self ms", "Mean us", "Max us", "% of backward"]
        body = [[row.name, str(row.count), f"{row.total_ns / 1e6:.3f}", f"{row.self_ns / 1e6:.3f}",
                 f"{row.mean_ns / 1e3:.2f}", f"{row.max_ns / 1e3:.2f}", f"{100 * row.share:.1f}"]
                for row in shown]
        if len(shown) < len(rows):
            rest = rows[len(shown):]
            total = sum(row.total_ns for row in rest)
            count = sum(row.count for row in rest)
            body.append([f"({len(rest)} more)", str(count), f"{total / 1e6:.3f}",
                         f"{sum(row.self_ns for row in rest) / 1e6:.3f}",
                         f"{total / count / 1e3:.2f}", f"{max(row.max_ns for row in rest) / 1e3:.2f}",
                         f"{100 * total / wall if wall else 0.0:.1f}"])
        count = sum(row.count for row in rows)
        total = sum(row.total_ns for row in rows)
        footer = ["Total", str(count), f"{total / 1e6:.3f}",
                  f"{sum(row.self_ns for row in rows) / 1e6:.3f}",
                  f"{total / count / 1e3:.2f}" if count else "0.00",
                  f"{max((row.max_ns for row in rows), default=0) / 1e3:.2f}",
                  f"{100 * total / wall if wall else 0.0:.1f}"]
        widths = [max(len(line[i]) for line in [headers, footer] + body) for i in range(len(headers))]

        def format_line(cells):
            return "  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i])
                             for i, cell in enumerate(cells))

        rule = "-" * len(format_line(headers))
        lines = [format_line(headers), rule] + [format_line(line) for line in body]
        lines += [rule, format_line(footer),
                  f"backward wall time {wall / 1e6:.3f} ms: {len(self._spans)} backward call(s), "
                  f"{self._run_count} graph task(s), nodes on "
                  f"{len({event.thread.index for event in self._events})} thread(s)"]
        text = "\n".join(lines) + "\n"
        if file is _STDOUT:
            file = sys.stdout
        if file is not None:
            file.write(text)
        return text

    def chrome_trace(self) -> dict:
        """The Chrome trace-event document (JSON object format) as a dict."""
        self._check_stopped()
        pid = os.getpid()
        origin = self.start_ns
        tids = _track_ids(self.threads)
        trace = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
                  "args": {"name": "pyengine backward"}}]
        # Tracks: the threads that called backward first, then the engine's.
        callers = {span.thread.index for span in self._spans}
        order = sorted(self.threads, key=lambda thread: (thread.index not in callers, thread.index))
        for sort_index, thread in enumerate(order):
            tid = tids[thread.index]
            trace.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                          "args": {"name": thread.name}})
            trace.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                          "args": {"sort_index": sort_index}})
        for span in self._spans:
            trace.append({"ph": "X", "pid": pid, "tid": tids[span.thread.index],
                          "name": "backward" if not span.failed else "backward (failed)",
                          "cat": "backward", "ts": (span.start_ns - origin) / 1e3,
                          "dur": (span.end_ns - span.start_ns) / 1e3,
                          "args": {"roots": span.roots}})
        for event in self._events:
            sequence_nr = event.sequence_nr
            trace.append({"ph": "X", "pid": pid, "tid": tids[event.thread.index],
                          "name": event.name, "cat": "node" if event.executed else "node,captured",
                          "ts": (event.start_ns - origin) / 1e3,
                          "dur": (event.end_ns - event.start_ns) / 1e3,
                          "args": {"sequence_nr": sequence_nr if sequence_nr < 2**63 else "max",
                                   "device": event.device, "run": event.run,
                                   "executed": event.executed}})
        return {"traceEvents": trace, "displayTimeUnit": "ms",
                "otherData": {"source": "pyengine.profile", "clock": "time.perf_counter_ns",
                              "origin_ns": origin, "implementation": _core.IMPLEMENTATION}}

    def export_chrome_trace(self, path) -> None:
        """Write the Chrome trace-event JSON that Perfetto (ui.perfetto.dev) and
        chrome://tracing open: one track per thread that ran nodes or called
        backward (the calling threads first, with a ``backward`` slice per
        call), one slice per node; times in microseconds from the profile's start."""
        document = self.chrome_trace()
        with open(path, "w", encoding="utf-8") as file:
            json.dump(document, file, separators=(",", ":"))
            file.write("\n")

    def __repr__(self):
        count = len(self._events) if self._state == "stopped" else "?"
        return f"<pyengine.profile {self._state}, {count} node events>"


def _take(entries: list, count: int) -> list:
    """Remove and return the first ``count`` entries (two atomic list operations)."""
    taken = entries[:count]
    del entries[:count]
    return taken


def _track_ids(threads) -> dict[int, int]:
    """A track id per thread: its native id, unless two threads share one."""
    ids, used = {}, set()
    for thread in threads:
        tid = thread.native_id
        if tid in used:
            tid = max(used) + 1
        used.add(tid)
        ids[thread.index] = tid
    return ids


def _union_length(intervals) -> int:
    """Total length covered by ``(start, end)`` intervals."""
    total = 0
    current_start = current_end = None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        elif end > current_end:
            current_end = end
    if current_end is not None:
        total += current_end - current_start
    return total
