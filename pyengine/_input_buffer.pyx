"""InputBuffer: the gradients flowing into one node, summed per input slot.

See Note [InputBuffer ownership] in the twin, ``pyengine/_pure/input_buffer.py``.
An InputBuffer is owned by one NodeTask or by its GraphTask's ``not_ready``
map, whose mutex guards it.
"""

cimport cython
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF

from pyengine._shared.messages import (INPUT_BUFFER_INITIALIZED_WHY, cannot_pickle_message,
                                       initialized_once_message)
from pyengine.backends import backend_of, bad_backend_result, check_same_device, no_backend_to_add

cimport numpy as cnp

from pyengine._node cimport is_numpy_array, numpy_scalars

cnp.import_array()


cdef list _none_list(Py_ssize_t size):
    cdef list result = PyList_New(size)
    for i in range(size):
        Py_INCREF(None)
        PyList_SET_ITEM(result, i, None)
    return result


cdef InputBuffer new_input_buffer(Py_ssize_t size):
    """An InputBuffer of ``size`` empty slots, without calling ``__init__``."""
    cdef InputBuffer input_buffer = InputBuffer.__new__(InputBuffer)
    input_buffer.buffer = _none_list(size)
    input_buffer.initialized_ = True
    return input_buffer


cdef inline bint sums_in_place(cnp.ndarray total, cnp.ndarray value) noexcept:
    """The twin's sums_in_place (pyengine/backends.py), in C: ``value`` has
    ``total``'s dtype and shape. See Note [InputBuffer ownership] in the
    twin."""
    if cnp.PyArray_NDIM(total) != cnp.PyArray_NDIM(value):
        return False
    cdef int axis
    for axis in range(cnp.PyArray_NDIM(total)):
        if cnp.PyArray_DIMS(total)[axis] != cnp.PyArray_DIMS(value)[axis]:
            return False
    # numpy's dtype ==, which the twin calls, after the identity that
    # answers for every built-in dtype without a call into numpy.
    return (<void*>cnp.PyArray_DESCR(total) == <void*>cnp.PyArray_DESCR(value)
            or cnp.PyArray_EquivTypes(total.descr, value.descr))


@cython.final
@cython.freelist(64)
cdef class InputBuffer:
    """Per-slot gradient sums for one node.

    ``buffer`` holds one value (or None) per input slot (See Note
    [InputBuffer has no device] in the twin).
    """

    def __init__(self, Py_ssize_t size):
        # Python code can reach a buffer the engine fills (through gc): a
        # second __init__ would drop the gradients summed so far.
        if self.initialized_:
            raise TypeError(initialized_once_message(self, INPUT_BUFFER_INITIALIZED_WHY))
        if size < 0:
            raise ValueError(f"InputBuffer size {size} is negative")
        self.buffer = _none_list(size)
        self.initialized_ = True

    def __reduce__(self):
        # See Note [Copying and pickling the engine's objects] in pyengine/_pure/node.py.
        raise TypeError(cannot_pickle_message(self))

    # Bounds checked: the writes at the end follow the sum and the first
    # write, either of which may run Python code (a backend, a replaced
    # value's __del__) that reaches these lists; an IndexError, as the
    # twin's, where the build's default would write past their end.
    @cython.boundscheck(True)
    cpdef int add(self, Py_ssize_t pos, object value, bint create_graph) except -1:
        """Add ``value`` into slot ``pos`` (See Note [InputBuffer ownership])."""
        if value is None:
            return 0
        cdef list buffer = self.buffer
        # Python code can reach an InputBuffer (pyengine._core.InputBuffer)
        # and write its buffer; the engine's own are never None and take
        # slots from Edges, which are never negative (See Note [Edge
        # input_nr] in pyengine/_shared/messages.py).
        if buffer is None:
            raise TypeError("InputBuffer.buffer is None; expected a list")
        if pos < 0:
            raise IndexError(f"InputBuffer slot {pos} is negative")
        if pos >= PyList_GET_SIZE(buffer):
            # A node that declared no metadata for this slot: grow to fit.
            buffer.extend([None] * (pos + 1 - PyList_GET_SIZE(buffer)))
        # Indexed with its bound checked: the grow allocates, and a collection
        # then may run Python code that empties the list.
        old = buffer[pos]
        if old is None:
            buffer[pos] = value
            return 0
        if self._owned is None:
            self._owned = _none_list(PyList_GET_SIZE(buffer))
        elif pos >= PyList_GET_SIZE(self._owned):
            self._owned.extend([None] * (pos + 1 - PyList_GET_SIZE(self._owned)))
        cdef bint in_place = self._owned[pos] is old and not create_graph
        if is_numpy_array(old) and type(value) is cnp.ndarray:
            # numpy's own operators, as the built-in numpy backend would call
            # them; an array this buffer allocated is always writeable.
            if in_place and sums_in_place(<cnp.ndarray>old, <cnp.ndarray>value):
                total = old
                total += value
            else:
                total = old + value
                if type(total) is not cnp.ndarray:
                    # A 0-d sum is a numpy scalar: keep the operands' type,
                    # as the numpy backend's add does.
                    total = cnp.PyArray_FROM_O(total)
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
        if pos >= PyList_GET_SIZE(buffer) or pos >= PyList_GET_SIZE(self._owned):
            raise RuntimeError(f"InputBuffer slot {pos} went away while a gradient was added "
                               "into it")
        buffer[pos] = total
        self._owned[pos] = total
        return 0
