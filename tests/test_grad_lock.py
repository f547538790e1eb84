"""The lock of a leaf's ``.grad`` (LeafState.lock, a GradLock), in both
cores: See Note [The lock of a leaf's .grad] in pyengine/_pure/node.py.

Oracles: the exact gradient of a chain after every accumulation; the lock's
own answers (taken again, released by a thread that does not hold it) as
the Note states them; Ctrl-C reaching a thread that waits for it.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import numpy as np
import pytest
from conftest import signals_not_swallowed

import pyengine
from pyengine.bench import graphs
from pyengine.node import leaf_state


class ReentrantLeaf(graphs.Leaf):
    """A leaf whose ``.grad`` setter runs a backward into the same leaf,
    once: Python code that runs under the leaf's lock."""

    def __init__(self, data):
        self.graph = None
        self.reenter = False
        super().__init__(data)

    @property
    def grad(self):
        return self.__dict__.get("_grad")

    @grad.setter
    def grad(self, value):
        if self.reenter and value is not None:
            self.reenter = False
            pyengine.get_default_engine().execute([self.graph.root_edge], [self.graph.grad],
                                                  False, False, True)
        self.__dict__["_grad"] = value


def chain_onto(leaf, nodes=2):
    """A chain of ``nodes`` Pass nodes into ``leaf``, and its root gradient."""
    metadata = pyengine.InputMetadata(graphs.SHAPE, graphs.DTYPE)
    edge = pyengine.gradient_edge(leaf)
    for _ in range(nodes):
        edge = pyengine.Edge(graphs.Pass(next_edges=(edge,), input_metadata=(metadata,)), 0)
    return edge


def test_an_accumulation_into_the_leaf_it_accumulates_into_raises_and_leaves_the_lock_free():
    leaf = ReentrantLeaf(np.zeros(graphs.SHAPE, graphs.DTYPE))
    root = chain_onto(leaf)
    grad = np.ones(graphs.SHAPE, graphs.DTYPE)
    leaf.graph = type("G", (), {"root_edge": root, "grad": grad})
    leaf.reenter = True
    with pytest.raises(RuntimeError, match="asked for a leaf's .grad lock while it held it"):
        pyengine.get_default_engine().execute([root], [grad], True, False, True)
    assert leaf.grad is None  # the setter raised before it stored anything
    assert not leaf_state(leaf).lock.held()
    # The lock is free: the same graph accumulates again, exactly.
    pyengine.get_default_engine().execute([root], [grad], False, False, True)
    np.testing.assert_array_equal(leaf.grad, np.ones(graphs.SHAPE))


def test_only_its_holder_releases_it():
    lock = leaf_state(graphs.Leaf(np.zeros(3))).lock
    with pytest.raises(RuntimeError, match="this thread does not hold"):
        lock.release()
    held, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    with pytest.raises(RuntimeError, match="this thread does not hold"):
        lock.release()
    assert not lock.held()  # another thread holds it
    done.set()
    holder.join(30)
    assert lock.acquire() is True and lock.held()
    with pytest.raises(RuntimeError, match="asked for a leaf's .grad lock while it held it"):
        lock.acquire()
    lock.release()
    assert not lock.held()



def test_a_with_block_that_let_go_of_the_lock_itself_is_refused_at_its_end():
    # Both cores refuse the block's release of a lock it no longer holds
    # (the twin's words are the RLock's own: See Note [An interrupt in the
    # twin's GradLock] in pyengine/_pure/node.py), and the lock is free.
    lock = leaf_state(graphs.Leaf(np.zeros(3))).lock
    with pytest.raises(RuntimeError, match="this thread does not hold|un-acquired lock"):
        with lock:
            lock.release()
    assert not lock.held()
    assert _free_for_another_thread(lock)

