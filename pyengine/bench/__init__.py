"""``python -m pyengine bench``: every speed claim of the project, from one run.

The same graphs on pyengine's compiled core and its pure twin, on PyTorch
(a ``view_as`` chain with no kernels, a chain of Python
``autograd.Function`` s, an ``x * c`` chain), on DeZero and micrograd with
their own engines and with pyengine swapped in; as many of those as are
installed. Graphs: a chain at 1k to 1M nodes, a wide graph (1000 x 10 with
fan-in), a diamond lattice, a fan-in of 1,000, an MLP training step; the
fixed cost of one ``backward`` / ``grad`` call on 1- and 10-node graphs;
the peak memory of one backward. It prints tables of medians (min-max) with
ratios, checks the goals, and writes a log-log PNG plot.

- :mod:`~pyengine.bench.workload`: what one sample times, and its oracle.
- :mod:`~pyengine.bench.graphs`: pyengine's graphs of pass-through nodes.
- :mod:`~pyengine.bench.subjects`: every engine, and how it builds each graph.
- :mod:`~pyengine.bench.worker`: a subject's process (See Note [Timing a sample]).
- :mod:`~pyengine.bench.runner`: the parent (See Note [Interleaved samples]).
- :mod:`~pyengine.bench.report`: tables, goals, plot.
- :mod:`~pyengine.bench.command`: the command line.

Importing this package imports none of the peers: each subject's worker
imports its own framework.
"""

from .command import add_arguments, main

__all__ = ["add_arguments", "main"]
