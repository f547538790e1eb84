"""Reentrant backward: a node whose ``apply`` calls ``pyengine.backward`` or
``pyengine.grad``. See Note [Reentrant backward].

Oracles: exact gradients (small integers; ``linear_graphs`` for the inner
graphs), an exact log of which node ran when and on which thread, and the
depth rule of PyTorch's engine: a reentrant graph task runs inline on the
thread that started it while that thread is fewer than
``max_recursion_depth`` levels deep; past that it goes to a pool thread
(named "pyengine-reentrant"), which again runs ``max_recursion_depth`` levels
inline before handing off.
"""

import os
import re
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import linear_graphs as lg  # noqa: E402
from conftest import run_on_this_core  # noqa: E402

import pyengine  # noqa: E402
from pyengine._core import set_sequence_nr  # noqa: E402

G = np.array([1.0, 2.0])


class Fn(pyengine.Node):
    """A node whose apply is ``fn(grads)``, logged as ``tag``."""

    def __init__(self, tag, next_edges, fn, log=None):
        super().__init__(next_edges=next_edges)
        self.tag = tag
        self.fn = fn
        self.log = log

    def apply(self, grads):
        if self.log is not None:
            self.log.append(self.tag)
        return self.fn(grads)


def value(node, output_nr=0, shape=(2,)):
    return lg.Value(np.zeros(shape), node, output_nr)


def leaf(shape=(2,)):
    return lg.Leaf(np.zeros(shape))


class Boom(Exception):
    pass


# -- results -------------------------------------------------------------------------------

def test_reentrant_grad_and_backward_results_are_exact():
    spec, roots, expected = lg.seeded_case(5, n_ops=20, min_reached_leaves=2)
    inner = lg.build(spec)
    refs = [ref for ref in spec.all_refs() if expected[ref] is not None]
    total = sum(float(sum(expected[ref])) for ref in refs)
    calls = []

    def reentrant(grads):
        results = pyengine.grad([inner.tensor(ref) for ref, _ in roots],
                                [inner.tensor(ref) for ref in refs],
                                grad_outputs=lg.root_grad_arrays(roots), retain_graph=True)
        for ref, got in zip(refs, results):
            assert lg.equal(got, expected[ref]), lg.describe(got, expected[ref])
        pyengine.backward([inner.tensor(ref) for ref, _ in roots],
                          grad_tensors=lg.root_grad_arrays(roots), retain_graph=True)
        calls.append(1)
        extra = sum(float(np.sum(r)) for r in results)
        return [grads[0] * 2 + extra, grads[0]]

    x, y = leaf(), leaf()
    node = Fn("R", (pyengine.gradient_edge(x), pyengine.gradient_edge(y)), reentrant)
    # Two roots on the same reentrant node, and a repeat with retain_graph.
    out = value(node)
    pyengine.backward([out, out], grad_tensors=[G, 3 * G], retain_graph=True)
    pyengine.backward(out, grad_tensors=G)
    assert len(calls) == 2
    assert (x.grad == (8 * G + total) + (2 * G + total)).all()
    assert (y.grad == 5 * G).all()
    # The inner backward calls accumulated into the inner leaves, twice.
    for i, inner_leaf in enumerate(inner.leaves):
        want = expected[("leaf", i)]
        assert lg.equal(inner_leaf.grad, None if want is None else [2 * v for v in want])


def test_nested_reentrant_grad_of_grad_levels():
    # Level k returns k * g by adding g to the reentrant grad of level k - 1.
    levels = _level_chain(5, log=None)
    x = levels.leaves[-1]
    pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert (x.grad == 5 * G).all()
    assert all(other.grad is None for other in levels.leaves[:-1])


# -- order ---------------------------------------------------------------------------------

