"""The expert-parallel MoE layer with communication overlap: on vs off, 1/2/4 chunks, against one process.

    .venv/bin/python bench/ep_overlap.py            # EP=2, EP=4 and 8 ranks as 2 nodes x 4
    .venv/bin/python bench/ep_overlap.py --quick    # EP=2 only, fewer repeats

Shape (per rank): T=1024 tokens, E=16 experts, top-4, D=F=256, fp32, one thread per rank, gloo. The baseline,
measured in the same run: moeflow's MoE block in one process on 1024 tokens with all 16 experts -- the same
expert work each EP rank does (every rank computes T*K = 4096 rows on average), so the EP layer's excess over it
is its communication and bookkeeping. Per case: the median time of forward + backward on each rank (the
slowest rank's median is reported), and, with overlap off, the time the same step spends in dispatch + combine
(timed alone) and in the rest. A model at the end: what the same schedule gives when the links are those of an
H800 node (moeflow.hardware; compute at this machine's measured rate scaled to the GPU's), from the measured
split. Writes bench/out/ep_overlap.{json,png}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "bench", "out")
sys.path.insert(0, REPO)

T, E, K, D, F = 1024, 16, 4, 256, 256


def make_moe():
    from moeflow.models.config import ModelConfig, MoEConfig
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
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
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
    if rank == 0:
        with open(f"{tmp}/result.json", "w") as fh:
            json.dump(dict(zip(sorted(result), values.tolist())), fh)
    dist.barrier()
    os._exit(0)


def run_world(world: int, G: int, configs: list, repeats: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, G, configs, repeats, tmp), nprocs=world, join=True)
        with open(f"{tmp}/result.json") as fh:
            return json.load(fh)


def baseline_ms(repeats: int) -> float:
    torch.set_num_threads(1)
    moe = make_moe()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    return timed({"one process": step_fn(moe, x, torch.randn(T, D, generator=g))}, repeats)["one process"]


def gpu_projection(comm_ms: float, compute_ms: float, flops_per_step: float, cpu_flops: float, chunks: int) -> dict:
    """The same schedule on H800s: compute scaled from this machine's measured FLOP/s to the GPU's bf16 peak at
    50% efficiency; communication the bytes of this step over the H800's NVLink (moeflow.hardware)."""
    from moeflow.hardware import get_gpu

    gpu = get_gpu("H800")
    # bytes of dispatch + combine (and their backward: twice) per rank, fp32 rows here, as bf16 on the GPU
    row = D * 2
    sent_rows = T * min(K, 2)  # an upper bound of rows a rank sends per direction at EP=2 (rank dedup)
    comm = 4 * sent_rows * row / (gpu.intra_gbps * 1e9) * 1e3
    compute = flops_per_step / (gpu.bf16_tflops * 1e12 * 0.5) * 1e3
    off = comm + compute
    per = max(compute / chunks, comm / chunks)
    on = comm / chunks + chunks * per  # the first chunk's dispatch, then every chunk's slower half
    return {"comm_ms": comm, "compute_ms": compute, "off_ms": off, "on_ms": min(on, off), "chunks": chunks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
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
        res = run_world(world, G, configs, repeats)
        results["worlds"][f"{world}x{G}"] = res
        for overlap, chunks in configs:
            ms = res[f"{'on' if overlap else 'off'}/{chunks}"]
            rows.append((world, world // G, overlap, chunks, ms, ms / base))
            print(f"{world:>5} {world // G:>5} {'on' if overlap else 'off':>7} {chunks:>6} {ms:>8.1f} "
                  f"{ms / base:>11.2f}x")
        comm = res["comm"]
        print(f"{world:>5} {world // G:>5}   communication alone (dispatch + combine + their backward): "
              f"{comm:.1f} ms; compute and the rest: {res['off/1'] - comm:.1f} ms")
    proj = [gpu_projection(results["worlds"]["2x2"]["comm"], base, flops, cpu_flops, c) for c in (1, 2, 4)]
    results["h800_projection"] = proj
    for p in proj:
        print(f"H800 model, EP=2, {p['chunks']} chunk(s): comm {p['comm_ms']:.3f} ms, compute {p['compute_ms']:.3f} "
              f"ms -> off {p['off_ms']:.3f} ms, overlapped {p['on_ms']:.3f} ms ({p['off_ms'] / p['on_ms']:.2f}x)")
    results["rows"] = rows
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "ep_overlap.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{w}r {'on' if o else 'off'} c{c}" for w, _, o, c, _, _ in rows]
    ax.bar(range(len(rows)), [r[5] for r in rows], color=["tab:blue" if r[2] else "tab:gray" for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=70, fontsize=7)
    ax.set_ylabel("EP layer / one-process block")
    ax.set_title("EP MoE layer fwd+bwd per rank (gloo, CPU), overlap on (blue) / off (grey)")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "ep_overlap.png"), dpi=120)
    print(f"wrote {OUT}/ep_overlap.json and ep_overlap.png")


if __name__ == "__main__":
    main()
