"""Randomized stress runs: the engine keeps working and loses nothing.

``python -m pyengine stress --minutes N`` runs it from the command line.

:func:`run` repeats batches of randomized scenarios until a time budget or a
batch count runs out, and checks every result against an independent
computation:

- ``threads``: 4 to 8 Python threads run backward at once, each on a graph
  of its own and all on one shared graph (``retain_graph=True``);
- ``reentrant``: reentrant backward chains 1 to 1,000 levels deep, inline
  and through the pool threads;
- ``faults``: nodes and hooks that raise at random points, ``Exception``s
  and a ``BaseException`` that is not an ``Exception`` (as
  ``KeyboardInterrupt`` is), in single and concurrent backward calls;
- ``callbacks``: final callbacks that queue more callbacks;
- ``devices``: graphs crossing ``cpu -> fake:0 -> fake:1 -> cpu`` with
  streams that hold work back until waited for.

The graphs are chains and fans of nodes that scale by powers of two, so
every gradient is exact and compared with ``==``. After every batch:

- no deadlock: every backward runs under a watchdog that dumps all threads'
  stacks and fails the run when it takes longer than ``watchdog_s``;
- no leaked threads: the threads that are not the engine's are back to
  their count before the batch, and the engine's (device workers, reentrant
  pool) do not grow past what the deepest reentrant chain needs;
- no leaked graphs: with the cyclic garbage collector off, weak references
  to the root of every finished graph are dead: reference counting alone
  freed them, so the engine left no reference and made no cycle;
- no lock left held: the batch ends with a backward that must succeed;
- no half-written ``.grad``: after a failed backward each leaf's gradient is
  either as it was or holds its complete gradient for that backward.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import math
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from . import fake_device as fd
from .autograd import gradient_edge
from .device import CPU
from .engine import get_default_engine, queue_callback
from .node import Edge, InputMetadata, Node

__all__ = ["StressFailure", "StressReport", "run"]

SCENARIOS = ("threads", "reentrant", "faults", "callbacks", "devices")


class StressFailure(AssertionError):
    """A stress check failed: a wrong gradient, a hang, a leak."""


@dataclass
class StressReport:
    batches: int = 0
    backward_calls: int = 0
    faults_injected: int = 0
    deadlocks: int = 0
    leaked_threads: int = 0
    leaked_graphs: int = 0
    seconds: float = 0.0
    per_scenario: dict = field(default_factory=dict)

    @property
    def failures(self) -> int:
        """The failed checks counted so far (a run stops at its first failure)."""
        return self.deadlocks + self.leaked_threads + self.leaked_graphs

    @property
    def scenarios(self) -> int:
        """Scenarios run so far: one of each per batch."""
        return self.batches * len(SCENARIOS)

    def progress(self) -> str:
        """One line: the elapsed time, batches, scenarios and failures so far."""
        return (f"{self.seconds:6.1f} s  {self.batches:,} batches  {self.scenarios:,} scenarios  "
                f"{self.backward_calls:,} backward calls  {self.failures} failures")

    def summary(self) -> str:
        scenarios = ", ".join(f"{name} {count}" for name, count in sorted(self.per_scenario.items()))
        return (f"{self.batches} batches, {self.backward_calls} backward calls ({scenarios}), "
                f"{self.faults_injected} faults injected, deadlocks {self.deadlocks}, "
                f"leaked threads {self.leaked_threads}, leaked graphs {self.leaked_graphs}, "
                f"{self.seconds:.1f} s")


# -- graphs with exact gradients ----------------------------------------------------------

class Leaf:
    """A leaf tensor of the tensor protocol."""

    def __init__(self, data):
        self.data = data
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


METADATA = InputMetadata((4,), np.float64)


class Scale(Node):
    """Backward of ``y = factor * x``; may raise ``fault`` when it runs."""

    def __init__(self, edges, factor, fault=None, metadata=METADATA):
        super().__init__(edges, [metadata])
        self.factor = factor
        self.fault = fault

    def apply(self, grads):
        if self.fault is not None:
            raise self.fault
        return [grads[0] * self.factor for _ in self._next_edges]


class InjectedError(Exception):
    """An ordinary error a node or hook raises on purpose."""


class InjectedInterrupt(BaseException):
    """Not an Exception, as KeyboardInterrupt: the engine must still recover."""


def random_factor(rng):
    return float(2.0 ** int(rng.integers(-2, 3)))


def chain(rng, leaf, length):
    """A chain of ``length`` scalings ending at ``leaf``; returns the root node
    and the exact gradient factor."""
    edge, product = gradient_edge(leaf), 1.0
    for _ in range(length):
        factor = random_factor(rng)
        node = Scale([edge], factor)
        edge, product = Edge(node, 0), product * factor
    return edge.node, product


def fan(rng, leaves, width, depth):
    """A root that fans out to ``width`` chains ending at random leaves; returns
    the root and each leaf's exact gradient factor."""
    expected = [0.0] * len(leaves)
    edges = []
    for _ in range(width):
        index = int(rng.integers(len(leaves)))
        node, product = chain(rng, leaves[index], depth)
        edges.append(Edge(node, 0))
        expected[index] += product
    return Scale(edges, 1.0), expected