def test_reentrant_tasks_run_before_the_parents_queued_tasks():
    log = []
    sink = leaf()
    acc = pyengine.gradient_edge(sink)
    # The inner graph's nodes have the lowest sequence numbers of all, so only
    # their reentrant depth can make them run before the parent's B.
    c2 = Fn("C2", (acc,), lambda g: [g[0]], log)
    c1 = Fn("C1", (pyengine.Edge(c2, 0),), lambda g: [g[0]], log)
    set_sequence_nr(c2, 0)
    set_sequence_nr(c1, 1)

    def a_apply(grads):
        log.append("A:start")
        (got,) = pyengine.grad(value(c1), value(c2), grad_outputs=grads[0], retain_graph=True)
        log.append("A:end")
        return [grads[0] + got]

    x = leaf()
    a = Fn("A", (pyengine.gradient_edge(x),), a_apply)
    b = Fn("B", (pyengine.gradient_edge(x),), lambda g: [g[0]], log)
    d = Fn("D", (pyengine.gradient_edge(x),), lambda g: [g[0]], log)
    root = Fn("R", (pyengine.Edge(a, 0), pyengine.Edge(b, 0), pyengine.Edge(d, 0)),
              lambda g: [g[0]] * 3, log)
    set_sequence_nr(d, 100)
    set_sequence_nr(b, 1000)
    set_sequence_nr(a, 2000)
    set_sequence_nr(root, 3000)
    pyengine.backward(value(root), grad_tensors=G)
    assert log == ["R", "A:start", "C1", "A:end", "B", "D"]
    assert (x.grad == 4 * G).all()
    assert sink.grad is None


def test_reentrant_backward_runs_the_whole_child_before_the_parent_continues():
    log = []
    inner_leaf = leaf()
    inner_acc = pyengine.gradient_edge(inner_leaf)
    # A child graph with fan-out and fan-in: I -> (J, K) -> L -> leaf.
    l_node = Fn("L", (inner_acc,), lambda g: [g[0]], log)
    j = Fn("J", (pyengine.Edge(l_node, 0),), lambda g: [2 * g[0]], log)
    k = Fn("K", (pyengine.Edge(l_node, 0),), lambda g: [3 * g[0]], log)
    i_node = Fn("I", (pyengine.Edge(j, 0), pyengine.Edge(k, 0)), lambda g: [g[0], g[0]], log)
    for node, nr in ((l_node, 1), (j, 2), (k, 3), (i_node, 4)):
        set_sequence_nr(node, nr)

    def a_apply(grads):
        log.append("A:start")
        pyengine.backward(value(i_node), grad_tensors=grads[0], retain_graph=True)
        log.append("A:end")
        return [grads[0]]

    x = leaf()
    a = Fn("A", (pyengine.gradient_edge(x),), a_apply)
    b = Fn("B", (pyengine.gradient_edge(x),), lambda g: [g[0]], log)
    root = Fn("R", (pyengine.Edge(a, 0), pyengine.Edge(b, 0)), lambda g: [g[0], g[0]], log)
    set_sequence_nr(b, 10)
    set_sequence_nr(a, 20)
    set_sequence_nr(root, 30)
    pyengine.backward(value(root), grad_tensors=G)
    assert log == ["R", "A:start", "I", "K", "J", "L", "A:end", "B"]
    assert (inner_leaf.grad == 5 * G).all()
    assert (x.grad == 2 * G).all()


# -- depth -----------------------------------------------------------------------------------

def _level_chain(n, log):
    """See linear_graphs.reentrant_chain: level k returns k * g."""
    nodes, leaves = lg.reentrant_chain(n, log)
    return _Levels(nodes, leaves)


class _Levels:
    def __init__(self, nodes, leaves):
        self.nodes = nodes
        self.leaves = leaves


def _check_depth_rule(log, n, max_depth, caller):
    # log is in call order: level n first (depth 0), level 1 last.
    assert [k for k, _, _ in log] == list(range(n, 0, -1))
    per_thread = max_depth + 1
    blocks = [log[i:i + per_thread] for i in range(0, n, per_thread)]
    idents = []
    for b, block in enumerate(blocks):
        assert len({ident for _, ident, _ in block}) == 1, \
            f"levels {block[0][0]}..{block[-1][0]} ran on several threads"
        ident, name = block[0][1], block[0][2]
        if b == 0:
            assert ident == caller.ident, "the first levels did not run inline on the caller"
        else:
            assert name == "pyengine-reentrant", f"depth {b * per_thread} ran on {name}"
            assert ident != caller.ident
        idents.append(ident)
    # A blocked pool thread cannot take another level: each block has its own thread.
    assert len(set(idents)) == len(blocks)


