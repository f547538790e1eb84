"""The default engine, and swapping another one in.

``backward``, ``grad`` and ``queue_callback`` run on the engine returned
by :func:`get_default_engine`. Any object with PyTorch's
``execute(roots, grads, keep_graph, create_graph, accumulate_grad, outputs)``
and ``queue_callback(callback)`` can replace it. Also here: whether device
nodes run on the devices' worker threads (``set_multithreading_enabled``),
and ``execute_owner_graph``, the short form of an ``OwnerGraph`` in writes
mode (an owner graph runs on the core's own walk, not through ``execute``).
"""

from __future__ import annotations

from ._core import Engine, OwnerGraph, RestoreOnExit, is_multithreading_enabled
from ._core import set_multithreading_enabled as _set_multithreading_enabled

__all__ = ["Engine", "OwnerGraph", "get_default_engine", "set_default_engine", "queue_callback",
           "execute_owner_graph", "set_multithreading_enabled", "is_multithreading_enabled"]

_default_engine = Engine()


def get_default_engine():
    return _default_engine


def set_default_engine(engine):
    """Make ``engine`` the default; return the previous default."""
    global _default_engine
    for method in ("execute", "queue_callback"):
        if not callable(getattr(engine, method, None)):
            raise TypeError(f"an engine needs an {method}() method; {type(engine).__name__} has none")
    previous, _default_engine = _default_engine, engine
    return previous


def queue_callback(callback):
    """Run ``callback()`` once the backward pass that is running now completes.

    Only valid during backward (from a node, a hook or another callback).
    """
    return _default_engine.queue_callback(callback)


# The writes-mode OwnerGraphs execute_owner_graph made, by (children, method):
# a framework calls it with the same two names at every backward.
_writes_graphs = {}


def execute_owner_graph(root, children, method):
    """Run backward over a framework's own graph of values, read now: call
    ``owner.<method>()`` for ``root`` and for every value below it through
    the ``children`` collections that has children itself, each once every
    value made from it has run, in the order of a depth-first topological
    sort (micrograd's own). For frameworks whose backward closures add into
    their inputs' ``.grad`` in place (micrograd): no node is made at forward
    or at backward. ``OwnerGraph(children, method).backward(root)``; See
    Note [Owner graphs] in ``pyengine/_pure/owner_graph.py``."""
    # Only plain names are kept: a str subclass's __eq__ and __hash__ are its
    # own, and would find, or be found for, another pair of names.
    names = type(children) is str and type(method) is str
    graph = _writes_graphs.get((children, method)) if names else None
    if graph is None:
        graph = OwnerGraph(children, method)
        if names and len(_writes_graphs) < 64:
            _writes_graphs[children, method] = graph
    graph.backward(root)


class set_multithreading_enabled(RestoreOnExit):
    """``set_multithreading_enabled(False)`` runs every node of the backward
    calls this thread makes on this thread, device nodes included, instead of
    on the devices' worker threads (streams are still synchronized). Takes
    effect at once and, used as a context manager, restores the previous
    mode on exit; the mode is per thread, as in ``torch.autograd``."""

    def __init__(self, mode: bool):
        # See Note [A mode context under an interrupt] in pyengine/grad_mode.py.
        self.restore_args = (is_multithreading_enabled(),)
        self.restore = _set_multithreading_enabled
        try:
            _set_multithreading_enabled(mode)
        except BaseException:
            # Ctrl-C as the set returned: the caller never gets the context
            # whose exit would put the mode back.
            self.__exit__(None, None, None)
            raise

    def __enter__(self):
        return self
