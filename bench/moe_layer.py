"""One MoE block, forward + backward: moeflow against Hugging Face transformers' Qwen3-MoE block.

What is timed (each case is one forward and one backward of the whole block, router included):

  moeflow[grouped_mm|bmm|loop]  moeflow.models.moe.MoE with each GroupedExperts path
  hf[grouped_mm]                transformers' Qwen3MoeSparseMoeBlock, config experts_implementation="grouped_mm"
  hf[eager]                     the same block with experts_implementation="eager" (its per-expert Python loop)
  dense mm floor                the 9 plain matmuls a SwiGLU over N = T*K rows needs (3 forward of [N, D] x [D, F]
                                shapes, 6 backward), no routing, no autograd: the time of the FLOPs alone
  grouped mm floor              the same 9 matmuls as torch._grouped_mm over the routing's expert groups, nothing
                                else: the floor's part that grouping the rows by expert adds
  dense swiglu (autograd)       a dense SwiGLU over the same N rows through autograd (the floor plus activation
                                and autograd overhead; shown for reference)

Then, per architecture (--archs; Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 by default), transformers' own sparse
block of that architecture with random weights against moeflow's MoE built from it by
moeflow.models.hf_live.moe_from_hf_block (same weights, same routing: softmax/sigmoid, renormalised or not,
group-limited, shared experts), timed against each of transformers' experts implementations (eager,
grouped_mm, batched_mm), with outputs and input gradients compared in the same run.

Both models get identical weights (moeflow's are copied into HF's fused gate_up_proj layout), so the check
at the start compares outputs and input gradients. Repeats of all cases are interleaved in a shuffled order
so that noise from other processes on a shared machine falls on every case alike; the reported figure is
the median, and the targets are ratios measured in the same run (docs/design.md, principle 10).

    .venv/bin/python bench/moe_layer.py             # E=16, top-4, D=F=256, 1024 tokens, fp32, 2 threads
    .venv/bin/python bench/moe_layer.py --quick     # a few repeats
    .venv/bin/python bench/moe_layer.py --tokens 4096 --experts 64 --topk 8 --hidden 512
    python bench/moe_layer.py --device cuda --dtype bfloat16 --tokens 8192 --experts 64 --topk 8 \
        --hidden 2048 --ffn 1408 --no-eager --archs ''    # the GPU shape (bench/gpu_measure.py runs it)

With --dtype bfloat16 every case's weights and inputs are bf16 (the floors' too); on CUDA each timed call is
bracketed by torch.cuda.synchronize, so a time is the kernels' and not their launch.

Writes bench/out/moe_layer.json, bench/out/moe_layer.png and bench/out/moe_layer_archs.png.
Shape suffixes: T tokens, K top-k, E experts, D model width, F expert width, N = T*K routed rows.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from readme_figures import DISPLAY_NAMES  # noqa: E402  (bench/, the script's folder)

from moeflow.core.model_config import ModelConfig, MoEConfig  # noqa: E402
from moeflow.models import moe as moe_mod  # noqa: E402

MOEFLOW_IMPLS = ("grouped_mm", "bmm", "loop")
HF_IMPLS = ("grouped_mm", "eager")
# (moeflow at least this many times faster than hf[grouped_mm], moeflow within this factor of the dense mm floor),
# per device type: a CPU's elementwise passes cost more next to its matmuls than a GPU's fused ones do
TARGETS = {"cpu": (1.5, 1.25), "cuda": (1.3, 1.5)}
# Largest max-abs difference between two implementations, relative to the output scale. They are compared in fp32
# (on --device) before the timed cases take --dtype: fp32 sums in another order differ near 1e-6, while in bf16 a
# router logit rounded another way can pick another expert for a token.
AGREE_TOL = 1e-4
DTYPES = ("float32", "bfloat16")


# ---- models ------------------------------------------------------------------------------


def build_moeflow(T: int, E: int, K: int, D: int, F: int, impl: str, seed: int) -> moe_mod.MoE:
    cfg = ModelConfig(
        dim=D,
        moe=MoEConfig(
            num_experts=E,
            top_k=K,
            ffn_dim=F,
            score_func="softmax",
            norm_topk_prob=True,
            load_balance="none",
            expert_impl=impl,
        ),
    ).validate()
    model = moe_mod.MoE(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Router logits of order 1 so the top-k choices are clear (no near-ties between the two models).
        model.router.gate.weight.copy_(torch.randn(E, D, generator=gen) / D**0.5)
        model.experts.w1.copy_(torch.randn(E, D, F, generator=gen) / D**0.5)
        model.experts.w3.copy_(torch.randn(E, D, F, generator=gen) / D**0.5)
        model.experts.w2.copy_(torch.randn(E, F, D, generator=gen) / F**0.5)
    return model


def copy_weights(dst: moe_mod.MoE, src: moe_mod.MoE) -> None:
    with torch.no_grad():
        for p_dst, p_src in zip(dst.parameters(), src.parameters(), strict=True):
            p_dst.copy_(p_src)


def build_hf(src: moe_mod.MoE, impl: str):
    """Qwen3MoeSparseMoeBlock with src's weights; `impl` is its experts_implementation ("grouped_mm", "eager")."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    w1_EDF, w3_EDF, w2_EFD = src.experts.w1, src.experts.w3, src.experts.w2
    E, D, F = w1_EDF.shape
    cfg = Qwen3MoeConfig(
        hidden_size=D,
        moe_intermediate_size=F,
        num_experts=E,
        num_experts_per_tok=src.top_k,
        norm_topk_prob=True,
        hidden_act="silu",
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=F,
        vocab_size=256,
        experts_implementation=impl,
    )
    # The block is built standalone (not through from_pretrained), so set the dispatch key directly too.
    cfg._experts_implementation = impl
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(src.router.gate.weight)
        # HF stores experts as nn.Linear-style [out, in]: gate_up_proj [E, 2F, D] = [gate; up], down_proj [E, D, F].
        block.experts.gate_up_proj.copy_(torch.cat([w1_EDF.transpose(1, 2), w3_EDF.transpose(1, 2)], dim=1))
        block.experts.down_proj.copy_(w2_EFD.transpose(1, 2))
    return block