def test_default_max_recursion_depth_is_60():
    assert pyengine.Engine().max_recursion_depth == 60


def test_reentrant_chain_1000_levels_deep_goes_through_pool_threads():
    n = 1000
    log = []
    levels = _level_chain(n, log)
    top = levels.leaves[-1]
    pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert (top.grad == n * G).all()
    assert all(x.grad is None for x in levels.leaves[:-1])
    max_depth = pyengine.get_default_engine().max_recursion_depth
    _check_depth_rule(log, n, max_depth, threading.current_thread())
    # And again: the pool threads are reused or replaced; the result is the same.
    log.clear()
    levels = _level_chain(n, log)
    pyengine.backward(value(levels.nodes[-1]), grad_tensors=2 * G)
    assert (levels.leaves[-1].grad == 2 * n * G).all()
    _check_depth_rule(log, n, max_depth, threading.current_thread())


@pytest.mark.parametrize("max_depth", [0, 1, 3])
def test_depth_rule_with_a_small_limit(engine_with_depth, max_depth):
    engine_with_depth(max_depth)
    n = 25
    log = []
    levels = _level_chain(n, log)
    pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert (levels.leaves[-1].grad == n * G).all()
    _check_depth_rule(log, n, max_depth, threading.current_thread())


def test_reentrant_from_a_thread_other_than_main():
    result = []

    def run():
        log = []
        levels = _level_chain(150, log)
        pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
        _check_depth_rule(log, 150, pyengine.get_default_engine().max_recursion_depth,
                          threading.current_thread())
        result.append(levels.leaves[-1].grad)

    thread = threading.Thread(target=run, name="caller")
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    assert len(result) == 1 and (result[0] == 150 * G).all()


# -- errors ----------------------------------------------------------------------------------

def _failing_chain(n, fail_at, exception):
    """Like _level_chain, but level ``fail_at`` raises ``exception``."""
    return _Levels(*lg.reentrant_chain(n, fail_at=fail_at, error=exception))


def _engine_still_works():
    spec, roots, expected = lg.seeded_case(9, n_ops=15)
    graph = lg.build(spec)
    pyengine.backward([graph.tensor(ref) for ref, _ in roots],
                      grad_tensors=lg.root_grad_arrays(roots))
    for i, x in enumerate(graph.leaves):
        assert lg.equal(x.grad, expected[("leaf", i)])
    levels = _level_chain(200, None)
    pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert (levels.leaves[-1].grad == 200 * G).all()


@pytest.mark.parametrize("n, fail_at", [(2, 1), (10, 1), (10, 5), (300, 1), (300, 150)])
def test_exception_in_a_child_reaches_the_outer_caller_with_its_type(n, fail_at):
    error = Boom(f"level {fail_at}")
    levels = _failing_chain(n, fail_at, error)
    with pytest.raises(Boom, match=f"^level {fail_at}$") as info:
        pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert info.value is error
    assert levels.leaves[-1].grad is None
    _engine_still_works()


def test_exception_in_a_child_on_a_pool_thread_with_a_small_limit(engine_with_depth):
    engine_with_depth(2)
    levels = _failing_chain(12, 1, KeyError("deep"))
    with pytest.raises(KeyError):
        pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    _engine_still_works()


def test_parent_that_catches_the_child_error_continues_and_the_child_stops():
    log = []
    inner_leaf = leaf()
    inner_acc = pyengine.gradient_edge(inner_leaf)
    y = Fn("Y", (inner_acc,), lambda g: [g[0]], log)

    def x_apply(grads):
        raise Boom("X")

    x_node = Fn("X", (inner_acc,), x_apply, log)
    i_node = Fn("I", (pyengine.Edge(x_node, 0), pyengine.Edge(y, 0)), lambda g: [g[0], g[0]], log)
    set_sequence_nr(y, 1)
    set_sequence_nr(x_node, 2)
    set_sequence_nr(i_node, 3)

    def a_apply(grads):
        log.append("A:start")
        try:
            pyengine.backward(value(i_node), grad_tensors=grads[0])
        except Boom:
            log.append("A:caught")
        return [grads[0]]

    out_leaf = leaf()
    a = Fn("A", (pyengine.gradient_edge(out_leaf),), a_apply)
    b = Fn("B", (pyengine.gradient_edge(out_leaf),), lambda g: [3 * g[0]], log)
    root = Fn("R", (pyengine.Edge(a, 0), pyengine.Edge(b, 0)), lambda g: [g[0], g[0]], log)
    set_sequence_nr(b, 10)
    set_sequence_nr(a, 20)
    set_sequence_nr(root, 30)
    pyengine.backward(value(root), grad_tensors=G)
    # Y was queued when X failed: it never runs, not even in the parent's loop.
    assert log == ["R", "A:start", "I", "X", "A:caught", "B"]
    assert inner_leaf.grad is None
    assert (out_leaf.grad == 4 * G).all()
    _engine_still_works()


