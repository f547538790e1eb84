"""The child program of tests/test_allocation_failures.py and
tests/test_pymem_failures.py: a backward in which the n-th allocation
fails, for every n.

Run as ``python allocation_failure_cases.py SCENARIO`` with either
``tests/fail_new.cpp`` built and preloaded (``LD_PRELOAD``, and its path in
``FAIL_NEW``): the n-th C++ allocation (operator new) throws; or
``tests/fail_pymem.c`` built (its path in ``FAIL_PYMEM``): the n-th Python
allocation (PyMem_Malloc, PyObject_Malloc and their calloc and realloc)
returns NULL. For the scenario, it first counts the allocations of one
backward (``calls``), then, for each n from 1 to that count, runs the
backward with the n-th allocation failing, and then a good backward, and
prints one line per case::

    cold 3 calls=21 MemoryError | after exact

Python allocations are many (thousands a backward): beyond the first
``FAIL_PYMEM_EACH`` of them, only every ``FAIL_PYMEM_STRIDE``-th fails
(``steps``). They are counted on the thread that runs the backward, and in
the scenarios whose nodes run on other threads too (``EVERY_THREAD``), on
every thread.

``cold`` cases run each on a new thread with a new Engine (so that no
table, queue or frame block kept by an earlier backward hides an
allocation), ``warm`` cases one after the other on this thread and the
default engine. The outcome is ``exact`` (the gradients are the reference
ones), ``MemoryError``, or anything else (a finding); ``after``: the good
backward's gradients, on the same thread and engine, against the reference.
A crash or a hang shows as the process's end: the parent knows the case
from the ``BEGIN`` line printed before it. An error that a function of the
engine could not raise, and Python only printed ("Exception ignored in"),
is a line ``UNRAISABLE`` after the case's ``BEGIN``.

Every node passes twice the gradient it gets along each of its edges, so
the reference gradients are computed here by a walk of the graph in Python
(no engine), exact in float64. In ``devices_raise`` a node on a device
raises PlantedError instead, every time: that error is its ``exact``.
"""

import ctypes
import os
import sys
import threading

import numpy as np

import pyengine
from pyengine import Edge, Node
from pyengine import fake_device as fd

SHAPE = (2,)


class FailNew:
    """tests/fail_new.cpp's controls: ``arm(n)`` makes the n-th C++
    allocation from now fail (0: none), ``disarm()`` returns how many
    there were."""

    def __init__(self, path):
        library = ctypes.CDLL(path)
        library.fail_new_arm.argtypes = [ctypes.c_long]
        library.fail_new_disarm.restype = ctypes.c_long
        self.arm, self.disarm = library.fail_new_arm, library.fail_new_disarm


class FailPyMem:
    """tests/fail_pymem.c's controls, as FailNew's: ``arm(n)`` makes the
    n-th Python allocation from now fail, on this thread or, while
    ``every_thread`` is set, on any."""

    def __init__(self, path, every_thread=False):
        # PyDLL: the calls keep the GIL, which PyMem_SetAllocator needs.
        library = ctypes.PyDLL(path)
        library.fail_pymem_arm.argtypes = [ctypes.c_long, ctypes.c_int]
        library.fail_pymem_arm.restype = None
        library.fail_pymem_disarm.restype = ctypes.c_long
        library.fail_pymem_install.restype = None
        library.fail_pymem_install()
        self.library, self.every_thread = library, every_thread

    def arm(self, failing_call):
        try:
            self.library.fail_pymem_arm(failing_call, self.every_thread)
        except MemoryError:
            # The failing call was ctypes' own, after the C function armed:
            # the case runs with no failure.
            pass

    def disarm(self):
        while True:
            try:
                return self.library.fail_pymem_disarm()
            except MemoryError:
                # The failing call was ctypes' own, before the C function
                # ran: only one call fails, so the next try disarms.
                pass


# What case() fails: set by main(), or by a test that makes the twin's own
# allocations fail instead (tests/test_allocation_failures.py).
failures = None

