"""The parent of ``python -m pyengine bench``: one worker process per subject,
their samples interleaved, then one fresh process per memory figure.

Note [Interleaved samples]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Which core pyengine uses is fixed when it is imported, and an adapter
patches its framework for the whole process, so every subject runs in a
worker of its own (:mod:`pyengine.bench.worker`). The workers start one
after another (each builds and checks all its workloads, then waits), and
then the parent asks them for samples in turn: repeat 1 of chain 1k on
every subject, then chain 10k on every subject, ..., then repeat 2. Only
one process computes at any time, and load from elsewhere on a shared
machine falls on every subject and size alike, which is what keeps the
ratios taken from one run meaningful.

Note [Worker timeout]
~~~~~~~~~~~~~~~~~~~~~
A worker that hangs (an engine that deadlocks, a framework stuck in a
lock) would hang the bench forever, since the parent waits for each reply.
So every reply has a deadline, :data:`WORKER_TIMEOUT_S` unless
``--worker-timeout`` says otherwise: the hello (building and checking every
workload of the subject), one sample, the check after timing, one memory
figure. It is generous: at the default sizes the slowest reply (the hello
of a framework's own engine, which builds and runs its 1M-node chains) takes
minutes, and a whole default run about a quarter of an hour. A worker past
its deadline is killed; the workload it was on gets an error naming it and
the time, the subject's other workloads say the worker was stopped, and the
run goes on with the other subjects.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

from .subjects import SUBJECTS
from .workload import NODES_PER_SAMPLE

WORKER_TIMEOUT_S = 1800  # per reply (See Note [Worker timeout])


def _worker_command(*args) -> list:
    return [sys.executable, "-m", "pyengine.bench.worker", *map(str, args)]


# The folder that holds the pyengine this process imported (a checkout or
# site-packages). Workers get it first on PYTHONPATH and as their working
# directory: `python -m` puts the working directory ahead of PYTHONPATH, and
# a checkout's source tree there (without its compiled modules) would be
# imported instead.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker_env(subject) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"]
                                        if env.get("PYTHONPATH") else "")
    if subject.pure is not None:
        env["PYENGINE_PURE"] = "1" if subject.pure else "0"
    return env


def _expected_implementation(subject) -> str | None:
    return {True: "pure", False: "compiled"}.get(subject.pure)


def _misimported(subject, implementation) -> str | None:
    expected = _expected_implementation(subject)
    if expected and implementation != expected:
        return (f"asked for pyengine's {expected} core, imported {implementation!r} from "
                f"{PACKAGE_ROOT} (a source tree without its compiled modules? build them, "
                "or run from outside it)")
    return None


class Worker:
    """The parent's end of one ``serve`` worker; each reply within
    ``timeout_s`` (See Note [Worker timeout])."""

    def __init__(self, subject, budget, keys, timeout_s=None):
        self.subject = subject
        self.timeout_s = WORKER_TIMEOUT_S if timeout_s is None else timeout_s
        self.stopped = None  # why the worker was killed, once it was
        self.proc = subprocess.Popen(_worker_command("serve", subject.key, budget, *keys),
                                     env=_worker_env(subject), cwd=PACKAGE_ROOT,
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        # A pipe's readline() has no timeout: a thread reads, the parent
        # waits on the queue with one.
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, daemon=True,
                         name=f"bench worker {subject.key}").start()
        self.hello = self._read("while building and checking its workloads")
        wrong = _misimported(subject, self.hello.get("implementation"))
        if wrong and "error" not in self.hello:
            self.hello["error"] = wrong

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read(self, doing: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stopped = (f"no reply in {self.timeout_s:g} s {doing}; the worker was "
                                "stopped (a hang? --worker-timeout gives it longer)")
                self.proc.kill()
                self.proc.wait()
                return {"error": self.stopped}
            if line is None:
                return {"error": f"worker exited with status {self.proc.wait()}"}
            if line.startswith("{"):
                return json.loads(line)

    def request(self, text: str) -> dict:
        if self.stopped:
            return {"error": f"not run: {self.stopped}"}
        if self.proc.poll() is not None:
            return {"error": f"worker exited with status {self.proc.returncode}"}
        try:
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"error": f"worker exited with status {self.proc.wait()}"}
        return self._read(f"to {text!r}")

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


def available(subject) -> str | None:
    """None if ``subject``'s packages import here, else why not."""
    import importlib.util

    for module in subject.needs:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


