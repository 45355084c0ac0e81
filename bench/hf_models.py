"""Whole models, forward + backward: moeflow against Hugging Face transformers, same weights, tokens/s.

For each supported architecture (Llama-3, Qwen3, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3) a small random
transformers model is saved once; moeflow loads that folder (moeflow.models.hf.from_pretrained) and both run
the compute of a training step: forward, cross-entropy on the shifted tokens, backward. transformers runs with
attention 'sdpa' (as moeflow) and, for the MoE models, each of its experts implementations 'eager' and
'grouped_mm' (its 'batched_mm' gathers every routed row's expert weights, GBs per layer kept for backward;
bench/moe_layer.py times it on one block, 20-80x slower than the others on a CPU). Logits and losses are
compared before timing; repeats of all cases are interleaved in a shuffled order, and the figure is the median.

    .venv/bin/python bench/hf_models.py            # 4 x 256 tokens, D=256, 4 layers, E=16 top-4, 10 repeats
    .venv/bin/python bench/hf_models.py --quick    # 2 repeats: a smoke run

Writes bench/out/hf_models.json and bench/out/hf_models.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from moe_layer import DISPLAY_NAMES, Case, machine_info, parse_archs, time_cases  # noqa: E402

from moeflow.models.hf import from_pretrained  # noqa: E402

ARCHS = ("llama", "qwen3", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3")
MOE_ARCHS = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3")
HF_EXPERT_IMPLS = ("eager", "grouped_mm")


def hf_config(arch: str, a: argparse.Namespace):
    """One small shape for all: D wide, L layers, H heads of D/H, E experts of width F, top-K; dense FFNs of
    width K*F, so every model does about the same FFN work per token."""
    import transformers as t

    D, H = a.hidden, a.heads
    common = dict(vocab_size=a.vocab, hidden_size=D, num_hidden_layers=a.layers, num_attention_heads=H,
                  max_position_embeddings=a.seq)
    moe = dict(num_experts_per_tok=a.topk)
    if arch == "llama":
        return t.LlamaConfig(**common, num_key_value_heads=H // 2, intermediate_size=a.topk * a.ffn)
    if arch == "qwen3":
        return t.Qwen3Config(**common, num_key_value_heads=H // 2, head_dim=D // H, intermediate_size=a.topk * a.ffn)
    if arch == "qwen3_moe":
        return t.Qwen3MoeConfig(**common, **moe, num_key_value_heads=H // 2, head_dim=D // H, num_experts=a.experts,
                                moe_intermediate_size=a.ffn, intermediate_size=a.topk * a.ffn, norm_topk_prob=True)
    if arch == "mixtral":
        return t.MixtralConfig(**common, **moe, num_key_value_heads=H // 2, num_local_experts=a.experts,
                               intermediate_size=a.ffn)
    if arch == "olmoe":
        return t.OlmoeConfig(**common, **moe, num_key_value_heads=H, num_experts=a.experts, intermediate_size=a.ffn,
                             pad_token_id=0, eos_token_id=1)
    return t.DeepseekV3Config(
        **common, **moe, num_key_value_heads=H, n_routed_experts=a.experts, moe_intermediate_size=a.ffn,
        intermediate_size=a.topk * a.ffn, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=D // 2, kv_lora_rank=D // 4, qk_nope_head_dim=D // H, qk_rope_head_dim=D // H // 2,
        v_head_dim=D // H,
    )


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order 1/sqrt(fan-in) (routing far from ties, so both sides route alike), norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1 + 0.1 * noise if "norm" in name else noise * (1.0 if "embed" in name else p.shape[-1] ** -0.5))


def train_step_case(name: str, forward, params: list, x: torch.Tensor, group: str) -> Case:
    def fn():
        logits = forward(x)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()

    return Case(name, fn, params, group)


def build_cases(args, folder_root: Path) -> tuple[list[Case], dict]:
    import transformers

    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(args.seed))
    cases, checks = [], {}
    for arch in args.archs:
        folder = folder_root / arch
        hf = transformers.AutoModelForCausalLM.from_config(hf_config(arch, args))
        randomize(hf, args.seed)
        hf.save_pretrained(folder)
        model, cfg = from_pretrained(folder)
        with torch.no_grad():
            ref = model(x)
        checks[arch] = {"params_M": cfg.num_params() / 1e6, "logits_scale": float(ref.abs().max())}
        cases.append(train_step_case(f"{arch} moeflow", model, list(model.parameters()), x, "moeflow"))
        for impl in HF_EXPERT_IMPLS if arch in MOE_ARCHS else ("eager",):
            kwargs = {"experts_implementation": impl} if arch in MOE_ARCHS else {}
            twin = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", **kwargs)
            with torch.no_grad():
                checks[arch][f"hf[{impl}] logits max abs diff"] = float((twin(x).logits - ref).abs().max())
            label = f"hf[{impl}]" if arch in MOE_ARCHS else "hf"
            cases.append(train_step_case(f"{arch} {label}", lambda t, m=twin: m(t).logits, list(twin.parameters()),
                                         x, "hf"))
    return cases, checks


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--archs", default=",".join(ARCHS),
                   help=f"comma list of {', '.join(f'{DISPLAY_NAMES[a]} ({a})' for a in ARCHS)}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256, help="D")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--experts", type=int, default=16, help="E")
    p.add_argument("--topk", type=int, default=4, help="K")
    p.add_argument("--ffn", type=int, default=256, help="F, expert width (dense FFNs get K * F)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="2 repeats, 1 warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    args = p.parse_args(argv)
    try:
        args.archs = parse_archs(args.archs, ARCHS)
    except ValueError as e:
        p.error(str(e))
    if args.quick:
        args.repeats, args.warmup = 2, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tokens = args.batch * args.seq
    info = machine_info(args.threads)
    print(f"hf_models bench: {args.batch} x {args.seq} tokens, D={args.hidden} L={args.layers} H={args.heads} "
          f"V={args.vocab} E={args.experts} K={args.topk} F={args.ffn}, fp32, forward + loss + backward, "
          f"{args.repeats} repeats (interleaved) after {args.warmup} warm-up")
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    with tempfile.TemporaryDirectory() as tmp:
        cases, checks = build_cases(args, Path(tmp))
        time_cases(cases, args.warmup, args.repeats, args.seed)
    med = {c.name: statistics.median(c.times_ms) for c in cases}

    print(f"\n{'architecture':13s} {'params':>8s} {'moeflow':>9s} {'hf[eager]':>10s} {'hf[grouped_mm]':>15s} "
          f"{'moeflow / fastest hf':>21s}  logits max abs diff   (tokens/s, medians)")
    rows = {}
    for arch in args.archs:
        mf = tokens / med[f"{arch} moeflow"] * 1e3
        hf = {c.name.split(" ", 1)[1]: tokens / med[c.name] * 1e3 for c in cases
              if c.name.startswith(f"{arch} hf")}
        fastest = max(hf, key=hf.get)
        diff = max(v for k, v in checks[arch].items() if "diff" in k)
        rows[arch] = {"moeflow_tokens_per_s": mf, "hf_tokens_per_s": hf, "fastest_hf": fastest,
                      "speedup_vs_fastest_hf": mf / hf[fastest], **checks[arch],
                      "logits_agree": diff <= 1e-4 * max(1.0, checks[arch]["logits_scale"])}
        eager = hf.get("hf[eager]", hf.get("hf"))
        gmm = f"{hf['hf[grouped_mm]']:15,.0f}" if "hf[grouped_mm]" in hf else f"{'-':>15s}"
        print(f"{arch:13s} {checks[arch]['params_M']:7.1f}M {mf:9,.0f} {eager:10,.0f} {gmm} "
              f"{rows[arch]['speedup_vs_fastest_hf']:20.2f}x  {diff:.1e}")

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"bench": "hf_models", "shape": {k: getattr(args, k) for k in (
        "batch", "seq", "hidden", "heads", "layers", "vocab", "experts", "topk", "ffn")},
        "method": {"repeats": args.repeats, "warmup": args.warmup, "interleaved": True, "statistic": "median"},
        "machine": info, "median_ms": med, "times_ms": {c.name: c.times_ms for c in cases}, "rows": rows}
    json_path, png_path = args.out / "hf_models.json", args.out / "hf_models.png"
    json_path.write_text(json.dumps(result, indent=2))
    plot(rows, png_path, f"whole model fwd+loss+bwd, {args.batch}x{args.seq} tokens, D={args.hidden} "
         f"L={args.layers} E={args.experts} K={args.topk}, fp32, {args.threads} threads\n"
         f"torch {torch.__version__}, transformers {info['transformers']}")
    print(f"wrote {json_path} and {png_path}")
    return 0 if all(r["logits_agree"] for r in rows.values()) else 1


def plot(rows: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {"moeflow": ("tab:blue", lambda r: r["moeflow_tokens_per_s"]),
              "hf[eager] / hf": ("tab:orange", lambda r: r["hf_tokens_per_s"].get("hf[eager]",
                                                                                   r["hf_tokens_per_s"].get("hf"))),
              "hf[grouped_mm]": ("tab:red", lambda r: r["hf_tokens_per_s"].get("hf[grouped_mm]", 0.0))}
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(series)
    for j, (label, (color, value)) in enumerate(series.items()):
        ax.bar([i + j * width for i in range(len(rows))], [value(r) for r in rows.values()], width, label=label,
               color=color)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], list(rows))
    ax.set_ylabel("tokens/s (median), forward + backward")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
