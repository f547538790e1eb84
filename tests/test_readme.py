"""Every fenced ``python`` block of README.md runs as written.

Each block runs in a fresh Python process, in a scratch folder, on the core
this suite tests (``PYENGINE_PURE`` passes through). The oracle: the block
exits cleanly, and every ``print(...)  # text`` line prints that text (the
parts of it between ``...`` in that order), so the README's claimed outputs
are the real ones; files a block writes (``"name.json"``, ``"name.dot"``) exist
and are not empty. A fence ```` ```python needs=dezero ```` names a framework
the block needs: the block is skipped only where that framework is not
installed (an installed framework that fails to import fails the test).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

import pyengine

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")

FENCE = re.compile(r"^```python(?P<info>[^\n]*)\n(?P<code>.*?)^```\s*$", re.MULTILINE | re.DOTALL)
PRINTED = re.compile(r"^\s*print\(.*\)\s+#\s*(?P<expected>.+?)\s*$", re.MULTILINE)
WRITTEN = re.compile(r"\"([\w.-]+\.(?:json|dot))\"")


def readme_blocks():
    """(line number, needed frameworks, code) of each fenced python block."""
    with open(README, encoding="utf-8") as file:
        text = file.read()
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        needs = [word.split("=", 1)[1] for word in match.group("info").split()
                 if word.startswith("needs=")]
        blocks.append(pytest.param(line, needs, match.group("code"), id=f"README.md:{line}"))
    return blocks


def test_the_readme_has_python_blocks():
    assert len(readme_blocks()) >= 5


@pytest.mark.parametrize("line, needs, code", readme_blocks())
def test_readme_block_runs_as_written(tmp_path, line, needs, code):
    for framework in needs:
        if importlib.util.find_spec(framework) is None:
            pytest.skip(f"README.md:{line} needs {framework}, which is not installed")
    # The pyengine this suite imported, wherever the block runs.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(pyengine.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_parent] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, (f"README.md:{line} failed:\n{result.stderr}")
    position = 0
    for expected in PRINTED.finditer(code):
        for part in (part.strip() for part in expected.group("expected").split("...")):
            found = result.stdout.find(part, position)
            assert found >= 0, (f"README.md:{line}: the output lacks {part!r} (its comment says so):\n"
                                f"{result.stdout}")
            position = found + len(part)
    for name in WRITTEN.findall(code):
        path = tmp_path / name
        assert path.exists() and path.stat().st_size > 0, f"README.md:{line} did not write {name}"
        if name.endswith(".json"):
            json.loads(path.read_text())
        if name.endswith(".dot"):
            assert path.read_text().lstrip().startswith("digraph")
