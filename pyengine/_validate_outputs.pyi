"""validate_outputs (compiled; twin: pyengine/_pure/validate_outputs.py)."""

from collections.abc import Callable, Sequence
from typing import Any

from pyengine._node import Edge, NodeBase

class NodeErrorFormat:
    def __init__(self, node: Any) -> None: ...
    def __call__(self, message: str) -> str: ...

def plain_error_format(message: str) -> str: ...
def validate_outputs(edges: Sequence[Edge | None], grads: list[Any],
                     format_error: Callable[[str], str], gradient_policy: str = ...,
                     node: NodeBase | None = ...) -> None: ...
