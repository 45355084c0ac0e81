"""Expert parallelism of a transformers MoE model: moeflow's path on transformers' own modules against moeflow's own
model of the same weights, ep=2 on two gloo ranks of one machine.

    .venv/bin/python bench/hf_ep.py                      # writes bench/out/hf_ep.{json,png}
    .venv/bin/python bench/hf_ep.py --out bench/results  # the committed figures
    .venv/bin/python bench/hf_ep.py --quick              # 3 repeats, 1 round: a smoke run

Cases, each `moeflow.parallelize(model, ParallelDims(2, ep=2))` (FSDP2 ZeRO-3 of the rest) and one step of
fused AdamW (what `moeflow train` builds; every case gets the same optimizer) per repeat on the same batch of each
rank:

  qwen3_moe native          moeflow's Transformer loaded from the folder (model.hf_impl = 'native')
  qwen3_moe transformers    transformers' Qwen3MoeForCausalLM, its experts through moeflow.ep
                            (model.hf_impl = 'transformers')
  gpt_oss transformers      transformers' GptOssForCausalLM (no native path: the architecture's own experts)

and the peers, the same folders trained by:

  qwen3_moe transformers-ep  transformers' own distributed training: from_pretrained(..., distributed_config=
  gpt_oss transformers-ep    DistributedConfig(fsdp_size=2, ep_size=2)), its expert plan (its all-to-all token
                             dispatch) and FSDP2, a plain loop (forward, cross-entropy, backward, AdamW)
  qwen3_moe deepspeed-autoep DeepSpeed's AutoEP, ZeRO stage 0, in a venv of its own (bench/hf_ep_autoep.py; AutoEP
                             has no gpt-oss preset)

Shapes (Qwen3-MoE's and gpt-oss's layouts at a CPU's size): hidden 256, 4 layers, 8 heads of 32 (2 kv heads), 16
experts of width 256, top-4, vocabulary 2048, 4 x 256 tokens per rank, fp32, one thread per rank. The losses of
each architecture's cases are compared (same weights, same batch: equal to 1e-5). Each case runs in a pair of
processes of its own (so that no case pays for another's memory), the cases one after another in rotated order
for `--rounds` rounds; reported, from each case's fastest round (other work on the machine slows a round, never
speeds one): the slowest rank's median step, tokens/s of the slowest rank, each case's ratio to the native path and
to transformers' own expert parallelism of the same architecture, and each rank's peak resident memory. One more
step of each case under torch's profiler gives its kernel floor: the time of the matmul and attention kernels
(FLOOR_OPS), which every program of these fp32 models runs whatever its framework; the fastest peer's step over the
smallest Qwen3-MoE floor is the most any program could gain on that peer here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CASES = ["qwen3_moe native", "qwen3_moe transformers", "qwen3_moe transformers-ep", "gpt_oss transformers",
         "gpt_oss transformers-ep"]
AUTOEP = "qwen3_moe deepspeed-autoep"  # runs in its own venv (bench/hf_ep_autoep.py)
PEERS = ("transformers-ep", "deepspeed-autoep")
D, LAYERS, HEADS, KV, HD, E, K, F, V = 256, 4, 8, 2, 32, 16, 4, 256, 2048
B, S = 4, 256
# the kernels every implementation of these models runs in fp32 (matmuls, attention): their time in a step is its floor
FLOOR_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
             "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}


def _configs():
    import transformers as t

    common = dict(vocab_size=V, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV, head_dim=HD, max_position_embeddings=S, tie_word_embeddings=False)
    return {"qwen3_moe": t.Qwen3MoeConfig(**common, intermediate_size=4 * D, num_experts=E, num_experts_per_tok=K,
                                          moe_intermediate_size=F, norm_topk_prob=True),
            "gpt_oss": t.GptOssConfig(**common, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K,
                                      sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2)}


def make_folders(work: Path) -> dict[str, Path]:
    import torch
    import transformers

    from tests.support.hf_models import randomize

    folders = {}
    for name, cfg in _configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).float()
        randomize(model, seed=1)
        folders[name] = work / name
        model.save_pretrained(folders[name])
    return folders


def _worker(rank: int, case: str, folder: str, repeats: int, tmp: str) -> None:
    """One case on this rank, in processes of its own: its first loss, `repeats` timed steps, one profiled step."""
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import transformers
    from transformers.distributed import DistributedConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)  # (tmp: this case's)
    import moeflow
    from moeflow.models import hf_transformers
    from moeflow.models.hf import from_pretrained

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, V, (B, S + 1), generator=gen)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    impl = case.split()[1]
    if impl == "transformers-ep":  # the peer: transformers' expert plan and FSDP2, its own loading, a plain loop
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=2, ep_size=2)).train()

        def train_step():
            loss = F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            return loss.detach()
    else:
        model = from_pretrained(folder)[0] if impl == "native" else hf_transformers.load(folder)
        state = moeflow.parallelize(model, moeflow.ParallelDims(2, ep=2))
        model = state.model

        def train_step():
            return state.runner.train_step(inputs, targets)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # (moeflow train's; every case gets it)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = train_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, float(loss)

    first = step()[1]  # warm-up, and the loss compared across the cases before any timing counts
    step()
    times = [step()[0] for _ in range(repeats)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # (it slows its step)
        step()
    floor = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in FLOOR_OPS) / 1e6
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({
        "first_loss": first, "median_s": statistics.median(times), "floor_s": floor,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    dist.destroy_process_group()


def _run(case: str, folders: dict, repeats: int, tmp: Path) -> list[dict]:
    """One case on 2 ranks in processes of its own -> each rank's result."""
    import torch.multiprocessing as mp

    from bench import hf_ep_autoep

    work = Path(tempfile.mkdtemp(dir=tmp))
    if case == AUTOEP:
        hf_ep_autoep.run(folders["qwen3_moe"], work, repeats, B, S)
        return [json.loads((work / f"autoep_rank{r}.json").read_text()) for r in range(2)]
    mp.spawn(_worker, args=(case, str(folders[case.split()[0]]), repeats, str(work)), nprocs=2, join=True)
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "out"))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="each case this many times, in rotated order")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    repeats, rounds = (3, 1) if args.quick else (args.repeats, args.rounds)
    cases = CASES + [AUTOEP]
    results: dict[str, list[list[dict]]] = {c: [] for c in cases}  # per case: per round, each rank's result
    with tempfile.TemporaryDirectory() as tmp:
        folders = make_folders(Path(tmp))
        for r in range(rounds):
            for case in cases[r % len(cases):] + cases[:r % len(cases)]:
                results[case].append(_run(case, folders, repeats, Path(tmp)))
                print(f"round {r + 1}/{rounds} {case}: slowest rank's median step "
                      f"{1e3 * max(x['median_s'] for x in results[case][-1]):.0f} ms", flush=True)
    first = {c: [x["first_loss"] for x in results[c][0]] for c in cases}  # each rank's own batch
    for case in cases:  # every case of an architecture starts from the same weights and batch
        same = next(c for c in cases if c.split()[0] == case.split()[0])
        for got, want in zip(first[case], first[same]):
            if abs(got - want) > 1e-5 * abs(want):
                raise SystemExit(f"{case} disagrees with {same} on the first loss: {got} vs {want}")
    # each round's slowest rank; the fastest round counts (other work on the machine slows a round, never speeds one)
    round_s = {c: [max(x["median_s"] for x in ranks) for ranks in results[c]] for c in cases}
    best = {c: min(range(rounds), key=lambda i: round_s[c][i]) for c in cases}
    slowest = {c: round_s[c][best[c]] for c in cases}
    tokens = B * S

    def fastest_peer(case: str) -> float:
        return min(slowest[c] for c in cases if c.split()[0] == case.split()[0] and c.split()[1] in PEERS)

    rows = [{"case": c, "step_ms": 1e3 * slowest[c], "tokens_per_s": tokens / slowest[c],
             "vs_native": slowest[CASES[0]] / slowest[c] if c.startswith("qwen3_moe") else None,
             "vs_transformers_ep": slowest[f"{c.split()[0]} transformers-ep"] / slowest[c],
             "vs_fastest_peer": fastest_peer(c) / slowest[c],
             "floor_ms": 1e3 * max(x["floor_s"] for x in results[c][best[c]]) if c != AUTOEP else None,
             "rounds_step_ms": [1e3 * t for t in round_s[c]],
             "peak_rss_mb": [x["peak_rss_mb"] for x in results[c][best[c]]]}
            for c in cases]
    # The most any program of these fp32 kernels could gain on the fastest Qwen3-MoE peer: its step over the floor
    floor = min(row["floor_ms"] for row in rows if row["case"].startswith("qwen3_moe") and row["floor_ms"])
    ceiling = 1e3 * fastest_peer("qwen3_moe native") / floor
    print(f"\nep=2 on 2 gloo ranks, {tokens} tokens per rank, each case in processes of its own, medians of "
          f"{repeats} steps (the fastest of {rounds} rounds); first losses (rank 0) "
          f"{', '.join(f'{c} {v[0]:.6f}' for c, v in first.items())}\n")
    print(f"{'case':<26} {'step ms':>9} {'tokens/s':>9} {'vs native':>10} {'vs transformers-ep':>19} "
          f"{'vs fastest peer':>16} {'kernels ms':>11} {'peak RSS MB':>12}")
    for row in rows:
        native = f"{row['vs_native']:.2f}" if row["vs_native"] else "-"
        kernels = f"{row['floor_ms']:.1f}" if row["floor_ms"] else "-"
        print(f"{row['case']:<26} {row['step_ms']:>9.1f} {row['tokens_per_s']:>9.0f} {native:>10} "
              f"{row['vs_transformers_ep']:>19.2f} {row['vs_fastest_peer']:>16.2f} {kernels:>11} "
              f"{max(row['peak_rss_mb']):>12.0f}")
    print(f"\nmatmul and attention kernels of a Qwen3-MoE step: {floor:.1f} ms; the fastest peer's step over them: "
          f"{ceiling:.2f}x, the most any program could gain on it")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "repeats": repeats, "rounds": rounds,
            "tokens_per_rank": tokens,
            "shape": dict(D=D, layers=LAYERS, heads=HEADS, experts=E, top_k=K, expert_width=F, vocab=V),
            "first_loss": {c: v[0] for c, v in first.items()}, "kernel_floor_ms": floor,
            "ceiling_vs_fastest_peer": ceiling}
    (out / "hf_ep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _plot(rows, out / "hf_ep.png")
    print(f"\nwrote {out / 'hf_ep.json'} and hf_ep.png")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([r["case"] for r in rows], [r["tokens_per_s"] for r in rows])
    ax.set_xlabel("tokens/s of the slowest rank (ep=2, fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
