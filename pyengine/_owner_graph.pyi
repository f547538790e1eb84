"""Owner graphs (compiled; twin: pyengine/_pure/owner_graph.py)."""

from collections.abc import Callable, Iterable
from typing import Any

_Reader = str | Callable[..., Any]

class OwnerGraph:
    parents: _Reader
    backward_: _Reader
    mode: str
    returns: bool
    num_inputs: Callable[[Any], int] | None
    metadata: Callable[[Any], Any] | None
    accumulate: Callable[[Any, Any], Any] | None
    visit: Callable[[Any], Any] | None
    needs_no_gradient: Callable[[Any], bool] | None
    pre_hook: Callable[[Any, list[Any]], Any] | None
    post_hook: Callable[[Any, list[Any], list[Any]], Any] | None
    should_compute_output: bool
    gradient_policy: str
    accumulates: bool
    unpack_grads: bool
    dense_gradient: Callable[[Any], Any] | None
    def __init__(self, parents: _Reader, backward: _Reader, *, mode: str = ...,
                 num_inputs: Callable[[Any], int] | None = ...,
                 metadata: Callable[[Any], Any] | None = ...,
                 accumulate: Callable[[Any, Any], Any] | None = ...,
                 visit: Callable[[Any], Any] | None = ...,
                 needs_no_gradient: Callable[[Any], bool] | None = ...,
                 pre_hook: Callable[[Any, list[Any]], Any] | None = ...,
                 post_hook: Callable[[Any, list[Any], list[Any]], Any] | None = ...,
                 should_compute_output: bool = ..., gradient_policy: str = ...,
                 accumulates: bool = ..., unpack_grads: bool = ...,
                 dense_gradient: Callable[[Any], Any] | None = ...) -> None: ...
    def backward(self, root: Any, grad: Any = ...) -> None: ...
    def grad(self, root: Any, grad: Any, inputs: Iterable[Any],
             allow_unused: bool = ...) -> list[Any]: ...

def run_owner_graph(graph: OwnerGraph, root: Any, grad: Any, inputs: list[Any] | None,
                    allow_unused: bool) -> list[Any] | None: ...

class HeldOwners:
    """A reference to every owner a walk has seen, out of Python code's
    reach: See Note [The walk's owners stay alive] in
    pyengine/_pure/owner_graph.py."""

class LeafLock:
    """An owner leaf's accumulation lock: See Note [An owner leaf
    accumulates under a lock] in pyengine/_pure/owner_graph.py."""

def leaf_locks_in_use() -> int: ...
