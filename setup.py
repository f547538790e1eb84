"""Build of pyengine's compiled core.

This is the one place that sets the Cython compiler directives. A debug
build (line tracing for coverage and profilers, bounds and wraparound
checks, C assertions and libstdc++'s on) is one environment variable away:

    PYENGINE_DEBUG=1 pip install .

AddressSanitizer and UndefinedBehaviorSanitizer are one more (See Note
[A sanitized build]):

    PYENGINE_SANITIZE=1 pip install .

and ThreadSanitizer another (data races between the engine's threads):

    PYENGINE_SANITIZE=thread pip install .

Where no C++ compiler works, the install falls back to the pure-Python twin:
See Note [Installing without a compiler].
"""

import os
import sys
import tempfile

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

DEBUG = os.environ.get("PYENGINE_DEBUG", "") not in ("", "0")
# "" (none), "address" (ASan and UBSan: PYENGINE_SANITIZE=1) or "thread"
# (TSan): See Note [A sanitized build].
SANITIZE = os.environ.get("PYENGINE_SANITIZE", "")
SANITIZE = "" if SANITIZE in ("", "0") else "thread" if SANITIZE == "thread" else "address"

COMPILED_MODULES = ["_state", "_interrupts", "_node", "_ready_queue", "_input_buffer", "_graph_task",
                    "_validate_outputs", "_owner_graph", "_dependencies", "_thread_pool",
                    "_engine"]

directives = {
    "language_level": 3,
    "embedsignature": True,
    # No generated __reduce_cython__ / __setstate_cython__: the latter set C
    # fields from a tuple without the checks of __init__ (nor, in this
    # build, a bound check). Each class that copies says how itself: See
    # Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
    "auto_pickle": False,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "linetrace": DEBUG,
    "profile": DEBUG,
}
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if DEBUG:
    # libstdc++'s checks too: every std::vector index of the C++ tables
    # (pyengine/*.h) is bounds-checked, and a bad one aborts with its place.
    macros += [("CYTHON_TRACE", "1"), ("CYTHON_TRACE_NOGIL", "1"), ("_GLIBCXX_ASSERTIONS", "1")]
else:
    macros += [("NDEBUG", "1")]

# Note [A sanitized build]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The compiled core's worst bug would be a read or write of memory it does
# not own: most do not crash where they happen, so a test passes over them.
# PYENGINE_SANITIZE=1 compiles AddressSanitizer (bad reads and writes,
# use after free) and UndefinedBehaviorSanitizer (overflow, bad shifts,
# misaligned or null access) into every module; a report aborts the
# process. The interpreter itself is not built with them, so the runtime
# must be loaded before anything else and Python's own allocator bypassed,
# so that every object gets ASan's guarded memory: .ci/sanitized runs a
# command that way. CI runs the debug build's tests so (.ci/run).
#
# PYENGINE_SANITIZE=thread compiles ThreadSanitizer instead (the two do not
# mix): every read and write of the compiled core is checked for a data
# race between threads (two accesses, one a write, that no lock, atomic,
# thread start or join orders), and lock-order inversions are reported;
# with -g, so that a report names the Cython function and its line in the
# generated .cpp, or the .h line (pyengine/*.h). The interpreter is
# not built with it, so TSan sees no access that Python's own code makes;
# it does see CPython's GIL (a pthread mutex and condition variable, whose
# calls its interceptors catch), so accesses that the GIL orders are not
# reported as races. A report does not stop the process; it exits with
# status 66. `PYENGINE_SANITIZE=thread .ci/sanitized COMMAND` runs a
# command so, with the suppressions of .ci/tsan.supp (each says why its
# reports are false). Measured on 2026-12-04 (optimized build, CPython
# 3.11): the thread fuzz (8,000 programs), the interrupt fuzz (4,000 runs),
# the stress tests and the threaded tests gave no report in pyengine's
# code, where a planted race (ReadyQueue.push_record without its mutex)
# gave hundreds in the thread fuzz's first batch. CI runs the optimized
# build so (.ci/tsan: 3,000 thread-fuzz programs, 800
# interrupt-fuzz runs, the threaded test files and the stress tests, each
# process stopped at its first report, halt_on_error, and any report fails
# the stage), not the debug build: its line tracing races on Cython's own
# per-function cache, written from every thread that runs a nogil
# function (.ci/install_debug.py --sanitize=thread).
sanitizer_flags = {
    "": [],
    "address": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                "-fno-omit-frame-pointer"],
    "thread": ["-fsanitize=thread", "-fno-omit-frame-pointer", "-g"],
}[SANITIZE]
if SANITIZE:
    # No freelists (GraphTask keeps some): each freed object goes back to
    # the allocator, where ASan sees a use after its free and TSan the
    # memory's next owner.
    macros += [("CYTHON_USE_FREELISTS", "0")]

