"""FP8 training (training.fp8) against bf16: per-step losses of the real trainer, and the step time, same data and
initial weights, one process.

    .venv/bin/python bench/fp8.py              # tiny-moe and tiny-dense, 50 steps each recipe
    .venv/bin/python bench/fp8.py --steps 10   # a smoke run
    .venv/bin/python bench/fp8.py --max-rel 0.03   # exit status 1 if an FP8 run strays > 3% from bf16 (GPU smoke)

Runs (each from the same seed): tiny-moe in bf16 (autocast, the baseline), in fp32, in MXFP8 (dense, attention
and expert matmuls, the rest fp32: torchao 0.18's MXFP8 ops refuse autocast; emulated on a CPU) and in tensorwise /
rowwise FP8 (under bf16 autocast); tiny-dense in bf16, fp32 and tensorwise / rowwise FP8. A run moeflow refuses on
this machine is left out with training.fp8's reason: the FP8 recipes with routed experts need CUDA (sm90), so on a
CPU an MoE model takes MXFP8 only; MXFP8 needs torch 2.13, and on a GPU Blackwell. Reports the largest and mean
relative difference of each step's loss from the baseline, the final losses, and the median step time (on a CPU
emulation is slower than bf16: it quantises for real, then multiplies in fp32; FP8 pays off only with FP8 tensor
cores). Writes bench/out/fp8.{json,png} (--out DIR elsewhere).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import traceback

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# lr 1e-3 with 10 warm-up steps: at the default 3e-3 the tiny models spike now and then, in bf16 and fp32 alike, and
# the per-step comparison then measures the spikes
COMMON = ["--data.seq_len=128", "--data.max_bytes=400000", "--training.global_batch=8", "--training.lr=1e-3",
          "--training.warmup_steps=10", "--metrics.log_every=1", "--metrics.tensorboard=false", "--eval.every=0",
          "--checkpoint.enabled=false"]
RUNS = {  # name: (model, baseline name, fp8 recipe, training.dtype); those moeflow refuses here are left out
    "tiny-moe bf16": ("tiny-moe", None, "none", "bf16"),
    "tiny-moe fp32": ("tiny-moe", "tiny-moe bf16", "none", "fp32"),
    "tiny-moe mxfp8": ("tiny-moe", "tiny-moe bf16", "mxfp8", "fp32"),
    "tiny-moe tensorwise": ("tiny-moe", "tiny-moe bf16", "tensorwise", "bf16"),
    "tiny-moe rowwise": ("tiny-moe", "tiny-moe bf16", "rowwise", "bf16"),
    "tiny-dense bf16": ("tiny-dense", None, "none", "bf16"),
    "tiny-dense fp32": ("tiny-dense", "tiny-dense bf16", "none", "fp32"),
    "tiny-dense tensorwise": ("tiny-dense", "tiny-dense bf16", "tensorwise", "bf16"),
    "tiny-dense rowwise": ("tiny-dense", "tiny-dense bf16", "rowwise", "bf16"),
}


def runs_here() -> tuple[dict, dict]:
    """(the runs moeflow takes on this machine, {left-out run: why}), by training.fp8's own refusal: on a CPU the
    MoE model takes MXFP8 only (the FP8 grouped GEMM of its experts needs sm90), on a GPU MXFP8 needs Blackwell,
    and MXFP8 needs torch 2.13. Without torchao there is nothing to measure: exit with its line."""
    from moeflow.parallel.fp8 import refusal

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if importlib.util.find_spec("torchao") is None:
        sys.exit(refusal("tensorwise", device, has_experts=False))
    runs, left_out = {}, {}
    for name, (model, base, fp8, dtype) in RUNS.items():
        why = refusal(fp8, device, has_experts=model == "tiny-moe")
        if why:
            left_out[name] = why
        else:
            runs[name] = (model, base, fp8, dtype)
    return runs, left_out


def run(model: str, fp8: str, dtype: str, steps: int, run_dir: str) -> dict:
    from moeflow.config import load_config, parse_overrides
    from moeflow.train.trainer import train

    argv = [*COMMON, f"--model.name={model}", f"--training.fp8={fp8}", f"--training.dtype={dtype}",
            f"--training.steps={steps}"]
    train(load_config(None, {**parse_overrides(argv), "run_dir": run_dir}), fresh=True, progress=False)
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    # tokens_per_s over each logged step (log_every = 1); the first steps warm up
    timed = lines[3:] or lines
    return {"loss": [r["loss"] for r in lines], "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed)}


def write_png(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, model in zip(axes, ("tiny-moe", "tiny-dense")):
        for name, r in results.items():
            if name.startswith(model + " "):
                ax.plot(range(1, len(r["loss"]) + 1), r["loss"], label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(model)
        ax.legend()
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=OUT, help="folder for fp8.json and fp8.png")
    ap.add_argument("--max-rel", type=float, default=None,
                    help="fail (exit status 1) if an FP8 run's loss strays further than this from bf16 at any step")
    args = ap.parse_args()
    torch.set_num_threads(2)
    runs, left_out = runs_here()
    for name, why in left_out.items():
        print(f"# {name}: left out here ({why})")
    import torchao

    meta = dict(machine=platform.machine(), cpu_count=os.cpu_count(), python=platform.python_version(),
                torch=torch.__version__, torchao=torchao.__version__, platform=platform.platform(),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                common=COMMON, steps=args.steps, left_out=left_out)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (model, _, fp8, dtype) in runs.items():
            try:
                results[name] = run(model, fp8, dtype, args.steps, os.path.join(tmp, name.replace(" ", "_")))
            except Exception as e:  # one run that fails leaves the others' figures
                traceback.print_exc()
                results[name] = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
            compare(results, runs)
            with open(os.path.join(args.out, "fp8.json"), "w") as fh:  # after each run: a timeout keeps the rest
                json.dump({"meta": meta, "results": results}, fh, indent=1)
    print(f"# {meta['platform']}, {meta['cpu_count']} CPUs, {meta['device']}, python {meta['python']}, "
          f"torch {meta['torch']}, torchao {meta['torchao']}")
    print(f"# {args.steps} steps, {' '.join(COMMON)}")
    print("| run | first loss | final loss | max rel. diff vs bf16 | mean rel. diff | tokens/s | vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | | | |")
        elif "max_rel" not in r:
            print(f"| {name} | {r['loss'][0]:.4f} | {r['loss'][-1]:.4f} | (its baseline failed) | | "
                  f"{r['tokens_per_s']:,.0f} | |")
        else:
            print(f"| {name} | {r['loss'][0]:.4f} | {r['loss'][-1]:.4f} | {100 * r['max_rel']:.2f}% | "
                  f"{100 * r['mean_rel']:.2f}% | {r['tokens_per_s']:,.0f} | {r['speed']:.2f}x |")
    write_png({k: r for k, r in results.items() if "loss" in r}, os.path.join(args.out, "fp8.png"))
    print(f"wrote {args.out}/fp8.json and fp8.png")
    failed = [n for n, r in results.items() if "max_rel" not in r]
    if failed:
        sys.exit(f"FP8 runs that failed or lost their baseline: {failed}")
    if args.max_rel is not None:
        strays = [n for n, (_, base, fp8, _) in runs.items() if fp8 != "none" and results[n]["max_rel"] > args.max_rel]
        if strays:
            sys.exit(f"FP8 runs further than {args.max_rel:.0%} from bf16: {strays}")


def compare(results: dict, runs: dict) -> None:
    """Each finished run against its baseline: the largest and mean relative loss difference per step, the speed."""
    for name, r in results.items():
        base = runs[name][1]
        if "error" in r:
            continue
        if base is None:
            r.update(max_rel=0.0, mean_rel=0.0, speed=1.0)
        elif base in results and "error" not in results[base]:
            b = results[base]
            rel = [abs(x - y) / y for x, y in zip(r["loss"], b["loss"])]
            r.update(max_rel=max(rel), mean_rel=sum(rel) / len(rel), speed=r["tokens_per_s"] / b["tokens_per_s"])


if __name__ == "__main__":
    main()
