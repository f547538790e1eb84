"""The compiled core's static types, in the twin: what Cython refuses
before a compiled function's body runs, the twin refuses in the same words.

- ``@cython.final`` classes (Edge, InputMetadata, LeafState, InputBuffer,
  GraphTask, ExecInfo, NodeTask, ReadyQueue): their C code reads the fields
  it was compiled for, so no other class may extend them. ``final`` gives a
  twin class the same refusal.
- Arguments typed with an extension type and ``not None``: the compiled
  body reads the object's C fields at once (None would be read as one).
  ``check_argument`` is the same check for the twin's function.
- ``X.__new__(cls)``: CPython checks ``cls`` before a compiled class's
  ``tp_new`` runs. ``check_new`` is the same check for the twin's
  ``__new__``.
- Arguments and fields typed with a C integer: ``as_c_int`` (an ``int``)
  and ``as_ssize_t`` (a ``Py_ssize_t``) convert as Cython does, with its
  errors.
"""

import operator
import struct
import sys

__all__ = ["C_LONG_MAX", "C_LONG_MIN", "as_c_int", "as_ssize_t", "c_bint_attribute",
           "c_int_attribute", "c_type_name", "check_argument", "check_c_long", "check_new",
           "compiled_name", "final", "refuse_write"]


def final(cls):
    """``cls``, refusing subclasses (TypeError) as a final extension type
    does."""
    def __init_subclass__(subclass, **kwargs):
        raise TypeError(f"type '{cls.__module__}.{cls.__qualname__}' is not an acceptable "
                        "base type")
    cls.__init_subclass__ = classmethod(__init_subclass__)
    return cls


# Note [Type names in Cython's words]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Cython's errors (an argument's or a field's type check, a <T?> cast) name
# a type by its C name, tp_name: a class defined in Python by its name
# (Leaf), a built-in type by its name (int), any other type defined in C with
# its module (numpy.int64, numpy.ndarray, pyengine._node.Edge). The twin's
# words for the same checks name types as Cython would (c_type_name), and
# its own classes by the compiled core's names (compiled_name: the twin's
# pyengine._pure.node.NodeBase is pyengine._node.NodeBase there), so that
# both cores' errors read alike.
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made at run time


def c_type_name(cls):
    """``cls``'s tp_name, as Cython's errors print a type (the twin's own
    classes by the compiled core's names): See Note [Type names in Cython's
    words]."""
    if cls.__module__.startswith("pyengine._pure."):
        return compiled_name(cls)
    if cls.__flags__ & _HEAP_TYPE or cls.__module__ == "builtins":
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


# CPython 3.13 words a name that an object without a __dict__ lacks, set or
# deleted, with this ending.
_NO_DICT = " and no __dict__ for setting new attributes" if sys.version_info >= (3, 13) else ""


def refuse_write(value, name):
    """What writing or deleting attribute ``name`` of ``value`` raises where
    ``value``'s compiled class takes no such write (it has no ``__dict__``),
    in CPython's words: a field (a slot or property of the twin) is "not
    writable", named with the class that declares it; another class
    attribute (a method) is "read-only"; any other name does not exist."""
    cls = type(value)
    for owner in cls.__mro__:
        declared = vars(owner).get(name)
        if declared is not None:
            if hasattr(declared, "__set__"):
                raise AttributeError(f"attribute '{name}' of '{c_type_name(owner)}' objects is "
                                     "not writable")
            raise AttributeError(f"'{c_type_name(cls)}' object attribute '{name}' is read-only")
    raise AttributeError(f"'{c_type_name(cls)}' object has no attribute '{name}'{_NO_DICT}")


# Note [A class's __new__ called with another class]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``X.__new__(cls)`` on a compiled class goes through CPython's wrapper of
# its tp_new, which refuses, before any field is made: a ``cls`` that is
# not a type, one that is not X or a subclass of it, and one whose
# allocation is another compiled class's (``NodeBase.__new__(GraphRoot)``,
# "not safe"; that last class is the first in ``cls``'s MRO whose
# ``__new__`` is not Python code: CPython's ``staticbase``). The twin's
# classes are Python, whose ``object.__new__`` makes an instance of any
# plain class: its ``__new__``s call ``check_new`` wherever
# ``cls.__new__`` is not their own (so the usual construction pays one
# identity test), and its classes that extend another of its classes make
# their base's fields through a function, not through the base's
# ``__new__``, which would take them for a foreign class.

def _is_core_class(cls):
    # A class the compiled core defines (its twin here), or object: where
    # a tp_new of C comes from.
    return cls.__module__.startswith("pyengine._pure.") or cls is object


def _new_defined_by(cls):
    return next(owner for owner in cls.__mro__ if "__new__" in vars(owner))


def check_new(base, cls):
    """TypeError, in CPython's words, where ``base.__new__(cls)`` on the
    compiled class would refuse ``cls``: See Note [A class's __new__ called
    with another class]."""
    name = compiled_name(base)
    if not isinstance(cls, type):
        raise TypeError(f"{name}.__new__(X): X is not a type object ({c_type_name(type(cls))})")
    if not issubclass(cls, base):
        raise TypeError(f"{name}.__new__({c_type_name(cls)}): {c_type_name(cls)} is not a "
                        f"subtype of {name}")
    for static_base in cls.__mro__:
        allocator = _new_defined_by(static_base)
        if _is_core_class(allocator):
            break
    if allocator is not base:
        raise TypeError(f"{name}.__new__({c_type_name(cls)}) is not safe, use "
                        f"{c_type_name(static_base)}.__new__()")


