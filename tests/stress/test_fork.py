"""Fork while other threads run backward (marker ``stress``, bounded budget).

``fork_driver.py`` forks 300 times while three threads run backward on the
core under test (a shared retained graph across the fake devices' worker
threads, fresh graphs with new leaves, ``grad()``); each child runs three
backward calls on fresh graphs with exact gradients (2 * 30, 30 = 2 * 3 * 5
across the CPU and two fake devices; and 7) and exits. The
oracle: every child exits 0 within its timeout; a child that hangs dumps its
stacks (faulthandler, armed before anything else runs in the child), and the
test shows them. Before Note [Locks after fork] (``pyengine/node.py``), about
one fork in 30 hung here, in ``leaf_state`` or the fake runtime's
``default_stream``, on a lock that a thread of the parent held at the fork.

``python tests/stress/fork_driver.py --forks 5000`` runs longer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import pyengine

pytestmark = [pytest.mark.stress,
              pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")]

DRIVER = os.path.join(os.path.dirname(__file__), "fork_driver.py")


def test_forks_while_other_threads_run_backward_never_hang():
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(entry)
                                            for entry in env["PYTHONPATH"].split(os.pathsep))
    # Not from the repository root, so that the installed pyengine is imported.
    result = subprocess.run([sys.executable, DRIVER, "--forks", "300", "--child-timeout", "5"],
                            capture_output=True, text=True, timeout=600, env=env,
                            cwd=os.path.dirname(__file__))
    lines = result.stdout.strip().splitlines()
    assert lines, result.stderr
    summary = json.loads(lines[-1])
    assert summary["implementation"] == pyengine.IMPLEMENTATION
    assert summary["hangs"] == [] and summary["failures"] == [], result.stdout + result.stderr
    assert summary["thread_errors"] == [] and summary["threads_alive"] == 0, summary
    assert result.returncode == 0, result.stdout + result.stderr
