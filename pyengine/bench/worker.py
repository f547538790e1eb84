"""The worker process of one subject: builds its workloads, then times them
one sample at a time when the parent asks; or measures the memory of one
backward.

    python -m pyengine.bench.worker serve SUBJECT BUDGET KIND:SIZE ...
    python -m pyengine.bench.worker memory SUBJECT SIZE [--tracemalloc]

``BUDGET`` is the node executions one sample covers (See
:meth:`~pyengine.bench.workload.Workload.set_budget`). ``serve`` writes
one JSON line, the hello (what it built, or why not), then answers one
JSON line per request read from stdin: ``sample KEY`` (one sample, in the
workload's unit), ``check`` (the oracle on every workload, after timing),
``quit``. ``memory`` writes one JSON line.

Note [Timing a sample]
~~~~~~~~~~~~~~~~~~~~~~
Built workloads live until the process ends, so they are moved out of the
cyclic GC's reach (``gc.freeze()``); ``gc.collect()`` runs before each
sample and the GC stays enabled while timing (it is part of what users
pay). A sample is the wall time (``time.perf_counter``) of ``calls``
consecutive ``run()`` calls after one untimed ``reset()``.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
import tracemalloc

from .subjects import SUBJECTS
from .workload import Unsupported


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def sample(workload) -> float:
    """One sample of ``workload`` in its unit (See Note [Timing a sample])."""
    workload.reset()
    run, calls = workload.run, workload.calls
    gc.collect()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return workload.scale(time.perf_counter() - start)


def _implementation():
    try:
        import pyengine
    except ImportError:  # pragma: no cover - the worker runs from pyengine
        return None
    return pyengine.IMPLEMENTATION


def serve(subject_key: str, budget: int, keys: list[str], out=sys.stdout,
          requests=sys.stdin) -> None:
    subject = SUBJECTS[subject_key]
    hello = {"subject": subject_key, "implementation": _implementation(), "workloads": {}}
    workloads = {}
    try:
        subject.setup()
    except Exception as error:
        hello["error"] = _error_text(error)
        keys = []
    for key in keys:
        kind, _, size = key.partition(":")
        try:
            workload = subject.build(kind, int(size))
            workload.set_budget(budget)
            workload.run_checked()  # the oracle, before any timing
        except Unsupported:
            continue
        except Exception as error:
            hello["workloads"][key] = {"error": _error_text(error)}
            continue
        workloads[key] = workload
        hello["workloads"][key] = {"name": workload.name, "nodes": workload.nodes,
                                   "unit": workload.unit, "calls": workload.calls}
    gc.collect()
    gc.freeze()
    print(json.dumps(hello), file=out, flush=True)
    for line in requests:
        command, _, argument = line.strip().partition(" ")
        try:
            if command == "sample":
                reply = {"value": sample(workloads[argument])}
            elif command == "check":
                errors = {}
                for key, workload in workloads.items():
                    try:
                        workload.run_checked()
                    except Exception as error:
                        errors[key] = _error_text(error)
                reply = {"errors": errors}
            elif command == "quit":
                break
            else:
                reply = {"error": f"unknown request {line.strip()!r}"}
        except Exception as error:
            reply = {"error": _error_text(error)}
        print(json.dumps(reply), file=out, flush=True)


def _read_status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def memory(subject_key: str, size: int, trace_python_allocations: bool = False) -> dict:
    """Peak memory of one backward on a freshly built chain of ``size``.

    First backward: peak RSS with the kernel's high-water mark reset just
    before (``/proc/self/clear_refs`` = 5; VmHWM after minus VmRSS before:
    all memory, the compiled core's C++ containers included; the
    ``ru_maxrss`` delta where that file is not writable). Then, if
    ``trace_python_allocations``, a second backward under ``tracemalloc``
    (the peak of Python's allocators only; it slows every allocation, by
    minutes for a framework's 1M-node backward, so the runner asks for it
    on pyengine's own engine only).
    """
    subject = SUBJECTS[subject_key]
    out = {"subject": subject_key, "implementation": _implementation(), "size": size}
    try:
        subject.setup()
        # One-time costs of a first backward (PyTorch's thread pool and
        # caches, an engine's worker state) are not per-graph memory.
        subject.build("chain", 10).run_checked()
        workload = subject.build("chain", size)
        out["nodes"] = workload.nodes
        workload.reset()
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            before = _read_status("VmRSS")
            workload.run()
            out["rss_peak"] = _read_status("VmHWM") - before
            out["rss_method"] = "VmHWM-VmRSS"
        except OSError:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            workload.run()
            out["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
            out["rss_method"] = "ru_maxrss"
        workload.check()
        if trace_python_allocations:
            workload.reset()
            gc.collect()
            tracemalloc.start()
            workload.run()
            out["tracemalloc_peak"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            workload.check()
    except Unsupported as error:
        out["error"] = f"unsupported: {error}"
    except Exception as error:
        out["error"] = _error_text(error)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mode, subject_key, *rest = argv
    if mode == "serve":
        serve(subject_key, int(rest[0]), rest[1:])
    elif mode == "memory":
        print(json.dumps(memory(subject_key, int(rest[0]), "--tracemalloc" in rest[1:])),
              flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
