"""What the multi-process benchmarks share: local processes in one gloo group, and rank 0's result as JSON.

A benchmark's worker has the signature worker(rank, world, *args, tmp): it calls `init_gloo(rank, world, tmp)`,
measures, and `report(rank, tmp, result)`; the driver calls `run_workers(worker, world, *args)` and gets the
result back. `tmp` is a fresh directory the ranks share (the group's rendezvous file, run directories).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch.distributed as dist


def run_workers(worker, world: int, *args, tmp_dir: str | None = None):
    """Run worker(rank, world, *args, tmp) on `world` spawned processes; return what rank 0 reported."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(dir=tmp_dir) as tmp:
        mp.spawn(worker, args=(world, *args, tmp), nprocs=world, join=True)
        with open(os.path.join(tmp, "result.json")) as fh:
            return json.load(fh)


def init_gloo(rank: int, world: int, tmp: str) -> None:
    """One gloo process group over the `world` local processes, met through a file in `tmp`."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)


def report(rank: int, tmp: str, result) -> None:
    """Rank 0's result (JSON-serialisable) for run_workers to return."""
    if rank == 0:
        with open(os.path.join(tmp, "result.json"), "w") as fh:
            json.dump(result, fh)
