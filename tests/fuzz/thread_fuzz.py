"""The thread fuzz: several Python threads calling backward at once on one
graph, on both cores; its programs, their exact outcomes, and the parent
side that runs them in child processes (``thread_interpreter.py``).

A *program* (plain JSON, drawn by ``draw_program`` from a seed)::

    {"leaves": L, "lazy_leaves": M,
     "nodes": [{"n_in": 1|2, "edges": [{"to": ["leaf"|"node", j], "nr": k} or None, ...],
                "w": [[w_jk]],              # apply: out_j = sum_k w_jk * grad_k
                "device": -1 | 0 | 1,       # the CPU, or a fake device (its worker thread)
                "sleep0": bool,             # time.sleep(0) in apply: the threads interleave
                "reentrant": [j, k, grad] | None,  # a backward from node j's slot k, run
                "reentrant_in": "apply" | "hook" | "callback",  # by apply, a pre-hook, a final callback
                "callback": bool,           # apply queues a final callback
                "const": [a, b] | None}, ...],  # output 0: one array, the node's own
     "hooks": [{"kind": "pre" | "tensor_pre" | "post", "node": i}
               | {"kind": "post_acc" | "leaf_hook", "leaf": l}, ...],
     "rewires": [{"by": i, "node": t, "how": "same" | "shorten" | "extend",
                  "in": "apply" | "hook"}, ...],  # i's apply or pre-hook replaces t's next_edges
     "hook_churn": [{"by": i, "node": t}],  # i's apply adds and removes hooks of t
     "misuse": {"kind": "raise" | "shape" | "callback_raise" | "release" | "stop",
                "node": i} | None,
     "profile": bool, "anomaly": bool,      # a profile / anomaly mode around the threads
     "width": w,                            # every gradient is w copies of a pair
     "shared_grads": bool,                  # one root gradient array for all threads
     "mutator": bool,                       # a thread swapping the nodes' private fields
                                            # for equal new ones, and adding hooks
     "engine2": bounds | None,              # the Engine of execute_other, and the
                                            # bounds of execute_dropped's: an Engine
                                            # made for the call and dropped after it
     "engine": [max_recursion_depth, max_total_depth, max_pool_threads] | None,
     "switch": 1e-6 | None,                 # sys.setswitchinterval while the threads run
     "threads": [{"late": bool, "no_grad": bool, "calls": [call, ...],
                  "single": bool}, ...]}    # set_multithreading_enabled(False) in that thread

A call is ``{"api": "backward" | "grad" | "execute" | "execute_grad" |
"backward_inputs" | "execute_other" | "execute_dropped", "roots":
[[j, k], ...], "grads": [[a, b] | "bad", ...], "inputs": [l, ...]}`` (all
with ``retain_graph=True``, unless ``"retain": false``: the misuse
"release"), or ``{"api": "stop_other"}`` (misuse "stop": ``Engine.stop`` on the second
Engine while the others may use it), or ``{"api": "fresh", "leaf": m, "grads":
[[a, b]]}``: a fresh one-node graph (x3) into a lazy leaf, whose
AccumulateGrad the threads make at once. A pre-hook doubles a node's
gradients, a tensor pre-hook halves its slot 0, the others count. Weights
and gradients are small dyadic numbers, so every sum is exact in float64
in any order: the oracle does not depend on the threads' schedule.

``simulate`` gives each call's exact outcome: its error type (FuzzError
from a raising node or final callback, RuntimeError for a wrong-shaped
gradient, at the node or as a root gradient), or what ``grad`` returns, and
what it adds to each leaf, with what it runs (nodes, hooks, callbacks,
reentrant backwards, each a call of its own). ``problems_of`` judges a
core's result against it:

- no crash, no hang (a missing line: the child's per-program timeout);
- every call's outcome exact: the error type, or the captured gradients;
  one more outcome where the program's Engine has a small pool: the
  RuntimeError of a pool whose threads are all busy (another thread's
  reentrant backward holds them);
- each leaf's ``.grad`` is the exact sum of every successful call's part
  (leaves that a failing call may have reached aside);
- where no call failed, the counts of applies, hooks and callbacks are exact;
- grad mode off in every node, and each caller's own mode (some run
  with it off) as it was after each call;
- no caller thread still running after the joins, no engine thread in the
  program's code, the reference backwards after it exact;
- each Engine made for an ``execute_dropped`` call collected once the
  program ends, and the threads of a collected Engine ended within
  ``thread_interpreter.ENDING_S`` (a later program reports one that ran on);
- where a "shorten" or "extend" rewire makes the outcome depend on the
  schedule (misuse), only: each error is RuntimeError or FuzzError.

Both cores must also agree: for every call, the same error message where
both raised the same type (object addresses aside).

``python thread_fuzz.py --programs 2000 --seed 1 --core both`` runs it widely.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fuzz_interpreter  # noqa: E402

INTERPRETER = os.path.join(HERE, "thread_interpreter.py")
CORES = ("compiled", "pure")
PROGRAM_TIMEOUT = 20.0
WEIGHTS = [-2.0, -1.0, 0.5, 1.0, 2.0]
GRADS = [-1.0, 0.5, 1.0, 2.0]
# Small bounds (reentrant backward handed to pool threads), and a roomy one.
ENGINE_BOUNDS = [[0, 64, 1], [0, 64, 2], [1, 64, 2], [1, 64, 8], [0, 64, 64], [60, 4096, 256]]
APIS = ["backward", "backward", "grad", "execute", "execute_grad", "backward_inputs",
        "execute_other", "execute_dropped", "fresh"]


# -- programs --

def draw_program(rng):
    leaves = rng.randint(1, 3)
    n = rng.randint(1, 7)
    devices = rng.random() < 0.35
    nodes = []
    for i in range(n):
        n_in = rng.randint(1, 2)
        edges = []
        for _ in range(rng.randint(1, 3)):
            choice = rng.randint(0, 5)
            if choice == 0:
                edges.append(None)
            elif i == 0 or choice == 1:
                edges.append({"to": ["leaf", rng.randrange(leaves)], "nr": 0})
            else:
                j = rng.randrange(i)
                edges.append({"to": ["node", j], "nr": rng.randrange(nodes[j]["n_in"])})
        node = {"n_in": n_in, "edges": edges,
                "w": [[rng.choice(WEIGHTS) for _ in range(n_in)] for _ in edges],
                "device": rng.choice([-1, -1, 0, 1]) if devices else -1,
                "sleep0": rng.random() < 0.5, "reentrant": None,
                "callback": rng.random() < 0.15,
                "const": [rng.choice(GRADS), rng.choice(GRADS)] if rng.random() < 0.1 else None}
        if i > 0 and rng.random() < 0.2:
            j = rng.randrange(i)
            node["reentrant"] = [j, rng.randrange(nodes[j]["n_in"]),
                                 [rng.choice(GRADS), rng.choice(GRADS)]]
            node["reentrant_in"] = rng.choice(["apply", "apply", "hook", "callback"])
        nodes.append(node)
    hooks = []
    for _ in range(rng.choice([0, 0, 1, 2, 3])):
        kind = rng.choice(["pre", "tensor_pre", "post", "post_acc", "leaf_hook"])
        if kind in ("post_acc", "leaf_hook"):
            hooks.append({"kind": kind, "leaf": rng.randrange(leaves)})
        else:
            hooks.append({"kind": kind, "node": rng.randrange(n)})
    rewires = []
    if rng.random() < 0.25:
        how = "same" if rng.random() < 0.75 else rng.choice(["shorten", "extend"])
        rewires.append({"by": rng.randrange(n), "node": rng.randrange(n), "how": how,
                        "in": rng.choice(["apply", "hook"])})
    hook_churn = []
    if rng.random() < 0.2:
        hook_churn.append({"by": rng.randrange(n), "node": rng.randrange(n)})
    misuse = None
    if rng.random() < 0.25:
        misuse = {"kind": rng.choice(["raise", "raise", "shape", "callback_raise", "release",
                                      "stop"]),
                  "node": rng.randrange(n)}
    lazy = rng.randint(0, 1)
    threads = []
    # Now and then a crowd: more threads, more waits for one another.
    for _ in range(rng.randint(2, 8) if rng.random() < 0.92 else rng.randint(12, 16)):
        calls = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            api = rng.choice(APIS if lazy else APIS[:-1])
            if api == "fresh":
                calls.append({"api": api, "leaf": 0, "grads": [[rng.choice(GRADS)] * 2]})
                continue
            roots = [[n - 1, rng.randrange(nodes[n - 1]["n_in"])]]
            if n > 1 and rng.random() < 0.4:
                j = rng.randrange(n - 1)
                roots.append([j, rng.randrange(nodes[j]["n_in"])])
            grads = [[rng.choice(GRADS), rng.choice(GRADS)] for _ in roots]
            if rng.random() < 0.04:
                grads[0] = "bad"
            call = {"api": api, "roots": roots, "grads": grads}
            if api in ("grad", "execute_grad", "backward_inputs"):
                call["inputs"] = sorted(rng.sample(range(leaves), rng.randint(1, leaves)))
            calls.append(call)
        threads.append({"late": rng.random() < 0.3, "no_grad": rng.random() < 0.3,
                        "single": devices and rng.random() < 0.25, "calls": calls})
    if misuse and misuse["kind"] == "stop":
        # One thread stops the second Engine while the others may use it.
        thread = rng.choice(threads)
        thread["calls"].insert(rng.randint(0, len(thread["calls"])), {"api": "stop_other"})
        for thread in threads:
            for call in thread["calls"]:
                if call["api"] in ("execute", "backward") and rng.random() < 0.5:
                    call["api"] = "execute_other"
    if misuse and misuse["kind"] == "release":
        # One call lets the graph go (retain_graph=False) while the others use it.
        calls = [c for t in threads for c in t["calls"] if c["api"] != "fresh"]
        if calls:
            rng.choice(calls)["retain"] = False
    return {"leaves": leaves, "lazy_leaves": lazy, "nodes": nodes, "hooks": hooks,
            "rewires": rewires, "hook_churn": hook_churn, "misuse": misuse,
            "profile": rng.random() < 0.15, "anomaly": rng.random() < 0.1,
            "width": 1 if rng.random() < 0.6 else rng.choice([256, 4096]),
            "shared_grads": rng.random() < 0.3,
            "mutator": rng.random() < 0.25,
            "engine2": rng.choice(ENGINE_BOUNDS) if rng.random() < 0.5 else None,
            "engine": rng.choice(ENGINE_BOUNDS) if rng.random() < 0.5 else None,
            "switch": 1e-6 if rng.random() < 0.4 else None, "threads": threads}


def draw_programs(seed_value, count):
    rng = random.Random(seed_value)
    return [draw_program(rng) for _ in range(count)]


def deterministic(program):
    """Whether every call's outcome is fixed by the program: no rewire that
    changes what a node's edges are, no call that releases the graph."""
    return (all(rewire["how"] == "same" for rewire in program["rewires"])
            and (program.get("misuse") or {}).get("kind") not in ("release", "stop"))


