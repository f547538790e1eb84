"""The engine (compiled; twin: pyengine/_pure/engine.py)."""

from collections.abc import Callable, Sequence
from typing import Any

from pyengine._node import Edge, NodeBase

MAX_RECURSION_DEPTH: int
MAX_TOTAL_DEPTH: int
MAX_POOL_THREADS: int

class WorkerState:
    """The engine's per-thread state; no attribute is visible from Python."""

class WorkerStateKeeper:
    """Ends its thread's WorkerState with the thread's locals; no attribute
    is visible from Python."""

class GraphRoot(NodeBase):
    outputs: list[Any]
    @property
    def _root_streams(self) -> tuple[Any, ...]: ...
    def __init__(self, roots: Sequence[Edge], grads: Sequence[Any]) -> None: ...
    def name(self) -> str: ...

class Engine:
    max_recursion_depth: int
    max_total_depth: int
    max_pool_threads: int
    def __init__(self, max_recursion_depth: int = ..., max_total_depth: int = ...,
                 max_pool_threads: int = ...) -> None: ...
    def execute(self, roots: Sequence[Edge], grads: Sequence[Any], keep_graph: bool,
                create_graph: bool, accumulate_grad: bool,
                outputs: Sequence[Edge] | None = ...) -> list[Any]: ...
    def stop(self, timeout: float = ...) -> None: ...
    def queue_callback(self, callback: Callable[[], Any]) -> None: ...

