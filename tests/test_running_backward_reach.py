"""What Python code that a running backward runs can reach, and do to it.

A node's ``apply``, its hooks, a final callback or the profiler reach the
running graph task (``state.get_current_graph_task()``), its ready queue,
its root, the running node and its neighbours, the engine, and, through
``gc``, the InputBuffers the engine fills. Each test below is one thing
such code did that a core got wrong; the sweep at the end calls every
method and writes every field of each of those objects from each place,
on the caller's thread, a reentrant pool thread and a device thread, and
lets the backward go on.

Oracles: the analytic gradients of the small graphs built here, the other
core (the sweep compares both, each in its own interpreter, and a crash is
a finding, not a dead test run), and a good backward after each case.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import re
import select
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import run_on_this_core

import pyengine
import pyengine._core as core
from pyengine import Edge, Node

state = core.state_module


class Leaf:
    def __init__(self):
        self.data = np.ones(3)
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


class During(Node):
    """Passes ``grads[0] * 2`` on, after ``during()`` ran."""

    def __init__(self, next_edges, during):
        super().__init__(next_edges=next_edges, input_metadata=[((3,), np.float64)])
        self.during = during

    def apply(self, grads):
        self.during()
        return [grads[0] * 2] * len(self.next_edges)


def test_exec_info_a_running_node_changes_is_a_copy():
    # The twin gave its live exec_info dict and ExecInfo entries: a node
    # that cleared or filled it pruned every node after it, or captured
    # nothing. Both cores give copies.
    def clear():
        task = state.get_current_graph_task()
        task.exec_info.clear()
        for info in task.exec_info.values():
            info.captures.clear()
            info.captures.append((0, 7))
        found = task.find_exec_info(pyengine.grad_accumulator(a))
        found.captures.clear()
        found.captures.append((0, 7))

    def fill():
        task = state.get_current_graph_task()
        task.exec_info[id(pyengine.grad_accumulator(b))] = core.graph_task_module.ExecInfo()
        assert task.find_exec_info(pyengine.grad_accumulator(b)) is None

    a, b = Leaf(), Leaf()
    node = During([pyengine.gradient_edge(a), pyengine.gradient_edge(b)], clear)
    captured = pyengine.get_default_engine().execute(
        [Edge(node, 0)], [np.ones(3)], False, False, False,
        outputs=[pyengine.gradient_edge(a), pyengine.gradient_edge(b)])
    assert [value.tolist() for value in captured] == [[2.0] * 3, [2.0] * 3]
    node = During([pyengine.gradient_edge(a), pyengine.gradient_edge(b)], fill)
    pyengine.get_default_engine().execute([Edge(node, 0)], [np.ones(3)], False, False, True)
    assert (a.grad.tolist(), b.grad.tolist()) == ([2.0] * 3, [2.0] * 3)


def test_a_deleted_free_field_reads_none_in_both_cores():
    # Deleting a Cython ``public object`` field stores None; the twin's
    # slots were deleted, and the engine's next read of one was an
    # AttributeError in the twin alone (See Note [Fields Python code can
    # write] in pyengine/_pure/node.py).
    a, b = Leaf(), Leaf()
    accumulate = pyengine.grad_accumulator(a)
    pyengine.register_post_accumulate_grad_hook(a, lambda tensor: None)
    seen = {}

    def delete():
        task = state.get_current_graph_task()
        del task.graph_root
        seen["graph_root"] = task.graph_root
        for field in ("accumulator", "tensor_pre_hooks", "post_accumulate_grad_hooks"):
            delattr(accumulate.leaf_state, field)
            seen[field] = getattr(accumulate.leaf_state, field)
        for field in ("_stream", "_saved_values"):
            delattr(accumulate, field)
            seen[field] = getattr(accumulate, field)

    node = During([Edge(accumulate, 0), pyengine.gradient_edge(b)], delete)
    pyengine.get_default_engine().execute([Edge(node, 0)], [np.ones(3)], False, False, True)
    assert seen == dict.fromkeys(seen)
    assert (a.grad.tolist(), b.grad.tolist()) == ([2.0] * 3, [2.0] * 3)

    def delete_variable():
        del accumulate.variable

    node = During([Edge(accumulate, 0)], delete_variable)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'grad'"):
        pyengine.get_default_engine().execute([Edge(node, 0)], [np.ones(3)], False, False, True)
    assert accumulate.variable is None


def test_a_second_init_of_a_running_ready_queue_keeps_its_tasks():
    # The twin's ReadyQueue.__init__ made a new heap and condition: from a
    # leaf's hook, while the other branch's task waited in the running
    # graph task's queue, it dropped that task, and the backward waited
    # forever (the compiled queue's heap is made with the object). In a
    # child process, for a hang is the failure.
    lines = run_on_this_core(textwrap.dedent('''
        import numpy as np
        import pyengine
        import pyengine._core as core
        from pyengine import Edge, Node

        class Leaf:
            def __init__(self):
                self.data, self.grad, self.grad_fn = np.ones(3), None, None
                self.output_nr, self.requires_grad = 0, True

        class Twice(Node):
            def apply(self, grads):
                return [grads[0] * 2] * len(self.next_edges)

        a, b = Leaf(), Leaf()
        other = Twice([pyengine.gradient_edge(b)], [((3,), np.float64)])
        mid = Twice([pyengine.gradient_edge(a), Edge(other, 0)], [((3,), np.float64)])
        top = Twice([Edge(mid, 0), Edge(other, 0)], [((3,), np.float64)])
        queues = []
        def again(tensor):
            queue = core.state_module.get_current_graph_task().cpu_ready_queue
            queues.append(len(queue))
            queue.__init__()
            queues.append(len(queue))
        pyengine.register_post_accumulate_grad_hook(a, again)
        pyengine.get_default_engine().execute([Edge(top, 0)], [np.ones(3)], False, False, True)
        print(queues, a.grad.tolist(), b.grad.tolist())
    '''), timeout=60)
    assert lines == ["[1, 1] [4.0, 4.0, 4.0] [12.0, 12.0, 12.0]"]


def test_a_second_init_of_a_pending_input_buffer_is_refused():
    # A node that found, through gc, the InputBuffer of a node still waiting
    # for its other input and ran its __init__ again emptied it: the
    # gradient summed there so far was lost, in both cores, without a word.
    # Both refuse a second __init__, as GraphTask's.
    import gc

    refused = ("InputBuffer.__init__ ran already: it runs once per instance (a second __init__ "
               "would empty the slots of the gradients that a running backward may have summed "
               "into it)")
    answers = set()

    def again():
        for found in gc.get_objects():
            if type(found) is core.InputBuffer:
                try:
                    found.__init__(1)
                except TypeError as error:
                    answers.add(str(error))
                else:
                    answers.add("ran")

    a = Leaf()
    left = During([pyengine.gradient_edge(a)], again)
    right = During([pyengine.gradient_edge(a)], again)
    root = During([Edge(left, 0), Edge(right, 0)], lambda: None)
    pyengine.get_default_engine().execute([Edge(root, 0)], [np.ones(3)], False, False, True)
    assert answers == {refused}
    assert a.grad.tolist() == [8.0] * 3
    fresh = core.InputBuffer.__new__(core.InputBuffer)
    fresh.__init__(2)
    assert fresh.buffer == [None, None]
    with pytest.raises(TypeError, match="InputBuffer.__init__ ran already"):
        fresh.__init__(1)
    assert fresh.buffer == [None, None]


def test_an_owner_a_final_callback_writes_is_not_the_thread_woken():
    # The compiled loop read the graph task's owner (a public int) again
    # after the final callbacks ran, and woke the thread of what a callback
    # wrote there (no device thread 0: ValueError, after a backward that had
    # completed); the twin reads it once, before them. Both read it once.
    def during():
        def callback():
            state.get_current_graph_task().owner = 0
        pyengine.queue_callback(callback)

    a = Leaf()
    node = During([pyengine.gradient_edge(a)], during)
    pyengine.get_default_engine().execute([Edge(node, 0)], [np.ones(3)], False, False, True)
    assert a.grad.tolist() == [2.0] * 3


class Owner:
    def __init__(self, *parents):
        self.parents = list(parents)
        self.grad = None


def test_an_owner_graph_is_initialized_once():
    # A parents reader or a backward that called __init__ again on the
    # graph being walked switched its mode mid-walk: the compiled walk ran
    # owners of a writes-mode search as returns-mode ones, and the twin
    # failed elsewhere, in other words. See Note [An owner graph is
    # initialized once] in pyengine/_pure/owner_graph.py.
    refused = ("TypeError: OwnerGraph.__init__ ran already: it runs once per instance (a second "
               "__init__ would change the mode, readers and hooks that a walk of the graph, "
               "which may be running, reads as it goes)")
    answers = []

    def again(graph, mode):
        try:
            graph.__init__(parents, backward, mode=mode)
        except TypeError as error:
            answers.append(f"TypeError: {error}")

    def parents(owner):
        again(graph, "returns" if graph.mode == "writes" else "writes")
        return owner.parents

    def backward(owner, grads=None):
        again(graph, "returns" if graph.mode == "writes" else "writes")
        return [grads[0] * 3 for _ in owner.parents] if graph.returns else None

    a, b = Owner(), Owner()
    root = Owner(Owner(a, b), a)
    graph = pyengine.OwnerGraph(parents, backward, mode="returns")
    graph.backward(root, np.ones(3))
    assert (a.grad.tolist(), b.grad.tolist()) == ([12.0] * 3, [9.0] * 3)
    graph = pyengine.OwnerGraph(parents, backward, mode="writes")
    graph.backward(root)
    assert graph.mode == "writes" and len(answers) == 12 and set(answers) == {refused}

    # A gradient policy is compared as the str it holds (check_options):
    # its own __ne__, which would run an __init__ from inside this one, is
    # never called, and the graph keeps the constant.
    class Policy(str):
        def __ne__(self, other):
            again(graph, "writes")
            return str.__ne__(self, other)

        __hash__ = str.__hash__

    graph = pyengine.OwnerGraph.__new__(pyengine.OwnerGraph)
    graph.__init__(parents, backward, mode="returns", gradient_policy=Policy("reduce"))
    assert graph.returns and type(graph.gradient_policy) is str and len(answers) == 12
    # A mode that is a str subclass: its __ne__ (run by each of the mode's
    # two comparisons) runs an __init__ of the same graph from inside this
    # one, which is refused; then the compiled field takes a str only.
    graph = pyengine.OwnerGraph.__new__(pyengine.OwnerGraph)
    with pytest.raises(TypeError, match="^Expected str, got Policy$"):
        graph.__init__(parents, backward, mode=Policy("returns"))
    assert answers[-2:] == [refused, refused] and len(answers) == 14


# -- the sweep -------------------------------------------------------------------------

_SWEEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "running_backward_sweep.py")
# Seconds a case may take before the parent calls it a hang (a case takes
# milliseconds), and the child to start.
_CASE_TIMEOUT = 10.0
_START_TIMEOUT = 60.0


def _lines(process, deadline):
    """The child's output lines; None once it printed nothing for the
    case timeout (a hang)."""
    descriptor = process.stdout.fileno()
    pending = b""
    started = False
    while True:
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            started = True
            yield line.decode(errors="replace")
        timeout = _CASE_TIMEOUT if started else _START_TIMEOUT
        ready, _, _ = select.select([descriptor], [], [], min(timeout, deadline - time.monotonic()))
        if not ready:
            yield None
            return
        chunk = os.read(descriptor, 1 << 16)
        if not chunk:
            if pending:
                yield pending.decode(errors="replace")
            return
        pending += chunk


def sweep(pure, budget=600.0, only=None, device_order=None):
    """Run the sweep on one core: ``{case: outcome}``, a crash or a hang
    being an outcome (``CRASH`` with the exit status, ``HANG``) after which
    a new interpreter goes on with the next case; only the cases whose key
    holds ``only``, where given, and the device place in ``device_order``
    (See DEVICE_ORDER in the sweep). One case runs alone, with its stderr,
    as ``python tests/running_backward_sweep.py 0 'KEY'``."""
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(pyengine.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))
    if pure:
        env["PYENGINE_PURE"] = "1"
    else:
        env.pop("PYENGINE_PURE", None)
    if device_order is not None:
        env["PYENGINE_REACH_DEVICE_ORDER"] = device_order
    deadline = time.monotonic() + budget
    outcomes = {}
    first = 0
    while True:
        # Its stderr apart: a thread's traceback (a pool thread's that a
        # case's write ended) must not break a line of the answers.
        process = subprocess.Popen([sys.executable, _SWEEP, str(first)] + ([only] if only else []),
                                   stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, cwd=repo_root, env=env)
        begun, ended, hung, other = None, False, False, []
        for line in _lines(process, deadline):
            if line is None:
                hung = True
                break
            if line.startswith("BEGIN "):
                _, index, key = line.split(" ", 2)
                begun = (int(index), key)
            elif line.startswith("END "):
                ended = True
            elif begun is not None and line.startswith(f"{begun[0]} "):
                outcomes[begun[1]] = line.split(" -> ", 1)[1]
                begun = None
            else:
                other.append(line)
        if hung:
            process.kill()
        status = process.wait()
        if ended:
            return outcomes
        assert begun is not None, f"the sweep stopped outside a case (status {status}): {other[-5:]}"
        outcomes[begun[1]] = "HANG" if hung else f"CRASH (status {status})"
        assert time.monotonic() < deadline, "the sweep ran out of time"
        first = begun[0] + 1


def _count_words(outcome):
    # Cython and Python word a wrong count of arguments apart.
    return re.sub(r"TypeError: [^|]*(positional argument|keyword argument)[^|]*\|",
                  "TypeError (the arguments' count) |", outcome)


# Note [A case whose answer is a race]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In the device place two threads run the backward at once: the caller's
# runs Other and b's accumulation while the device thread runs Dev, whose
# apply runs the case. Left to the threads, a case that reads or changes
# what the caller's thread is doing answers as their race goes (the state
# of Other's saved values, the graph task's captured gradients, whether
# the caller's queue has a task, a graph task completed or failed before
# the caller's thread sent b its gradient), the same in both cores for
# each order but not from run to run: the last stop's CI saw the cores
# answer apart. So the sweep fixes the order: Dev runs its case once the
# caller's thread has run Other and b (the graph task's count is down to
# Dev's own task) and has had time to wait for Dev's work; the test below
# runs the device place's cases again with Dev's case run while the
# caller's thread is in Other, and compares the cores there too. (A wait
# of a fixed time after Other's apply would leave the order to the machine's
# load: CI runs two stages at once on two cores.)
# Two cases race inside the engine, after the case, in either order, and
# are checked against every answer their race can give, not against the
# other core's (no crash, no hang and a good backward after them are asked
# of them as of every case):
# - decrement_outstanding_tasks() takes the count one below the truth: the
#   backward ends when the count reaches zero (See Note [One thread
#   completes a graph task] in pyengine/_pure/engine.py), and whether a's
#   accumulation (queued by Dev after the case) and b's ran by then is the
#   race of the device thread's decrement with the caller's thread (and, in
#   the busy order, so is the count the call returns).
# - _device_thread_main(0, running queue) pushes a shutdown task to the
#   caller's queue and serves that queue: whichever thread pops the shutdown
#   first decides whether the loop returns False (it popped it) or True
#   (the caller's thread took it, and the loop found the queue empty). The
#   gradients do not race: each task runs once, on one thread or the other.
# The debug build under ASan, which slows threads unevenly, showed each of
# these apart in one run of 40 to 80.
# (A backward answers a tuple of the leaves' ``.grad``, a grad(inputs=) the
# engine's list.)
_GRADIENTS = r"then returns (tuple|list)\[{a}, {b}\] \| after ok"
_A, _B = r"array\(2\.0, 2\.0, 2\.0\)", r"array\(5\.0, 5\.0, 5\.0\)"
RACING_CASES = {}
for _mode in ("backward", "grad"):
    RACING_CASES[f"device/{_mode}: graph_task.decrement_outstanding_tasks()"] = (
        r"returns [0-2] \| " + _GRADIENTS.format(a=f"(None|{_A})", b=f"(None|{_B})"))
    RACING_CASES[f"device/{_mode}: engine._device_thread_main(0, running queue)"] = (
        r"returns (True|False) \| " + _GRADIENTS.format(a=_A, b=_B))


def _compare_cores(compiled, pure):
    """The failures of a sweep run on both cores: crashes, hangs, a broken
    engine after a case, racing cases answered out of their race, and the
    other cases answered apart."""
    assert compiled.keys() == pure.keys()
    failures = [(case, outcome) for core_outcomes in (compiled, pure)
                for case, outcome in core_outcomes.items()
                if outcome == "HANG" or outcome.startswith("CRASH") or "BAD AFTER" in outcome]
    assert failures == [], f"{len(failures)} cases crashed, hung or broke the engine: {failures[:5]}"
    # See Note [A case whose answer is a race].
    racing = [(case, outcome) for core_outcomes in (compiled, pure)
              for case, outcome in core_outcomes.items()
              if case in RACING_CASES and not re.fullmatch(RACING_CASES[case], outcome)]
    assert racing == [], f"{len(racing)} racing cases answered out of their race: {racing[:5]}"
    assert any(case in compiled for case in RACING_CASES)
    differences = [(case, compiled[case], pure[case]) for case in compiled
                   if case not in RACING_CASES
                   and _count_words(compiled[case]) != _count_words(pure[case])]
    assert differences == [], f"{len(differences)} differ, the first: {differences[:5]}"


@pytest.mark.skipif(importlib.util.find_spec("pyengine._engine") is None,
                    reason="no compiled core to compare with")
@pytest.mark.skipif(sys.platform == "win32", reason="select() on a pipe is POSIX's")
def test_what_a_running_backward_reaches_never_crashes_and_answers_alike_in_both_cores():
    """Each case of tests/running_backward_sweep.py (about 2,300: every
    method and field of the graph task, its queue, the nodes, the engine
    and the InputBuffer a node's apply reaches, and, lightly, what each
    other place reaches) in both cores at once: no crash, no hang, a good
    backward after each, and the same answers, the backward's gradients
    included (a case that makes two threads race answers one of the
    answers its race can give: See Note [A case whose answer is a race]).
    ``PYENGINE_REACH_FULL=1`` runs the full sweep (about 86,000
    cases per core)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        compiled_run, pure_run = pool.submit(sweep, False), pool.submit(sweep, True)
        compiled, pure = compiled_run.result(), pure_run.result()
    assert compiled.keys() == pure.keys() and len(compiled) > 2_000
    # Most actions leave the backward its analytic gradients (a: 2, b: 50
    # times the root's): the sweep runs the backwards it means to.
    analytic = "array(2.0, 2.0, 2.0), array(50.0, 50.0, 50.0)]"
    assert sum(analytic in outcome for outcome in compiled.values()) > len(compiled) // 2
    _compare_cores(compiled, pure)


