"""Benchmark moeflow.ep backends against the one-copy-per-(token, expert) all-to-all baseline.

    .venv/bin/python bench/ep.py            # full: worlds 2, 4, 8
    .venv/bin/python bench/ep.py --quick    # short run

Backends x world sizes (local gloo processes acting as 1, 2 or 4 ranks per node) x routings (uniform
top-8 of 64, Zipf-skewed top-8 of 64, DeepSeek-V3-style group-limited top-8 of 256). Per case: bytes
inside / across nodes of one dispatch + combine (summed over ranks), and the median time of
dispatch + combine after warm-up. The baseline (`pair`, what TorchTitan's and Megatron's all-to-all
dispatchers do) is measured in the same run: one copy per valid (token, expert) pair, one count exchange,
one all_to_all_single each way, weighted sum at the source. Writes bench/out/ep.{json,png} (--out DIR
elsewhere; bench/results holds the published run that README.md shows) and prints a table plus the machine
and versions.

Shape legend: T tokens per rank, K top-k, E experts, D hidden, R ranks, P (token, expert) pairs.
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


def make_routing(kind: str, T: int, E: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_idx [T, K], topk_weights [T, K] for a routing kind."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        scores = torch.rand(T, E, generator=g)
    elif kind == "zipf":
        # Zipf-like popularity (s = 1.2) with a per-token perturbation: a few hot experts.
        pop = 1.0 / torch.arange(1, E + 1).float() ** 1.2
        scores = torch.log(pop) + torch.empty(T, E).exponential_(generator=g).neg()
    elif kind == "deepseek":
        # DeepSeek-V3: 8 groups, each token keeps its best 4 groups (by the sum of their top-2), top-8 inside.
        n_group, topk_group = 8, 4
        scores = torch.rand(T, E, generator=g)
        grouped = scores.view(T, n_group, E // n_group)
        gscore = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gscore.topk(topk_group, dim=-1).indices, True)
        scores = scores.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), -1.0)
    else:
        raise ValueError(kind)
    idx = scores.topk(K, dim=-1).indices
    w = torch.rand(T, K, generator=g)
    return idx, w / w.sum(1, keepdim=True)


ROUTINGS = {"uniform-64": ("uniform", 64), "zipf-64": ("zipf", 64), "deepseek-256": ("deepseek", 256)}


class PairBaseline:
    """One copy per valid (token, expert) pair, no dedup (TorchTitan / Megatron all-to-all dispatchers).

    As those dispatchers do: pairs sorted by destination rank (then expert), a count exchange, one
    all_to_all_single of the x rows (the expert of each row follows from the per-expert counts, so no
    ids travel), the expert outputs come back the same way and the source applies the weights and sums.
    """

    def __init__(self, group, R: int, G: int):
        self.group, self.R, self.G = group, R, G
        self.bytes = [0, 0, 0, 0]  # dispatch intra, inter, combine intra, inter

    def run(self, x_TD, idx_TK, w_TK, E: int) -> torch.Tensor:
        R, me = self.R, dist.get_rank(self.group)
        T, K = idx_TK.shape
        flat = idx_TK.reshape(-1)
        key = torch.where(flat >= 0, flat, torch.full_like(flat, E))
        order = torch.argsort(key, stable=True)  # by expert, so by destination rank
        per_expert = torch.bincount(key, minlength=E + 1)
        n_valid = int(per_expert[:E].sum())  # host sync: number of copies
        pair_P = order[:n_valid]
        send = per_expert[:E].view(R, E // R).sum(1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_l, recv_l = send.tolist(), recv.tolist()  # host sync: split sizes
        row = x_TD.shape[1] * x_TD.element_size()
        for r, n in enumerate(send_l):
            if r != me:
                same = r // self.G == me // self.G
                self.bytes[0 if same else 1] += n * row
                self.bytes[2 if same else 3] += n * row  # the same copies come back in combine
        got = x_TD.new_empty(sum(recv_l), x_TD.shape[1])
        dist.all_to_all_single(got, x_TD.index_select(0, pair_P // K), recv_l, send_l, group=self.group)
        back = x_TD.new_empty(n_valid, x_TD.shape[1])
        dist.all_to_all_single(back, got, send_l, recv_l, group=self.group)  # `got` stands in for expert output
        out = torch.zeros(T, x_TD.shape[1], dtype=torch.float32)
        out.index_add_(0, pair_P // K, back.float() * w_TK.reshape(-1)[pair_P].unsqueeze(1))
        return out.to(x_TD.dtype)


def _timed(fn, warmup: int, repeats: int, group) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the pace
    return float(t)


def _worker(rank: int, world: int, args, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_gloo(rank, world, tmp)
    from moeflow.ep import Buffer

    group = dist.group.WORLD
    rows = []
    gs = [g for g in (1, 2, 4) if world % g == 0 and g <= world and (world // g) > 1 or g == world]
    for G in sorted(set(gs)):
        buffers = {b: Buffer(group, backend=b, ranks_per_node=G) for b in ("alltoall", "hierarchical", "allgather")}
        for rname, (kind, E) in ROUTINGS.items():
            idx, w = make_routing(kind, args.tokens, E, 8, seed=rank)
            x = torch.randn(args.tokens, args.hidden).to(torch.bfloat16)
            base = PairBaseline(group, world, G)
            base.run(x, idx, w, E)
            sent = torch.tensor(base.bytes)
            dist.all_reduce(sent, group=group)
            t = _timed(lambda base=base, x=x, idx=idx, w=w, E=E: base.run(x, idx, w, E), args.warmup,
                       args.repeats, group)
            cases = [("pair", sent.tolist(), t)]
            for bname, buf in buffers.items():
                def step(buf=buf, x=x, idx=idx, w=w, E=E):
                    rx, ridx, rw, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
                    return buf.combine(rx, h, topk_weights=rw)[0]
                buf.reset_stats()
                step()
                s = buf.stats
                v = torch.tensor([s.dispatch_bytes_intra, s.dispatch_bytes_inter, s.combine_bytes_intra,
                                  s.combine_bytes_inter])
                dist.all_reduce(v, group=group)
                cases.append((bname, v.tolist(), _timed(step, args.warmup, args.repeats, group)))
            for bname, b, t in cases:
                rows.append(dict(world=world, ranks_per_node=G, nodes=world // G, routing=rname, backend=bname,
                                 tokens_per_rank=args.tokens, hidden=args.hidden, dtype="bf16", top_k=8,
                                 dispatch_intra=b[0], dispatch_inter=b[1], combine_intra=b[2],
                                 combine_inter=b[3], time_ms=t * 1e3))
    report(rank, tmp, rows)
    dist.barrier()
    dist.destroy_process_group()


# A link model, to read the byte counts as time on real nodes (loopback has no slow inter-node link).
# H100 class: NVLink ~450 GB/s per GPU one way, InfiniBand NDR 400 Gb/s = 50 GB/s per GPU.
MODEL_GBPS = {"intra": 450.0, "inter": 50.0}


def model_ms(r: dict) -> float:
    """Modelled dispatch + combine time per rank: bytes / bandwidth; the two phases of `hierarchical`
    add up, the single all-to-all of the others overlaps intra and inter traffic (alpha ignored)."""
    R = r["world"]
    t = 0.0
    for kind in ("dispatch", "combine"):
        intra = r[f"{kind}_intra"] / R / (MODEL_GBPS["intra"] * 1e9)
        inter = r[f"{kind}_inter"] / R / (MODEL_GBPS["inter"] * 1e9)
        t += intra + inter if r["backend"] == "hierarchical" else max(intra, inter)
    return t * 1e3


def _table(rows: list[dict]) -> str:
    base = {(r["world"], r["ranks_per_node"], r["routing"]): r for r in rows if r["backend"] == "pair"}
    head = (f"{'R':>2} {'GxM':>5} {'routing':<13} {'backend':<13} {'intra MB':>9} {'inter MB':>9} "
            f"{'inter/base':>10} {'ms':>8} {'speedup':>8} {'model ms':>9} {'model x':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        b = base[(r["world"], r["ranks_per_node"], r["routing"])]
        intra = (r["dispatch_intra"] + r["combine_intra"]) / 1e6
        inter = (r["dispatch_inter"] + r["combine_inter"]) / 1e6
        binter = (b["dispatch_inter"] + b["combine_inter"]) / 1e6
        ratio = f"{inter / binter:.2f}" if binter else "-"
        modelled = f"{model_ms(b) / model_ms(r):>7.2f}x" if model_ms(r) else f"{'-':>8}"  # one rank moves nothing
        lines.append(f"{r['world']:>2} {r['ranks_per_node']}x{r['nodes']:<3} {r['routing']:<13} {r['backend']:<13} "
                     f"{intra:>9.2f} {inter:>9.2f} {ratio:>10} {r['time_ms']:>8.2f} "
                     f"{b['time_ms'] / r['time_ms']:>7.2f}x {model_ms(r):>9.3f} {modelled}")
    return "\n".join(lines)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["world"], r["ranks_per_node"], r["routing"]) for r in rows})
    backends = ["pair", "alltoall", "hierarchical", "allgather"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, len(keys) * 0.9), 8))
    width = 0.2
    for i, b in enumerate(backends):
        sel = {(r["world"], r["ranks_per_node"], r["routing"]): r for r in rows if r["backend"] == b}
        xs = [k + (i - 1.5) * width for k in range(len(keys))]
        axes[0].bar(xs, [sel[k]["time_ms"] for k in keys], width, label=b)
        axes[1].bar(xs, [(sel[k]["dispatch_inter"] + sel[k]["combine_inter"]) / 1e6 for k in keys], width, label=b)
    labels = [f"R{w} {g}/node\n{rt}" for w, g, rt in keys]
    for ax, title in zip(axes, ["dispatch + combine, median ms (lower is better)", "bytes across nodes, MB"]):
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="worlds 2 and 8, fewer tokens and repeats")
    p.add_argument("--worlds", default=None, help="comma-separated world sizes (default 2,4,8)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", default=OUT, help="folder for ep.json and ep.png (bench/results: the published figures)")
    args = p.parse_args(argv)
    quick = dict(worlds="2,8", tokens=128, hidden=512, warmup=1, repeats=3)
    full = dict(worlds="2,4,8", tokens=512, hidden=1024, warmup=2, repeats=7)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        rows += run_workers(_worker, world, args)
    out = args.out
    os.makedirs(out, exist_ok=True)
    meta = dict(machine=platform.machine(), cpu_count=os.cpu_count(), python=platform.python_version(),
                torch=torch.__version__, platform=platform.platform(), args=vars(args),
                note="local gloo processes over TCP loopback; 'nodes' are simulated with ranks_per_node")
    for r in rows:
        r["model_ms"] = model_ms(r)
    with open(os.path.join(out, "ep.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    _plot(rows, os.path.join(out, "ep.png"))
    print(f"# {meta['platform']}, {meta['cpu_count']} CPUs, python {meta['python']}, torch {meta['torch']}")
    print(f"# T={args.tokens} tokens/rank, D={args.hidden} bf16, top-8; median of {args.repeats} after "
          f"{args.warmup} warm-up; speedup = baseline time / time")
    print(f"# model ms: bytes per rank / ({MODEL_GBPS['intra']:.0f} GB/s intra, {MODEL_GBPS['inter']:.0f} GB/s "
          "inter), NOT measured; 'ms' and 'speedup' are measured here over loopback")
    print(_table(rows))
    print(f"wrote {out}/ep.json and {out}/ep.png")


if __name__ == "__main__":
    main()
