"""Fork while other threads run backward: the driver of ``test_fork.py``.

``python fork_driver.py --forks N --child-timeout S`` starts threads that run
backward without pause (a shared retained graph across the fake devices'
worker threads, fresh graphs with new leaves, ``grad()`` captures), then
forks N times. Each child runs backward twice on a fresh cross-device graph
and ``grad()`` on another, checks the exact gradients and exits. A child that does
not exit within ``S`` seconds is a hang: ``faulthandler``, armed in the
child before anything else runs there (the first ``after_in_child`` hook),
writes the stacks of its threads to a file, which the driver prints. The
last line of output is a JSON summary.

The import order matters: the fork hook below is registered before pyengine
registers its own, so it runs first in the child.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings

_dump_path = None
_dump_file = None
_child_timeout = 10.0


def _arm_in_child():
    global _dump_file
    _dump_file = open(f"{_dump_path}.{os.getpid()}", "w")  # noqa: SIM115 (kept open until _exit)
    faulthandler.dump_traceback_later(_child_timeout, exit=True, file=_dump_file)


os.register_at_fork(after_in_child=_arm_in_child)

import numpy as np  # noqa: E402

import pyengine  # noqa: E402
from pyengine import fake_device as fd  # noqa: E402
from pyengine.device import CPU  # noqa: E402

F0, F1 = fd.device(0), fd.device(1)


class Leaf:
    def __init__(self, data):
        self.data = data
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True


def on(value, device):
    host = value.numpy() if isinstance(value, fd.FakeArray) else np.asarray(value)
    return host if device == CPU else fd.to_fake(host, device)


def host(value):
    return value.numpy() if isinstance(value, fd.FakeArray) else value


class Scale(pyengine.Node):
    """Backward of ``y = factor * x``, x on ``input_device``, y on ``device``."""

    def __init__(self, edge, device, factor, input_device):
        super().__init__([edge], [pyengine.InputMetadata((3,), np.float64, device)])
        self.factor = factor
        self.input_device = input_device

    def apply(self, grads):
        return [on(host(grads[0]) * self.factor, self.input_device)]


def chain():
    """leaf <- cpu (x2) <- fake:0 (x3) <- fake:1 (x5): the leaf's gradient is 30."""
    x = Leaf(np.ones(3))
    n_cpu = Scale(pyengine.gradient_edge(x), CPU, 2.0, CPU)
    n0 = Scale(pyengine.Edge(n_cpu, 0), F0, 3.0, CPU)
    n1 = Scale(pyengine.Edge(n0, 0), F1, 5.0, F0)
    return x, n1


def backward(root, retain=False):
    pyengine.get_default_engine().execute([pyengine.Edge(root, 0)], [on(np.ones(3), F1)],
                                          retain, False, True)


def child_work():
    # Fresh graphs only: a graph that a thread of the parent was running at
    # the fork may have been left half-done (See Note [Locks after fork]).
    x, root = chain()
    backward(root, retain=True)
    backward(root)
    if not (host(x.grad) == 60.0).all():
        return 3
    x = Leaf(np.ones(3))
    (grad,) = pyengine.grad([pyengine.Edge(Scale(pyengine.gradient_edge(x), CPU, 7.0, CPU), 0)],
                            [x], [np.ones(3)])
    return 0 if (grad == 7.0).all() else 5


def main(argv=None):
    global _dump_path, _child_timeout
    parser = argparse.ArgumentParser()
    parser.add_argument("--forks", type=int, default=200)
    parser.add_argument("--child-timeout", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=3)
    args = parser.parse_args(argv)
    _child_timeout = args.child_timeout
    warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
    directory = tempfile.mkdtemp(prefix="pyengine-fork-")
    _dump_path = os.path.join(directory, "stacks")
    try:
        return _fork_while_running(args)
    finally:
        # Every child was waited on (or killed): no one writes here any more.
        shutil.rmtree(directory, ignore_errors=True)


def _fork_while_running(args) -> int:
    """Fork ``args.forks`` times while the threads run backward; 0 when every
    child passed, no thread failed, and none hung."""
    shared_x, shared_root = chain()
    backward(shared_root, retain=True)
    stop = threading.Event()
    errors = []

    def shared_loop():
        while not stop.is_set():
            backward(shared_root, retain=True)

    def fresh_loop():
        while not stop.is_set():
            x, root = chain()
            backward(root)

    def grad_loop():
        while not stop.is_set():
            x = Leaf(np.ones(3))
            node = Scale(pyengine.gradient_edge(x), CPU, 7.0, CPU)
            pyengine.grad([pyengine.Edge(node, 0)], [x], [np.ones(3)])

    def guarded(loop):
        def run():
            try:
                loop()
            except BaseException as error:  # reported, never lost
                errors.append(repr(error))
        return run

    loops = [shared_loop, fresh_loop, grad_loop]
    threads = [threading.Thread(target=guarded(loops[i % len(loops)]), daemon=True)
               for i in range(args.threads)]
    for thread in threads:
        thread.start()

    hangs, failures, dumps = [], [], []
    started = time.monotonic()
    for i in range(args.forks):
        time.sleep(0.001 * (i % 5))  # vary where the other threads are at the fork
        pid = os.fork()
        if pid == 0:
            try:
                code = child_work()
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 6
            os._exit(code)
        deadline = time.monotonic() + args.child_timeout + 20.0
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.005)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = None
        dump_file = f"{_dump_path}.{pid}"
        dump = open(dump_file).read() if os.path.exists(dump_file) else ""
        if os.path.exists(dump_file):
            os.remove(dump_file)
        code = None if status is None else os.waitstatus_to_exitcode(status)
        if dump or status is None:
            hangs.append(i)
            dumps.append(f"--- fork {i}: exit {code}\n{dump or '(no stack dump: killed)'}")
        elif code != 0:
            failures.append((i, code))
    stop.set()
    for thread in threads:
        thread.join(30)
    for dump in dumps:
        print(dump)
    summary = {"implementation": pyengine.IMPLEMENTATION, "forks": args.forks, "hangs": hangs,
               "failures": failures, "thread_errors": errors,
               "threads_alive": sum(thread.is_alive() for thread in threads),
               "seconds": round(time.monotonic() - started, 1)}
    print(json.dumps(summary))
    return 0 if not (hangs or failures or errors) else 1


if __name__ == "__main__":
    sys.exit(main())
