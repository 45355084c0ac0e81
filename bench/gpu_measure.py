"""The GPU measurement, run once the smoke test passes: the MoE block at a realistic shape, one-GPU training MFU,
FP8 against bf16. Run through bench/gpu_measure.sh.

    bash bench/gpu_measure.sh --out DIR                  # one GPU, under 7 minutes
    python bench/gpu_measure.py --device cpu --out DIR   # the same parts at toy sizes (how the script is tested)

Parts, each a child process with its own time limit, so that one that fails or runs out of time leaves the others'
figures (DIR/gpu_measure.json is rewritten after each part; DIR/gpu_measure.log holds every part's output):

  moe_layer  bench/moe_layer.py in bf16 at T=8192 tokens, E=64, top-8, D=2048, F=1408 (Qwen3-MoE-30B-A3B's expert
             shape at a smaller width): moeflow's block against the dense matmul floor of the same FLOPs and
             transformers' Qwen3-MoE block (grouped_mm), outputs checked in fp32 first. Targets: moeflow within
             1.5x of the floor, 1.3x faster than transformers. Its fastest moeflow path is what
             moeflow.models.moe.DEFAULT_EXPERT_IMPL["cuda"] should name.
  train      `moeflow train` on one GPU: a Qwen3-MoE-shaped model (24 layers, D=1024, 16 heads of 64, 4 KV heads,
             64 experts of width 192, top-8, Qwen3's vocabulary size; 1.28B parameters, 0.49B active) at sequence
             length 4096, bf16, compiled blocks, 30 steps: tokens/s over the 20 after warm-up, and MFU two ways
             against the device's bf16 dense peak: the trainer's (6 x active matmul parameters + causal attention,
             per token) and 6 x active matmul parameters alone. Target: 35%.
  fp8        bench/fp8.py: tensorwise and rowwise FP8 against bf16, 50 steps from one seed: each step's loss
             difference and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PARTS = ("moe_layer", "train", "fp8")
LIMITS_S = {"moe_layer": 90, "train": 200, "fp8": 110}  # 400 s in all; the train part's first steps compile
MFU_TARGET = 0.35
WARMUP_STEPS = 10  # the first steps compile and fill the allocator's cache; tokens/s is over the steps after them
LOG_EVERY = 5  # metrics (and the routers' statistics, read back to the host) every 5 steps, as a run would log them

MOE_LAYER = {  # bench/moe_layer.py's shape arguments
    "cuda": ["--tokens", "8192", "--experts", "64", "--topk", "8", "--hidden", "2048", "--ffn", "1408",
             "--repeats", "20", "--warmup", "3"],
    "cpu": ["--tokens", "256", "--experts", "8", "--topk", "2", "--hidden", "64", "--ffn", "64", "--quick"],
}
TRAIN = {  # the model and batch of the train part
    "cuda": ["--model.name=qwen3-moe-30b-a3b", "--model.dim=1024", "--model.n_layers=24", "--model.n_heads=16",
             "--model.n_kv_heads=4", "--model.head_dim=64", "--model.moe.num_experts=64", "--model.moe.top_k=8",
             "--model.moe.ffn_dim=192", "--data.seq_len=4096", "--data.max_bytes=4000000",
             "--training.global_batch=8", "--training.micro_batch=2", "--training.steps=30",
             "--training.compile=true"],
    "cpu": ["--model.name=qwen3-moe-30b-a3b", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4",
            "--model.n_kv_heads=2", "--model.head_dim=16", "--model.moe.num_experts=8", "--model.moe.top_k=2",
            "--model.moe.ffn_dim=32", "--model.vocab_size=256", "--data.seq_len=64", "--data.max_bytes=200000",
            "--training.global_batch=4", "--training.micro_batch=2", f"--training.steps={WARMUP_STEPS + 2}"],
}
TRAIN_COMMON = ["--training.dtype=bf16", "--training.lr=6e-4", "--training.warmup_steps=5", "--eval.every=0",
                f"--metrics.log_every={LOG_EVERY}", "--metrics.tensorboard=false", "--checkpoint.enabled=false",
                "--no-progress", "--fresh"]
FP8_STEPS = {"cuda": 50, "cpu": 3}


def run_part(name: str, argv: list[str], log: Path, limit_s: float) -> dict:
    """Run one part as a child process, its output appended to `log` and then echoed; rc 124 when out of time."""
    with log.open("a") as fh:
        fh.write(f"\n===== {name}: {' '.join(argv)}\n")
        fh.flush()
        start, offset = time.perf_counter(), fh.tell()
        try:
            rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    seconds = time.perf_counter() - start
    with log.open(errors="replace") as fh:  # a child killed mid-write may leave half a character
        fh.seek(offset)
        output = fh.read()
    print(output, end="", flush=True)
    last = (output.strip().splitlines() or ["no output"])[-1][:500]
    if rc == 124:
        last = f"out of its {limit_s} s (last line: {last})"
    return {"rc": rc, "seconds": round(seconds, 1), **({"error": last} if rc else {})}


def moe_layer_figures(out: Path) -> dict:
    r = json.loads((out / "moe_layer.json").read_text())
    t = r["targets"]
    return {"shape": r["shape"], "median_ms": r["median_ms"], "moeflow_impl": t["moeflow_impl"],
            "fastest_moeflow_impl": t["fastest_moeflow_impl_by_median"],
            "moeflow_to_dense_floor": t["ratios_of_medians"]["to_dense_floor"],
            "speedup_vs_hf_grouped_mm": t["ratios_of_medians"]["vs_hf_grouped_mm"],
            "target_to_dense_floor": t["target_ratio_to_dense_floor"],
            "target_vs_hf": t["target_speedup_vs_hf_grouped_mm"],
            "met_vs_floor": t["met_vs_floor"], "met_vs_hf": t["met_vs_hf"], "outputs_agree": t["outputs_agree"]}


def train_figures(run_dir: Path, overrides: list[str], device: str) -> dict:
    from moeflow.config import load_config, parse_overrides
    from moeflow.train.metrics import peak_flops_per_device

    model = load_config(None, parse_overrides(overrides)).model
    seq_len = int(next(a for a in overrides if a.startswith("--data.seq_len=")).split("=")[1])
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # the line a child killed at its time limit was writing
            continue
    rows = [r for r in rows if "loss" in r]
    # each logged row's tokens/s is over the steps since the row before: the timed steps are the windows wholly after
    # the warm-up (else the last window), and their tokens over their time is the rate over exactly those steps
    steps = [r["step"] for r in rows]
    windows = [(step - before, r["tokens_per_s"], step) for before, step, r in zip([0, *steps], steps, rows)]
    timed = [(n, rate) for n, rate, step in windows if step - n >= WARMUP_STEPS] or [windows[-1][:2]]
    tokens_per_s = sum(n for n, _ in timed) / sum(n / rate for n, rate in timed)
    peak = peak_flops_per_device(torch.device(device), "bf16")
    flops_6n = model.flops_per_token(0)  # 6 x active matmul parameters (no attention term at sequence length 0)
    out = {"params": model.num_params(), "active_params": model.num_active_params(), "seq_len": seq_len,
           "flops_per_token": model.flops_per_token(seq_len), "flops_per_token_6n": flops_6n,
           "steps": steps[-1], "timed_steps": sum(n for n, _ in timed), "tokens_per_s": tokens_per_s,
           "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"],
           "peak_memory_mb": max(r["peak_memory_mb"] for r in rows),
           "peak_flops": peak, "mfu_target": MFU_TARGET}
    if peak:
        out["mfu"] = tokens_per_s * out["flops_per_token"] / peak
        out["mfu_6n"] = tokens_per_s * flops_6n / peak
        out["met_mfu"] = out["mfu_6n"] >= MFU_TARGET
    return out


def fp8_figures(out: Path) -> dict:
    """Each run's figures against its baseline, or its error (bench/fp8.py writes its JSON after each run)."""
    r = json.loads((out / "fp8.json").read_text())["results"]
    return {name: {k: v[k] for k in ("tokens_per_s", "max_rel", "mean_rel", "speed")} | {
        "first_loss": v["loss"][0], "final_loss": v["loss"][-1]} if "max_rel" in v else
        {"error": v.get("error", "its baseline failed")} for name, v in r.items()}


