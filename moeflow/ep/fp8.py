"""The fp8 format DeepEP dispatches: float8_e4m3fn values plus one float32 scale per 128 columns.

Shape legend: T tokens, D hidden, S = D // 128 scale columns.

    x_fp8_TD, scales_TS = per_token_cast_to_fp8(x_TD)     # x ~= x_fp8 * scale (per 128-column block)
    x_TD_again = per_token_cast_back(x_fp8_TD, scales_TS)  # float32
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def check_fp8_hidden(hidden: int) -> None:
    if hidden % FP8_BLOCK:
        raise ValueError(
            f"fp8 input needs hidden % {FP8_BLOCK} == 0 (one scale per {FP8_BLOCK} columns), got hidden = "
            f"{hidden}; pad the hidden size to a multiple of {FP8_BLOCK} or dispatch in bf16/fp32"
        )


def per_token_cast_to_fp8(x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [T, D] to (float8_e4m3fn [T, D], float32 scales [T, D // 128]): amax / 448 per block."""
    T, D = x_TD.shape
    check_fp8_hidden(D)
    blocks = x_TD.float().view(T, D // FP8_BLOCK, FP8_BLOCK)
    # The clamp keeps an all-zero block's scale finite (its values stay 0).
    scales_TS = blocks.abs().amax(dim=2).clamp(min=1e-4) / FP8_MAX
    x_fp8 = (blocks / scales_TS.unsqueeze(2)).to(torch.float8_e4m3fn).view(T, D)
    return x_fp8, scales_TS


def per_token_cast_back(x_fp8_TD: torch.Tensor, scales_TS: torch.Tensor) -> torch.Tensor:
    """Dequantize the pair back to float32 [T, D]."""
    T, D = x_fp8_TD.shape
    blocks = x_fp8_TD.float().view(T, D // FP8_BLOCK, FP8_BLOCK) * scales_TS.float().unsqueeze(2)
    return blocks.view(T, D)
