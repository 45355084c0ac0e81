"""Process-group set-up for the trainer: torchrun's environment in, (rank, world, device) out."""

from __future__ import annotations

import datetime
import os
import sys
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


def choose_device(pref: str, local_ranks: int, setting: str = "training.device") -> str:
    """'cuda' or 'cpu' for training.device = `pref` with `local_ranks` processes on this machine. Each rank needs
    a GPU of its own (NCCL refuses two ranks on one), so 'auto' takes CUDA only when there are enough GPUs and
    'cuda' without them is an error here, before any process group exists. Assumes torchrun's convention: every
    process sees all of its machine's GPUs and takes the one at its LOCAL_RANK."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if pref == "cpu":
        return "cpu"
    if pref == "cuda":
        if gpus == 0:
            raise ValueError(f"{setting} = 'cuda' but CUDA is not available here; use 'auto' or 'cpu'")
        if gpus < local_ranks:
            raise ValueError(f"{setting} = 'cuda' with {local_ranks} processes on this machine, which has "
                             f"{gpus} GPU{'s' if gpus > 1 else ''}: each process needs its own; use "
                             f"--nproc-per-node {gpus}, or training.device = 'cpu'")
        return "cuda"
    return "cuda" if 0 < gpus and local_ranks <= gpus else "cpu"


def init_distributed(device_pref: str = "auto", timeout_s: float = 300) -> DistInfo:
    """Join torchrun's process group when WORLD_SIZE > 1 (gloo on CPU, NCCL on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = choose_device(device_pref, local_ranks) == "cuda"
    if not use_cuda and device_pref == "auto" and torch.cuda.is_available() and rank == 0:
        gpus = torch.cuda.device_count()
        print(f"moeflow train: {local_ranks} processes per machine but {gpus} GPU{'s' if gpus > 1 else ''}, so "
              f"training runs on the CPU (training.device = 'auto'); --nproc-per-node {gpus} trains on the GPUs",
              file=sys.stderr)
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


def read_after_collective(t: torch.Tensor) -> list:
    """`t` (the result of a collective) on the host. On NCCL the host waits for the collective here (dist.all_reduce
    only queues it), so a hang report names this frame as the collective the rank waits in (moeflow.train.faults)."""
    return t.tolist()


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
