"""Stubs for pyengine._dependencies (compiled): see _dependencies.pyx."""

from typing import Any, Sequence

def init_to_execute(graph_root: Any, graph_task: Any, outputs: Sequence[Any],
                    accumulate_grad: bool) -> int: ...
