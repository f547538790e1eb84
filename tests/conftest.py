"""Shared fixtures.

- ``torch``: the torch module, or the test is skipped where torch is missing
  (torch is an oracle only: the same graph built in PyTorch).
- ``signals_not_swallowed``: SIGINT raises KeyboardInterrupt (even in a
  background job, which starts with SIGINT ignored), and no gc callback
  may swallow it.
- ``run_on_this_core``: code in a subprocess on the test's core, which must
  exit normally (for what once crashed or hung the interpreter).
- ``engine_with_depth``: swaps in an Engine with a given max_recursion_depth.
- ``in_a_fork_while_held`` / ``in_a_fork_while``: a forked child's work,
  while another thread of the parent holds a lock (See Note [Locks after
  fork] in pyengine/node.py).
- ``Counter`` / ``make_logger``: nodes that count their calls or log their
  names, to check which nodes ran and in what order.
- an autouse fixture that checks, after every test, that the global state
  (grad mode, anomaly mode, default engine) is back to normal and that the
  default engine still runs a plain backward correctly.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import sys
import threading
import warnings

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from minitensor import leaf  # noqa: E402

import pyengine  # noqa: E402

_ORIGINAL_ENGINE = pyengine.get_default_engine()


def pytest_report_header(config):
    return f"pyengine {pyengine.__version__}: {pyengine.IMPLEMENTATION} core from {pyengine.__file__}"


def pytest_configure(config):
    # One suite, two builds: the run must test the build it was asked for,
    # never the pure twin by accident (a source tree without the compiled
    # modules falls back to it with only a warning).
    wanted = "pure" if os.environ.get("PYENGINE_PURE", "") not in ("", "0") else "compiled"
    if pyengine.IMPLEMENTATION != wanted:
        raise pytest.UsageError(
            f"expected the {wanted} pyengine core but imported the {pyengine.IMPLEMENTATION} one "
            f"from {pyengine.__file__}; install pyengine (pip install .) and run pytest from the "
            "repository root, or set PYENGINE_PURE=1 for the twin")


@pytest.fixture
def torch():
    """The torch module; skips the test when torch is not installed."""
    return pytest.importorskip("torch")


@pytest.fixture
def no_anomaly_warning():
    """Silence detect_anomaly's "Anomaly Detection has been enabled" warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        yield


@contextlib.contextmanager
def signals_not_swallowed():
    """While a test waits for a KeyboardInterrupt: SIGINT raises it, and no
    cyclic GC runs.

    - A shell without job control starts a background job (``pytest &``,
      ``nohup``) with SIGINT ignored, and CPython keeps an ignored SIGINT as
      it found it, so no Ctrl-C test could pass there: Python's own handler
      is put in for the wait, and the one found put back after it.
    - A signal handler may run inside a gc callback (hypothesis installs
      one), and CPython discards what a gc callback raises.
    """
    previous_handler = signal.getsignal(signal.SIGINT)
    if previous_handler is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        if previous_handler is not signal.default_int_handler:
            signal.signal(signal.SIGINT, previous_handler)


# Before Python 3.10 an interrupt that comes out between a with block's end
# and its __exit__ call skips the __exit__ (CPython's bpo-29988, fixed in
# 3.10, which checks for signals only after calls and on back edges): the
# lock of a ``with lock:`` stays taken. Random interrupts find that in the
# Python code around a backward (the profiler's lock: the next flush waited
# for good on 3.9), so tests that send them run from 3.10 on.
random_interrupts_need_3_10 = pytest.mark.skipif(
    sys.version_info < (3, 10),
    reason="before 3.10 an interrupt can skip a with block's __exit__ (CPython bpo-29988)")


class RandomInterrupts:
    """SIGINTs to the main thread at random moments (``low_s`` to ``high_s``
    apart, from a seeded generator), from a thread of their own, while the
    with block runs: Ctrl-C pressed at a moment nobody chose.

    A SIGINT raises KeyboardInterrupt only while ``armed`` is True (the
    test's own steps are left alone), and disarms it: one interrupt per
    armed call, since a second interrupt while the first is handled is a
    window the twin leaves open (Note [Where the twin's main thread sees an
    interrupt] in pyengine/_pure/engine.py). Entered inside
    ``signals_not_swallowed``, so no gc callback runs the handler."""

    def __init__(self, seed: int, low_s: float, high_s: float):
        self.armed = False
        self._seed, self._low_s, self._high_s = seed, low_s, high_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._interrupt_at_random)
        self._main = threading.main_thread().ident
        self._stack = contextlib.ExitStack()

    def _handler(self, signum, frame):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt

    def _interrupt_at_random(self):
        chance = random.Random(self._seed)
        while not self._stop.wait(chance.uniform(self._low_s, self._high_s)):
            signal.pthread_kill(self._main, signal.SIGINT)

    def __enter__(self):
        assert threading.current_thread() is threading.main_thread()
        self._stack.enter_context(signals_not_swallowed())
        previous = signal.signal(signal.SIGINT, self._handler)
        self._stack.callback(signal.signal, signal.SIGINT, previous)
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self.armed = False
        self._stop.set()
        self._thread.join(30)
        self._stack.close()
        return False


