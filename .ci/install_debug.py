"""Install the debug build of pyengine (``PYENGINE_DEBUG=1``: bounds and
wraparound checks, line tracing, -O0; see setup.py) into the environment of
the Python that runs this script, and check that it is the debug build.

``python .ci/install_debug.py [--sanitize[=address|thread]] [EXTRAS]``,
e.g. ``test``. ``--sanitize`` (or ``--sanitize=address``) builds
AddressSanitizer and UndefinedBehaviorSanitizer in as well
(``PYENGINE_SANITIZE=1``, See Note [A sanitized build] in setup.py).
``--sanitize=thread`` installs the optimized build (-O2, no line tracing)
with ThreadSanitizer compiled in (``PYENGINE_SANITIZE=thread``) instead of
the debug build: the debug build's line tracing has data races of its own,
which ThreadSanitizer reports (Cython's generated code caches each traced
function's code object in a static variable, which a function that runs
without the GIL writes on every call, from whichever thread calls it), and
it runs the thread fuzz no faster. A sanitized build runs only under
``.ci/sanitized`` (with ``PYENGINE_SANITIZE=thread`` for the latter), as
the check here does; the check also asks that every compiled module links
the sanitizer's runtime (libasan, libtsan), and, for the ThreadSanitizer
build, that no line of the core is traced (an optimized build).

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
sanitizer = sys.argv[1] if len(sys.argv) > 1 else None
if sanitizer == "thread":
    assert not traced, f"a debug build: lines of {traced} were traced"
    print("optimized build:", pyengine.__file__)
else:
    assert "_engine.pyx" in traced, f"not a debug build: no line of _engine.pyx was traced ({traced})"
    print("debug build:", pyengine.__file__, "traces", ", ".join(traced))
if sanitizer is not None:
    import glob
    import os
    import subprocess

    runtime = {"address": "libasan", "thread": "libtsan"}[sanitizer]
    modules = glob.glob(os.path.join(os.path.dirname(pyengine.__file__), "_*.so"))
    assert modules, "no compiled module found"
    for module in modules:
        needed = subprocess.run(["readelf", "-d", module], capture_output=True, text=True,
                                check=True).stdout
        assert runtime in needed, f"not a sanitized build: {module} does not link {runtime}"
    print("sanitized:", len(modules), "modules link", runtime)
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
    sanitizer = None
    for arg in argv:
        if arg == "--sanitize" or arg.startswith("--sanitize="):
            sanitizer = arg.partition("=")[2] or "address"
    if sanitizer not in (None, "address", "thread"):
        sys.exit(f"--sanitize={sanitizer}: address or thread")
    argv = [arg for arg in argv if not arg.startswith("--sanitize")]
    extras = f"[{argv[0]}]" if argv else ""
    with tempfile.TemporaryDirectory(prefix="pyengine-debug-") as scratch:
        source = os.path.join(scratch, "src")
        copy_sources(source)
        env = dict(os.environ, PYENGINE_DEBUG="1")
        check = [sys.executable, "-c", CHECK]
        if sanitizer == "thread":
            env.pop("PYENGINE_DEBUG")
            env["PYENGINE_SANITIZE"] = "thread"
        elif sanitizer == "address":
            env["PYENGINE_SANITIZE"] = "1"
        if sanitizer is not None:
            check = [os.path.join(ROOT, ".ci", "sanitized")] + check + [sanitizer]
        # pip builds a local project each time it installs it; the check
        # below fails if a build of another kind was left in place instead.
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir",
                        source + extras], check=True, env=env)
        # From the scratch folder, so that the installed package is the one
        # imported; .ci/sanitized picks its sanitizer from PYENGINE_SANITIZE.
        subprocess.run(check, check=True, cwd=scratch, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
