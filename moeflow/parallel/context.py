"""Context parallelism: each sequence is split over the cp ranks, and attention all-gathers keys and values.

Layout (causal load balancing): a sequence of S tokens is cut into 2cp chunks of C = S / 2cp tokens, and cp rank
r keeps chunks r and 2cp-1-r, concatenated (the order of Megatron-LM's context parallelism and of torch's
head-tail load balancer). Under a causal mask chunk j attends to j + 1 chunks, so every rank computes
(r + 1) + (2cp - r) = 2cp + 1 chunk blocks of scores: the same work on every rank. For cp = 4 and S = 16:
rank 0 keeps positions [0, 1, 14, 15], rank 1 [2, 3, 12, 13], rank 2 [4, 5, 10, 11], rank 3 [6, 7, 8, 9].

Attention (`context_parallel_attention`): this rank's keys and values, after RoPE, are all-gathered over the cp
group in one collective (its backward reduce-scatters their gradients), put back in sequence order, and each
local query chunk j attends to the keys [0, (j + 1)C) with a lower-right causal mask. Autograd does the rest, so
GQA and multi-head latent attention (value width unlike the key width) need nothing special. Each rank holds,
and saves for backward, the whole sequence's keys and values of a layer; docs/design.md ("context
parallelism") says why this variant and what the ring variant would save. Where torch has no kernel for
lower-right causality (always on CPU; on CUDA when neither the flash nor the memory-efficient kernel takes the
shapes) it materialises the mask and saves it for backward: C x (j + 1)C numbers per chunk, quadratic in the
sequence. There the chunk's attention is recomputed in backward instead (`torch.utils.checkpoint`), which keeps
the saved activations linear in S / cp (bench/context_parallel.py measures them).

What `apply_context_parallel` changes, by swapping classes (names, parameters and attributes stay):
- every attention module (a moeflow.models.layers.AttentionCore) computes its core as above over the cp group;
- every stage root (a moeflow Transformer) passes RoPE the positions of its two chunks and checks the whole
  length S = cp x its tokens against model.max_seq_len;
and it returns the runner's default loss scale: cp / the valid targets of the whole sequences (one all-reduce of a
count over the cp group), so that the mean over the cp ranks, which FSDP's gradient average and the trainer's loss
take, is the mean over all targets (the trainer passes its own scale, over the whole global batch). The trainer
feeds each rank its chunks of inputs and targets alike
(`shard_sequence`, ParallelState.local_sequence); the targets were shifted on the whole sequence, so the tokens at
chunk boundaries keep their true next token.

Shape suffixes: B batch, H query heads, Hk key/value heads, L local tokens (S / cp), C chunk (S / 2cp),
S whole sequence, Dk query/key width, Dv value width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

from moeflow.ep.comm import all_gather_single, reduce_scatter_single
from moeflow.models.layers import AttentionCore, autocast_input
from moeflow.models.transformer import Transformer

# ---- the layout -------------------------------------------------------------------------------------------


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2cp) that cp rank `rank` keeps."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Positions in the sequence of this rank's L = seq_len / cp tokens (LongTensor [L]), for RoPE."""
    _check_divisible(seq_len, cp)
    C = seq_len // (2 * cp)
    return torch.cat([torch.arange(j * C, (j + 1) * C, device=device) for j in chunk_ids(rank, cp)])


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's chunks r and 2cp-1-r of whole sequences along `dim`, concatenated."""
    _check_divisible(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[j] for j in chunk_ids(rank, cp)], dim=dim)


def _check_divisible(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be split over parallel.cp = {cp} ranks: its length "
                         f"must be divisible by 2 x cp = {2 * cp} (set data.seq_len accordingly)")


def _sequence_order(cp: int, C: int, device) -> torch.Tensor:
    """Index [S] that puts an all-gather's rank-major chunks (rank 0's two, then rank 1's, ...) in sequence order."""
    slot = {chunk: i for i, chunk in enumerate(j for rank in range(cp) for j in chunk_ids(rank, cp))}
    return torch.cat([torch.arange(slot[chunk] * C, (slot[chunk] + 1) * C, device=device) for chunk in range(2 * cp)])


