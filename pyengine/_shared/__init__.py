"""What both engine cores share: the slow paths the compiled core calls
from C, and the twin calls as they are.

``pyengine/_pure/`` is only the twin, the specification of the compiled
core; the modules here are no twin of anything: both cores import them
the same way. One module per concept: ``hooks`` (hooks around ``apply``,
anomaly mode's checks, post-accumulate-grad hooks), ``gradient_checks``
(``validate_gradient``, the slow check of one gradient against its slot),
``device_threads`` (the per-device worker threads and where a node runs),
``node_streams`` (the stream a node records and the end-of-backward sync
of the caller's streams), ``messages`` (the errors both cores raise, in
the same words), ``owner_graph_checks`` (owner graphs' checks, messages
and slow paths).

Note [Slow paths are shared]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The compiled core does in C what runs per node and per edge on the common
path: queue, dependency counts, buffers, a numpy gradient that already has
the right shape, dtype and device, a node without hooks. For the rare paths
(hooks, broadcast reductions and casts, other value types, anomaly checks,
device threads, streams) it calls the functions of this package, which
only touch the attributes both cores share. The twin calls the same
functions at the same points. Each rule is then written once, and the twin
stays the specification of both.
"""
