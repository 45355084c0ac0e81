"""Building blocks shared by the attention variants: RMSNorm, rotary position embeddings (RoPE) and the
attention core.

Shape suffixes: B batch, H heads, Hk key/value heads, S sequence, Dh head width, Dv value width.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeflow.core.model_config import RopeScaling
from moeflow.models.attention import attend


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x in the dtype autocast runs matmuls in, or as it is outside autocast. For inputs of ops autocast does not
    cast: torch._grouped_mm (not on a CPU in torch 2.13: the experts ran in fp32 under bf16 autocast; on a GPU an
    fp32 input would miss the bf16 grouped GEMM), and attention kernels reached without autocast (context
    parallelism's lower-right causal mask). Cast before a collective, it also halves the bytes moved."""
    if x.is_floating_point() and autocast_on(x):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def autocast_on(x: torch.Tensor) -> bool:
    """Whether autocast is enabled for x's device type (False for types autocast does not know, e.g. meta).
    Compiled code runs on a device autocast knows, and skips the availability check: torch 2.11's dynamo cannot
    trace it (a graph break at every call)."""
    device_type = x.device.type
    known = torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type)
    return known and torch.is_autocast_enabled(device_type)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as Llama's reference does) and cast back before the weight.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, Dh] for the rotate-half convention (the layout Hugging Face checkpoints use)."""
    inv_freq, magnitude = rope_frequencies(head_dim, theta, scaling, max_seq_len)
    angles_SDh2 = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles_SDh = torch.cat([angles_SDh2, angles_SDh2], dim=-1)
    return angles_SDh.cos() * magnitude, angles_SDh.sin() * magnitude


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, max_seq_len: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [Dh/2], cos/sin magnitude), with the long-context rescaling if any."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None or scaling.type == "none":
        return inv_freq, 1.0
    factor, original = scaling.factor, scaling.original_max_seq_len or max_seq_len
    if scaling.type == "llama3":
        # Llama 3.1 (reference code in meta-llama/llama-models): keep short wavelengths, slow long ones down
        # by `factor`, and blend linearly in between.
        lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        slowed = inv_freq / factor
        blend = (original / wavelen - lo) / (hi - lo)
        blended = (1 - blend) * slowed + blend * inv_freq
        out = torch.where(wavelen > original / lo, slowed, inv_freq)
        is_medium = (wavelen >= original / hi) & (wavelen <= original / lo)
        return torch.where(is_medium, blended, out), 1.0
    # YaRN (Peng et al. 2023, sec. 3.2 "NTK-by-parts"): frequencies that turn more than beta_fast times over
    # the original context are kept, fewer than beta_slow are slowed by `factor`, a linear ramp in between.
    def dim_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(scaling.beta_fast)), 0)
    high = min(math.ceil(dim_of(scaling.beta_slow)), head_dim - 1)
    span = high - low if high != low else 1e-3  # (the reference's guard against a zero-width ramp)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    return inv_freq, yarn_magnitude(scaling)


def yarn_mscale(factor: float, coefficient: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * c * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0


def yarn_magnitude(scaling: RopeScaling) -> float:
    if scaling.attention_factor:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def apply_rope(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor) -> torch.Tensor:
    half = x_BHSDh.shape[-1] // 2
    rotated = torch.cat([-x_BHSDh[..., half:], x_BHSDh[..., :half]], dim=-1)
    return (x_BHSDh * cos_SDh + rotated * sin_SDh).to(x_BHSDh.dtype)


class AttentionCore:
    """Mixin of the attention modules: `core` turns queries, keys and values (after RoPE) into the attention
    output, causally. It is the one place attention looks at other positions of the sequence, so a parallel
    dimension that splits the sequence swaps it (moeflow.parallel.context subclasses the module's class)."""

    def core(self, q_BHSDh: torch.Tensor, k_BHkTDh: torch.Tensor, v_BHkTDv: torch.Tensor,
             mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """mask: None (causal) or a boolean mask (moeflow.models.attention); T keys (S, or more after a KV
        cache)."""
        return attend(q_BHSDh, k_BHkTDh, v_BHkTDv, mask, scale=scale)