# -- the exact outcomes --

def _add(total, value):
    return list(value) if total is None else [a + b for a, b in zip(total, value)]


def _scale(value, factor):
    return None if value is None else [v * factor for v in value]


def reached_leaves(program, starts):
    """The leaves a call from ``starts`` (node indices) may write, through
    edges and reentrant backwards."""
    nodes = program["nodes"]
    seen, todo, leaves = set(), list(starts), set()
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        for edge in nodes[i]["edges"]:
            if edge is not None:
                kind, j = edge["to"]
                (leaves.add if kind == "leaf" else todo.append)(j)
        if nodes[i]["reentrant"] is not None:
            todo.append(nodes[i]["reentrant"][0])
    return leaves


def simulate(program, roots, grads, inputs=None, accumulate=None):
    """One graph task: ``roots`` ([node, slot]) with ``grads``; ``inputs``
    (leaf indices) for grad mode (with ``accumulate``: backward(inputs=),
    which accumulates into those leaves only), else None (accumulate). Returns ``{"exc":
    type name or None, "leaves": what it adds to each leaf, "captured",
    "counts"}``; the counts include those of the reentrant backwards in it."""
    nodes, n_leaves = program["nodes"], program["leaves"]
    misuse = program.get("misuse") or {}
    out = {"exc": None, "leaves": [None] * n_leaves, "captured": None,
           "counts": {"applies": [0] * len(nodes), "post": [0] * len(nodes),
                      "post_acc": [0] * n_leaves, "callbacks": 0}}
    if any(g == "bad" for g in grads):
        out["exc"] = "RuntimeError"
        return out
    counts = out["counts"]
    hooks = program["hooks"]
    needed = [True] * len(nodes)
    if inputs is not None:
        for i, node in enumerate(nodes):
            needed[i] = any(edge is not None and (
                (edge["to"][0] == "leaf" and edge["to"][1] in inputs)
                or (edge["to"][0] == "node" and needed[edge["to"][1]])) for edge in node["edges"])
    slots = [[None] * node["n_in"] for node in nodes]
    reached = [False] * len(nodes)
    at_leaf = [None] * n_leaves
    leaf_reached = [False] * n_leaves
    for (j, k), grad in zip(roots, grads):
        slots[j][k] = _add(slots[j][k], grad)
        reached[j] = True
    callbacks = 0
    deferred = []  # backwards that final callbacks run
    for i in range(len(nodes) - 1, -1, -1):
        if not (reached[i] and needed[i]):
            continue
        node, grads_in = nodes[i], slots[i]
        for hook in hooks:
            if hook["kind"] == "tensor_pre" and hook["node"] == i:
                grads_in[0] = _scale(grads_in[0], 0.5)
        for hook in hooks:
            if hook["kind"] == "pre" and hook["node"] == i:
                grads_in = [_scale(g, 2.0) for g in grads_in]
        counts["applies"][i] += 1
        if node["reentrant"] is not None:
            if node.get("reentrant_in") == "callback":
                deferred.append(node["reentrant"])
            elif _nested(program, node["reentrant"], out):
                return out
        if node["callback"]:
            callbacks += 1
        if misuse.get("kind") == "raise" and misuse["node"] == i:
            out["exc"] = "FuzzError"
            return out
        if misuse.get("kind") == "shape" and misuse["node"] == i and any(node["edges"]):
            # validate_outputs checks a gradient against the slot it flows into.
            out["exc"] = "RuntimeError"
            return out
        if misuse.get("kind") == "callback_raise" and misuse["node"] == i:
            out["exc_at_end"] = "FuzzError"
        for index, (row, edge) in enumerate(zip(node["w"], node["edges"])):
            value = [0.0, 0.0]
            for weight, grad in zip(row, grads_in):
                if grad is not None:
                    value = [v + weight * g for v, g in zip(value, grad)]
            if index == 0 and node.get("const") is not None:
                value = list(node["const"])
            if edge is None:
                continue
            kind, j = edge["to"]
            if kind == "leaf":
                at_leaf[j] = _add(at_leaf[j], value)
                leaf_reached[j] = True
            else:
                slots[j][edge["nr"]] = _add(slots[j][edge["nr"]], value)
                reached[j] = True
        for hook in hooks:
            if hook["kind"] == "post" and hook["node"] == i:
                counts["post"][i] += 1
    if inputs is not None and not accumulate:
        out["captured"] = [at_leaf[leaf] for leaf in inputs]
    else:
        for leaf in range(n_leaves):
            if leaf_reached[leaf] and (inputs is None or leaf in inputs):
                out["leaves"][leaf] = _add(out["leaves"][leaf], at_leaf[leaf])
                for hook in hooks:
                    if hook["kind"] == "post_acc" and hook["leaf"] == leaf:
                        counts["post_acc"][leaf] += 1
    if out.pop("exc_at_end", None):
        out["exc"] = "FuzzError"
        return out
    for nested in deferred:
        if _nested(program, nested, out):
            return out
    counts["callbacks"] += callbacks
    return out