def test_threads_that_accumulate_into_one_leaf_add_every_gradient():
    # Large arrays: numpy lets go of the GIL in their adds, under the lock,
    # so the threads meet at it.
    shape = (200_000,)
    leaf = graphs.Leaf(np.zeros(shape))
    metadata = pyengine.InputMetadata(shape, np.float64)
    roots = [pyengine.Edge(graphs.Pass(next_edges=(pyengine.gradient_edge(leaf),),
                                       input_metadata=(metadata,)), 0) for _ in range(2)]
    calls, failures = 40, []

    def run(root):
        try:
            for _ in range(calls):
                pyengine.get_default_engine().execute([root], [np.ones(shape)], True, False, True)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            failures.append(error)

    threads = [threading.Thread(target=run, args=(root,)) for root in roots]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    np.testing.assert_array_equal(leaf.grad, np.full(shape, 2.0 * calls))


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_ctrl_c_reaches_a_thread_that_waits_for_it():
    assert threading.current_thread() is threading.main_thread()
    lock = leaf_state(graphs.Leaf(np.zeros(3))).lock
    held, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            time.sleep(0.2)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            done.wait(30)

    # SIGINT as Ctrl-C gives it, even in a background job: See
    # signals_not_swallowed in conftest.py.
    with signals_not_swallowed():
        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(30)
        start = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                with lock:
                    pytest.fail("took a lock another thread holds")
            assert time.monotonic() - start < 10
            assert not lock.held()
        finally:
            done.set()
            holder.join(30)
    with lock:
        assert lock.held()


def _free_for_another_thread(lock, timeout=10.0):
    """Whether another thread takes and lets go of ``lock`` within ``timeout``."""
    def take():
        with lock:
            pass

    other = threading.Thread(target=take, daemon=True)  # stuck for good where the lock is
    other.start()
    other.join(timeout)
    return not other.is_alive()


def _interrupted_at_line(n, codes, action):
    """Run ``action()`` with KeyboardInterrupt raised at the ``n``-th line
    that this thread runs in a frame of ``codes``; whether it was raised."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code in codes else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        action()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(previous)
    return False


@pytest.mark.parametrize("scenario", ["a with block", "an accumulation"])
def test_an_interrupt_at_any_line_of_the_twins_grad_lock_leaves_it_free(scenario):
    # Ctrl-C comes out of the twin's Python code between its steps: at each
    # line its GradLock runs, in a with block and in AccumulateGrad's, the
    # lock is free for another thread after the interrupt, and the leaf's
    # .grad is the gradient or nothing. (Lines of the code around the lock,
    # not its own, are left out: a trace function sees a line event where a
    # with block's exit starts, a place where CPython 3.11 runs no signal
    # handler.) See Note [An
    # interrupt in the twin's GradLock] in pyengine/_pure/node.py.
    from pyengine._pure import node as twin

    if scenario == "an accumulation" and pyengine.IMPLEMENTATION != "pure":
        pytest.skip("the twin's AccumulateGrad runs on the twin's engine only")
    # The code of every method (and property getter) of the twin's GradLock.
    codes = {getattr(member.fget if isinstance(member, property) else member, "__code__", None)
             for member in vars(twin.GradLock).values()} - {None}
    grad = np.ones(graphs.SHAPE, graphs.DTYPE)
    for n in range(1, 200):
        if scenario == "a with block":
            lock = twin.GradLock()

            def action(lock=lock):
                with lock:
                    pass
        else:
            leaf = graphs.Leaf(np.zeros(graphs.SHAPE, graphs.DTYPE))
            lock, root = leaf_state(leaf).lock, chain_onto(leaf)

            def action(root=root):
                pyengine.get_default_engine().execute([root], [grad], False, False, True)
        interrupted = _interrupted_at_line(n, codes, action)
        assert not lock.held(), n
        assert _free_for_another_thread(lock), f"the lock stayed taken after line {n}"
        if scenario == "an accumulation":
            assert leaf.grad is None or (leaf.grad == grad).all(), (n, leaf.grad)
        if not interrupted:
            break
    assert 3 < n < 199