@pytest.mark.skipif(importlib.util.find_spec("pyengine._engine") is None,
                    reason="no compiled core to compare with")
@pytest.mark.skipif(sys.platform == "win32", reason="select() on a pipe is POSIX's")
def test_a_device_thread_answers_alike_in_both_cores_while_the_caller_runs_a_node():
    """The device place's cases of the sweep again, each run by Dev on the
    device thread while the caller's thread is in Other's apply (which waits
    for the case): in both cores no crash, no hang, a good backward after,
    and the same answers. The order changes what some cases see: the cases
    that would race if the threads were left to themselves (See Note [A
    case whose answer is a race]) answer apart from the sweep's order."""
    # The idle order's cores are compared by the sweep's test above; here it
    # runs on the compiled core only, for what the order changes.
    orders_and_cores = [("caller_busy", False), ("caller_busy", True), ("caller_idle", False)]
    with concurrent.futures.ThreadPoolExecutor(len(orders_and_cores)) as pool:
        runs = {(order, pure): pool.submit(sweep, pure, only="device/", device_order=order)
                for order, pure in orders_and_cores}
        runs = {key: run.result() for key, run in runs.items()}
    busy, idle = runs["caller_busy", False], runs["caller_idle", False]
    assert len(busy) > 100 and all(case.startswith("device/") for case in busy)
    _compare_cores(busy, runs["caller_busy", True])
    # What the order shows: a completion from the device thread ends the
    # backward before the caller's thread sends b its gradient (b None) only
    # while that thread is busy.
    completes = "device/backward: graph_task.mark_as_completed_and_run_post_processing()"
    assert busy[completes] == "returns None | then returns tuple[None, None] | after ok"
    assert idle[completes] == ("returns None | then returns tuple[array(2.0, 2.0, 2.0), "
                               "array(5.0, 5.0, 5.0)] | after ok")
