"""Input through the public API that the compiled core used to trust: Edge
input numbers, next edges changed while a node runs, ``execute``'s
arguments, and node fields written from Python. Each gets one clear error,
the same in both cores (this file runs on both), never a crash. Anything
that crashed the interpreter before runs in a subprocess (the same core as
the test: ``PYENGINE_PURE`` and ``PYTHONPATH`` pass through), which must
exit normally and print exactly the expected lines.

Oracles: the error texts below, and the analytic gradients of small graphs
(ones times a constant) that each sink receives.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from conftest import run_on_this_core

import pyengine
from pyengine import Edge, Node

# The graph every subprocess builds: ``Fan`` hands ``grads[0] * (i + 1)``
# to its edge ``i``; each ``Sink`` records what reaches its slot 0.
_PRELUDE = '''
import numpy as np
import pyengine
from pyengine import Edge, Node

engine = pyengine.get_default_engine()


class Sink(Node):
    def __init__(self, name):
        super().__init__(input_metadata=[((3,), np.float64)])
        self.tag = name
        self.got = []

    def name(self):
        return self.tag

    def apply(self, grads):
        self.got.append(None if grads[0] is None else grads[0].tolist())
        return ()


class Fan(Node):
    def __init__(self, edges, count=None):
        super().__init__(next_edges=edges, input_metadata=[((3,), np.float64)])
        self.count = len(self.next_edges) if count is None else count

    def apply(self, grads):
        return [grads[0] * (i + 1) for i in range(self.count)]


def run(root, keep_graph=False, outputs=None, accumulate_grad=True):
    return engine.execute([Edge(root, 0)], [np.ones(3)], keep_graph, False, accumulate_grad,
                          outputs)


def report(what, fn):
    try:
        print(what, "->", fn())
    except Exception as error:
        print(what, "->", type(error).__name__ + ":", error)
'''


def run_isolated(code: str) -> list[str]:
    """Run ``code`` after the prelude on this test's core: See
    ``run_on_this_core`` in conftest.py."""
    return run_on_this_core(_PRELUDE + textwrap.dedent(code), timeout=120)


# -- Edge input_nr: See Note [Edge input_nr] in pyengine/_shared/messages.py --

def test_negative_input_nr_is_an_error_before_any_backward():
    # The compiled core crashed (SIGSEGV) on either; the twin wrapped -1
    # around to the last slot and raised IndexError for -1000.
    lines = run_isolated('''
        sink = Sink("sink")
        for input_nr in (-1, -1000):
            report(input_nr, lambda: run(Fan([Edge(sink, input_nr)])))
        print("sink got", sink.got)
        run(Fan([Edge(sink, 0)]))
        print("then", sink.got)
    ''')
    assert lines == [
        "-1 -> ValueError: Edge input_nr must be >= 0, got -1 for sink",
        "-1000 -> ValueError: Edge input_nr must be >= 0, got -1000 for sink",
        "sink got []",
        "then [[1.0, 1.0, 1.0]]",
    ]


@pytest.mark.parametrize("input_nr, kind", [("0", "str"), (1.5, "float"), (None, "NoneType"),
                                            (1.0, "float")])
def test_input_nr_must_be_an_int(input_nr, kind):
    # The compiled core said "'str' object cannot be interpreted as an
    # integer"; the twin took int("0") and int(1.5).
    sink = Sink_()
    with pytest.raises(TypeError) as info:
        Edge(sink, input_nr)
    assert str(info.value) == f"Edge input_nr must be an int, got {kind} (for Sink_)"
    # What operator.index takes, an Edge takes, as an int.
    edge = Edge(sink, np.int64(0))
    assert type(edge.input_nr) is int and edge.input_nr == 0 and Edge(sink, True).input_nr == 1
    _backward(Scale([edge], 2.0))
    assert sink.got == [[[2.0, 2.0, 2.0]]]


class Sink_(Node):
    """Records the gradients that reach it, per slot."""

    def __init__(self, input_metadata=(((3,), np.float64),)):
        super().__init__(input_metadata=input_metadata)
        self.got = []

    def apply(self, grads):
        self.got.append([None if g is None else g.tolist() for g in grads])
        return ()


class Scale(Node):
    """Hands ``grads[0] * factor`` to each of its edges."""

    def __init__(self, edges, factor=1.0):
        super().__init__(next_edges=edges, input_metadata=[((3,), np.float64)])
        self.factor = factor

    def apply(self, grads):
        return [grads[0] * self.factor for _ in self.next_edges]


def _backward(root, keep_graph=False):
    return pyengine.get_default_engine().execute([Edge(root, 0)], [np.ones(3)], keep_graph, False,
                                                 True)


def test_undeclared_slots_grow_up_to_the_limit():
    from pyengine._core import node_module

    limit = node_module.MAX_INPUT_NR
    assert limit == 65536
    # A node that declares one slot receives a gradient at slot 3: its
    # InputBuffer grows to four slots, as before.
    sink = Sink_()
    _backward(Scale([Edge(sink, 3)], 5.0))
    assert sink.got == [[None, None, None, [5.0, 5.0, 5.0]]]
    # The last undeclared slot allowed, and the first refused.
    far = Sink_()
    _backward(Scale([Edge(far, limit - 1)], 1.0))
    assert len(far.got[0]) == limit and far.got[0][limit - 1] == [1.0, 1.0, 1.0]
    for input_nr in (limit, 10**12, 2**64):
        with pytest.raises(ValueError) as info:
            Edge(far, input_nr)
        assert str(info.value) == (
            f"Edge input_nr {input_nr} is beyond Sink_'s 1 input slots and above {limit}, the "
            "limit for undeclared slots; declare the slot with input_metadata first")


def test_declared_slots_beyond_the_limit_are_fine():
    from pyengine._core import node_module

    limit = node_module.MAX_INPUT_NR
    sink = Sink_(input_metadata=[None] * (limit + 2))
    _backward(Scale([Edge(sink, limit + 1)], 3.0))
    assert len(sink.got[0]) == limit + 2 and sink.got[0][limit + 1] == [3.0, 3.0, 3.0]
    assert sink.got[0][:limit + 1] == [None] * (limit + 1)


# -- next edges changed while a node runs: See Note [Next edges while a node runs] --------

# A node that changes its own next edges (to ``new_edges()``) while it runs,
# at one of the five places Python code runs then.
_CHANGING_NODE = '''
class Releasing(Fan):
    change = None

    def release_variables(self):
        super().release_variables()
        if self.change is not None:
            self.next_edges = self.change()


class Applying(Fan):
    change = None

    def apply(self, grads):
        self.next_edges = self.change()
        return super().apply(grads)


WHERE = ("tensor_prehook", "prehook", "apply", "posthook", "release_variables")


def changing_node(where, edges, count, new_edges):
    kind = {"apply": Applying, "release_variables": Releasing}.get(where, Fan)
    node = kind(edges, count=count)

    def mutate(*args):
        node.next_edges = new_edges()

    if where == "tensor_prehook":
        node.register_tensor_prehook(0, mutate)
    elif where == "prehook":
        node.register_prehook(mutate)
    elif where == "posthook":
        node.register_hook(mutate)
    else:
        node.change = new_edges
    return node
'''
WHERE = ("tensor_prehook", "prehook", "apply", "posthook", "release_variables")


def test_next_edges_changed_while_the_node_runs():
    # The node's gradients go along the edges it had before it ran, whoever
    # changes them while it runs; the change holds from its next run on.
    # A shorter tuple from a post-hook or release_variables crashed the
    # compiled core (SIGSEGV), and raised IndexError in the twin.
    lines = run_isolated(_CHANGING_NODE + '''
for where in WHERE:
    for change in ("shorter", "longer", "other"):
        a, b, c = Sink("a"), Sink("b"), Sink("c")
        new_edges = {"shorter": lambda: [Edge(a, 0)],
                     "longer": lambda: [Edge(a, 0), Edge(b, 0), Edge(c, 0)],
                     "other": lambda: [Edge(c, 0), Edge(a, 0)]}[change]
        fan = changing_node(where, [Edge(a, 0), Edge(b, 0)], 2, new_edges)
        report(f"{where} {change}", lambda: run(fan, keep_graph=where != "release_variables"))
        print("   ", a.got, b.got, c.got, len(fan.next_edges))
print("done")
''')
    expected = []
    for where in WHERE:
        for change, edges_after in (("shorter", 1), ("longer", 3), ("other", 2)):
            expected += [f"{where} {change} -> []",
                         f"    [[1.0, 1.0, 1.0]] [[2.0, 2.0, 2.0]] [] {edges_after}"]
    assert lines == expected + ["done"]


def test_only_next_edge_changed_while_the_node_runs():
    # The same for a node with one next edge, which the engine reads from the
    # node (See Note [A node's only next edge] in pyengine/_pure/node.py):
    # its gradient goes to the node it had before it ran, even where that
    # node's only reference was the replaced edge.
    lines = run_isolated(_CHANGING_NODE + '''
for where in WHERE:
    for change in ("none", "longer", "other", "dropped"):
        b, c = Sink("b"), Sink("c")
        old = Sink("old")
        got = old.got
        new_edges = {"none": lambda: [],
                     "longer": lambda: [Edge(b, 0), Edge(c, 0)],
                     "other": lambda: [Edge(c, 0)],
                     "dropped": lambda: [None]}[change]
        fan = changing_node(where, [Edge(old, 0)], 1, new_edges)
        del old
        report(f"{where} {change}", lambda: run(fan, keep_graph=where != "release_variables"))
        print("   ", got, b.got, c.got, len(fan.next_edges),
              fan._only_next_node is (c if change == "other" else None))
print("done")
''')
    expected = []
    for where in WHERE:
        for change, edges_after in (("none", 0), ("longer", 2), ("other", 1), ("dropped", 1)):
            expected += [f"{where} {change} -> []",
                         f"    [[1.0, 1.0, 1.0]] [] [] {edges_after} True"]
    assert lines == expected + ["done"]


def test_only_next_edge_follows_next_edges():
    # Set with _next_edges by every way of setting them, never alone, and
    # read only (See Note [A node's only next edge]).
    a, b = Sink_(), Sink_()
    node = Scale([Edge(a, 0)], 2.0)
    assert (node._only_next_node, node._only_input_nr) == (a, 0)
    for edges, expected in (([Edge(a, 0), Edge(b, 0)], (None, -1)), ([None], (None, -1)),
                            ([], (None, -1)), ((Edge(b, 0),), (b, 0))):
        node.next_edges = edges
        assert (node._only_next_node, node._only_input_nr) == expected
    node._next_edges = [Edge(a, 0)]
    assert (node._only_next_node, node._only_input_nr) == (a, 0)
    for field in ("_only_next_node", "_only_input_nr"):
        with pytest.raises(AttributeError):
            setattr(node, field, None)
        with pytest.raises(AttributeError):
            delattr(node, field)
    assert Sink_()._only_next_node is None and Sink_()._only_input_nr == -1
    # A second slot of the sink: the gradient reaches input 1.
    two_slots = Sink_(input_metadata=[((3,), np.float64)] * 2)
    node.next_edges = [Edge(two_slots, 1)]
    assert node._only_input_nr == 1
    _backward(node)
    assert two_slots.got == [[None, [2.0, 2.0, 2.0]]]


def test_only_next_edge_set_again_while_the_old_one_goes():
    # The node the replaced edge led to may be freed by the setter, and its
    # __del__ may set the edges again: the fields end as that last set left
    # them, never a node from one set and an input_nr from another.
    b, c = Sink_(), Sink_(input_metadata=[((3,), np.float64)] * 2)
    holder = []

    class SetsOnDel(Sink_):
        def __del__(self):
            holder[0].next_edges = [Edge(c, 1)]

    old = SetsOnDel()
    node = Scale([Edge(old, 0)], 2.0)
    holder.append(node)
    del old
    node.next_edges = [Edge(b, 0)]
    assert (node._only_next_node, node._only_input_nr) == (c, 1)
    assert [(edge.node, edge.input_nr) for edge in node.next_edges] == [(c, 1)]
    _backward(node)
    assert (b.got, c.got) == ([], [[None, [2.0, 2.0, 2.0]]])


def test_changed_next_edges_hold_from_the_next_run():
    a, b, c = Sink_(), Sink_(), Sink_()
    fan = Scale([Edge(a, 0), Edge(b, 0)], 2.0)
    fan.register_hook(lambda grad_inputs, grad_outputs: setattr(fan, "next_edges", [Edge(c, 0)]))
    _backward(fan, keep_graph=True)
    assert (a.got, b.got, c.got) == ([[[2.0] * 3]], [[[2.0] * 3]], [])
    # Scale returns one gradient per edge it has when it runs: now one, to c.
    _backward(fan, keep_graph=True)
    assert (a.got, b.got, c.got) == ([[[2.0] * 3]], [[[2.0] * 3]], [[[2.0] * 3]])


def test_apply_that_keeps_returning_the_old_count_fails_cleanly_next_run():
    a, b = Sink_(), Sink_()

    class Two(Node):
        def apply(self, grads):
            self.next_edges = [Edge(a, 0)]
            return [grads[0], grads[0]]

    two = Two([Edge(a, 0), Edge(b, 0)], [((3,), np.float64)])
    _backward(two, keep_graph=True)
    assert a.got == b.got == [[[1.0] * 3]]
    with pytest.raises(RuntimeError) as info:
        _backward(two, keep_graph=True)
    assert str(info.value) == "Function Two returned an invalid number of gradients - expected 1, but got 2"


# -- execute's arguments: See Note [Checking execute's arguments] ----------------------

def test_a_returned_list_shortened_while_the_engine_reads_it():
    # A node may keep the list it returns; Python code the engine runs while
    # it reads that list (here a replaced gradient's __del__: the cast in
    # validate_outputs, or the add into a buffer while the gradients are
    # passed on) may shorten it. The compiled core read past its end
    # (SIGSEGV); the twin raised IndexError or dropped the rest.
    lines = run_isolated('''
        class Clears(np.ndarray):
            """A gradient that empties its producer's kept list when dropped."""
            def __del__(self):
                Producer.kept.clear()


        class Producer(Node):
            kept = []

            def __init__(self, edges, first):
                super().__init__(next_edges=edges, input_metadata=[((3,), np.float64)])
                self.first = first

            def apply(self, grads):
                Producer.kept = [self.first(), np.ones(3), np.ones(3)][:len(self.next_edges)]
                return Producer.kept


        float32_clears = lambda: np.ones(3, np.float32).view(Clears)  # the cast drops it
        # validate_outputs, without and with hooks
        for hooked in (False, True):
            sinks = [Sink(str(i)) for i in range(3)]
            producer = Producer([Edge(sink, 0) for sink in sinks], float32_clears)
            if hooked:
                producer.register_prehook(lambda grads: None)
            report(f"validate, hooks {hooked}", lambda: run(producer))
            print("   ", [sink.got for sink in sinks])
        # passing the gradients on: the second add into the shared sink drops
        # the Clears the first producer put there, which empties the second
        # producer's list (made earlier, so it runs later)
        shared, other = Sink("shared"), Sink("other")
        second = Producer([Edge(shared, 0), Edge(other, 0)], lambda: np.ones(3))
        first = Producer([Edge(shared, 0)], lambda: np.ones(3).view(Clears))
        root = Fan([Edge(first, 0), Edge(second, 0)])
        report("passing on", lambda: run(root))
        print("   ", shared.got, other.got)
        print("done")
    ''')
    changed = "RuntimeError: the gradients Function Producer returned changed while the engine passed them on"
    assert lines == [f"validate, hooks False -> {changed}", "    [[], [], []]",
                     f"validate, hooks True -> {changed}", "    [[], [], []]",
                     f"passing on -> {changed}", "    [] []",
                     "done"]


def test_lists_shortened_by_python_code_the_engine_runs_elsewhere():
    # Where else the engine reads a list while Python code it calls may
    # shorten it: an owner graph's gradients while dense_gradient runs and
    # while a sum runs (an object array's elements' __add__), and an
    # InputBuffer's slots while a backend adds. The compiled core read or
    # wrote past their ends (SIGSEGV); the twin raised IndexError. Owner
    # graph hooks get tuples (they got the engine's own lists), and
    # AccumulateGrad.apply takes a list with the gradient (it read an
    # empty one's first item).
    lines = run_isolated('''
        import gc

        from pyengine import AccumulateGrad, OwnerGraph
        from pyengine._core import InputBuffer

        made = []


        def clear_lists_holding(value, length):
            for referrer in gc.get_referrers(value):
                if type(referrer) is list and referrer is not made and len(referrer) == length:
                    referrer.clear()


        class Element:
            """An object array's element whose sum empties the 5-gradient lists."""
            def __init__(self, v):
                self.v = v

            def __add__(self, other):
                for array in made:
                    clear_lists_holding(array, 5)
                return Element(self.v + (other.v if isinstance(other, Element) else other))

            __radd__ = __add__


        def element_array(v):
            array = np.empty(1, dtype=object)
            array[0] = Element(v)
            made.append(array)
            return array


        class Owner:
            def __init__(self, parents=(), slots=1):
                self.parents, self.grad, self.slots = list(parents), None, slots

            def vjp(self, grads):
                return [element_array(1.0) for _ in self.parents]


        hooks_got = []
        graph = OwnerGraph("parents", "vjp", mode="returns",
                           pre_hook=lambda owner, grads: hooks_got.append(type(grads).__name__),
                           post_hook=lambda owner, out, grads: hooks_got.append(
                               (type(out).__name__, type(grads).__name__)))
        p, q = Owner(), Owner()
        report("owner graph sum", lambda: graph.backward(Owner([p, p, q, q, q]),
                                                         element_array(1.0)))
        print("hooks got", hooks_got[:2])


        def dense(value):
            clear_lists_holding(value, 4)
            return np.asarray(value, dtype=float)


        class Sub(np.ndarray):
            pass


        class Subs(Owner):
            def vjp(self, grads):
                return [np.ones(2).view(Sub) for _ in self.parents]


        leaf = Subs()
        mid = Subs([leaf], slots=4)
        graph = OwnerGraph("parents", "vjp", mode="returns", dense_gradient=dense,
                           num_inputs=lambda owner: owner.slots)
        report("owner graph dense_gradient",
               lambda: graph.backward(Subs([(mid, 0), (mid, 1), (mid, 2), (mid, 3)]), np.ones(2)))


        buffer = InputBuffer(3)


        class Clears(np.ndarray):
            def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
                buffer.buffer.clear()
                return getattr(ufunc, method)(*[np.asarray(i) for i in inputs], **kwargs)


        buffer.add(2, np.ones(2).view(Clears), False)
        report("InputBuffer add", lambda: buffer.add(2, np.ones(2), False))
        report("InputBuffer(-1)", lambda: InputBuffer(-1).buffer)


        class Leaf:
            def __init__(self):
                self.data, self.grad, self.requires_grad = np.ones(2), None, True
                self.grad_fn, self.output_nr = None, 0


        accumulate = AccumulateGrad(Leaf())
        report("AccumulateGrad []", lambda: accumulate.apply([]))
        report("AccumulateGrad tuple", lambda: accumulate.apply((np.ones(2),)))
        print("done")
    ''')
    changed = "RuntimeError: an owner's gradients changed while the engine read them"
    assert lines == [
        f"owner graph sum -> {changed}",
        "hooks got ['tuple', ('tuple', 'tuple')]",
        f"owner graph dense_gradient -> {changed}",
        "InputBuffer add -> RuntimeError: InputBuffer slot 2 went away while a gradient was "
        "added into it",
        "InputBuffer(-1) -> ValueError: InputBuffer size -1 is negative",
        "AccumulateGrad [] -> ValueError: AccumulateGrad.apply expects a list with the leaf's "
        "gradient, got an empty list",
        "AccumulateGrad tuple -> TypeError: Argument 'grads' has incorrect type (expected list, "
        "got tuple)",
        "done"]


def test_execute_checks_outputs_before_anything_runs():
    # The compiled core read object() as an Edge and returned [None]; the
    # twin raised AttributeError after compute_dependencies.
    lines = run_isolated('''
        sink = Sink("sink")
        fan = Fan([Edge(sink, 0)])
        report("object", lambda: run(fan, outputs=[object()], accumulate_grad=False))
        report("None", lambda: run(fan, outputs=[Edge(sink, 0), None], accumulate_grad=False))
        report("tuple", lambda: run(fan, outputs=[(sink, 0)], accumulate_grad=False))
        report("int", lambda: run(fan, outputs=5, accumulate_grad=False))
        print("ran", sink.got)
        report("edge", lambda: [g.tolist() for g in run(fan, outputs=iter([Edge(sink, 0)]),
                                                         accumulate_grad=False)])
    ''')
    assert lines == [
        "object -> TypeError: outputs[0] must be an Edge, got object",
        "None -> TypeError: outputs[1] must be an Edge, got NoneType",
        "tuple -> TypeError: outputs[0] must be an Edge, got tuple",
        "int -> TypeError: 'int' object is not iterable",
        "ran []",
        "edge -> [[1.0, 1.0, 1.0]]",
    ]


def test_execute_checks_roots_grads_and_outputs_before_anything_runs():
    sink = Sink_()
    fan = Scale([Edge(sink, 0)])
    edge, ones = Edge(fan, 0), np.ones(3)
    # (roots, grads, outputs, error, message); roots are checked first,
    # then outputs, then grads.
    table = [
        ([object()], [ones], None, TypeError, "roots[0] must be an Edge, got object"),
        ([None], [ones], None, TypeError, "roots[0] must be an Edge, got NoneType"),
        ([], [], None, RuntimeError, "execute needs at least one root edge"),
        ([edge], [ones, ones], None, RuntimeError,
         "invalid number of gradients - expected 1, but got 2"),
        ([edge], [], None, RuntimeError, "invalid number of gradients - expected 1, but got 0"),
        ([edge], [object()], None, TypeError,
         "invalid gradient at index 0 - expected an array, but got object"),
        ([edge], 5, None, TypeError, "'int' object is not iterable"),
        ([object()], [ones], [object()], TypeError, "roots[0] must be an Edge, got object"),
        ([edge], [ones], [object()], TypeError, "outputs[0] must be an Edge, got object"),
        ([edge], [], ["edge"], TypeError, "outputs[0] must be an Edge, got str"),
        ([edge], [ones], [Edge(sink, 0), None], TypeError, "outputs[1] must be an Edge, got NoneType"),
        ([edge], [ones], [Edge(sink, 0), 1.0], TypeError, "outputs[1] must be an Edge, got float"),
    ]
    for roots, grads, outputs, error, message in table:
        with pytest.raises(error) as info:
            pyengine.get_default_engine().execute(roots, grads, False, False, False, outputs)
        assert str(info.value) == message
    assert sink.got == []


# -- node fields written from Python: See Note [Fields Python code can write] -------------

# (what is written, the statement, what it gives: "write" when the write
# itself fails, else what the backward after it gives). Each statement runs
# on a fresh graph: leaf <- mid <- root, with ``acc`` an AccumulateGrad and
# ``free`` a GradientFreeNode.
_WRITES = [
    ("_next_edges object", "mid._next_edges = (object(),)",
     "write TypeError: next_edges[0] must be an Edge or None, got object"),
    ("_next_edges int", "mid._next_edges = 5", "write TypeError: 'int' object is not iterable"),
    ("_next_edges None", "mid._next_edges = None",
     "write TypeError: 'NoneType' object is not iterable"),
    ("_next_edges list", "mid._next_edges = [Edge(sink, 0)]", "backward -> []"),
    ("del _next_edges", "del mid._next_edges",
     "write AttributeError: cannot delete _next_edges: set it to () instead"),
    ("del _input_metadata", "del sink._input_metadata",
     "write AttributeError: cannot delete _input_metadata: set it to () instead"),
    ("_input_metadata object", "sink._input_metadata = [object()]",
     "write TypeError: input_metadata[0] must be an InputMetadata or None, got object"),
    ("_input_metadata tuple spec", "sink._input_metadata = [((3,), np.float64)]",
     "write TypeError: input_metadata[0] must be an InputMetadata or None, got tuple"),
    ("_input_metadata append", "sink._input_metadata.append(1)",
     "write AttributeError: 'tuple' object has no attribute 'append'"),
    ("_input_metadata[0] = ", "sink._input_metadata[0] = 1",
     "write TypeError: 'tuple' object does not support item assignment"),
    ("_input_metadata None", "sink._input_metadata = None",
     "write TypeError: 'NoneType' object is not iterable"),
    ("_input_metadata fewer", "sink._input_metadata = []", "backward -> []"),
    ("_input_metadata never initialized",
     "sink._input_metadata = [pyengine.InputMetadata.__new__(pyengine.InputMetadata)]",
     "write TypeError: input_metadata[0] is an InputMetadata whose __init__ never completed"),
    ("add_input_metadata never initialized",
     "sink.add_input_metadata(pyengine.InputMetadata.__new__(pyengine.InputMetadata))",
     "write TypeError: an input's metadata is an InputMetadata whose __init__ never completed"),
    ("input_metadata shape", "sink.input_metadata[0].shape = (5,)", "write AttributeError"),
    ("input_metadata dtype", "sink.input_metadata[0].dtype = object()", "write AttributeError"),
    ("input_metadata is_cpu", "sink.input_metadata[0].is_cpu = False", "write AttributeError"),
    ("_pre_hooks tuple", "mid._pre_hooks = (1,)", "write TypeError: Expected list, got tuple"),
    ("_pre_hooks bad entry", "mid._pre_hooks = [1]",
     "backward -> TypeError: cannot unpack non-iterable int object"),
    ("_post_hooks str", "mid._post_hooks = 'x'", "write TypeError: Expected list, got str"),
    ("_tensor_pre_hooks dict", "mid._tensor_pre_hooks = {}", "write TypeError: Expected list, got dict"),
    ("_retains_grad_hooks list", "mid._retains_grad_hooks = []",
     "write TypeError: Expected dict, got list"),
    ("_metadata int", "mid._metadata = 1", "write TypeError: Expected dict, got int"),
    # Cython names a type defined in C with its module: See Note [Type names
    # in Cython's words] in pyengine/_pure/static_types.py.
    ("_metadata numpy int", "mid._metadata = np.int64(1)",
     "write TypeError: Expected dict, got numpy.int64"),
    ("_pre_hooks array", "mid._pre_hooks = np.ones(1)",
     "write TypeError: Expected list, got numpy.ndarray"),
    ("del _pre_hooks", "del mid._pre_hooks", "backward -> []"),
    ("_sequence_nr", "mid._sequence_nr = 2**70", "write AttributeError"),
    ("_initialized", "mid._initialized = False", "write AttributeError"),
    ("_released", "mid._released = 'yes'", "backward -> []"),
    ("del _released", "del mid._released", "write AttributeError: cannot delete _released"),
    ("_only_next_node", "mid._only_next_node = root", "write AttributeError"),
    ("_only_next_node None", "mid._only_next_node = None", "write AttributeError"),
    ("_only_input_nr", "mid._only_input_nr = 7", "write AttributeError"),
    ("del _only_next_node", "del mid._only_next_node", "write AttributeError"),
    ("_saved_values", "mid._saved_values = object()", "backward -> []"),
    ("_stream", "mid._stream = object()",
     "backward -> AttributeError: 'object' object has no attribute 'device'"),
    ("edge node", "mid.next_edges[0].node = root", "write AttributeError"),
    ("edge input_nr", "mid.next_edges[0].input_nr = -1", "write AttributeError"),
    ("free method", "free.method = 5", "write AttributeError"),
    ("free owner", "free.owner = None", "write AttributeError"),
    ("acc leaf_state", "acc.leaf_state = 1", "write TypeError: leaf_state must be a LeafState, got int"),
    ("acc leaf_state None", "acc.leaf_state = None",
     "write TypeError: leaf_state must be a LeafState, got NoneType"),
    ("del acc leaf_state", "del acc.leaf_state", "write AttributeError: cannot delete leaf_state"),
    ("edge without a node", "mid.next_edges = [Edge.__new__(Edge)]", "write TypeError"),
    ("root without a node", "engine.execute([Edge.__new__(Edge)], [np.ones(3)], False, False, True)",
     "write TypeError"),
    ("edge init again", "mid.next_edges[0].__init__(root, 0); assert mid.next_edges[0].node is sink",
     "backward -> []"),
    ("AccumulateGrad without its own leaf_state",
     "bare = type('Bare', (AccumulateGradBase,), {})(input_metadata=[((3,), np.float64)]); "
     "bare.variable = variable; run(Fan([Edge(bare, 0)])); "
     "assert variable.grad.tolist() == [1.0] * 3; variable.grad = None",
     "backward -> []"),
    ("input_metadata init again", "sink.input_metadata[0].__init__((2,), np.float64)",
     "write TypeError: InputMetadata is immutable: its __init__ ran already"),
    ("leaf_state lock", "acc.leaf_state.lock = None", "write AttributeError"),
    # The core's validate_outputs (private) from Python: the compiled one
    # read object() as an Edge once; both check what Python code passes.
    ("validate_outputs edges", "validate_outputs([object()], [np.ones(3)], str)",
     "write TypeError: edges[0] must be an Edge or None, got object"),
    ("validate_outputs grads", "validate_outputs([None], (np.ones(3),), str)",
     "write TypeError: Argument 'grads' has incorrect type (expected list, got tuple)"),
    ("input buffer slot", "InputBuffer(1).add(-1, np.ones(3), False)",
     "write IndexError: InputBuffer slot -1 is negative"),
    ("input buffer list", "b = InputBuffer(1); b.buffer = None; b.add(0, np.ones(3), False)",
     "write TypeError"),
    ("input buffer tuple", "InputBuffer(1).buffer = (np.ones(3),)",
     "write TypeError: Expected list, got tuple"),
    ("input buffer list subclass", "InputBuffer(1).buffer = type('L', (list,), {})([None])",
     "write TypeError: Expected list, got L"),
    ("input buffer array", "InputBuffer(1).buffer = np.ones(1)",
     "write TypeError: Expected list, got numpy.ndarray"),
    ("del input buffer list",
     "b = InputBuffer(1); del b.buffer; assert b.buffer is None; b.add(0, np.ones(3), False)",
     "write TypeError: InputBuffer.buffer is None; expected a list"),
    ("input buffer never initialized",
     "b = InputBuffer.__new__(InputBuffer); assert b.buffer is None; b.buffer = [None]; "
     "b.add(0, np.ones(3), False); b.add(0, np.ones(3), False); assert b.buffer[0].tolist() == [2.0] * 3",
     "backward -> []"),
    ("input buffer slot of no backend",
     "b = InputBuffer(1); b.buffer = [1.5]; b.add(0, np.ones(3), False)",
     "write TypeError: InputBuffer slot 0 holds a float, which no registered backend adds a "
     "gradient to"),
]


def test_writing_fields_from_python_never_crashes():
    # Each write either fails with the error of a checked field, or the
    # backward after it gives a clear error (or none): the same in both
    # cores. Before, the compiled core trusted _next_edges and
    # _input_metadata and crashed on their contents.
    lines = run_isolated(f'''
        from pyengine import AccumulateGrad, GradientFreeNode
        from pyengine._core import AccumulateGradBase, InputBuffer, validate_outputs


        class Owner:
            def run(self):
                pass


        class Variable:
            def __init__(self):
                self.data = np.ones(3)
                self.grad = None


        for what, statement, expected in {_WRITES!r}:
            sink = Sink("sink")
            mid = Fan([Edge(sink, 0)])
            root = Fan([Edge(mid, 0)])
            variable = Variable()
            acc = AccumulateGrad(variable)
            free = GradientFreeNode(Owner(), "run")
            try:
                exec(statement)
            except Exception as error:
                outcome = f"write {{type(error).__name__}}: {{error}}"
            else:
                try:
                    outcome = f"backward -> {{run(root)}}"
                except Exception as error:
                    outcome = f"backward -> {{type(error).__name__}}: {{error}}"
                run(Fan([Edge(acc, 0)]))
                assert variable.grad.tolist() == [1.0, 1.0, 1.0], what
            print(what, "|", outcome)
        # The engine works afterwards.
        sink = Sink("sink")
        run(Fan([Edge(Fan([Edge(sink, 0)], count=1), 0)]))
        print("after", sink.got)
    ''')
    outcomes = dict(line.split(" | ", 1) for line in lines[:-1])
    for what, _, expected in _WRITES:
        assert outcomes[what].startswith(expected), (what, outcomes[what])
    assert lines[-1] == "after [[1.0, 1.0, 1.0]]"


def test_fields_keep_their_value_after_a_refused_write():
    sink = Sink_()
    mid = Scale([Edge(sink, 0)])
    edges, metadata = mid._next_edges, mid._input_metadata
    with pytest.raises(TypeError):
        mid._next_edges = (Edge(sink, 0), object())
    with pytest.raises(TypeError):
        mid._input_metadata = [None, "spec"]
    with pytest.raises(TypeError):
        mid._pre_hooks = ()
    assert mid._next_edges is edges and mid._input_metadata is metadata and mid._pre_hooks is None
    # A checked write takes effect: the engine sees the new edges and slots.
    other = Sink_()
    mid._next_edges = [Edge(other, 0)]
    mid._input_metadata = [pyengine.InputMetadata((3,), np.float64)]
    assert type(mid._next_edges) is tuple and type(mid._input_metadata) is tuple
    _backward(Scale([Edge(mid, 0)], 4.0))
    assert sink.got == [] and other.got == [[[4.0] * 3]]


@pytest.mark.parametrize("name", ["Edge", "InputMetadata", "LeafState", "GradLock", "InputBuffer",
                                  "GraphTask", "NodeTask", "ReadyQueue"])
def test_the_cores_value_classes_are_final_in_both(name):
    # The compiled core declares them final, so that its C code reads the
    # fields it was compiled for; the twin refused nothing before.
    with pytest.raises(TypeError, match=f"type 'pyengine.*{name}' is not an acceptable base type"):
        type("Extended", (getattr(pyengine._core, name),), {})


def test_a_grad_no_backend_adds_to_is_named_and_kept():
    # A leaf's .grad is the framework's attribute, so Python code can set it
    # to anything; the sum into it names what it found, in both cores.
    class Variable:
        def __init__(self):
            self.data = np.ones(3)
            self.grad = None

    variable = Variable()
    accumulate = pyengine.AccumulateGrad(variable)
    variable.grad = [1.0, 1.0, 1.0]
    with pytest.raises(TypeError, match="the variable's .grad holds a list, which no registered "
                                        "backend adds a gradient to"):
        _backward(Scale([Edge(accumulate, 0)], 1.0))
    assert variable.grad == [1.0, 1.0, 1.0]
    variable.grad = None
    _backward(Scale([Edge(accumulate, 0)], 2.0))
    assert variable.grad.tolist() == [2.0] * 3


# Each names an argument the compiled function reads as an extension type
# at once: None there was read as one (SIGSEGV, or a write into None). With
# the type Cython's error names, in both cores (the twin names its classes
# by the compiled core's names: See Note [Type names in Cython's words] in
# pyengine/_pure/static_types.py).
_NONE_ARGUMENTS = [
    ("graph_task", "engine.ready_queue(None, pyengine.CPU)", "pyengine._graph_task.GraphTask"),
    ("queue", "engine._device_thread_main(1, None)", "pyengine._ready_queue.ReadyQueue"),
    ("graph_task", "engine._run_pool_task(None)", "pyengine._graph_task.GraphTask"),
    ("node", "core.set_sequence_nr(None, 0)", "pyengine._node.NodeBase"),
    ("graph", "core.owner_graph_module.run_owner_graph(None, None, None, None, False)",
     "pyengine._owner_graph.OwnerGraph"),
    ("task", "core.ReadyQueue().push(None)", "pyengine._ready_queue.NodeTask"),
    ("task", "core.ReadyQueue().push_pop(None)", "pyengine._ready_queue.NodeTask"),
    ("pool", "thread_pool._reentrant_thread_main(None, None, [])",
     "pyengine._thread_pool._ThreadPoolShared"),
]


def test_none_where_the_compiled_core_reads_an_extension_type():
    lines = run_isolated(f'''
        import gc
        import importlib
        import pyengine._core as core

        thread_pool = importlib.import_module(
            "pyengine._thread_pool" if core.IMPLEMENTATION == "compiled"
            else "pyengine._pure.thread_pool")
        for name, statement, _ in {_NONE_ARGUMENTS!r}:
            try:
                exec(statement)
            except TypeError as error:
                print(name, "|", error)
            else:
                print(name, "| no error")
            gc.collect()
        # Cython names a type defined in C with its module.
        import numpy as np
        try:
            core.set_sequence_nr(np.int64(1), 0)
        except TypeError as error:
            print("numpy |", error)
        # A graph task may lack a queue (an owner graph's has none); no
        # thread may then run it.
        try:
            engine._run_pool_task(core.GraphTask(False, False, 0, None))
        except ValueError as error:
            print("no queue |", error)
        sink = Sink("sink")
        run(Fan([Edge(sink, 0)]))
        print("after", sink.got)
    ''')
    assert lines[:len(_NONE_ARGUMENTS)] == [
        f"{name} | Argument '{name}' has incorrect type (expected {expected}, got NoneType)"
        for name, _, expected in _NONE_ARGUMENTS]
    assert lines[len(_NONE_ARGUMENTS):] == [
        "numpy | Argument 'node' has incorrect type (expected pyengine._node.NodeBase, got "
        "numpy.int64)",
        "no queue | this graph task has no CPU ready queue (an owner graph's, or one made with "
        "cpu_ready_queue=None): no thread can run its nodes",
        "after [[1.0, 1.0, 1.0]]",
    ]


# -- values the compiled core read in C unchecked (found by the review of
# 2026-12-03): None or a list shortened by Python code, read or written by
# PyList_GET_SIZE, a cdef method call or an index without a bound check. In
# the release build each read or wrote past an object (a segfault, or
# silent corruption); in the debug build most aborted. Each now gets the
# same error as the twin. --

def test_none_where_a_list_or_object_is_read_in_c_is_refused():
    lines = run_isolated('''
        import ctypes
        from pyengine import _core
        report("validate_outputs grads=None", lambda: _core.validate_outputs((), None, None))
        # GraphTask.init_to_execute wrote the node's kept slot into None.
        # Past its 16 bytes (its reference count and type), which nothing may write.
        past_none = (ctypes.c_uint32 * 12).from_address(id(None) + 16)
        before = list(past_none)
        graph_task = _core.GraphTask(False, False, 0, _core.ReadyQueue())
        report("init_to_execute root=None", lambda: graph_task.init_to_execute(None, [], True))
        print("memory past None unchanged:", list(past_none) == before)
        # Engine.stop woke the owner of every graph task a device queue was
        # handed out for, through its CPU queue: None here.
        engine = pyengine.Engine()
        queueless = _core.GraphTask(False, False, 0, None)
        report("ready_queue, no CPU queue",
               lambda: engine.ready_queue(queueless, pyengine.Device("cuda", 0)))
        report("stop", engine.stop)
        # init_to_execute read an output that is not an Edge as one.
        for output in (None, 5, np.int64(5)):
            report(f"init_to_execute output {output!r}", lambda: _core.GraphTask(
                False, False, 0, _core.ReadyQueue()).init_to_execute(Sink("s"), [output], False))
        # The signature's check comes first, as Cython's.
        report("validate_outputs grads=None, policy zzz",
               lambda: _core.validate_outputs((), None, None, gradient_policy="zzz"))
        # The engine's device threads, reached through gc: what stop() and a
        # device task's routing read from them in C.
        import gc
        from pyengine._shared.device_threads import _DeviceThreads
        class Anything:
            __slots__ = ("__weakref__",)
        stranger = Anything()
        for change in ("a graph task", "a queue"):
            engine = pyengine.Engine()
            engine.ready_queue(_core.GraphTask(False, False, 0, _core.ReadyQueue()),
                               pyengine.Device("cuda", 0))
            threads = [o for o in gc.get_referents(engine) if type(o) is _DeviceThreads][0]
            if change == "a graph task":
                threads.graph_tasks.add(stranger)
            else:
                threads.queues[0] = None
            report(f"stop, {change} changed", engine.stop)
    ''')
    assert lines == [
        "validate_outputs grads=None -> TypeError: Argument 'grads' has incorrect type "
        "(expected list, got NoneType)",
        "init_to_execute root=None -> TypeError: Argument 'graph_root' must not be None",
        "memory past None unchanged: True",
        "ready_queue, no CPU queue -> ValueError: this graph task has no CPU ready queue (an "
        "owner graph's, or one made with cpu_ready_queue=None): no thread can run its nodes",
        "stop -> None",
        "init_to_execute output None -> TypeError: Cannot convert NoneType to pyengine._node.Edge",
        "init_to_execute output 5 -> TypeError: Cannot convert int to pyengine._node.Edge",
        "init_to_execute output np.int64(5) -> TypeError: Cannot convert numpy.int64 to "
        "pyengine._node.Edge",
        "validate_outputs grads=None, policy zzz -> TypeError: Argument 'grads' has incorrect "
        "type (expected list, got NoneType)",
        "stop, a graph task changed -> TypeError: Cannot convert Anything to "
        "pyengine._graph_task.GraphTask",
        "stop, a queue changed -> RuntimeError: the engine's device queues were changed: a "
        "NoneType where a ReadyQueue was",
    ]


def test_a_task_pushed_from_python_must_be_one_the_engine_can_run():
    # See Note [A task pushed from Python is checked] in
    # pyengine/_pure/ready_queue.py. thread_main cast a forged task's
    # inputs to a list: a segfault.
    lines = run_isolated('''
        from pyengine import _core
        sink = Sink("sink")
        class Impostor:  # what NodeTask reads of a node, not a Node
            _sequence_nr = 5
        class Forger(Node):
            def __init__(self, task_fields):
                super().__init__(next_edges=[Edge(sink, 0)],
                                 input_metadata=[((3,), np.float64)])
                self.task_fields = task_fields
            def apply(self, grads):
                graph_task = _core.state_module.get_current_graph_task()
                fields = [graph_task if field == "graph_task" else field
                          for field in self.task_fields]
                if fields[1] == "self":
                    fields[1] = self
                elif fields[1] == "impostor":
                    fields[1] = Impostor()
                graph_task.cpu_ready_queue.push(_core.NodeTask(*fields))
                return [grads[0]]
        class PosingGraphTask:  # isinstance takes a __class__ property's word
            __class__ = property(lambda self: _core.GraphTask)
            reentrant_depth = 0
            def increment_outstanding_tasks(self):
                pass
        queueless = _core.GraphTask(False, False, 0, None)
        for fields in [("graph_task", "self", "not a list"), ("graph_task", "impostor", []),
                       (None, "self", []), (PosingGraphTask(), "self", []),
                       (queueless, "self", [])]:
            shown = tuple(field if isinstance(field, (str, list)) or field is None
                          else type(field).__name__ for field in fields)
            report(shown, lambda: run(Forger(fields)))
        print("sink got", sink.got)
        run(Fan([Edge(sink, 0)]))
        print("then", sink.got)
    ''')
    assert lines == [
        "('graph_task', 'self', 'not a list') -> TypeError: a NodeTask with a node is one the "
        "engine runs: its inputs must be a list, got str",
        "('graph_task', 'impostor', []) -> TypeError: a NodeTask with a node is one the engine "
        "runs: its node must be a Node, got Impostor",
        "(None, 'self', []) -> TypeError: a NodeTask with a node is one the engine runs: its "
        "graph_task must be a GraphTask, got NoneType",
        "('PosingGraphTask', 'self', []) -> TypeError: a NodeTask with a node is one the engine "
        "runs: its graph_task must be a GraphTask, got PosingGraphTask",
        "('GraphTask', 'self', []) -> ValueError: this graph task has no CPU ready queue (an "
        "owner graph's, or one made with cpu_ready_queue=None): no thread can run its nodes",
        "sink got []",
        "then [[1.0, 1.0, 1.0]]",
    ]


def test_a_list_python_code_shortens_while_c_indexes_it_is_an_index_error():
    # Each list is reached through gc, as code that meant harm would.
    lines = run_isolated('''
        import gc
        from pyengine import _core

        # An owner graph's returned gradients, emptied by its metadata callback.
        class V:
            def __init__(self, *parents):
                self.parents, self.grad = parents, None
        a, b = V(), V()
        g0, g1 = np.ones(2), np.full(2, 2.0)
        def metadata(owner):
            if owner is a:
                for referrer in gc.get_referrers(g0):
                    if type(referrer) is list and len(referrer) == 2 and referrer[0] is g0:
                        referrer.clear()
            return [((2,), np.float64)]
        graph = pyengine.OwnerGraph(lambda o: o.parents, lambda o, grads: [g0, g1],
                                    mode="returns", metadata=metadata)
        report("owner graph", lambda: graph.backward(V(a, b), np.ones(2)))

        # An InputBuffer's sums, emptied by the __del__ of the value a sum replaced.
        buffer = _core.InputBuffer(1)
        class Dropper:
            def __del__(self):
                for referent in gc.get_referents(buffer):
                    if type(referent) is list and referent is not buffer.buffer:
                        referent.clear()
        class Element:
            def __add__(self, other):
                buffer.buffer[0] = Dropper()
                return Element()
        buffer.add(0, np.array([Element()], dtype=object), False)
        report("InputBuffer.add", lambda: buffer.add(0, np.array([Element()], dtype=object), False))

        # execute's root gradients, emptied by the __del__ of the gradient
        # validate_outputs cast.
        class Vanishing(np.ndarray):
            def __del__(self):
                for candidate in gc.get_objects():
                    if (type(candidate) is list and len(candidate) == 1
                            and type(candidate[0]) is np.ndarray
                            and candidate[0].dtype == np.float32):
                        candidate.clear()
        class Float32Sink(Node):
            def apply(self, grads):
                return []
        float32_sink = Float32Sink(input_metadata=[((2,), np.float32)])
        report("execute", lambda: engine.execute(
            [Edge(float32_sink, 0)], iter([np.full(2, 7.0).view(Vanishing)]), False, False, True))

        # init_to_execute's outputs, emptied by a gc callback once its walk
        # has begun (the first output marked), which a copy made before the
        # walk does not see.
        sinks = [Sink(str(i)) for i in range(4)]
        outputs = [Edge(node, 0) for node in sinks]
        graph_task = _core.GraphTask(False, False, 0, _core.ReadyQueue())
        armed = []
        def empty_outputs(phase, info):
            if armed and outputs and graph_task.exec_info:
                outputs.clear()
        gc.callbacks.append(empty_outputs)
        # Drain the free lists, so that the loop's first allocation collects.
        keep = [[] for _ in range(200)], [(i, -i) for i in range(5000)]
        gc.set_threshold(1)
        armed.append(1)
        report("init_to_execute", lambda: graph_task.init_to_execute(sinks[0], outputs, False))
        gc.set_threshold(700)
        gc.callbacks.remove(empty_outputs)
        print("outputs emptied:", outputs == [], "captured:", len(graph_task.captured_vars))
    ''')
    assert lines == [
        "owner graph -> IndexError: list index out of range",
        "InputBuffer.add -> IndexError: list assignment index out of range",
        "execute -> IndexError: list index out of range",
        "init_to_execute -> None",
        "outputs emptied: True captured: 4",
    ]


def test_an_input_buffer_whose_list_a_sum_sets_to_none_is_an_error():
    # The sum of two gradients runs Python code, which may reach the
    # engine's InputBuffer (through gc) and set its list to None; the engine
    # then handed None to the task as its inputs, read in C: a segfault.
    lines = run_isolated('''
        import gc
        from pyengine import _core
        class Element:
            def __add__(self, other):
                for candidate in gc.get_objects():
                    if type(candidate) is _core.InputBuffer:
                        candidate.buffer = None
                return Element()
        class ObjectSink(Node):
            def __init__(self):
                super().__init__(input_metadata=[None])
                self.got = []
            def apply(self, grads):
                self.got.append(grads)
                return ()
        class Twice(Node):
            def __init__(self, edge):
                super().__init__(next_edges=[edge, edge], input_metadata=[((3,), np.float64)])
            def apply(self, grads):
                return [np.array([Element()], dtype=object) for _ in range(2)]
        sink = ObjectSink()
        report("backward", lambda: run(Twice(Edge(sink, 0))))
        print("sink got", sink.got)
    ''')
    assert lines == [
        "backward -> RuntimeError: an InputBuffer's list was set to None while the engine "
        "summed gradients into it: no inputs to run its node on",
        "sink got []",
    ]


def test_an_input_metadata_whose_init_failed_is_left_uninitialized():
    # The compiled core set the shape and its fast path's dtype before a
    # size that does not fit a C long raised: the fast path then compared a
    # gradient against fewer sizes than the shape has, and the twin, which
    # took any size, disagreed.
    metadata = pyengine.InputMetadata.__new__(pyengine.InputMetadata)
    for shape in [(2, 2**64), (2, -2**63 - 1)]:
        with pytest.raises(OverflowError, match="too large to convert to C long"):
            metadata.__init__(shape, np.float64)
        assert (metadata.shape, metadata.dtype, metadata.device, metadata.is_cpu) == (
            None, None, None, False)
    with pytest.raises(TypeError, match="whose __init__ never completed"):
        Sink_(input_metadata=[metadata])
    # Whatever its dtype: every size is a C size.
    with pytest.raises(OverflowError, match="too large to convert to C long"):
        pyengine.InputMetadata((2, 2**64), object)
    metadata.__init__((3,), np.float64)
    sink = Sink_(input_metadata=[metadata])
    _backward(Scale([Edge(sink, 0)], 2.0))
    assert sink.got == [[[2.0, 2.0, 2.0]]]


def test_an_input_metadata_init_run_again_from_its_own_index_is_refused():
    # A size's __index__ that runs the same metadata's __init__ to its end:
    # the outer __init__ then overwrote the fields (a CPU slot became a
    # device's), under a node that had read them in between.
    metadata = pyengine.InputMetadata.__new__(pyengine.InputMetadata)
    made = []

    class Reentrant:
        def __index__(self):
            if not made:
                metadata.__init__((3,), np.float64)
                made.append(Sink_(input_metadata=[metadata]))
            return 3

        __int__ = __index__

    with pytest.raises(TypeError, match="its __init__ ran already"):
        metadata.__init__((Reentrant(),), np.float64, "fake:0")
    assert (metadata.shape, metadata.device) == ((3,), pyengine.Device("cpu"))
    _backward(Scale([Edge(made[0], 0)], 2.0))
    assert made[0].got == [[[2.0, 2.0, 2.0]]]


def test_an_input_buffer_list_emptied_while_it_grows_is_never_read_past_its_end():
    # Growing the list to a slot beyond it allocates, and a collection then
    # may run a gc callback that empties it: the compiled core read the slot
    # past the list's end (a segfault). Where the collection falls differs
    # between the cores, so either outcome is right: the sum, or an
    # IndexError for the slot that went away.
    lines = run_isolated('''
        import gc
        from pyengine import _core
        buffer = _core.InputBuffer(0)
        slots = [np.ones(1)] * 2
        buffer.buffer = slots
        armed = []
        def empty_slots(phase, info):
            if armed and phase == "start" and slots:
                armed.clear()
                slots.clear()
        gc.callbacks.append(empty_slots)
        keep = [[] for _ in range(200)], [(i, -i) for i in range(5000)]
        gc.set_threshold(1)
        armed.append(1)
        try:
            buffer.add(40, np.ones(1), False)
            outcome = "added" if buffer.buffer[40].tolist() == [1.0] else "wrong sum"
        except IndexError:
            outcome = "IndexError"
        gc.set_threshold(700)
        gc.callbacks.remove(empty_slots)
        print(outcome, "emptied" if not armed else "not emptied")
    ''')
    assert lines in (["added emptied"], ["IndexError emptied"])


def test_what_grad_inputs_captures_is_out_of_python_codes_reach():
    # The compiled core kept the (input_nr, output_idx) pairs of each
    # captured node in a list of lists that gc.get_referents reaches from
    # the graph task, and indexed it unchecked: a node that emptied it
    # crashed the interpreter. They are in C now; the twin keeps them in its
    # ExecInfo objects, which this node does not reach (the graph task's
    # referents hold ExecInfos only inside a dict).
    lines = run_isolated('''
        import gc
        from pyengine import _core
        class Emptying(Fan):
            def apply(self, grads):
                task = _core.state_module.get_current_graph_task()
                for referent in gc.get_referents(task):
                    if type(referent) is list and referent and type(referent[0]) is list:
                        referent.clear()
                        print("emptied a list of lists")
                return super().apply(grads)
        sinks = [Sink(f"s{i}") for i in range(4)]
        captured = run(Emptying([Edge(sink, 0) for sink in sinks]), accumulate_grad=False,
                       outputs=[Edge(sink, 0) for sink in sinks])
        print([value.tolist() for value in captured])
    ''')
    assert lines == [[[1.0] * 3, [2.0] * 3, [3.0] * 3, [4.0] * 3].__repr__()]


# -- a graph task's fields and its exception, set by a running node (found
# by comparing both cores' error messages) --

def test_graph_task_fields_a_running_node_sets_fail_in_the_same_words():
    lines = run_isolated('''
        from pyengine._core import state_module


        class Poke(Node):
            """Sets its graph task's field ``field`` to ``value`` and passes its
            gradient on."""

            def __init__(self, edges, field, value):
                super().__init__(next_edges=edges, input_metadata=[((3,), np.float64)])
                self.field, self.value = field, value

            def apply(self, grads):
                graph_task = state_module.get_current_graph_task()
                if self.field == "exception":
                    graph_task.set_exception(self.value)
                else:
                    setattr(graph_task, self.field, self.value)
                return [grads[0]]


        for field, value in (("captured_vars", None), ("captured_vars", []),
                             ("leaf_streams", None), ("final_callbacks", None),
                             ("exception", 5), ("exception", KeyError)):
            sink = Sink("sink")
            for outputs in (None, [Edge(sink, 0)]):
                report(f"{field}={value!r} outputs={outputs is not None}",
                       lambda: run(Poke([Edge(sink, 0)], field, value), outputs=outputs,
                                   accumulate_grad=outputs is None))
        # A final callback sets it in an owner graph's backward.


        class Value:
            def __init__(self, kids=()):
                self.kids = kids

            def back(self):
                pyengine.queue_callback(
                    lambda: state_module.get_current_graph_task().set_exception(5))


        report("owner graph exception=5",
               lambda: pyengine.execute_owner_graph(Value((Value(),)), "kids", "back"))
        sink = Sink("sink")
        run(Fan([Edge(sink, 0)]))
        print("after", sink.got)
    ''')
    assert lines == [
        # Nothing captured: execute returns the field as it is.
        "captured_vars=None outputs=False -> None",
        # The compiled core said "'NoneType' object is not subscriptable".
        "captured_vars=None outputs=True -> TypeError: 'NoneType' object does not support item "
        "assignment",
        "captured_vars=[] outputs=False -> []",
        "captured_vars=[] outputs=True -> IndexError: list assignment index out of range",
        # The twin iterated None ("'NoneType' object is not iterable"); the
        # compiled core syncs leaf streams only when there are any.
        "leaf_streams=None outputs=False -> []",
        "leaf_streams=None outputs=True -> [array([1., 1., 1.])]",
        "final_callbacks=None outputs=False -> TypeError: object of type 'NoneType' has no len()",
        "final_callbacks=None outputs=True -> TypeError: object of type 'NoneType' has no len()",
        # The compiled core said "raise: exception class must be a subclass
        # of BaseException".
        "exception=5 outputs=False -> TypeError: exceptions must derive from BaseException",
        "exception=5 outputs=True -> TypeError: exceptions must derive from BaseException",
        "exception=<class 'KeyError'> outputs=False -> KeyError: ",
        "exception=<class 'KeyError'> outputs=True -> KeyError: ",
        "owner graph exception=5 -> TypeError: exceptions must derive from BaseException",
        "after [[1.0, 1.0, 1.0]]",
    ]


def test_a_second_init_of_a_graph_task_or_an_engine_is_refused():
    # A node that called __init__ again on its running graph task reset its
    # counts and set its CPU queue to None, which the compiled core then
    # pushed to (a segfault; the twin raised AttributeError). An engine's
    # second __init__ left its device and pool threads to run unknown to it.
    lines = run_isolated('''
        from pyengine import _core
        class Reinit(Node):
            def apply(self, grads):
                _core.state_module.get_current_graph_task().__init__(False, False, 0, None)
                return [grads[0]]
        sink = Sink("sink")
        report("running graph task", lambda: run(Reinit([Edge(sink, 0)])))
        print("sink got", sink.got)
        graph_task = _core.GraphTask(False, False, 0, _core.ReadyQueue())
        report("new graph task", lambda: graph_task.__init__(True, True, 1, None))
        print("fields kept:", graph_task.keep_graph, graph_task.reentrant_depth,
              type(graph_task.cpu_ready_queue).__name__)
        engine = pyengine.Engine(3)
        report("engine", lambda: engine.__init__(5))
        print("bound kept:", engine.max_recursion_depth)
        fresh = _core.GraphTask.__new__(_core.GraphTask)
        fresh.__init__(False, False, 2, None)
        print("__new__ then __init__:", fresh.reentrant_depth)
        run(Fan([Edge(sink, 0)]))
        print("after", sink.got)
    ''')
    graph_task_refused = ("TypeError: GraphTask.__init__ ran already: it runs once per instance (a "
                          "second __init__ would reset the counts, queue and error of a backward "
                          "that may be running)")
    assert lines == [
        f"running graph task -> {graph_task_refused}",
        "sink got []",
        f"new graph task -> {graph_task_refused}",
        "fields kept: False 0 ReadyQueue",
        "engine -> TypeError: Engine.__init__ ran already: it runs once per instance (a second "
        "__init__ would leave its device and pool threads to run on, unknown to it and never "
        "stopped)",
        "bound kept: 3",
        "__new__ then __init__: 2",
        "after [[1.0, 1.0, 1.0]]",
    ]