# -- bounds: See Note [Bounds on reentrant backward] ------------------------------------------

def _reentrant_threads():
    return {t for t in threading.enumerate() if t.name == "pyengine-reentrant"}


@pytest.fixture
def engine_with(request):
    """Swap in an Engine made with the given arguments; restore the default."""
    previous = []

    def make(**kwargs):
        engine = pyengine.Engine(**kwargs)
        previous.append(pyengine.set_default_engine(engine))
        return engine

    yield make
    for engine in reversed(previous):
        pyengine.set_default_engine(engine)


def test_default_bounds():
    engine = pyengine.Engine()
    assert engine.max_total_depth == 4096
    assert engine.max_pool_threads == 256


class _OnlyIndex:
    def __index__(self):
        return 3


class _Int:
    def __int__(self):
        return 3


@pytest.mark.parametrize("name", ["max_recursion_depth", "max_total_depth", "max_pool_threads"])
@pytest.mark.parametrize("given, expected", [
    (3, 3), (True, 1), (np.int64(3), 3), (2.9, 2), (-2.9, -2), (_Int(), 3),
    (2**31 - 1, 2**31 - 1), (-2**31, -2**31),
    ("3", (TypeError, "an integer is required")),
    (None, (TypeError, "an integer is required")),
    (_OnlyIndex(), (TypeError, "an integer is required")),
    (2**31, (OverflowError, "value too large to convert to int")),
    (-2**31 - 1, (OverflowError, "value too large to convert to int")),
    (2**40, (OverflowError, "value too large to convert to int")),
    # "C long" up to CPython 3.12, "C int" from 3.13 (the compiled core's
    # conversion changed with it); the type is what both cores share.
    (2**64, (OverflowError, "Python int too large to convert to C ")),
    (float("nan"), (ValueError, "cannot convert float NaN to integer")),
])
def test_the_bounds_are_c_ints_in_both_cores(name, given, expected):
    # The compiled Engine keeps them in C ints, converted as Cython converts
    # an int argument; the twin took anything int() takes ("3", 2**40).
    # The oracle is what the compiled core does. See Note [The engine's
    # bounds are C ints] in pyengine/_pure/static_types.py.
    if isinstance(expected, tuple):
        error, message = expected
        with pytest.raises(error, match=re.escape(message)):
            pyengine.Engine(**{name: given})
        engine = pyengine.Engine()
        before = getattr(engine, name)
        with pytest.raises(error, match=re.escape(message)):
            setattr(engine, name, given)
        assert getattr(engine, name) == before
    else:
        assert type(getattr(pyengine.Engine(**{name: given}), name)) is int
        assert getattr(pyengine.Engine(**{name: given}), name) == expected
        engine = pyengine.Engine()
        setattr(engine, name, given)
        assert type(getattr(engine, name)) is int
        assert getattr(engine, name) == expected


@pytest.mark.parametrize("name", ["max_recursion_depth", "max_total_depth", "max_pool_threads"])
def test_a_bound_cannot_be_deleted_in_either_core(name):
    # A C field cannot be absent: Cython answers ``del`` on a ``cdef public
    # int`` with NotImplementedError "__del__"; the twin's property had no
    # deleter (AttributeError). The oracle is the compiled core's answer.
    engine = pyengine.Engine()
    before = getattr(engine, name)
    with pytest.raises(NotImplementedError, match="__del__"):
        delattr(engine, name)
    assert getattr(engine, name) == before