def run_timing(subject_keys, workload_keys, repeats, budget=NODES_PER_SAMPLE,
               log=print, timeout_s=None) -> dict:
    """Time every workload of every subject (See Note [Interleaved samples]);
    each worker's reply within ``timeout_s`` (See Note [Worker timeout]).

    Returns ``{subject: {"error"?, "implementation", "workloads": {key:
    {"name", "nodes", "unit", "samples": [...]} or {"error"}}}}``.
    """
    results, workers = {}, {}
    try:
        for key in subject_keys:
            subject = SUBJECTS[key]
            missing = available(subject)
            if missing:
                results[key] = {"skipped": missing, "workloads": {}}
                continue
            log(f"building and checking: {subject.label}")
            worker = Worker(subject, budget, workload_keys, timeout_s)
            hello = worker.hello
            results[key] = {"implementation": hello.get("implementation"),
                            "workloads": hello.get("workloads", {})}
            if "error" in hello:
                results[key]["error"] = hello["error"]
                worker.close()
                continue
            workers[key] = worker
        for repeat in range(repeats):
            log(f"repeat {repeat + 1}/{repeats}")
            for workload_key in workload_keys:
                for key, worker in workers.items():
                    entry = results[key]["workloads"].get(workload_key)
                    if entry is None or "error" in entry:
                        continue
                    reply = worker.request(f"sample {workload_key}")
                    if "error" in reply:
                        entry["error"] = reply["error"]
                    else:
                        entry.setdefault("samples", []).append(reply["value"])
        for key, worker in workers.items():
            reply = worker.request("check")
            failures = reply.get("errors", {}) if "error" not in reply else None
            for workload_key, entry in results[key]["workloads"].items():
                if "error" in entry:
                    continue
                failure = reply["error"] if failures is None else failures.get(workload_key)
                if failure:
                    entry["error"] = "after timing: " + failure
    finally:
        for worker in workers.values():
            worker.close()
    return results


# Whose memory is also traced through Python's allocators: the engine's own.
TRACED_SUBJECTS = ("pyengine", "pyengine-pure")


def run_memory(subject_keys, sizes, log=print, timeout_s=None) -> list:
    """Peak memory of one backward on a chain of each size, each in a fresh
    process (See :func:`pyengine.bench.worker.memory`) that has ``timeout_s``
    (See Note [Worker timeout])."""
    timeout_s = WORKER_TIMEOUT_S if timeout_s is None else timeout_s
    figures = []
    for key in subject_keys:
        subject = SUBJECTS[key]
        if available(subject):
            continue
        for size in sizes:
            log(f"memory: {subject.label}, chain of {size:,}")
            extra = ["--tracemalloc"] if key in TRACED_SUBJECTS else []
            try:
                proc = subprocess.run(_worker_command("memory", key, size, *extra),
                                      env=_worker_env(subject), cwd=PACKAGE_ROOT,
                                      stdout=subprocess.PIPE, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:  # it killed the worker
                figures.append({"subject": key, "size": size,
                                "error": f"no result in {timeout_s:g} s for the chain of "
                                f"{size:,}; the worker was stopped (a hang? --worker-timeout "
                                "gives it longer)"})
                continue
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                figure = {"subject": key, "size": size,
                          "error": f"worker exited with status {proc.returncode}"}
            else:
                figure = json.loads(lines[-1])
                wrong = _misimported(subject, figure.get("implementation"))
                if wrong:
                    figure["error"] = wrong
            figures.append(figure)
    return figures
