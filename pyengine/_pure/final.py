"""The twin's ``@cython.final``: a class no other class may extend.

The compiled core declares its value classes (Edge, InputMetadata,
LeafState, InputBuffer, GraphTask, ExecInfo, NodeTask, ReadyQueue) final,
so that the C code that reads their fields reads the fields it was compiled
for. The twin's classes are plain Python and could be extended, which would
let a program run on the twin that the compiled core refuses. ``final``
refuses a subclass in CPython's own words for a final extension type.
"""

__all__ = ["final"]


def final(cls):
    """``cls``, refusing subclasses (TypeError) as a final extension type
    does."""
    def __init_subclass__(subclass, **kwargs):
        raise TypeError(f"type '{cls.__module__}.{cls.__qualname__}' is not an acceptable "
                        "base type")
    cls.__init_subclass__ = classmethod(__init_subclass__)
    return cls
