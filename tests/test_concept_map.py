"""The concept map (ARCHITECTURE.md) names only code that exists.

Every ``file:name`` in the map's tables must be defined in that file: a
function, class or module-level name (``def``, ``cdef``, ``cpdef``,
``class``, ``name =`` at the start of a line), ``Class.method`` a method
(or class-level name) inside that class, and in a C++ header a struct,
class or function. A bare file must exist. Oracle: the source files
themselves; the checker is itself checked on names that exist and names
that do not, so a map that goes stale fails here.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "ARCHITECTURE.md"

# `pyengine/_engine.pyx:Engine.execute`, `pyengine/_owner_graph.pyx`
REFERENCE = re.compile(r"`(pyengine/[\w/]+\.(?:py|pyx|pxd|h))(?::([\w.]+))?`")

# What the map must cover: PyTorch's engine concepts, by the names the
# first column uses for them.
PYTORCH_CONCEPTS = [
    "GraphTask", "NodeTask", "ReadyQueue", "CompareNodeTaskTime", "InputBuffer", "InputMetadata",
    "validate_outputs", "Engine::execute", "Engine::execute_with_graph_task", "Engine::thread_main",
    "Engine::evaluate_function", "call_function", "call_tensor_pre_hooks", "call_pre_hooks",
    "call_post_hooks", "post-accumulate-grad hooks", "retain_grad", "compute_dependencies",
    "init_to_execute", "exec_info_", "Capture", "mark_as_completed_and_run_post_processing",
    "exec_post_processing", "queue_callback", "set_exception", "thread_on_exception",
    "ThreadPoolShared", "add_thread_pool_task", "reentrant_thread_init", "max_recursion_depth_",
    "total_depth", "checkpoint_valid", "GraphRoot", "AccumulateGrad", "anomaly mode",
    "leaf_streams", "caller_current_streams", "Node", "Edge", "sequence_nr",
    "get_current_graph_task_exec_info", "_will_engine_execute_node", "worker_device",
    "start_device_threads",
]

PYENGINE_CONCEPTS = ["Owner graphs", "GradientFreeNode", "value backend registry", "fake device",
                     "let other threads run", "DependencyMap", "ExecInfoMap"]


def table_rows():
    """The map's table rows (the header and separator rows left out), as
    lists of cells."""
    rows = []
    for line in MAP.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[1] in ("Compiled core",):
            continue
        rows.append(cells)
    return rows


def references():
    found = []
    for cells in table_rows():
        for cell in cells:
            found.extend(REFERENCE.findall(cell))
    return sorted(set(found))


def _top_level_definition(name):
    name = re.escape(name)
    return re.compile(
        rf"^(?:(?:cdef\s+class|class|cdef|cpdef|def|async\s+def)\b[^=(\n]*?\b{name}\s*[(:]"
        rf"|(?:cdef\s+[\w\[\]\*]+\s+|DEF\s+)?{name}\s*=(?!=))", re.MULTILINE)


def _header_definition(name):
    name = re.escape(name)
    return re.compile(rf"^(?:(?:struct|class)\s+{name}\b|(?:inline|static)\b[^;\n]*\b{name}\s*\()",
                      re.MULTILINE)


def _class_body(source, class_name):
    """The lines of ``class_name``'s body: from its header to the next line
    at the start of the file's indentation (not blank, a comment or a
    decorator). None when no such class."""
    lines = source.splitlines()
    header = re.compile(rf"^(?:cdef\s+class|class)\s+{re.escape(class_name)}\b")
    start = next((number for number, line in enumerate(lines) if header.match(line)), None)
    if start is None:
        return None
    body = []
    for line in lines[start + 1:]:
        if line and not line[0].isspace() and not line.startswith(("#", "@")):
            break
        body.append(line)
    return "\n".join(body)


def is_defined(path, name):
    """Whether ``name`` (``f``, or ``Class.method``) is defined in ``path``
    (relative to the repository root)."""
    source = (ROOT / path).read_text(encoding="utf-8")
    if path.endswith(".h"):
        return "." not in name and bool(_header_definition(name).search(source))
    if "." not in name:
        return bool(_top_level_definition(name).search(source))
    class_name, member = name.split(".", 1)
    body = _class_body(source, class_name)
    if body is None or "." in member:
        return False
    member = re.escape(member)
    return bool(re.search(
        rf"^\s+(?:(?:async\s+def|def|cdef|cpdef)\b[^=(\n]*?\b{member}\s*\("
        rf"|{member}\s*=(?!=)|cdef\s+(?:public\s+|readonly\s+)?[\w\[\]\*]+\s+{member}\b)",
        body, re.MULTILINE))


def test_the_map_exists_and_names_code():
    assert len(references()) >= 100, "ARCHITECTURE.md's tables lost their file:name cells"


@pytest.mark.parametrize("path,name", references(), ids=lambda value: value or "-")
def test_every_name_in_the_map_is_defined_where_it_says(path, name):
    assert (ROOT / path).is_file(), f"ARCHITECTURE.md names {path}, which does not exist"
    if name:
        assert is_defined(path, name), f"ARCHITECTURE.md names {path}:{name}, not defined there"


def test_every_row_names_the_compiled_core_and_the_twin():
    for cells in table_rows():
        assert len(cells) == 4, cells
        concept, compiled, twin, _ = cells
        assert REFERENCE.search(compiled), f"no compiled-core location for {concept}"
        assert REFERENCE.search(twin), f"no twin location for {concept}"
        # The twin's column names the twin, the shared modules or the
        # Python layer, never the compiled modules.
        for path, _ in REFERENCE.findall(twin):
            assert not path.endswith((".pyx", ".pxd", ".h")), f"{concept}: twin column names {path}"


def test_the_map_covers_pytorchs_concepts_and_pyengines_own():
    concepts = " ".join(cells[0] for cells in table_rows()).lower()
    missing = [name for name in PYTORCH_CONCEPTS + PYENGINE_CONCEPTS if name.lower() not in concepts]
    assert not missing, f"ARCHITECTURE.md does not map {missing}"


def test_the_map_states_the_pytorch_revision_it_follows():
    text = MAP.read_text(encoding="utf-8")
    assert "PyTorch 2.x" in text and "torch 2.13" in text and "not the 2020 engine.cpp" in text


@pytest.mark.parametrize("path,name,expected", [
    ("pyengine/_pure/engine.py", "Engine.thread_main", True),
    ("pyengine/_pure/engine.py", "Engine.no_such_method", False),
    ("pyengine/_pure/engine.py", "thread_main", False),  # a method, not a module-level function
    ("pyengine/_pure/engine.py", "MAX_RECURSION_DEPTH", True),
    ("pyengine/_pure/engine.py", "NoSuchClass.execute", False),
    ("pyengine/_engine.pyx", "Engine.evaluate_function", True),
    ("pyengine/_dependencies.pyx", "compute_dependencies", True),
    ("pyengine/_engine.pyx", "compute_dependencies", False),  # moved to _dependencies.pyx
    ("pyengine/_engine.pyx", "WorkerState", True),
    ("pyengine/_engine.pyx", "Engine.compute_dependencies", False),
    ("pyengine/_node_task.h", "pyengine_CompareNodeTaskTime", True),
    ("pyengine/_node_task.h", "pyengine_NoSuchStruct", False),
    ("pyengine/_interrupts.pxd", "let_others_run", True),
])
def test_the_checker_tells_defined_names_from_missing_ones(path, name, expected):
    assert is_defined(path, name) is expected