# The scenarios whose nodes run on threads other than the caller's (device
# and pool threads): in their warm cases, which find those threads running,
# Python allocations fail on every thread. Not in cold cases, where the
# backward starts the threads: an allocation that fails in CPython's own
# start of a thread (threading's _bootstrap_inner, on the new thread, once
# start() has returned) ends the thread before it runs its target, and a
# pool thread that never comes leaves its graph task waiting for good,
# whatever the engine does; this program's own thread.start() fails too.
EVERY_THREAD = ("devices", "devices_raise", "pool")


class Leaf:
    def __init__(self):
        self.data, self.grad, self.grad_fn = np.zeros(SHAPE), None, None
        self.output_nr, self.requires_grad = 0, True


def host(value):
    return value.numpy() if isinstance(value, fd.FakeArray) else value


class Twice(Node):
    """Twice its gradient along each edge (onto edge i's device ``to[i]``,
    where given), after running ``during``."""

    def __init__(self, edges, device=pyengine.CPU, to=None, during=None):
        super().__init__(next_edges=edges,
                         input_metadata=[pyengine.InputMetadata(SHAPE, np.float64, device)])
        self.to = to or [None] * len(edges)
        self.during = during

    def apply(self, grads):
        if self.during is not None:
            self.during()
        out = host(grads[0]) * 2.0
        return [out if device is None else fd.to_fake(out, device) for device in self.to]


class Owner:
    """A value of a framework's own graph: twice its gradient to each parent."""

    def __init__(self, *parents):
        self.parents = list(parents)
        self.grad = None

    def backward_writes(self):
        for parent in self.parents:
            parent.grad = (parent.grad if parent.grad is not None else 0) + self.grad * 2


def owner_returns(owner, grads):
    return [grads[0] * 2 for _ in owner.parents]


def reference(root, leaves):
    """Each leaf's gradient from a unit root gradient, by a walk of the
    graph in Python: the sum over paths of 2 per node passed."""
    order, seen = [], set()

    def visit(node):
        # Recursive: the graphs here are a few hundred nodes deep at most.
        if id(node) in seen:
            return
        seen.add(id(node))
        for child in children(node):
            visit(child)
        order.append(node)

    def children(node):
        if isinstance(node, Owner):
            return node.parents
        if isinstance(node, Twice):
            return [edge.node for edge in node.next_edges if edge is not None]
        return []

    visit(root)
    total = {id(root): 1.0}
    for node in reversed(order):
        for child in children(node):
            total[id(child)] = total.get(id(child), 0.0) + 2.0 * total.get(id(node), 0.0)
    result = []
    for leaf in leaves:
        key = leaf if isinstance(leaf, Owner) else pyengine.grad_accumulator(leaf)
        result.append([total.get(id(key), 0.0)] * SHAPE[0])
    return result


class PlantedError(Exception):
    """What a node of the ``devices_raise`` scenario raises, every time."""


def planted_failure():
    raise PlantedError("a node fails")


# expected_of() for a scenario whose backward always raises PlantedError.
RAISES = "PlantedError"


