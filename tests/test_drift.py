"""Where both cores had drifted from PyTorch 2.x (issue 17, item 5).

- ``is_checkpoint_valid`` in a backward nested in a node of ``grad()``:
  ANDed with the enclosing task's (See Note [Checkpoint valid in nested
  backward] in pyengine/_pure/state.py). Oracle: PyTorch on the same nesting.
- An InputBuffer keeps no device (See Note [InputBuffer has no device] in
  pyengine/_pure/input_buffer.py); a node's task goes where its metadata
  says. Oracle: PyTorch 2.x's InputBuffer has no device; the worker thread
  that ran the node.
- A node that got some of its gradients but never ran fails the backward
  with PyTorch's "could not compute gradients for some functions" (See Note
  [Gradients left in not ready] in pyengine/_pure/graph_task.py). Oracle:
  the gradients the graph's edges deliver, counted by hand.
- A backend registered over numpy's sees every numpy sum and check, in both
  cores (See Note [Replacing the numpy backend] in pyengine/backends.py).
  Oracle: what the built-in numpy backend computes, and the calls the graph
  must make, counted by hand.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from minitensor import T, leaf

import pyengine
from pyengine import backends
from pyengine._core import InputBuffer

# -- is_checkpoint_valid in nested backward --------------------------------------------

class Probe(pyengine.Node):
    """Records is_checkpoint_valid() under ``label``, then, if ``nested`` is
    given, runs ``nested()`` (a backward of its own) and records again."""

    def __init__(self, x, log, label, nested=None):
        super().__init__(next_edges=[pyengine.gradient_edge(x)], input_metadata=[x.data])
        self.log, self.label, self.nested = log, label, nested

    def apply(self, grads):
        self.log.append((self.label, pyengine.is_checkpoint_valid()))
        if self.nested is not None:
            self.nested()
            self.log.append((self.label + " after", pyengine.is_checkpoint_valid()))
        return [grads[0]]


def probed(x, log, label, nested=None):
    out = T(x.data.copy())
    out.grad_fn, out.requires_grad = Probe(x, log, label, nested), True
    return out


def pyengine_nesting(outer_call):
    """A node of an outer backward (``outer_call``: "backward" or "grad") runs
    a plain backward whose node runs another plain backward."""
    log = []

    def innermost():
        with pyengine.enable_grad():
            y = leaf([3.0])
            probed(y, log, "inner 2").sum().backward()

    def inner():
        with pyengine.enable_grad():
            y = leaf([2.0])
            probed(y, log, "inner 1", innermost).sum().backward()

    x = leaf([1.0])
    out = probed(x, log, "outer", inner).sum()
    if outer_call == "grad":
        pyengine.grad(out, x)
    else:
        out.backward()
    return log


def torch_nesting(torch, outer_call):
    log = []

    def make_probe(label, nested):
        class TorchProbe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.clone()

            @staticmethod
            def backward(ctx, g):
                log.append((label, torch.autograd._is_checkpoint_valid()))
                if nested is not None:
                    nested()
                    log.append((label + " after", torch.autograd._is_checkpoint_valid()))
                return g
        return TorchProbe

    def innermost():
        with torch.enable_grad():
            y = torch.tensor([3.0], requires_grad=True)
            make_probe("inner 2", None).apply(y).sum().backward()

    def inner():
        with torch.enable_grad():
            y = torch.tensor([2.0], requires_grad=True)
            make_probe("inner 1", innermost).apply(y).sum().backward()

    x = torch.tensor([1.0], requires_grad=True)
    out = make_probe("outer", inner).apply(x).sum()
    if outer_call == "grad":
        torch.autograd.grad(out, x)
    else:
        out.backward()
    return log


@pytest.mark.parametrize("outer_call", ["grad", "backward"])
def test_checkpoint_valid_in_backward_nested_in_grad_matches_torch(torch, outer_call):
    expected = torch_nesting(torch, outer_call)
    # PyTorch 2.13: False all the way down under grad(), True under backward().
    assert {valid for _, valid in expected} == {outer_call == "backward"}
    assert pyengine_nesting(outer_call) == expected
    assert pyengine.is_checkpoint_valid()


# -- InputBuffer has no device -------------------------------------------------------------

def test_input_buffer_keeps_no_device():
    # PyTorch 2.x's InputBuffer has buffer and stream fields, no device.
    buffer = InputBuffer(2)
    buffer.add(0, np.ones(2), False)
    assert not hasattr(buffer, "device")
    assert buffer.buffer[0].tolist() == [1.0, 1.0] and buffer.buffer[1] is None


# -- gradients left in not_ready ------------------------------------------------------------

class Passing(pyengine.Node):
    """Returns its one gradient along each edge (None along ``none_edges``);
    runs ``before()`` first if given; records its name in ``ran``."""

    def __init__(self, next_edges, ran, name, before=None, none_edges=()):
        super().__init__(next_edges=next_edges, input_metadata=[np.zeros(1)])
        self.ran, self.label, self.before, self.none_edges = ran, name, before, none_edges

    def apply(self, grads):
        self.ran.append(self.label)
        if self.before is not None:
            self.before()
        return [None if i in self.none_edges else grads[0] for i in range(len(self.next_edges))]

    def name(self):
        return self.label


def diamond(drop_edge, a_returns_none=False):
    """root -> A, root -> B, A -> C, B -> C, C -> leaf x. A runs first (made
    later) and, with ``drop_edge``, takes B's edge to C away before B runs:
    C gets A's gradient (a None one with ``a_returns_none``) and waits for
    B's forever."""
    ran = []
    x = leaf([0.0])
    c = Passing([pyengine.gradient_edge(x)], ran, "C")
    b = Passing([pyengine.Edge(c, 0)], ran, "B")

    def drop_b_edge():
        if drop_edge:
            b.next_edges = [None]

    a = Passing([pyengine.Edge(c, 0)], ran, "A", before=drop_b_edge,
                none_edges=(0,) if a_returns_none else ())
    root = Passing([pyengine.Edge(a, 0), pyengine.Edge(b, 0)], ran, "root")
    return root, x, ran


