"""FP8 compute for training (training.fp8), through torchao; weights, gradients, optimizer state and checkpoints
stay in high precision: FP8 is only the format of the matmuls' inputs, cast afresh every step.

What is converted, by recipe:
  tensorwise | rowwise   dense and attention nn.Linear layers -> torchao.float8's Float8Linear (one scale per tensor,
                         or per row with power-of-two scales); routed experts -> torchao's FP8 rowwise grouped GEMM
                         (the only FP8 grouped recipe torchao has, whichever dense recipe is chosen).
  mxfp8                  dense Linear layers and routed experts -> torchao's MXFP8 training ops (e4m3 with one
                         power-of-two scale per 32 elements, the OCP microscaling format).
Always high precision: the router gates (top-k choices flip under FP8 noise), the output head and the embeddings
(DeepSeek-V3 report, sec. 3.3.1, keeps these, the MoE gating and the norms in BF16/FP32), and every norm.
A Linear is converted only where the kernels' shape rules hold: both widths multiples of 16 (FP8 `_scaled_mm`),
or of 32 with no bias for MXFP8 (torchao 0.18's MXFP8 weight wrapper drops a Linear's bias); the tokens of a
micro-batch must be a multiple of 16 (32), which the job config checks through data.seq_len.
Expert token groups are padded to the alignment the grouped kernels need (16 rows for FP8, 32 for MXFP8:
GroupedExperts.group_alignment), and the grouped GEMMs get the weights column-major, as both require (moeflow
stores experts [E, in, out] row-major, torchao's layout is [E, out, in]; one transposed copy per forward).

The grouped GEMMs return bf16 (torchao's default; its emulation accepts no other), which the MoE's combine casts
back to the activations' dtype.

Where it runs (torchao 0.18, torch 2.13):
- CUDA: tensorwise/rowwise dense need sm89+; the FP8 grouped GEMM needs sm90 and Triton; MXFP8 needs SM100
  (Blackwell) kernels. Elsewhere: refused, with the reason.
- CPU: torchao's emulation (real e4m3/e5m2 quantisation, fp32 matmuls): float8 dense with emulate=True, MXFP8 dense
  and grouped with KernelPreference.EMULATED. The FP8 rowwise grouped GEMM has no emulation (Triton kernels, then
  torch._scaled_grouped_mm, which has no CPU kernel), so an MoE model with tensorwise/rowwise is refused on a CPU.
  Emulation is for tests: it is slower than bf16.
Applied by parallelize after tensor and expert parallelism (only this rank's experts are wrapped) and before FSDP,
which shards the converted modules (TorchTitan's order).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moeflow.core.choices import FP8_RECIPES
from moeflow.models.moe import GroupedExperts
from moeflow.parallel.torch_compat import torch_minor

GROUP_ALIGNMENT = {"tensorwise": 16, "rowwise": 16, "mxfp8": 32}


def keeps_high_precision(fqn: str) -> bool:
    """Router gates, the output head (`lm_head` in Hugging Face models) and the dense layers of MTP modules, which
    see S - k positions per sequence: the FP8 weight-gradient matmul reduces over tokens, which its kernels need in
    multiples of 16 (32 for MXFP8). Embeddings are not Linear layers and are never touched."""
    return fqn.endswith("router.gate") or fqn.rsplit(".", 1)[-1] in ("output", "lm_head") or fqn.startswith("mtp.")


def dense_filter(recipe: str):
    """filter(module, fqn) -> whether a Linear is converted: not kept high precision, and of kernel-friendly shape."""
    multiple = 32 if recipe == "mxfp8" else 16

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or keeps_high_precision(fqn):
            return False
        if recipe == "mxfp8" and module.bias is not None:
            return False
        return module.in_features % multiple == 0 and module.out_features % multiple == 0

    return convert


def refusal(recipe: str, device_type: str, has_experts: bool) -> str | None:
    """Why `recipe` cannot run here (None: it can), checked before anything is converted."""
    if recipe == "none":
        return None
    if recipe not in FP8_RECIPES:
        return f"training.fp8 = {recipe!r} is not one of {list(FP8_RECIPES)}"
    if importlib.util.find_spec("torchao") is None:
        return f"training.fp8 = {recipe!r} needs torchao: pip install 'torchao>=0.18,<0.19'"
    if recipe == "mxfp8" and torch_minor() < (2, 13):
        # torchao 0.18's MXFP8 training asserts DTensor features that torch 2.11 lacks (2.13 has them)
        return (f"training.fp8 = 'mxfp8' needs torch 2.13 or newer (this is {torch.__version__}); use 'rowwise' or "
                f"'tensorwise', or upgrade torch")
    if device_type == "cpu":
        if has_experts and recipe in ("tensorwise", "rowwise"):
            return (f"training.fp8 = {recipe!r} sends the routed experts through torchao's FP8 rowwise grouped GEMM, "
                    f"which needs CUDA (sm90) and Triton and has no CPU emulation; on a CPU use training.fp8 = "
                    f"'mxfp8' (emulated there), or a dense model")
        return None
    if device_type != "cuda":
        return f"training.fp8 = {recipe!r} runs on CUDA GPUs (or emulated on a CPU), not on {device_type!r}"
    major, minor = torch.cuda.get_device_capability()
    if recipe == "mxfp8" and major < 10:
        return (f"training.fp8 = 'mxfp8' needs MXFP8 tensor cores (SM100, Blackwell); this GPU is sm{major}{minor}: "
                f"use training.fp8 = 'rowwise' or 'tensorwise'")
    if (major, minor) < (8, 9):
        return f"training.fp8 = {recipe!r} needs FP8 tensor cores (sm89+); this GPU is sm{major}{minor}"
    if has_experts and major < 9:
        return (f"training.fp8 = {recipe!r}: torchao's FP8 grouped GEMM for the routed experts needs sm90; this GPU "
                f"is sm{major}{minor}")
    return None


def _quiet_torchao_import() -> None:
    # torchao logs (through `logging`) that its CUDA extensions do not load on a CPU-only torch, and torch's pytree
    # logs a deprecation about two torchao enums; neither matters here.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def apply_fp8(model: nn.Module, recipe: str, device_type: str) -> dict[str, list[str]]:
    """Convert `model` in place for `recipe` ('none' does nothing); returns the converted module names
    {"dense": [...], "experts": [...]}. ValueError (see `refusal`) where it cannot run."""
    converted: dict[str, list[str]] = {"dense": [], "experts": []}
    if recipe == "none":
        return converted
    experts = {fqn: m for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)}
    why = refusal(recipe, device_type, bool(experts))
    if why:
        raise ValueError(why)
    emulated = device_type == "cpu"
    _quiet_torchao_import()
    from torchao import quantize_

    dense = dense_filter(recipe)
    converted["dense"] = [fqn for fqn, m in model.named_modules() if dense(m, fqn)]
    if recipe == "mxfp8":
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.quantization.quantize_.common import KernelPreference

        for fqn, m in experts.items():
            _check_mxfp8_widths(fqn, m)
        kernel = KernelPreference.EMULATED if emulated else KernelPreference.AUTO
        # quantize_ wraps every parameter of a matched module and of its children, so the filter matches leaves only
        # (a Linear, or GroupedExperts, which holds nothing but its three weights).
        quantize_(model, MXFP8TrainingOpConfig(kernel_preference=kernel),
                  filter_fn=lambda m, fqn: dense(m, fqn) or isinstance(m, GroupedExperts))
    else:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulated)
        convert_to_float8_training(model, config=config, module_filter_fn=dense)
        if experts:
            from torchao.prototype.moe_training.config import Float8TrainingOpConfig

            quantize_(model, Float8TrainingOpConfig(),
                      filter_fn=lambda m, fqn: isinstance(m, GroupedExperts))
    for fqn, m in experts.items():
        m.impl = "grouped_mm"  # the op torchao's wrappers intercept
        m.group_alignment = GROUP_ALIGNMENT[recipe]
        m.column_major_weights = True
        converted["experts"].append(fqn)
    return converted


def _check_mxfp8_widths(fqn: str, experts: GroupedExperts) -> None:
    if experts.dim % 32 or experts.hidden % 32:
        raise ValueError(f"training.fp8 = 'mxfp8' scales blocks of 32 along each matmul's inner width, but {fqn} has "
                         f"model width {experts.dim} and expert width {experts.hidden}; use multiples of 32 "
                         f"(model.dim, model.moe.ffn_dim) or another training.fp8 recipe")


def high_precision(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside torchao's FP8/MXFP8 training weight wrapper (and inside a DTensor holding one), else
    `t`: what checkpoints store and load into, so they never depend on torchao or on the recipe."""
    wrappers = sys.modules.get("torchao.prototype.moe_training.tensor")  # never imported: nothing is wrapped
    if wrappers is None:
        return t
    if isinstance(t, DTensor):
        local = t.to_local()
        plain = high_precision(local)
        return t if plain is local else DTensor.from_local(plain, t.device_mesh, t.placements, run_check=False,
                                                            shape=t.shape, stride=t.stride())
    return t._data if isinstance(t, wrappers.TrainingWeightWrapperBaseTensor) else t
