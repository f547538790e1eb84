"""What a backward that failed or was interrupted must leave on its thread
as it found it: the checks that the fuzz's reference check
(``tests/fuzz/fuzz_interpreter.py``) and the interrupt sweep
(``tests/interrupt_sweep.py``) share."""

from __future__ import annotations

import pyengine


def thread_state_problems(multithreading: bool = True) -> list:
    """What is left changed in the calling thread's state (each mode put
    right, so that the next check starts clean); with ``multithreading``,
    the multithreading switch too (the fuzz's programs may leave it off)."""
    problems = []
    if not pyengine.is_grad_enabled():
        problems.append("grad mode left off")
        pyengine.set_grad_enabled(True)
    if pyengine.is_anomaly_enabled():
        problems.append("anomaly mode left on")
        pyengine.set_detect_anomaly(False)
    if not pyengine.is_checkpoint_valid():
        problems.append("checkpoint flag left off")
    if multithreading and not pyengine.is_multithreading_enabled():
        problems.append("multithreading left off")
        pyengine.set_multithreading_enabled(True)
    try:
        # No backward runs here, so none is the thread's current one (an
        # owner graph's walk once left its freed graph task there: See Note
        # [An owner's thread state comes back] in pyengine/_pure/owner_graph.py).
        pyengine.queue_callback(lambda: None)
        problems.append("a graph task left current: queue_callback took a callback")
    except RuntimeError:
        pass
    return problems
