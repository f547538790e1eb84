"""The reentrant thread pool (compiled; twin: pyengine/_pure/thread_pool.py)."""

from collections.abc import Callable
from typing import Any

class _ThreadPoolShared: ...

def _reentrant_thread_main(pool: _ThreadPoolShared, run_graph_task: Callable[[Any], object],
                           slot: list[Any]) -> None: ...
def stop_thread_pool(pool: _ThreadPoolShared) -> list[Any]: ...
