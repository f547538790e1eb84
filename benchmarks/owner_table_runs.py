"""The runs behind RESULTS.md's section on the owner table (issue 18, "why
autograd's chain depended on the process"): each subcommand builds one
framework's graph once and times or counts its backward on pyengine's
owner-graph walk, checking the gradient against the analytic one.

    python benchmarks/owner_table_runs.py probe chain|fanin
        probes per insert that ``address >> 4`` gives this process's
        autograd graph on a 32,768-slot table, and the backward's time
    python benchmarks/owner_table_runs.py autograd-deep N
        µs per node of an N-deep autograd chain
    python benchmarks/owner_table_runs.py autograd-faults chain|fanin
        user and system time and minor page faults per backward, native
        and on pyengine, alternating
    python benchmarks/owner_table_runs.py autograd-loop chain|fanin|wide CALLS [--native]
        CALLS backward calls and nothing else timed: run under valgrind
    python benchmarks/owner_table_runs.py chainer-chain
        ms per backward of a 10k Chainer chain on pyengine
    python benchmarks/owner_table_runs.py micrograd-chain CALLS LENGTH
        ms per backward of a LENGTH micrograd chain, and page faults

Each needs its framework installed (autograd 1.9.1, chainer 7.8.1,
micrograd 0.1.0).
"""

from __future__ import annotations

import gc
import resource
import statistics
import sys
import time

import numpy as np


def autograd_graph(kind, n=10_000):
    """The traced end node of an autograd graph, and its gradient at ones(3)."""
    import autograd.numpy as anp
    from autograd.core import VJPNode
    from autograd.tracer import trace

    def chain(x):
        for _ in range(n):
            x = anp.negative(x)
        return x

    def fanin(x):
        total = x
        for _ in range(n):
            total = total + x
        return total

    def wide(x):
        total = None
        for _ in range(n // 10):
            y = x
            for _ in range(10):
                y = anp.negative(y)
            total = y if total is None else total + y
        return total

    function = {"chain": chain, "fanin": fanin, "wide": wide}[kind]
    expected = {"chain": (-1.0) ** n, "fanin": n + 1.0, "wide": float(n // 10)}[kind]
    _, end = trace(VJPNode.new_root(), function, np.ones(3))
    return end, np.full(3, expected)


def backward_pass(end):
    import autograd.core

    return autograd.core.backward_pass(np.ones(3), end)


def probe(kind):
    from pyengine.adapters import autograd as adapter

    end, expected = autograd_graph(kind)
    nodes, stack, seen = [], [end], set()
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
            stack.extend(node.parents)
    size = 32_768
    table, probes = [None] * size, 0
    for node in nodes:
        i, p = (id(node) >> 4) & (size - 1), 1
        while table[i] is not None:
            i, p = (i + 1) & (size - 1), p + 1
        table[i] = node
        probes += p
    gc.collect()
    gc.freeze()
    times = []
    with adapter.installed():
        for _ in range(15):
            start = time.process_time()
            result = backward_pass(end)
            times.append(time.process_time() - start)
    np.testing.assert_array_equal(result, expected)
    print(f"{kind}: {probes / len(nodes):.2f} probes per insert, "
          f"pyengine {statistics.median(times) * 1e3:.2f} ms")


def autograd_deep(n):
    from pyengine.adapters import autograd as adapter

    end, expected = autograd_graph("chain", n)
    gc.collect()
    gc.freeze()
    times = []
    with adapter.installed():
        for _ in range(5):
            start = time.process_time()
            result = backward_pass(end)
            times.append(time.process_time() - start)
    np.testing.assert_array_equal(result, expected)
    print(f"N={n}: pyengine {statistics.median(times) * 1e6 / n:.3f} us/node")


def autograd_faults(kind):
    from pyengine.adapters import autograd as adapter

    end, expected = autograd_graph(kind)
    gc.collect()
    gc.freeze()
    for engine in ("native", "pyengine", "native", "pyengine"):
        if engine == "pyengine":
            adapter.install()
        backward_pass(end)
        before = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(20):
            result = backward_pass(end)
        after = resource.getrusage(resource.RUSAGE_SELF)
        adapter.uninstall()
        np.testing.assert_array_equal(result, expected)
        print(f"{engine}: user {(after.ru_utime - before.ru_utime) / 20 * 1e3:.2f} ms, "
              f"sys {(after.ru_stime - before.ru_stime) / 20 * 1e3:.2f} ms, "
              f"{(after.ru_minflt - before.ru_minflt) / 20:.0f} minor faults per backward")


def autograd_loop(kind, calls, native):
    from pyengine.adapters import autograd as adapter

    end, expected = autograd_graph(kind)
    gc.collect()
    gc.freeze()
    if native:
        for _ in range(calls):
            result = backward_pass(end)
    else:
        with adapter.installed():
            for _ in range(calls):
                result = backward_pass(end)
    np.testing.assert_array_equal(result, expected)


def chainer_chain():
    import chainer

    from pyengine.adapters import chainer as adapter

    x = chainer.Variable(np.linspace(-1.0, 1.0, 3))
    y = x
    for _ in range(10_000):
        y = -y
    gc.collect()
    gc.freeze()
    times = []
    with adapter.installed():
        for _ in range(10):
            x.cleargrad()
            y.grad = np.ones(3)
            start = time.process_time()
            y.backward()
            times.append(time.process_time() - start)
    np.testing.assert_array_equal(x.grad, np.ones(3))
    print(f"chainer chain 10k: pyengine {statistics.median(times[1:]) * 1e3:.2f} ms")


def micrograd_chain(calls, length):
    from micrograd.engine import Value

    from pyengine.adapters import micrograd as adapter

    x = Value(0.5)
    y, values = x, [x]
    for _ in range(length):
        y = y * 1.0001
        values.extend(y._prev)
        values.append(y)
    gc.collect()
    gc.freeze()
    with adapter.installed():
        y.backward()
        before = resource.getrusage(resource.RUSAGE_SELF)
        times = []
        for _ in range(calls):
            for value in values:  # micrograd's backward adds into every .grad
                value.grad = 0.0
            start = time.process_time()
            y.backward()
            times.append(time.process_time() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
    np.testing.assert_allclose(x.grad, 1.0001 ** length)
    print(f"micrograd chain {length:,}: {statistics.median(times) * 1e3:.2f} ms, "
          f"{(after.ru_minflt - before.ru_minflt) / calls:.0f} minor faults per backward")


def main(argv):
    command, *rest = argv
    if command == "probe":
        probe(rest[0])
    elif command == "autograd-deep":
        autograd_deep(int(rest[0]))
    elif command == "autograd-faults":
        autograd_faults(rest[0])
    elif command == "autograd-loop":
        autograd_loop(rest[0], int(rest[1]), "--native" in rest)
    elif command == "chainer-chain":
        chainer_chain()
    elif command == "micrograd-chain":
        micrograd_chain(int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
