"""The errors both cores raise, in the same words, and the limits they name.

Shared by the compiled core and the twin (See Note [Slow paths are
shared]): a test that matches an error's words passes on both. The limit
on an Edge's ``input_nr`` lives here with its message:
See Note [Edge input_nr].
"""

import operator

# Note [A name() that raises]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A node's name() is Python code of the framework's, and the engine calls it
# only to word something else: an error's message (a gradient of the wrong
# shape, anomaly mode's note on a node's error), a profiler event, a graph
# drawing. One that raises must not put its own error in the place of what
# it was asked to name: the wrong shape would be lost behind a bug in a
# name(). So where name() (or the ``str`` of what it returns) raises an
# Exception, the node goes by its type's name, and the words say that its
# name() raised and what. KeyboardInterrupt and SystemExit are not
# Exceptions: they go up. PyTorch's name() is C++ and cannot raise.


def node_name(node):
    """``str(node.name())`` (a :class:`pyengine.Node`'s), or the type's name
    for a node without one (a core node type used as it is), or for one whose
    name() raises an Exception: See Note [A name() that raises]."""
    node_type = type(node)
    try:
        name = getattr(node, "name", None)
        return str(name()) if callable(name) else node_type.__name__
    except Exception as error:
        return f"{node_type.__name__} (its name() raised {type(error).__name__})"


def not_initialized_message(node):
    return (f"{type(node).__name__} was not initialized: its __init__ must call "
            "super().__init__(next_edges, input_metadata)")


def gradients_changed_message(node):
    """The list of gradients ``node`` returned got shorter while the engine
    read it: the node kept it, and Python code the engine ran (a cast, a
    backend's add, a replaced gradient's ``__del__``) shortened it. ``node``
    None: the gradients given to ``execute`` or ``validate_outputs``."""
    if node is None:
        return "the list of gradients changed while the engine checked it"
    return (f"the gradients Function {node_name(node)} returned changed while the engine "
            "passed them on")


def raise_error(error):
    """``raise error``, in Python's words for an ``error`` that is not an
    exception: a graph task's exception that Python code set (set_exception)
    to anything. The twin raises it so; Cython's ``raise`` says "raise:
    exception class must be a subclass of BaseException" where Python says
    "exceptions must derive from BaseException", so the compiled core raises
    such an object here."""
    raise error


def lock_taken_again_message():
    """A thread asked for its graph task's lock while it held it: See Note
    [Accumulating under the graph task lock] in pyengine/_engine.pyx."""
    return ("a thread asked for the graph task's lock while it held it: Python code that ran "
            "while the engine passed gradients on (a backend's add, or the __del__ of a value "
            "it let go of) started work on the same backward (a running node's query, or a "
            "nested backward that ran one of its nodes)")


def no_value_backend_message(value):
    """InputMetadata's TypeError for a value no registered backend handles."""
    return (f"no value backend for {type(value).__name__}; register one with "
            "pyengine.register_backend")


# Note [InputMetadata sizes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A shape is a sequence of sizes, each an int: anything with ``__index__``
# (``operator.index``; a numpy integer will do), as PyTorch's sizes. A
# float (2.7 was kept as 2), a str ("3" was 3) or bytes is a TypeError
# naming the size and its position, and a str or bytes shape ("12" was
# (1, 2), b"12" was (49, 50)) is refused whole. A size below 0 is a
# ValueError naming the shape, the size and its position, where it was
# kept and blamed, at backward, on the node whose gradient could not match
# it. Every size must also fit a C long (the compiled core's fast path
# keeps them as C sizes): OverflowError. Both cores check the sizes in
# order and stop at the first wrong one, so that a shape wrong twice gives
# one error in both.


def metadata_size(size, position):
    """``size``, the one at ``position`` of an InputMetadata's shape, as a
    plain int: See Note [InputMetadata sizes]. ``operator.index``, and the
    int's own value where that gives an int subclass back (a bool, on
    Python 3.9, which later versions copy into an int)."""
    try:
        size = operator.index(size)
    except TypeError:
        raise TypeError(size_not_int_message(size, position)) from None
    return size if type(size) is int else int.__index__(size)


def size_not_int_message(size, position):
    """InputMetadata's TypeError for a size that is not an int: See Note
    [InputMetadata sizes]."""
    return (f"InputMetadata shape: the size at position {position} must be an int, got "
            f"{type(size).__name__} {size!r}")


def negative_size_message(shape, position):
    """InputMetadata's ValueError for a size below 0: See Note
    [InputMetadata sizes]."""
    return (f"InputMetadata shape {shape}: the size at position {position} is "
            f"{shape[position]}, expected a size of at least 0")


