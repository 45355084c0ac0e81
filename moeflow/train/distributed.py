"""Process-group set-up for the trainer: torchrun's environment in, (rank, world, device) out."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_pref: str = "auto", timeout_s: float = 300) -> DistInfo:
    """Join torchrun's process group when WORLD_SIZE > 1 (gloo on CPU, NCCL on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("training.device = 'cuda' but CUDA is not available here; use 'auto' or 'cpu'")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    return DistInfo(rank, world, local_rank, device)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
