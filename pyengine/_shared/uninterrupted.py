"""Steps that Ctrl-C cannot split.

From Python 3.10 on, CPython raises what a signal handler raises (Ctrl-C's
KeyboardInterrupt) on the main thread at a Python function's entry, after
a call returns, or on a loop's back edge; never inside C code that calls
only C. So a loop of several C calls whose effects must all happen or none
runs as one call: ``run_all(map(function, ...))`` with the ``map`` made
first (its call is a place of its own, before any effect) and nothing but
assignments between it and ``run_all``.
"""

from __future__ import annotations

from collections import deque

__all__ = ["run_all"]

# Consumes an iterator in C, keeping nothing: ``deque(maxlen=0).extend``.
run_all = deque(maxlen=0).extend