def _nested(program, nested, out):
    """A backward run inside ``out``'s graph task (from a node, a hook or a
    final callback): its parts added to ``out``'s; True if it raised."""
    j, k, grad = nested
    sub = simulate(program, [[j, k]], [grad])
    counts = out["counts"]
    for name, values in sub["counts"].items():
        if name == "callbacks":
            counts[name] += values
        else:
            counts[name] = [a + b for a, b in zip(counts[name], values)]
    for leaf, value in enumerate(sub["leaves"]):
        if value is not None:
            out["leaves"][leaf] = _add(out["leaves"][leaf], value)
    if sub["exc"]:
        out["exc"] = sub["exc"]
        return True
    return False


def expected_call(program, call):
    """``simulate`` for a thread's call; ``fresh`` adds 3 * its gradient to
    its lazy leaf."""
    if call["api"] == "fresh":
        return {"exc": None, "leaves": [None] * program["leaves"], "captured": None,
                "lazy": [[3.0 * v for v in call["grads"][0]]], "counts": None}
    inputs = call.get("inputs") if call["api"] in ("grad", "execute_grad", "backward_inputs") \
        else None
    result = simulate(program, call["roots"], call["grads"], inputs,
                      accumulate=call["api"] == "backward_inputs")
    if call["api"] in ("execute", "execute_other", "execute_dropped") and result["exc"] is None:
        result["captured"] = []
    return result


