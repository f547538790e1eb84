"""The pure-Python twin of the compiled core.

Same names, same behaviour, plain Python (``heapq``, ``threading``): the
executable specification of the engine, the fallback where no compiled build
exists, and the baseline that shows what Cython buys. ``PYENGINE_PURE=1``
selects it (see :mod:`pyengine._core`).
"""
