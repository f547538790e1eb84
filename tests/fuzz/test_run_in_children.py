"""``fuzz_interpreter.run_in_children``, the parent side that the thread and
interrupt fuzzes share (marker ``fuzz``): a crash's ``"i"`` indexes the
items, also where the child ran every item and then failed at its exit (a
crash at interpreter shutdown, or ThreadSanitizer's status 66 after a
report), which the fuzzes' command lines once took for an item past the
end (an IndexError instead of the failure). The oracle: the items each
child was given and the status it exits with, chosen here.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fuzz_interpreter  # noqa: E402

pytestmark = pytest.mark.fuzz

# A child: one result line per item, until an item says "crash" (exit 3
# there); after the last item, the status that EXIT_STATUS names.
CHILD = """
import json, os, sys
items = json.load(sys.stdin)
for i, item in enumerate(items):
    if item == "crash":
        sys.exit(3)
    print(json.dumps({"i": i, "item": item}), flush=True)
sys.exit(int(os.environ.get("EXIT_STATUS", "0")))
"""


def run(tmp_path, items, exit_status, **env_vars):
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    # TSAN_OPTIONS only where a test sets it (a run under .ci/sanitized's
    # thread mode has it already).
    env = {name: value for name, value in os.environ.items() if name != "TSAN_OPTIONS"}
    env.update(EXIT_STATUS=str(exit_status), **env_vars)
    return fuzz_interpreter.run_in_children(str(child), items, env, program_timeout=5.0)


def test_a_clean_child_has_no_crash(tmp_path):
    results, crashes = run(tmp_path, ["a", "b"], 0)
    assert sorted(results) == [0, 1] and crashes == []


def test_a_crash_mid_batch_is_its_item_and_a_new_child_runs_the_rest(tmp_path):
    results, crashes = run(tmp_path, ["a", "crash", "c"], 0)
    assert sorted(results) == [0, 2] and results[2]["item"] == "c"
    assert [(crash["i"], crash["why"]) for crash in crashes] == [
        (1, "a hang or exit (status 3, per-program timeout)")]


def test_a_failure_after_the_last_item_is_charged_to_it(tmp_path):
    items = ["a", "b", "c"]
    results, crashes = run(tmp_path, items, 66)
    assert sorted(results) == [0, 1, 2]
    assert [crash["i"] for crash in crashes] == [2]
    assert crashes[0]["why"] == ("a hang or exit (status 66, per-program timeout), "
                                 "at its exit, after its last item")
    assert items[crashes[0]["i"]] == "c"


def test_status_66_under_thread_sanitizer_is_its_report(tmp_path):
    # .ci/sanitized's thread mode sets TSAN_OPTIONS; a child that reported
    # a race exits 66, and the crash says so rather than "a hang".
    results, crashes = run(tmp_path, ["a", "b"], 66, TSAN_OPTIONS="log_path=stderr")
    assert sorted(results) == [0, 1]
    assert [(crash["i"], crash["why"]) for crash in crashes] == [
        (1, "a ThreadSanitizer report (status 66), at its exit, after its last item")]
