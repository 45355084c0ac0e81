"""Expert-parallel token dispatch/combine with DeepEP's (V1) Buffer call shapes, on any torch.distributed
backend (gloo on CPU, NCCL/RCCL on GPUs). See moeflow/ep/buffer.py for the API and docs/ep-bytes.md
for what `buffer.stats` counts.

    from moeflow.ep import Buffer            # instead of: from deep_ep import Buffer
"""

from moeflow.ep.buffer import Buffer
from moeflow.ep.comm import EPStats
from moeflow.ep.counts import get_dispatch_layout, lower_bound_bytes, traffic_bytes
from moeflow.ep.event import EventOverlap
from moeflow.ep.fp8 import per_token_cast_back, per_token_cast_to_fp8
from moeflow.ep.inflight import InFlight
from moeflow.ep.routing import EPHandle

__all__ = [
    "Buffer", "EPHandle", "EPStats", "EventOverlap", "InFlight", "get_dispatch_layout", "lower_bound_bytes",
    "per_token_cast_back", "per_token_cast_to_fp8", "traffic_bytes",
]
