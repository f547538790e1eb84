"""InputBuffer (compiled; twin: pyengine/_pure/input_buffer.py)."""

from typing import Any

from pyengine.device import Device

class InputBuffer:
    buffer: list[Any]
    device: Device
    def __init__(self, size: int) -> None: ...
    def add(self, pos: int, value: Any, create_graph: bool) -> int: ...
