"""NodeBase, Edge, InputMetadata (compiled; twin: pyengine/_pure/node.py)."""

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from pyengine.device import Device

ACCUMULATE_GRAD_SEQUENCE_NR: int


class InputMetadata:
    shape: tuple[int, ...]
    dtype: Any
    device: Device
    is_cpu: bool
    def __init__(self, shape: Iterable[int], dtype: Any, device: Device = ...) -> None: ...
    @classmethod
    def from_value(cls, value: Any) -> InputMetadata: ...

def as_input_metadata(spec: Any) -> InputMetadata | None: ...

class Edge:
    node: NodeBase
    input_nr: int
    def __init__(self, node: NodeBase, input_nr: int = ...) -> None: ...
    def __iter__(self) -> Iterator[Any]: ...

class NodeBase:
    _next_edges: tuple[Edge | None, ...]
    _input_metadata: tuple[InputMetadata | None, ...]
    _sequence_nr: int
    _pre_hooks: list[Any] | None
    _post_hooks: list[Any] | None
    _tensor_pre_hooks: list[Any] | None
    _retains_grad_hooks: dict[int, Any] | None
    _saved_values: Any
    _released: bool
    @property
    def _overrides_release_variables(self) -> bool: ...
    @property
    def _gradient_policy(self) -> str: ...
    gradient_policy: str
    _stream: Any
    _metadata: dict[str, Any] | None
    _initialized: bool
    def __init__(self, next_edges: Iterable[Edge | None] = ...,
                 input_metadata: Iterable[Any] = ...) -> None: ...
    @property
    def sequence_nr(self) -> int: ...
    @property
    def next_edges(self) -> tuple[Edge | None, ...]: ...
    @next_edges.setter
    def next_edges(self, next_edges: Iterable[Edge | None]) -> None: ...
    @property
    def input_metadata(self) -> tuple[InputMetadata | None, ...]: ...
    def num_inputs(self) -> int: ...
    def add_input_metadata(self, spec: Any) -> int: ...
    @property
    def metadata(self) -> dict[str, Any]: ...
    @property
    def stream(self) -> Any: ...
    def apply(self, grads: list[Any]) -> Sequence[Any]: ...
    def task_should_compute_output(self, output_edge_index: int) -> bool: ...
    def task_buffered_gradient(self, output_edge_index: int) -> Any: ...
    def release_variables(self) -> None: ...

class GradientFreeNodeBase(NodeBase):
    owner: Any
    method: str
    def __init__(self, owner: Any, method: str, next_edges: Iterable[Edge | None] = ...,
                 input_metadata: Iterable[Any] = ...) -> None: ...
    def apply(self, grads: list[Any]) -> list[None]: ...

class LeafState:
    lock: Any
    accumulator: Any
    tensor_pre_hooks: list[Any] | None
    post_accumulate_grad_hooks: list[Any] | None
    keep_indexed: bool
    def owned_grad(self) -> Any: ...
    def set_owned_grad(self, grad: Any) -> None: ...

class AccumulateGradBase(NodeBase):
    variable: Any
    leaf_state: LeafState
    def apply(self, grads: list[Any]) -> tuple[()]: ...

def _set_sequence_nr(node: NodeBase, sequence_nr: int) -> None: ...
