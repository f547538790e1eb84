"""Owner graphs: a framework's own graph of values, read when backward runs.

Shared by both cores: the compiled engine runs the same specification
faster (See Note [Owner graphs]), and falls back to this translation where
its fast path does not apply.

Note [Owner graphs]
~~~~~~~~~~~~~~~~~~~
Some frameworks keep no backward graph apart from their values: each value
(an *owner*) holds a collection of the values it was made from (micrograd's
``_prev``) and a method that adds its ``.grad``'s contribution into theirs
in place (micrograd's ``_backward``). Such a graph is an *owner graph*:
``children`` names the collection, ``method`` the method. Its meaning is a
graph of gradient-free nodes (See Note [GradientFreeNode] in
``pyengine/_pure/node.py``), built by ``owner_graph_edge``:

- every owner reachable from the root through the collections whose own
  collection is not empty gets a node calling ``owner.<method>()``; an owner
  with an empty collection is a leaf, and nothing runs for it (only the
  methods of the owners above it write its ``.grad``);
- a node's next edges go to the nodes of its owner's distinct non-leaf
  children, in the collection's iteration order;
- the nodes are made children first, in the post-order of a depth-first
  search from the root that visits each collection in its iteration order,
  so their sequence numbers increase along that post-order and the root's
  is the highest.

Running that graph, the ready queue always pops the node latest in the
post-order among the ready ones; and the node latest in the post-order
among those not run yet is always ready, because each of its consumers
finished the search after it (a consumer reaches its child before it
finishes), so comes later in the post-order and has run. So the nodes run
in exactly the reverse post-order, and running them in that order needs no
dependency counts and no ready queue. Two consequences:

- A depth-first post-order that visits the collections in their iteration
  order is what micrograd's own ``backward`` computes (its recursive
  ``build_topo``), so the closures run in micrograd's order and every
  ``.grad`` is bitwise micrograd's.
- The compiled engine needs no node objects to run an owner graph: it
  computes the post-order (a search with a C stack, so any depth works) and
  calls the methods in reverse, with the thread state a graph task's node
  sees (grad mode off, the graph task current, so ``queue_callback``
  works). No object is made per owner, which matters more than the
  search's speed: micrograd's values are reference cycles, so the cyclic
  GC frees each graph, and every tracked object made per value, whether at
  forward or at backward, makes the GC's collections both more frequent
  and longer (``benchmarks/RESULTS.md`` has the figures). Inside another
  backward (reentrant), with a profiler, or with anomaly mode on, it runs
  the translation instead: the enclosing graph task, the profiler's events
  and anomaly mode's notes need nodes.

The search reads each owner's collection exactly once, through its own
iteration, when it first reaches that owner (after the ``children`` lookup
that told it the owner is no leaf), into a snapshot it owns (the twin:
``tuple(collection)``; the compiled core: owned references in one C array
used as a stack, so still no object per owner; an iterator made and freed
at once leaves the GC's allocation count where it was). So a collection
that changes while the search runs (a ``children`` property that edits
other collections, another thread) changes nothing the search already
read, and both cores visit the same owners in the same order. The compiled
search lets other threads run, and honours Ctrl-C, as it goes (See Note
[Long passes let other threads run] in ``pyengine/_interrupts.pxd``).

The graph belongs to the framework: it is read at each backward and never
released, so backward can run again. An owner graph with a cycle (an owner
among its own descendants) is an error, as it is for a backward graph: no
order runs it.
"""

__all__ = ["check_owner_graph_arguments", "cycle_error", "execute_translated",
           "owner_graph_edge", "owner_graph_post_order"]


def check_owner_graph_arguments(children, method):
    if not isinstance(children, str):
        raise TypeError(f"children must be a str (an attribute name), got {type(children).__name__}")
    if not isinstance(method, str):
        raise TypeError(f"method must be a str (a method name), got {type(method).__name__}")


def cycle_error(owner, children):
    return RuntimeError(
        f"the owner graph has a cycle: a {type(owner).__name__} is among its own "
        f"descendants through {children!r}")


# What owner_graph_post_order knows of an owner it has seen.
_ON_STACK = 0  # its search is not finished
_NODE = 1  # finished, and it has children: it has a node
_LEAF = 2  # no children: no node


class _Frame:
    """The search's place in one owner's collection of children."""

    __slots__ = ("owner", "children", "node_children", "node_child_ids")

    def __init__(self, owner, collection):
        self.owner = owner
        # Read once, here: See Note [Owner graphs].
        self.children = iter(tuple(collection))
        self.node_children = []  # its distinct non-leaf children so far
        self.node_child_ids = set()

    def add_node_child(self, child):
        if id(child) not in self.node_child_ids:
            self.node_child_ids.add(id(child))
            self.node_children.append(child)


def owner_graph_post_order(root, children):
    """The non-leaf owners under ``root`` (its own ``children`` collection
    included), each with the list of its distinct non-leaf children: pairs
    in the depth-first post-order of Note [Owner graphs]. Empty when
    ``root`` is a leaf. Iterative, so any depth works. Owners are told
    apart by identity, whatever their ``==``."""
    collection = getattr(root, children)
    if not collection:
        return []
    seen = {id(root): _ON_STACK}
    held = [root]  # keeps every owner seen alive, so that its id stays its own
    order = []
    stack = [_Frame(root, collection)]
    while stack:
        frame = stack[-1]
        for child in frame.children:
            child_state = seen.get(id(child))
            if child_state is None:
                held.append(child)
                grandchildren = getattr(child, children)
                if not grandchildren:
                    seen[id(child)] = _LEAF
                    continue
                seen[id(child)] = _ON_STACK
                frame.add_node_child(child)
                stack.append(_Frame(child, grandchildren))
                break  # search the child first; this frame resumes after it
            if child_state == _ON_STACK:
                raise cycle_error(child, children)
            if child_state == _NODE:
                frame.add_node_child(child)
        else:
            stack.pop()
            seen[id(frame.owner)] = _NODE
            order.append((frame.owner, frame.node_children))
    return order


def owner_graph_edge(root, children, method, node_type, edge_type):
    """The Edge into the node of ``root`` in the graph of gradient-free nodes
    that the owner graph under it means (See Note [Owner graphs]), or None
    when ``root`` is a leaf. ``node_type`` is a gradient-free node class
    taking ``(owner, method, next_edges)``, ``edge_type`` the core's Edge."""
    check_owner_graph_arguments(children, method)
    edge_of = {}  # id(owner) -> the Edge into its node
    edge = None
    for owner, owner_children in owner_graph_post_order(root, children):
        next_edges = tuple(edge_of[id(child)] for child in owner_children)
        edge = edge_of[id(owner)] = edge_type(node_type(owner, method, next_edges), 0)
    return edge


def execute_translated(engine, root, children, method, node_type, edge_type):
    """Run the owner graph under ``root`` by its translation (See
    ``owner_graph_edge``) with ``engine.execute``: no gradient enters, and
    the nodes are made for this one backward."""
    edge = owner_graph_edge(root, children, method, node_type, edge_type)
    if edge is not None:
        engine.execute([edge], [None], False, False, True)
