#!/usr/bin/env python
"""What the profiler hook costs the compiled loop when no profiler is active.

    python benchmarks/profiler_overhead.py [--before REV] [--after REV ...]
                                           [--nodes 100000] [--repeats 21]
                                           [--calls 5] [--markdown] [--json FILE]

Goal (issue 8): with no profiler active, the 100k chain's backward is
within 3% of its time in a build without the feature. The hook is already
in the build, so "without the feature" is the commit before it: by default
``--before`` is the parent of the commit that added ``set_profiler`` to
``pyengine/_state.pyx``, and ``--after`` is that commit (the hook's own
cost, nothing else changed) and ``HEAD`` (the build as it is now). Every
revision is exported with ``git archive`` into ``--build-dir`` (default: a
folder under the system's temp dir) and compiled there with the same
command (``setup.py build_ext --inplace``, the flags of setup.py), so the
builds differ only by their sources. A build is kept and reused by commit.

How it measures (as ``python -m pyengine bench`` does):

- One worker process per build (``PYTHONPATH`` = its tree,
  ``PYENGINE_PURE=0``; a worker that did not get the compiled core is an
  error). Each builds its own chain of ``--nodes`` pass-through nodes with
  that tree's ``pyengine/bench/graphs.py`` (``benchmarks/graphs.py`` in
  older trees), runs one backward and checks the leaf's gradient before
  timing, and again after.
- A sample is the wall time of ``--calls`` consecutive backward calls
  (``Engine.execute``), divided by nodes x calls, after ``gc.collect()``
  with the graph frozen out of the GC's reach, averaged over the
  ``--processes`` worker processes of the build (3 by default): where a
  process's memory lands moves its figures by several percent, run to run,
  whatever the build.
- Samples are interleaved: each repeat takes one sample of each build, in
  alternating order (before, after..., then after..., before), so drift and
  load from other processes fall on every build alike.
- Three figures per sample: the calling thread's CPU time
  (``time.thread_time_ns``; every node of the chain runs on that thread,
  and time spent descheduled for other processes is left out), the wall
  time, and the fastest call's wall time; all per node.
- Reported: median and min per build, and for each after-build the median
  of its per-repeat ratios after/before (two samples taken back to back).
  The goal is judged on the CPU-time ratio, the figure a shared machine
  disturbs least; the wall-time ratios are printed beside it. The exit
  status is 0 when every after-build meets the goal.
- ``--callgrind`` also counts the instructions per node executed inside
  ``Engine.execute`` in every build (valgrind; a 20k chain, 5 calls, with
  that tree's ``benchmarks/profile_chain.py``): the deterministic figure,
  which no other process disturbs.
- ``--control`` adds an A/A arm: the before-build again, in processes of
  its own, whose ratio to the first shows how far apart two identical
  builds measure on this machine (the method's noise floor).
- For reference, the last after-build also takes samples with the profiler
  on: the raw hook with a callback that does nothing, and a full
  ``pyengine.profile()`` (the working tree's ``pyengine/profiler.py`` is
  copied into that tree when its commit lacks it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GOAL_RATIO = 1.03
# Per sample: CPU time of the calling thread (the goal's figure), wall time,
# and the fastest call's wall time; all in us per node.
METRICS = ("cpu", "wall", "wall_min")


# -- builds ---------------------------------------------------------------------------

def git(*args) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def hook_commit() -> str:
    """The commit that added set_profiler to the compiled core's state (short form)."""
    commits = git("log", "--format=%h", "-S", "def set_profiler", "--", "pyengine/_state.pyx")
    if not commits:
        raise SystemExit("no commit adds set_profiler to pyengine/_state.pyx: give --before")
    return commits.splitlines()[-1]


def build(rev: str, build_dir: str) -> str:
    """A tree of ``rev`` with its compiled core built in place; reused by commit."""
    sha = git("rev-parse", rev)
    tree = os.path.join(build_dir, sha[:12])
    marker = os.path.join(tree, ".built")
    if os.path.exists(marker):
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", sha], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    print(f"building {rev} ({sha[:12]}) in {tree} ...", file=sys.stderr, flush=True)
    result = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"building {rev} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    open(marker, "w").close()
    return tree


# -- the worker -------------------------------------------------------------------------

