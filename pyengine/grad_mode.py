"""Grad mode: whether frontends record backward graphs, per thread.

``no_grad``, ``enable_grad`` and ``set_grad_enabled`` work as context
managers and decorators, as in ``torch``. The engine itself sets grad mode
to ``create_graph`` while a node runs, so that a frontend consulting
:func:`is_grad_enabled` records the backward pass only under
``create_graph=True``.
"""

from __future__ import annotations

import functools

from ._core import is_grad_enabled
from ._core import set_grad_enabled as _set_grad_enabled

__all__ = ["is_grad_enabled", "no_grad", "enable_grad", "set_grad_enabled"]


class _GradModeContext:
    """Sets grad mode on entry, restores the previous mode on exit."""

    _enabled: bool

    def __enter__(self):
        self._previous = is_grad_enabled()
        _set_grad_enabled(self._enabled)
        return self

    def __exit__(self, *exc_info):
        _set_grad_enabled(self._previous)
        return False

    def __call__(self, function):
        enabled = self._enabled

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with set_grad_enabled(enabled):
                return function(*args, **kwargs)

        return wrapper


class no_grad(_GradModeContext):
    """Disable recording in this block or function."""

    _enabled = False


class enable_grad(_GradModeContext):
    """Enable recording in this block or function."""

    _enabled = True


class set_grad_enabled(_GradModeContext):
    """``set_grad_enabled(mode)`` sets grad mode at once (like torch) and, used
    as a context manager, restores the previous mode on exit."""

    def __init__(self, mode: bool):
        self._enabled = bool(mode)
        self._previous = is_grad_enabled()
        _set_grad_enabled(self._enabled)

    def __enter__(self):
        return self
