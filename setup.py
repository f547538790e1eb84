"""Build of pyengine's compiled core.

This is the one place that sets the Cython compiler directives. A debug
build (line tracing for coverage and profilers, bounds and wraparound
checks, C assertions on) is one environment variable away:

    PYENGINE_DEBUG=1 pip install .
"""

import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("PYENGINE_DEBUG", "") not in ("", "0")

COMPILED_MODULES = ["_state", "_interrupts", "_node", "_ready_queue", "_input_buffer", "_graph_task",
                    "_validate_outputs", "_owner_graph", "_dependencies", "_thread_pool",
                    "_engine"]

directives = {
    "language_level": 3,
    "embedsignature": True,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "linetrace": DEBUG,
    "profile": DEBUG,
}
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if DEBUG:
    macros += [("CYTHON_TRACE", "1"), ("CYTHON_TRACE_NOGIL", "1")]
else:
    macros += [("NDEBUG", "1")]

extensions = [
    Extension(
        f"pyengine.{name}",
        [f"pyengine/{name}.pyx"],
        language="c++",
        include_dirs=[numpy.get_include(), "pyengine"],
        define_macros=macros,
        extra_compile_args=["-std=c++17", "-O0" if DEBUG else "-O2", "-g0" if not DEBUG else "-g"],
    )
    for name in COMPILED_MODULES
]

setup(ext_modules=cythonize(extensions, compiler_directives=directives, nthreads=os.cpu_count() or 1))