def worker(args) -> None:
    """Serve samples over stdin/stdout, one JSON line each."""
    sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "benchmarks"))
    try:
        from pyengine.bench.graphs import chain
    except ImportError:  # a tree older than pyengine.bench: benchmarks/graphs.py
        from graphs import chain

    import pyengine
    from pyengine import _core

    graph = chain(args.nodes)
    graph.run_checked()
    gc.collect()
    gc.freeze()
    leaf, run = graph.leaf, graph.run

    def sample(calls):
        """us per node: wall time of the calls, the fastest call's wall
        time, and the calling thread's CPU time (every node of the chain runs
        on it), which time spent descheduled for other processes leaves out."""
        gc.collect()
        walls, cpus = [], []
        for _ in range(calls):
            leaf.grad = None
            cpu = time.thread_time_ns()
            wall = time.perf_counter_ns()
            run()
            walls.append(time.perf_counter_ns() - wall)
            cpus.append(time.thread_time_ns() - cpu)
        per_node = 1e-3 / graph.nodes
        return {"cpu": sum(cpus) / calls * per_node, "wall": sum(walls) / calls * per_node,
                "wall_min": min(walls) * per_node}

    def noop(node, start_ns, end_ns):
        pass

    has_hook = hasattr(_core, "set_profiler")
    print(json.dumps({"implementation": pyengine.IMPLEMENTATION, "has_hook": has_hook,
                      "has_profile": hasattr(pyengine, "profile") or _has_profiler_module()}),
          flush=True)
    for line in sys.stdin:
        what = line.strip()
        try:
            if what == "off":
                reply = sample(args.calls)
            elif what == "hook":
                previous = _core.set_profiler(noop)
                try:
                    reply = sample(args.calls)
                finally:
                    _core.set_profiler(previous)
            elif what == "profile":
                from pyengine.profiler import profile

                with profile() as prof:
                    reply = sample(args.calls)
                reply["events"] = len(prof.events)
            elif what == "check":
                graph.run_checked()
                reply = {"ok": True}
            else:
                break
        except Exception as error:
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), flush=True)


def _has_profiler_module() -> bool:
    import importlib.util

    return importlib.util.find_spec("pyengine.profiler") is not None


class Worker:
    def __init__(self, tree: str, args):
        env = dict(os.environ, PYTHONPATH=tree, PYENGINE_PURE="0")
        command = [sys.executable, os.path.abspath(__file__), "--worker",
                   "--nodes", str(args.nodes), "--calls", str(args.calls)]
        self.proc = subprocess.Popen(command, env=env, cwd=tree, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.hello = self.read()
        if self.hello.get("implementation") != "compiled":
            raise SystemExit(f"the worker in {tree} did not get the compiled core: {self.hello}")

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, what: str) -> dict:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        reply = self.read()
        if "error" in reply:
            raise SystemExit(f"worker: {reply['error']}")
        return reply

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Pool:
    """``--processes`` workers of one build. A sample is the mean of one sample
    from each: a process's memory layout (address randomization, heap) moves
    its figures by a few percent, as much as the hook could, so every build
    is measured in several processes."""

    def __init__(self, tree: str, args):
        self.workers = [Worker(tree, args) for _ in range(args.processes)]
        self.hello = self.workers[0].hello

    def sample(self, what: str) -> dict:
        replies = [worker_.ask(what) for worker_ in self.workers]
        mean = {metric: statistics.fmean(reply[metric] for reply in replies) for metric in METRICS}
        if "events" in replies[0]:
            mean["events"] = min(reply["events"] for reply in replies)
        return mean

    def check_and_close(self):
        for worker_ in self.workers:
            worker_.ask("check")
            worker_.close()


# -- the parent ---------------------------------------------------------------------------

def load_average() -> str:
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "n/a"