@pytest.mark.parametrize("a_returns_none", [False, True])
def test_node_left_waiting_for_a_gradient_fails_backward(a_returns_none):
    root, x, ran = diamond(drop_edge=True, a_returns_none=a_returns_none)
    callbacks = []

    class Queue(pyengine.Node):
        # The root's own root, so that a final callback is queued first.
        def apply(self, grads):
            pyengine.queue_callback(lambda: callbacks.append("ran"))
            return [grads[0]]

    top = Queue(next_edges=[pyengine.Edge(root, 0)], input_metadata=[np.zeros(1)])
    with pytest.raises(RuntimeError, match=r"^could not compute gradients for some functions: "
                                            r"1 node got some of their gradients but not all"):
        pyengine.get_default_engine().execute([pyengine.Edge(top, 0)], [np.ones(1)],
                                              False, False, True)
    # C never ran, x got nothing, and no final callback ran (as PyTorch's
    # exec_post_processing checks before its callbacks).
    assert ran == ["root", "A", "B"]
    assert x.grad is None
    assert callbacks == []


def test_diamond_without_the_change_runs_every_node():
    # The control: 1 + 1 reaches x through C.
    root, x, ran = diamond(drop_edge=False)
    pyengine.get_default_engine().execute([pyengine.Edge(root, 0)], [np.ones(1)],
                                          False, False, True)
    assert ran == ["root", "A", "B", "C"]
    assert x.grad.tolist() == [2.0]


def test_node_no_gradient_reached_is_not_an_error():
    # B's edge into C goes before any gradient reached C: C has no buffer,
    # and PyTorch does not complain about it either (only about buffers).
    ran = []
    x = leaf([0.0])
    c = Passing([pyengine.gradient_edge(x)], ran, "C")
    b = Passing([pyengine.Edge(c, 0)], ran, "B")

    def drop_b_edge():
        b.next_edges = [None]

    a = Passing([pyengine.Edge(b, 0)], ran, "A", before=drop_b_edge)
    pyengine.get_default_engine().execute([pyengine.Edge(a, 0)], [np.ones(1)], False, False, True)
    assert ran == ["A", "B"]
    assert x.grad is None


# -- a backend registered over numpy's ------------------------------------------------------

class RecordingNumpyBackend(backends.NumpyBackend):
    """The built-in numpy backend's arithmetic, recording each call."""

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def _record(self, name):
        with self.lock:
            self.calls.append(name)


for _name in ("shape", "dtype", "device", "add", "add_", "copy", "sum_to", "cast"):
    def _recording(self, *args, _name=_name):
        self._record(_name)
        return getattr(backends.NumpyBackend, _name)(self, *args)
    setattr(RecordingNumpyBackend, _name, _recording)


@pytest.fixture
def recording_numpy_backend():
    backend = RecordingNumpyBackend()
    pyengine.register_backend(np.ndarray, backend)
    try:
        yield backend
    finally:
        pyengine.register_backend(np.ndarray, backends.NUMPY)


def fan_in(x):
    """x feeds two nodes whose gradients meet in one InputBuffer (x * 2 + x * 3)."""
    from minitensor import add, mul
    return add(mul(x, 2.0), mul(x, 3.0)).sum()


def test_replaced_numpy_backend_sums_and_checks_every_gradient(recording_numpy_backend):
    x = leaf([1.0, 2.0])
    fan_in(x).backward()
    assert x.grad.tolist() == [5.0, 5.0]
    calls = recording_numpy_backend.calls
    # The two gradients into x's AccumulateGrad are summed once, out of place
    # (See Note [InputBuffer ownership]); validate_outputs checks each numpy
    # gradient's shape, dtype and device.
    assert calls.count("add") == 1
    assert calls.count("shape") >= 4 and calls.count("dtype") >= 4
    assert "add_" not in calls


def test_replaced_numpy_backend_accumulates_into_grad(recording_numpy_backend):
    x = leaf([1.0, 2.0])
    fan_in(x).backward()
    recording_numpy_backend.calls.clear()
    fan_in(x).backward()
    assert x.grad.tolist() == [10.0, 10.0]
    # The second backward adds into the .grad pyengine owns, in place.
    assert recording_numpy_backend.calls.count("add_") == 1


def test_builtin_numpy_backend_back_after_replacement():
    backend = RecordingNumpyBackend()
    pyengine.register_backend(np.ndarray, backend)
    pyengine.register_backend(np.ndarray, backends.NUMPY)
    x = leaf([1.0, 2.0])
    fan_in(x).backward()
    assert x.grad.tolist() == [5.0, 5.0]
    assert backend.calls == []
