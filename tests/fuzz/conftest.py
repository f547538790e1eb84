"""The fuzz runs only when selected by marker (``-m fuzz``).

Each run of the fuzz tests both cores, in child processes, so the main runs
(``pytest`` against the compiled core, ``PYENGINE_PURE=1 pytest`` against
the twin) would run the same fuzz twice: they leave it out (deselected, and
counted as such in pytest's summary). ``pytest -m fuzz tests/fuzz`` runs it:
``.ci/run`` does, in a stage of its own, and ``tox -e fuzz``.
"""

from __future__ import annotations


def pytest_collection_modifyitems(config, items):
    if "fuzz" in (config.option.markexpr or ""):
        return
    selected, deselected = [], []
    for item in items:
        (deselected if item.get_closest_marker("fuzz") else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
