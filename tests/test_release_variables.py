"""release_variables: which nodes' overrides the engine calls, and what that costs.

See Note [Overriding release variables] in ``pyengine/_pure/node.py``.
Oracles: a log of the calls each node's release made, against the calls
the Note's rules give; and a count of the lookups of ``release_variables``
on a node's class (through a metaclass that counts them), against one per
node made plus one per release of a node whose class overrides it (none for
a class that does not). The suite runs on both cores.
"""

import pytest

import pyengine
from pyengine import Edge, Node

# -- helpers ------------------------------------------------------------------------------------


class Lookups(type):
    """A metaclass that counts the lookups of ``release_variables`` on its classes."""

    count = 0

    def __getattribute__(cls, name):
        if name == "release_variables":
            Lookups.count += 1
        return super().__getattribute__(name)


class Saving(Node):
    """A node that saves a value and passes no gradient."""

    def __init__(self, next_edges=()):
        super().__init__(next_edges=next_edges)
        self.save_for_backward("saved")

    def apply(self, grads):
        return [None] * len(self.next_edges)


def release(*nodes):
    """Run backward from the last of ``nodes`` (a chain), not retaining the graph."""
    pyengine.get_default_engine().execute([Edge(nodes[-1], 0)], [None], False, False, True)


def chain(node_type, length):
    nodes = []
    for _ in range(length):
        nodes.append(node_type([Edge(nodes[-1], 0)] if nodes else []))
    return nodes


# -- overrides --------------------------------------------------------------------------------------

def test_an_override_runs_once_per_release_after_its_node_ran():
    log = []

    class Freeing(Saving):
        def apply(self, grads):
            log.append(("apply", self.sequence_nr))
            return super().apply(grads)

        def release_variables(self):
            log.append(("release", self.sequence_nr))
            super().release_variables()

    nodes = chain(Freeing, 3)
    assert all(node._overrides_release_variables for node in nodes)
    release(*nodes)
    expected = []
    for node in reversed(nodes):
        expected += [("apply", node.sequence_nr), ("release", node.sequence_nr)]
    assert log == expected
    assert all(node._released and node._saved_values is None for node in nodes)


def test_a_node_without_an_override_releases_without_a_lookup():
    class Plain(Saving, metaclass=Lookups):
        pass

    Lookups.count = 0
    nodes = chain(Plain, 4)
    assert Lookups.count == 4  # one per node made
    assert not any(node._overrides_release_variables for node in nodes)
    release(*nodes)
    assert Lookups.count == 4  # none per release
    assert all(node._released and node._saved_values is None for node in nodes)


def test_an_override_is_looked_up_once_per_release():
    released = []

    class Counted(Saving, metaclass=Lookups):
        def release_variables(self):
            released.append(self)
            super().release_variables()

    Lookups.count = 0
    nodes = chain(Counted, 3)
    release(*nodes)
    assert Lookups.count == 3 + 3
    assert released == nodes[::-1]


def test_a_subclass_inherits_an_override():
    released = []

    class Freeing(Saving):
        def release_variables(self):
            released.append(type(self).__name__)
            super().release_variables()

    class Child(Freeing):
        pass

    class Grandchild(Child):
        def apply(self, grads):
            return super().apply(grads)

    nodes = [Freeing()]
    nodes.append(Child([Edge(nodes[-1], 0)]))
    nodes.append(Grandchild([Edge(nodes[-1], 0)]))
    assert all(node._overrides_release_variables for node in nodes)
    release(*nodes)
    assert released == ["Grandchild", "Child", "Freeing"]


def test_a_retained_graph_releases_nothing():
    released = []

    class Freeing(Saving):
        def release_variables(self):
            released.append(self)

    nodes = chain(Freeing, 2)
    pyengine.get_default_engine().execute([Edge(nodes[-1], 0)], [None], True, False, True)
    assert released == []
    assert not any(node._released for node in nodes)
    assert nodes[0].saved_values == ("saved",)


# -- changes after the node was made ------------------------------------------------------------

def test_an_override_given_to_the_class_later_reaches_only_nodes_made_afterwards():
    released = []

    class Plain(Saving):
        pass

    before = Plain()

    def release_variables(self):
        released.append(self)
        Node.release_variables(self)

    Plain.release_variables = release_variables
    after = Plain([Edge(before, 0)])
    assert (before._overrides_release_variables, after._overrides_release_variables) == (False,
                                                                                         True)
    release(before, after)
    assert released == [after]
    assert before._released and before._saved_values is None  # NodeBase's release


def test_replacing_an_override_on_the_class_takes_effect_at_once():
    log = []

    class Freeing(Saving):
        def release_variables(self):
            log.append("first")

    nodes = chain(Freeing, 2)
    Freeing.release_variables = lambda self: log.append("second")
    release(*nodes)
    assert log == ["second", "second"]


def test_removing_an_override_leaves_the_base_release():
    log = []

    class Freeing(Saving):
        def release_variables(self):
            log.append("override")

    node = Freeing()
    del Freeing.release_variables
    assert node._overrides_release_variables
    release(node)
    assert log == []
    assert node._released and node._saved_values is None


def test_a_function_set_on_the_node_is_not_an_override():
    log = []
    node = Saving()
    node.release_variables = lambda: log.append("instance")
    assert not node._overrides_release_variables
    release(node)
    assert log == []
    assert node._released and node._saved_values is None


def test_the_flag_is_read_only():
    node = Saving()
    for value in (True, False):
        with pytest.raises(AttributeError):
            node._overrides_release_variables = value
    assert not node._overrides_release_variables


def test_a_gradient_free_node_class_may_override_release_variables():
    from pyengine import GradientFreeNode

    log = []

    class Owner:
        def run(self):
            log.append("run")

    class Freeing(GradientFreeNode):
        def release_variables(self):
            log.append("release")
            super().release_variables()

    bottom = Freeing(Owner(), "run")
    top = Freeing(Owner(), "run", [Edge(bottom, 0)])
    release(bottom, top)
    assert log == ["run", "release", "run", "release"]


# -- a release seen from other code ------------------------------------------------------------


def test_a_node_reads_as_released_from_the_moment_its_release_begins():
    # Code that runs while a node's saved values are freed (here a saved
    # value's __del__; in a race, another thread's backward on the same
    # graph) must find the node released: PyTorch's error, not an empty
    # tuple of saved values. Oracle: the release's order in Note [A node is
    # marked released before it is cleared] (pyengine/_pure/engine.py).
    seen = []

    class Probe:
        def __del__(self):
            try:
                seen.append(node.saved_values)
            except RuntimeError as error:
                seen.append(str(error))

    node = Saving()
    node.save_for_backward(Probe())
    release(node)
    assert seen == [pyengine.node.RELEASED_ERROR]


def test_an_override_runs_on_a_node_already_marked_released():
    seen = []

    class Freeing(Saving):
        def release_variables(self):
            seen.append(self._released)
            super().release_variables()

    release(Freeing())
    assert seen == [True]
