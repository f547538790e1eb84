"""Threads that walk owner graphs into shared leaves, in both cores: each
leaf's accumulation holds a lock of that leaf's. See Note [An owner leaf
accumulates under a lock] in pyengine/_pure/owner_graph.py.

Before, two threads that accumulated into one leaf at once each read the
leaf's gradient, added their own and wrote the sum: one of the two was
lost (with the default accumulate and large arrays, about half of them).

Oracles: the exact sum of every walk's gradient in each leaf (every
gradient a small integer, exact in float64); the refusal's words where an
accumulation starts another into its own leaf; Ctrl-C reaching a thread
that waits for a leaf; no lock left in the cores' tables after the walks.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import warnings

import numpy as np
import pytest
from conftest import RandomInterrupts, in_a_fork_while, random_interrupts_need_3_10, signals_not_swallowed

from pyengine._pure import owner_graph as pure_owner_graph
from pyengine._pure import state as pure_state

try:
    from pyengine import _owner_graph as compiled_owner_graph
    from pyengine import _state as compiled_state
except ImportError:  # the twin alone, without a build
    compiled_owner_graph = compiled_state = None

WAIT_S = 30.0


def owner_graph_module(core):
    """The OwnerGraph module of ``core``; skips where the compiled one is not built."""
    if core == "compiled" and compiled_owner_graph is None:
        pytest.skip("no compiled build")
    return compiled_owner_graph if core == "compiled" else pure_owner_graph


class Value:
    """An owner of a framework's own graph: its parents and a gradient."""

    def __init__(self, *parents):
        self.parents = list(parents)
        self.grad = None


def passes_on(owner, grads):
    """Returns mode's backward: the owner's gradient to each of its parents."""
    return [grads[0]] * len(owner.parents)


def slow_accumulate(leaf, gradient):
    """``leaf.grad += gradient`` in two steps, letting other threads run
    between the read and the write: where two threads accumulate into one
    leaf at once without a lock, one of the two sums is lost."""
    old = leaf.grad
    time.sleep(0.001)
    leaf.grad = gradient if old is None else old + gradient


