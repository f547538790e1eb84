"""Stubs for pyengine._dependencies (compiled): see _dependencies.pyx."""

from collections.abc import Sequence
from typing import Any

def init_to_execute(graph_root: Any, graph_task: Any, outputs: Sequence[Any],
                    accumulate_grad: bool) -> int: ...
