"""``python -m pyengine bench``: its arguments, and one run from start to report."""

from __future__ import annotations

import argparse
import contextlib
import decimal
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time

from . import lookups as lookup_bench
from . import report as reporting
from .runner import WORKER_TIMEOUT_S, run_memory, run_timing
from .subjects import SUBJECTS
from .workload import NODES_PER_SAMPLE

DEFAULT_CHAIN_SIZES = [1_000, 10_000, 100_000, 1_000_000]
DEFAULT_MEMORY_SIZES = [10_000, 100_000, 1_000_000]
# The other graphs, at the sizes the goals name: wide 1000x10, a 100x100
# lattice, a fan-in of 1,000.
GRAPH_KEYS = ["wide:10000", "lattice:10000", "fan-in:1000"]
QUICK_GRAPH_KEYS = ["wide:1000", "lattice:1000", "fan-in:100"]
STEP_KEYS = ["mlp-step:0"]
FIXED_KEYS = [f"{kind}-fixed:{nodes}" for kind in ("execute", "backward", "grad")
              for nodes in (1, 10)]


# The largest size --sizes, --memory-sizes and --lookup-rows take. Every
# worker holds all its graphs at once (a chain, grad(inputs=) and the apply
# floor per size: 0.3-1.3 KB per node each, more for DeZero and micrograd),
# and a lookup table takes ~2 KB per row in its copies, so 10M already needs
# tens of GB per subject; past it a typo (1e30) would only run out of memory.
MAX_SIZE = 10_000_000


def parse_size(text: str) -> int:
    """``"10k"`` -> 10000, ``"1M"`` -> 1000000, ``"2500"`` -> 2500, ``"1e6"``
    -> 1000000: a whole number from 1 to :data:`MAX_SIZE`."""
    cleaned = text.strip().lower().replace("_", "").replace(",", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(cleaned[-1:], 1)
    try:  # Decimal, not float: exact, so 1.001k is 1001 and 1.5 is not whole
        number = decimal.Decimal(cleaned[:-1] if scale > 1 else cleaned)
    except decimal.InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1000, 10k or 1M)") from None
    if not number.is_finite():  # inf, nan
        raise argparse.ArgumentTypeError(f"a size must be a finite number, got {text!r}")
    too_large = argparse.ArgumentTypeError(
        f"a size must be at most {MAX_SIZE:,} (10M; every graph is held in memory), got {text!r}")
    if number.adjusted() > 20:  # 1e400: decide before any arithmetic on it
        raise too_large
    with decimal.localcontext() as context:
        context.prec = len(number.as_tuple().digits) + 30  # the product is exact
        scaled = number * scale
    if scaled != scaled.to_integral_value():
        raise argparse.ArgumentTypeError(f"a size must be a whole number, got {text!r}")
    if scaled < 1:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    if scaled > MAX_SIZE:
        raise too_large
    return int(scaled)


def _subject_list(text: str):
    keys = list(dict.fromkeys(key.strip() for key in text.split(",") if key.strip()))
    unknown = [key for key in keys if key not in SUBJECTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown subject(s) {', '.join(unknown)}; "
                                         f"expected some of {', '.join(SUBJECTS)}")
    if not keys:
        raise argparse.ArgumentTypeError(f"expected at least one of {', '.join(SUBJECTS)}, "
                                         f"got {text!r}")
    return keys


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


DEFAULT_PLOT = "pyengine-bench.png"
MAX_WORKER_TIMEOUT_S = 7 * 24 * 3600


