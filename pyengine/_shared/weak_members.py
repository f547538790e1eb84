"""A set of objects held weakly whose members' deaths run no Python code.

Note [No weak reference callback on an engine path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``weakref.WeakSet`` and ``WeakKeyDictionary`` drop a dead member through a
callback, Python code that runs wherever the member dies: for a graph task
or a stream, in the engine or in the caller's frame as a backward returns.
CPython runs signal handlers at a Python function's entry, so Ctrl-C there
raised KeyboardInterrupt inside the callback, and CPython reports an error
from a weak reference callback and drops it: the interrupt was lost
(``tests/test_interrupt_sweep.py`` found this in the device threads' set of
graph tasks, the fake runtime's set of streams and the profiler's table of
runs). So these hold weak references with no callback (a death then runs
no Python code), keyed by ``id`` and checked against the object on each
look, and drop the dead ones in a pass each time their table has doubled
since the last.
"""

from __future__ import annotations

import weakref

__all__ = ["WeakMembers", "PRUNE_AT_LEAST"]

# The least table size at which a pass drops dead entries.
PRUNE_AT_LEAST = 64


class WeakMembers:
    """A set of weakly held objects (by identity), as ``weakref.WeakSet``
    without its callbacks: See Note [No weak reference callback on an engine
    path]. Not thread-safe: its owner guards it."""

    __slots__ = ("_references", "_prune_at")

    def __init__(self):
        self._references: dict = {}
        self._prune_at = PRUNE_AT_LEAST

    def add(self, member) -> None:
        references = self._references
        key = id(member)
        reference = references.get(key)
        # A dead member's id may be a new object's: its entry names another.
        if reference is not None and reference() is member:
            return
        if len(references) >= self._prune_at:
            self._references = references = {
                live_key: live for live_key, live in references.items() if live() is not None}
            self._prune_at = max(PRUNE_AT_LEAST, 2 * len(references))
        references[key] = weakref.ref(member)

    def members(self) -> list:
        """The members still alive."""
        alive = [reference() for reference in self._references.values()]
        return [member for member in alive if member is not None]

    def __len__(self) -> int:
        return len(self.members())

    def __iter__(self):
        return iter(self.members())
