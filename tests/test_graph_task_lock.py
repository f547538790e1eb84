"""The graph task's lock with Python code under it: See Note [Accumulating
under the graph task lock] in pyengine/_engine.pyx and Note [A lock the GIL
guards] in pyengine/_gil_guarded_lock.h.

While the engine passes a node's gradients on it holds the graph task's
lock, and Python code may run there: a backend's add, and the ``__del__``
of a gradient a buffer lets go of. If that code asks for the same lock
(a running node's query, or a nested backward that runs one of the outer
backward's nodes), the thread would wait for itself forever. Both cores
raise RuntimeError there instead. Each case runs in a subprocess of this
test's core with a timeout, so that a deadlock fails the test instead of
hanging the suite. (Ctrl-C while another thread holds the lock: See
tests/test_interrupts.py.)

Oracles: the error's words, the gradients the sinks get (sums of ones),
and that every backward returns.
"""

from __future__ import annotations

import textwrap

from conftest import run_on_this_core

_PRELUDE = '''
import numpy as np
import pyengine
from pyengine import Edge, InputMetadata, Node
from pyengine import fake_device as fd

engine = pyengine.get_default_engine()
SLOT = [InputMetadata((3,), np.float64)]


class Sink(Node):
    def __init__(self):
        super().__init__(input_metadata=SLOT)
        self.got = None

    def apply(self, grads):
        self.got = grads[0].tolist()
        return ()


class Gives(Node):
    """Hands ``make()`` to each of its edges; the last to run is ``running``."""
    running = None

    def __init__(self, edges, make, metadata=SLOT):
        super().__init__(next_edges=edges, input_metadata=metadata)
        self.make = make

    def apply(self, grads):
        Gives.running = self
        return [self.make() for _ in self.next_edges]


def run(root):
    engine.execute([Edge(root, 0)], [np.ones(3)], False, False, True, None)
'''


def run_isolated(code: str) -> list[str]:
    """Run ``code`` after the prelude on this test's core: See
    ``run_on_this_core`` in conftest.py."""
    return run_on_this_core(_PRELUDE + textwrap.dedent(code), timeout=60)


TAKEN_AGAIN = ("RuntimeError: a thread asked for the graph task's lock while it held it: Python "
               "code that ran while the engine passed gradients on (a backend's add, or the "
               "__del__ of a value it let go of) started work on the same backward (a running "
               "node's query, or a nested backward that ran one of its nodes)")


def test_a_query_from_a_gradient_dropped_under_the_lock_is_an_error_not_a_deadlock():
    # The second producer's add into the sink's buffer drops the first
    # producer's gradient (nodes made later run first), whose __del__ asks
    # the running node's question, which takes the lock. The question
    # fails; the backward goes on.
    lines = run_isolated('''
        asked = []


        class Asks(np.ndarray):
            armed = True

            def __del__(self):
                if Asks.armed:
                    Asks.armed = False
                    try:
                        asked.append(repr(Gives.running.task_buffered_gradient(0)))
                    except Exception as error:
                        asked.append(f"{type(error).__name__}: {error}")


        sink = Sink()
        second = Gives([Edge(sink, 0)], lambda: np.ones(3))
        first = Gives([Edge(sink, 0)], lambda: np.ones(3).view(Asks))
        run(Gives([Edge(first, 0), Edge(second, 0)], lambda: np.ones(3)))
        print(asked)
        print(sink.got)
    ''')
    assert lines == [repr([TAKEN_AGAIN]), "[2.0, 2.0, 2.0]"]


def test_a_nested_backward_that_runs_an_outer_node_under_the_lock_is_an_error():
    # The first producer gives both the sink and ``other`` a gradient whose
    # __del__ runs a nested backward; ``other`` is then ready and waits in
    # the thread's queue. The second producer's add into the sink's buffer
    # drops the first gradient under the lock. While the nested backward
    # waits for its fake-device node, its loop runs ``other``, an outer
    # task, whose routing asks for the lock this thread holds: the outer
    # backward fails with RuntimeError, the nested one completes.
    lines = run_isolated('''
        F0 = fd.device(0)
        nested_sink = Sink()


        def nested_backward():
            device_node = Gives([Edge(nested_sink, 0)], lambda: np.ones(3),
                                [InputMetadata((3,), np.float64, F0)])
            run(Gives([Edge(device_node, 0)], lambda: fd.to_fake(np.ones(3), F0)))


        class RunsBackward(np.ndarray):
            armed = True

            def __del__(self):
                if RunsBackward.armed:
                    RunsBackward.armed = False
                    nested_backward()


        sink, other_sink = Sink(), Sink()
        other = Gives([Edge(other_sink, 0)], lambda: np.ones(3))
        second = Gives([Edge(sink, 0)], lambda: np.ones(3))
        first = Gives([Edge(sink, 0), Edge(other, 0)], lambda: np.ones(3).view(RunsBackward))
        try:
            run(Gives([Edge(second, 0), Edge(first, 0)], lambda: np.ones(3)))
            print("outer: no error")
        except RuntimeError as error:
            print(f"outer: RuntimeError: {error}")
        print("nested:", nested_sink.got)
        # The engine works afterwards.
        sink = Sink()
        run(Gives([Edge(Gives([Edge(sink, 0)], lambda: np.ones(3) * 2), 0)], lambda: np.ones(3)))
        print("after:", sink.got)
    ''')
    assert lines == [f"outer: {TAKEN_AGAIN}", "nested: [1.0, 1.0, 1.0]", "after: [2.0, 2.0, 2.0]"]
