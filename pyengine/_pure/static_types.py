"""The compiled core's static types, in the twin: what Cython refuses
before a compiled function's body runs, the twin refuses in the same words.

- ``@cython.final`` classes (Edge, InputMetadata, LeafState, InputBuffer,
  GraphTask, ExecInfo, NodeTask, ReadyQueue): their C code reads the fields
  it was compiled for, so no other class may extend them. ``final`` gives a
  twin class the same refusal.
- Arguments typed with an extension type and ``not None``: the compiled
  body reads the object's C fields at once (None would be read as one).
  ``check_argument`` is the same check for the twin's function.
"""

__all__ = ["check_argument", "final"]


def final(cls):
    """``cls``, refusing subclasses (TypeError) as a final extension type
    does."""
    def __init_subclass__(subclass, **kwargs):
        raise TypeError(f"type '{cls.__module__}.{cls.__qualname__}' is not an acceptable "
                        "base type")
    cls.__init_subclass__ = classmethod(__init_subclass__)
    return cls


def check_argument(name, value, expected):
    """TypeError, in Cython's words, unless ``value`` is an ``expected``."""
    if not isinstance(value, expected):
        raise TypeError(f"Argument '{name}' has incorrect type (expected "
                        f"{expected.__module__}.{expected.__qualname__}, got "
                        f"{type(value).__name__})")
