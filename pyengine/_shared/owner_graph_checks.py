"""Owner graphs' checks, messages and slow paths, shared by both cores: the
compiled walk (``pyengine/_owner_graph.pyx``) calls these where its own C
checks do not pass, and the twin (``pyengine/_pure/owner_graph.py``) calls
them always, so that both raise the same errors in the same words. The
protocol and the walk are in those two modules: See Note [Owner graphs] in
``pyengine/_pure/owner_graph.py``."""

from types import GeneratorType

from ..backends import backend_of, check_backend_result
from .hooks import add_note
from .messages import MAX_INPUT_NR

__all__ = ["WRITES", "RETURNS", "REDUCE", "EXACT", "OwnerRun", "accumulate_grad", "add_owner_note",
           "check_hook_result", "check_input_nr", "check_nan", "check_options", "check_reader",
           "count_slots", "cycle_error", "format_owner_error", "format_root_error",
           "inputs_what", "iterate", "make_owner_graph", "mark_needed", "metadata_of_what",
           "owner_name", "parents_of_what", "qualified_type_name", "read_returned",
           "reduce_owner_graph", "split_item", "split_root"]


WRITES = "writes"
RETURNS = "returns"
# gradient_policy: PyTorch's validate_outputs, or Chainer's exact check.
REDUCE = "reduce"
EXACT = "exact"


def owner_name(owner):
    return type(owner).__name__


def leaf_lock_taken_again_message(leaf):
    """A thread asked for an owner leaf's accumulation lock while it held
    it: See Note [An owner leaf accumulates under a lock] in
    pyengine/_pure/owner_graph.py."""
    return (f"a thread asked for the accumulation lock of a {owner_name(leaf)} while it held "
            "it: Python code that ran while a gradient was accumulated into that leaf (the "
            "owner graph's accumulate, a backend's add) started another accumulation into the "
            "same leaf, which would wait for itself")


def check_reader(what, reader):
    """``reader`` if it is a callable, or the attribute name it is as a
    plain str: a str subclass (an ``enum.StrEnum`` member) reads as the
    string it holds, since the walks tell a name from a callable by
    ``type(reader) is str``; else TypeError."""
    if isinstance(reader, str):
        return str.__str__(reader)
    if callable(reader):
        return reader
    raise TypeError(f"{what} must be a str (an attribute or method name) or a callable, "
                    f"got {type(reader).__name__}")


def check_options(returns, should_compute_output, gradient_policy, accumulates, unpack_grads):
    """The returns-mode options of an OwnerGraph, checked: See Note [Owner
    graphs]. The flags must be bools, so that the compiled core reads
    exactly what the twin reads."""
    for what, flag in (("should_compute_output", should_compute_output),
                       ("accumulates", accumulates), ("unpack_grads", unpack_grads)):
        if type(flag) is not bool:
            raise TypeError(f"{what} must be a bool, got {qualified_type_name(flag)}")
    # Compared as the str it holds, and kept as the constant: a str
    # subclass's own __eq__ or __str__ could say one thing to the check and
    # another to the walk.
    if isinstance(gradient_policy, str) and str.__eq__(gradient_policy, REDUCE):
        gradient_policy = REDUCE
    elif isinstance(gradient_policy, str) and str.__eq__(gradient_policy, EXACT):
        gradient_policy = EXACT
    else:
        raise ValueError(f"gradient_policy must be {REDUCE!r} or {EXACT!r}, "
                         f"got {gradient_policy!r}")
    if not returns:
        for what, value in (("should_compute_output", should_compute_output),
                            ("gradient_policy", gradient_policy == EXACT),
                            ("accumulates", accumulates), ("unpack_grads", unpack_grads)):
            if value:
                raise TypeError(f"{what} is for mode={RETURNS!r}: in mode={WRITES!r} the "
                                "owners write their parents' gradients themselves")
    return gradient_policy


def qualified_type_name(value):
    """``value``'s type as an error names it: ``int``, or ``numpy.bool``
    where another module's type has a builtin's name."""
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


# OwnerGraph.__init__'s keyword-only arguments: each is kept as the field of
# its name, and given again to make a copy.
OWNER_GRAPH_KEYWORDS = ("mode", "num_inputs", "metadata", "accumulate", "visit",
                        "needs_no_gradient", "pre_hook", "post_hook", "should_compute_output",
                        "gradient_policy", "accumulates", "unpack_grads", "dense_gradient")