# ---- attention --------------------------------------------------------------------------------------------


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim `dim` (2 of [B, H, L, D], 1 of [B, L, D]) in rank order; backward:
    reduce-scatter (sum), since every rank's outputs read every rank's tokens."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int = 2) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        cp = dist.get_world_size(group)
        x_L = x.movedim(dim, 0).contiguous()
        out_S = x_L.new_empty((cp * x_L.shape[0], *x_L.shape[1:]))
        all_gather_single(out_S, x_L, group=group)
        return out_S.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = dist.get_world_size(ctx.group)
        grad_S = grad.movedim(ctx.dim, 0).contiguous()
        out_L = grad_S.new_empty((grad_S.shape[0] // cp, *grad_S.shape[1:]))
        reduce_scatter_single(out_L, grad_S, group=ctx.group)
        return out_L.movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """The whole sequences, in sequence order, of every cp rank's two chunks along `dim` (reduce-scattered in
    backward)."""
    cp, C = dist.get_world_size(group), x.shape[dim] // 2
    return _GatherSequence.apply(x, group, dim).index_select(dim, _sequence_order(cp, C, x.device))


def gather_keys_values(k_BHkLDk: torch.Tensor, v_BHkLDv: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence's keys and values, in sequence order, from every cp rank's two chunks: one collective
    (they differ in width under multi-head latent attention: concatenated), reduce-scattered in backward."""
    kv_BHkSD = gather_sequence(torch.cat([k_BHkLDk, v_BHkLDv], dim=-1), group, dim=2)
    return kv_BHkSD.split([k_BHkLDk.shape[-1], v_BHkLDv.shape[-1]], dim=-1)


def context_parallel_attention(q_BHLDk: torch.Tensor, k_BHkLDk: torch.Tensor, v_BHkLDv: torch.Tensor, group,
                               scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries (its two chunks, RoPE applied) over the whole sequence's keys and
    values, of which it holds the same two chunks; equals full-sequence causal attention, cut the same way."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    L = q_BHLDk.shape[2]
    if L % 2:
        raise ValueError(f"context-parallel attention needs an even number of local tokens (two equal chunks), got "
                         f"{L}; the sequence length must be divisible by 2 x cp = {2 * cp}")
    C = L // 2
    # Under autocast q and k can arrive fp32 (a qk-norm's fp32 weight promotes its bf16 input), and the lower-right
    # causal mask reaches the attention kernel without autocast's cast: cast here (it also halves the gather).
    q_BHLDk, k_BHkLDk, v_BHkLDv = (autocast_input(t) for t in (q_BHLDk, k_BHkLDk, v_BHkLDv))
    k_BHkSDk, v_BHkSDv = gather_keys_values(k_BHkLDk, v_BHkLDv, group)
    gqa = q_BHLDk.shape[1] != k_BHkLDk.shape[1]
    out = []
    for j, q_BHCDk in zip(chunk_ids(rank, cp), q_BHLDk.split(C, dim=2)):
        keys = (j + 1) * C  # chunk j sees chunks 0 .. j: the last C keys diagonally, the rest fully
        args = (q_BHCDk, k_BHkSDk[:, :, :keys], v_BHkSDv[:, :, :keys], scale, gqa)
        if j == 0 or _lower_right_kernel(*args[:3], gqa):  # (chunk 0 is square: plain is_causal, no mask)
            out.append(_chunk_attention(*args))
        else:
            out.append(torch.utils.checkpoint.checkpoint(_chunk_attention, *args, use_reentrant=False))
    return torch.cat(out, dim=2)


def _chunk_attention(q_BHCDk, k_BHkKDk, v_BHkKDv, scale, gqa) -> torch.Tensor:
    """A query chunk against the keys up to and including its own chunk (lower-right causal)."""
    C, keys = q_BHCDk.shape[2], k_BHkKDk.shape[2]
    return F.scaled_dot_product_attention(q_BHCDk, k_BHkKDk, v_BHkKDv, attn_mask=causal_lower_right(C, keys),
                                          scale=scale, enable_gqa=gqa)


def _lower_right_kernel(q, k, v, gqa: bool) -> bool:
    """Whether torch computes a lower-right causal mask inside a kernel (CausalBias's dispatch, torch 2.13:
    CUDA flash or memory-efficient attention) rather than materialising it."""
    params = SDPAParams(q, k, v, None, 0.0, False, gqa)
    return can_use_flash_attention(params) or can_use_efficient_attention(params)


# ---- applying it ------------------------------------------------------------------------------------------


def _attention_class(cls: type, group) -> type:
    def core(self, q, k, v, mask=None, scale=None):
        if mask is not None:
            raise ValueError("context parallelism computes plain causal attention only: packed documents "
                             "(data.packing) and KV caches need parallel.cp = 1")
        return context_parallel_attention(q, k, v, group, scale)

    return type(f"ContextParallel{cls.__name__}", (cls,), {"core": core})


def _stage_class(cls: type, rank: int, cp: int) -> type:
    def forward(self, tokens, *args, positions=None, **kwargs):
        if positions is None:  # (given positions are this rank's already, e.g. per document)
            S = tokens.shape[1] * cp  # token ids [B, L], or hidden states [B, L, D]
            self.check_length(S)
            positions = local_positions(S, rank, cp, device=tokens.device)
        return super(sub, self).forward(tokens, *args, positions=positions, **kwargs)

    sub = type(f"ContextParallel{cls.__name__}", (cls,), {"forward": forward})
    return sub


class ContextParallelTokenScale:
    """The runner's default loss scale under context parallelism (moeflow.parallel.runner): cp / the valid
    targets of the whole sequences (one all-reduce of a count over the cp group). Each rank's summed loss times
    this, averaged over the cp ranks (FSDP's gradient average, the trainer's loss), is the mean over all
    targets, however the ignored ones (ignore_index) fall between the chunks; a rank with none still takes part."""

    def __init__(self, group, ignore_index: int = -100):
        self.group, self.ignore_index = group, ignore_index
        self.cp = dist.get_world_size(group)

    def __call__(self, targets: torch.Tensor) -> torch.Tensor:
        count = (targets != self.ignore_index).sum().float()
        dist.all_reduce(count, group=self.group)
        return self.cp / count.clamp(min=1)


def apply_context_parallel(stages: Sequence[nn.Module], cp_mesh) -> ContextParallelTokenScale:
    """Make this rank's stage modules (moeflow Transformers: the model, or its pipeline stages) compute over
    their chunks of each sequence with the other ranks of the 1-D `cp_mesh`; returns the runner's default loss
    scale (`runner.token_scale`)."""
    group, rank, cp = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
    swapped: dict[type, type] = {}
    done: set[int] = set()
    for stage in stages:
        if not isinstance(stage, Transformer):
            raise ValueError(f"context parallelism needs moeflow Transformer stages, got {type(stage).__name__}")
        stage.__class__ = _stage_class(type(stage), rank, cp)
        for module in stage.modules():
            if isinstance(module, AttentionCore) and id(module) not in done:
                cls = type(module)
                if cls not in swapped:
                    swapped[cls] = _attention_class(cls, group)
                module.__class__ = swapped[cls]
                done.add(id(module))
    return ContextParallelTokenScale(group)
