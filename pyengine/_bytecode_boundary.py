"""A bytecode boundary that compiled code can call.

See Note [Long passes let other threads run] in ``pyengine/_interrupts.pxd``.
"""


def bytecode_boundary():
    """Do nothing, in bytecode. Entering a Python function is where the
    interpreter hands the GIL to a thread that asked for it, and runs pending
    signal handlers (raising what they raise); a C caller gets both by
    calling this."""