def measure(args) -> dict:
    before_rev = args.before or hook_commit() + "^"
    after_revs = args.after or [hook_commit(), "HEAD"]
    shas = {}
    for rev in after_revs:  # the same commit twice is one arm
        shas.setdefault(git("rev-parse", rev), rev)
    after_revs = list(shas.values())
    build_dir = args.build_dir or os.path.join(tempfile.gettempdir(), "pyengine-profiler-overhead")
    before_tree = build(before_rev, build_dir)
    after_trees = [build(rev, build_dir) for rev in after_revs]
    # The profiler-on reference runs in the last after-build.
    profiler_source = os.path.join(ROOT, "pyengine", "profiler.py")
    copied = False
    in_commit = subprocess.run(["git", "-C", ROOT, "cat-file", "-e",
                                f"{after_revs[-1]}:pyengine/profiler.py"],
                               capture_output=True).returncode == 0
    if not in_commit and os.path.exists(profiler_source):
        shutil.copy(profiler_source, os.path.join(after_trees[-1], "pyengine", "profiler.py"))
        copied = True
    started = time.time()
    load_start = load_average()
    before = Pool(before_tree, args)
    afters = [Pool(tree, args) for tree in after_trees]
    if before.hello["has_hook"]:
        raise SystemExit(f"--before {before_rev} already has the profiler hook")
    for rev, worker_ in zip(after_revs, afters):
        if not worker_.hello["has_hook"]:
            raise SystemExit(f"--after {rev} has no profiler hook")
    arms = [("before", before)] + [(f"after:{rev}", worker_) for rev, worker_ in zip(after_revs, afters)]
    if args.control:
        # A/A: the before-build again, in processes of its own: how far apart
        # two identical builds measure here (process layout, load).
        arms.insert(1, ("control", Pool(before_tree, args)))
    names = [name for name, _ in arms] + ["hook", "profile"]
    samples = {metric: {name: [] for name in names} for metric in METRICS}
    ratios = {metric: {name: [] for name, _ in arms[1:]} for metric in METRICS}
    reference = afters[-1]
    for repeat in range(args.repeats):
        order = arms if repeat % 2 == 0 else arms[::-1]
        taken = {}
        for name, arm in order:
            taken[name] = arm.sample("off")
        for metric in METRICS:
            for name, _ in arms:
                samples[metric][name].append(taken[name][metric])
            for name in ratios[metric]:
                ratios[metric][name].append(taken[name][metric] / taken["before"][metric])
        if repeat % 3 == 0:  # the profiler-on figures are for reference only
            extra = {"hook": reference.sample("hook")}
            if reference.hello["has_profile"]:
                extra["profile"] = reference.sample("profile")
                if extra["profile"]["events"] != args.calls * (args.nodes + 1):
                    raise SystemExit(f"profile recorded {extra['profile']['events']} events, "
                                     f"expected {args.calls * (args.nodes + 1)}")
            for name, reply in extra.items():
                for metric in METRICS:
                    samples[metric][name].append(reply[metric])
    for _, arm in arms:
        arm.check_and_close()
    instructions = {}
    if args.callgrind:
        if shutil.which("valgrind") is None:
            raise SystemExit("--callgrind needs valgrind")
        for name, tree in [("before", before_tree)] + [(f"after:{rev}", tree) for rev, tree
                                                         in zip(after_revs, after_trees)]:
            instructions[name] = callgrind(tree, args.callgrind_nodes, 5)
    return {
        "before": {"rev": before_rev, "sha": git("rev-parse", before_rev)},
        "after": [{"rev": rev, "sha": git("rev-parse", rev)} for rev in after_revs],
        "profiler_py_copied_from_working_tree": copied,
        "nodes": args.nodes, "calls_per_sample": args.calls, "repeats": args.repeats,
        "processes_per_build": args.processes,
        "samples_us_per_node": samples, "ratios": ratios, "instructions_per_node": instructions,
        "callgrind_nodes": args.callgrind_nodes,
        "load_average": {"start": load_start, "end": load_average()},
        "seconds": time.time() - started, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
    }


def callgrind(tree: str, nodes: int, calls: int) -> float:
    """Instructions per node executed inside ``Engine.execute`` (deterministic):
    valgrind's callgrind on that tree's benchmarks/profile_chain.py."""
    out = os.path.join(tree, ".callgrind.out")
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
               "--collect-atstart=no", "--toggle-collect=*Engine_3execute*", sys.executable,
               "benchmarks/profile_chain.py", "--kind", "chain", "--n", str(nodes),
               "--calls", str(calls)]
    env = dict(os.environ, PYTHONPATH=tree, PYENGINE_PURE="0")
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"callgrind failed in {tree}:\n{result.stderr[-2000:]}")
    with open(out) as file:
        totals = next(int(line.split()[1]) for line in file if line.startswith("totals:"))
    return totals / (calls * (nodes + 1))  # the chain's nodes and the leaf's AccumulateGrad


