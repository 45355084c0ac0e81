"""Train several parallel layouts inside one launch of `world` gloo processes (start-up dominates here).

Each case is (name, argv overrides, run_dir, resume): the worker calls the real trainer, which writes
metrics.jsonl and a checkpoint to run_dir; the test compares both against a single-process run.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist


def launch(world: int, cases: list[tuple[str, list[str], str, bool]]) -> dict[str, str]:
    """Run the cases on `world` processes; -> {case name: 'ok' or the first rank's traceback}."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, cases, tmp), nprocs=world, join=True)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    merged = {}
    for name, *_ in cases:
        bad = [r.get(name, "not run (an earlier case failed)") for r in results if r.get(name) != "ok"]
        # The rank that failed first explains it; its peers only report the broken connection.
        bad.sort(key=lambda tb: ("Connection closed" in tb or "not run" in tb, len(tb)))
        merged[name] = bad[0] if bad else "ok"
    return merged


def _worker(rank: int, world: int, cases, tmp: str) -> None:
    os.environ.update({"OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    # A short timeout: a case that fails on one rank leaves its peers in a collective until it expires.
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    if os.environ.get("FH"):  # FH=seconds: dump every rank's stack to /tmp/fhR.txt after that long (hangs)
        import faulthandler

        faulthandler.dump_traceback_later(int(os.environ["FH"]), file=open(f"/tmp/fh{rank}.txt", "w"))
    from moeflow.config import load_config, parse_overrides
    from moeflow.train.trainer import train

    results = {}
    for name, argv, run_dir, resume in cases:
        try:
            cfg = load_config(None, {**parse_overrides(argv), "run_dir": run_dir})
            train(cfg, resume=resume, fresh=not resume, progress=False)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            break  # peers may wait in a collective this rank skipped: stop rather than cascade
        dist.barrier()
    torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
    os._exit(0)  # no destroy_process_group: after a failed case a peer may hold an unmatched collective
