"""Adapters to the real DeepEP (`deep_ep`) and UCCL-EP (`uccl.ep`) buffers, when installed on CUDA.

Both expose DeepEP's V1 Buffer, so moeflow.ep.Buffer(backend="deep_ep") forwards every call to theirs
unchanged (their own kernels, their handles). moeflow's byte counters are not filled for these backends:
use moeflow.ep.layout.traffic_bytes on the routing for the same numbers.
"""

from __future__ import annotations

import importlib

import torch

_SOURCES = {
    "deep_ep": (("deep_ep",), "https://github.com/deepseek-ai/DeepEP"),
    "uccl": (("uccl.ep", "uccl_ep"), "https://github.com/uccl-project/uccl (ep/)"),
}


def make_external(name: str, group, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                  num_qps_per_rank: int):
    """The package's Buffer, or a RuntimeError saying why it cannot be used here and what to use instead."""
    modules, url = _SOURCES[name]
    fallback = "use backend='auto' (alltoall / hierarchical over torch.distributed) instead"
    if not torch.cuda.is_available():
        raise RuntimeError(f"Buffer(backend={name!r}) needs CUDA GPUs and there are none here; {fallback}")
    mod, errors = None, []
    for module in modules:
        try:
            mod = importlib.import_module(module)
            break
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
    if mod is None or not hasattr(mod, "Buffer"):
        raise RuntimeError(
            f"Buffer(backend={name!r}) needs the {name} package built for this CUDA ({url}); it could not be "
            f"imported ({'; '.join(errors) or 'no Buffer class'}); {fallback}"
        )
    if num_nvl_bytes == 0 and num_rdma_bytes == 0 and not low_latency_mode:
        num_nvl_bytes = 1 << 30  # the real kernels need a preallocated buffer; 1 GiB is DeepEP's example
    return mod.Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=low_latency_mode,
                      num_qps_per_rank=num_qps_per_rank)
