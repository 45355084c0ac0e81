"""The figures README.md and bench/README.md show, rendered from the committed benchmark output in bench/results/.

    .venv/bin/python bench/readme_figures.py          # rewrite both READMEs' marked blocks from bench/results/*.json
    .venv/bin/python bench/readme_figures.py --check  # exit 1, naming each block, when a README differs from the JSON
    .venv/bin/python bench/readme_figures.py --record-make-train runs/default/summary.json  # after `make train`

A block sits between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` (an HTML comment: invisible on GitHub).
To refresh the figures of a block, run its benchmark with `--out bench/results`, then this script, and commit
both; tests/test_bench.py fails while a README and the JSON disagree. Only --record-make-train imports torch.

| block | file | written by |
|---|---|---|
| make_train | README.md | `make train`, then `--record-make-train` |
| ep | README.md | `bench/ep.py --worlds 8 --out bench/results` |
| hf_speed | README.md | `bench/moe_layer.py --out bench/results` and `bench/hf_models.py --out bench/results` |
| plan | README.md | `bench/plan_vs_measured.py --out bench/results` |
| train_layouts | bench/README.md | `bench/train.py --out bench/results` |
| vllm_serve | README.md | `bench/vllm_serve.py --out bench/results` |
| hf_ep | README.md | `bench/hf_ep.py --out bench/results` |
| hf_ep_table | bench/README.md | `bench/hf_ep.py --out bench/results` |
| hf_coverage | README.md | `python -m tests.e2e.hf_coverage --out bench/results` |
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# What README.md calls each architecture (bench/moe_layer.py's --archs takes these too).
DISPLAY_NAMES = {"llama": "Llama 3", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral", "olmoe": "OLMoE",
                 "deepseek_v3": "DeepSeek-V3"}
DENSE = ("llama", "qwen3")


def _load(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; bench/readme_figures.py's docstring says which script writes it")
    return json.loads(path.read_text())


def _range(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"


def _wrap(paragraph: str) -> str:
    return textwrap.fill(paragraph, width=110, break_long_words=False, break_on_hyphens=False)


def _sci(v: float) -> str:
    """4.1e-06 -> '4e-6'."""
    mantissa, exponent = f"{v:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _ms(v: float) -> str:
    return f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


# ---- blocks ---------------------------------------------------------------------------------------------------


def make_train() -> str:
    from moeflow.cli import format_summary

    r = _load("make_train")
    m = r["machine"]
    return (f"Measured on {m['cpu_count']} CPU cores, torch {m['torch']} (`bench/results/make_train.json`):\n\n"
            "```" + format_summary(r["summary"]) + "\n```")


EP_ROUTINGS = {"uniform-64": "uniform, 64 experts", "zipf-64": "Zipf, 64 experts",
               "deepseek-256": "DeepSeek-V3 group-limited, 256"}
EP_BACKENDS = ("pair", "alltoall", "hierarchical")


def ep() -> str:
    r = _load("ep")
    args, meta = r["meta"]["args"], r["meta"]
    rows = {(x["routing"], x["backend"]): x for x in r["rows"] if x["world"] == 8 and x["ranks_per_node"] == 4}
    lines = [_wrap(f"`bench/ep.py` (8 ranks as 2 nodes x 4 on {meta['cpu_count']} CPU cores, torch {meta['torch']}; "
                   f"{args['tokens']} tokens/rank, hidden {args['hidden']} bf16, top-8, median of {args['repeats']}) "
                   "against the TorchTitan/Megatron baseline of one copy per (token, expert) pair:"), "",
             "| routing | backend | MB across nodes | vs baseline | measured ms | speed-up |",
             "|---|---|---|---|---|---|"]
    inter = lambda x: (x["dispatch_inter"] + x["combine_inter"]) / 1e6  # noqa: E731
    for routing, label in EP_ROUTINGS.items():
        base = rows[routing, "pair"]
        for backend in EP_BACKENDS:
            x = rows[routing, backend]
            name = "pair (baseline)" if backend == "pair" else backend
            lines.append(f"| {label} | {name} | {inter(x):.1f} | {inter(x) / inter(base):.2f} | {x['time_ms']:.1f} | "
                         f"{base['time_ms'] / x['time_ms']:.2f}x |")
    return "\n".join(lines)


def hf_speed() -> str:
    block, model = _load("moe_layer"), _load("hf_models")
    arch_rows = (block.get("architectures") or {}).get("rows", {})
    diffs = [v for r in arch_rows.values() for k, d in r["agreement"].items() if k != "output_scale"
             for v in (d["output"], d["input_grad"])]
    diffs += [v for r in model["rows"].values() for k, v in r.items() if "diff" in k]
    m = block["machine"]
    lines = [_wrap(f"Speed, measured by `bench/moe_layer.py` and `bench/hf_models.py` with the same weights on both "
                   f"sides ({m['torch_threads']} threads on {m['logical_cpus']} CPU cores, torch {m['torch']}, "
                   f"transformers {m['transformers']}, fp32, medians of interleaved repeats; outputs agree to "
                   f"{_sci(max(diffs))}; `bench/results/moe_layer.json`, `hf_models.json`):"), "",
             "| architecture | MoE block fwd+bwd ms: moeflow | transformers eager / grouped_mm / batched_mm | whole "
             "model tokens/s: moeflow | transformers eager / grouped_mm |", "|---|---|---|---|---|"]
    block_x, moe_x, dense_x = [], [], []
    for arch, label in DISPLAY_NAMES.items():
        b, w = arch_rows.get(arch), model["rows"].get(arch)
        cells = ["", ""]
        if b:
            hf_ms = b["hf_ms"]
            cells = [_ms(b["moeflow_ms"]), " / ".join(_ms(hf_ms[i]) for i in ("eager", "grouped_mm", "batched_mm"))]
            block_x.append(b["speedup_vs_fastest_hf"])
        if w:
            hf = w["hf_tokens_per_s"]
            impls = ["hf"] if arch in DENSE else ["hf[eager]", "hf[grouped_mm]"]
            cells += [f"{w['moeflow_tokens_per_s']:,.0f}", " / ".join(f"{hf[i]:,.0f}" for i in impls)]
            (dense_x if arch in DENSE else moe_x).append(w["speedup_vs_fastest_hf"])
        else:
            cells += ["", ""]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    s, ms = block["shape"], model["shape"]
    lines += ["", _wrap(f"Block: {s['tokens']} tokens, {s['experts']} experts, top-{s['topk']}, D = {s['hidden']}, F = "
              f"{s['ffn']}. Whole model: {ms['batch']} x {ms['seq']} tokens, D = {ms['hidden']}, "
              f"{ms['layers']} layers, {ms['experts']} experts of width {ms['ffn']}, top-{ms['topk']}. moeflow's "
              f"speed over transformers' fastest experts path: {_range(block_x)} on a block, {_range(moe_x)} on a "
              f"whole MoE model, {_range(dense_x)} on the dense models (above 1x: moeflow is faster).")]
    return "\n".join(lines)


def plan() -> str:
    r = _load("plan_vs_measured")
    return f"Spearman {r['spearman']:.2f} over {len(r['rows'])} one-process layouts"


TRAIN_NOTES = {"dp2 zero2": "at rest", "tp2 moe replicated": "MoE layers replicated over tp, the old default",
               "tp2": "MoE folded: experts over the tp ranks, shared experts sharded over them",
               "pp2 1F1B": "embedding / head stages", "hsdp 2x2": "two replicas",
               "zero1 pp2": "at rest; embedding / head stages"}


def train_layouts() -> str:
    r = _load("train")
    meta = r["meta"]
    lines = [_wrap(f"`train.py`, measured on {meta['cpu_count']} shared CPU cores, torch {meta['torch']} "
                   f"(`bench/results/train.json`: median of {meta['steps']} steps after {meta['warmup']} warm-up; "
                   f"{' '.join(f'`{a}`' for a in meta['model'])}); per-rank state is the largest rank's parameters + "
                   "gradients + AdamW moments."), "",
             "| layout | ranks | tok/s | vs 1 process | state MB per rank | ideal total/N MB | state / ideal |",
             "|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        state = (x["params_bytes"] + x["grads_bytes"] + x["optim_bytes"]) / 1e6
        note = f" ({TRAIN_NOTES[x['layout']]})" if x["layout"] in TRAIN_NOTES else ""
        lines.append(f"| {x['layout']} | {x['world']} | {x['tokens_per_s']:.0f} | {x['speed_vs_1_process']:.2f} | "
                     f"{state:.2f} | {x['ideal_bytes'] / 1e6:.2f} | {x['state_over_ideal']:.2f}{note} |")
    return "\n".join(lines)


VLLM_CASES = {"tiny-moe": "tiny-moe (`make train`'s model)", "qwen3_moe-native": "Qwen3-MoE, moeflow's modules",
              "qwen3_moe-native-lora": "Qwen3-MoE, LoRA r=8 (merged export), moeflow's modules",
              "mixtral-native": "Mixtral, moeflow's modules",
              "qwen3_moe-transformers": "Qwen3-MoE, transformers' modules",
              "glm4_moe-transformers": "GLM-4.5-shaped (partial RoPE, biases), transformers' modules",
              "gpt_oss-transformers": "gpt-oss, transformers' modules",
              "gpt_oss-transformers-lora": "gpt-oss, LoRA r=8 (merged export), transformers' modules"}


def vllm_serve() -> str:
    r = _load("vllm_serve")
    meta = r["meta"]
    lines = [_wrap(f"`bench/vllm_serve.py` (`bench/results/vllm_serve.json`; {meta['versions']} in its own venv; "
                   f"{meta['steps']} training steps under ep=2, exported in {meta['dtype']}; {meta['new_tokens']} "
                   f"greedy tokens after each of {len(meta['prompts'])} prompts, and moeflow's and vLLM's "
                   f"next-token log-probabilities at every prompt position against transformers'):"), "",
             "| run | exported as | moeflow = transformers | vLLM = transformers |", "|---|---|---|---|"]

    def agree(row, key):
        if row.get(key) is None:
            return f"not served: {row.get('vllm_error')}"
        same = sum(x == y for p, q in zip(row["transformers"], row[key]) for x, y in zip(p, q))
        return (f"{same}/{sum(len(p) for p in row['transformers'])} tokens, log-probs within "
                f"{row[key + '_logprob_gap']:.1e}")

    for case, row in r["cases"].items():
        lines.append(f"| {VLLM_CASES.get(case, case)} | `{row['architecture']}` | {agree(row, 'moeflow')} | "
                     f"{agree(row, 'vllm')} |")
    return "\n".join(lines)


def hf_ep() -> str:
    r = _load("hf_ep")
    meta, rows = r["meta"], r["rows"]
    by = {row["case"]: row for row in rows}
    native, hf, oss = by["qwen3_moe native"], by["qwen3_moe transformers"], by["gpt_oss transformers"]
    peer, oss_peer = by["qwen3_moe transformers-ep"], by["gpt_oss transformers-ep"]
    return _wrap(f"Speed (`bench/hf_ep.py`, `bench/results/hf_ep.json`: ep=2 on 2 gloo ranks, "
                 f"{meta['tokens_per_rank']} tokens per rank, fp32, each case in processes of its own, medians of "
                 f"{meta['repeats']} fused-AdamW steps (the fastest of {meta['rounds']} rounds), same weights and "
                 f"first loss): a Qwen3-MoE trains at {hf['tokens_per_s']:,.0f} tokens/s on "
                 f"transformers' modules under moeflow against {native['tokens_per_s']:,.0f} on moeflow's own model "
                 f"({hf['vs_native']:.2f}x) and {peer['tokens_per_s']:,.0f} under transformers' own expert "
                 f"parallelism (`DistributedConfig(fsdp_size=2, ep_size=2)`; moeflow's native path "
                 f"{native['vs_transformers_ep']:.2f}x, its transformers path {hf['vs_transformers_ep']:.2f}x of "
                 f"it); a gpt-oss of the same size at {oss['tokens_per_s']:,.0f} under moeflow against "
                 f"{oss_peer['tokens_per_s']:,.0f} under transformers' own ({oss['vs_transformers_ep']:.2f}x); "
                 f"DeepSpeed's AutoEP trains the Qwen3-MoE at {by['qwen3_moe deepspeed-autoep']['tokens_per_s']:,.0f} "
                 f"(bench/README.md has the table).")


def hf_ep_table() -> str:
    r = _load("hf_ep")
    meta, rows = r["meta"], r["rows"]
    lines = [_wrap(f"`bench/hf_ep.py` (`bench/results/hf_ep.json`): ep=2 on 2 gloo ranks, {meta['tokens_per_rank']} "
                   f"tokens per rank, fp32, hidden {meta['shape']['D']}, {meta['shape']['layers']} layers, "
                   f"{meta['shape']['experts']} experts (top-{meta['shape']['top_k']}), each case in a pair of "
                   f"processes of its own, medians of {meta['repeats']} fused-AdamW steps of the slowest rank (the "
                   f"fastest of {meta['rounds']} rounds, the cases in rotated order); every case of an architecture "
                   f"starts from the same weights and batch and gives the same first loss:"), "",
             "| case | step | tokens/s | vs moeflow native | vs transformers' own EP | vs the fastest peer | "
             "matmul + attention kernels |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        native = f"{row['vs_native']:.2f}" if row["vs_native"] else "-"
        kernels = f"{row['floor_ms']:.0f} ms" if row.get("floor_ms") else "-"
        lines.append(f"| {row['case']} | {row['step_ms']:.0f} ms | {row['tokens_per_s']:,.0f} | {native} | "
                     f"{row['vs_transformers_ep']:.2f} | {row['vs_fastest_peer']:.2f} | {kernels} |")
    by = {row["case"]: row for row in rows}
    best = max(by["qwen3_moe transformers"]["vs_fastest_peer"], by["gpt_oss transformers"]["vs_fastest_peer"])
    lines += ["", _wrap(f"`transformers` is moeflow on transformers' modules (`model.hf_impl = 'transformers'`); the "
                        f"peers: `transformers-ep`, transformers' own `DistributedConfig(fsdp_size=2, ep_size=2)` "
                        f"with a plain loop, and `deepspeed-autoep`, DeepSpeed 0.19.8's AutoEP (ZeRO stage 0, in a "
                        f"venv of its own; it has no gpt-oss preset). Targets: "
                        f"moeflow >= 1.2x the fastest peer ({'met' if best >= 1.2 else 'not met'}: "
                        f"{by['qwen3_moe transformers']['vs_fastest_peer']:.2f}x and "
                        f"{by['gpt_oss transformers']['vs_fastest_peer']:.2f}x on transformers' modules, "
                        f"{by['qwen3_moe native']['vs_fastest_peer']:.2f}x on moeflow's own model); the "
                        f"transformers path within 1.1x of the native one "
                        f"({'met' if by['qwen3_moe transformers']['vs_native'] >= 1 / 1.1 else 'not met'}: "
                        f"{by['qwen3_moe transformers']['vs_native']:.2f}x). The last column is the time of a "
                        f"step's matmul and attention kernels (torch's profiler, one more step of each case), "
                        f"which every program of these fp32 models runs: {meta['kernel_floor_ms']:.0f} ms of a "
                        f"Qwen3-MoE step, so the fastest peer spends {meta['ceiling_vs_fastest_peer']:.2f}x that per "
                        f"step; the rest is elementwise work (norms, activations, rotary embeddings, the optimizer), "
                        f"token and weight movement and the frameworks' own overhead.")]
    return "\n".join(lines)


def lora() -> str:
    r = _load("lora")
    meta, rows, ratios = r["meta"], r["rows"], r["ratios"]
    lines = [_wrap(f"`bench/lora.py` (`bench/results/lora.json`): a Qwen3-MoE of {meta['shape']['layers']} layers, "
                   f"{meta['shape']['experts']} experts (top-{meta['shape']['top_k']}), hidden {meta['shape']['D']}; "
                   f"one process, fp32, {meta['tokens_per_step']} tokens per step, the median of {meta['steps']} "
                   f"{'fused-' if meta.get('fused') else ''}AdamW steps (the fastest of {meta.get('rounds', 2)} "
                   f"rounds); LoRA rank {meta['rank']} on the "
                   f"attention projections and every expert's gate_up / down in both programs:"), "",
             "| case | tokens/s | trained params | gradients + optimizer state | checkpoint | peak RSS | loss after |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['case']} | {row['tokens_per_s']:,.0f} | {row['trainable']:,} | "
                     f"{(row['grad_bytes'] + row['optim_bytes']) / 2**20:.1f} MB | "
                     f"{row['checkpoint_bytes'] / 2**20:.1f} MB | {row['peak_rss_mb']:,.0f} MB | {row['loss']:.4f} |")
    lines += ["", _wrap(f"LoRA's gradients + optimizer state are {ratios['lora_state_vs_full']:.2%} of full "
                        f"fine-tuning's (target <= 5%), its checkpoint {ratios['lora_checkpoint_vs_full']:.2%} "
                        f"(target <= 10%); moeflow's LoRA runs at {ratios['moeflow_lora_vs_peft_tokens_per_s']:.2f}x "
                        f"the tokens/s of transformers + peft (target 1.3x).")]
    return "\n".join(lines)


def optim() -> str:
    r = _load("optim")
    meta, rows = r["meta"], r["rows"]
    small = next(row["tokens_per_rank"] for row in rows if row["case"] == "1 process")
    lines = [_wrap(f"`bench/optim.py` (`bench/results/optim.json`): tiny-moe, fp32, {small} tokens per rank (the "
                   f"last row: the default job's 16 x 128 in one process), medians of {meta['repeats']} "
                   f"alternating steps of the slowest rank; `muon` "
                   f"sends each sharded matrix to one owner rank and its result back (two all-to-alls, the "
                   f"trainer's scheme), `muon-gather` every shard to every rank and the results summed (the scheme "
                   f"it replaced):"), "",
             "| layout | optimizer | training step | optimizer step | Newton-Schulz | matrices orthogonalised / in the "
             "model | MB sent per step (max rank / planned) | step vs AdamW |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        muon = row["optimizer"] == "muon"
        sent = ("-" if "sent_mb" not in row else f"{row['sent_mb']:.3f} / {row['planned_mb']:.3f}" if muon
                else f"{row['sent_mb']:.3f}")
        lines.append(f"| {row['case']} | {row['optimizer']} | {row['step_ms']:.1f} ms | {row['optim_ms']:.1f} ms | "
                     + (f"{row['ns_ms']:.1f} ms | {row['ns_matrices']:.0f} / {row['model_matrices']}" if muon
                        else "- | -") + f" | {sent} | {row['step_vs_adamw']:.2f} |")
    by = {(row["case"], row["optimizer"]): row for row in rows}
    one, default = by[("1 process", "muon")], by[("1 process, 16 x 128", "muon")]
    step_gflop = meta["train_gflop_per_token"] * small
    d2, d4 = ((by[(c, "muon-gather")], by[(c, "muon")]) for c in ("dp_shard=2", "dp_shard=4"))
    worst = max(abs(row["sent_mb"] / row["planned_mb"] - 1) for row in rows
                if row["optimizer"] == "muon" and row.get("planned_mb"))
    lines += ["", _wrap(
        f"At 1 process the Muon step is {one['step_vs_adamw']:.2f}x AdamW's at {small} tokens and "
        f"{default['step_vs_adamw']:.2f}x at the default job's {default['tokens_per_rank']:,} (target 1.15x: "
        f"{'met' if default['step_vs_adamw'] <= 1.15 else 'not met'} there, "
        f"{'met' if one['step_vs_adamw'] <= 1.15 else 'not met'} at {small}). Newton-Schulz "
        f"(bf16, each rank's matrices stacked by shape into one batched chain) takes {one['ns_ms']:.1f} ms of the "
        f"{one['optim_ms']:.1f} ms optimizer step: it is {meta['ns_gflop_per_step']:.2f} GFLOP per step whatever "
        f"the batch, {meta['ns_gflop_per_step'] / step_gflop:.1f}x the {step_gflop:.2f} GFLOP of the forward and "
        f"backward of {small} tokens, so at that batch no kernel brings the ratio to 1.15x (torch.optim.Muon, "
        f"torch's single-device reference, takes {meta['reference']['torch_muon_ms']:.1f} ms for its step over the "
        f"same {meta['reference']['matrices']} matrices, moeflow's Muon {meta['reference']['moeflow_muon_ms']:.1f} "
        f"ms); "
        f"Newton-Schulz is 15% of the training FLOPs from "
        f"{meta['ns_gflop_per_step'] / (0.15 * meta['train_gflop_per_token']):,.0f} tokens per step (a pretraining "
        f"batch is millions). Under 2 and 4 gloo ranks the all-to-all scheme sends "
        f"{d2[0]['sent_mb'] / d2[1]['sent_mb']:.0f}x and {d4[0]['sent_mb'] / d4[1]['sent_mb']:.0f}x fewer bytes "
        f"than gathering (dp_shard=2 and 4: the experts, cut between matrices, move nothing) and takes the Muon "
        f"step from {d2[0]['step_vs_adamw']:.2f}x to {d2[1]['step_vs_adamw']:.2f}x AdamW's at dp_shard=2 and from "
        f"{d4[0]['step_vs_adamw']:.2f}x to {d4[1]['step_vs_adamw']:.2f}x at 4; the busiest rank sends within "
        f"{worst:.1%} of the planner's figure (the mean rank's). Every matrix is orthogonalised once, by one "
        f"rank, under every layout.")]
    return "\n".join(lines)


def data_prep() -> str:
    r = _load("data_prep")
    meta, prep, blend = r["meta"], r["prep"], r["blend"]
    lines = [_wrap(f"`bench/data_prep.py` (`bench/results/data_prep.json`): {meta['corpus_mb']} MB of jsonl documents "
                   f"(the standard library's sources, repeated) in {meta['shards']} shards, a byte-level BPE of "
                   f"{meta['vocab']:,} tokens, {meta['cpu_count']} CPU cores; every tool writes each document's ids "
                   f"and an end-of-document token:"), "",
             "| tokenizer run | seconds | tokens | tokens/s | vs the fastest peer |", "|---|---|---|---|---|"]
    for row in prep:
        vs = f"{row['vs_fastest_peer']:.2f}x" if row["vs_fastest_peer"] else "-"
        lines.append(f"| {row['tool']} | {row['seconds']:.1f} | {row['tokens']:,} | {row['tokens_per_s']:,.0f} "
                     f"| {vs} |")
    one, mixed = blend["rows"]["one source"], blend["rows"]["blend of three"]
    lines += ["", _wrap(f"Target (moeflow's cache at least the fastest peer): "
                        f"{'met' if r['prep_target_met'] else 'not met'}. Training tiny-moe fed by a blend of three "
                        f"sources runs at {blend['tokens_per_s_ratio']:.3f}x the tokens/s of one source "
                        f"({mixed['tokens_per_s']:,.0f} against {one['tokens_per_s']:,.0f}; interleaved blocks of "
                        f"{meta['steps_per_block']} steps, medians of {meta['blocks']}); the blend's sampler takes "
                        f"{mixed['loader_ms']:.2f} ms of a {mixed['step_ms']:.0f} ms step against "
                        f"{one['loader_ms']:.2f} ms ({blend['loader_overhead']:.2%} of a step more; target <= 2%: "
                        f"{'met' if r['blend_target_met'] else 'not met'}).")]
    return "\n".join(lines)


def _short(reason: str) -> str:
    """A refusal's first clause, for a table cell."""
    return reason.split(";")[0].split(": ", 1)[-1].strip().rstrip(".")


