# InputBuffer; see _input_buffer.pyx.

cdef class InputBuffer:
    cdef public list buffer
    # _owned[i]: the value the buffer allocated for slot i, or None.
    cdef list _owned
    # Set by __init__ and new_input_buffer: a second __init__ is refused.
    cdef bint initialized_

    cpdef int add(self, Py_ssize_t pos, object value, bint create_graph) except -1


cdef InputBuffer new_input_buffer(Py_ssize_t size)
