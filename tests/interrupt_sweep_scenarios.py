"""The calls that ``tests/test_interrupt_sweep.py`` interrupts at each place.

Each scenario builds its graph afresh (an interrupt may leave the last one
half run) and returns ``(got, expected)``: the analytic result of a run
that no interrupt cut, which the check compares after each interrupted
run, with the state that must be back (``interrupt_sweep.state_problems``)
and the leaves' ``.grad`` locks free. ``run(name)`` sweeps one and
returns its report as a dict.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import plain_tensors
from interrupt_sweep import state_problems, sweep

# The frontend and the fake device imported before any sweep: an
# interrupted import is the import system's matter.
import pyengine
import pyengine.frontend as F
from pyengine import fake_device

SHAPE = (2,)
METADATA = [(SHAPE, np.float64)]
# The leaves of the run being checked: their .grad locks must be free after it.
_leaves: list = []


class Leaf(plain_tensors.Leaf):
    """A leaf whose .grad lock the check looks at."""

    def __init__(self, data):
        super().__init__(data)
        _leaves.append(self)


class Scale(pyengine.Node):
    """Backward of ``3 * x``."""

    def apply(self, grads):
        return [grads[0] * 3.0]


class Split(pyengine.Node):
    """Backward of using ``x`` twice."""

    def apply(self, grads):
        return [grads[0], grads[0]]


def diamond(x):
    """x -> two Scale nodes -> Split: d/dx = 6."""
    left = Scale([pyengine.gradient_edge(x)], METADATA)
    right = Scale([pyengine.gradient_edge(x)], METADATA)
    return Split([pyengine.Edge(left, 0), pyengine.Edge(right, 0)], METADATA)


# -- the engine ----------------------------------------------------------------------

def backward_with_hooks():
    """A backward with every kind of hook and a final callback queued by a node."""
    x = Leaf(np.ones(SHAPE))
    called = []
    pyengine.register_tensor_hook(x, lambda grad: grad * 2.0)
    pyengine.register_post_accumulate_grad_hook(x, lambda tensor: called.append("post"))
    root = diamond(x)
    root.register_prehook(lambda grad_outputs: None)
    root.register_hook(lambda grad_inputs, grad_outputs: None)

    class QueuesCallback(pyengine.Node):
        def apply(self, grads):
            pyengine.queue_callback(lambda: called.append("final"))
            return [grads[0]]

    top = QueuesCallback([pyengine.Edge(root, 0)], METADATA)
    pyengine.backward([pyengine.Edge(top, 0)], [np.ones(SHAPE)])
    return (x.grad, called), (np.full(SHAPE, 12.0), ["post", "final"])


def grad_of_inputs():
    """``grad(inputs=)`` on a graph kept for a second call."""
    x = Leaf(np.ones(SHAPE))
    root = diamond(x)
    (first,) = pyengine.grad([pyengine.Edge(root, 0)], [x], [np.ones(SHAPE)], retain_graph=True)
    (second,) = pyengine.grad([pyengine.Edge(root, 0)], [x], [np.ones(SHAPE)])
    return (first, second, x.grad), (np.full(SHAPE, 6.0), np.full(SHAPE, 6.0), None)


def profiled():
    x = Leaf(np.ones(SHAPE))
    with pyengine.profile() as prof:
        pyengine.backward([pyengine.Edge(diamond(x), 0)], [np.ones(SHAPE)])
    return (x.grad, prof.runs), (np.full(SHAPE, 6.0), 1)


_reentrant_engine = []


class Reenter(pyengine.Node):
    """Runs a backward of the next level inside its own: a chain of
    reentrant backwards deeper than the engine's recursion limit, so that
    some run on pool threads while the main thread waits for them."""

    def __init__(self, depth, x):
        super().__init__([pyengine.gradient_edge(x)], [((), np.float64)])
        self.depth, self.x = depth, x

    def apply(self, grads):
        if self.depth > 0:
            _reentrant_engine[0].execute([pyengine.Edge(Reenter(self.depth - 1, self.x), 0)],
                                         [np.ones(())], False, False, True)
        return [grads[0]]


def reentrant():
    if not _reentrant_engine:
        _reentrant_engine.append(pyengine.Engine(max_recursion_depth=2, max_pool_threads=4))
    x = Leaf(np.ones(()))
    _reentrant_engine[0].execute([pyengine.Edge(Reenter(4, x), 0)], [np.ones(())],
                                 False, False, True)
    return x.grad, np.float64(5.0)


def devices():
    """A chain across two fake devices and the CPU: each node on its device's
    worker thread, the main thread waiting for them."""
    fake0, fake1 = fake_device.device(0), fake_device.device(1)

    class To(pyengine.Node):
        def __init__(self, edge, device, input_device):
            super().__init__([edge], [pyengine.InputMetadata(SHAPE, np.float64, device)])
            self.input_device = input_device

        def apply(self, grads):
            host = grads[0].numpy() if isinstance(grads[0], fake_device.FakeArray) else grads[0]
            host = host * 2.0
            if self.input_device == pyengine.device.CPU:
                return [host]
            return [fake_device.to_fake(host, self.input_device)]

    x = Leaf(np.ones(SHAPE))
    on_cpu = To(pyengine.gradient_edge(x), pyengine.device.CPU, pyengine.device.CPU)
    on_fake0 = To(pyengine.Edge(on_cpu, 0), fake0, pyengine.device.CPU)
    on_fake1 = To(pyengine.Edge(on_fake0, 0), fake1, fake0)
    pyengine.backward([pyengine.Edge(on_fake1, 0)], [fake_device.to_fake(np.ones(SHAPE), fake1)])
    return x.grad, np.full(SHAPE, 8.0)


# -- the mode contexts --------------------------------------------------------------

@pyengine.no_grad()
def _decorated():
    return pyengine.is_grad_enabled()


@pyengine.enable_grad()
def _decorated_generator():
    yield pyengine.is_grad_enabled()
    yield pyengine.is_grad_enabled()


def modes():
    """Every mode context around blocks, and as decorators, and a backward
    under anomaly mode with a node that needs it."""
    seen = []
    with pyengine.no_grad():
        seen.append(pyengine.is_grad_enabled())
        with pyengine.enable_grad():
            seen.append(pyengine.is_grad_enabled())
        seen.append(pyengine.is_grad_enabled())
    with pyengine.set_grad_enabled(False):
        seen.append(pyengine.is_grad_enabled())
    seen.append(_decorated())
    with pyengine.no_grad():
        seen.extend(_decorated_generator())
    with pyengine.set_multithreading_enabled(False):
        seen.append(pyengine.is_multithreading_enabled())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        detect = pyengine.detect_anomaly()
    x = Leaf(np.ones(SHAPE))
    with detect:
        seen.append(pyengine.is_anomaly_enabled())
        pyengine.backward([pyengine.Edge(diamond(x), 0)], [np.ones(SHAPE)])
    with pyengine.set_detect_anomaly(True):
        seen.append(pyengine.is_anomaly_enabled())
    return (seen, x.grad), ([False, True, False, False, False, True, True, False, True, True],
                            np.full(SHAPE, 6.0))


# -- the frontend ---------------------------------------------------------------------

def frontend_training_step():
    """An MLP's forward, backward and SGD step, the step under no_grad."""
    rng = np.random.default_rng(0)
    model = F.nn.MLP([2, 3, 2], rng=rng)
    optimizer = F.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inputs = F.tensor(np.linspace(-1.0, 1.0, 8).reshape(4, 2))
    labels = F.tensor(np.array([0, 1, 1, 0]))
    for _ in range(2):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
    return [p.data.copy() for p in model.parameters()], None