def build(scenario):
    """The graph: (root, leaves, run), run() giving the leaves' gradients."""
    a, b = Leaf(), Leaf()
    edge_a, edge_b = pyengine.gradient_edge(a), pyengine.gradient_edge(b)
    api = "backward"
    if scenario in ("lattice", "lattice_grad", "made"):
        # Three layers of three, each node with two consumers and two inputs.
        layer = [Twice([edge_a, edge_b]) for _ in range(3)]
        for _ in range(3):
            layer = [Twice([Edge(layer[i], 0), Edge(layer[(i + 1) % 3], 0)]) for i in range(3)]
        root = Twice([Edge(node, 0) for node in layer])
        if scenario == "lattice_grad":
            api = "grad"
    elif scenario == "fan":
        # A ready queue of 300 tasks at once.
        root = Twice([Edge(Twice([edge_a]), 0) for _ in range(300)] + [edge_b])
    elif scenario == "chain":
        node = Twice([edge_a])
        for _ in range(60):
            node = Twice([Edge(node, 0)])
        root = Twice([Edge(node, 0), edge_b])
    elif scenario in ("devices", "devices_raise"):
        first, second = fd.device(0), fd.device(1)
        # The device threads complete the task and wake its owner, this one.
        low = Twice([edge_a], second)
        # devices_raise: a node fails while its stream is current (See Note
        # [Python allocations that fail] in pyengine/_engine.pyx).
        mid = Twice([Edge(low, 0), edge_b], first, to=[second, None],
                    during=planted_failure if scenario == "devices_raise" else None)
        root = Twice([Edge(mid, 0)], pyengine.CPU, to=[first])
    elif scenario in ("reentrant", "pool"):
        inner = Twice([pyengine.gradient_edge(Leaf())])

        def nested():
            pyengine.backward([Edge(inner, 0)], [np.ones(SHAPE)], retain_graph=True)

        root = Twice([Edge(Twice([edge_a, edge_b], during=nested), 0)])
    elif scenario in ("owner_writes", "owner_returns"):
        a, b = Owner(), Owner()
        mid = Owner(a, b)
        root = Owner(mid, b)
        if scenario == "owner_writes":
            graph = pyengine.OwnerGraph("parents", "backward_writes")

            def run():
                a.grad = b.grad = mid.grad = None
                root.grad = np.ones(SHAPE)
                graph.backward(root)
                return [a.grad, b.grad]
        else:
            graph = pyengine.OwnerGraph("parents", owner_returns, mode="returns")

            def run():
                a.grad = b.grad = mid.grad = None
                graph.backward(root, np.ones(SHAPE))
                return [a.grad, b.grad]
        return root, [a, b], run
    else:
        raise SystemExit(f"no scenario {scenario!r}")

    def run():
        a.grad = b.grad = None
        if api == "grad":
            return list(pyengine.grad([Edge(root, 0)], [a, b], [np.ones(SHAPE)],
                                      retain_graph=True))
        pyengine.backward([Edge(root, 0)], [np.ones(SHAPE)], retain_graph=True)
        return [a.grad, b.grad]

    return root, [a, b], run


def as_lists(values):
    """run()'s gradients as lists, to compare with reference()'s; made
    after the failures are disarmed (it allocates)."""
    return [None if value is None else host(value).tolist() for value in values]


_expected = {}


def expected_of(scenario):
    """The reference gradients of ``scenario``'s graph, from one built
    before any failure is armed: reference() allocates, as does build()."""
    if scenario == "devices_raise":
        return RAISES
    if scenario not in _expected:
        _expected[scenario] = reference(*build(scenario)[:2])
    return _expected[scenario]


def outcome_of(values, error, expected):
    if expected is RAISES and type(error) is PlantedError:
        return "exact"
    if error is None:
        got = as_lists(values)
        return "exact" if got == expected else f"gave {got}"
    if isinstance(error, MemoryError):
        return "MemoryError"
    if isinstance(error.__cause__, MemoryError):
        # A thread that could not start: the engine raises RuntimeError
        # from the MemoryError (See start_pool_thread).
        return f"MemoryError via {type(error).__name__}"
    return f"{type(error).__name__}: {error}"  # a finding: any other error


def case(scenario, failing_call):
    """One backward with call ``failing_call`` failing (0: none); then a
    good one. Returns (calls counted, outcome, the good one's outcome).
    Scenario ``made``: the lattice's nodes and metadata are made while
    allocations fail, too. Between arm and disarm nothing allocates but
    the graph's making (``made``) and the backward: what they raise is
    kept, and described after."""
    expected = expected_of(scenario)
    values = error = run = None
    if scenario != "made":
        run = build(scenario)[2]
    failures.arm(failing_call)
    try:
        if run is None:
            run = build(scenario)[2]
        values = run()
    except BaseException as caught:
        error = caught
    calls = failures.disarm()
    if run is None:
        # Making the graph failed: a good one is made and run after.
        run = build(scenario)[2]
    outcome = outcome_of(values, error, expected)
    error = None
    try:
        after = outcome_of(run(), None, expected)
    except BaseException as caught:
        after = outcome_of(None, caught, expected)
    return calls, outcome, after


def on_new_thread(scenario, failing_call):
    """``case`` on a new thread with a new Engine: nothing kept from before."""
    result = []
    engine = pyengine.Engine(max_recursion_depth=0) if scenario == "pool" else pyengine.Engine()
    previous = pyengine.get_default_engine()
    pyengine.set_default_engine(engine)
    try:
        thread = threading.Thread(target=lambda: result.append(case(scenario, failing_call)))
        thread.start()
        thread.join()
    finally:
        pyengine.set_default_engine(previous)
        engine.stop()
    return result[0]


