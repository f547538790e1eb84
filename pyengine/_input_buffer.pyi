"""InputBuffer (compiled; twin: pyengine/_pure/input_buffer.py)."""

from typing import Any

class InputBuffer:
    buffer: list[Any]
    def __init__(self, size: int) -> None: ...
    def add(self, pos: int, value: Any, create_graph: bool) -> int: ...
