"""Devices: where a value lives, as ``(type, index)``.

``cpu`` has no index. ``cuda:N`` is a cupy device; ``fake:N`` is the
test-only device type of DESIGN.md (numpy-backed values that the engine
routes and synchronizes exactly as it would GPU values). Devices are
immutable, hashable and compare by value; ``Device.parse("cuda:1")`` and
``str(device)`` convert to and from PyTorch's spelling.
"""

from __future__ import annotations

__all__ = ["Device", "CPU", "as_device"]


class Device:
    """A device ``(type, index)``; ``index`` is ``None`` for the CPU."""

    __slots__ = ("type", "index", "_hash")

    def __init__(self, type: str, index: int | None = None) -> None:
        if type == "cpu":
            index = None
        elif index is None or index < 0:
            raise ValueError(f"device {type!r} needs a non-negative index, got {index!r}")
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "_hash", hash((type, index)))

    @staticmethod
    def parse(spec: str | Device) -> Device:
        """``"cpu"``, ``"cuda"`` (index 0), ``"cuda:1"``, ``"fake:0"`` or a Device."""
        if isinstance(spec, Device):
            return spec
        type_, _, index = str(spec).partition(":")
        if type_ == "cpu":
            return CPU
        return Device(type_, int(index) if index else 0)

    def __setattr__(self, name, value):
        raise AttributeError("Device is immutable")

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, Device):
            return NotImplemented
        return self.type == other.type and self.index == other.index

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"Device({str(self)!r})"

    def __reduce__(self):
        return (Device, (self.type, self.index))


CPU = Device("cpu")


def as_device(device) -> Device:
    """``device`` as a Device: a Device as it is, a str read by
    :meth:`Device.parse` (``"cpu"``, ``"cuda:1"``, as torch takes them);
    anything else is a TypeError naming what it got."""
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        return Device.parse(device)
    raise TypeError(f"device must be a pyengine.Device or a str such as 'cpu' or 'cuda:1', "
                    f"got {type(device).__name__}")
