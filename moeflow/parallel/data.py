"""Data parallelism with FSDP2 (`fully_shard`): ZeRO-3 reshards parameters after forward, ZeRO-2 keeps
them gathered until backward (PyTorch FSDP2 docs, `reshard_after_forward`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, zero: int = 3, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard each transformer block, then the root (embedding, norm, head), over `mesh`."""
    if zero not in (2, 3):
        raise ValueError(f"parallel.zero = {zero} is not supported by FSDP2 sharding here; use 2 or 3")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mesh": mesh, "reshard_after_forward": zero == 3}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model