def _worker_timeout(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_WORKER_TIMEOUT_S:  # nan too
        raise argparse.ArgumentTypeError(f"expected seconds, more than 0 and at most "
                                         f"{MAX_WORKER_TIMEOUT_S} (a week), got {text!r}")
    return seconds


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written, or None: checked while parsing, before
    any timing, rather than after an hour of it."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path or path.endswith(("/", os.sep)) or os.path.isdir(path):
        return "it names a folder, expected a file name"
    if not os.path.isdir(folder):
        return f"the folder {folder!r} does not exist"
    if not os.access(folder, os.W_OK):
        return f"the folder {folder!r} is not writable"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "the file is not writable"
    return None


def _json_path(text: str) -> str:
    problem = _unwritable(text)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {problem}")
    return text


def _plot_formats() -> list | None:
    """The suffixes matplotlib writes, or None without matplotlib (found
    without importing it; the run then says it writes no plot)."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def _plot_problem(text: str) -> str | None:
    problem = _unwritable(text)
    if problem:
        return f"cannot write {text!r}: {problem}"
    formats = _plot_formats()
    suffix = os.path.splitext(text)[1][1:].lower()
    if formats is not None and suffix not in formats:
        told = f"matplotlib writes no {'.' + suffix!r} files" if suffix else "it has no suffix"
        return (f"cannot tell a plot format from {text!r}: {told}; expected a name ending in "
                f"one of {', '.join('.' + f for f in formats)}")
    return None


def _plot_path(text: str) -> str:
    problem = _plot_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _write_replacing(path: str, write) -> None:
    """``write(temporary_path)`` beside ``path``, then rename it over ``path``:
    a write that fails leaves what was there (an earlier JSON) whole."""
    target = os.path.realpath(path)
    folder, name = os.path.split(target)
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=os.path.splitext(name)[1],
                                         dir=folder)
    os.close(handle)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # as open() would have made it
        write(temporary)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def _write_json(path: str, content) -> str | None:
    """Write ``content`` to ``path``; None, or the error line saying why not."""
    def write(temporary):
        with open(temporary, "w") as f:
            json.dump(content, f, indent=1)

    try:
        _write_replacing(path, write)
    except (OSError, TypeError, ValueError) as error:
        return f"bench: --json {path}: not written: {_error_text(error)}"
    return None


def _error_text(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:  # not the temporary file's name
        return error.strerror
    return f"{type(error).__name__}: {error}"


def add_arguments(parser) -> None:
    parser.add_argument("--repeats", type=_positive, default=5,
                        help="samples per workload (default 5; the table shows median, min, max)")
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=None, metavar="N",
                        help="chain sizes for the table and the plot: whole numbers such as 1000, 10k, "
                        "1M or 1e6, at most 10M (default 1k 10k 100k 1M)")
    parser.add_argument("--memory-sizes", nargs="+", type=parse_size, default=None, metavar="N",
                        help="chain sizes for the memory figures, at most 10M (default 10k 100k 1M)")
    parser.add_argument("--subjects", type=_subject_list, default=list(SUBJECTS),
                        help="comma-separated subset of: " + ", ".join(SUBJECTS)
                        + " (default: all; those whose package is missing are skipped)")
    parser.add_argument("--quick", action="store_true",
                        help="small graphs (chain 1k and 10k, the others at 1/10), 3 repeats, "
                        "memory at 1k and 10k: a smoke run, not figures to quote")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory figures")
    parser.add_argument("--lookup-rows", nargs="+", type=parse_size, default=None, metavar="N",
                        help="table sizes for the lookup figures (indexed gradients; default "
                        "100k 1M, quick 10k 100k; at most 10M)")
    parser.add_argument("--no-lookups", action="store_true", help="skip the lookup figures")
    parser.add_argument("--lookups-only", action="store_true",
                        help="only the lookup figures (no engines, no memory)")
    parser.add_argument("--plot", type=_plot_path, default=None, metavar="PATH",
                        help=f"where to write the plot, in the format its suffix names "
                        f"(.png, .pdf, .svg, ...; default {DEFAULT_PLOT})")
    parser.add_argument("--no-plot", action="store_true", help="write no plot")
    parser.add_argument("--worker-timeout", type=_worker_timeout, default=WORKER_TIMEOUT_S,
                        metavar="SECONDS",
                        help=f"how long the bench waits for any one reply of a subject's worker "
                        f"(its build, one sample, one memory figure) before it stops the worker "
                        f"and reports the workload as failed (default {WORKER_TIMEOUT_S}; "
                        f"raise it for sizes past 1M)")
    parser.add_argument("--markdown", action="store_true", help="markdown tables")
    parser.add_argument("--json", type=_json_path, metavar="PATH",
                        help="also write every sample as JSON")


def _versions() -> str:
    names = ["numpy", "torch", "dezero", "micrograd", "matplotlib"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return "; ".join(found)


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        return "n/a"


def plan(args):
    """The workload keys of this run: ``{"graphs", "steps", "fixed"}``."""
    sizes = args.sizes or ([1_000, 10_000] if args.quick else DEFAULT_CHAIN_SIZES)
    chain_sizes = sorted(set(sizes))
    graphs = [f"chain:{n}" for n in chain_sizes]
    # Issue 19's references, on the same chains: grad(inputs=) against the
    # backward above, and the floor of calling each apply with no engine.
    graphs += [f"grad-inputs:{n}" for n in chain_sizes]
    graphs += [f"apply-floor:{n}" for n in chain_sizes]
    graphs += QUICK_GRAPH_KEYS if args.quick else GRAPH_KEYS
    return {"graphs": graphs, "steps": STEP_KEYS, "fixed": FIXED_KEYS}


def main(args) -> int:
    """Exit status: 0; 1 if a workload failed or an output was not written
    (the report is printed first either way); 2 for a usage error, before
    any timing, or for a plot that needs matplotlib, which is missing."""
    import pyengine

    plot_path = None
    if not args.no_plot and not args.lookups_only:
        plot_path = args.plot or DEFAULT_PLOT
        # An explicit --plot was checked while parsing; check the default here.
        problem = None if args.plot else _plot_problem(plot_path)
        if problem:
            print(f"python -m pyengine bench: error: argument --plot: {problem} (the default; "
                  "pass --plot PATH or --no-plot)", file=sys.stderr)
            return 2
        if _plot_formats() is None:
            print("bench: matplotlib is not installed, so this run writes no plot "
                  "(pip install matplotlib, or pass --no-plot)", file=sys.stderr)
    if args.quick:
        args.repeats = min(args.repeats, 3)
    keys = plan(args)
    memory_sizes = args.memory_sizes or ([1_000, 10_000] if args.quick else DEFAULT_MEMORY_SIZES)
    # The command line as typed, for the report (when run as `python -m pyengine bench`).
    typed = sys.argv[2:] if sys.argv[1:2] == ["bench"] else []
    command = "python -m pyengine bench" + "".join(f" {shlex.quote(a)}" for a in typed)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_start = _load()
    t0 = time.perf_counter()

    def log(text):
        print(f"[{time.perf_counter() - t0:6.0f} s] {text}", file=sys.stderr, flush=True)

    all_keys = keys["graphs"] + keys["steps"] + keys["fixed"]
    budget = NODES_PER_SAMPLE // 10 if args.quick else NODES_PER_SAMPLE
    timing = {} if args.lookups_only else run_timing(args.subjects, all_keys, args.repeats,
                                                     budget, log, timeout_s=args.worker_timeout)
    if args.json:  # the timings survive a memory phase that fails or is interrupted
        problem = _write_json(args.json, {"keys": keys, "timing": timing})
        if problem:
            log(f"{problem} (the run goes on; the report follows)")
    memory = ([] if args.no_memory or args.lookups_only
              else run_memory(args.subjects, memory_sizes, log, timeout_s=args.worker_timeout))
    lookup_rows = args.lookup_rows or (lookup_bench.QUICK_TABLE_ROWS if args.quick
                                       else lookup_bench.DEFAULT_TABLE_ROWS)
    lookups = [] if args.no_lookups else lookup_bench.run_lookups(lookup_rows, args.repeats, log)
    elapsed = time.perf_counter() - t0
    machine = (f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs; "
               f"pyengine {pyengine.__version__}; {_versions()}")
    header = (f"pyengine bench, {started}: `{command}`\n"
              f"{machine}; wall time {elapsed:.0f} s; load average {load_start} at the start, "
              f"{_load()} at the end\n"
              f"{args.repeats} samples per workload, interleaved across subjects; each sample "
              f"of a graph covers >= {budget:,} node executions")
    results = {"header": header, "started": started, "command": command, "machine": machine,
               "keys": keys, "timing": timing, "memory": memory, "lookups": lookups,
               "title": f"pyengine bench, {started}, {os.cpu_count()} CPUs: {command}"}
    text = reporting.report(results, markdown=args.markdown)
    skipped = reporting.skipped_lines(results)
    if skipped:
        text += "\nSkipped (not installed): " + "; ".join(skipped) + "\n"
    # The report first: whatever fails below, the timings are on the screen.
    print(text, flush=True)
    status = 1 if reporting.failure_lines(results) else 0
    problems = []
    if args.json:
        problems.append(_write_json(args.json, results))
    if plot_path and timing:
        try:
            _write_replacing(plot_path, lambda temporary: reporting.plot(results, temporary))
            print(f"plot: {plot_path}")
        except ImportError as error:
            print(f"no plot: {error}", file=sys.stderr)
            status = max(status, 2)
        except Exception as error:  # OSError; matplotlib's ValueError for a format
            problems.append(f"bench: --plot {plot_path}: not written: {_error_text(error)}")
    problems = [problem for problem in problems if problem]
    for problem in problems:
        print(problem, file=sys.stderr)
    return max(status, 1) if problems else status
