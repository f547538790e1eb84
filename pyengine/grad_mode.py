"""Grad mode: whether frontends record backward graphs, per thread.

``no_grad``, ``enable_grad`` and ``set_grad_enabled`` work as context
managers and decorators, as in ``torch`` (the first two bare too:
``@no_grad``): a decorated function runs under
the mode, and a decorated generator function runs under it each time it
resumes (the caller's mode is back between two values). Decorating with
``set_grad_enabled(mode)`` leaves the mode as it was before the call that
made the decorator. The engine itself sets grad mode
to ``create_graph`` while a node runs, so that a frontend consulting
:func:`is_grad_enabled` records the backward pass only under
``create_graph=True``.
"""

from __future__ import annotations

import functools
import inspect

from ._core import is_grad_enabled
from ._core import set_grad_enabled as _set_grad_enabled

__all__ = ["is_grad_enabled", "no_grad", "enable_grad", "set_grad_enabled"]


class _GradModeContext:
    """Sets grad mode on entry, restores the previous mode on exit."""

    _enabled: bool

    def __enter__(self):
        # See Note [Where a mode context saves the previous mode] in
        # pyengine/anomaly_mode.py.
        self._previous = is_grad_enabled()
        _set_grad_enabled(self._enabled)
        return self

    def __exit__(self, *exc_info):
        _set_grad_enabled(self._previous)
        return False

    def __call__(self, function):
        enabled = self._enabled
        if inspect.isgeneratorfunction(function):
            @functools.wraps(function)
            def generator_wrapper(*args, **kwargs):
                return (yield from _resumed_under(enabled, function(*args, **kwargs)))

            return generator_wrapper

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with set_grad_enabled(enabled):
                return function(*args, **kwargs)

        return wrapper


def _resumed_under(enabled, generator):
    """What ``generator`` yields, each of its steps run with grad mode
    ``enabled``, and the consumer's mode in place while it holds a value:
    a ``with`` around the whole generator would leak the mode to the
    consumer at each ``yield``. Values sent and errors thrown in are
    passed on, as ``yield from`` does."""
    step = generator.send
    argument = None
    while True:
        try:
            with set_grad_enabled(enabled):
                value = step(argument)
        except StopIteration as stop:
            return stop.value
        try:
            argument = yield value
            step = generator.send
        except GeneratorExit:
            with set_grad_enabled(enabled):
                generator.close()
            raise
        except BaseException as error:
            step = generator.throw
            argument = error


class _NoArgumentGradModeContext(_GradModeContext):
    """A mode context that takes no argument, so that, as torch's, it also
    decorates bare: ``@no_grad`` is ``@no_grad()``."""

    def __new__(cls, function=None):
        if function is None:
            return super().__new__(cls)
        return cls()(function)


class no_grad(_NoArgumentGradModeContext):
    """Disable recording in this block or function (``@no_grad`` or
    ``@no_grad()``)."""

    _enabled = False


class enable_grad(_NoArgumentGradModeContext):
    """Enable recording in this block or function (``@enable_grad`` or
    ``@enable_grad()``)."""

    _enabled = True


class set_grad_enabled(_GradModeContext):
    """``set_grad_enabled(mode)`` sets grad mode at once (like torch) and, used
    as a context manager, restores the previous mode on exit."""

    def __init__(self, mode: bool):
        self._enabled = bool(mode)
        self._previous = is_grad_enabled()
        _set_grad_enabled(self._enabled)

    def __enter__(self):
        # Set again, as torch's does.
        # See Note [Where a mode context saves the previous mode] in
        # pyengine/anomaly_mode.py.
        _set_grad_enabled(self._enabled)
        return self

    def __call__(self, function):
        # Made for a decorator, not a call: the mode it set at once goes
        # back, as torch's does.
        _set_grad_enabled(self._previous)
        return super().__call__(function)
