"""Install the debug build of pyengine (``PYENGINE_DEBUG=1``: bounds and
wraparound checks, line tracing, -O0; see setup.py) into the environment of
the Python that runs this script, and check that it is the debug build.

``python .ci/install_debug.py [--sanitize] [EXTRAS]``, e.g. ``test``.
``--sanitize`` builds AddressSanitizer and UndefinedBehaviorSanitizer in
as well (``PYENGINE_SANITIZE=1``, See Note [A sanitized build] in
setup.py); such a build runs only under ``.ci/sanitized``, as the check
here does, and the check also asks that every module links the ASan
runtime.

It builds from a copy of the checkout without build outputs: built in the
checkout, setuptools would reuse the extensions an optimized build left in
``build/``, and Cython the ``.cpp`` files next to the ``.pyx`` ones (both are
redone only when older than their sources; the compiler directives are not
among those). The check: the installed core's Cython code reports its lines
to a trace function, which only a line-tracing build does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = """
import sys

import numpy as np

import pyengine

assert pyengine.IMPLEMENTATION == "compiled", pyengine.IMPLEMENTATION
seen = set()


def tracer(frame, event, arg):
    seen.add(frame.f_code.co_filename)
    return tracer


class Leaf(pyengine.Node):
    def apply(self, grads):
        return []


sys.settrace(tracer)
pyengine.get_default_engine().execute([pyengine.Edge(Leaf(), 0)], [np.ones(1)], False, False, True)
sys.settrace(None)
traced = sorted(name.rsplit("/", 1)[-1] for name in seen if name.endswith(".pyx"))
assert "_engine.pyx" in traced, f"not a debug build: no line of _engine.pyx was traced ({traced})"
print("debug build:", pyengine.__file__, "traces", ", ".join(traced))
if len(sys.argv) > 1 and sys.argv[1] == "--sanitize":
    import glob
    import os
    import subprocess

    modules = glob.glob(os.path.join(os.path.dirname(pyengine.__file__), "_*.so"))
    assert modules, "no compiled module found"
    for module in modules:
        needed = subprocess.run(["readelf", "-d", module], capture_output=True, text=True,
                                check=True).stdout
        assert "libasan" in needed, f"not a sanitized build: {module} does not link libasan"
    print("sanitized:", len(modules), "modules link libasan")
"""


def copy_sources(destination):
    """The checkout's files but its build outputs: in a git checkout, the files
    git tracks or would (not the ignored ones: build outputs, environments)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, destination, ignore=shutil.ignore_patterns(
            ".git", ".tox", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", "*.so",
            "*.cpp", "*.pyd"))
        return
    for name in listed.decode().split("\0"):
        path = os.path.join(ROOT, name)
        if not name or not os.path.isfile(path):
            continue  # a file deleted in the work tree, or a submodule
        target = os.path.join(destination, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(path, target)


def main(argv):
    sanitize = "--sanitize" in argv
    argv = [arg for arg in argv if arg != "--sanitize"]
    extras = f"[{argv[0]}]" if argv else ""
    with tempfile.TemporaryDirectory(prefix="pyengine-debug-") as scratch:
        source = os.path.join(scratch, "src")
        copy_sources(source)
        env = dict(os.environ, PYENGINE_DEBUG="1")
        check = [sys.executable, "-c", CHECK]
        if sanitize:
            env["PYENGINE_SANITIZE"] = "1"
            check = [os.path.join(ROOT, ".ci", "sanitized")] + check + ["--sanitize"]
        # pip builds a local project each time it installs it; the check
        # below fails if an optimized pyengine was left in place instead.
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir",
                        source + extras], check=True, env=env)
        # From the scratch folder, so that the installed package is the one imported.
        subprocess.run(check, check=True, cwd=scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
