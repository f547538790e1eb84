"""The pure-Python twin of the compiled core.

Same names, same behaviour, plain Python (lists, ``threading``): the
executable specification of the engine, the fallback where no compiled build
exists, and the baseline that shows what Cython buys. ``PYENGINE_PURE=1``
selects it (see :mod:`pyengine._core`).

Note [Slow paths are shared]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The compiled core does in C what runs per node and per edge on the common
path: queue, dependency counts, buffers, a numpy gradient that already has
the right shape, dtype and device, a node without hooks. For the rare paths
(hooks, broadcast reductions and casts, other value types, anomaly checks)
it calls the functions of this twin, which only touch the attributes both
cores share. Each rule is then written once, and the twin stays the
specification of both.
"""
