"""`moeflow simulate ep`: EP bytes and time per dispatch strategy, swept over EP sizes.

`main(argv)` is what `moeflow simulate ...` calls; argv starts with the target word ('ep').
Step model: every GPU runs all layers on --tokens-per-gpu tokens (no pipeline split); compute at
peak * efficiency; EP time is 2 x (dispatch + combine) per MoE layer (forward + backward), not
overlapped with compute, so comm_share = EP / (EP + compute) is an upper bound on what overlap can hide.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from moeflow.core.hardware import GPUS, get_gpu
from moeflow.core.presets import PRESETS, get_preset
from moeflow.sim.ep import STRATEGY_DOC, Links, check_topology, ep_layer_time, row_bytes, sample_copies

DEFAULT_STRATEGIES = ("pair", "rank", "node")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeflow simulate", description="Simulate communication at scale.")
    sub = p.add_subparsers(dest="target", required=True)
    e = sub.add_parser(
        "ep", help="expert-parallel dispatch/combine traffic per strategy and EP size",
        description="Bytes per link class, busiest-link time, EP time per layer and EP share of the step "
        "for each dispatch strategy (" + "; ".join(f"{k}: {v}" for k, v in STRATEGY_DOC.items()) + ").",
    )
    e.add_argument("--model", required=True, help=f"MoE preset: {', '.join(PRESETS)}")
    e.add_argument("--nodes", type=int, required=True, help="nodes in the cluster")
    e.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    e.add_argument("--tokens-per-gpu", type=int, default=4096,
                   help="tokens each GPU dispatches per MoE layer per micro-batch (default 4096)")
    e.add_argument("--routing", default="uniform",
                   help="uniform | zipf:A (Zipf popularity, exponent A) | group (the model's n_group/topk_group) "
                   "| a routing log .npy/.pt/.jsonl of top-k ids (default uniform)")
    e.add_argument("--gpu", default="H800", help=f"sets FLOP/s and default bandwidths: {', '.join(GPUS)} "
                   "(default H800)")
    e.add_argument("--nvlink-gbps", type=float, help="intra-node GB/s per GPU per direction (default: the GPU's)")
    e.add_argument("--ib-gbps", type=float, help="inter-node GB/s per GPU per direction (IB/RoCE/EFA; "
                   "default: the GPU's)")
    e.add_argument("--ep-sizes", help="comma-separated EP sizes (default: powers of two from 8 up to "
                   "min(GPUs, experts) that divide the experts)")
    e.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help="comma-separated subset of pair,rank,node,allgather (default pair,rank,node)")
    e.add_argument("--dispatch-dtype", choices=["bf16", "fp8"], default="bf16",
                   help="dispatch row dtype (combine is bf16; default bf16)")
    e.add_argument("--seq-len", type=int, default=4096, help="sequence length for attention FLOPs (default 4096)")
    e.add_argument("--efficiency", type=float, default=None, help="fraction of peak FLOP/s (default: the GPU's)")
    e.add_argument("--sample-budget", type=int, default=1 << 20,
                   help="max ep*tokens*top_k entries counted exactly; larger runs sample and scale (default 2^20)")
    e.add_argument("--seed", type=int, default=0, help="routing sample seed (default 0)")
    e.add_argument("--json", action="store_true", help="print JSON (key 'rows') instead of a table")
    e.add_argument("--png", help="write tokens/s and comm share vs EP size to this PNG")
    return p


def default_ep_sizes(num_experts: int, world: int, gpn: int) -> list[int]:
    sizes, e = [], 8
    while e <= min(world, num_experts):
        if num_experts % e == 0 and (e <= gpn or e % gpn == 0):
            sizes.append(e)
        e *= 2
    return sizes or [min(world, num_experts)]


def simulate(args) -> dict:
    cfg = get_preset(args.model)
    if not cfg.is_moe:
        moe_presets = [k for k, v in PRESETS.items() if v.is_moe]
        raise ValueError(f"--model {args.model} is dense (no experts); choose an MoE preset: {', '.join(moe_presets)}")
    gpu = get_gpu(args.gpu)
    world = args.nodes * args.gpus_per_node
    if args.nodes < 1 or args.gpus_per_node < 1 or args.tokens_per_gpu < 1:
        raise ValueError("--nodes, --gpus-per-node and --tokens-per-gpu must be positive")
    if args.seq_len < 1:
        raise ValueError(f"--seq-len must be positive, got {args.seq_len}")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency ({args.efficiency}) must be in (0, 1]; e.g. 0.5")
    for flag, value in (("--nvlink-gbps", args.nvlink_gbps), ("--ib-gbps", args.ib_gbps)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a positive number of GB/s, got {value}; leave it out for the GPU's own")
    E, K = cfg.moe.num_experts, cfg.moe.top_k
    try:
        sizes = ([int(x) for x in args.ep_sizes.split(",")] if args.ep_sizes
                 else default_ep_sizes(E, world, args.gpus_per_node))
    except ValueError:
        raise ValueError(f"--ep-sizes {args.ep_sizes!r}: give comma-separated integers, e.g. 8,64") from None
    for ep in sizes:
        if ep > world:
            raise ValueError(
                f"--ep-sizes has {ep} > the {world} GPUs of --nodes x --gpus-per-node; drop it or add nodes"
            )
        check_topology(E, ep, args.gpus_per_node)
    strategies = args.strategies.split(",")
    for strat in strategies:
        if strat not in STRATEGY_DOC:
            raise ValueError(f"--strategies has {strat!r}; choose from {','.join(STRATEGY_DOC)}")
    links = Links(gpu.intra_gbps if args.nvlink_gbps is None else args.nvlink_gbps,
                  gpu.inter_gbps if args.ib_gbps is None else args.ib_gbps)
    d_row, c_row = row_bytes(cfg.dim, K, args.dispatch_dtype)
    eff = args.efficiency or gpu.efficiency
    compute_s = cfg.flops_per_token(args.seq_len) * args.tokens_per_gpu / (gpu.peak_flops("bf16") * eff)
    rows = []
    for ep in sizes:
        copies, exact = sample_copies(args.routing, E, K, ep, args.gpus_per_node, args.tokens_per_gpu,
                                      strategies, args.sample_budget, args.seed, cfg.moe.n_group,
                                      cfg.moe.topk_group)
        for strat in strategies:
            lt = ep_layer_time(copies[strat], d_row, c_row, links)
            ep_step = lt["layer_train_s"] * cfg.num_moe_layers
            rows.append({
                "ep": ep, "strategy": strat, "nodes_spanned": -(-ep // args.gpus_per_node),
                "bytes_intra": lt["busiest_bytes_intra"], "bytes_inter": lt["busiest_bytes_inter"],
                "total_bytes_intra": lt["bytes_intra"], "total_bytes_inter": lt["bytes_inter"],
                "dispatch_s": lt["dispatch_s"], "combine_s": lt["combine_s"], "ep_time_s": lt["layer_train_s"],
                "ep_step_s": ep_step, "compute_step_s": compute_s,
                "comm_share": ep_step / (ep_step + compute_s),
                "tokens_per_s": args.tokens_per_gpu / (ep_step + compute_s), "exact": exact,
            })
    return {
        "model": cfg.name, "experts": E, "top_k": K, "hidden": cfg.dim, "moe_layers": cfg.num_moe_layers,
        "nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "tokens_per_gpu": args.tokens_per_gpu,
        "routing": args.routing, "gpu": gpu.name, "intra_gbps": links.intra_gbps, "inter_gbps": links.inter_gbps,
        "dispatch_row_bytes": d_row, "combine_row_bytes": c_row,
        "notes": "bytes_* are the busiest rank's bytes per MoE layer (dispatch + combine, forward); total_* "
                 "sum over sending ranks; ep_time_s is one layer's forward+backward EP time; tokens_per_s is "
                 "per GPU",
        "rows": rows,
    }


def format_table(out: dict) -> str:
    lines = [f"{out['model']}: {out['experts']} experts top-{out['top_k']}, hidden {out['hidden']}, "
             f"{out['moe_layers']} MoE layers; {out['nodes']}x{out['gpus_per_node']} {out['gpu']} "
             f"(NVLink {out['intra_gbps']:.0f} GB/s, IB {out['inter_gbps']:.0f} GB/s); {out['tokens_per_gpu']} "
             f"tokens/GPU; routing {out['routing']}",
             f"{'ep':>5} {'nodes':>5} {'strategy':>9} {'MB intra':>9} {'MB inter':>9} {'layer ms':>9} "
             f"{'comm %':>7} {'tok/s/GPU':>10} {'exact':>5}"]
    for r in out["rows"]:
        lines.append(f"{r['ep']:>5} {r['nodes_spanned']:>5} {r['strategy']:>9} {r['bytes_intra'] / 1e6:>9.1f} "
                     f"{r['bytes_inter'] / 1e6:>9.1f} {r['ep_time_s'] * 1e3:>9.2f} {r['comm_share']:>7.1%} "
                     f"{r['tokens_per_s']:>10.0f} {'yes' if r['exact'] else 'est':>5}")
    lines.append("MB = busiest rank's bytes per MoE layer (dispatch + combine, forward); layer ms = forward + "
                 "backward EP time of one MoE layer; comm % assumes no overlap with compute.")
    return "\n".join(lines)


def write_png(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for strat in dict.fromkeys(r["strategy"] for r in out["rows"]):
        rs = [r for r in out["rows"] if r["strategy"] == strat]
        ax1.plot([r["ep"] for r in rs], [r["tokens_per_s"] for r in rs], "o-", label=strat)
        ax2.plot([r["ep"] for r in rs], [100 * r["comm_share"] for r in rs], "o-", label=strat)
    for ax, label in ((ax1, "tokens/s per GPU"), (ax2, "EP share of step (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("EP size")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"moeflow simulate ep: {out['model']}, {out['tokens_per_gpu']} tokens/GPU, {out['routing']}")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = simulate(args)
    except ValueError as e:
        print(f"moeflow simulate: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=1) if args.json else format_table(out))
    if args.png:
        from moeflow.core.figures import write_png_option

        if not write_png_option(write_png, out, args.png, "moeflow simulate"):
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