extensions = [
    Extension(
        f"pyengine.{name}",
        [f"pyengine/{name}.pyx"],
        language="c++",
        include_dirs=[numpy.get_include(), "pyengine"],
        define_macros=macros,
        # Python's own flags define NDEBUG; a debug build takes it back, so
        # that C assert()s (pyengine's headers', CPython's inline ones) run.
        extra_compile_args=["-std=c++17", "-O0" if DEBUG else "-O2", "-g0" if not DEBUG else "-g"]
        + (["-UNDEBUG"] if DEBUG else []) + sanitizer_flags,
        extra_link_args=sanitizer_flags,
    )
    for name in COMPILED_MODULES
]


# Note [Installing without a compiler]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# pyengine's pure-Python twin is the fallback where no compiled build exists
# (pyengine/_core.py picks it, with a warning, when the compiled modules are
# missing). So a machine without a working C++ compiler still gets a working
# install: before building the extensions, build_ext compiles and links a
# one-line C++ file with the very compiler and flags the extensions would
# use. If that fails, no extension is built (and any an earlier build left
# in the build folder is removed), a warning says why, and the
# package installs without its compiled modules; pip shows the warning with
# ``pip install -v``, and importing pyengine warns every time. If the probe
# works, the extensions build as usual and an error in them fails the
# install: a broken build must not pass for a missing compiler.


def warn(message):
    bar = "*" * 78
    print(f"\n{bar}\npyengine: {message}\n{bar}\n", file=sys.stderr, flush=True)


class BuildExtOrFallBack(build_ext):
    """build_ext that builds nothing, with a warning, where no C++ compiler
    works. See Note [Installing without a compiler]."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            # The modules compile independently: one compiler per core this
            # process may use (a container's limit, not the machine's count)
            # unless asked otherwise (-j / --parallel), as pip asks nothing.
            if hasattr(os, "sched_getaffinity"):
                self.parallel = len(os.sched_getaffinity(0)) or 1
            else:
                self.parallel = os.cpu_count() or 1

    def build_extensions(self):
        problem = self.compiler_problem()
        if problem is None:
            super().build_extensions()
            return
        # A compiled module an earlier build left where this one puts its
        # output (build/lib.*/pyengine/) would be packaged as if just built.
        for extension in self.extensions:
            stale = self.get_ext_fullpath(extension.name)
            if os.path.exists(stale):
                os.remove(stale)
        warn(f"no working C++ compiler ({problem}), so the compiled core is not built and "
             "pyengine installs as its pure-Python twin, which is several times slower. Install a "
             "C++17 compiler (g++ or clang++) and reinstall pyengine (pip install --force-reinstall "
             "--no-cache-dir ...) to get the compiled core.")

    def compiler_problem(self):
        """Why the compiler cannot build a C++ extension, or None if it can."""
        probe = extensions[0]
        with tempfile.TemporaryDirectory(prefix="pyengine-probe-") as scratch:
            source = os.path.join(scratch, "probe.cpp")
            with open(source, "w") as file:
                file.write("int pyengine_probe() { return 0; }\n")
            try:
                objects = self.compiler.compile([source], output_dir=scratch,
                                                extra_postargs=probe.extra_compile_args)
                self.compiler.link_shared_object(
                    objects, os.path.join(scratch, "probe" + self.compiler.shared_lib_extension),
                    target_lang=probe.language)
            except (CCompilerError, ExecError, PlatformError, OSError) as error:
                text = str(error)
                return text if len(text) < 200 else f"{text[:200]}..."
        return None


# force: the generated C++ depends on the numpy (its .pxd and headers) of the
# build environment, which a timestamp does not tell; a .cpp left from a
# build against another numpy does not compile.
setup(ext_modules=cythonize(extensions, compiler_directives=directives, nthreads=os.cpu_count() or 1,
                            force=True),
      cmdclass={"build_ext": BuildExtOrFallBack})
