"""Benchmark synchronous against asynchronous checkpoints (checkpoint.async_save): what a save costs the steps.

    .venv/bin/python bench/checkpoint.py              # tiny-moe and a 10x wider one, 1 and 2 ranks
    .venv/bin/python bench/checkpoint.py --quick      # fewer cycles

Per model and rank count, three modes measured in one process group, in blocks of 3 cycles taken in turn: no
checkpoint (the baseline), `CheckpointManager.save` synchronous, and async (torch.distributed.checkpoint.async_save).
A cycle is `--every` training steps with a save after the last; reported are the median time the save call blocks
the step, and the median wall time of a whole cycle, whose excess over the baseline's is what checkpointing costs
the run (an async write runs during the next cycle's steps and competes with them for the CPU; the cycle times
include that, and the next save first waits for the write, as in training). The checkpoints go to a temporary
folder on this machine's disk. Writes bench/out/checkpoint.{json,png} and prints a table plus the machine and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from gloo_workers import init_gloo, report, run_workers

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMON = ["--data.seq_len=128", "--data.max_bytes=400000", "--training.global_batch=8", "--metrics.tensorboard=false",
          "--eval.every=0"]
MODELS = {
    "tiny-moe": ["--model.name=tiny-moe"],
    "tiny-moe x10": ["--model.name=tiny-moe", "--model.dim=512", "--model.ffn_dim=1024", "--model.moe.ffn_dim=512"],
}
MODES = ("none", "sync", "async")


def measure(cfg, info, rounds: int, per_block: int, every: int, tmp: str) -> dict:
    from moeflow.train.build import build
    from moeflow.train.checkpoint import CheckpointManager
    from moeflow.train.step import train_step

    s = build(cfg, info, *cfg.layout(info.world_size))
    managers = {"sync": CheckpointManager(f"{tmp}/sync", 2, info.rank),
                "async": CheckpointManager(f"{tmp}/async", 2, info.rank, async_save=True)}
    for _ in range(3):  # warm-up
        train_step(cfg, s, with_moe_stats=False)
    blocked = {m: [] for m in MODES}
    cycle = {m: [] for m in MODES}
    steps_only = {m: [] for m in MODES}
    step = 0
    for _ in range(rounds):
        for mode in MODES:  # blocks of each mode in turn, so a slow moment of the machine hits every mode alike
            for i in range(per_block):
                if dist.is_initialized():
                    dist.barrier()
                t0 = time.perf_counter()
                for _ in range(every):
                    train_step(cfg, s, with_moe_stats=False)
                    step += 1
                    if mode == "async":
                        managers["async"].poll()
                t1 = time.perf_counter()
                if mode != "none":  # async: waits for the previous write first, as in training
                    extra = {"step": step, "scheduler": s.scheduler.state_dict(), "sampler": s.sampler.state_dict()}
                    managers[mode].save(step, s.model, s.optimizer, extra)
                if mode == "async" and i == per_block - 1:
                    managers["async"].wait()  # the block's last write must not overlap the next mode's block
                t2 = time.perf_counter()
                blocked[mode].append(t2 - t1)
                cycle[mode].append(t2 - t0)
                steps_only[mode].append(t1 - t0)
    nbytes = sum(f.stat().st_size for f in sorted(managers["sync"].complete_checkpoints())[0][1].iterdir())
    return {"checkpoint_mb": nbytes / 2**20, "params_m": cfg.model.num_params() / 1e6,
            **{f"{m}_blocked_ms": 1e3 * statistics.median(blocked[m]) for m in MODES},
            **{f"{m}_steps_ms": 1e3 * statistics.median(steps_only[m]) for m in MODES},
            **{f"{m}_cycle_ms": 1e3 * statistics.median(cycle[m]) for m in MODES}}


def _worker(rank: int, world: int, model: list[str], cycles: int, every: int, tmp: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    if world > 1:  # one process trains as a user's single-process run does: no process group
        init_gloo(rank, world, tmp)
    from moeflow.config import load_config, parse_overrides
    from moeflow.train.distributed import DistInfo

    extra = ["--parallel.ep=2"] if world == 2 else []
    cfg = load_config(None, {**parse_overrides([*COMMON, *model, *extra]), "run_dir": f"{tmp}/run"})
    report(rank, tmp, measure(cfg, DistInfo(rank, world, rank, torch.device("cpu")), cycles // 3, 3, every, tmp))
    os._exit(0)


def run(world: int, model: list[str], cycles: int, every: int) -> dict:
    return run_workers(_worker, world, model, cycles, every, tmp_dir=OUT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--every", type=int, default=5, help="training steps per save")
    args = p.parse_args()
    cycles = 3 if args.quick else 9
    os.makedirs(OUT, exist_ok=True)
    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch "
          f"{torch.__version__}; a save every {args.every} steps, median of {cycles} interleaved cycles")
    rows = []
    for name, model in MODELS.items():
        for world in (1, 2):
            r = run(world, model, cycles, args.every)
            rows.append({"model": name, "ranks": world, **r})
    head = (f"{'model':<13} {'ranks':>5} {'params M':>8} {'ckpt MB':>7} | {'save blocks ms':^15} | "
            f"{str(args.every) + ' steps ms (the write overlaps)':^26} | {'cost per save, ms':^17}")
    print(head + f"\n{'':<13} {'':>5} {'':>8} {'':>7} | {'sync':>7} {'async':>7} | {'none':>8} {'sync':>8} "
          f"{'async':>8} | {'sync':>8} {'async':>8}")
    for r in rows:
        cost = {m: r[f"{m}_cycle_ms"] - r["none_cycle_ms"] for m in ("sync", "async")}
        r["cost_ms_per_save"] = cost
        print(f"{r['model']:<13} {r['ranks']:>5} {r['params_m']:>8.2f} {r['checkpoint_mb']:>7.1f} | "
              f"{r['sync_blocked_ms']:>7.0f} {r['async_blocked_ms']:>7.0f} | {r['none_steps_ms']:>8.0f} "
              f"{r['sync_steps_ms']:>8.0f} {r['async_steps_ms']:>8.0f} | {cost['sync']:>8.0f} {cost['async']:>8.0f}")
    print("cost per save: the median cycle (steps + save) minus the median cycle without a checkpoint")
    with open(os.path.join(OUT, "checkpoint.json"), "w") as fh:
        json.dump({"machine": platform.platform(), "torch": torch.__version__, "every": args.every, "rows": rows},
                  fh, indent=1)
    _plot(rows)
    print(f"wrote {OUT}/checkpoint.json and checkpoint.png")


def _plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['model']}\n{r['ranks']} rank{'s' * (r['ranks'] > 1)}" for r in rows]
    x = range(len(rows))
    for i, (mode, color) in enumerate((("sync", "tab:red"), ("async", "tab:green"))):
        ax.bar([xi + 0.4 * i for xi in x], [r[f"{mode}_blocked_ms"] for r in rows], 0.4, color=color,
               label=f"{mode}: ms the save blocks the step")
    ax.set_xticks([xi + 0.2 for xi in x], labels)
    ax.set_ylabel("ms")
    ax.legend()
    ax.set_title("checkpoint save: time the training step waits")
    save_figure(fig, os.path.join(OUT, "checkpoint.png"))


if __name__ == "__main__":
    main()
