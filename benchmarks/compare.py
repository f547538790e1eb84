#!/usr/bin/env python
"""Compiled core vs pure twin (vs PyTorch), in one table.

    python benchmarks/compare.py [--sizes 10k 100k 1M] [--wide-sizes 10k 100k]
                                 [--repeats 5] [--markdown] [--pure-1m]
                                 [--no-torch] [--no-memory] [--json FILE]

The choice between the compiled core and the pure twin is made when
``pyengine`` is imported, so every measurement runs in a subprocess of this
script (``--worker ...``): one with ``PYENGINE_PURE=0`` (the compiled core;
it is reported as an error if it fell back to the twin) and one with
``PYENGINE_PURE=1``, both alive at once but never computing at once: the
parent asks them for samples in turn (repeat 1: chain 10k compiled, chain
10k pure, chain 100k compiled, ...; repeat 2: ...), so that load from other
processes on a shared machine falls on both cores and all sizes alike and
the ratios taken from one run stay meaningful. Then one fresh process per
memory figure, and one for PyTorch.

What is measured (see benchmarks/README.md):

- time per node: one sample is the wall time (``time.perf_counter``) of
  ``ceil(100,000 / nodes)`` consecutive backward calls through
  ``Engine.execute([root_edge], [grad], False, False, True)`` on a graph
  built beforehand, divided by nodes x calls. Before timing, one backward
  runs and the leaf's gradient is checked against the analytic value; it is
  checked again after timing. The leaf's ``.grad`` is set to None before
  each call (inside the timed loop: one attribute store). All graphs are
  built first and then frozen out of the cyclic GC (``gc.freeze()``);
  ``gc.collect()`` runs before each sample and the GC stays enabled while
  timing.
  Reported: median (min-max) over ``--repeats`` samples.
- fixed cost: the one-node graph (node -> leaf), 10,000 calls per sample,
  through ``Engine.execute`` and through ``pyengine.backward``.
- memory: a fresh process builds the graph, then runs one backward with the
  peak RSS reset just before (``/proc/self/clear_refs`` = 5; VmHWM after
  minus VmRSS before: everything, C++ maps and Python objects alike; falls
  back to the ``ru_maxrss`` delta where clear_refs is not writable), then a
  second backward under ``tracemalloc`` (peak of Python-allocator bytes
  only: it cannot see the compiled core's C++ containers).
- PyTorch (reference, same shapes, float64 (3,)): a chain of
  ``y = y.view_as(y)`` and a chain of a Python ``torch.autograd.Function``
  whose backward returns its gradient, timed through
  ``torch.autograd.backward``; the one-op graph's fixed cost through
  ``torch.autograd.backward`` and through the engine's ``run_backward``.

Goals (printed as met/missed): compiled <= 0.3 us/node on the 100k chain,
<= 0.4 on the wide 1000x10 graph, fixed cost <= 3 us, compiled >= 5x faster
than pure on every graph, chain per-node cost at 1M within 1.3x of 10k.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# One sample covers at least this many node executions (several backward
# calls on small graphs), so that a sample lasts long enough to time.
NODES_PER_SAMPLE = 100_000
FIXED_CALLS_PER_SAMPLE = 10_000
WORKER_TIMEOUT_S = 1800

GOAL_CHAIN_100K_US = 0.3
GOAL_WIDE_US = 0.4
GOAL_FIXED_US = 3.0
GOAL_SPEEDUP = 5.0
GOAL_SCALING = 1.3


# -- sizes ----------------------------------------------------------------------------

def parse_size(text: str) -> int:
    text = text.strip().lower().replace("_", "").replace(",", "")
    scale = 1
    if text.endswith("k"):
        scale, text = 1_000, text[:-1]
    elif text.endswith("m"):
        scale, text = 1_000_000, text[:-1]
    value = int(float(text) * scale)
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def size_label(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1_000 and n % 1_000 == 0:
        return f"{n // 1_000}k"
    return str(n)


def summarize(samples):
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "samples": samples}


# -- workers (subprocesses) -----------------------------------------------------------

def _time_calls(run_once, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run_once()
    return time.perf_counter() - start


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class _PyengineServer:
    """The worker of one core: builds every graph once, then answers the
    parent's requests one line at a time (see :func:`worker_pyengine`)."""

    def __init__(self, args):
        sys.path.insert(0, HERE)
        from graphs import build

        import pyengine

        self.pyengine = pyengine
        self.graphs = {}
        self.rows = []
        specs = [("chain", n) for n in args.sizes] + [("wide", n) for n in args.wide_sizes]
        for kind, n in specs:
            row = {"kind": kind, "size": n}
            try:
                graph = build(kind, n)
                row["name"], row["nodes"] = graph.name, graph.nodes
                graph.run_checked()  # the oracle, before any timing
                row["calls_per_sample"] = max(1, math.ceil(NODES_PER_SAMPLE / graph.nodes))
                self.graphs[f"{kind}:{n}"] = graph
            except Exception as error:  # reported in the table, never a time
                row["error"] = _error_text(error)
            self.rows.append(row)
        self.fixed_error = None
        try:
            self.single = build("single", 1)
            self.single.run_checked()
        except Exception as error:
            self.single = None
            self.fixed_error = _error_text(error)
        # The graphs live until the end: keep the cyclic GC off them, so that
        # the gc.collect() before each sample is cheap and the same for all.
        gc.collect()
        gc.freeze()

    def hello(self):
        return {"implementation": self.pyengine.IMPLEMENTATION, "rows": self.rows,
                "fixed_error": self.fixed_error}

    def sample(self, key):
        """One sample of graph ``key``: us per node."""
        graph = self.graphs[key]
        leaf, run = graph.leaf, graph.run
        calls = max(1, math.ceil(NODES_PER_SAMPLE / graph.nodes))

        def once():
            leaf.grad = None
            run()

        gc.collect()
        return _time_calls(once, calls) / (calls * graph.nodes) * 1e6

    def fixed(self, how):
        """One sample of the fixed cost: us per backward on the one-node graph."""
        graph = self.single
        root_edge, grad, leaf = graph.root_edge, graph.grad, graph.leaf
        if how == "execute":
            execute = self.pyengine.get_default_engine().execute

            def once():
                leaf.grad = None
                execute([root_edge], [grad], False, False, True)
        else:
            backward = self.pyengine.backward

            def once():
                leaf.grad = None
                backward(root_edge, grad)

        once()
        graph.check()
        gc.collect()
        return _time_calls(once, FIXED_CALLS_PER_SAMPLE) / FIXED_CALLS_PER_SAMPLE * 1e6

    def check(self):
        """Re-run the oracle on every graph after the timed runs."""
        errors = {}
        for key, graph in list(self.graphs.items()) + [("single", self.single)]:
            if graph is None:
                continue
            try:
                graph.run_checked()
            except Exception as error:
                errors[key] = _error_text(error)
        return {"errors": errors}


