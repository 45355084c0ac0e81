"""The expert-parallel MoE layer with communication overlap: on vs off, 1/2/4 chunks, against one process.

    .venv/bin/python bench/ep_overlap.py            # EP=2, EP=4 and 8 ranks as 2 nodes x 4
    .venv/bin/python bench/ep_overlap.py --quick    # EP=2 only, fewer repeats

Shape (per rank): T=1024 tokens, E=16 experts, top-4, D=F=256, fp32, one thread per rank, gloo. The baseline,
measured in the same run: moeflow's MoE block in one process on 1024 tokens with all 16 experts -- the same
expert work each EP rank does (every rank computes T*K = 4096 rows on average), so the EP layer's excess over it
is its communication and bookkeeping. Per case: the median time of forward + backward on each rank (the
slowest rank's median is reported), and, with overlap off, the time the same step spends in dispatch + combine
(timed alone) and in the rest. At the end, what the same schedule gives on GPUs, where communication has an
engine of its own: moeflow.plan.overlap's two-engine model of the layer with moeflow.plan's H800 / H100 rates and
links, for this shape and for DeepSeek-V3's and Qwen3-30B-A3B's MoE layers (`--project-only`: only that).
Writes bench/out/ep_overlap.{json,png}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from gloo_workers import init_gloo, report, run_workers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "bench", "out")
sys.path.insert(0, REPO)

T, E, K, D, F = 1024, 16, 4, 256, 256


def make_moe():
    from moeflow.core.model_config import ModelConfig, MoEConfig
    from moeflow.models.moe import MoE

    cfg = ModelConfig(dim=D, moe=MoEConfig(num_experts=E, top_k=K, ffn_dim=F, expert_impl="grouped_mm"))
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    return moe


def step_fn(moe, x, gy):
    def step():
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).backward(gy)
    return step


def timed(fns: dict, repeats: int, barrier=None) -> dict[str, float]:
    """Median ms of each fn, repeats interleaved so that noise falls on every case alike."""
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            if barrier:
                barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def worker(rank: int, world: int, G: int, configs: list, repeats: int, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_gloo(rank, world, tmp)
    from moeflow.parallel.expert import apply_expert_parallel

    base = make_moe()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    gy = torch.randn(T, D, generator=g)
    fns, layers = {}, {}
    for overlap, chunks in configs:
        layer = copy.deepcopy(base)
        apply_expert_parallel(layer, None, backend="auto", ranks_per_node=G, chunks=chunks, overlap=overlap)
        layers[overlap, chunks] = layer
        fns[f"{'on' if overlap else 'off'}/{chunks}"] = step_fn(layer, x, gy)
    # The communication alone: the same routing's dispatch + combine (+ their backward) with the layer's Buffer.
    layer = layers[configs[0]]
    buf = layer.dispatcher.buffer
    with torch.no_grad():
        routed = layer.router(x)
    xc = x.detach().clone().requires_grad_()

    def comm_only():
        recv_x, _, _, _, handle, _ = buf.dispatch(xc, topk_idx=routed.topk_idx, num_experts=E)
        out, _, _ = buf.combine(recv_x, handle)
        out.backward(gy)

    fns["comm"] = comm_only
    result = timed(fns, repeats, barrier=dist.barrier)
    # the slowest rank's median: the step of an EP group is as long as its slowest member's
    values = torch.tensor([result[k] for k in sorted(result)], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    report(rank, tmp, dict(zip(sorted(result), values.tolist())))
    dist.barrier()
    os._exit(0)


def baseline_ms(repeats: int) -> float:
    torch.set_num_threads(1)
    moe = make_moe()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    return timed({"one process": step_fn(moe, x, torch.randn(T, D, generator=g))}, repeats)["one process"]


PROJECTED = [  # (label, model, GPU, nodes, ep): the schedule on GPUs, moeflow.plan's link and compute model
    ("this bench's layer (D=F=256, E=16, top-4), 1024 tok/rank, EP=2", "bench", "H800", 1, 2),
    ("DeepSeek-V3 MoE layer, 4096 tok/rank, EP=8 in one node", "deepseek-v3", "H800", 1, 8),
    ("DeepSeek-V3 MoE layer, 4096 tok/rank, EP=64 over 8 nodes", "deepseek-v3", "H800", 8, 64),
    ("Qwen3-30B-A3B MoE layer, 4096 tok/rank, EP=8 in one node", "qwen3-moe-30b-a3b", "H100-80GB", 1, 8),
]


def gpu_projection() -> list[dict]:
    """The trainer's overlap schedule (moeflow.plan.overlap: communication and compute on engines of their own)
    with moeflow.plan's GPU rates and links: one MoE layer's forward + backward per rank, bf16, uniform routing,
    chunks 0 (overlap off) / 1 / 2 / 4, against its expert compute alone."""
    from moeflow.core.hardware import get_gpu
    from moeflow.core.model_config import ModelConfig, MoEConfig
    from moeflow.core.parallel_dims import ParallelDims
    from moeflow.core.presets import get_preset
    from moeflow.plan.layout import Job, Layout
    from moeflow.plan.time import moe_layer_projection

    out = []
    for label, model, gpu, nodes, ep in PROJECTED:
        cfg = (ModelConfig(dim=D, n_layers=1, moe=MoEConfig(num_experts=E, top_k=K, ffn_dim=F)) if model == "bench"
               else get_preset(model))
        seq = T if model == "bench" else 4096
        lay = Layout(ParallelDims(8 * nodes, ep=ep, zero=3), 1, "none")
        for static in (False, True):  # parallel.ep_num_worst_tokens 0 (a host sync per dispatch) or -1
            job = Job(cfg, get_gpu(gpu), nodes, 8, seq, seq * 8 * nodes, ep_static_sizes=static)
            rows = [moe_layer_projection(job, lay, chunks) for chunks in (0, 1, 2, 4)]
            out.append({"case": label, "sizes": "static" if static else "exact", "gpu": gpu, "ep": ep,
                        "compute_ms": rows[0]["compute_s"] * 1e3,
                        "layer_ms": {r["chunks"]: r["layer_s"] * 1e3 for r in rows},
                        "ratio": {r["chunks"]: r["layer_s"] / r["compute_s"] for r in rows}})
    return out


def print_projection(proj: list[dict]) -> None:
    print("\nthe same schedule on GPUs (moeflow.plan.overlap; layer fwd+bwd / its expert compute alone):")
    print(f"{'case':<62} {'sizes':<6} {'gpu':<9} {'compute ms':>10} {'off':>6} {'c=1':>6} {'c=2':>6} {'c=4':>6}")
    for p in proj:
        r = p["ratio"]
        print(f"{p['case']:<62} {p['sizes']:<6} {p['gpu']:<9} {p['compute_ms']:>10.3f} {r[0]:>5.2f}x {r[1]:>5.2f}x "
              f"{r[2]:>5.2f}x {r[4]:>5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--project-only", action="store_true", help="print the GPU projection only (no processes)")
    args = parser.parse_args()
    if args.project_only:
        print_projection(gpu_projection())
        return
    repeats = 5 if args.quick else 15
    worlds = [(2, 2)] if args.quick else [(2, 2), (4, 4), (8, 4)]
    configs = [(False, 1), (True, 1), (False, 2), (True, 2), (False, 4), (True, 4)]
    base = baseline_ms(repeats)
    flops = 6 * T * K * 3 * D * F  # the experts' matmuls, forward + backward
    cpu_flops = flops / (base * 1e-3)
    rows, results = [], {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                         "torch": torch.__version__, "baseline_ms": base, "worlds": {}}
    print(f"one process, 1024 tokens, 16 experts: {base:.1f} ms fwd+bwd ({cpu_flops / 1e9:.1f} GFLOP/s)")
    print(f"{'ranks':>5} {'nodes':>5} {'overlap':>7} {'chunks':>6} {'ms/rank':>8} {'vs 1 process':>12}")
    for world, G in worlds:
        res = run_workers(worker, world, G, configs, repeats)
        results["worlds"][f"{world}x{G}"] = res
        for overlap, chunks in configs:
            ms = res[f"{'on' if overlap else 'off'}/{chunks}"]
            rows.append((world, world // G, overlap, chunks, ms, ms / base))
            print(f"{world:>5} {world // G:>5} {'on' if overlap else 'off':>7} {chunks:>6} {ms:>8.1f} "
                  f"{ms / base:>11.2f}x")
        comm = res["comm"]
        print(f"{world:>5} {world // G:>5}   communication alone (dispatch + combine + their backward): "
              f"{comm:.1f} ms; compute and the rest: {res['off/1'] - comm:.1f} ms")
    proj = gpu_projection()
    results["gpu_projection"] = proj
    print_projection(proj)
    results["rows"] = rows
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "ep_overlap.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{w}r {'on' if o else 'off'} c{c}" for w, _, o, c, _, _ in rows]
    ax.bar(range(len(rows)), [r[5] for r in rows], color=["tab:blue" if r[2] else "tab:gray" for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=70, fontsize=7)
    ax.set_ylabel("EP layer / one-process block")
    ax.set_title("EP MoE layer fwd+bwd per rank (gloo, CPU), overlap on (blue) / off (grey)")
    save_figure(fig, os.path.join(OUT, "ep_overlap.png"))
    print(f"wrote {OUT}/ep_overlap.json and ep_overlap.png")


if __name__ == "__main__":
    main()