def frontend_checkpoint_and_second_order():
    x = F.tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = F.checkpoint(lambda t: (t * t).exp(), x)
    y.sum().backward()
    first = x.grad.data.copy()
    x.grad = None
    (g,) = F.grad((x * x * x).sum(), [x], create_graph=True)
    g.sum().backward()
    return (first, x.grad.data), (2.0 * np.array([1.0, 2.0]) * np.exp([1.0, 4.0]),
                                  6.0 * np.array([1.0, 2.0]))


SCENARIOS = {
    "backward with hooks": backward_with_hooks,
    "grad of inputs": grad_of_inputs,
    "profiled": profiled,
    "reentrant": reentrant,
    "devices": devices,
    "modes": modes,
    "frontend training step": frontend_training_step,
    "frontend checkpoint and second order": frontend_checkpoint_and_second_order,
}


# Scenarios whose result has no closed form here: checked against an
# uninterrupted run's.
NO_CLOSED_FORM = {"frontend training step"}


def _same(got, expected) -> bool:
    if isinstance(expected, (tuple, list)):
        return (isinstance(got, (tuple, list)) and len(got) == len(expected)
                and all(_same(g, e) for g, e in zip(got, expected)))
    if expected is None or isinstance(expected, str):
        return got == expected
    return got is not None and np.shape(got) == np.shape(expected) and np.allclose(
        np.asarray(got, dtype=float), expected, rtol=1e-12, atol=0)


def run(name: str, timeout: float = 20.0) -> dict:
    """Sweep scenario ``name``; its report: the places, and per failing place
    what was wrong."""
    scenario = SCENARIOS[name]
    reference = []
    if name in NO_CLOSED_FORM:
        # Its uninterrupted result, from before the sweep forks (its
        # children inherit it); such a scenario starts no thread.
        reference.append(scenario()[0])
        del _leaves[:]
    # The sweep forks: no thread may run.
    assert threading.active_count() == 1, threading.enumerate()

    def check():
        problems = state_problems()
        for leaf in _leaves:
            state = getattr(leaf, "_pyengine_leaf", None)
            if state is not None and state.lock.held():
                problems.append("a leaf's .grad lock left held")
        del _leaves[:]
        try:
            got, expected = scenario()
            if expected is None:
                expected = reference[0]
            if not _same(got, expected):
                problems.append(f"the clean run after it gave {got!r}, expected {expected!r}")
        except BaseException as error:
            problems.append(f"the clean run after it raised {type(error).__name__}: {error}"[:300])
        return problems + state_problems()

    places, failures = sweep(scenario, check, timeout=timeout)
    return {"places": places, "failures": failures}
