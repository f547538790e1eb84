"""queue_callback and is_checkpoint_valid.

Oracles: the order in which logging nodes and callbacks run (a callback runs
once, after every node of its backward pass), and PyTorch's
``Variable._execution_engine.queue_callback`` / ``_is_checkpoint_valid`` on
the same graph.
"""

import numpy as np
import pytest
from conftest import tap
from minitensor import leaf

import pyengine

OUTSIDE = "Final callbacks can only be installed during backward pass."


def test_queue_callback_outside_backward_raises():
    with pytest.raises(RuntimeError, match=OUTSIDE):
        pyengine.queue_callback(lambda: None)


def test_queue_callback_outside_backward_raises_after_a_backward():
    x = leaf([1.0])
    (x * 2.0).sum().backward()
    with pytest.raises(RuntimeError, match=OUTSIDE):
        pyengine.queue_callback(lambda: None)


def test_callback_runs_once_after_all_nodes():
    log = []
    x = leaf([1.0, 2.0])
    x.register_post_accumulate_grad_hook(lambda t: log.append("acc"))
    a, _ = tap(x * 2.0, tag="a", log=log)
    b, b_node = tap(a * 3.0, tag="b", log=log)
    b_node.register_prehook(lambda grads: pyengine.queue_callback(lambda: log.append("cb")))
    (b * 1.0).sum().backward()
    assert log == ["b", "a", "acc", "cb"]


def test_callback_sees_leaf_gradients():
    x = leaf([1.0, 2.0])
    seen = []
    h = x * 3.0
    h.register_hook(lambda g: pyengine.queue_callback(lambda: seen.append(x.grad.copy())))
    h.sum().backward()
    np.testing.assert_array_equal(seen[0], [3.0, 3.0])


def test_callback_may_queue_more_callbacks():
    log = []

    def second():
        log.append("second")
        pyengine.queue_callback(lambda: log.append("third"))

    def first():
        log.append("first")
        pyengine.queue_callback(second)

    x = leaf([1.0])
    h, node = tap(x * 2.0, tag="node", log=log)
    node.register_prehook(lambda grads: pyengine.queue_callback(first))
    h.register_hook(lambda g: pyengine.queue_callback(lambda: log.append("other")))
    h.sum().backward()
    # FIFO: both callbacks queued during the pass run first, then those they queued.
    assert log == ["node", "other", "first", "second", "third"]


def test_callback_order_matches_torch(torch):
    from torch.autograd import Variable

    def run(backend_queue, h, make_root, log):
        def first():
            log.append("first")
            backend_queue(lambda: log.append("nested"))

        h.register_hook(lambda g: (backend_queue(first), backend_queue(lambda: log.append("2nd")),
                                   log.append("hook"))[-1])
        make_root().backward()

    log, torch_log = [], []
    x = leaf([1.0])
    h = x * 2.0
    run(pyengine.queue_callback, h, lambda: (h * h).sum(), log)
    tx = torch.tensor([1.0], requires_grad=True)
    th = tx * 2.0
    run(Variable._execution_engine.queue_callback, th, lambda: (th * th).sum(), torch_log)
    assert log == torch_log


def test_callbacks_belong_to_their_backward_call():
    calls = []
    x = leaf([1.0])
    h = x * 2.0
    handle = h.register_hook(lambda g: pyengine.queue_callback(lambda: calls.append(1)))
    y = h.sum()
    y.backward(retain_graph=True)
    assert calls == [1]
    handle.remove()
    y.backward()
    assert calls == [1]


def test_callback_during_grad():
    calls = []
    x = leaf([1.0, 2.0])
    h = x * 2.0
    h.register_hook(lambda g: pyengine.queue_callback(lambda: calls.append(g.copy())))
    (gx,) = pyengine.grad(h.sum(), x)
    np.testing.assert_array_equal(gx, [2.0, 2.0])
    assert len(calls) == 1
    np.testing.assert_array_equal(calls[0], [1.0, 1.0])


def test_exception_in_callback_reaches_caller():
    x = leaf([1.0])
    h = x * 2.0

    def bad():
        raise LookupError("from callback")

    h.register_hook(lambda g: pyengine.queue_callback(bad))
    with pytest.raises(LookupError, match="from callback"):
        h.sum().backward()
    np.testing.assert_array_equal(x.grad, [2.0])  # every node ran before the callback


def test_callbacks_do_not_run_after_a_node_error():
    calls = []
    x = leaf([1.0])
    b, b_node = tap(x * 2.0)
    c, c_node = tap(b)
    # c runs first and queues a callback; then b fails: the callback never runs.
    c_node.register_prehook(lambda grads: pyengine.queue_callback(lambda: calls.append(1)))
    b_node.register_prehook(lambda grads: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        c.sum().backward()
    assert calls == []
    assert x.grad is None


# -- is_checkpoint_valid -------------------------------------------------------------

class Probe(pyengine.Node):
    def __init__(self, x, log):
        super().__init__(next_edges=[pyengine.gradient_edge(x)], input_metadata=[x.data])
        self.log = log

    def apply(self, grads):
        self.log.append(pyengine.is_checkpoint_valid())
        return [grads[0]]


def probe(x, log):
    from minitensor import T

    out = T(x.data)
    out.grad_fn, out.requires_grad = Probe(x, log), True
    return out


def test_is_checkpoint_valid():
    assert pyengine.is_checkpoint_valid()
    log = []
    x = leaf([1.0])
    y = (probe(x, log) * 2.0).sum()
    y.backward(retain_graph=True)
    pyengine.grad(y, x, retain_graph=True)
    y.backward(inputs=[x])
    assert log == [True, False, False]
    assert pyengine.is_checkpoint_valid()


def test_is_checkpoint_valid_matches_torch(torch):
    class TorchProbe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            torch_log.append(torch.autograd._is_checkpoint_valid())
            return g

    torch_log = []
    tx = torch.tensor([1.0], requires_grad=True)
    ty = (TorchProbe.apply(tx) * 2.0).sum()
    ty.backward(retain_graph=True)
    torch.autograd.grad(ty, tx, retain_graph=True)
    ty.backward(inputs=[tx])

    log = []
    x = leaf([1.0])
    y = (probe(x, log) * 2.0).sum()
    y.backward(retain_graph=True)
    pyengine.grad(y, x, retain_graph=True)
    y.backward(inputs=[x])
    assert log == torch_log


def test_is_checkpoint_valid_in_callback_of_grad(torch):
    # PyTorch sets it only around a node's call (CheckpointValidGuard in
    # call_function): a final callback of grad() sees True.
    from torch.autograd import Variable

    def run(queue_callback, is_valid, x, seen):
        h = x * 2.0
        h.register_hook(lambda g: queue_callback(lambda: seen.append(is_valid())))
        return h.sum()

    seen, torch_seen = [], []
    x = leaf([1.0])
    pyengine.grad(run(pyengine.queue_callback, pyengine.is_checkpoint_valid, x, seen), x)
    tx = torch.tensor([1.0], requires_grad=True)
    torch.autograd.grad(run(Variable._execution_engine.queue_callback,
                            torch.autograd._is_checkpoint_valid, tx, torch_seen), tx)
    assert seen == torch_seen
    assert pyengine.is_checkpoint_valid()
