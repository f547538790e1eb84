"""Anomaly mode: forward tracebacks on nodes, NaN checks on gradients.

While anomaly mode is on, every node created keeps the stack of its
creation in ``node.metadata["traceback_"]``; an error raised while running
a node gets a note naming the node and showing that forward traceback; and,
with ``check_nan``, a node returning NaN raises ``RuntimeError("Function 'X'
returned nan values in its 0th output.")``. The mode is global, as in
PyTorch. It slows the engine down: use it to debug.
"""

from __future__ import annotations

import warnings

from ._core import (
    RestoreOnExit,
    is_anomaly_check_nan_enabled,
    is_anomaly_enabled,
    set_anomaly_enabled,
)

__all__ = ["detect_anomaly", "set_detect_anomaly", "is_anomaly_enabled",
           "is_anomaly_check_nan_enabled"]


# Note [Where a mode context saves the previous mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each context manager saves the mode it restores on exit where torch's
# does, so that reusing one instance behaves as in torch:
# - ``detect_anomaly``, ``set_detect_anomaly`` and ``set_grad_enabled``
#   save it in ``__init__``. The same ``detect_anomaly`` entered twice,
#   nested, restores the mode of before its construction at both exits;
#   saving it in ``__enter__`` instead made the inner entry save "on", and
#   anomaly mode stayed on after both exits. ``set_grad_enabled`` also sets
#   its mode again in ``__enter__``, so that an instance entered a second
#   time (after its first exit restored the mode) runs its block under its
#   mode.
# - ``no_grad`` and ``enable_grad`` save it in ``__enter__``, as torch's do
#   (an instance made once and entered many times, as a decorator's is,
#   restores the mode of each entry).


class detect_anomaly(RestoreOnExit):
    """Context manager (and decorator) that turns anomaly mode on, and on
    exit restores the mode of before it was made (as torch's does). See
    Note [A mode context under an interrupt] in pyengine/grad_mode.py."""

    def __init__(self, check_nan: bool = True):
        self.check_nan = check_nan
        # See Note [Where a mode context saves the previous mode].
        _record_restore(self)
        warnings.warn("Anomaly Detection has been enabled. This mode will increase the runtime "
                      "and should only be enabled for debugging.", stacklevel=2)

    def __enter__(self):
        try:
            set_anomaly_enabled(True, self.check_nan)
        except BaseException:
            # Ctrl-C as the set returned: no with block began, so nothing
            # else would put the mode back.
            self.__exit__(None, None, None)
            raise
        return self

    def __call__(self, function):
        def wrapper(*args, **kwargs):
            with self.__class__(self.check_nan):
                return function(*args, **kwargs)

        return wrapper


class set_detect_anomaly(RestoreOnExit):
    """``set_detect_anomaly(mode, check_nan=True)`` sets anomaly mode at once and,
    used as a context manager, restores the previous mode on exit. See Note
    [A mode context under an interrupt] in pyengine/grad_mode.py."""

    def __init__(self, mode: bool, check_nan: bool = True):
        # See Note [Where a mode context saves the previous mode].
        _record_restore(self)
        try:
            set_anomaly_enabled(mode, check_nan)
        except BaseException:
            # As in detect_anomaly.__enter__.
            self.__exit__(None, None, None)
            raise

    def __enter__(self):
        return self


def _record_restore(context):
    """Record in ``context`` how its exit puts back today's anomaly mode."""
    context.restore_args = (is_anomaly_enabled(), is_anomaly_check_nan_enabled())
    context.restore = set_anomaly_enabled