def worker_pyengine(args) -> None:
    """Serve the parent: one JSON line per request read from stdin.

    Requests: ``sample <kind>:<size>``, ``fixed execute|backward``,
    ``check``, ``quit``. The first line written is the hello: the
    implementation imported and the graphs built (or their errors).
    """
    server = _PyengineServer(args)
    print(json.dumps(server.hello()), flush=True)
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        try:
            if command == "sample":
                reply = {"us": server.sample(argument)}
            elif command == "fixed":
                reply = {"us": server.fixed(argument)}
            elif command == "check":
                reply = server.check()
            elif command == "quit":
                break
            else:
                reply = {"error": f"unknown request {line.strip()!r}"}
        except Exception as error:
            reply = {"error": _error_text(error)}
        print(json.dumps(reply), flush=True)


def _read_status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker_memory(args) -> dict:
    """Peak memory of one backward on a freshly built graph, this process's core."""
    import resource
    import tracemalloc

    sys.path.insert(0, HERE)
    from graphs import build

    import pyengine

    out = {"implementation": pyengine.IMPLEMENTATION, "kind": args.kind, "size": args.n}
    try:
        graph = build(args.kind, args.n)
        out["name"], out["nodes"] = graph.name, graph.nodes
        gc.collect()
        graph.reset()
        # 1. Peak RSS of the first backward: all memory, C++ and Python.
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # reset VmHWM to the current RSS
            before = _read_status("VmRSS")
            graph.run()
            out["rss_peak_delta"] = _read_status("VmHWM") - before
            out["rss_method"] = "VmHWM-VmRSS"
        except OSError:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            graph.run()
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            out["rss_peak_delta"] = after - before
            out["rss_method"] = "ru_maxrss"
        graph.check()
        graph.reset()
        gc.collect()
        # 2. tracemalloc peak of a second backward: Python allocator only.
        tracemalloc.start()
        graph.run()
        out["tracemalloc_peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        graph.check()
    except Exception as error:
        out["error"] = _error_text(error)
    return out


def worker_torch(args) -> dict:
    """The same chains in PyTorch, for reference."""
    import torch

    torch.set_num_threads(1)
    out = {"torch": torch.__version__, "rows": [], "fixed": {}}

    class PassFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def build_view(x, n):
        y = x
        for _ in range(n):
            y = y.view_as(y)
        return y

    def build_function(x, n):
        y = x
        apply = PassFn.apply
        for _ in range(n):
            y = apply(y)
        return y

    ones = torch.ones(3, dtype=torch.float64)
    specs = [("view_as chain", build_view, n) for n in args.sizes]
    specs += [("Function chain", build_function, n) for n in args.function_sizes]
    for name, builder, n in specs:
        row = {"name": f"{name} {size_label(n)}", "nodes": n}
        try:
            x = torch.zeros(3, dtype=torch.float64, requires_grad=True)
            y = builder(x, n)

            def once(x=x, y=y):
                x.grad = None
                torch.autograd.backward((y,), (ones,))

            once()
            if not torch.equal(x.grad, ones):
                raise AssertionError(f"torch {name}: x.grad is {x.grad}")
            calls = max(1, math.ceil(NODES_PER_SAMPLE / n))
            samples = []
            for _ in range(args.repeats):
                gc.collect()
                samples.append(_time_calls(once, calls) / (calls * n) * 1e6)
            row["us_per_node"] = summarize(samples)
        except Exception as error:
            row["error"] = _error_text(error)
        finally:
            x = y = once = None
            gc.collect()
        out["rows"].append(row)
        print(f"  torch: {row['name']} done", file=sys.stderr, flush=True)

    x = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    y = x.view_as(x)
    run_backward = torch.autograd.Variable._execution_engine.run_backward

    def via_api():
        x.grad = None
        torch.autograd.backward((y,), (ones,))

    def via_engine():
        x.grad = None
        run_backward((y,), (ones,), False, False, (), allow_unreachable=True, accumulate_grad=True)

    for name, fn in (("backward", via_api), ("run_backward", via_engine)):
        fn()
        if not torch.equal(x.grad, ones):
            out["fixed"][name] = {"error": f"x.grad is {x.grad}"}
            continue
        samples = []
        for _ in range(args.repeats):
            gc.collect()
            samples.append(_time_calls(fn, FIXED_CALLS_PER_SAMPLE) / FIXED_CALLS_PER_SAMPLE * 1e6)
        out["fixed"][name] = summarize(samples)
    return out


# -- the parent ------------------------------------------------------------------------

def _worker_env(pure: bool | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if pure is not None:
        env["PYENGINE_PURE"] = "1" if pure else "0"
    return env


def _expected_implementation(result: dict, pure: bool | None) -> dict:
    expected = {True: "pure", False: "compiled"}.get(pure)
    if expected and result.get("implementation") != expected:
        return {"error": f"worker asked for the {expected} core imported "
                         f"{result.get('implementation')!r}"}
    return result


def run_worker(kind: str, pure: bool | None, extra: list[str]) -> dict:
    """Run a one-shot worker (memory, torch) and return its JSON result."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", kind] + extra
    proc = subprocess.run(command, env=_worker_env(pure), stdout=subprocess.PIPE, text=True,
                          timeout=WORKER_TIMEOUT_S)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"worker {kind} (pure={pure}) exited with {proc.returncode}"}
    return _expected_implementation(json.loads(lines[-1]), pure)


class _Server:
    """The parent's end of a :func:`worker_pyengine` process."""

    def __init__(self, pure: bool, extra: list[str]):
        command = [sys.executable, os.path.abspath(__file__), "--worker", "pyengine"] + extra
        self.proc = subprocess.Popen(command, env=_worker_env(pure), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.hello = self._read()
        if "error" not in self.hello:
            self.hello = _expected_implementation(self.hello, pure)

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                return {"error": f"worker exited with {self.proc.wait()}"}
            if line.startswith("{"):
                return json.loads(line)

    def request(self, text: str) -> dict:
        if self.proc.poll() is not None:
            return {"error": f"worker exited with {self.proc.returncode}"}
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_interleaved(args, pure_sizes, pure_wide):
    """Time both cores with their samples interleaved: for each repeat, each
    graph, one sample from the compiled worker and then one from the pure
    worker. Load from elsewhere then hits both cores and all sizes alike,
    which keeps ratios taken from one run meaningful on a shared machine."""

    def extra(sizes, wide_sizes):
        return ["--sizes", *map(str, sizes), "--wide-sizes", *map(str, wide_sizes)]

    print("building graphs (compiled core, then pure twin)...", file=sys.stderr, flush=True)
    servers = {"compiled": _Server(False, extra(args.sizes, args.wide_sizes))}
    servers["pure"] = _Server(True, extra(pure_sizes, pure_wide))
    results = {}
    try:
        for impl, server in servers.items():
            hello = server.hello
            if "error" in hello:
                error = hello["error"]
                results[impl] = {"error": error, "rows": [], "fixed": {"error": error}}
                continue
            results[impl] = {"implementation": hello["implementation"], "rows": hello["rows"],
                             "fixed": {}, "samples": {}}
        keys = []
        for result in results.values():
            for row in result["rows"]:
                key = f"{row['kind']}:{row['size']}"
                if "error" not in row and key not in keys:
                    keys.append(key)
        keys.sort(key=lambda k: (k.split(":")[0] != "chain", int(k.split(":")[1])))
        live = {impl: server for impl, server in servers.items() if "error" not in results[impl]}
        for repeat in range(args.repeats):
            print(f"  repeat {repeat + 1}/{args.repeats}", file=sys.stderr, flush=True)
            for key in keys:
                for impl, server in live.items():
                    row = next((r for r in results[impl]["rows"]
                                if f"{r['kind']}:{r['size']}" == key), None)
                    if row is None or "error" in row:
                        continue
                    reply = server.request(f"sample {key}")
                    if "error" in reply:
                        row["error"] = reply["error"]
                    else:
                        results[impl]["samples"].setdefault(key, []).append(reply["us"])
            for how in ("execute", "backward"):
                for impl, server in live.items():
                    fixed = results[impl]["fixed"]
                    if "error" in fixed or server.hello.get("fixed_error"):
                        fixed["error"] = fixed.get("error") or server.hello["fixed_error"]
                        continue
                    reply = server.request(f"fixed {how}")
                    if "error" in reply:
                        fixed["error"] = reply["error"]
                    else:
                        results[impl]["samples"].setdefault(f"fixed:{how}", []).append(reply["us"])
        for impl, server in live.items():
            reply = server.request("check")
            errors = reply.get("errors", {}) if "error" not in reply else {"*": reply["error"]}
            result = results[impl]
            for row in result["rows"]:
                key = f"{row['kind']}:{row['size']}"
                failure = errors.get(key) or errors.get("*")
                if failure:
                    row["error"] = "after timing: " + failure
                elif "error" not in row and result["samples"].get(key):
                    row["us_per_node"] = summarize(result["samples"][key])
            for how in ("execute", "backward"):
                samples = result["samples"].get(f"fixed:{how}")
                if errors.get("single"):
                    result["fixed"]["error"] = "after timing: " + errors["single"]
                elif samples and "error" not in result["fixed"]:
                    result["fixed"][how] = summarize(samples)
    finally:
        for server in servers.values():
            server.close()
    return results["compiled"], results["pure"]


def fmt_us(stats, digits=None) -> str:
    if stats is None:
        return "-"
    if "error" in stats:
        return "FAILED"
    median, low, high = stats["median"], stats["min"], stats["max"]
    if digits is None:
        digits = 3 if median < 1 else 2 if median < 10 else 1
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def render(headers, rows, markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
        lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(headers[i])), *(len(str(row[i])) for row in rows)) if rows
              else len(headers[i]) for i in range(len(headers))]
    out = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w)
                     for i, (h, w) in enumerate(zip(headers, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for row in rows:
        out.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                             for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(out)


def heading(text: str, markdown: bool) -> str:
    return f"\n### {text}\n" if markdown else f"\n{text}\n{'=' * len(text)}"


def _row_key(row):
    return (row.get("kind"), row.get("size"))


def _stats(row):
    if row is None:
        return None
    if "error" in row:
        return {"error": row["error"]}
    return row["us_per_node"]


def report(args, compiled, pure, torch_result, memory, started, elapsed) -> str:
    md = args.markdown
    parts = []
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    parts.append(f"pyengine compare.py, started {started}; wall time {elapsed:.0f} s; python "
                 f"{platform.python_version()}; {os.cpu_count()} CPUs"
                 + (f"; load average at start {args._load[0]:.2f}" if args._load else "")
                 + (f", at end {load[0]:.2f}" if load else ""))
    parts.append(f"{args.repeats} samples per benchmark (each >= {NODES_PER_SAMPLE:,} node "
                 f"executions, or {FIXED_CALLS_PER_SAMPLE:,} calls for the fixed cost), compiled "
                 "and pure samples interleaved; figures are median (min-max) over the samples")
    errors = []

    # Time per node.
    pure_rows = {_row_key(r): r for r in pure.get("rows", [])}
    table = []
    for row in compiled.get("rows", []):
        other = pure_rows.pop(_row_key(row), None)
        c, p = _stats(row), _stats(other)
        ratio = "-"
        if c and p and "error" not in c and "error" not in p:
            ratio = f"{p['median'] / c['median']:.1f}x"
        name = row.get("name") or f"{row['kind']} {size_label(row['size'])}"
        table.append([name, f"{row.get('nodes', row['size']):,}", fmt_us(c), fmt_us(p), ratio])
        for impl, r in (("compiled", row), ("pure", other)):
            if r is not None and "error" in r:
                errors.append(f"{impl} {name}: {r['error']}")
    for other in pure_rows.values():
        name = other.get("name") or f"{other['kind']} {size_label(other['size'])}"
        nodes = other.get("nodes", other["size"])
        table.append([name, f"{nodes:,}", "-", fmt_us(_stats(other)), "-"])
        if "error" in other:
            errors.append(f"pure {name}: {other['error']}")
    parts.append(heading("Time per node (us/node)", md))
    parts.append(render(["graph", "nodes", "compiled us/node", "pure us/node", "pure/compiled"],
                        table, md))

    # Fixed cost.
    fixed_rows = []
    for key, label in (("execute", "one node -> leaf, Engine.execute"),
                       ("backward", "one node -> leaf, pyengine.backward")):
        c = compiled.get("fixed", {}).get(key)
        p = pure.get("fixed", {}).get(key)
        ratio = f"{p['median'] / c['median']:.1f}x" if c and p else "-"
        fixed_rows.append([label, fmt_us(c), fmt_us(p), ratio])
    for impl, result in (("compiled", compiled), ("pure", pure)):
        if "error" in result.get("fixed", {}):
            errors.append(f"{impl} fixed cost: {result['fixed']['error']}")
    parts.append(heading("Fixed cost of one backward (us per backward)", md))
    parts.append(render(["graph", "compiled us", "pure us", "pure/compiled"], fixed_rows, md))

    # Scaling.
    scaling = {}
    scale_rows = []
    for impl, result in (("compiled", compiled), ("pure", pure)):
        chains = {r["size"]: r for r in result.get("rows", [])
                  if r["kind"] == "chain" and "us_per_node" in r}
        if chains:
            small, large = min(chains), max(chains)
            if small != large:
                a, b = chains[small]["us_per_node"], chains[large]["us_per_node"]
                scaling[impl] = (small, large, b["median"] / a["median"], b["min"] / a["min"])
                scale_rows.append([impl, f"{size_label(large)} vs {size_label(small)}",
                                   f"{scaling[impl][2]:.2f}x", f"{scaling[impl][3]:.2f}x"])
    if scale_rows:
        parts.append(heading("Chain: per-node cost at the largest vs the smallest size", md))
        parts.append(render(["core", "sizes", "ratio of medians", "ratio of mins"], scale_rows, md))

    # Memory.
    if memory:
        mem_rows = []
        methods = set()
        for m in memory:
            name = m.get("name") or f"{m['kind']} {size_label(m['size'])}"
            if "error" in m:
                mem_rows.append([m["implementation"], name, "FAILED", "FAILED"])
                errors.append(f"{m['implementation']} memory {name}: {m['error']}")
                continue
            nodes = m["nodes"]
            methods.add(m["rss_method"])
            rss, traced = m["rss_peak_delta"], m["tracemalloc_peak"]
            mem_rows.append([m["implementation"], name,
                             f"{rss / nodes:.0f} ({rss / 2**20:.1f} MiB)",
                             f"{traced / nodes:.0f} ({traced / 2**20:.1f} MiB)"])
        parts.append(heading("Peak memory of one backward (bytes/node, total)", md))
        method = "/".join(sorted(methods)) or "n/a"
        parts.append(render(["core", "graph", f"peak RSS delta ({method})",
                             "tracemalloc peak (Python allocations only)"], mem_rows, md))

    # PyTorch.
    if torch_result is not None:
        if "error" in torch_result:
            parts.append(heading("PyTorch reference", md))
            parts.append(f"torch worker failed: {torch_result['error']}")
        else:
            rows = [[r["name"], f"{r['nodes']:,}", fmt_us(_stats(r))] for r in torch_result["rows"]]
            for key, label in (("backward", "one view_as -> leaf, torch.autograd.backward, us"),
                               ("run_backward", "one view_as -> leaf, engine run_backward, us")):
                stats = torch_result["fixed"].get(key)
                rows.append([label, "1", fmt_us(stats)])
            parts.append(heading(f"PyTorch {torch_result['torch']} reference (us/node)", md))
            parts.append(render(["graph", "nodes", "us/node"], rows, md))

    # Goals.
    parts.append(heading("Goals", md))
    goals = evaluate_goals(compiled, pure, scaling)
    parts.append(render(["goal", "measured", "status"], goals, md))

    if errors:
        parts.append(heading("Failures", md))
        parts.extend(("- " if md else "  ") + e for e in errors)
    return "\n".join(parts) + "\n"


def evaluate_goals(compiled, pure, scaling):
    rows = {_row_key(r): r for r in compiled.get("rows", [])}
    goals = []

    def per_node(kind, size, limit, label):
        row = rows.get((kind, size))
        if row is None:
            goals.append([label, "not run", "-"])
        elif "error" in row:
            goals.append([label, "FAILED: " + row["error"][:60], "MISSED"])
        else:
            median = row["us_per_node"]["median"]
            goals.append([label, f"{median:.3f} us/node", "met" if median <= limit else "MISSED"])

    per_node("chain", 100_000, GOAL_CHAIN_100K_US,
             f"compiled <= {GOAL_CHAIN_100K_US} us/node, 100k chain")
    per_node("wide", 10_000, GOAL_WIDE_US, f"compiled <= {GOAL_WIDE_US} us/node, wide 1000x10")

    fixed = compiled.get("fixed", {}).get("execute")
    label = f"fixed cost <= {GOAL_FIXED_US} us (Engine.execute)"
    if fixed is None:
        goals.append([label, "FAILED" if "error" in compiled.get("fixed", {}) else "not run",
                      "MISSED"])
    else:
        goals.append([label, f"{fixed['median']:.2f} us",
                      "met" if fixed["median"] <= GOAL_FIXED_US else "MISSED"])

    pure_rows = {_row_key(r): r for r in pure.get("rows", [])}
    ratios, failed = [], []
    for key, row in rows.items():
        other = pure_rows.get(key)
        if other is None:
            continue
        if "error" in row or "error" in other:
            failed.append(row.get("name") or f"{key[0]} {size_label(key[1])}")
            continue
        ratios.append((other["us_per_node"]["median"] / row["us_per_node"]["median"],
                       row["name"]))
    if compiled.get("fixed", {}).get("execute") and pure.get("fixed", {}).get("execute"):
        ratios.append((pure["fixed"]["execute"]["median"] / compiled["fixed"]["execute"]["median"],
                       "fixed cost"))
    label = f"compiled >= {GOAL_SPEEDUP:.0f}x faster than pure (every graph)"
    if ratios:
        worst = min(ratios)
        text = f"min {worst[0]:.1f}x ({worst[1]})" + (f"; not measured: {', '.join(failed)}"
                                                       if failed else "")
        goals.append([label, text, "met" if worst[0] >= GOAL_SPEEDUP and not failed else "MISSED"])
    else:
        goals.append([label, "not measured", "MISSED"])

    label = f"chain per-node cost at 1M within {GOAL_SCALING}x of 10k (compiled)"
    if "compiled" in scaling and scaling["compiled"][:2] == (10_000, 1_000_000):
        ratio = scaling["compiled"][2]
        goals.append([label, f"{ratio:.2f}x (ratio of mins {scaling['compiled'][3]:.2f}x)",
                      "met" if ratio <= GOAL_SCALING else "MISSED"])
    else:
        goals.append([label, "not run (needs --sizes with 10k and 1M)", "-"])
    return goals


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", type=parse_size,
                        default=[10_000, 100_000, 1_000_000], help="chain sizes (10k 100k 1M)")
    parser.add_argument("--wide-sizes", nargs="*", type=parse_size, default=[10_000, 100_000],
                        help="total nodes of the wide graphs, depth 10 (10k = 1000x10)")
    parser.add_argument("--repeats", type=int, default=5, help="samples per benchmark (5)")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--pure-1m", action="store_true",
                        help="also run the pure twin on graphs of 1M nodes and more")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    parser.add_argument("--memory-sizes", nargs="+", type=parse_size,
                        default=[100_000, 1_000_000], help="chain sizes for memory (100k 1M)")
    parser.add_argument("--torch-function-max", type=parse_size, default=100_000,
                        help="largest torch.autograd.Function chain (100k; forward is slow)")
    parser.add_argument("--json", help="also write the raw results to this file")
    # Worker mode (internal).
    parser.add_argument("--worker", choices=["pyengine", "memory", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--function-sizes", nargs="*", type=int, default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sizes = sorted(set(args.sizes))
    args.wide_sizes = sorted(set(args.wide_sizes))

    if args.worker == "pyengine":
        worker_pyengine(args)
        return 0
    if args.worker:
        worker = {"memory": worker_memory, "torch": worker_torch}
        print(json.dumps(worker[args.worker](args)), flush=True)
        return 0

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    args._load = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()

    big = 1_000_000
    pure_sizes = [n for n in args.sizes if args.pure_1m or n < big]
    pure_wide = [n for n in args.wide_sizes if args.pure_1m or n < big]
    compiled, pure = run_interleaved(args, pure_sizes, pure_wide)
    for result, impl in ((compiled, "compiled"), (pure, "pure")):
        if "error" in result:
            print(f"{impl} worker failed: {result['error']}", file=sys.stderr)

    memory = []
    if not args.no_memory:
        for pure_flag in (False, True):
            for n in args.memory_sizes:
                if pure_flag and n >= big and not args.pure_1m:
                    continue
                print(f"memory {'pure' if pure_flag else 'compiled'} chain {size_label(n)}...",
                      file=sys.stderr, flush=True)
                result = run_worker("memory", pure_flag, ["--kind", "chain", "--n", str(n)])
                if "implementation" not in result:
                    result.update(implementation="pure" if pure_flag else "compiled",
                                  kind="chain", size=n)
                memory.append(result)

    torch_result = None
    if not args.no_torch:
        try:
            import importlib.util

            has_torch = importlib.util.find_spec("torch") is not None
        except (ImportError, ValueError):
            has_torch = False
        if has_torch:
            print("torch...", file=sys.stderr, flush=True)
            function_sizes = [n for n in args.sizes if n <= args.torch_function_max]
            torch_result = run_worker("torch", None,
                                      ["--repeats", str(args.repeats), "--sizes",
                                       *map(str, args.sizes), "--function-sizes",
                                       *map(str, function_sizes)])

    elapsed = time.perf_counter() - t0
    text = report(args, compiled, pure, torch_result, memory, started, elapsed)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compiled": compiled, "pure": pure, "memory": memory, "torch": torch_result,
                       "started": started, "elapsed_s": elapsed}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
