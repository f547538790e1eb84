"""Anomaly mode's note on a failing node's error, on every Python version.

``BaseException.add_note`` exists from Python 3.11; before it, pyengine keeps
the note in ``__notes__`` and in the message (See Note [Error notes before
Python 3.11] in pyengine/_shared/hooks.py). The oracle: the note is in
``__notes__`` and in the traceback Python prints, whichever the version.
"""

from __future__ import annotations

import sys
import traceback

import numpy as np
import pytest
from minitensor import T, leaf

import pyengine
from pyengine import gradient_edge
from pyengine._shared.hooks import add_note, add_note_without_add_note


def printed(error):
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def test_notes_before_311_go_to_notes_and_message():
    error = RuntimeError("the message")
    add_note_without_add_note(error, "first note")
    add_note_without_add_note(error, "second note")
    assert error.__notes__ == ["first note", "second note"]
    assert str(error) == "the message\nfirst note\nsecond note"


def test_notes_before_311_keep_a_message_the_error_words_itself():
    error = KeyError("key")
    add_note_without_add_note(error, "the note")
    assert error.__notes__ == ["the note"]
    assert str(error) == "'key'"
    several = ValueError("a", 2)
    add_note_without_add_note(several, "the note")
    assert several.args == ("a", 2) and several.__notes__ == ["the note"]


def test_notes_before_311_refuse_what_add_note_refuses():
    with pytest.raises(TypeError, match="note must be a str, not int"):
        add_note_without_add_note(RuntimeError("x"), 3)
    error = RuntimeError("x")
    error.__notes__ = ("not", "a list")
    with pytest.raises(TypeError, match="__notes__ is not a list"):
        add_note_without_add_note(error, "the note")


def test_add_note_shows_in_the_printed_traceback():
    try:
        raise RuntimeError("the message")
    except RuntimeError as caught:
        add_note(caught, "the note")
        error = caught
    assert error.__notes__ == ["the note"]
    assert "RuntimeError: the message" in printed(error)
    assert "the note" in printed(error)
    if sys.version_info >= (3, 11):
        assert str(error) == "the message"  # the note is printed from __notes__


class Fail(pyengine.Node):
    def __init__(self, x):
        super().__init__(next_edges=[gradient_edge(x)], input_metadata=[x.data])

    def apply(self, grads):
        raise ValueError("bad backward")


@pytest.mark.parametrize("threads", [False, True], ids=["caller thread", "worker threads"])
def test_anomaly_note_names_the_node_and_its_forward_call(no_anomaly_warning, threads):
    x = leaf([1.0])
    with pyengine.set_multithreading_enabled(threads), pyengine.detect_anomaly():
        bad = T(x.data.copy())
        bad.grad_fn, bad.requires_grad = Fail(x), True  # the forward call the note shows
        with pytest.raises(ValueError, match="bad backward") as excinfo:
            (bad * 2.0).sum().backward()
    notes = "\n".join(excinfo.value.__notes__)
    assert "Error detected in Fail" in notes
    assert "bad.grad_fn, bad.requires_grad = Fail(x), True" in notes
    assert "bad.grad_fn, bad.requires_grad = Fail(x), True" in printed(excinfo.value)
    assert x.grad is None
    assert np.array_equal(x.data, [1.0])