def reduce_owner_graph(graph, owner_graph_type):
    """``OwnerGraph.__reduce__`` of both cores (``owner_graph_type``: the
    core's OwnerGraph): a copy or an unpickled graph is made by the base's
    ``__init__`` from the fields, with its checks, and gets the instance's
    ``__dict__`` (a subclass's attributes). See Note [Copying and pickling
    the engine's objects] in pyengine/_pure/node.py."""
    keywords = {name: getattr(graph, name) for name in OWNER_GRAPH_KEYWORDS}
    return (make_owner_graph, (owner_graph_type, type(graph), graph.parents, graph.backward_,
                               keywords), getattr(graph, "__dict__", None))


def make_owner_graph(owner_graph_type, cls, parents, backward, keywords):
    """A ``cls`` (an ``owner_graph_type`` or a subclass) initialized by
    ``owner_graph_type.__init__``: what ``reduce_owner_graph`` gives pickle."""
    graph = owner_graph_type.__new__(cls)
    owner_graph_type.__init__(graph, parents, backward, **keywords)
    return graph


def read_returned(owner, outputs, count):
    """The gradients a returns-mode backward returned, as a list of
    ``count``: a list or a tuple, or a generator (autograd's vjps of more
    than two arguments return one), read once."""
    if type(outputs) is GeneratorType:
        outputs = list(outputs)
    elif not isinstance(outputs, (list, tuple)):
        raise TypeError(f"the backward of a {owner_name(owner)} returned "
                        f"{type(outputs).__name__}; expected a list or tuple of {count} "
                        "gradients, one per parent item")
    if len(outputs) != count:
        raise RuntimeError(f"the backward of a {owner_name(owner)} returned {len(outputs)} "
                           f"gradients; expected {count}, one per parent item")
    return outputs


def cycle_error(owner, parents):
    through = repr(parents) if isinstance(parents, str) else "its parents"
    return RuntimeError(
        f"the owner graph has a cycle: a {owner_name(owner)} is among its own "
        f"descendants through {through}")


class OwnerRun:
    """What the profiler sees of one owner run: See Note [Owner graphs]."""

    __slots__ = ("owner", "_sequence_nr")
    _input_metadata = ()

    def __init__(self, owner, sequence_nr):
        self.owner = owner
        self._sequence_nr = sequence_nr

    def name(self):
        return owner_name(self.owner)


# Note [An owner graph reads an int's value]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A slot number (a parent item's ``input_nr``, a root's) and a slot count
# (``num_inputs``) may be any int, subclasses included, and an int
# subclass may override its comparisons. The compiled walk reads the
# number's value in C, which no override changes; so both cores check and
# use that value (``int.__index__``, the int type's own method, as a plain
# int), never the object's comparisons: a count of -3 that says it is not
# below 1 is refused as -3 in both, and a slot of 2**70 that says it is in
# range is named as 2**70 in both.


def item_name(holder):
    """How an error names an item: ``holder`` is a str that names it (the
    root, ``inputs[k]``), or the owner it is a parent item of."""
    return holder if isinstance(holder, str) else f"a parent item of a {owner_name(holder)}"


def iterate(collection, describe, *args):
    """``iter(collection)``; where it is not iterable, TypeError naming what
    it is (``describe(*args)``, called only then) rather than Python's bare
    "'int' object is not iterable"."""
    try:
        return iter(collection)
    except TypeError:
        if hasattr(type(collection), "__iter__") or hasattr(type(collection), "__getitem__"):
            raise  # its own __iter__ raised: in its own words
        raise TypeError(f"{describe(*args)} must be iterable, got "
                        f"{type(collection).__name__}") from None


def metadata_of_what(owner):
    """How an error names what ``metadata`` returned for ``owner``."""
    return f"metadata({owner_name(owner)})"


def inputs_what():
    """How an error names ``grad()``'s inputs."""
    return "inputs"


def parents_of_what(parents, owner):
    """How an error names an owner's parents: its attribute, or what the
    ``parents`` callable returned for it."""
    if type(parents) is str:
        return f"the {parents!r} of a {owner_name(owner)}"
    return f"parents({owner_name(owner)})"


def split_item(item, holder):
    """``(parent, input_nr)`` of a parent item of ``holder`` (or of the item
    ``holder`` names: See ``item_name``), or None where no gradient flows
    (None, or a pair whose owner is None). ``input_nr`` is a plain int:
    See Note [An owner graph reads an int's value]."""
    if item is None:
        return None
    if type(item) is tuple:
        if len(item) != 2 or not isinstance(item[1], int) or isinstance(item[1], bool):
            expected = ("an owner or a pair" if isinstance(holder, str)
                        else "an owner, None, or a pair")
            raise TypeError(f"{item_name(holder)} is a tuple of {len(item)}: expected "
                            f"{expected} (owner, input_nr) with an int input_nr")
        input_nr = int.__index__(item[1])
        if not 0 <= input_nr < MAX_INPUT_NR:
            # No owner has a slot there (count_slots' limit); and the
            # compiled walk keeps input_nr in a C integer.
            raise IndexError(f"{item_name(holder)} names slot {input_nr}: a slot is at least 0 "
                             f"and below {MAX_INPUT_NR}")
        if item[0] is None:
            return None
        return item if type(item[1]) is int else (item[0], input_nr)
    return (item, 0)


