"""Every argument of a compiled ``def`` or ``cpdef`` function typed with an
extension type says ``not None`` (or the function checks None by hand),
since the body reads the object's C fields at once and would read None as
one: a crash. The twin refuses the same arguments (``check_argument`` in
``pyengine/_pure/static_types.py``), which the surface sweep
(``tests/test_surface_agreement.py``) checks call by call.

The oracle is the source: this reads each ``.pyx``'s signatures, so a new
function that forgets ``not None`` fails here before anyone calls it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pyengine"

# Arguments that may be None, each with the reason.
MAY_BE_NONE = {
    # An owner graph's graph task has no CPU ready queue: it never queues a
    # task. Engine._run_pool_task refuses such a graph task.
    ("_graph_task.pyx", "cpu_ready_queue"),
    # A cpdef argument cannot say ``not None``: run_owner_graph checks by hand.
    ("_owner_graph.pyx", "graph"),
}

SIGNATURE = re.compile(r"^[ \t]*(?:cpdef|def)\s+(\w+)\s*\((.*?)\)\s*(?:->[^:]*)?(?:except[^:]*)?:",
                       re.S | re.M)


def extension_types():
    names = set()
    for path in list(ROOT.glob("*.pyx")) + list(ROOT.glob("*.pxd")):
        names.update(re.findall(r"cdef class (\w+)", path.read_text()))
    return names


def unguarded_arguments():
    types = extension_types()
    found = []
    for path in sorted(ROOT.glob("*.pyx")):
        source = path.read_text()
        for match in SIGNATURE.finditer(source):
            for argument in match.group(2).split(","):
                words = argument.split()
                if (len(words) >= 2 and words[0] in types and "not None" not in argument
                        and (path.name, words[1].split("=")[0]) not in MAY_BE_NONE):
                    line = source.count("\n", 0, match.start()) + 1
                    found.append(f"{path.name}:{line} {match.group(1)}({' '.join(words)})")
    return found


def test_extension_type_arguments_say_not_none():
    assert unguarded_arguments() == []


def test_the_check_finds_what_it_looks_for(tmp_path, monkeypatch):
    # The checker itself, on a file that has one guarded and one unguarded
    # argument, so that a regex gone wrong cannot pass silently.
    (tmp_path / "sample.pyx").write_text(
        "cdef class Thing:\n    pass\n\n"
        "def good(Thing thing not None, int n):\n    pass\n\n"
        "def bad(self, Thing thing,\n        other=None):\n    pass\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert unguarded_arguments() == ["sample.pyx:7 bad(Thing thing)"]
