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

from ._core import RestoreOnExit, is_grad_enabled
from ._core import set_grad_enabled as _set_grad_enabled

__all__ = ["is_grad_enabled", "no_grad", "enable_grad", "set_grad_enabled"]


# Note [A mode context under an interrupt]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# From Python 3.10 on, Ctrl-C comes out on the main thread at a Python
# function's entry, after a call returns, or on a loop's back edge. A mode
# context written in Python (torch's are) leaves the mode changed where it
# comes out
# - in ``__enter__``, just after the call that set the mode: the with
#   block never began, so its ``__exit__`` never runs;
# - at ``__exit__``'s entry, before the call that puts the mode back.
# ``tests/test_interrupt_sweep.py`` raises KeyboardInterrupt at each such
# place of a block under each mode context, and found both. So:
# - ``__enter__`` (and ``__init__``, where a context sets its mode at once)
#   records what to put back, then sets the mode inside a ``try`` that puts
#   it back where the set raised or an interrupt came out as it returned;
# - ``__exit__`` is ``RestoreOnExit``'s (pyengine/_state.pyx), C in the
#   compiled core: it calls the recorded restore with no Python frame of
#   its own first. The twin's is Python, and so are its set functions
#   that restore a mode, so there windows at their entries (and before
#   their sets) are left.
# Left in both: a context that sets its mode at once (``set_grad_enabled``,
# ``set_detect_anomaly``, ``set_multithreading_enabled``) set it in the
# call that made it, and an interrupt as that call returns, before the
# with statement enters it, leaves the mode set (torch's semantics: the
# mode is set by the call, not by ``with``); and a second interrupt while
# ``__enter__`` puts the mode back after a first.


class _GradModeContext(RestoreOnExit):
    """Sets grad mode on entry, restores the previous mode on exit (See Note
    [A mode context under an interrupt])."""

    _enabled: bool

    def __enter__(self):
        # See Note [Where a mode context saves the previous mode] in
        # pyengine/anomaly_mode.py.
        _record_restore(self)
        try:
            _set_grad_enabled(self._enabled)
        except BaseException:
            # Ctrl-C as the set returned: no with block began, so nothing
            # else would put the mode back.
            self.__exit__(None, None, None)
            raise
        return self

    def __call__(self, function):
        enabled = self._enabled
        if inspect.isgeneratorfunction(function):
            @functools.wraps(function)
            def generator_wrapper(*args, **kwargs):
                return (yield from _resumed_under(enabled, function(*args, **kwargs)))

            return generator_wrapper

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with _SetOnEntry(enabled):
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
            with _SetOnEntry(enabled):
                value = step(argument)
        except StopIteration as stop:
            return stop.value
        try:
            argument = yield value
            step = generator.send
        except GeneratorExit:
            with _SetOnEntry(enabled):
                generator.close()
            raise
        except BaseException as error:
            step = generator.throw
            argument = error


class _SetOnEntry(_GradModeContext):
    """Grad mode ``enabled`` for a with block, set as it is entered: how the
    decorators run a function under their mode. ``set_grad_enabled`` would
    set it in the call that makes it, before the with statement, where
    Ctrl-C could come out with the mode set and no block to put it back
    (See Note [A mode context under an interrupt])."""

    def __init__(self, enabled: bool):
        self._enabled = enabled


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
        _record_restore(self)
        try:
            _set_grad_enabled(self._enabled)
        except BaseException:
            # As in _GradModeContext.__enter__.
            self.__exit__(None, None, None)
            raise

    def __enter__(self):
        # Set again, as torch's does. See Note [Where a mode context saves
        # the previous mode] in pyengine/anomaly_mode.py.
        try:
            _set_grad_enabled(self._enabled)
        except BaseException:
            # As in _GradModeContext.__enter__: the with statement failed.
            self.__exit__(None, None, None)
            raise
        return self

    def __call__(self, function):
        # Made for a decorator, not a call: the mode it set at once goes
        # back, as torch's does.
        _set_grad_enabled(*self.restore_args)
        return super().__call__(function)


def _record_restore(context):
    """Record in ``context`` how its exit puts back today's grad mode."""
    context.restore_args = (is_grad_enabled(),)
    context.restore = _set_grad_enabled
