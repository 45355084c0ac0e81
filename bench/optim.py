"""Muon against AdamW on tiny-moe: the optimizer step's time, the Newton-Schulz part alone, and a whole training
step, on 1 process, 2 gloo ranks (dp_shard, ep, tp) and 4 (dp_shard, ep), each optimizer measured in the same run.

    .venv/bin/python bench/optim.py                      # writes bench/out/optim.{json,png}
    .venv/bin/python bench/optim.py --out bench/results  # the committed figures
    .venv/bin/python bench/optim.py --quick              # 3 repeats: a smoke run

Each case builds tiny-moe (fp32, one thread per rank) with moeflow.parallelize, a fixed batch per rank (4 x 128
tokens; and 16 x 128 in one process, the default job's step), and the trainer's optimizer of each kind
(moeflow/train/build.py: AdamW over every parameter, or Muon over the block matrices and each expert matrix with
AdamW for the rest); the two alternate, step by step, and the median of the slowest rank counts. Reported per case
and optimizer: the training step (forward, backward, optimizer) and the optimizer step alone, in ms; for Muon also
the time spent in Newton-Schulz (timed by wrapping moeflow.train.muon.newton_schulz) and the number of matrices each
rank orthogonalised, summed over the ranks against the matrices of the model (each once: no matrix twice), and the
bytes one rank's Muon step sends (counted from its collectives' tensors, ring volumes:
tests/support/collective_bytes.py) against moeflow plan's prediction for the layout (moeflow.plan.optimizer). Muon
runs twice: with the sharded matrices' scheme the trainer uses (each matrix's shards to one owner rank and its
result back, two all-to-alls: `muon`) and with the one it replaced (every shard to every rank, the results summed:
`muon-gather`), which chose it. Beside the cases, the optimizer step alone of torch.optim.Muon (torch's
single-device reference) and of moeflow's Muon over the same 100 2-D matrices and gradients. Target (issue): the
Muon step <= 1.15x AdamW's at 1 rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OPTIMIZERS = ("adamw", "muon", "muon-gather")
SCHEMES = {"muon-gather": "gather_and_sum"}  # moeflow.train.muon._ShardedMatrices.SCHEME of each Muon run
# case -> (ranks, layout, sequences per rank); the last is the default job's step (configs/default.toml: 16 x 128)
CASES = {"1 process": (1, {}, 4), "dp_shard=2": (2, {"parallel.zero": 3}, 4), "ep=2": (2, {"parallel.ep": 2}, 4),
         "tp=2": (2, {"parallel.tp": 2}, 4), "dp_shard=4": (4, {"parallel.zero": 3}, 4),
         "ep=4": (4, {"parallel.ep": 4}, 4), "1 process, 16 x 128": (1, {}, 16)}
S = 128


def _worker(rank: int, world: int, layout: dict, B: int, repeats: int, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    from moeflow.config import load_config
    from moeflow.train import muon as muon_module
    from moeflow.train.build import build_model

    calls = {"n": 0, "s": 0.0}
    plain = muon_module.newton_schulz

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = plain(*args, **kwargs)
        # one call orthogonalises a matrix or a stack of them: count matrices
        calls["n"], calls["s"] = calls["n"] + args[0].shape[:-2].numel(), calls["s"] + time.perf_counter() - t0
        return out

    muon_module.newton_schulz = timed
    runs = {}
    for name in OPTIMIZERS:
        cfg = load_config(None, {"training.optimizer": name.split("-")[0], "data.seq_len": S,
                                 "training.global_batch": B * world, **layout})
        dims, batch = cfg.layout(world)
        torch.manual_seed(0)
        par, opt, _ = build_model(cfg, torch.device("cpu"), dims, batch)
        runs[name] = (par, opt)
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 256, (B, S + 1), generator=gen)

    def step(name: str) -> tuple[float, float]:
        par, opt = runs[name]
        muon_module._ShardedMatrices.SCHEME = SCHEMES.get(name, "all_to_all")
        t0 = time.perf_counter()
        par.runner.train_step(ids[:, :-1], ids[:, 1:])
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    for name in runs:  # warm-up
        step(name)
    calls.update(n=0, s=0.0)
    times = {name: [] for name in runs}
    for r in range(repeats):
        for name in (OPTIMIZERS if r % 2 == 0 else OPTIMIZERS[::-1]):
            times[name].append(step(name))
    from moeflow.models.transformer import Transformer

    with torch.device("meta"):  # the whole model's matrices (a rank under ep holds a slice of the experts)
        whole = Transformer(cfg.model)
    matrices = sum(p.shape[0] if p.ndim == 3 else 1 for p in muon_module.muon_parameters(whole)[0])
    out = {name: {"step_s": statistics.median(t for t, _ in v), "optim_s": statistics.median(o for _, o in v)}
           for name, v in times.items()}
    muon_module._ShardedMatrices.SCHEME = "all_to_all"
    out["muon"].update(ns_s=calls["s"] / repeats / 2, ns_matrices=calls["n"] / repeats / 2, model_matrices=matrices,
                       **_bytes_against_plan(cfg, dims, runs["muon"], ids, B))
    muon_module._ShardedMatrices.SCHEME = SCHEMES["muon-gather"]
    out["muon-gather"].update(**_bytes_against_plan(cfg, dims, runs["muon-gather"], ids, B))
    muon_module._ShardedMatrices.SCHEME = "all_to_all"
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
    if world > 1:
        dist.destroy_process_group()


def _bytes_against_plan(cfg, dims, run, ids, B: int) -> dict:
    """Bytes this rank's Muon step sends (counted from the collectives' tensors) and what moeflow plan predicts
    for the layout (moeflow.plan.optimizer)."""
    from moeflow.core.hardware import get_gpu
    from moeflow.plan.layout import Job, Layout
    from moeflow.plan.optimizer import muon_rank_cost
    from tests.support.collective_bytes import CollectiveBytes

    par, opt = run
    par.runner.train_step(ids[:, :-1], ids[:, 1:])
    with CollectiveBytes() as measured:
        opt.step()
    opt.zero_grad(set_to_none=True)
    job = Job(cfg.model, get_gpu("H100-80GB"), 1, max(2, dims.world_size), S, B * S * dims.world_size, optimizer="muon")
    cost = muon_rank_cost(job, Layout(dims, 1, "none"), list(range(cfg.model.n_layers)))
    return {"sent_bytes": measured.sent, "planned_bytes": cost["intra_bytes"] + cost["inter_bytes"]}


def main(argv=None) -> int:
    import torch
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "out"))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    rows = []
    for case, (world, layout, B) in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            if world == 1:
                _worker(0, 1, layout, B, repeats, tmp)
            else:
                mp.spawn(_worker, args=(world, layout, B, repeats, tmp), nprocs=world, join=True)
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
        for name in OPTIMIZERS:
            row = {"case": case, "optimizer": name, "tokens_per_rank": B * S,
                   "step_ms": 1e3 * max(r[name]["step_s"] for r in ranks),
                   "optim_ms": 1e3 * max(r[name]["optim_s"] for r in ranks)}
            if name == "muon":
                row.update(ns_ms=1e3 * max(r["muon"]["ns_s"] for r in ranks),
                           ns_matrices=sum(r["muon"]["ns_matrices"] for r in ranks),
                           model_matrices=ranks[0]["muon"]["model_matrices"])
            if name != "adamw":  # the planner costs the trainer's scheme: the mean rank's bytes
                row.update(sent_mb=max(r[name]["sent_bytes"] for r in ranks) / 1e6,
                           mean_sent_mb=statistics.mean(r[name]["sent_bytes"] for r in ranks) / 1e6,
                           planned_mb=max(r[name]["planned_bytes"] for r in ranks) / 1e6)
            rows.append(row)
    by = {(r["case"], r["optimizer"]): r for r in rows}
    print(f"\ntiny-moe, fp32, 4 x {S} tokens per rank unless named, medians of {repeats} alternating steps "
          f"(slowest rank)\n")
    print(f"{'case':<20} {'optimizer':<11} {'step ms':>8} {'optim ms':>9} {'NS ms':>7} {'matrices NS / model':>20}"
          f" {'step vs adamw':>14} {'MB sent max / mean / planned':>29}")
    for r in rows:
        ratio = r["step_ms"] / by[(r["case"], "adamw")]["step_ms"]
        ns = f"{r['ns_ms']:.1f}" if "ns_ms" in r else "-"
        mats = f"{r['ns_matrices']:.0f} / {r['model_matrices']}" if "ns_matrices" in r else "-"
        r["step_vs_adamw"] = ratio
        sent = (f"{r['sent_mb']:.3f} / {r['mean_sent_mb']:.3f} / "
                f"{r['planned_mb'] if r['optimizer'] == 'muon' else float('nan'):.3f}" if "sent_mb" in r else "-")
        print(f"{r['case']:<20} {r['optimizer']:<11} {r['step_ms']:>8.1f} {r['optim_ms']:>9.1f} {ns:>7} {mats:>20}"
              f" {ratio:>14.2f} {sent:>29}")
    reference = _against_torch_muon(repeats)
    print(f"\nthe optimizer step alone over tiny-moe's {reference['matrices']} matrices (2-D, one thread): "
          f"torch.optim.Muon {reference['torch_muon_ms']:.1f} ms, moeflow's Muon {reference['moeflow_muon_ms']:.1f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "repeats": repeats, **_flops(),
            "reference": reference}
    (out / "optim.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _plot(rows, out / "optim.png")
    print(f"\nwrote {out / 'optim.json'} and optim.png")
    return 0


def _against_torch_muon(repeats: int) -> dict:
    """The optimizer step alone of torch.optim.Muon (torch's single-device reference, one matrix at a time) and of
    moeflow's Muon over the same 2-D matrices (tiny-moe's, each expert its own) and gradients, alternating: what
    Newton-Schulz costs whoever runs it."""
    import torch

    from moeflow.core.presets import PRESETS
    from moeflow.models.transformer import Transformer
    from moeflow.train.muon import Muon, muon_parameters

    torch.set_num_threads(1)
    with torch.device("meta"):
        whole = Transformer(PRESETS["tiny-moe"])
    shapes = [p.shape[-2:] for p in muon_parameters(whole)[0] for _ in range(p.shape[0] if p.ndim == 3 else 1)]
    gen = torch.Generator().manual_seed(0)
    optimizers = {}
    for name in ("torch", "moeflow"):
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        kw = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
        optimizers[name] = (torch.optim.Muon(params, adjust_lr_fn="match_rms_adamw", **kw) if name == "torch" else
                            Muon(params, [], adamw_lr=1e-3, betas=(0.9, 0.95), adjust_lr="match_rms_adamw", **kw))
    times = {name: [] for name in optimizers}
    for r in range(repeats + 1):
        for name, opt in (optimizers.items() if r % 2 == 0 else reversed(optimizers.items())):
            t0 = time.perf_counter()
            opt.step()
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    return {"matrices": len(shapes), "torch_muon_ms": 1e3 * statistics.median(times["torch"]),
            "moeflow_muon_ms": 1e3 * statistics.median(times["moeflow"])}


def _flops() -> dict:
    """Newton-Schulz's FLOPs per step (a constant of the model) against the forward and backward of one rank's
    tokens (which grow with the batch), both as moeflow plan counts them: the batch below which Muon's step cannot
    come near AdamW's whatever the kernels."""
    from moeflow.core.presets import PRESETS
    from moeflow.plan.optimizer import layer_matrices, ns_flops

    cfg = PRESETS["tiny-moe"]
    ns = sum(n * ns_flops(r, c, steps=5) for layer in range(cfg.n_layers) for n, r, c, _ in layer_matrices(cfg, layer))
    return {"ns_gflop_per_step": ns / 1e9, "train_gflop_per_token": cfg.flops_per_token(S) / 1e9}


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 3))
    for i, name in enumerate(OPTIMIZERS):
        ax.bar([x + 0.27 * i for x in range(len(cases))], [r["step_ms"] for r in rows if r["optimizer"] == name],
               0.27, label=name)
    ax.set_xticks([x + 0.27 for x in range(len(cases))], cases)
    ax.set_ylabel("training step, ms (slowest rank)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
