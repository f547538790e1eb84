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

__all__ = ["WeakMembers"]

# The least table size at which a pass drops dead entries.
PRUNE_AT_LEAST = 64


class WeakMembers:
    """Weakly held objects (by identity), each with a value (None unless
    given): ``weakref.WeakSet`` and ``WeakKeyDictionary`` without their
    callbacks (See Note [No weak reference callback on an engine path]).
    Not thread-safe: its owner guards it."""

    __slots__ = ("_entries", "_prune_at")

    def __init__(self):
        # id(member) -> (weak reference to it, its value)
        self._entries: dict = {}
        self._prune_at = PRUNE_AT_LEAST

    def get(self, member, default=None):
        """``member``'s value, or ``default`` where it is not a member."""
        entry = self._entries.get(id(member))
        # A dead member's id may be a new object's: its entry names another.
        if entry is not None and entry[0]() is member:
            return entry[1]
        return default

    def add(self, member, value=None) -> None:
        """Make ``member`` a member with ``value``; one already is keeps its own."""
        entries = self._entries
        entry = entries.get(id(member))
        if entry is not None and entry[0]() is member:
            return
        if len(entries) >= self._prune_at:
            self._entries = entries = {
                key: live for key, live in entries.items() if live[0]() is not None}
            self._prune_at = max(PRUNE_AT_LEAST, 2 * len(entries))
        entries[id(member)] = (weakref.ref(member), value)

    def members(self) -> list:
        """The members still alive."""
        alive = [reference() for reference, _ in self._entries.values()]
        return [member for member in alive if member is not None]

    def __iter__(self):
        return iter(self.members())

    def clear(self) -> None:
        self._entries.clear()
        self._prune_at = PRUNE_AT_LEAST
