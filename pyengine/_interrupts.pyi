"""Letting other threads run in a long pass; the compiled core cimports it
(See Note [Long passes let other threads run] in _interrupts.pxd)."""
