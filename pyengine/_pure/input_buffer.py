"""InputBuffer: the gradients flowing into one node, summed per input slot.

Twin of ``pyengine/_input_buffer.pyx``.

Note [InputBuffer ownership]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The first gradient to reach a slot is stored as it is: no copy. It may be a
view of something its producer keeps, or the very array a user passed as
``grad_tensors``, so the engine must never write into it. The second
gradient is added out of place, into a new value that the buffer allocated
and therefore owns; from the third on, the buffer adds in place into that
owned value. Under ``create_graph`` every sum is out of place, so that the
frontend records it. The buffer remembers ownership per slot, by identity.
"""

from ..backends import backend_of
from ..device import CPU


class InputBuffer:
    """Per-slot gradient sums for one node.

    ``buffer`` holds one value (or None) per input slot; ``device`` is the
    device of the first non-CPU value added, else the CPU. Owned by one
    NodeTask or by its GraphTask's ``not_ready`` map, whose lock guards it.
    """

    __slots__ = ("buffer", "device", "_owned")

    def __init__(self, size):
        self.buffer = [None] * size
        self.device = CPU
        # _owned[i] is the value the buffer allocated for slot i, or None.
        self._owned = None

    def add(self, pos, value, create_graph):
        """Add ``value`` into slot ``pos`` (See Note [InputBuffer ownership])."""
        if value is None:
            return
        buffer = self.buffer
        # Python code can reach an InputBuffer (pyengine._core.InputBuffer)
        # and write its buffer; the engine's own are never None and take
        # slots from Edges, which are never negative (See Note [Edge input_nr]
        # in pyengine/_shared/messages.py).
        if buffer is None:
            raise TypeError("InputBuffer.buffer is None; expected a list")
        if pos < 0:
            raise IndexError(f"InputBuffer slot {pos} is negative")
        if pos >= len(buffer):
            # A node that declared no metadata for this slot: grow to fit.
            buffer.extend([None] * (pos + 1 - len(buffer)))
        old = buffer[pos]
        if old is None:
            buffer[pos] = value
            if self.device is CPU:
                backend = backend_of(value)
                if backend is not None:
                    self.device = backend.device(value)
            return
        backend = backend_of(old)
        owned = self._owned
        if owned is None:
            owned = self._owned = [None] * len(buffer)
        elif pos >= len(owned):
            owned.extend([None] * (pos + 1 - len(owned)))
        if owned[pos] is old and not create_graph:
            buffer[pos] = backend.add_(old, value)
        else:
            buffer[pos] = backend.add(old, value)
        owned[pos] = buffer[pos]