def shape_not_sizes_message(shape):
    """InputMetadata's TypeError for a str or bytes shape: See Note
    [InputMetadata sizes]."""
    return (f"InputMetadata shape must be a sequence of ints, got {type(shape).__name__} "
            f"{shape!r}")


def grad_lock_taken_again_message():
    """A thread asked for a leaf's ``.grad`` lock while it held it: See
    Note [The lock of a leaf's .grad] in pyengine/_pure/node.py."""
    return ("a thread asked for a leaf's .grad lock while it held it: Python code that ran "
            "while the leaf's gradient was accumulated (the tensor's .grad property, a "
            "backend's add or copy) started another accumulation into the same leaf, which "
            "would wait for itself")


def grad_lock_not_held_message():
    """GradLock.release by a thread that does not hold the lock."""
    return "release of a leaf's .grad lock that this thread does not hold"


def uninitialized_metadata_message(where):
    """An InputMetadata made with ``InputMetadata.__new__`` alone, or whose
    ``__init__`` raised: its fields were never set, so no slot can use it."""
    return f"{where} is an InputMetadata whose __init__ never completed"


def accumulate_grad_grads_message(grads):
    """What AccumulateGrad.apply refuses: anything but a list holding the
    leaf's gradient first (the engine gives it its InputBuffer's list)."""
    if type(grads) is not list:
        return f"Argument 'grads' has incorrect type (expected list, got {type(grads).__name__})"
    return "AccumulateGrad.apply expects a list with the leaf's gradient, got an empty list"


def init_to_execute_refused_message(reason):
    """Why init_to_execute refused a graph task: ``"planning"`` (another call
    is running on it), ``"planned"`` or ``"started"``."""
    if reason == "planning":
        return ("init_to_execute is already running on this graph task (another thread's "
                "call): a graph task is planned by one call")
    if reason == "planned":
        return ("init_to_execute was already called on this graph task: a graph task is "
                "planned once, before it starts")
    return ("init_to_execute on a graph task that has started: its dependencies and "
            "exec_info are fixed once its first task is queued")


def _leaf_state_error(leaf_state):
    return f"leaf_state must be a LeafState, got {type(leaf_state).__name__}"


def _cannot_delete(name):
    raise AttributeError(f"cannot delete {name}: set it to () instead")


# Note [Edge input_nr]
# ~~~~~~~~~~~~~~~~~~~~
# ``Edge(node, input_nr)``: ``input_nr`` is an int (anything with
# ``__index__``, as PyTorch's int arguments: a numpy integer will do, a
# float or a str will not: TypeError) and at least 0 (ValueError naming
# the node and the value; PyTorch's input_nr is unsigned, and a negative
# index would count from the end, or before the start, of the node's
# slots). It may name a slot beyond the ones the node declared with
# ``input_metadata``: the node's InputBuffer then grows to fit, one list
# entry per slot up to ``input_nr``, and that slot's gradients are not
# checked. That growth is bounded: an undeclared slot must be below
# MAX_INPUT_NR (65,536 slots, half a MiB of list), so a huge ``input_nr``
# is an error when the Edge is made (ValueError), never gigabytes of list
# or a MemoryError in the middle of a backward. A slot the node declared
# may be any of them. The check is made once, when the Edge is made
# (``_check_input_nr`` in both cores' node modules): an Edge is immutable,
# and a node's slots only grow (``add_input_metadata``).
MAX_INPUT_NR = 1 << 16


def _input_nr_error(node, input_nr):
    if not isinstance(input_nr, int):
        return f"Edge input_nr must be an int, got {type(input_nr).__name__} (for {node_name(node)})"
    if input_nr < 0:
        return f"Edge input_nr must be >= 0, got {input_nr} for {node_name(node)}"
    return (f"Edge input_nr {input_nr} is beyond {node_name(node)}'s {len(node._input_metadata)} "
            f"input slots and above {MAX_INPUT_NR}, the limit for undeclared slots; declare "
            f"the slot with input_metadata first")


def input_buffer_list_gone_message():
    """An InputBuffer the engine filled whose list Python code set to None
    meanwhile (the sum runs Python code, which reaches the buffer through
    gc): the engine reads that list as the task's inputs, in C."""
    return ("an InputBuffer's list was set to None while the engine summed gradients into it: "
            "no inputs to run its node on")


def task_field_message(field, expected, value):
    """A NodeTask with a node that a ReadyQueue refuses: See Note [A task
    pushed from Python is checked] in pyengine/_pure/ready_queue.py."""
    return (f"a NodeTask with a node is one the engine runs: its {field} must be {expected}, "
            f"got {type(value).__name__}")