def report(result: dict, markdown: bool) -> str:
    samples, ratios = result["samples_us_per_node"], result["ratios"]

    def stats(metric, name):
        values = samples[metric][name]
        if not values:
            return "n/a"
        return f"{statistics.median(values):.4f} ({min(values):.4f})"

    def paired(metric, name):
        return f"{statistics.median(ratios[metric][name]):.4f}"

    def versus_before(metric, name):
        values = samples[metric][name]
        return f"{statistics.median(values) / statistics.median(samples[metric]['before']):.2f}*"

    header = ["build", "CPU us/node, median (min)", "wall us/node, median (min)",
              "CPU after/before", "wall after/before", "fastest-call wall after/before"]
    rows = [[f"before: {result['before']['rev']} ({result['before']['sha'][:9]}), no hook",
             stats("cpu", "before"), stats("wall", "before"), "1", "1", "1"]]
    for arm in result["after"]:
        name = f"after:{arm['rev']}"
        rows.append([f"{arm['rev']} ({arm['sha'][:9]}), hook, no profiler", stats("cpu", name),
                     stats("wall", name), paired("cpu", name), paired("wall", name),
                     paired("wall_min", name)])
    if "control" in ratios["cpu"]:
        rows.insert(1, ["A/A control: the before-build again, other processes", stats("cpu", "control"),
                        stats("wall", "control"), paired("cpu", "control"),
                        paired("wall", "control"), paired("wall_min", "control")])
    last = result["after"][-1]["rev"]
    for key, text in (("hook", f"{last}, hook set to a no-op callback"),
                      ("profile", f"{last}, inside pyengine.profile() (events resolved too)")):
        if samples["cpu"][key]:
            rows.append([text, stats("cpu", key), stats("wall", key), versus_before("cpu", key),
                         versus_before("wall", key), versus_before("wall_min", key)])
    instructions = result.get("instructions_per_node") or {}
    if instructions:
        header.append("instructions/node (callgrind)")
        names = (["before"] + (["control"] if "control" in ratios["cpu"] else [])
                 + [f"after:{arm['rev']}" for arm in result["after"]])
        for row, name in zip(rows, names):
            if name == "control":
                row.append("(the before-build)")
                continue
            count = instructions[name]
            row.append(f"{count:,.1f} ({count / instructions['before'] - 1:+.2%})")
        for row in rows:
            row.extend([""] * (len(header) - len(row)))
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row))
                 for row in [header] + rows]
    lines.append("")
    lines.append("after/before: the median over repeats of the ratio of two samples taken back "
                 "to back; * a ratio of medians (those samples are taken every third repeat).")
    for arm in result["after"]:
        name = f"after:{arm['rev']}"
        values = ratios["cpu"][name]
        ratio = statistics.median(values)
        verdict = "met" if ratio <= GOAL_RATIO else "MISSED"
        lines.append(f"Goal, {arm['rev']}: no profiler, the {result['nodes']:,}-node chain within "
                     f"{(GOAL_RATIO - 1) * 100:.0f}% of the build without the hook: {verdict} "
                     f"(CPU time, median paired ratio {ratio:.4f}; paired ratios {min(values):.4f} "
                     f"to {max(values):.4f}).")
    lines.append(f"{result['repeats']} repeats x {result['processes_per_build']} processes per "
                 f"build x {result['calls_per_sample']} backward calls per sample, builds "
                 f"interleaved; load average {result['load_average']['start']} at the start, "
                 f"{result['load_average']['end']} at the end; "
                 f"{result['seconds']:.0f} s; Python {result['python']}, {result['machine']}.")
    return "\n".join(lines)


def goal_met(result: dict) -> bool:
    return all(statistics.median(values) <= GOAL_RATIO
               for name, values in result["ratios"]["cpu"].items() if name != "control")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the build without the hook (default: the parent of the "
                                         "commit that added set_profiler)")
    parser.add_argument("--after", nargs="+", help="builds with the hook (default: the commit "
                                                   "that added it, and HEAD)")
    parser.add_argument("--build-dir", help="where the builds are kept")
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=5, help="backward calls per sample")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--processes", type=int, default=3,
                        help="worker processes per build; a sample is their mean")
    parser.add_argument("--control", action="store_true",
                        help="add an A/A control: the before-build again, in processes of its own")
    parser.add_argument("--callgrind", action="store_true",
                        help="also count instructions per node with valgrind (deterministic)")
    parser.add_argument("--callgrind-nodes", type=int, default=20_000,
                        help="chain length under callgrind (5 calls)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", help="also write the raw samples here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    result = measure(args)
    print(report(result, args.markdown))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=1)
    return 0 if goal_met(result) else 1


if __name__ == "__main__":
    sys.exit(main())
