"""The pure-Python twin of the compiled core.

Same names, same behaviour, plain Python (lists, ``threading``): the
executable specification of the engine, the fallback where no compiled build
exists, and the baseline that shows what Cython buys. ``PYENGINE_PURE=1``
selects it (see :mod:`pyengine._core`).

What both cores share (hooks, ``validate_gradient``, device threads,
streams, error messages) lives in ``pyengine/_shared/``, which the twin
imports exactly as the compiled core does: See Note [Slow paths are
shared] there.
"""
