"""``pyengine._shared.weak_members.WeakMembers``: weakly held objects with a
value each, and no weak reference callback (See Note [No weak reference
callback on an engine path]). Oracles: which objects are alive, by
identity, and the value each was added with."""

from __future__ import annotations

import gc
import weakref

from pyengine._shared.weak_members import PRUNE_AT_LEAST, WeakMembers


class Object:
    pass


def test_members_are_the_live_objects_with_their_first_values():
    table = WeakMembers()
    kept = [Object() for _ in range(3)]
    for value, member in enumerate(kept):
        table.add(member, value)
    table.add(kept[0], "again")  # already a member: keeps its value
    dropped = Object()
    table.add(dropped, 99)
    del dropped
    gc.collect()
    assert {id(member) for member in table.members()} == {id(member) for member in kept}
    assert [table.get(member) for member in kept] == [0, 1, 2]
    assert table.get(Object(), "absent") == "absent"


def test_a_dead_members_entry_is_not_a_new_objects():
    table = WeakMembers()
    first = Object()
    table.add(first, "first")
    reference = weakref.ref(first)
    del first
    gc.collect()
    assert reference() is None
    # Whatever object now has the dead one's id, it is no member.
    assert all(table.get(Object()) is None for _ in range(100))


def test_growth_drops_the_dead_and_keeps_the_live():
    table = WeakMembers()
    kept = []
    for i in range(10 * PRUNE_AT_LEAST):
        member = Object()
        table.add(member, i)
        if i % 10 == 0:
            kept.append((member, i))
    del member
    gc.collect()
    # Passes ran as the table doubled: the dead entries do not pile up.
    assert len(table._entries) < 2 * len(kept) + 2 * PRUNE_AT_LEAST
    # A set: a new member may take a dead one's place in the table.
    assert {id(member) for member in table.members()} == {id(member) for member, _ in kept}
    assert all(table.get(member) == i for member, i in kept)
    table.clear()
    assert table.members() == []