# ---- timed cases ---------------------------------------------------------------------------


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Case:
    """A callable that runs one forward+backward; `reset` runs before each timed call, untimed."""

    def __init__(self, name: str, fn, params: list[torch.Tensor], group: str):
        self.name, self.fn, self.params, self.group = name, fn, params, group
        self.times_ms: list[float] = []

    def reset(self) -> None:
        for p in self.params:
            p.grad = None

    def run_once(self) -> float:
        self.reset()
        sync()
        t0 = time.perf_counter()
        self.fn()
        sync()
        return (time.perf_counter() - t0) * 1e3


def module_case(name: str, module: torch.nn.Module, x_BSD: torch.Tensor, dy_BSD: torch.Tensor, group: str) -> Case:
    x = x_BSD.detach().clone().requires_grad_(True)

    def fn():
        y = module(x)
        y.backward(dy_BSD)

    return Case(name, fn, [x, *module.parameters()], group)


def randn(gen: torch.Generator, like: torch.Tensor, *shape: int) -> torch.Tensor:
    """Standard normal numbers from the CPU generator `gen` (the same on every device), on `like`'s device and dtype."""
    return torch.randn(shape, generator=gen).to(like)


def dense_mm_floor_case(N: int, D: int, F: int, gen: torch.Generator, like: torch.Tensor) -> Case:
    """The 9 matmuls of a SwiGLU over N rows, forward and backward, with nothing else (no autograd)."""
    x_ND = randn(gen, like, N, D)
    w1_DF, w3_DF = randn(gen, like, D, F), randn(gen, like, D, F)
    w2_FD = randn(gen, like, F, D)
    dy_ND = randn(gen, like, N, D)

    def fn():
        h1_NF, h3_NF = x_ND @ w1_DF, x_ND @ w3_DF  # forward
        y_ND = h3_NF @ w2_FD
        dh_NF = dy_ND @ w2_FD.T  # backward: d(input) and d(weight) of each matmul
        dw2_FD = h1_NF.T @ dy_ND
        dx_ND = dh_NF @ w1_DF.T
        dx_ND += dh_NF @ w3_DF.T
        dw1_DF, dw3_DF = x_ND.T @ dh_NF, x_ND.T @ h1_NF
        return y_ND, dw2_FD, dx_ND, dw1_DF, dw3_DF

    return Case("dense mm floor", fn, [], "floor")