def backward(root, grad, keep_graph=False):
    get_default_engine().execute([Edge(root, 0)], [grad], keep_graph, False, True)


# -- the watchdog ---------------------------------------------------------------------------

class Watchdog:
    """Runs calls in a thread and fails the run if one does not finish in time."""

    def __init__(self, seconds, report):
        self.seconds = seconds
        self.report = report

    def call(self, function, *args):
        outcome = {}

        def target():
            try:
                outcome["value"] = function(*args)
            except BaseException as error:  # everything must reach the caller
                outcome["error"] = error

        thread = threading.Thread(target=target, name="pyengine-stress-call", daemon=True)
        thread.start()
        thread.join(self.seconds)
        if thread.is_alive():
            self.report.deadlocks += 1
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            raise StressFailure(f"{getattr(function, '__name__', function)} did not finish in "
                                f"{self.seconds} s: deadlock (stacks dumped to stderr)")
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")


# -- scenarios ---------------------------------------------------------------------------------

def expect_equal(got, expected, what):
    if got is None or not np.array_equal(np.asarray(got), np.asarray(expected)):
        raise StressFailure(f"{what}: got {got!r}, expected {expected!r}")


def scenario_threads(rng, report, graphs):
    count = int(rng.integers(4, 9))
    # Disjoint graphs, one per thread.
    leaves = [Leaf(np.zeros(4)) for _ in range(count)]
    roots = [chain(rng, leaf, int(rng.integers(1, 40))) for leaf in leaves]
    threads = [threading.Thread(target=backward, args=(root, np.ones(4)))
               for root, _ in roots]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for leaf, (_, product) in zip(leaves, roots):
        expect_equal(leaf.grad, np.full(4, product), "disjoint threads")
    # One shared graph, retained, backward from every thread at once.
    shared = [Leaf(np.zeros(4)) for _ in range(3)]
    root, expected = fan(rng, shared, width=int(rng.integers(2, 20)), depth=5)
    threads = [threading.Thread(target=backward, args=(root, np.ones(4), True))
               for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for leaf, factor in zip(shared, expected):
        if factor:
            expect_equal(leaf.grad, np.full(4, count * factor), "shared graph")
    graphs.extend(root for root, _ in roots)
    graphs.append(root)
    return 2 * count


class Reenter(Node):
    """Starts a backward one level shallower from inside ``apply``."""

    def __init__(self, leaf, depth):
        super().__init__([gradient_edge(leaf)], [((), np.float64)])
        self.leaf = leaf
        self.depth = depth

    def apply(self, grads):
        if self.depth > 0:
            backward(Reenter(self.leaf, self.depth - 1), np.ones(()))
        return grads


def scenario_reentrant(rng, report, graphs):
    depth = int(rng.choice([1, 30, 100, 1000]))
    leaf = Leaf(np.zeros(()))
    root = Reenter(leaf, depth)
    backward(root, np.ones(()))
    expect_equal(leaf.grad, depth + 1.0, f"reentrant chain {depth} deep")
    graphs.append(root)
    return depth + 1


class Tap(Node):
    """A pass-through that may raise: a fault in the middle of a graph."""

    def __init__(self, edge, fault):
        super().__init__([edge], [METADATA])
        self.fault = fault

    def apply(self, grads):
        if self.fault is not None:
            raise self.fault
        return grads


def scenario_faults(rng, report, graphs):
    calls = 0
    for _ in range(int(rng.integers(2, 6))):
        fault = InjectedInterrupt("stress") if rng.random() < 0.3 else InjectedError("stress")
        leaves = [Leaf(np.zeros(4)) for _ in range(3)]
        before = [np.full(4, 7.0) for _ in leaves]
        for leaf, grad in zip(leaves, before):
            leaf.grad = grad.copy()
        root, expected = fan(rng, leaves, width=int(rng.integers(3, 12)), depth=3)
        where = rng.choice(["node", "prehook", "posthook", "tensor_hook"])
        target = root
        if where == "node":
            faulty = Tap(root._next_edges[0], fault)
            root._next_edges = (Edge(faulty, 0),) + root._next_edges[1:]
        else:
            def hook(*args, fault=fault):
                raise fault
            if where == "prehook":
                target.register_prehook(hook)
            elif where == "posthook":
                target.register_hook(hook)
            else:
                target.register_tensor_prehook(0, hook)
        report.faults_injected += 1
        try:
            backward(root, np.ones(4))
        except (InjectedError, InjectedInterrupt) as error:
            if error is not fault:
                raise StressFailure(f"the caller got {error!r}, not the fault raised") from error
            # The traceback holds this frame, whose locals hold the graph, which
            # holds the fault: a cycle of the test's making, not the engine's.
            error.__traceback__ = None
        else:
            raise StressFailure(f"a fault in a {where} was swallowed")
        calls += 1
        for leaf, grad, factor in zip(leaves, before, expected):
            # Either untouched, or holding this backward's whole gradient.
            if not (np.array_equal(leaf.grad, grad) or
                    np.array_equal(leaf.grad, grad + factor)):
                raise StressFailure(f"half-written .grad after a fault: {leaf.grad!r}")
        graphs.append(root)
    return calls


def scenario_callbacks(rng, report, graphs):
    length = int(rng.integers(1, 50))
    order = []
    leaf = Leaf(np.zeros(4))

    def queue(step):
        def callback():
            order.append(step)
            if step + 1 < length:
                queue_callback(queue(step + 1))
        return callback

    class Queues(Node):
        def apply(self, grads):
            queue_callback(queue(0))
            return grads

    root = Queues([gradient_edge(leaf)], [METADATA])
    backward(root, np.ones(4))
    expect_equal(np.array(order), np.arange(length), "callbacks queued by callbacks")
    graphs.append(root)
    return 1


def scenario_devices(rng, report, graphs):
    leaf = Leaf(np.zeros(4))
    devices = [fd.device(0), fd.device(1)]

    class Move(Node):
        def __init__(self, edge, device, factor, to):
            super().__init__([edge], [InputMetadata((4,), np.float64, device)])
            self.factor, self.to = factor, to

        def apply(self, grads):
            grad = grads[0] * self.factor
            host = grad.numpy() if isinstance(grad, fd.FakeArray) else grad
            return [host if self.to == CPU else fd.to_fake(host, self.to)]

    edge, product, to = gradient_edge(leaf), 1.0, CPU
    for _ in range(int(rng.integers(2, 8))):
        device = devices[int(rng.integers(2))]
        factor = random_factor(rng)
        edge = Edge(Move(edge, device, factor, to), 0)
        product, to = product * factor, device
    with fd.set_delayed(bool(rng.integers(2))):
        backward(edge.node, fd.to_fake(np.ones(4), to))
    expect_equal(leaf.grad, np.full(4, product), "cross-device chain")
    graphs.append(edge.node)
    return 1


_SCENARIO_FUNCTIONS = {
    "threads": scenario_threads,
    "reentrant": scenario_reentrant,
    "faults": scenario_faults,
    "callbacks": scenario_callbacks,
    "devices": scenario_devices,
}


# -- batches -----------------------------------------------------------------------------------

def _engine_thread(thread):
    return thread.name.startswith("pyengine-") and thread.name != "pyengine-stress-call"


def _check_batch(report, graph_refs, other_threads_before, engine_threads_limit):
    # Graphs are freed by reference counting alone (the cyclic GC is off).
    alive = [ref for ref in graph_refs if ref() is not None]
    if alive:
        report.leaked_graphs += len(alive)
        raise StressFailure(f"{len(alive)} graphs outlived their backward (a reference cycle "
                            f"or a leaked reference), e.g. {alive[0]()!r}")
    others = [t for t in threading.enumerate() if not _engine_thread(t)]
    engine = [t for t in threading.enumerate() if _engine_thread(t)]
    if len(others) > other_threads_before or len(engine) > engine_threads_limit:
        report.leaked_threads += max(len(others) - other_threads_before,
                                     len(engine) - engine_threads_limit)
        raise StressFailure(f"threads leaked: {[t.name for t in threading.enumerate()]}")


def run(duration_s=None, batches=None, seed=0, watchdog_s=60.0, log=None) -> StressReport:
    """Run batches until ``duration_s`` seconds or ``batches`` batches are done
    (whichever is given; both: the first reached). Raises StressFailure on
    the first failed check; returns the report otherwise, its ``seconds``
    the time to the end of the last batch. ``log(report)``, where given, is
    called after every batch."""
    if duration_s is None and batches is None:
        raise ValueError("give duration_s or batches")
    rng = np.random.default_rng(seed)
    report = StressReport()
    watchdog = Watchdog(watchdog_s, report)
    engine = get_default_engine()
    # Deepest reentrant chain / levels per thread, plus the device workers,
    # plus slack for pool threads still winding down.
    engine_threads_limit = 1000 // max(engine.max_recursion_depth, 1) + 4 + 4
    start = time.monotonic()
    gc_was_enabled = gc.isenabled()
    completed = False
    try:
        while True:
            if batches is not None and report.batches >= batches:
                break
            # A time budget runs one batch at least: "passed" after none
            # would check nothing.
            if (duration_s is not None and report.batches
                    and time.monotonic() - start >= duration_s):
                break
            other_threads_before = len([t for t in threading.enumerate()
                                        if not _engine_thread(t)])
            gc.collect()
            gc.disable()
            graphs: list = []
            for name in rng.permutation(SCENARIOS):
                calls = watchdog.call(_SCENARIO_FUNCTIONS[name], rng, report, graphs)
                report.backward_calls += calls
                report.per_scenario[name] = report.per_scenario.get(name, 0) + calls
            graph_refs = [weakref.ref(root) for root in graphs]
            del graphs
            # A lock left held would hang this one; a broken engine fails it.
            leaf = Leaf(np.zeros(4))
            root, product = chain(rng, leaf, 3)
            watchdog.call(backward, root, np.ones(4))
            expect_equal(leaf.grad, np.full(4, product), "the backward after the batch")
            del root
            _check_batch(report, graph_refs, other_threads_before, engine_threads_limit)
            gc.enable()
            report.batches += 1
            report.seconds = time.monotonic() - start
            if log is not None:
                log(report)
        completed = True
    finally:
        if gc_was_enabled:
            gc.enable()
        if not completed:
            # To the failure. A completed run keeps the time at its last
            # batch's end, which its last progress line showed.
            report.seconds = time.monotonic() - start
    return report


# -- python -m pyengine stress ------------------------------------------------------------

def _minutes(text: str) -> float:
    """``--minutes``: a positive, finite number (nan never ends a run, and a
    budget of 0 or less would pass having checked nothing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected a positive, finite number of minutes, got {text!r}")
    return value


def _watchdog_seconds(text: str) -> float:
    """``--watchdog``: positive (0 fails every call as a deadlock) and at most
    ``threading.TIMEOUT_MAX``, the longest a thread's join can wait."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (0 < value <= threading.TIMEOUT_MAX):
        raise argparse.ArgumentTypeError(
            f"expected a positive number of seconds up to {threading.TIMEOUT_MAX:g}, got {text!r}")
    return value


def _seed(text: str) -> int:
    """``--seed``: an integer >= 0, as numpy's default_rng takes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a seed >= 0, got {text!r}")
    return value


def add_arguments(parser) -> None:
    parser.add_argument("--minutes", type=_minutes, default=1.0,
                        help="time budget, at least one batch (1)")
    parser.add_argument("--seed", type=_seed, default=0, help="random seed, >= 0 (0)")
    parser.add_argument("--watchdog", type=_watchdog_seconds, default=60.0,
                        help="seconds one call may take before it counts as a deadlock (60)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress line: print only the header and the summary")


class ProgressLine:
    """The run's progress on one line: redrawn in place on a terminal; in a log
    (not a terminal), a line every ``every_s`` seconds."""

    def __init__(self, stream=None, every_s=10.0):
        self.stream = sys.stdout if stream is None else stream
        self.live = self.stream.isatty()
        self.every_s = every_s
        self.next_s = every_s
        self.drawn = False

    def __call__(self, report):
        if self.live:
            self.stream.write(f"\r\x1b[K{report.progress()}")
            self.drawn = True
        elif report.seconds >= self.next_s:
            self.stream.write(report.progress() + "\n")
            self.next_s = report.seconds + self.every_s
        self.stream.flush()

    def finish(self):
        """End the redrawn line, so that what follows starts on a line of its own."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def main(args) -> int:
    from ._core import core_description

    print(f"pyengine stress: {core_description()}; {args.minutes} min, seed {args.seed}", flush=True)
    progress = None if args.quiet else ProgressLine()
    try:
        report = run(duration_s=args.minutes * 60, seed=args.seed, watchdog_s=args.watchdog,
                     log=progress)
    except StressFailure as failure:
        if progress is not None:
            progress.finish()
        print(f"FAILED: {failure}")
        return 1
    if progress is not None:
        progress.finish()
    print(f"passed: {report.summary()}")
    return 0
