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


# NCCL's flight recorder (torch.distributed.flight_recorder): each rank keeps its last collectives in a ring buffer
# and dumps it when a collective times out. Set unless the user set them (a name of either generation).
FLIGHT_RECORDER_ENTRIES = 2000
FLIGHT_RECORDER_FILE = "nccl-trace-rank"  # RUN_DIR/nccl-trace-rank<N>, beside the hang-rank<N>.txt files


def set_flight_recorder_env(run_dir: str | os.PathLike, environ=os.environ) -> None:
    """The flight recorder's environment for an NCCL run writing to `run_dir` (before the process group exists,
    which reads it once). Read a dump with `python -m torch.distributed.flight_recorder.fr_trace
    RUN_DIR --prefix nccl-trace-rank`."""
    wanted = {("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): str(FLIGHT_RECORDER_ENTRIES),
              ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
              ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
                  os.path.join(os.path.abspath(run_dir), FLIGHT_RECORDER_FILE)}
    for names, value in wanted.items():
        if not any(name in environ for name in names):
            environ[names[0]] = value


def init_distributed(device_pref: str = "auto", timeout_s: float = 300, run_dir: str | None = None) -> DistInfo:
    """Join torchrun's process group when WORLD_SIZE > 1 (gloo on CPU, NCCL on CUDA, with its flight recorder
    dumping into `run_dir` on a timeout)."""
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
        _warn_shared_store(rank)
        if use_cuda and run_dir is not None:
            set_flight_recorder_env(run_dir)
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    return DistInfo(rank, world, local_rank, device)


def _warn_shared_store(rank: int) -> None:
    """torchrun agents on several machines share their TCP store with the ranks unless told not to; a rank started
    again after a failure can then read a dead rank's address from the previous attempt and fail to connect or
    hang (pytorch/pytorch#135712). moeflow's own launcher unshares it; a hand-written torchrun line needs it set."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    agents = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if rank == 0 and restarts > 0 and agents > 1 and shared:
        print("moeflow train: torchrun restarts ranks but shares its store with them, so a restarted rank can read "
              "a dead rank's address and hang (pytorch/pytorch#135712); start torchrun with "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment", file=sys.stderr)


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


class SumPacker:
    """Named tensors summed over every rank in one all-reduce and read back in one host sync:
    `packer.add("loss", loss)`, ..., `sums = packer.all_reduce_sum()`, `sums["loss"]`. Every rank must add the
    same names with the same shapes in the same order (the packed tensors are summed element by element)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._parts: dict[str, torch.Tensor] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self._parts:
            raise ValueError(f"SumPacker: {name!r} added twice")
        self._parts[name] = t.detach().float().to(self.device)

    def all_reduce_sum(self) -> Sums:
        packed = all_reduce_sum(torch.cat([t.reshape(-1) for t in self._parts.values()]))
        return Sums(packed, read_after_collective(packed), {name: t.shape for name, t in self._parts.items()})


class Sums:
    """SumPacker's result: each name's sum over the ranks, on the host (`sums[name]`) or the device
    (`sums.on_device(name)`), in the shape it was added with."""

    def __init__(self, packed: torch.Tensor, host: list[float], shapes: dict[str, torch.Size]):
        self._packed, self._host = packed, host
        self._segments: dict[str, tuple[int, torch.Size]] = {}  # name -> (offset into the packed tensor, shape)
        offset = 0
        for name, shape in shapes.items():
            self._segments[name] = (offset, shape)
            offset += shape.numel()

    def __getitem__(self, name: str):
        """A float for a scalar, (nested) lists of floats for the rest."""
        offset, shape = self._segments[name]
        return _nested(self._host[offset:offset + shape.numel()], shape)

    def on_device(self, name: str) -> torch.Tensor:
        """The sum as a tensor where it was reduced (no host copy)."""
        offset, shape = self._segments[name]
        return self._packed[offset:offset + shape.numel()].view(shape)

    def group(self, prefix: str) -> dict:
        """{name after `prefix`: sums[name]} for every name that starts with `prefix`."""
        return {name[len(prefix):]: self[name] for name in self._segments if name.startswith(prefix)}


def _nested(flat: list[float], shape: torch.Size):
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    inner = shape[1:].numel()
    return [_nested(flat[i * inner:(i + 1) * inner], shape[1:]) for i in range(shape[0])]


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