def grouped_mm_floor_case(counts_E: torch.Tensor, D: int, F: int, gen: torch.Generator, like: torch.Tensor) -> Case:
    """The dense floor's 9 matmuls as grouped matmuls over the routing's expert groups (torch._grouped_mm, the
    kernel moeflow's experts call), still with nothing else: what splitting the rows by expert costs by itself."""
    E, N = counts_E.numel(), int(counts_E.sum())
    offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
    x_ND, dy_ND = randn(gen, like, N, D), randn(gen, like, N, D)
    w1_EDF, w3_EDF = randn(gen, like, E, D, F), randn(gen, like, E, D, F)
    w2_EFD = randn(gen, like, E, F, D)
    gmm = torch._grouped_mm

    def fn():
        h1_NF, h3_NF = gmm(x_ND, w1_EDF, offs=offs_E), gmm(x_ND, w3_EDF, offs=offs_E)  # forward
        y_ND = gmm(h3_NF, w2_EFD, offs=offs_E)
        dh_NF = gmm(dy_ND, w2_EFD.transpose(1, 2), offs=offs_E)  # backward, as the dense floor's
        dw2_EFD = gmm(h1_NF.T, dy_ND, offs=offs_E)
        dx_ND = gmm(dh_NF, w1_EDF.transpose(1, 2), offs=offs_E)
        dx_ND += gmm(dh_NF, w3_EDF.transpose(1, 2), offs=offs_E)
        dw1_EDF, dw3_EDF = gmm(x_ND.T, dh_NF, offs=offs_E), gmm(x_ND.T, h1_NF, offs=offs_E)
        return y_ND, dw2_EFD, dx_ND, dw1_EDF, dw3_EDF

    return Case("grouped mm floor", fn, [], "floor")


def dense_swiglu_case(N: int, D: int, F: int, gen: torch.Generator, like: torch.Tensor) -> Case:
    ffn = moe_mod.FeedForward(D, F).to(like)
    x = randn(gen, like, N, D).requires_grad_(True)
    dy = randn(gen, like, N, D)

    def fn():
        ffn(x).backward(dy)

    return Case("dense swiglu (autograd)", fn, [x, *ffn.parameters()], "floor")


# ---- agreement -----------------------------------------------------------------------------


def fwd_bwd(module, x_BSD, dy_BSD):
    x = x_BSD.detach().clone().requires_grad_(True)
    for p in module.parameters():
        p.grad = None
    y = module(x)
    y.backward(dy_BSD)
    return y.detach(), x.grad.detach()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def check_agreement(mf: dict, hf: dict, x, dy) -> dict:
    """Max abs differences of outputs, input gradients and weight gradients, moeflow[impl] vs the others."""
    ref = next(iter(mf.values()))
    y_ref, dx_ref = fwd_bwd(ref, x, dy)
    g_ref = {
        "router": ref.router.gate.weight.grad.clone(),
        "gate_up": torch.cat([ref.experts.w1.grad.transpose(1, 2), ref.experts.w3.grad.transpose(1, 2)], dim=1),
        "down": ref.experts.w2.grad.transpose(1, 2).clone(),
    }
    out = {"output_scale": float(y_ref.abs().max()), "input_grad_scale": float(dx_ref.abs().max())}
    for name, m in list(mf.items())[1:]:
        y, dx = fwd_bwd(m, x, dy)
        out[f"{name} vs {next(iter(mf))}"] = {"output": max_abs(y, y_ref), "input_grad": max_abs(dx, dx_ref)}
    for name, block in hf.items():
        y, dx = fwd_bwd(block, x, dy)
        out[f"{next(iter(mf))} vs {name}"] = {
            "output": max_abs(y, y_ref),
            "input_grad": max_abs(dx, dx_ref),
            "router_grad": max_abs(block.gate.weight.grad, g_ref["router"]),
            "gate_up_grad": max_abs(block.experts.gate_up_proj.grad, g_ref["gate_up"]),
            "down_grad": max_abs(block.experts.down_proj.grad, g_ref["down"]),
        }
    return out


