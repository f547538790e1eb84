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

An in-place sum must give what the out-of-place one would, or the slot's
sum would depend on the order its gradients arrive in. A slot with
metadata gets gradients validate_outputs cast and reduced to its dtype and
shape, as PyTorch's InputBuffer always does. A slot without metadata (an
undeclared slot) may get an int array, then a float one, or a row, then a
matrix: added into the owned value in place, numpy would refuse to cast
the float into the int array, refuse to grow the row, or cast a float64
into a float32 array, where the same gradients in another order sum. So
a numpy array is added in place only where it has the owned value's dtype
and shape (``sums_in_place``; ``NumpyBackend.add_`` follows the same
rule), and out of place otherwise, into a new owned value.

Note [InputBuffer has no device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
PyTorch 1.x's InputBuffer remembered the device of the first non-CPU
gradient added, and the engine sent the node's task to that device's queue.
PyTorch 2.x dropped it: ``evaluate_function`` and ``execute_with_graph_task``
route by ``Node::device()``, the node's first non-CPU input metadata. So
does pyengine (``node_device`` in pyengine/_pure/node.py, which falls back to
the gradients' devices only for a node that declared no non-CPU metadata),
and an InputBuffer keeps no device.
"""

import numpy as np

from .._shared.messages import (
    INPUT_BUFFER_INITIALIZED_WHY,
    cannot_pickle_message,
    initialized_once_message,
)
from ..backends import backend_of, bad_backend_result, check_same_device, no_backend_to_add, sums_in_place
from .node import is_numpy_array, numpy_scalars
from .static_types import as_ssize_t, c_type_name, check_new, final


@final
class InputBuffer:
    """Per-slot gradient sums for one node.

    ``buffer`` holds one value (or None) per input slot (See Note
    [InputBuffer has no device]). Owned by one NodeTask or by its
    GraphTask's ``not_ready`` map, whose lock guards it.
    """

    __slots__ = ("_buffer", "_owned", "initialized_")

    def __new__(cls, *args, **kwargs):
        # As the compiled type's fields: None until set, even where
        # ``__init__`` never runs (``InputBuffer.__new__(InputBuffer)``).
        if cls.__new__ is not InputBuffer.__new__:
            check_new(InputBuffer, cls)
        self = object.__new__(cls)
        self._buffer = None
        self._owned = None
        self.initialized_ = False
        return self

    def __init__(self, size):
        size = as_ssize_t(size)
        # Python code can reach a buffer the engine fills (through gc): a
        # second __init__ would drop the gradients summed so far.
        if self.initialized_:
            raise TypeError(initialized_once_message(self, INPUT_BUFFER_INITIALIZED_WHY))
        if size < 0:
            raise ValueError(f"InputBuffer size {size} is negative")
        self.buffer = [None] * size
        # _owned[i] is the value the buffer allocated for slot i, or None.
        self._owned = None
        self.initialized_ = True

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))

    @property
    def buffer(self):
        return self._buffer

    # The compiled core's ``cdef public list buffer``: Python code may set
    # an exact list or None, and ``del`` sets None.
    @buffer.setter
    def buffer(self, value):
        if value is not None and type(value) is not list:
            raise TypeError(f"Expected list, got {c_type_name(type(value))}")
        self._buffer = value

    @buffer.deleter
    def buffer(self):
        self._buffer = None

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
            return
        owned = self._owned
        if owned is None:
            owned = self._owned = [None] * len(buffer)
        elif pos >= len(owned):
            owned.extend([None] * (pos + 1 - len(owned)))
        in_place = owned[pos] is old and not create_graph
        if is_numpy_array(old) and type(value) is np.ndarray:
            # numpy's own operators, as the built-in numpy backend would call
            # them; an array this buffer allocated is always writeable.
            if in_place and sums_in_place(old, value):
                total = old
                total += value
            else:
                total = old + value
                if type(total) is not np.ndarray:
                    # A 0-d sum is a numpy scalar: keep the operands' type,
                    # as the numpy backend's add does.
                    total = np.asarray(total)
        elif numpy_scalars(old, value):
            # numpy's scalar arithmetic, as the built-in numpy backend's add
            # calls it for two numpy scalars.
            total = old + value
        else:
            backend = backend_of(old)
            if backend is None:  # the slot's name is made only for an error
                raise no_backend_to_add(old, f"InputBuffer slot {pos}")
            if backend_of(value) is not backend:
                # Two array types: the sum may convert one to the other's
                # device without a word, so the devices are compared first.
                check_same_device(f"InputBuffer slot {pos}", old, value)
            try:
                total = backend.add_(old, value) if in_place else backend.add(old, value)
            except Exception:
                check_same_device(f"InputBuffer slot {pos}", old, value)
                raise
            # Stored only once it is a value: See Note [What a backend
            # returns] in pyengine/backends.py.
            if backend_of(total) is None:
                raise bad_backend_result(total, backend, "add_" if in_place else "add",
                                         f"InputBuffer slot {pos}")
        # The sum ran Python code (a backend, an object array's elements'
        # __add__), which may have reached these lists and shortened them.
        if pos >= len(buffer) or pos >= len(owned):
            raise RuntimeError(f"InputBuffer slot {pos} went away while a gradient was added "
                               "into it")
        buffer[pos] = total
        owned[pos] = total