def compiled_name(cls):
    """The compiled core's tp_name of the twin's class ``cls``: See Note [Type
    names in Cython's words]."""
    module = cls.__module__
    if module.startswith("pyengine._pure."):
        module = "pyengine._" + module[len("pyengine._pure."):]
    return f"{module}.{cls.__qualname__}"


def check_argument(name, value, expected):
    """TypeError, in Cython's words, unless ``value`` is an ``expected``."""
    if not isinstance(value, expected):
        raise TypeError(f"Argument '{name}' has incorrect type (expected "
                        f"{compiled_name(expected)}, got {c_type_name(type(value))})")


# Note [The engine's bounds are C ints]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The compiled Engine keeps max_recursion_depth, max_total_depth and
# max_pool_threads in C ints, converted as Cython converts any argument
# typed int: an int (bool included) as it is; anything else through its
# __int__ (a float is truncated, as int() does; an object with only
# __index__, or a str, is refused: TypeError "an integer is required");
# beyond a C long, OverflowError "Python int too large to convert to C
# long"; beyond a C int, OverflowError "value too large to convert to int".
# The twin converts the same way (as_c_int), in __init__ and when one is
# set, so that both cores accept and refuse the same values with the same
# errors (int() took "3" and 2**40, which the compiled core refuses).
_C_INT_BITS = struct.calcsize("i") * 8
_C_LONG_BITS = struct.calcsize("l") * 8


C_LONG_MIN = -(1 << (_C_LONG_BITS - 1))
C_LONG_MAX = (1 << (_C_LONG_BITS - 1)) - 1


def check_c_long(value):
    """OverflowError, in CPython's words, unless the int ``value`` fits the C
    long that Cython converts it to."""
    if not C_LONG_MIN <= value <= C_LONG_MAX:
        raise OverflowError("Python int too large to convert to C long")


# Cython converts an int of one or two 30-bit digits to a C int itself
# ("value too large to convert to int" where it does not fit); a wider one it
# hands to CPython, whose words changed in 3.13: before, PyLong_AsLong's (a
# C long's, beyond one), since, the C int's.
_WIDE_FOR_C_INT = 1 << 60 if sys.version_info >= (3, 13) else None


def as_c_int(value):
    """``value`` as the compiled core's C int fields take it: See Note [The
    engine's bounds are C ints]."""
    if not isinstance(value, int):
        to_int = getattr(type(value), "__int__", None)
        if to_int is None:
            raise TypeError("an integer is required")
        value = to_int(value)
        if not isinstance(value, int):
            raise TypeError(f"__int__ returned non-int (type {type(value).__name__})")
    if _WIDE_FOR_C_INT is not None and abs(value) >= _WIDE_FOR_C_INT:
        raise OverflowError("Python int too large to convert to C int")
    check_c_long(value)
    if not -(1 << (_C_INT_BITS - 1)) <= value < 1 << (_C_INT_BITS - 1):
        raise OverflowError("value too large to convert to int")
    return int(value)


def as_c_double(value):
    """``value`` as Cython converts it to a C double argument (CPython's
    ``PyFloat_AsDouble``): a float, or an object with ``__float__`` or
    ``__index__``; else TypeError in CPython's words."""
    if type(value) is float:
        return value
    if not hasattr(type(value), "__float__") and not hasattr(type(value), "__index__"):
        raise TypeError(f"must be real number, not {type(value).__name__}")
    return float(value)


def c_int_attribute(field):
    """A property over the slot ``field`` that behaves as a Cython ``cdef
    public int`` attribute: a value set is converted by as_c_int (See Note
    [The engine's bounds are C ints]), and ``del`` is NotImplementedError
    "__del__", Cython's answer for a C field that cannot be absent."""

    def set(self, value):
        setattr(self, field, as_c_int(value))

    def delete(self):
        raise NotImplementedError("__del__")

    return property(operator.attrgetter(field), set, delete)


def c_bint_attribute(field):
    """A property over the slot ``field`` that behaves as a Cython ``cdef
    public bint`` attribute: a value set is stored as its truth value (an
    array of several elements is Python's ValueError), and ``del`` is
    NotImplementedError "__del__", as for a C int."""

    def set(self, value):
        setattr(self, field, bool(value))

    def delete(self):
        raise NotImplementedError("__del__")

    return property(operator.attrgetter(field), set, delete)


_SSIZE_T_BITS = struct.calcsize("n") * 8


def as_ssize_t(value):
    """``value`` as Cython converts an argument typed ``Py_ssize_t``: through
    ``__index__`` (a float or a str is a TypeError), OverflowError beyond
    the C type."""
    value = operator.index(value)
    if not -(1 << (_SSIZE_T_BITS - 1)) <= value < 1 << (_SSIZE_T_BITS - 1):
        raise OverflowError("Python int too large to convert to C ssize_t")
    return value
