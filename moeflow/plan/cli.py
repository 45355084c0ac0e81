"""`moeflow plan`: rank parallel layouts for a model on a cluster, with reasons.

`main(argv)` is what `moeflow plan ...` calls (argv after the word 'plan'); also `python -m moeflow.plan.cli`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moeflow.core.hardware import GPUS, get_gpu
from moeflow.core.model_config import ModelConfig, MoEConfig
from moeflow.core.presets import get_preset
from moeflow.plan.advice import advise
from moeflow.plan.layout import Job
from moeflow.plan.search import Constraints, search, shortfall_message

ASSUMPTIONS = [
    "matmuls on the roofline at the GPU's measured large-matmul efficiency (MAMF), flash attention at 50% of "
    "peak, norms/activations/permutes at HBM bandwidth; kernels at KERNEL_EFFICIENCY of those rates "
    "(calibrated, moeflow.plan.compute)",
    "pipeline bubble of the schedule (1F1B, interleaved, zero-bubble, DualPipeV) from its published formula",
    "TP and PP point-to-point communication are not overlapped with compute; EP overlaps inside the MoE layer as "
    "the trainer does it (--ep-chunks, two engines: moeflow.plan.overlap), or behind another micro-batch with "
    "--ep-overlap (DualPipe)",
    "DP/ZeRO communication overlaps compute (not other communication); only the excess is exposed",
    "EP traffic from uniform routing with per-rank dedup inside a node, per-node dedup across nodes",
    "bf16 weights and grads, fp32 AdamW state (16 bytes/param before sharding); fp8/mxfp8 change only the FLOP/s "
    "of the matmuls training.fp8 converts (dense, attention and expert projections); EP traffic stays bf16",
    "ZeRO-Offload only when nothing fits on the devices: parallel.offload = 'optimizer' (the optimizer's state on "
    "the host, gradients and weights or Muon's updates copied once per step) or 'params' (the ZeRO-3 shards on the "
    "host, copied per micro-batch), the PCIe copies not overlapped, the host's optimizer step at its memory "
    "bandwidth (Muon's Newton-Schulz on the device)",
    "AdamW's optimizer step and data loading time not modelled; --optimizer muon adds Muon's Newton-Schulz FLOPs "
    "and whole-matrix gathers after backward, not overlapped, and its 8 bytes/param of state for the block "
    "matrices (moeflow.plan.optimizer)",
]


def load_model(spec: str) -> ModelConfig:
    """A preset name, a moeflow TOML ([model] and [model.moe] tables) or a Hugging Face config.json."""
    if spec.endswith(".json"):
        import json

        from moeflow.core.hf_arch import config_from_hf  # the loader's exact mapping (no torch)

        if not os.path.exists(spec):
            raise ValueError(f"--model {spec!r}: no such file; pass an existing config.json or a preset name")
        with open(spec) as f:
            cfg = config_from_hf(json.load(f))
        cfg.name = spec
        return cfg
    if spec.endswith(".toml"):
        import tomllib

        if not os.path.exists(spec):
            raise ValueError(f"--model {spec!r}: no such file; pass an existing TOML or a preset name")
        with open(spec, "rb") as f:
            data = tomllib.load(f)
        table = dict(data.get("model", data))
        if "name" in table and len(table) == 1:
            return get_preset(table["name"])
        moe = MoEConfig(**table.pop("moe")) if "moe" in table else MoEConfig(num_experts=0)
        try:
            return ModelConfig(**table, moe=moe).validate()
        except TypeError as e:
            raise ValueError(f"--model {spec!r}: {e}; use ModelConfig field names in [model]") from None
    return get_preset(spec)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moeflow plan",
        description="Predict memory and step time of every parallel layout (dp_replicate, dp_shard, tp, pp, "
        "ep, ZeRO stage, micro-batch, activation checkpointing) and rank them by tokens/s per GPU.",
    )
    p.add_argument("--model", required=True,
                   help="preset name (e.g. deepseek-v3, llama3-8b), a moeflow TOML with a [model] table, or a "
                   "Hugging Face config.json (llama, qwen3, qwen3_moe, mixtral, olmoe, deepseek_v3, glm4_moe)")
    p.add_argument("--gpu", help=f"accelerator type: {', '.join(GPUS)} (required unless --calibrate)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--global-batch-tokens", type=int, default=4 * 1024 * 1024,
                   help="tokens per optimizer step across the cluster, a multiple of --seq-len (default 4Mi)")
    p.add_argument("--precision", choices=["bf16", "fp8", "mxfp8"], default="bf16",
                   help="matmul precision, as training.fp8 runs it: fp8/mxfp8 time the dense, attention and expert "
                        "matmuls at the fp8 peak and the router, output head and attention scores at bf16 "
                        "(default bf16)")
    p.add_argument("--intra-gbps", type=float, help="override the intra-node GB/s per GPU per direction")
    p.add_argument("--inter-gbps", type=float, help="override the inter-node GB/s per GPU per direction")
    p.add_argument("--efficiency", type=float,
                   help="override the fraction of peak FLOP/s the largest matmuls reach (0-1]; default: the GPU's "
                   "measured one (moeflow.core.hardware)")
    for dim in ("tp", "pp", "ep", "zero"):
        p.add_argument(f"--{dim}", type=int, help=f"pin {dim} to this value instead of searching it")
    p.add_argument("--pp-schedule", help="pin the pipeline schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "
                   "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) instead of searching 1F1B, Interleaved1F1B, "
                   "InterleavedZeroBubble, ZBVZeroBubble and DualPipeV")
    p.add_argument("--cp", type=int, help="plan context parallelism of this size (default 1: not searched)")
    p.add_argument("--ep-chunks", type=int, default=1,
                   help="the trainer's expert-parallel overlap inside the MoE layer: its parallel.ep_overlap_chunks "
                   "(default 1: the first dispatch behind the shared experts); 0 for parallel.ep_overlap=false")
    p.add_argument("--ep-static", action="store_true",
                   help="cost the trainer's static EP receive sizes (parallel.ep_num_worst_tokens=-1): no host sync "
                   "for each dispatch's counts, so chunks overlap fully")
    p.add_argument("--ep-overlap", action="store_true",
                   help="cost expert-parallel dispatch/combine as overlapped with another micro-batch's compute, "
                   "hidden up to that compute (DualPipe; the trainer does not run it: use it to model runs that do)")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="the trainer's training.optimizer: muon adds its Newton-Schulz FLOPs, its gathers of whole "
                   "matrices and its state (one fp32 momentum instead of AdamW's two moments) to every layout "
                   "(default adamw)")
    p.add_argument("--ns-steps", type=int, default=5, help="Muon's Newton-Schulz iterations, training.muon_ns_steps "
                   "(default 5)")
    p.add_argument("--top", type=int, default=5, help="feasible layouts to show (default 5)")
    p.add_argument("--infeasible", type=int, default=3, help="close infeasible layouts to show (default 3)")
    p.add_argument("--json", action="store_true", help="print JSON (key 'layouts') instead of a table")
    p.add_argument("--png", help="write a chart of the top layouts' throughput and memory to this path")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (matmul FLOP/s, 2-process gloo all-reduce) and plan for a "
                   "'cpu-calibrated' device; --gpus-per-node then counts processes")
    return p


def plan(job: Job, cons: Constraints | None = None, top: int = 5, infeasible: int = 3) -> dict:
    """Search and summarise; ValueError when nothing fits (with the memory shortfall)."""
    results = search(job, cons)
    ok = [r for r in results if r.feasible]
    if not ok:
        raise ValueError(shortfall_message(job, results))
    bad = [r for r in results if not r.feasible and r.time][:infeasible]
    adv = advise(job, ok[0])
    cfg = job.model
    return {
        "job": {"model": cfg.name, "params": cfg.num_params(), "active_params": cfg.num_active_params(),
                "gpu": job.gpu.name, "nodes": job.nodes, "gpus_per_node": job.gpus_per_node,
                "seq_len": job.seq_len, "global_batch_tokens": job.global_batch_tokens,
                "precision": job.precision, "optimizer": job.optimizer},
        "hardware": {"memory_gb": job.gpu.memory_gb, "peak_tflops": job.gpu.peak_flops(job.precision) / 1e12,
                     "matmul_efficiency": job.gpu.matmul_fraction(job.precision), "hbm_gbps": job.gpu.hbm_gbps,
                     "intra_gbps": job.intra, "inter_gbps": job.inter, "ep_overlap": job.ep_overlap,
                     "ep_chunks": job.ep_chunks, "ep_static_sizes": job.ep_static_sizes, "source": job.gpu.source},
        "searched": job.stats.cache.get("searched", len(results)),
        "feasible": len(ok),
        "layouts": [r.as_dict() for r in ok[:top] + bad],
        "recommendation": {"family": adv.family, "tools": adv.tools, "text": adv.text},
        "assumptions": ASSUMPTIONS,
    }


def format_table(out: dict) -> str:
    j = out["job"]
    sw = max([8] + [len(r["schedule"]) for r in out["layouts"]])  # the schedule column's width
    cp_head = f"{'cp':>3} " if any(r.get("cp", 1) > 1 for r in out["layouts"]) else ""  # only when planned
    lines = [
        f"{j['model']} ({j['params'] / 1e9:.1f}B total, {j['active_params'] / 1e9:.1f}B active) on "
        f"{j['nodes']}x{j['gpus_per_node']} {j['gpu']}, seq {j['seq_len']}, {j['global_batch_tokens']} tokens/step, "
        f"{j['precision']}, {j.get('optimizer', 'adamw')}; {out['searched']} layouts searched, {out['feasible']} fit",
        "",
        f"{'#':>3} {'dp_rep':>6} {'dp_sh':>5} {'tp':>3} {'pp':>3} {'schedule':>{sw}} {'ep':>4} {cp_head}{'zero':>4} "
        f"{'mb':>3} {'ac':>5} {'mem GB':>7} "
        f"{'(p/g/o/act)':>22} {'tok/s/GPU':>10} {'MFU':>5} {'step s':>7} {'bubble':>6}",
    ]
    for i, r in enumerate(out["layouts"]):
        m, t = r["memory_gb"], r["time_s"]
        parts = f"{m['params']:.1f}/{m['grads']:.1f}/{m['optimizer']:.1f}/{m['activations']:.1f}"
        mark = f"{i + 1:>3}" if r["feasible"] else "  x"
        cp_cell = f"{r.get('cp', 1):>3} " if cp_head else ""
        lines.append(
            f"{mark} {r['dp_replicate']:>6} {r['dp_shard']:>5} {r['tp']:>3} {r['pp']:>3} {r['schedule']:>{sw}} "
            f"{r['ep']:>4} {cp_cell}{r['zero']:>4} {r['micro_batch']:>3} {r['activation_checkpointing']:>5} "
            f"{m['total']:>7.1f} "
            f"{parts:>22} {r['tokens_per_s_per_gpu']:>10.0f} {r['mfu']:>5.1%} {t.get('step_s', 0):>7.2f} "
            f"{t.get('bubble_fraction', 0):>6.1%}"
        )
        if r.get("offload", "none") != "none":
            lines.append(f"      offload: {m['host']:.1f} GB per GPU in host memory "
                         f"(parallel.offload = '{r['offload']}'), "
                         f"{t.get('offload_s', 0):.2f} s of the step in PCIe copies and the host's optimizer step")
        if not r["feasible"]:
            lines.append(f"      infeasible: {r['reason']}")
    lines += ["", "Recommendation: " + out["recommendation"]["text"], "",
              "Assumptions: " + "; ".join(out["assumptions"]) + "."]
    return "\n".join(lines)


def write_png(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    rows = out["layouts"]
    labels = [f"tp{r['tp']} pp{r['pp']} ep{r['ep']} z{r['zero']}\nmb{r['micro_batch']} {r['activation_checkpointing']}"
              + ("" if r["pp"] == 1 else f"\n{r['schedule']}") for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = ["tab:blue" if r["feasible"] else "tab:gray" for r in rows]
    ax1.bar(range(len(rows)), [r["tokens_per_s_per_gpu"] for r in rows], color=colors)
    ax1.set_ylabel("tokens/s per GPU (gray: does not fit)")
    bottom = [0.0] * len(rows)
    for part in ("params", "grads", "optimizer", "optimizer_step", "activations", "ep_buffers", "zero3_gather",
                 "reserved"):
        vals = [r["memory_gb"][part] for r in rows]
        ax2.bar(range(len(rows)), vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.axhline(out["hardware"]["memory_gb"], color="k", ls="--", label="GPU memory")
    ax2.set_ylabel("GB per GPU")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=60)
    j = out["job"]
    fig.suptitle(f"moeflow plan: {j['model']} on {j['nodes']}x{j['gpus_per_node']} {j['gpu']}")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_model(args.model)
        if args.calibrate:
            from moeflow.plan.calibrate import calibrate

            gpu = calibrate(args.gpus_per_node)
        elif not args.gpu:
            raise ValueError(f"--gpu is required (one of {', '.join(GPUS)}), or pass --calibrate")
        else:
            gpu = get_gpu(args.gpu)
        if args.efficiency is not None:
            if not 0 < args.efficiency <= 1:
                raise ValueError(f"--efficiency ({args.efficiency}) must be in (0, 1]; e.g. 0.7")
            from dataclasses import replace

            gpu = replace(gpu, matmul_efficiency=args.efficiency, fp8_matmul_efficiency=args.efficiency)
        job = Job(cfg, gpu, args.nodes, args.gpus_per_node, args.seq_len, args.global_batch_tokens,
                  args.precision, args.intra_gbps, args.inter_gbps, ep_overlap=args.ep_overlap,
                  ep_chunks=args.ep_chunks, ep_static_sizes=args.ep_static, optimizer=args.optimizer,
                  ns_steps=args.ns_steps)
        cons = Constraints(args.tp, args.pp, args.ep, args.zero, args.pp_schedule, args.cp)
        out = plan(job, cons, args.top, args.infeasible)
    except ValueError as e:
        print(f"moeflow plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=1) if args.json else format_table(out))
    if args.png:
        from moeflow.core.figures import write_png_option

        if not write_png_option(write_png, out, args.png, "moeflow plan"):
            return 2
        if not args.json:
            print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