def test_a_hook_that_runs_backward_on_its_own_graph_ends_in_recursion_error():
    # The runaway of issue 15: before the bound it started a pool thread
    # every 61 levels until the system refused one, minutes later.
    x = leaf()
    y = Fn("Y", (pyengine.gradient_edge(x),), lambda g: [g[0]])
    levels = []

    def again(grads):
        levels.append(None)
        if len(levels) > 20_000:
            # A guard for the test, far past the engine's bound.
            raise Boom("no bound on reentrant depth")
        pyengine.get_default_engine().execute([pyengine.Edge(y, 0)], [grads[0]], True, False,
                                              True)

    y.register_prehook(again)
    threads_before = threading.active_count()
    start = time.monotonic()
    with pytest.raises(RecursionError) as info:
        pyengine.backward(value(y), grad_tensors=G)
    elapsed = time.monotonic() - start
    engine = pyengine.get_default_engine()
    limit, per_thread = engine.max_total_depth, engine.max_recursion_depth + 1
    threads_started = threading.active_count() - threads_before
    print(f"runaway hook: RecursionError after {elapsed:.2f} s, {len(levels)} levels, "
          f"{threads_started} threads started", file=sys.stderr)
    assert elapsed < 60, "hang guard"
    message = str(info.value)
    assert f"nested {limit + 1} levels deep" in message and "max_total_depth" in message
    # Levels 0..limit ran their hook; the next level was refused before it ran.
    assert len(levels) == limit + 1
    assert threads_started <= limit // per_thread + 1
    assert x.grad is None
    _engine_still_works()


@pytest.mark.parametrize("limit", [0, 5, 600])
def test_max_total_depth_is_the_deepest_legal_nesting(engine_with, limit):
    engine_with(max_recursion_depth=7, max_total_depth=limit)
    # A chain of n levels nests n - 1 deep.
    levels = _level_chain(limit + 1, None)
    pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert (levels.leaves[-1].grad == (limit + 1) * G).all()
    levels = _level_chain(limit + 2, None)
    with pytest.raises(RecursionError, match=f"nested {limit + 1} levels deep, past the engine's "
                                             f"max_total_depth of {limit}"):
        pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert all(x.grad is None for x in levels.leaves)
    # The deepest legal chain still runs.
    levels = _level_chain(limit + 1, None)
    pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert (levels.leaves[-1].grad == (limit + 1) * G).all()


def test_a_full_pool_raises_instead_of_waiting(engine_with):
    # max_recursion_depth 0: each reentrant level takes a pool thread of its
    # own while the level above waits, so a chain of n levels needs n - 1.
    engine_with(max_recursion_depth=0, max_pool_threads=3)
    before = _reentrant_threads()
    levels = _level_chain(4, None)
    pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert (levels.leaves[-1].grad == 4 * G).all()
    levels = _level_chain(5, None)
    with pytest.raises(RuntimeError, match="all 3 threads of the engine's reentrant pool are busy"):
        pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert all(x.grad is None for x in levels.leaves)
    assert len(_reentrant_threads() - before) == 3
    # The three threads still serve.
    levels = _level_chain(4, None)
    pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert (levels.leaves[-1].grad == 4 * G).all()
    assert len(_reentrant_threads() - before) == 3


def test_a_full_pool_serves_backward_after_backward(engine_with):
    # A backward that used every pool thread, or failed for want of one,
    # returns only once they are idle again, so the next one finds them: no
    # spurious "all 3 threads ... are busy" (See Note [A pool thread is back
    # before its caller] in pyengine/_pure/thread_pool.py). The race it guards
    # against is narrow: seen once in a full run on a loaded machine, not
    # reproduced on demand; a tiny switch interval and threads competing
    # for the GIL widen it.
    engine_with(max_recursion_depth=0, max_pool_threads=3)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    # Contention for the GIL, so that a pool thread still unwinding waits
    # for it while its caller runs on.
    stop = threading.Event()
    spinners = [threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
                for _ in range(2)]
    for spinner in spinners:
        spinner.start()
    try:
        for _ in range(100):
            levels = _level_chain(4, None)
            pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
            assert (levels.leaves[-1].grad == 4 * G).all()
            # One level too many: the pool is full, and the error unwinds
            # every level while the next backward starts.
            with pytest.raises(RuntimeError, match="all 3 threads"):
                pyengine.backward(value(_level_chain(5, None).nodes[-1]), grad_tensors=G)
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join()
        sys.setswitchinterval(interval)