def split_root(root, what):
    """``(owner, input_nr)`` of a root of a walk, or of one of ``grad()``'s
    inputs (``what``: "the root", "inputs[k]"), checked as a parent item is."""
    pair = None if root is None else split_item(root, what) if type(root) is tuple else (root, 0)
    if pair is None:
        got = "None" if root is None else "a pair whose owner is None"
        raise TypeError(f"{what} must be an owner or a pair (owner, input_nr), got {got}")
    return pair


def count_slots(graph, owner):
    """``num_inputs(owner)``, checked; 1 without ``num_inputs``."""
    if graph.num_inputs is None:
        return 1
    count = graph.num_inputs(owner)
    if isinstance(count, int) and not isinstance(count, bool):
        count = int.__index__(count)  # See Note [An owner graph reads an int's value]
    if type(count) is not int or count < 1:
        raise TypeError(f"num_inputs({owner_name(owner)}) must be an int of at least 1, "
                        f"got {count!r}")
    if count > MAX_INPUT_NR:
        # See Note [Edge input_nr]: no list of a billion slots mid-backward.
        raise ValueError(f"num_inputs({owner_name(owner)}) is {count}; at most {MAX_INPUT_NR} "
                         "slots are allowed")
    return count


def check_input_nr(owner, input_nr, slots, where):
    """That ``input_nr`` (a plain int, from ``split_item``) is a slot of
    ``owner``; ``where`` names the item in the error (See ``item_name``)."""
    count = slots[id(owner)]
    if not 0 <= input_nr < count:
        raise IndexError(f"{item_name(where)} names slot {input_nr} of a {owner_name(owner)}, "
                         f"which has {count} slot{'s' if count != 1 else ''}")


def mark_needed(order, is_leaf, items_of, wanted):
    """The owners (by id) with a path to an owner in ``wanted`` (by id): in
    the post-order every parent comes before its owner."""
    needed = set()
    for i in range(len(order)):
        if is_leaf[i]:
            continue
        for item in items_of[i]:
            pair = split_item(item, order[i])
            if pair is not None and (id(pair[0]) in wanted or id(pair[0]) in needed):
                needed.add(id(order[i]))
                break
    return needed


def accumulate_grad(leaf, gradient):
    """The default ``accumulate``: See Note [Owner graphs]."""
    old = getattr(leaf, "grad", None)
    if old is None:
        leaf.grad = gradient
    else:
        backend = backend_of(old)
        if backend is None:
            leaf.grad = old + gradient
        else:
            # Kept only once it is a value: See Note [What a backend returns]
            # in pyengine/backends.py.
            leaf.grad = check_backend_result(backend.add(old, gradient), backend, "add",
                                             f"the .grad of a {owner_name(leaf)}")


def format_root_error(message):
    return f"the root's gradient: {message}"


def format_owner_error(owner):
    name = owner_name(owner)
    return lambda message: f"the backward of a {name}: {message}"


# A list of an owner's gradients got shorter while the engine read it:
# Python code it ran (dense_gradient, a backend's add) reached the list.
GRADIENTS_CHANGED = "an owner's gradients changed while the engine read them"


def check_hook_result(owner, what, result, count):
    """A hook's replacement gradients as a list of ``count``."""
    if not isinstance(result, (list, tuple)) or len(result) != count:
        got = f"{len(result)} values" if isinstance(result, (list, tuple)) else type(result).__name__
        raise RuntimeError(f"{what} of a {owner_name(owner)} returned {got}; expected None or "
                           f"a list of {count} gradients")
    return list(result)


def check_nan(owner, outputs):
    """Anomaly mode's NaN check on the gradients an owner returned."""
    for i in range(len(outputs)):
        output = outputs[i]
        if output is not None and backend_of(output).has_nan(output):
            raise RuntimeError(f"the backward of a {owner_name(owner)} returned nan values in "
                               f"its {i}th output.")


def add_owner_note(error, owner):
    add_note(error, f"Error detected in the backward of a {owner_name(owner)} (an owner graph).")
