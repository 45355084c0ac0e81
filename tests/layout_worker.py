"""Train several parallel layouts inside one launch of `world` gloo processes (start-up dominates here).

Each case is (name, argv overrides, run_dir, resume): the worker calls the real trainer, which writes
metrics.jsonl and a checkpoint to run_dir; the test compares both against a single-process run.
"""

from __future__ import annotations

import os

import torch.distributed as dist


def launch(world: int, cases: list[tuple[str, list[str], str, bool]]) -> dict[str, str]:
    """Run the cases on `world` processes; -> {case name: 'ok' or the first rank's traceback}."""
    from tests.dist_harness import launch as harness_launch

    # A short collective timeout: a case that fails on one rank leaves its peers waiting until it expires.
    results = harness_launch(world, cases, _run_case, setup=_trainer_env, timeout_s=180)  # 8 ranks share 2 cores
    merged = {}
    for name, *_ in cases:
        bad = [r.get(name, "not run (an earlier case failed)") for r in results if r.get(name) != "ok"]
        # The rank that failed first explains it; its peers only report the broken connection.
        bad.sort(key=lambda tb: ("Connection closed" in tb or "not run" in tb, len(tb)))
        merged[name] = bad[0] if bad else "ok"
    return merged


def _trainer_env(rank: int, world: int) -> None:
    """The environment torchrun would give the trainer."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world)})


def _run_case(_, case) -> None:
    from moeflow.config import load_config, parse_overrides
    from moeflow.train.trainer import train

    name, argv, run_dir, resume = case
    cfg = load_config(None, {**parse_overrides(argv), "run_dir": run_dir})
    train(cfg, resume=resume, fresh=not resume, progress=False)
    dist.barrier()
