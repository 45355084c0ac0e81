"""Does `moeflow plan --calibrate` rank layouts the way this machine does?

What is measured, in one CPU process: one optimizer-free training step (forward + backward with gradient
accumulation over micro-batches) of a small dense moeflow Transformer, for a fixed global batch, at
micro-batch 1/2/4/8 and activation checkpointing none/full (full = torch.utils.checkpoint around each
block). What is predicted: moeflow.plan.time.step_time for the same layouts (dp=tp=pp=ep=1) on the
'cpu-calibrated' device that moeflow.plan.calibrate measures first (matmul FLOP/s at two sizes, gloo
all-reduce bandwidth between 2 processes). Reported: both throughputs and their Spearman rank
correlation (the target: >= 0.8 over >= 4 layouts).

The correlation covers these one-process layouts only. Multi-rank layouts (dp, tp, pp, ep) do run here
(bench/train.py measures them), but their ranks share this machine's two cores, so their step times measure
oversubscription, which the planner (one device per rank) does not model; ranking them against its
predictions would test the machine, not the planner.

    OMP_NUM_THREADS=1 .venv/bin/python bench/plan_vs_measured.py [--repeats 5] [--out bench/results]

Writes bench/out/plan_vs_measured.json and .png (--out DIR elsewhere; bench/results holds the published run
that README.md quotes). Shape suffixes: B batch, S sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from moeflow.core.model_config import ModelConfig
from moeflow.core.parallel_dims import ParallelDims
from moeflow.models.transformer import Transformer
from moeflow.plan.calibrate import calibrate
from moeflow.plan.layout import Job, Layout
from moeflow.plan.time import step_time

OUT = Path(__file__).resolve().parent / "out"
CFG = ModelConfig(name="bench-dense", vocab_size=512, dim=256, n_layers=4, n_heads=4, ffn_dim=768, max_seq_len=128)
SEQ, GLOBAL_SEQS = 128, 8
LAYOUTS = [(mb, ac) for mb in (1, 2, 4, 8) for ac in ("none", "full")]


def forward(model: Transformer, tokens_BS: torch.Tensor, ac: str) -> torch.Tensor:
    h_BSD = model.tok_embeddings(tokens_BS)
    cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
    for block in model.layers.values():
        h_BSD = checkpoint(block, h_BSD, cos, sin, use_reentrant=False) if ac == "full" else block(h_BSD, cos, sin)
    return model.output(model.norm(h_BSD))


def train_step(model: Transformer, data_BS: torch.Tensor, mb: int, ac: str) -> float:
    t0 = time.perf_counter()
    for i in range(0, GLOBAL_SEQS, mb):
        tokens_BS = data_BS[i:i + mb]
        logits = forward(model, tokens_BS, ac)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens_BS.flatten())
        loss.backward()
    return time.perf_counter() - t0


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):  # average ranks over ties
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=OUT, help="folder for the JSON and PNG")
    args = ap.parse_args()
    out = args.out
    cpu = platform.processor() or platform.machine()
    print(f"python {platform.python_version()}, torch {torch.__version__}, {cpu}, threads {torch.get_num_threads()}")
    gpu = calibrate(gpus_per_node=1)
    print(f"calibrated: peak {gpu.bf16_tflops * 1e3:.1f} GFLOP/s, half-efficiency at {gpu.half_tokens:.0f} tokens, "
          f"all-reduce {gpu.intra_gbps:.2f} GB/s ({gpu.source})")

    torch.manual_seed(0)
    model = Transformer(CFG)
    data_BS = torch.randint(0, CFG.vocab_size, (GLOBAL_SEQS, SEQ))
    times: dict[tuple, list[float]] = {lay: [] for lay in LAYOUTS}
    for lay in LAYOUTS:  # warm-up
        train_step(model, data_BS, *lay)
    for _ in range(args.repeats):
        order = LAYOUTS[:]
        random.shuffle(order)  # interleave so noise from other processes falls on every case alike
        for lay in order:
            times[lay].append(train_step(model, data_BS, *lay))
        model.zero_grad(set_to_none=True)

    job = Job(CFG, gpu, 1, 1, SEQ, GLOBAL_SEQS * SEQ)
    rows = []
    print(f"\n{'micro_batch':>11} {'ac':>5} {'measured tok/s':>15} {'predicted tok/s':>16}")
    for mb, ac in LAYOUTS:
        measured = GLOBAL_SEQS * SEQ / statistics.median(times[mb, ac])
        pred = step_time(job, Layout(ParallelDims(1, zero=1), mb, ac))["tokens_per_s_per_gpu"]
        rows.append({"micro_batch": mb, "activation_checkpointing": ac, "measured_tokens_per_s": measured,
                     "predicted_tokens_per_s": pred})
        print(f"{mb:>11} {ac:>5} {measured:>15.0f} {pred:>16.0f}")
    rho = spearman([r["measured_tokens_per_s"] for r in rows], [r["predicted_tokens_per_s"] for r in rows])
    print(f"\nSpearman(predicted, measured) over {len(rows)} layouts = {rho:.2f} (target >= 0.8)")
    print("measured: single-process forward+backward of a 4-layer dense moeflow Transformer (no optimizer step); "
          "the correlation covers these one-process layouts only (multi-rank layouts share this machine's cores: "
          "bench/train.py measures them)")

    out.mkdir(parents=True, exist_ok=True)
    result = {"spearman": rho, "layouts": "one process: micro-batch x activation checkpointing", "rows": rows,
              "model": CFG.name, "seq_len": SEQ, "global_seqs": GLOBAL_SEQS,
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "cpu": cpu,
                          "python": platform.python_version()},
              "calibrated": {"peak_gflops": gpu.bf16_tflops * 1e3, "half_tokens": gpu.half_tokens,
                             "allreduce_gbps": gpu.intra_gbps, "source": gpu.source},
              "torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats}
    (out / "plan_vs_measured.json").write_text(json.dumps(result, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    for r in rows:
        ax.scatter(r["predicted_tokens_per_s"], r["measured_tokens_per_s"],
                   marker="o" if r["activation_checkpointing"] == "none" else "s", color="tab:blue")
        ax.annotate(f"mb{r['micro_batch']} {r['activation_checkpointing']}",
                    (r["predicted_tokens_per_s"], r["measured_tokens_per_s"]), fontsize=7)
    ax.set_xlabel("predicted tokens/s (plan, calibrated)")
    ax.set_ylabel("measured tokens/s")
    ax.set_title(f"plan vs measured on this CPU: Spearman {rho:.2f}")
    save_figure(fig, out / "plan_vs_measured.png")
    print(f"wrote {out / 'plan_vs_measured.json'} and .png")


if __name__ == "__main__":
    main()
