"""The ``.pyi`` stubs name what the compiled modules define.

The modules come from setup.py's ``COMPILED_MODULES`` (read, not run), so a
new compiled module is checked as soon as it is built. The oracle for each
module is its ``.pyx`` source: the public names it defines at top level
(``def``, ``cpdef``, ``class``, ``cdef class``, ``NAME = ...``) that the built
module really has (a ``cdef`` function is not visible from Python); its
``.pyi`` must name exactly those, and nothing the built module lacks. Names
a module only imports (``np``, the twin's helpers) are not its own and stay
out of its stub.
"""

from __future__ import annotations

import ast
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFINED = re.compile(r"^(?:(?:cdef\s+(?:public\s+|readonly\s+)?)?class\s+(?P<cls>\w+)"
                     r"|def\s+(?P<fn>\w+)\s*\("
                     r"|cpdef\s+(?:[\w\[\]*,. ]+\s+)?(?P<cpfn>\w+)\s*\("
                     r"|(?P<const>[A-Za-z]\w*)\s*(?::[^=]+)?=(?!=))", re.MULTILINE)


def compiled_modules():
    """``COMPILED_MODULES`` from setup.py, without running setup.py."""
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as file:
        tree = ast.parse(file.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "COMPILED_MODULES" for target in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no COMPILED_MODULES list")


def defined_in_source(name):
    """Public names the ``.pyx`` defines at top level."""
    with open(os.path.join(ROOT, "pyengine", f"{name}.pyx"), encoding="utf-8") as file:
        source = file.read()
    names = {next(group for group in match.groups() if group) for match in DEFINED.finditer(source)}
    return {found for found in names if not found.startswith("_")}


def named_in_stub(path):
    """Public top-level names a ``.pyi`` declares."""
    with open(path, encoding="utf-8") as file:
        tree = ast.parse(file.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return {found for found in names if not found.startswith("_")}


def test_setup_lists_every_pyx():
    on_disk = {name[:-len(".pyx")] for name in os.listdir(os.path.join(ROOT, "pyengine"))
               if name.endswith(".pyx")}
    assert set(compiled_modules()) == on_disk


@pytest.mark.parametrize("name", compiled_modules())
def test_stub_names_match_the_compiled_module(name):
    try:
        module = importlib.import_module(f"pyengine.{name}")
    except ImportError as error:
        pytest.skip(f"pyengine.{name} is not built here ({error}); the compiled runs check it")
    public = {found for found in dir(module) if not found.startswith("_")}
    own = defined_in_source(name) & public
    stub = os.path.join(ROOT, "pyengine", f"{name}.pyi")
    if not os.path.exists(stub):
        assert not own, f"pyengine/{name}.pyi is missing; the module defines {sorted(own)}"
        return
    declared = named_in_stub(stub)
    assert declared - public == set(), f"pyengine/{name}.pyi names what the module lacks"
    assert own - declared == set(), f"pyengine/{name}.pyi lacks names the module defines"
    assert declared - own == set(), f"pyengine/{name}.pyi names what the module only imports"
