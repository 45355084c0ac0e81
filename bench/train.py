"""Benchmark parallel layouts of the trainer: tokens/s and what each rank holds.

    .venv/bin/python bench/train.py            # layouts on 1, 2 and 4 local gloo processes
    .venv/bin/python bench/train.py --quick    # fewer steps

Per layout: median step time after warm-up (tokens/s of the whole job), and the per-rank bytes of
parameters, gradients and AdamW state measured on the live model (local shards of DTensors; the largest
rank). Baselines measured or computed in the same run: the single-process run (tokens/s, and the full
model's bytes) and the ideal 1/N share of those bytes. On this 2-core machine several ranks share two
cores, so tokens/s shows overheads, not the speed-up a GPU cluster gets; the bytes are what they are
anywhere. Writes bench/out/train.{json,png} (--out DIR elsewhere; bench/results holds the published run that
bench/README.md shows) and prints a table plus the machine and versions.
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

MODEL = ["--model.name=tiny-moe", "--model.n_layers=4", "--data.seq_len=64", "--data.max_bytes=400000",
         "--training.global_batch=8", "--metrics.tensorboard=false", "--eval.every=0"]
LAYOUTS = {
    1: {"1 process": []},
    2: {"dp2 zero1": ["--parallel.zero=1"], "dp2 zero2": ["--parallel.zero=2"], "dp2 zero3": [],
        "ep2": ["--parallel.ep=2"], "tp2": ["--parallel.tp=2"],
        "tp2 moe replicated": ["--parallel.tp=2", "--parallel.ep_over_tp=false"], "pp2 1F1B": ["--parallel.pp=2"],
        "zero1 pp2": ["--parallel.zero=1", "--parallel.pp=2"], "cp2": ["--parallel.cp=2"]},
    4: {"dp4 zero3": [], "hsdp 2x2": ["--parallel.dp_replicate=2"], "ep2 x dp4": ["--parallel.ep=2"],
        "ep4": ["--parallel.ep=4"], "tp2 x dp2": ["--parallel.tp=2"], "pp2 x dp2": ["--parallel.pp=2"],
        "tp2 x pp2": ["--parallel.tp=2", "--parallel.pp=2"], "cp2 x ep2": ["--parallel.cp=2", "--parallel.ep=2"],
        "zero1 pp2 x dp2": ["--parallel.zero=1", "--parallel.pp=2"]},
}


def measure(cfg, info, steps: int, warmup: int) -> dict:
    from moeflow.train.build import build
    from moeflow.train.step import state_bytes, train_step

    s = build(cfg, info, *cfg.layout(info.world_size))
    times = []
    for i in range(warmup + steps):
        dist.barrier() if dist.is_initialized() else None
        t0 = time.perf_counter()
        out = train_step(cfg, s, with_moe_stats=False, measure=i == warmup + steps - 1)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    held = state_bytes(s, out["grad_bytes"])  # the largest rank's, as the trainer's summary reports
    step_s = statistics.median(times)
    return {"step_s": step_s, "tokens_per_s": cfg.training.global_batch * cfg.data.seq_len / step_s,
            "params_bytes": held["params"], "grads_bytes": held["grads"], "optim_bytes": held["optimizer"]}


def _worker(rank: int, world: int, cases: dict, steps: int, warmup: int, tmp: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    if world > 1:  # one process trains as a user's single-process run does: no process group
        init_gloo(rank, world, tmp)
    from moeflow.config import load_config, parse_overrides
    from moeflow.train.distributed import DistInfo

    info = DistInfo(rank, world, rank, torch.device("cpu"))
    out = {}
    for name, extra in cases.items():
        cfg = load_config(None, {**parse_overrides([*MODEL, *extra]), "run_dir": f"{tmp}/{len(out)}"})
        out[name] = measure(cfg, info, steps, warmup)
    report(rank, tmp, out)
    os._exit(0)


def run_world(world: int, cases: dict, steps: int, warmup: int) -> dict:
    return run_workers(_worker, world, cases, steps, warmup)


def write_png(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["layout"] for r in rows]
    state = [(r["params_bytes"] + r["grads_bytes"] + r["optim_bytes"]) / 1e6 for r in rows]
    ideal = [r["ideal_bytes"] / 1e6 for r in rows]
    ax1.bar(names, state, label="measured (largest rank)")
    ax1.plot(names, ideal, "k_", markersize=20, label="ideal total / N")
    ax1.set_ylabel("params + grads + AdamW state per rank (MB)")
    ax1.legend()
    ax2.bar(names, [r["tokens_per_s"] for r in rows])
    ax2.set_ylabel("tokens/s (whole job, 2 shared CPU cores)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 measured steps instead of 6")
    ap.add_argument("--out", default=OUT, help="folder for train.json and train.png (bench/results: the published "
                    "figures)")
    args = ap.parse_args()
    steps, warmup = (2, 1) if args.quick else (6, 2)
    results = {}
    for world, cases in LAYOUTS.items():
        for name, r in run_world(world, cases, steps, warmup).items():
            results[name] = {**r, "world": world}
    base = results["1 process"]
    full_state = base["params_bytes"] + base["grads_bytes"] + base["optim_bytes"]
    rows = []
    for name, r in results.items():
        state = r["params_bytes"] + r["grads_bytes"] + r["optim_bytes"]
        rows.append({"layout": name, **r, "ideal_bytes": full_state / r["world"],
                     "state_over_ideal": state / (full_state / r["world"]),
                     "speed_vs_1_process": r["tokens_per_s"] / base["tokens_per_s"]})
    meta = dict(machine=platform.machine(), cpu_count=os.cpu_count(), python=platform.python_version(),
                torch=torch.__version__, platform=platform.platform(), model=MODEL, steps=steps, warmup=warmup)
    print(f"# {meta['platform']}, {meta['cpu_count']} CPUs, python {meta['python']}, torch {meta['torch']}")
    print(f"# model: {' '.join(MODEL)}")
    print(f"{'layout':<12} {'ranks':>5} {'tok/s':>8} {'vs 1p':>6} {'params MB':>10} {'grads MB':>9} "
          f"{'adam MB':>8} {'ideal MB':>9} {'/ideal':>7}")
    for r in rows:
        print(f"{r['layout']:<12} {r['world']:>5} {r['tokens_per_s']:>8.0f} {r['speed_vs_1_process']:>6.2f} "
              f"{r['params_bytes'] / 1e6:>10.2f} {r['grads_bytes'] / 1e6:>9.2f} {r['optim_bytes'] / 1e6:>8.2f} "
              f"{r['ideal_bytes'] / 1e6:>9.2f} {r['state_over_ideal']:>7.2f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    write_png(rows, os.path.join(args.out, "train.png"))
    print(f"wrote {args.out}/train.json and train.png")


if __name__ == "__main__":
    main()