# ---- per-architecture blocks ---------------------------------------------------------------

ARCHS = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3")
# --archs takes either spelling: the model_type keys above, or what README.md calls them (DISPLAY_NAMES).
HF_EXPERT_IMPLS = ("eager", "grouped_mm", "batched_mm")  # transformers 5's experts_implementation choices
# batched_mm gathers each routed row's expert weights ([T*K, 2F, D]: GBs at the default shape) and is 20-40x slower
# than the others on a CPU; timed in a few separate runs after the interleaved ones, so that its memory traffic
# does not slow the cases it would be interleaved with.
SEPARATE_IMPLS = ("batched_mm",)
SEPARATE_REPEATS = 3


def build_hf_arch_block(arch: str, E: int, K: int, D: int, F: int, seed: int):
    """(transformers' sparse block of `arch` with weights of order 1/sqrt(fan-in), its config)."""
    import transformers as t
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    attn = dict(hidden_size=D, num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
    if arch == "qwen3_moe":
        cfg = t.Qwen3MoeConfig(**attn, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                               norm_topk_prob=True)
        block_cls = Qwen3MoeSparseMoeBlock
    elif arch == "mixtral":
        cfg = t.MixtralConfig(**attn, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K)
        block_cls = MixtralSparseMoeBlock
    elif arch == "olmoe":
        cfg = t.OlmoeConfig(**attn, intermediate_size=F, num_experts=E, num_experts_per_tok=K, norm_topk_prob=False)
        block_cls = OlmoeSparseMoeBlock
    else:
        cfg = t.DeepseekV3Config(**attn, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K,
                                 n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                                 first_k_dense_replace=0)
        block_cls = DeepseekV3MoE
    cfg._experts_implementation = "eager"
    block = block_cls(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        for name, b in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return block, cfg


def hf_block_with_impl(block, impl: str):
    """A copy of `block` whose experts run transformers' `impl` path (the experts read their config's key)."""
    twin = copy.deepcopy(block)
    twin.experts.config._experts_implementation = impl
    return twin


def arch_section(args, x_BSD: torch.Tensor, dy_BSD: torch.Tensor) -> dict:
    """x_BSD, dy_BSD: the timed cases' input and output gradient (--device, --dtype)."""
    from moeflow.models.hf_live import moe_from_hf_block

    E, K, D, F = args.experts, args.topk, args.hidden, args.ffn
    x32, dy32 = x_BSD.float(), dy_BSD.float()
    cases, separate, agreement = [], [], {}
    for arch in args.archs:
        block, cfg = build_hf_arch_block(arch, E, K, D, F, args.seed)
        mf = moe_from_hf_block(block, cfg)
        block, mf = block.to(x32), mf.to(x32)
        y_ref, dx_ref = fwd_bwd(mf, x32, dy32)
        agreement[arch] = {"output_scale": float(y_ref.abs().max())}
        cases.append(module_case(f"{arch} moeflow[{mf.experts.resolve_impl(x_BSD)}]", mf.to(x_BSD), x_BSD, dy_BSD,
                                 "moeflow"))
        for impl in HF_EXPERT_IMPLS:
            twin = hf_block_with_impl(block, impl)
            y, dx = fwd_bwd(twin, x32, dy32)
            agreement[arch][impl] = {"output": max_abs(y, y_ref), "input_grad": max_abs(dx, dx_ref)}
            (separate if impl in SEPARATE_IMPLS else cases).append(
                module_case(f"{arch} hf[{impl}]", twin.to(x_BSD), x_BSD, dy_BSD, "hf"))
    time_cases(cases, args.warmup, args.repeats, args.seed)
    # in fp32 the agreement's fwd_bwd above was the separate cases' warm-up
    time_cases(separate, int(x_BSD.dtype != torch.float32), min(args.repeats, SEPARATE_REPEATS), args.seed)
    cases += separate
    med = {c.name: statistics.median(c.times_ms) for c in cases}

    print(f"\nper architecture: transformers' sparse block vs moeflow's MoE built from it (median ms, fwd+bwd, "
          f"T={args.tokens} E={E} K={K} D={D} F={F} {args.dtype})")
    print(f"{'architecture':14s} {'moeflow':>9s} " + " ".join(f"{'hf[' + i + ']':>15s}" for i in HF_EXPERT_IMPLS)
          + f" {'best hf/moeflow':>15s}  max abs diff (output, input grad)")
    rows = {}
    for arch in args.archs:
        mf_name = next(c.name for c in cases if c.name.startswith(f"{arch} moeflow"))
        hf_ms = {i: med[f"{arch} hf[{i}]"] for i in HF_EXPERT_IMPLS}
        fastest = min(hf_ms, key=hf_ms.get)
        worst = max((d["output"], d["input_grad"]) for k, d in agreement[arch].items() if k != "output_scale")
        rows[arch] = {"moeflow_ms": med[mf_name], "moeflow_impl": mf_name.split()[1], "hf_ms": hf_ms,
                      "fastest_hf": fastest, "speedup_vs_fastest_hf": ratio(hf_ms[fastest], med[mf_name]),
                      "agreement": agreement[arch],
                      "outputs_agree": max(worst) <= AGREE_TOL * max(1.0, agreement[arch]["output_scale"])}
        print(f"{arch:14s} {med[mf_name]:9.2f} " + " ".join(f"{hf_ms[i]:15.2f}" for i in HF_EXPERT_IMPLS)
              + f" {rows[arch]['speedup_vs_fastest_hf']:14.2f}x  {worst[0]:.1e}, {worst[1]:.1e}")
    print(f"({', '.join(SEPARATE_IMPLS)}: median of {min(args.repeats, SEPARATE_REPEATS)} runs after the interleaved "
          f"ones; the rest: {args.repeats} interleaved repeats)")
    return {"rows": rows, "times_ms": {c.name: c.times_ms for c in cases}}


def time_cases(cases: list, warmup: int, repeats: int, seed: int) -> None:
    """Warm up, then `repeats` rounds over all cases in a shuffled order (noise falls on every case alike)."""
    with torch.enable_grad():
        for _ in range(warmup):
            for c in cases:
                c.run_once()
        rng = random.Random(seed)
        for _ in range(repeats):
            order = cases[:]
            rng.shuffle(order)
            for c in order:
                c.times_ms.append(c.run_once())


def plot_archs(rows: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["moeflow", *(f"hf[{i}]" for i in HF_EXPERT_IMPLS)]
    colors = ["tab:blue", "tab:orange", "tab:red", "tab:brown"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals = [r["moeflow_ms"] if name == "moeflow" else r["hf_ms"][name[3:-1]] for r in rows.values()]
        xs = [i + j * width for i in range(len(rows))]
        ax.bar(xs, vals, width, label=name, color=colors[j])
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], list(rows))
    ax.set_yscale("log")  # batched_mm is ~100x the others on a CPU
    ax.set_ylabel("median ms per forward+backward (log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- driver --------------------------------------------------------------------------------


def machine_info(threads: int, device: str) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "mkldnn": torch.backends.mkldnn.is_available(),
        "mkl": torch.backends.mkl.is_available(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="T, tokens in the batch")
    p.add_argument("--experts", type=int, default=16, help="E, routed experts")
    p.add_argument("--topk", type=int, default=4, help="K, experts per token")
    p.add_argument("--hidden", type=int, default=256, help="D, model width")
    p.add_argument("--ffn", type=int, default=None, help="F, expert width (default: --hidden)")
    p.add_argument("--repeats", type=int, default=30, help="timed repeats of every case (interleaved)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs of every case first")
    p.add_argument("--quick", action="store_true", help="3 repeats, 1 warm-up (a smoke run; noisy)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="of every timed case's weights and inputs (the agreement is checked in fp32 first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-eager", action="store_true", help="skip hf[eager] and moeflow[loop] (slow at large E)")
    p.add_argument("--archs", default=",".join(ARCHS),
                   help="architectures for the per-architecture table, comma list of "
                   f"{', '.join(f'{DISPLAY_NAMES[a]} ({a})' for a in ARCHS)}; '' skips")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out", help="folder for the JSON and PNG")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu")
    try:
        args.archs = parse_archs(args.archs, ARCHS)
    except ValueError as e:
        p.error(str(e))
    if args.quick:
        args.repeats, args.warmup = 3, 1
    args.ffn = args.ffn or args.hidden
    return args


def parse_archs(text: str, choices: tuple[str, ...]) -> list[str]:
    """'Qwen3-MoE,mixtral' -> ['qwen3_moe', 'mixtral']: model_type keys or display names, any case; '' -> []."""
    def norm(name: str) -> str:
        return re.sub(r"[\s_-]", "", name.lower())

    lookup = {norm(k): k for k in choices} | {norm(DISPLAY_NAMES[k]): k for k in choices}
    out = []
    for name in filter(None, (a.strip() for a in text.split(","))):
        if norm(name) not in lookup:
            known = ", ".join(f"{DISPLAY_NAMES[k]} ({k})" for k in choices)
            raise ValueError(f"--archs: unknown architecture {name!r}; choose from {known}")
        if lookup[norm(name)] not in out:
            out.append(lookup[norm(name)])
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    T, E, K, D, F = args.tokens, args.experts, args.topk, args.hidden, args.ffn
    N = T * K
    info = machine_info(args.threads, args.device)
    target_vs_hf, target_vs_floor = TARGETS[args.device]
    shape_text = f"T={T} E={E} K={K} D={D} F={F} {args.dtype} on {args.device}"
    print(f"moe_layer bench: {shape_text}, fwd+bwd, {args.repeats} repeats (interleaved) after {args.warmup} warm-up")
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))

    gen = torch.Generator().manual_seed(args.seed + 1)
    like = torch.empty(0, device=args.device, dtype=getattr(torch, args.dtype))  # the timed tensors' device and dtype
    x32_BSD, dy32_BSD = randn(gen, like.float(), 1, T, D), randn(gen, like.float(), 1, T, D)
    x_BSD, dy_BSD = x32_BSD.to(like), dy32_BSD.to(like)

    mf_impls = [i for i in MOEFLOW_IMPLS if not (args.no_eager and i == "loop")]
    hf_impls = [i for i in HF_IMPLS if not (args.no_eager and i == "eager")]
    base = build_moeflow(T, E, K, D, F, mf_impls[0], args.seed).to(args.device)
    mf = {f"moeflow[{mf_impls[0]}]": base}
    for impl in mf_impls[1:]:
        m = build_moeflow(T, E, K, D, F, impl, args.seed).to(args.device)
        copy_weights(m, base)
        mf[f"moeflow[{impl}]"] = m
    auto_impl = moe_mod.DEFAULT_EXPERT_IMPL.get(args.device, "loop")
    hf = {f"hf[{impl}]": build_hf(base, impl).to(args.device) for impl in hf_impls}

    try:
        agree = check_agreement(mf, hf, x32_BSD, dy32_BSD)
    except Exception as e:  # a path that cannot run in fp32 on this device: say so, and still time --dtype
        agree = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}", "output_scale": float("nan"),
                 "input_grad_scale": float("nan")}
        print(f"\nagreement NOT CHECKED: {agree['error']}")
    for module in (*mf.values(), *hf.values()):
        module.to(like)
    print(
        f"\nagreement (fp32 max abs difference; output scale {agree['output_scale']:.3g}, "
        f"input-grad scale {agree['input_grad_scale']:.3g}):"
    )
    for key, d in agree.items():
        if isinstance(d, dict):
            print(f"  {key:36s} " + "  ".join(f"{k} {v:.2e}" for k, v in d.items()))
    worst = max((v for d in agree.values() if isinstance(d, dict) for v in d.values()), default=float("nan"))
    # None: not checked (the JSON's "agreement" holds the error)
    agree_ok = None if "error" in agree else worst <= AGREE_TOL * max(1.0, agree["output_scale"],
                                                                       agree["input_grad_scale"])

    cases = [module_case(name, m, x_BSD, dy_BSD, "moeflow") for name, m in mf.items()]
    cases += [module_case(name, b, x_BSD, dy_BSD, "hf") for name, b in hf.items()]
    with torch.no_grad():
        counts_E = base.router(x_BSD.reshape(-1, D)).tokens_per_expert  # the timed blocks' own expert groups
    cases += [dense_mm_floor_case(N, D, F, gen, like), grouped_mm_floor_case(counts_E, D, F, gen, like),
              dense_swiglu_case(N, D, F, gen, like)]

    time_cases(cases, args.warmup, args.repeats, args.seed)

    med = {c.name: statistics.median(c.times_ms) for c in cases}
    best = {c.name: min(c.times_ms) for c in cases}
    q = {c.name: statistics.quantiles(c.times_ms, n=4) if len(c.times_ms) > 1 else [med[c.name]] * 3 for c in cases}
    mf_best = min((n for n in mf), key=lambda n: med[n])
    flops = 2 * 9 * N * D * F  # 9 matmuls of N x D x F multiply-adds

    def ratios(stat: dict, name: str) -> dict:
        return {
            "vs_hf_grouped_mm": ratio(stat.get("hf[grouped_mm]", float("nan")), stat[name]),  # > 1: faster than HF
            "vs_hf_eager": ratio(stat.get("hf[eager]", float("nan")), stat[name]),
            "to_dense_floor": ratio(stat[name], stat["dense mm floor"]),  # 1 = the floor
        }

    print(
        f"\n{'case':26s} {'median ms':>9s} {'IQR ms':>15s} {'min ms':>7s} {'GFLOP/s':>8s} "
        f"{'hf[gmm]/x':>9s} {'hf[eager]/x':>11s} {'x/floor':>7s}   (ratios of medians; of minima)"
    )
    for c in cases:
        m, r, rb = med[c.name], ratios(med, c.name), ratios(best, c.name)
        print(
            f"{c.name:26s} {m:9.2f} {q[c.name][0]:7.2f}-{q[c.name][2]:<7.2f} {best[c.name]:7.2f} "
            f"{flops / m / 1e6:8.1f} {r['vs_hf_grouped_mm']:9.2f} {r['vs_hf_eager']:11.2f} "
            f"{r['to_dense_floor']:7.2f}   ({rb['vs_hf_grouped_mm']:.2f}; {rb['vs_hf_eager']:.2f}; "
            f"{rb['to_dense_floor']:.2f})"
        )

    auto_name = f"moeflow[{auto_impl}]"
    if auto_name not in med:
        auto_name = mf_best
    r_med, r_min = ratios(med, auto_name), ratios(best, auto_name)
    targets = {
        "moeflow_impl": auto_name,
        "fastest_moeflow_impl_by_median": mf_best,
        "ratios_of_medians": r_med,
        "ratios_of_minima": r_min,
        "target_speedup_vs_hf_grouped_mm": target_vs_hf,
        "target_ratio_to_dense_floor": target_vs_floor,
        "met_vs_hf": r_med["vs_hf_grouped_mm"] >= target_vs_hf,
        "met_vs_floor": r_med["to_dense_floor"] <= target_vs_floor,
        # the floor split in two: grouping the rows by expert (grouped / dense floor), and everything that is not a
        # matmul (routing, permutation, SwiGLU and weighting elementwise, autograd: moeflow / grouped floor)
        "grouped_floor_to_dense_floor": ratio(med["grouped mm floor"], med["dense mm floor"]),
        "ratio_to_grouped_floor": ratio(med[auto_name], med["grouped mm floor"]),
        "outputs_agree": agree_ok,
    }
    print(f"\nDEFAULT_EXPERT_IMPL[{args.device!r}] = {auto_impl!r}; fastest measured moeflow path here: {mf_best}")
    print(
        f"target: {auto_name} >= {target_vs_hf}x faster than hf[grouped_mm]: {r_med['vs_hf_grouped_mm']:.2f}x "
        f"(minima {r_min['vs_hf_grouped_mm']:.2f}x) -> {'met' if targets['met_vs_hf'] else 'MISSED'}"
    )
    print(
        f"target: {auto_name} within {target_vs_floor}x of the dense mm floor: {r_med['to_dense_floor']:.2f}x "
        f"(minima {r_min['to_dense_floor']:.2f}x) -> {'met' if targets['met_vs_floor'] else 'MISSED'}"
    )
    print(f"the floor split in two: grouped mm floor / dense floor {targets['grouped_floor_to_dense_floor']:.2f}x "
          f"(the matmuls split by expert); {auto_name} / grouped mm floor {targets['ratio_to_grouped_floor']:.2f}x "
          f"(routing, permutation, elementwise, autograd)")
    print(f"outputs agree (max abs diff {worst:.2e}): {agree_ok}")

    archs = arch_section(args, x_BSD, dy_BSD) if args.archs else None

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "bench": "moe_layer",
        "shape": {"tokens": T, "experts": E, "topk": K, "hidden": D, "ffn": F, "dtype": args.dtype,
                  "device": args.device},
        "method": {"repeats": args.repeats, "warmup": args.warmup, "interleaved": True, "statistic": "median"},
        "machine": info,
        "median_ms": med,
        "min_ms": best,
        "quartiles_ms": {k: [v[0], v[2]] for k, v in q.items()},
        "times_ms": {c.name: c.times_ms for c in cases},
        "agreement": agree,
        "targets": targets,
        "architectures": archs,
    }
    json_path = args.out / "moe_layer.json"
    json_path.write_text(json.dumps(result, indent=2))
    png_path = args.out / "moe_layer.png"
    plot(
        cases,
        med,
        q,
        med["dense mm floor"],
        png_path,
        f"MoE block fwd+bwd, {shape_text}, "
        f"{args.threads} threads\ntorch {torch.__version__}, transformers {info['transformers']}",
    )
    if archs:
        arch_png = args.out / "moe_layer_archs.png"
        plot_archs(archs["rows"], arch_png, f"HF sparse blocks vs moeflow MoE, {shape_text}, "
                   f"{args.threads} threads\ntorch {torch.__version__}, transformers {info['transformers']}")
        print(f"wrote {arch_png}")
        if not all(r["outputs_agree"] for r in archs["rows"].values()):
            print("per-architecture outputs DISAGREE")
            return 1
    print(f"wrote {json_path} and {png_path}")
    return 0


def plot(cases, med, q, floor, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"moeflow": "tab:blue", "hf": "tab:orange", "floor": "tab:gray"}
    names = [c.name for c in cases]
    vals = [med[n] for n in names]
    err = [[med[n] - q[n][0] for n in names], [q[n][2] - med[n] for n in names]]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
    ax.barh(names, vals, xerr=err, color=[colors[c.group] for c in cases], capsize=3)
    ax.axvline(floor, color="k", ls="--", lw=1, label="dense mm floor")
    for i, (n, v) in enumerate(zip(names, vals)):
        ax.text(q[n][2], i, f"  {v:.1f} ms ({v / floor:.2f}x floor)", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median ms per forward+backward (bars: interquartile range)")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(vals) * 1.45)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