def hf_coverage() -> str:
    r = _load("hf_coverage")
    caps, cells = r["capabilities"], r["cells"]
    reasons: list[str] = []  # footnotes, in order of first use

    def cell(value: str) -> str:
        if value == "ok":
            return "✓"
        if "which moeflow cannot load" in value:  # not one of the natively mapped architectures
            return "–"
        short = _short(value)
        if short not in reasons:
            reasons.append(short)
        return f"✗{reasons.index(short) + 1}"

    ok = sum(all(row.get(c) == "ok" for c in ("ep=2", "read", "dp=2", "export", "generate"))
             for row in cells.values())
    lines = [_wrap(f"`python -m tests.e2e.hf_coverage --out bench/results` (`bench/results/hf_coverage.json`, "
                   f"transformers {r['transformers']}): {len(cells)} architectures found, {ok} train under ep=2 "
                   f"and dp=2 as one process, are read rank-locally into ep=2 (each rank its own experts, through "
                   f"transformers' checkpoint conversion), export and generate as transformers does."), "",
             "| architecture | " + " | ".join(caps) + " |", "|---|" + "---|" * len(caps)]
    for arch, row in sorted(cells.items()):
        lines.append(f"| {arch} | " + " | ".join(cell(row.get(c, "not run")) for c in caps) + " |")
    notes = ["–: not one of the architectures moeflow's own model maps (it runs on transformers' modules)"]
    notes += [f"✗{i + 1}: {why}" for i, why in enumerate(reasons)]
    lines += [""] + [note + ("  " if i + 1 < len(notes) else "") for i, note in enumerate(notes)]
    by_reason: dict[str, list[str]] = {}
    for arch, why in sorted(r.get("not_fitting", {}).items()):
        by_reason.setdefault(why, []).append(arch)
    if by_reason:
        lines += ["", _wrap("Found but not trained, having no text-only causal LM: " + "; ".join(
            f"{', '.join(archs)} ({why})" for why, archs in by_reason.items()) + ".")]
    return "\n".join(lines)