def test_a_pool_thread_that_fails_to_start_is_reported_and_cleaned_up(engine_with, monkeypatch):
    engine = engine_with(max_recursion_depth=0)
    before = _reentrant_threads()
    start = threading.Thread.start

    def refuse(thread):
        if thread.name == "pyengine-reentrant":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    levels = _level_chain(3, None)
    with pytest.raises(RuntimeError, match="could not start a reentrant pool thread for a "
                                           "backward nested 1 levels deep: can't start new "
                                           "thread") as info:
        pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert all(x.grad is None for x in levels.leaves)
    # Compared as "nothing new" rather than equality: pool threads of earlier
    # tests' engines may end meanwhile and leave `before`.
    assert not _reentrant_threads() - before
    monkeypatch.setattr(threading.Thread, "start", start)
    # The engine works, and starts its pool threads now.
    levels = _level_chain(3, None)
    pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    assert (levels.leaves[-1].grad == 3 * G).all()
    started = _reentrant_threads() - before
    assert len(started) == 2
    # stop joins only threads that ran (it raised "cannot join thread before
    # it is started" when a failed one stayed in the pool's list).
    engine.stop()
    assert not any(thread.is_alive() for thread in started)
    assert not _reentrant_threads() - before


# -- after Engine.stop: See Note [Stopping the pool] -------------------------------------------

_AFTER_STOP_PRELUDE = f'''
import sys, threading
import numpy as np
sys.path.insert(0, {os.path.dirname(__file__)!r})
import pyengine
from test_reentrant import G, _level_chain, value

# Every level past the first hands off to a pool thread.
engine = pyengine.Engine(max_recursion_depth=0)
pyengine.set_default_engine(engine)


def backward_of_chain(n):
    levels = _level_chain(n, None)
    try:
        pyengine.backward(value(levels.nodes[-1]), grad_tensors=G)
    except RuntimeError as error:
        print("RuntimeError:", error)
    print("grads:", [None if x.grad is None else x.grad.tolist() for x in levels.leaves])
'''

_POOL_STOPPED = ("RuntimeError: cannot run a reentrant backward nested 1 levels deep on a pool "
                 "thread: the engine's reentrant pool threads have stopped (Engine.stop(), which "
                 "runs at interpreter exit)")


def _after_stop(code):
    """``code`` after the prelude, in a subprocess: the hang this guards
    against waits forever without the GIL."""
    return run_on_this_core(_AFTER_STOP_PRELUDE + textwrap.dedent(code), timeout=60)


def test_a_reentrant_backward_after_stop_raises_instead_of_hanging():
    # An atexit handler that runs backward after the engine's own stop()
    # hung the exit here: the hand-off started a pool thread, which saw
    # the pool stopping and returned, and the caller waited for it forever.
    lines = _after_stop("""
        backward_of_chain(2)
        engine.stop()
        backward_of_chain(1)  # no hand-off: runs as before
        backward_of_chain(2)
        backward_of_chain(2)  # the refused task left nothing behind
    """)
    assert lines == ["grads: [None, [2.0, 4.0]]",
                     "grads: [[1.0, 2.0]]",
                     _POOL_STOPPED, "grads: [None, None]",
                     _POOL_STOPPED, "grads: [None, None]"]


def test_a_hand_off_that_no_pool_thread_took_before_stop_fails():
    # stop() comes after the graph task was queued for the pool and before
    # the thread started for it runs: the thread sees the pool stopping and
    # ends, so stop() itself fails the task its caller waits for.
    lines = _after_stop("""
        start = threading.Thread.start

        def stop_first(thread):
            if thread.name == "pyengine-reentrant":
                engine.stop()
            start(thread)

        threading.Thread.start = stop_first
        backward_of_chain(2)
        threading.Thread.start = start
        backward_of_chain(1)
    """)
    assert lines == [_POOL_STOPPED, "grads: [None, None]", "grads: [[1.0, 2.0]]"]