def summary_lines(parts: dict) -> list[str]:
    lines = []
    for name, p in parts.items():
        f = p.get("figures", {})
        if p["rc"]:
            lines.append(f"{name}: FAILED (rc {p['rc']}, {p['seconds']} s): {p.get('error', '')}")
        if p["rc"] and not f:
            continue
        if name == "moe_layer":
            lines.append(f"moe_layer: {f['moeflow_impl']} {f['moeflow_to_dense_floor']:.2f}x the dense floor (target "
                         f"<= {f['target_to_dense_floor']}x), {f['speedup_vs_hf_grouped_mm']:.2f}x faster than "
                         f"hf[grouped_mm] (target >= {f['target_vs_hf']}x); fastest moeflow path "
                         f"{f['fastest_moeflow_impl']}; outputs agree in fp32: "
                         f"{'not checked' if f['outputs_agree'] is None else f['outputs_agree']}")
        elif name == "train":
            mfu = (f"MFU {f['mfu_6n']:.1%} (6N), {f['mfu']:.1%} (with attention); target {MFU_TARGET:.0%}"
                   if f.get("peak_flops") else "MFU unknown (no peak FLOP/s for this device)")
            lines.append(f"train: {f['steps']} steps, {f['params'] / 1e9:.2f}B parameters "
                         f"({f['active_params'] / 1e9:.2f}B active), {f['tokens_per_s']:,.0f} tokens/s, {mfu}; "
                         f"loss {f['first_loss']:.3f} -> "
                         f"{f['final_loss']:.3f}; peak memory {f['peak_memory_mb'] / 1024:.1f} GiB")
        elif name == "fp8":
            lines.append("fp8: " + "; ".join(f"{k} failed ({v['error']})" if "error" in v else
                                             f"{k} {v['tokens_per_s']:,.0f} tok/s ({v['speed']:.2f}x), max "
                                             f"{v['max_rel']:.2%} from bf16" for k, v in f.items()))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu_measure")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    args = ap.parse_args(argv)
    parts_asked = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in parts_asked if p not in PARTS]:
        ap.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; run it on a GPU, or --device cpu for the parts at toy sizes")
    args.out.mkdir(parents=True, exist_ok=True)
    log, json_path = args.out / "gpu_measure.log", args.out / "gpu_measure.json"
    log.write_text("")
    py, dev = sys.executable, args.device
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
              "python": platform.python_version(), "torch": torch.__version__, "limits_s": LIMITS_S, "parts": {}}
    os.environ.setdefault("OMP_NUM_THREADS", "2")  # the children's
    train_args = [*TRAIN[dev], *TRAIN_COMMON, f"--training.device={dev}"]
    commands = {
        "moe_layer": [py, "bench/moe_layer.py", "--device", dev, "--dtype", "bfloat16", "--no-eager", "--archs", "",
                      "--out", str(args.out), *MOE_LAYER[dev]],
        "train": [py, "-m", "moeflow", "train", *train_args, f"--run-dir={args.out / 'train'}"],
        "fp8": [py, "bench/fp8.py", "--steps", str(FP8_STEPS[dev]), "--out", str(args.out)],
    }
    figures = {"moe_layer": lambda: moe_layer_figures(args.out),
               "train": lambda: train_figures(args.out / "train", TRAIN[dev], dev),
               "fp8": lambda: fp8_figures(args.out)}
    outputs = {"moe_layer": args.out / "moe_layer.json", "train": args.out / "train", "fp8": args.out / "fp8.json"}
    for name in parts_asked:
        # an earlier run's output must not pass for this one's
        shutil.rmtree(outputs[name]) if outputs[name].is_dir() else outputs[name].unlink(missing_ok=True)
        part = run_part(name, commands[name], log, LIMITS_S[name])
        # whatever a part left is read, failed or not: the train part's logged steps when out of time, fp8's
        # finished runs when one of them fails (the figures say how many)
        try:
            part["figures"] = figures[name]()
        except Exception as exc:  # nothing (or too little) to read: the part's own error comes first
            why = f"no figures: {type(exc).__name__}: {exc}"
            part.update(rc=part["rc"] or 1, error=f"{part['error']}; {why}" if part.get("error") else why)
        result["parts"][name] = part
        json_path.write_text(json.dumps(result, indent=1))
    lines = summary_lines(result["parts"])
    with log.open("a") as fh:
        fh.write("\n===== summary\n" + "\n".join(lines) + "\n")
    print("\n" + "\n".join(lines) + f"\nwrote {json_path} and {log}")
    return 1 if any(p["rc"] for p in result["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