# -- judging one core's result --

def normalized(message):
    if message is None:
        return None
    return re.sub(r" at 0x[0-9a-fA-F]+", " at 0x...", message)


def _pool_busy(program, outcome):
    return (program.get("engine") is not None and outcome["exc"] == "RuntimeError"
            and "busy" in (outcome.get("message") or ""))


def problems_of(program, result):
    """What is wrong with one core's ``result`` for ``program``."""
    problems = []
    if result["check"] != "ok":
        problems.append(f"after the program: {result['check']}")
    if result.get("intact"):
        problems.append(f"written into: {result['intact']}")
    if result.get("grad_mode_wrong"):
        problems.append(f"grad mode: {result['grad_mode_wrong']}")
    if result["stuck"]:
        problems.append(f"still running after the joins: {result['stuck']}")
    calls = [(t, c, call) for t, thread in enumerate(program["threads"])
             for c, call in enumerate(thread["calls"])]
    outcomes = result["calls"]
    for t, thread in enumerate(program["threads"]):
        if len(outcomes[t]) != len(thread["calls"]):
            problems.append(f"thread {t}: {len(outcomes[t])} outcomes for "
                            f"{len(thread['calls'])} calls")
            return problems
    for t, thread in enumerate(outcomes):
        for c, outcome in enumerate(thread):
            if outcome["exc"] not in (None, "FuzzError", "RuntimeError"):
                problems.append(f"thread {t} call {c} raised {outcome['exc']}: "
                                f"{outcome.get('message')}\n{outcome.get('traceback', '')}")
            elif outcome["exc"] is not None and not outcome.get("message"):
                problems.append(f"thread {t} call {c} raised {outcome['exc']} with no message")
    if not deterministic(program):
        return problems
    leaves = [None] * program["leaves"]
    lazy = [None] * program.get("lazy_leaves", 0)
    tainted = set()
    counts = {"applies": [0] * len(program["nodes"]), "post": [0] * len(program["nodes"]),
              "post_acc": [0] * program["leaves"], "callbacks": 0}
    any_failed = False
    for t, c, call in calls:
        outcome = outcomes[t][c]
        expected = expected_call(program, call)
        where = f"thread {t} call {c} ({call['api']})"
        if outcome["exc"] is not None and _pool_busy(program, outcome):
            any_failed = True
            tainted |= reached_leaves(program, [j for j, _ in call.get("roots", ())])
            continue
        if outcome["exc"] != expected["exc"]:
            problems.append(f"{where}: raised {outcome['exc']} ({outcome.get('message')}), "
                            f"exactly {expected['exc']}")
            any_failed = True
            tainted |= reached_leaves(program, [j for j, _ in call.get("roots", ())])
            continue
        if expected["exc"] is not None:
            any_failed = True
            tainted |= reached_leaves(program, [j for j, _ in call.get("roots", ())])
            continue
        if not fuzz_interpreter_close(outcome["captured"], expected["captured"]):
            problems.append(f"{where}: returned {outcome['captured']}, "
                            f"exactly {expected['captured']}")
        for leaf, value in enumerate(expected["leaves"]):
            if value is not None:
                leaves[leaf] = _add(leaves[leaf], value)
        for value in expected.get("lazy") or ():
            lazy[call["leaf"]] = _add(lazy[call["leaf"]], value)
        if expected["counts"]:
            for name, values in expected["counts"].items():
                if name == "callbacks":
                    counts[name] += values
                else:
                    counts[name] = [a + b for a, b in zip(counts[name], values)]
    for leaf, value in enumerate(leaves):
        if leaf not in tainted and result["grads"][leaf] != value:
            problems.append(f"leaf {leaf}: .grad {result['grads'][leaf]}, exactly {value}")
    if result["lazy"] != lazy:
        problems.append(f"lazy leaves: .grad {result['lazy']}, exactly {lazy}")
    if not any_failed and result.get("profiled") is not None and \
            result["profiled"] != sum(result["counts"]["applies"]):
        problems.append(f"a profile saw {result['profiled']} applies of "
                        f"{sum(result['counts']['applies'])}")
    if not any_failed:
        for name, values in counts.items():
            if result["counts"][name] != values:
                problems.append(f"counts of {name}: {result['counts'][name]}, exactly {values}")
    return problems


