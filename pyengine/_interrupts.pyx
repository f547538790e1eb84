"""Letting other threads run, and honouring signals, in a long pass that
holds the GIL: See Note [Long passes let other threads run] in
``_interrupts.pxd``."""

from pyengine._bytecode_boundary import bytecode_boundary as _bytecode_boundary


cdef int yield_to_other_threads() except -1:
    """Hand the GIL to any thread that asked for it, and run pending signal
    handlers."""
    _bytecode_boundary()
    return 0