def no_ready_queue_message():
    return ("this graph task has no CPU ready queue (an owner graph's, or one made with "
            "cpu_ready_queue=None): no thread can run its nodes")


def total_depth_message(depth, limit):
    return (f"reentrant backward nested {depth} levels deep, past the engine's "
            f"max_total_depth of {limit} (a hook or node that calls backward on its own graph "
            f"recurses without end?); to allow deeper nesting, set "
            f"pyengine.get_default_engine().max_total_depth or pass "
            f"Engine(max_total_depth=...)")


def initialized_once_message(instance, why):
    """A second ``__init__`` on a GraphTask, an InputBuffer, an Engine or an
    OwnerGraph: it would reset what a running backward, the engine's
    threads or a running walk use (``why``)."""
    name = type(instance).__name__
    return f"{name}.__init__ ran already: it runs once per instance ({why})"


GRAPH_TASK_INITIALIZED_WHY = ("a second __init__ would reset the counts, queue and error of a "
                              "backward that may be running")
OWNER_GRAPH_INITIALIZED_WHY = ("a second __init__ would change the mode, readers and hooks that a "
                               "walk of the graph, which may be running, reads as it goes")
INPUT_BUFFER_INITIALIZED_WHY = ("a second __init__ would empty the slots of the gradients that a "
                                "running backward may have summed into it")
ENGINE_INITIALIZED_WHY = ("a second __init__ would leave its device and pool threads to run on, "
                          "unknown to it and never stopped")


def pool_full_message(depth, limit):
    return (f"reentrant backward nested {depth} levels deep needs a pool thread, but all "
            f"{limit} threads of the engine's reentrant pool are busy; set "
            f"pyengine.get_default_engine().max_pool_threads or pass "
            f"Engine(max_pool_threads=...) to allow more")


def handoff_interrupted_message():
    """See Note [A backward that raises leaves its ready queue] in pyengine/_pure/engine.py."""
    return ("cannot start a backward here: this thread's backward was interrupted (Ctrl-C) "
            "while a reentrant pool thread ran a backward nested in it, which still serves "
            "this thread's ready queue; every backward this thread runs ends with that "
            "KeyboardInterrupt, even where a node caught it (a backward started after the "
            "outermost one has raised runs as usual)")


def pool_stopped_message(depth):
    """See Note [Stopping the pool] in pyengine/_pure/thread_pool.py."""
    return (f"cannot run a reentrant backward nested {depth} levels deep on a pool thread: "
            "the engine's reentrant pool threads have stopped (Engine.stop(), which runs at "
            "interpreter exit)")


# What a ready queue's push raises where its heap cannot grow: See Note [C++
# allocations that fail] in pyengine/_engine.pyx.
QUEUE_FULL_MESSAGE = "a ready queue could not grow to hold one more task"


# A pool thread's engine, collected while a graph task was handed off to
# it: none is, since the hand-off's caller runs in its engine and holds it.
POOL_ENGINE_GONE_MESSAGE = ("the engine of a backward handed off to its reentrant pool was "
                            "collected")


def wait_timeout_message(timeout):
    return (f"a wait's timeout must be a number of seconds from 0 to threading.TIMEOUT_MAX, "
            f"got {timeout!r}")


def waits_for_itself_message(nested=False):
    """See Note [A graph task waits for itself] in pyengine/_pure/graph_task.py.
    ``nested``: the thread runs a backward that one of the task's nodes (or
    final callbacks) started, not the task itself."""
    if nested:
        return ("a graph task cannot wait for itself: this thread runs a backward nested in one "
                "of its nodes or final callbacks, which waits for that backward, so the wait "
                "would never end (a node, hook or final callback of the nested backward called "
                "wait() or mark_as_completed_and_run_post_processing() on an enclosing one)")
    return ("a graph task cannot wait for itself: this thread runs one of its nodes, hooks or "
            "final callbacks, which the task waits for, so the wait would never end (a node or "
            "final callback called wait() or mark_as_completed_and_run_post_processing() on "
            "the running graph task)")


def not_ready_message(count):
    """See Note [Gradients left in not ready] in pyengine/_pure/graph_task.py."""
    return (f"could not compute gradients for some functions: {count} "
            f"{'node' if count == 1 else 'nodes'} got some of their gradients but not all, "
            "so never ran (did a hook or node change next_edges during backward?)")


def cannot_pickle_message(value):
    """What copying or pickling a node, a graph task, a queue, a task, a
    buffer or an engine raises, in both cores: See Note [Copying and
    pickling the engine's objects] in pyengine/_pure/node.py."""
    return f"cannot pickle {type(value).__name__!r} object"