# block name -> (file, renderer, inline: the block sits inside a sentence)
BLOCKS = {
    "make_train": ("README.md", make_train, False),
    "ep": ("README.md", ep, False),
    "hf_speed": ("README.md", hf_speed, False),
    "plan": ("README.md", plan, True),
    "train_layouts": ("bench/README.md", train_layouts, False),
    "vllm_serve": ("README.md", vllm_serve, False),
    "hf_ep": ("README.md", hf_ep, False),
    "hf_coverage": ("README.md", hf_coverage, False),
    "lora": ("bench/README.md", lora, False),
    "optim": ("bench/README.md", optim, False),
    "hf_ep_table": ("bench/README.md", hf_ep_table, False),
    "data_prep": ("bench/README.md", data_prep, False),
}


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- bench:{name} -->)(.*?)(<!-- /bench:{name} -->)", re.DOTALL)


def rendered(name: str) -> str:
    _, render, inline = BLOCKS[name]
    return render() if inline else "\n" + render() + "\n\n"  # the blank line ends a table before the marker


def stale_blocks(texts: dict[str, str] | None = None) -> list[str]:
    """Names of the blocks whose text in the READMEs (or in `texts`, {file: text}) is not what the JSON gives,
    with why; [] when every figure matches."""
    texts = texts or {f: (REPO / f).read_text() for f, _, _ in BLOCKS.values()}
    out = []
    for name, (file, _, _) in BLOCKS.items():
        m = _pattern(name).search(texts[file])
        if m is None:
            out.append(f"{name}: no <!-- bench:{name} --> ... <!-- /bench:{name} --> markers in {file}")
        elif m.group(2) != rendered(name):
            out.append(f"{name} ({file}): differs from bench/results; run `python bench/readme_figures.py`")
    return out