def in_a_fork_while_held(lock, in_child, timeout: float = 10.0) -> int:
    """Fork while another thread holds ``lock`` (any context manager), and
    run ``in_child()`` in the child: See ``in_a_fork_while``."""
    def hold(held, done):
        with lock:
            held.set()
            done.wait(timeout * 3)

    return in_a_fork_while(hold, in_child, timeout)


def in_a_fork_while(hold, in_child, timeout: float = 10.0) -> int:
    """Fork while another thread runs ``hold(held, done)`` (which sets the
    Event ``held`` once it holds what it holds, then waits for ``done``),
    and run ``in_child()`` in the child, which ends when it returns: exit
    status 0 where it returned True, 1 where it raised (its traceback on
    stderr), 2 where it returned something else, and faulthandler's (1,
    with the child's stacks on stderr) where it did not return within
    ``timeout`` seconds (a hang). Returns that status; ``done`` is set, and
    the thread joined, after the child ended."""
    import faulthandler
    import threading

    held, done = threading.Event(), threading.Event()
    holder = threading.Thread(target=hold, args=(held, done))
    holder.start()
    try:
        assert held.wait(timeout)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                faulthandler.dump_traceback_later(timeout, exit=True)
                code = 0 if in_child() is True else 2
            except BaseException:
                import traceback
                traceback.print_exc()  # on the test's captured stderr
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    finally:
        done.set()
        holder.join(timeout)
        assert not holder.is_alive()


def run_on_this_core(code: str, timeout: float) -> list[str]:
    """Run ``code`` in a fresh interpreter on the core this test runs on
    (``PYENGINE_PURE`` and the repository on ``PYTHONPATH`` pass through).
    It must exit normally (no crash) within ``timeout`` seconds (else the
    test fails as a hang). Returns its output lines."""
    return run_on_core(code, pyengine.IMPLEMENTATION == "pure", timeout)


def run_on_core(code: str, pure: bool, timeout: float) -> list[str]:
    """``run_on_this_core`` on the twin (``pure``) or the compiled core. The
    child runs in the folder that holds the pyengine this process imported:
    "-c" puts the current folder first on sys.path, and from a checkout
    without an in-place build (CI, which tests the installed package) the
    child would import the source tree, which has no compiled core."""
    import subprocess

    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(pyengine.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))
    if pure:
        env["PYENGINE_PURE"] = "1"
    else:
        env.pop("PYENGINE_PURE", None)
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=timeout, cwd=repo_root)
    except subprocess.TimeoutExpired:
        pytest.fail(f"no exit within {timeout} s: a hang or a deadlock")
    assert proc.returncode == 0, (
        f"exit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc.stdout.splitlines()


@contextlib.contextmanager
def registered_backend(value_type, backend):
    """``backend`` registered for ``value_type`` while the block runs; the
    one before it (or none) put back after."""
    previous = pyengine.register_backend(value_type, backend)
    try:
        yield backend
    finally:
        if previous is None:
            pyengine.unregister_backend(value_type)
        else:
            pyengine.register_backend(value_type, previous)


@pytest.fixture
def engine_with_depth():
    """Swap in an Engine with a given max_recursion_depth; restore the default."""
    previous = []

    def make(depth):
        engine = pyengine.Engine(max_recursion_depth=depth)
        previous.append(pyengine.set_default_engine(engine))
        return engine

    yield make
    for engine in reversed(previous):
        pyengine.set_default_engine(engine)


@pytest.fixture(autouse=True)
def engine_still_works():
    """After each test: global state restored, and the engine still works."""
    yield
    assert pyengine.get_default_engine() is _ORIGINAL_ENGINE, "a test left another default engine"
    assert pyengine.is_grad_enabled(), "a test left grad mode off"
    assert not pyengine.is_anomaly_enabled(), "a test left anomaly mode on"
    assert pyengine.is_checkpoint_valid()
    with pytest.raises(RuntimeError):
        pyengine.queue_callback(lambda: None)  # no backward is running any more
    x = leaf([1.0, 2.0])
    (x * 3.0).sum().backward()
    np.testing.assert_array_equal(x.grad, [3.0, 3.0])


class Counter(pyengine.Node):
    """A pass-through node that counts its calls (and logs its tag, if given)."""

    def __init__(self, next_edges=(), input_metadata=(), tag=None, log=None):
        super().__init__(next_edges=next_edges, input_metadata=input_metadata)
        self.calls = 0
        self.tag = tag
        self.log = log

    def apply(self, grads):
        self.calls += 1
        if self.log is not None:
            self.log.append(self.tag)
        return [grads[0]] * len(self.next_edges)


def tap(x, tag=None, log=None):
    """``x`` passed through a :class:`Counter` node: returns ``(out, node)``."""
    from minitensor import T

    out = T(x.data)
    node = Counter(next_edges=[pyengine.gradient_edge(x)], input_metadata=[out.data],
                   tag=tag, log=log)
    out.grad_fn, out.requires_grad = node, True
    return out, node
