"""What every attention variant shares: the masks (causal, per-document, after a KV cache) and the one call that
applies them.

A mask here is None (plain causal attention: scaled_dot_product_attention's `is_causal`, its fastest path) or a
boolean tensor broadcastable to [B, H, Sq, Sk] (True = may attend). Packed sequences get a block-diagonal causal
mask built from per-position document ids; it is a plain tensor so that context parallelism can build the same
mask for its own query/key chunks by passing their global indices.

Why a boolean mask through scaled_dot_product_attention and not flex attention's block masks: on a CPU
flex attention has no backward and its forward runs unfused; bench/doc_attention.py measures both.

Shape suffixes: B batch, H heads, Sq query positions, Sk key positions, D width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_causal_mask(q_doc_BSq: torch.Tensor, k_doc_BSk: torch.Tensor | None = None,
                         q_index_Sq: torch.Tensor | None = None,
                         k_index_Sk: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, Sq, Sk] bool: a query sees a key of the same document at the same or an earlier index.

    Indices default to 0..S-1 (a whole packed sequence); a context-parallel rank passes the global indices of its
    query and key chunks (and their document ids) instead. Every query sees at least itself, so no row is empty.
    """
    k_doc_BSk = q_doc_BSq if k_doc_BSk is None else k_doc_BSk
    device = q_doc_BSq.device
    q_index_Sq = torch.arange(q_doc_BSq.shape[1], device=device) if q_index_Sq is None else q_index_Sq
    k_index_Sk = torch.arange(k_doc_BSk.shape[1], device=device) if k_index_Sk is None else k_index_Sk
    same_doc_BSqSk = q_doc_BSq.unsqueeze(2) == k_doc_BSk.unsqueeze(1)
    causal_SqSk = k_index_Sk.unsqueeze(0) <= q_index_Sq.unsqueeze(1)
    return (same_doc_BSqSk & causal_SqSk).unsqueeze(1)


def cached_causal_mask(new: int, cached: int, device) -> torch.Tensor | None:
    """[new, cached + new] bool for `new` queries that follow `cached` positions already in a KV cache; None when
    nothing is cached (plain causal). One new query (decoding) sees every key."""
    if cached == 0:
        return None
    q_index = torch.arange(cached, cached + new, device=device)
    return torch.arange(cached + new, device=device).unsqueeze(0) <= q_index.unsqueeze(1)


def attend(q_BHSqD: torch.Tensor, k_BHSkD: torch.Tensor, v_BHSkD: torch.Tensor, mask: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    """scaled_dot_product_attention with `mask` (None = causal); fewer key heads than query heads is GQA."""
    gqa = q_BHSqD.shape[1] != k_BHSkD.shape[1]
    if gqa and mask is not None and q_BHSqD.is_cuda and not _fused_masked_gqa(q_BHSqD, k_BHSkD, v_BHSkD, mask):
        # On CUDA flash attention takes no mask, and where memory-efficient attention takes no enable_gqa a
        # masked GQA call falls to the math kernel (fp32 [B, H, Sq, Sk] scores kept for backward): repeat the
        # key/value heads, which memory-efficient attention then takes with the mask.
        k_BHSkD, v_BHSkD = repeat_kv_heads(k_BHSkD, q_BHSqD.shape[1]), repeat_kv_heads(v_BHSkD, q_BHSqD.shape[1])
        gqa = False
    return F.scaled_dot_product_attention(
        q_BHSqD, k_BHSkD, v_BHSkD, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)


def repeat_kv_heads(x_BHkSD: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, H, S, D] from [B, Hk, S, D]: each key/value head repeated for the H / Hk query heads that share it (the
    grouping enable_gqa uses: query head h reads key head h // (H / Hk))."""
    return x_BHkSD.repeat_interleave(num_heads // x_BHkSD.shape[1], dim=1)


def _fused_masked_gqa(q, k, v, mask) -> bool:
    """Whether memory-efficient attention takes this masked GQA call as it is (torch decides per version)."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention

    return can_use_efficient_attention(SDPAParams(q, k, v, mask, 0.0, False, True))


LOGIT_BLOCK = 256  # queries per block in max_logits: bounds its memory at [B, H, 256, T] floats


def max_logits(q_BHSD: torch.Tensor, k_BHkTD: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[H]: the largest logit q.k / sqrt(D) of each query head over the positions it attends (mask None: causal;
    else True where a query attends a key); key heads shared by H / Hk query heads as enable_gqa shares them."""
    B, H, S, D = q_BHSD.shape
    k_BHTD = k_BHkTD.repeat_interleave(H // k_BHkTD.shape[1], dim=1).float()
    T = k_BHTD.shape[2]
    best_H = torch.full((H,), -torch.inf, device=q_BHSD.device)
    for lo in range(0, S, LOGIT_BLOCK):
        hi = min(S, lo + LOGIT_BLOCK)
        logits = q_BHSD[:, :, lo:hi].float() @ k_BHTD.transpose(-1, -2) / D ** 0.5  # [B, H, s, T]
        if mask is None:  # causal: query i (of the last S positions of T) sees keys up to T - S + i
            rows = torch.arange(lo, hi, device=q_BHSD.device)[:, None] + (T - S)
            sees = torch.arange(T, device=q_BHSD.device)[None, :] <= rows
        else:
            sees = mask[..., lo:hi, :]
        logits = logits.masked_fill(~sees, -torch.inf)
        best_H = torch.maximum(best_H, logits.amax(dim=(0, 2, 3)))
    return best_H