def write_all() -> list[str]:
    changed = []
    for file in sorted({f for f, _, _ in BLOCKS.values()}):
        path = REPO / file
        text = path.read_text()
        new = text
        for name, (f, _, _) in BLOCKS.items():
            if f == file:
                if not _pattern(name).search(new):
                    raise ValueError(f"{file} has no <!-- bench:{name} --> ... <!-- /bench:{name} --> markers")
                new = _pattern(name).sub(lambda m, name=name: m.group(1) + rendered(name) + m.group(3), new)
        if new != text:
            path.write_text(new)
            changed.append(file)
    return changed


def record_make_train(summary_path: str) -> Path:
    """Copy a `make train` summary.json into bench/results/make_train.json with the machine it ran on."""
    import torch

    out = RESULTS / "make_train.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": "make train", "summary": json.loads(Path(summary_path).read_text()),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                          "python": platform.python_version()}}
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a README's figures differ from the JSON")
    p.add_argument("--record-make-train", metavar="SUMMARY_JSON", help="store a `make train` summary.json first")
    args = p.parse_args(argv)
    if args.record_make_train:
        print(f"wrote {record_make_train(args.record_make_train)}")
    if args.check:
        stale = stale_blocks()
        print("\n".join(stale) or "every README figure matches bench/results")
        return 1 if stale else 0
    print(f"rewrote {', '.join(write_all()) or 'nothing (already current)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