def fuzz_interpreter_close(a, b):
    """Equal, as JSON (every value is exact)."""
    return json.dumps(a) == json.dumps(b)


ANOMALY_NOTE = "\nError detected in "


def notes_decided(program):
    """Whether the program fixes the anomaly notes on a call's error. Each
    node an error passes out of adds one; with a node that runs a reentrant
    backward, an error may reach the call both from its node and through
    that backward, with one more note, and which of the two the call
    raises first is the schedule's."""
    return not program.get("anomaly") or all(node["reentrant"] is None
                                             for node in program["nodes"])


def without_anomaly_notes(message):
    return None if message is None else message.split(ANOMALY_NOTE)[0]


def disagreements(program, compiled, pure):
    """Where both cores raised the same type for a call, other words (in a
    program whose outcomes the schedule does not decide; where it decides
    how many anomaly notes an error has, the words before them)."""
    problems = []
    if not deterministic(program):
        return problems
    words = normalized if notes_decided(program) else (
        lambda message: normalized(without_anomaly_notes(message)))
    for t, (ours, theirs) in enumerate(zip(compiled["calls"], pure["calls"])):
        for c, (a, b) in enumerate(zip(ours, theirs)):
            if _pool_busy(program, a) or _pool_busy(program, b):
                continue
            if a["exc"] and a["exc"] == b["exc"] and \
                    words(a.get("message")) != words(b.get("message")):
                problems.append(f"thread {t} call {c}: both raised {a['exc']}, in other words: "
                                f"compiled {a.get('message')!r}; pure {b.get('message')!r}")
    return problems


