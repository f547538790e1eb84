"""Every ``Note [X]`` the code and its documents cite exists where they say.

A Note is defined by a line ``Note [X]`` (in a comment or a docstring)
underlined with ``~~~``. A reference is ``Note [X]`` anywhere else, possibly
wrapped over lines and followed by ``in <path>``; it must name a defined
Note, in ``<path>`` when it gives one. Scanned: the package, the tests, the
examples, the benchmarks' code, setup.py, README.md and ARCHITECTURE.md; a
path may be given from the package's folder (``in _locks.pxd``). Not
benchmarks/RESULTS.md: a log of past measurements, whose older sections
cite Notes as they were then (each says where a removed one went). Oracle:
the source files themselves; the checker is checked on a text whose
references it must accept and reject.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ["pyengine", "tests", "examples", "benchmarks"]
DOCUMENTS = ["README.md", "ARCHITECTURE.md", "setup.py"]
SUFFIXES = {".py", ".pyx", ".pxd", ".pyi", ".h", ".md"}

# What starts a comment or docstring line: dropped before a line is read.
_LINE_PREFIX = re.compile(r"^\s*(?:#+|//+|/?\*+/?)?\s*")
_DEFINITION = re.compile(r"Note \[([^\]]+)\]")
_UNDERLINE = re.compile(r"~{3,}")
# ``in path``: a path with a slash or a source suffix, possibly quoted.
_REFERENCE = re.compile(r"Note\s+\[([^\]]+)\](?:\s*,?\s+in\s+(?:the\s+)?`*([\w./-]*\w)`*)?")


def _lines(text):
    return [_LINE_PREFIX.sub("", line).rstrip() for line in text.split("\n")]


def definitions(texts):
    """Note name -> the files that define it."""
    defined = {}
    for path, text in texts.items():
        lines = _lines(text)
        for line, below in zip(lines, lines[1:]):
            match = _DEFINITION.fullmatch(line.strip().strip('"'))
            if match and _UNDERLINE.fullmatch(below.strip()):
                defined.setdefault(match.group(1), set()).add(path)
    return defined


def broken_references(texts, defined):
    """``(file, line, name, path or None)`` per reference that does not resolve."""
    broken = []
    for path, text in texts.items():
        lines = _lines(text)
        # A message wrapped over string literals: "... Note [Views and the "
        # then "version counter] ...".
        joined = re.sub(r'"\n\s*f?"', "\n", "\n".join(lines))
        for match in _REFERENCE.finditer(joined):
            line = joined.count("\n", 0, match.start())
            if line + 1 < len(lines) and _UNDERLINE.fullmatch(lines[line + 1].strip()):
                continue  # the definition itself
            name = " ".join(match.group(1).split())
            where = defined.get(name, set())
            cited = match.group(2)
            if cited is not None and ("/" in cited or Path(cited).suffix in SUFFIXES | {".py"}):
                if not any(file == cited or file.endswith("/" + cited) for file in where):
                    broken.append((path, line + 1, name, cited))
            elif not where:
                broken.append((path, line + 1, name, None))
    return broken


def _sources():
    texts = {}
    for folder in SCANNED:
        for file in sorted((ROOT / folder).rglob("*")):
            if file.suffix not in SUFFIXES or "__pycache__" in file.parts:
                continue
            if file.name in ("RESULTS.md", Path(__file__).name):
                continue  # a log of the past; this checker's own examples
            texts[file.relative_to(ROOT).as_posix()] = file.read_text(encoding="utf-8")
    for document in DOCUMENTS:
        texts[document] = (ROOT / document).read_text(encoding="utf-8")
    return texts


def test_every_note_reference_resolves():
    texts = _sources()
    defined = definitions(texts)
    assert len(defined) > 50  # the checker finds the Notes at all
    broken = broken_references(texts, defined)
    assert not broken, "\n".join(
        f"{path}:{line}: Note [{name}]" + (f" in {cited}" if cited else "") + " is not defined"
        + (f" there (it is in {', '.join(sorted(defined[name]))})" if defined.get(name) else "")
        for path, line, name, cited in broken)


def test_the_checker_tells_resolved_references_from_broken_ones():
    texts = {
        "pkg/a.py": "# Note [Kept]\n# ~~~~~~~~~~\n# Why it is kept.\n",
        "pkg/b.py": ("# See Note [Kept] in pkg/a.py, and Note\n# [Kept] wrapped.\n"
                     "# Note [Kept] in pkg/b.py is in the wrong file.\n"
                     '"""See Note [Gone]."""\n'),
    }
    defined = definitions(texts)
    assert defined == {"Kept": {"pkg/a.py"}}
    assert broken_references(texts, defined) == [
        ("pkg/b.py", 3, "Kept", "pkg/b.py"), ("pkg/b.py", 4, "Gone", None)]
