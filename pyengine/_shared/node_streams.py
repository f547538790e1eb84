"""Streams at both ends of a backward: the stream a node records when it is
made, and the caller's streams waiting on the leaf streams at the end.
See Note [Streaming backwards].

Shared by the compiled core and the twin (See Note [Slow paths are
shared]): both run once per node made or once per backward.
"""

from .. import streams
from ..device import CPU


def _creation_stream(input_metadata):
    """The current stream of the node's device, the first non-CPU device among
    its input slots; None on the CPU. See Note [Streaming backwards]."""
    for metadata in input_metadata:
        if metadata is not None and metadata.device != CPU:
            runtime = streams.runtime_for(metadata.device)
            return runtime.current_stream(metadata.device) if runtime is not None else None
    return None


def sync_leaf_streams(graph_task):
    """Make each stream the caller had current wait on the leaf streams of its
    device. See Note [Streaming backwards]."""
    for leaf_stream in graph_task.leaf_streams:
        caller_stream = graph_task.caller_current_streams.get(leaf_stream.device)
        if caller_stream is not None:
            streams.sync_streams(caller_stream, leaf_stream)