# -- running children --

def env_for(core, plant=None, program_timeout=PROGRAM_TIMEOUT, join_s=None, quiesce_s=None):
    env = fuzz_interpreter.child_env(core, program_timeout)
    env.pop("PYENGINE_THREAD_FUZZ_PLANT", None)
    if plant:
        env["PYENGINE_THREAD_FUZZ_PLANT"] = plant
    if join_s is not None:
        env["PYENGINE_THREAD_FUZZ_JOIN_S"] = str(join_s)
    if quiesce_s is not None:
        env["PYENGINE_THREAD_FUZZ_QUIESCE_S"] = str(quiesce_s)
    return env


def run_children(core, programs, plant=None, program_timeout=PROGRAM_TIMEOUT, join_s=None,
                 quiesce_s=None):
    """Runs ``programs`` on ``core``: ``(results by index, crashes)``, a
    crash being ``{"i", "why", "stderr"}`` (a new child runs the rest)."""
    return fuzz_interpreter.run_in_children(
        INTERPRETER, programs, env_for(core, plant, program_timeout, join_s, quiesce_s),
        program_timeout)


def failures_of(programs, outcomes):
    """``outcomes``: ``{core: (results, crashes)}``. A list of ``{"i",
    "problems"}``, one per failing program."""
    failures = {}
    for core, (results, crashes) in outcomes.items():
        for crash in crashes:
            failures.setdefault(crash["i"], []).append(
                f"{core} core: {crash['why']}\nstderr tail:\n{crash['stderr'][-3000:]}")
        for i, result in results.items():
            for problem in problems_of(programs[i], result):
                failures.setdefault(i, []).append(f"{core} core: {problem}")
    if len(outcomes) == 2:
        (_, (a, _)), (_, (b, _)) = outcomes.items()
        for i in set(a) & set(b):
            for problem in disagreements(programs[i], a[i], b[i]):
                failures.setdefault(i, []).append(problem)
    return [{"i": i, "problems": problems} for i, problems in sorted(failures.items())]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", choices=("compiled", "pure", "both"), default="both")
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=200, help="programs per child process")
    parser.add_argument("--replay", help="a JSON file with a list of programs to run")
    parser.add_argument("--save", help="write failing programs to this JSON file")
    args = parser.parse_args(argv)
    if args.replay:
        with open(args.replay) as handle:
            programs = json.load(handle)
    else:
        programs = draw_programs(args.seed, args.programs)
    cores = CORES if args.core == "both" else (args.core,)
    started = time.monotonic()
    failures = []
    for offset in range(0, len(programs), args.chunk):
        part = programs[offset: offset + args.chunk]
        outcomes = {core: run_children(core, part) for core in cores}
        for failure in failures_of(part, outcomes):
            failure["i"] += offset
            failures.append(failure)
    print(f"{'+'.join(cores)}: {len(programs)} programs (seed {args.seed}) in "
          f"{time.monotonic() - started:.0f} s, {len(failures)} failing", flush=True)
    for failure in failures[:20]:
        print(json.dumps({"i": failure["i"], "problems": failure["problems"]})[:4000])
        print("program: " + json.dumps(programs[failure["i"]]))
    if args.save and failures:
        with open(args.save, "w") as handle:
            json.dump([programs[f["i"]] for f in failures], handle)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