def in_threads(*targets):
    """Run each target on a thread of its own; re-raise the first error."""
    errors = []

    def guarded(target):
        def run():
            try:
                target()
            except BaseException as error:  # noqa: BLE001 - re-raised on the test's thread
                errors.append(error)
        return run

    threads = [threading.Thread(target=guarded(target)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 2)
        assert not thread.is_alive(), "a thread did not end (a hang)"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("core", ["compiled", "pure"])
@pytest.mark.parametrize("accumulate, shape, walks",
                         [(None, (200_000,), 40), (slow_accumulate, (3,), 25)],
                         ids=["the default accumulate", "an accumulate that lets threads run"])
def test_threads_that_walk_into_one_leaf_add_every_gradient(core, accumulate, shape, walks):
    module = owner_graph_module(core)
    graph = module.OwnerGraph("parents", passes_on, mode="returns", accumulate=accumulate)
    shared, own = Value(), [Value(), Value(), Value()]

    def walker(k):
        def run():
            for _ in range(walks):
                # A chain of two owners into the shared leaf and this thread's own.
                graph.backward(Value(Value(shared, own[k])), np.ones(shape))
        return run

    in_threads(*(walker(k) for k in range(3)))
    np.testing.assert_array_equal(shared.grad, np.full(shape, 3.0 * walks))
    for leaf in own:
        np.testing.assert_array_equal(leaf.grad, np.full(shape, float(walks)))
    assert module.leaf_locks_in_use() == 0


@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_an_accumulation_into_its_own_leaf_is_refused_and_frees_the_lock(core):
    module = owner_graph_module(core)
    reenter = [True]

    def accumulate(leaf, gradient):
        if reenter[0]:
            reenter[0] = False
            graph.backward(Value(leaf), np.ones(3))  # the same leaf, on this thread
        slow_accumulate(leaf, gradient)

    graph = module.OwnerGraph("parents", passes_on, mode="returns", accumulate=accumulate)
    leaf, other = Value(), Value()
    with pytest.raises(RuntimeError, match="asked for the accumulation lock of a Value while it "
                                           "held it"):
        graph.backward(Value(leaf), np.ones(3))
    assert leaf.grad is None
    assert module.leaf_locks_in_use() == 0
    # The lock is free: the leaf accumulates again, exactly; an accumulation
    # into another leaf from inside one is no accumulation into its own.
    graph.backward(Value(leaf), np.ones(3))
    np.testing.assert_array_equal(leaf.grad, np.ones(3))

    def into_other(accumulated, gradient):
        if accumulated is leaf:
            graph_other.backward(Value(other), np.full(3, 2.0))
        slow_accumulate(accumulated, gradient)

    graph_other = module.OwnerGraph("parents", passes_on, mode="returns", accumulate=into_other)
    graph_other.backward(Value(leaf), np.ones(3))
    np.testing.assert_array_equal(leaf.grad, np.full(3, 2.0))
    np.testing.assert_array_equal(other.grad, np.full(3, 2.0))
    assert module.leaf_locks_in_use() == 0


@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_accumulations_into_different_leaves_do_not_wait_for_each_other(core):
    # The first thread's accumulation into its leaf waits, holding that
    # leaf's lock, until the second thread's walk into another leaf has
    # ended: a lock for all leaves would leave both waiting.
    module = owner_graph_module(core)
    first_holds, second_done = threading.Event(), threading.Event()

    def accumulate(leaf, gradient):
        if leaf is first_leaf:
            first_holds.set()
            assert second_done.wait(WAIT_S), "the other leaf's walk waited for this one"
        slow_accumulate(leaf, gradient)

    graph = module.OwnerGraph("parents", passes_on, mode="returns", accumulate=accumulate)
    first_leaf, second_leaf = Value(), Value()

    def first():
        graph.backward(Value(first_leaf), np.ones(3))

    def second():
        assert first_holds.wait(WAIT_S)
        assert module.leaf_locks_in_use() == 1
        graph.backward(Value(second_leaf), np.full(3, 2.0))
        second_done.set()

    in_threads(first, second)
    np.testing.assert_array_equal(first_leaf.grad, np.ones(3))
    np.testing.assert_array_equal(second_leaf.grad, np.full(3, 2.0))
    assert module.leaf_locks_in_use() == 0


@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_an_error_in_accumulate_frees_the_lock(core):
    module = owner_graph_module(core)
    fail = [True]

    def accumulate(leaf, gradient):
        if fail[0]:
            fail[0] = False
            raise ValueError("the framework's accumulate fails")
        slow_accumulate(leaf, gradient)

    graph = module.OwnerGraph("parents", passes_on, mode="returns", accumulate=accumulate)
    leaf = Value()
    with pytest.raises(ValueError, match="the framework's accumulate fails"):
        graph.backward(Value(leaf), np.ones(3))
    assert module.leaf_locks_in_use() == 0
    in_threads(lambda: graph.backward(Value(leaf), np.ones(3)))
    np.testing.assert_array_equal(leaf.grad, np.ones(3))


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_ctrl_c_reaches_a_thread_that_waits_for_a_leaf(core):
    assert threading.current_thread() is threading.main_thread()
    module = owner_graph_module(core)
    holds, done = threading.Event(), threading.Event()

    def accumulate(leaf, gradient):
        if threading.current_thread() is not threading.main_thread():
            holds.set()
            time.sleep(0.2)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            assert done.wait(WAIT_S)
        slow_accumulate(leaf, gradient)

    graph = module.OwnerGraph("parents", passes_on, mode="returns", accumulate=accumulate)
    leaf = Value()
    # SIGINT as Ctrl-C gives it, even in a background job: See
    # signals_not_swallowed in conftest.py.
    with signals_not_swallowed():
        holder = threading.Thread(target=lambda: graph.backward(Value(leaf), np.ones(3)))
        holder.start()
        try:
            assert holds.wait(WAIT_S)
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                graph.backward(Value(leaf), np.full(3, 2.0))
            assert time.monotonic() - start < WAIT_S / 3
            assert module.leaf_locks_in_use() == 1  # the holder's
        finally:
            done.set()
            holder.join(WAIT_S)
    assert not holder.is_alive()
    np.testing.assert_array_equal(leaf.grad, np.ones(3))
    assert module.leaf_locks_in_use() == 0
    graph.backward(Value(leaf), np.full(3, 2.0))
    np.testing.assert_array_equal(leaf.grad, np.full(3, 3.0))


@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_the_table_holds_the_accumulations_in_flight_and_no_more(core):
    # An entry lives while its accumulation runs and goes with it: inside
    # accumulate the table holds the one leaf's, after the walks none, however
    # many leaves were accumulated into (a process that walked into leaves
    # once keeps nothing for them).
    module = owner_graph_module(core)
    in_flight = []

    def accumulate(leaf, gradient):
        in_flight.append(module.leaf_locks_in_use())
        slow_accumulate(leaf, gradient)

    graph = module.OwnerGraph("parents", passes_on, mode="returns", accumulate=accumulate)
    leaves = [Value() for _ in range(1000)]
    for _ in range(2):
        for start in range(0, len(leaves), 250):
            graph.backward(Value(*leaves[start:start + 250]), np.ones(1))
        assert module.leaf_locks_in_use() == 0
    assert in_flight == [1] * 2 * len(leaves)
    for leaf in leaves:
        np.testing.assert_array_equal(leaf.grad, np.full(1, 2.0))


class Weighted(Value):
    """An owner whose backward passes its gradient times a weight to each
    parent (``weighted_vjp``)."""

    def __init__(self, parents, weights):
        super().__init__(*parents)
        self.weights = weights


def weighted_vjp(owner, grads):
    return [grads[0] * weight for weight in owner.weights]


def random_graph(rng):
    """Leaves, and a root over a random DAG of Weighted owners above them
    (an owner may name a parent twice); weights small dyadic numbers, so
    that every sum is exact in any order."""
    leaves = [Weighted([], []) for _ in range(rng.randint(1, 4))]
    owners = list(leaves)
    for _ in range(rng.randint(1, 30)):
        parents = [rng.choice(owners) for _ in range(rng.randint(1, 3))]
        owners.append(Weighted(parents, [rng.choice([0.5, 1.0, 2.0, -1.0]) for _ in parents]))
    return leaves, owners[-1]


def path_sums(root, leaves):
    """Each leaf's gradient from a unit gradient at ``root``, by a walk in
    Python (the sum over paths of the product of weights); None for a leaf
    not reached."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        owner, finished = stack.pop()
        if finished:
            order.append(owner)
        elif id(owner) not in seen:
            seen.add(id(owner))
            stack.append((owner, True))
            stack.extend((parent, False) for parent in owner.parents)
    total = {id(root): 1.0}
    for owner in reversed(order):
        for parent, weight in zip(owner.parents, owner.weights):
            total[id(parent)] = total.get(id(parent), 0.0) + weight * total[id(owner)]
    return [total[id(leaf)] if id(leaf) in seen else None for leaf in leaves]


def threads_on_a_random_graph(module, rng):
    """One drawn graph and the calls of two to five threads on it; checks
    every outcome against the path sums."""
    leaves, root = random_graph(rng)
    expected = path_sums(root, leaves)
    graph = module.OwnerGraph("parents", weighted_vjp, mode="returns",
                              accumulate=slow_accumulate if rng.random() < 0.5 else None,
                              pre_hook=(lambda owner, grads: None) if rng.random() < 0.5 else None)
    shape = (rng.choice([1, 20_000]),)
    plans = [[rng.random() < 0.3 for _ in range(rng.randint(3, 15))]
             for _ in range(rng.randint(2, 5))]

    def caller(plan):
        def run():
            for is_grad in plan:
                if not is_grad:
                    graph.backward(root, np.ones(shape))
                    continue
                got = graph.grad(root, np.ones(shape), leaves, allow_unused=True)
                for gradient, path_sum in zip(got, expected):
                    assert (gradient is None) == (path_sum is None)
                    if gradient is not None:
                        np.testing.assert_array_equal(gradient, np.full(shape, path_sum))
        return run

    in_threads(*(caller(plan) for plan in plans))
    backward_calls = sum(not is_grad for plan in plans for is_grad in plan)
    for leaf, path_sum in zip(leaves, expected):
        if path_sum is None or backward_calls == 0:
            assert leaf.grad is None
        else:
            np.testing.assert_array_equal(leaf.grad, np.full(shape, backward_calls * path_sum))
    assert module.leaf_locks_in_use() == 0


INTERRUPTS = 300


@random_interrupts_need_3_10
@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_interrupts_at_random_moments_leave_no_entry_in_the_table(core):
    # SIGINTs at random moments of a thread's walks into owner leaves: after
    # each interrupted walk the table is empty and the thread's state is as
    # outside a backward, and the leaves take exact gradients afterwards. In
    # the twin, about one interrupt in fifteen left an entry in the table
    # before its steps were ordered for Ctrl-C (Note [An interrupt in the
    # twin's leaf locks] in pyengine/_pure/owner_graph.py), and grad mode
    # was left off within the first ten interrupts (Note [An owner's thread
    # state comes back] there).
    assert threading.current_thread() is threading.main_thread()
    module = owner_graph_module(core)
    state = pure_state if core == "pure" else compiled_state
    graph = module.OwnerGraph("parents", passes_on, mode="returns")
    leaves = [Value() for _ in range(4)]
    interrupted, deadline = 0, time.monotonic() + WAIT_S
    with RandomInterrupts(seed=1234, low_s=0.0002, high_s=0.003) as interrupts:
        while interrupted < INTERRUPTS and time.monotonic() < deadline:
            root = Value(*[Value(leaf) for leaf in leaves])
            try:
                interrupts.armed = True
                graph.backward(root, np.ones(3))
                interrupts.armed = False
            except KeyboardInterrupt:
                interrupted += 1
            assert module.leaf_locks_in_use() == 0, f"after {interrupted} interrupts"
            # See Note [An owner's thread state comes back] in pyengine/_pure/owner_graph.py.
            assert (state.is_grad_enabled(), state.get_current_graph_task(),
                    state.is_checkpoint_valid()) == (True, None, True), interrupted
    # Fewer only where a slow build met the deadline: still many times the
    # interrupts that found each window.
    assert interrupted >= INTERRUPTS // 3, interrupted
    before = [leaf.grad.copy() if leaf.grad is not None else np.zeros(3) for leaf in leaves]
    graph.backward(Value(*[Value(leaf) for leaf in leaves]), np.full(3, 2.0))
    for leaf, old in zip(leaves, before):
        np.testing.assert_array_equal(leaf.grad, old + 2.0)


@pytest.mark.parametrize("core", ["compiled", "pure"])
@pytest.mark.parametrize("seed", [1, 2])
def test_threads_that_walk_random_graphs_sharing_leaves_add_every_gradient(core, seed):
    # Two to five threads each run a drawn sequence of backward and
    # grad(inputs=) calls on one random graph (the default accumulate, or
    # slow_accumulate): every grad() gives the path sums, and each leaf ends
    # with the path sum times the number of backward calls of all threads.

    module = owner_graph_module(core)
    rng = random.Random(seed)
    for _ in range(12):
        threads_on_a_random_graph(module, rng)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_a_forked_child_accumulates_into_a_leaf_another_thread_held(core):
    # A thread of the parent holds the leaf's lock (its accumulate waits)
    # when the main thread forks: the child, which has only the main
    # thread, walks into that leaf and gets the exact gradient, where it
    # would wait for a lock no thread of its own holds.
    module = owner_graph_module(core)
    leaf = Value()

    def hold(held, done):
        def accumulate(accumulated, gradient):
            held.set()
            assert done.wait(WAIT_S)
            slow_accumulate(accumulated, gradient)

        graph = module.OwnerGraph("parents", passes_on, mode="returns", accumulate=accumulate)
        graph.backward(Value(leaf), np.ones(3))

    def in_child():
        graph = module.OwnerGraph("parents", passes_on, mode="returns")
        graph.backward(Value(leaf), np.full(3, 2.0))
        return bool((leaf.grad == 2.0).all())

    assert in_a_fork_while(hold, in_child, WAIT_S / 3) == 0
    np.testing.assert_array_equal(leaf.grad, np.ones(3))
    assert module.leaf_locks_in_use() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("core", ["compiled", "pure"])
def test_a_child_forked_inside_accumulate_ends_its_walk(core):
    # The child of a fork inside accumulate holds the parent's entry for the
    # leaf, on a table of its own: it walks into that leaf again (a fresh
    # entry, made and dropped), then its first accumulation ends, leaving the
    # child's table alone. The child's leaf gets both gradients and its table
    # ends empty; the parent's gets its one.
    import faulthandler
    import traceback

    module = owner_graph_module(core)
    parent = os.getpid()
    plain = module.OwnerGraph("parents", passes_on, mode="returns")
    children = []

    def accumulate(leaf, gradient):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
            pid = os.fork()
        if pid == 0:
            faulthandler.dump_traceback_later(WAIT_S / 3, exit=True)
            plain.backward(Value(leaf), np.full(3, 2.0))
        else:
            children.append(pid)
        slow_accumulate(leaf, gradient)

    leaf = Value()
    graph = module.OwnerGraph("parents", passes_on, mode="returns", accumulate=accumulate)
    try:
        graph.backward(Value(leaf), np.ones(3))
    except BaseException:
        if os.getpid() != parent:
            traceback.print_exc()  # on the test's captured stderr
            os._exit(1)
        raise
    if os.getpid() != parent:
        os._exit(0 if (leaf.grad == 3.0).all() and module.leaf_locks_in_use() == 0 else 2)
    _, status = os.waitpid(children[0], 0)
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_array_equal(leaf.grad, np.ones(3))
    assert module.leaf_locks_in_use() == 0