def flags_case():
    """A wake-up task, a shutdown task and a node task pushed, each where
    the ready queue's heap cannot grow (its first allocation failing): a
    flag stands for each of the first two, the third raises MemoryError;
    then the queue pops them in CompareNodeTaskTime's order. Returns what
    it saw, as a dict."""
    from pyengine._core import GraphTask, NodeTask, ReadyQueue

    queue = ReadyQueue()
    graph_task = GraphTask(False, False, 0, ReadyQueue())
    node = Twice([])
    queue.push(NodeTask(graph_task, node, [1.0]))  # the heap now full, at capacity one
    seen = {}
    for name, push in [("wake-up", lambda: queue.push(NodeTask(graph_task, None, None))),
                       ("shutdown", queue.push_shutdown),
                       ("node task", lambda: queue.push(NodeTask(graph_task, node, [2.0])))]:
        failures.arm(1)
        try:
            push()
            outcome = "queued"
        except MemoryError:
            outcome = "MemoryError"
        seen[name] = (outcome, failures.disarm() >= 1)
    seen["len"] = len(queue)
    seen["outstanding"] = graph_task.outstanding_tasks
    popped = [queue.pop() for _ in range(len(queue))]
    seen["popped"] = [("shutdown" if task.is_shutdown else "wake-up" if task.node is None
                       else task.inputs) for task in popped]
    return seen


def steps(calls, each=None, stride=1):
    """The n to fail, of ``calls``: each up to ``each`` (None: all), then
    every ``stride``-th."""
    each = calls if each is None else each
    return list(range(1, min(each, calls) + 1)) + list(range(each + 1, calls + 1, stride))


_output_lock = threading.Lock()


def emit(line):
    """Print ``line`` whole, in one write. The unraisable hook prints from a
    new thread whose start failed while the main thread prints its case:
    print()'s text and its newline are two writes, and a case's line that
    landed between another thread's two began mid-line, and was not
    counted (the parent saw one case fewer, about one run in 25)."""
    with _output_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def report_unraisable(unraisable, default_hook=sys.unraisablehook):
    """An error Python could only print ("Exception ignored in"), on
    stdout after the case's BEGIN line, as well as on stderr."""
    emit(f"UNRAISABLE {type(unraisable.exc_value).__name__} in {unraisable.object!r}")
    default_hook(unraisable)


def main(scenario):
    global failures
    if "FAIL_PYMEM" in os.environ:
        failures = FailPyMem(os.environ["FAIL_PYMEM"])
    else:
        failures = FailNew(os.environ["FAIL_NEW"])
    sys.unraisablehook = report_unraisable
    if scenario == "pool":
        pyengine.set_default_engine(pyengine.Engine(max_recursion_depth=0))
    each = int(os.environ["FAIL_PYMEM_EACH"]) if "FAIL_PYMEM_EACH" in os.environ else None
    stride = int(os.environ.get("FAIL_PYMEM_STRIDE", 1))
    cold_calls = on_new_thread(scenario, 0)[0]
    for n in steps(cold_calls, each, stride):
        emit(f"BEGIN cold {n}")
        calls, outcome, after = on_new_thread(scenario, n)
        emit(f"cold {n} calls={calls} {outcome} | after {after}")
    if isinstance(failures, FailPyMem):
        failures.every_thread = scenario in EVERY_THREAD
    case(scenario, 0)  # warm
    warm_calls = case(scenario, 0)[0]
    for n in steps(warm_calls, each, stride):
        emit(f"BEGIN warm {n}")
        calls, outcome, after = case(scenario, n)
        emit(f"warm {n} calls={calls} {outcome} | after {after}")
    emit(f"END cold={cold_calls} warm={warm_calls}")


if __name__ == "__main__":
    if sys.argv[1] == "flags":
        failures = FailNew(os.environ["FAIL_NEW"])
        emit(f"FLAGS {flags_case()}")
    else:
        main(sys.argv[1])
