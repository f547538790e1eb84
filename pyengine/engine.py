"""The default engine, and swapping another one in.

``backward``, ``grad`` and ``queue_callback`` run on the engine returned by
:func:`get_default_engine`. Any object with PyTorch's
``execute(roots, grads, keep_graph, create_graph, accumulate_grad, outputs)``
and ``queue_callback(callback)`` can replace it.
"""

from __future__ import annotations

from ._core import Engine, register_engine

__all__ = ["Engine", "get_default_engine", "set_default_engine", "queue_callback"]

_default_engine = Engine()
register_engine(_default_engine)


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
