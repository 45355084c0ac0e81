"""Seconds one GPU spends computing one micro-batch of one transformer layer, per operation kind.

A layer's work is split three ways, each with its own rate (all per GPU, per micro-batch of s*b tokens):
- matmuls (the projections, the FFN or the experts, the router, the output head): the roofline (Williams,
  Waterman & Patterson 2009, "Roofline: an insightful visual performance model"): a matmul of M rows against a
  K x N weight takes max(FLOPs / (peak * matmul_efficiency), bytes / HBM bandwidth), FLOPs = 2MKN, bytes =
  (MK + KN + MN) elements; matmul_efficiency is the largest matmuls' measured fraction of peak (moeflow.core.hardware).
  With tensor + sequence parallelism the rows are the whole micro-batch (the sequence is gathered before
  the matmul) and N (column-parallel) or K (row-parallel) is split over tp (Shoeybi et al. 2019, sec. 3;
  Korthikanti et al. 2022 sec. 4.2.2). A routed expert's rows are the tokens it receives: under balanced
  routing T * ep * K / E for T tokens per rank. Each forward matmul has two backward ones of the same shape
  (input gradient and weight gradient), so forward F, input-gradient B and weight-gradient W cost the same.
- attention scores (softmax(QK^T)V, causal: half the square): flash attention at ATTENTION_EFFICIENCY, its
  backward recomputing the scores (5 matmuls against the forward's 2: Dao 2023, arXiv:2307.08691, Algorithm 2),
  which is Korthikanti et al.'s selective recomputation built in. Without flash attention (`flash=False`:
  Megatron-LM before it adopted flash attention) the two score matmuls run on the roofline over the whole
  square, and the tensors Korthikanti et al. 2022 Table 2 keeps per layer (scores, softmax, dropout mask: 5as
  bytes per token for a heads, sequence s) are written and read once each forward and twice backward.
- memory-bound elementwise work (norms, residual adds, RoPE, the SwiGLU product, MoE permute/unpermute, the
  loss over the vocabulary): bytes moved / HBM bandwidth, counted per op in `elementwise_elements`.

Recomputation adds forward work to B: selective redoes the attention scores (Korthikanti et al. 2022 sec. 5;
nothing more under flash attention, which already does), full redoes the whole forward. With fp8 (--precision
fp8) the matmuls run at the fp8 peak and its measured efficiency with 1-byte operands (as torchao's and
Transformer Engine's fp8 training do: linear layers only); attention and elementwise work stay bf16.

Every rate is then scaled by KERNEL_EFFICIENCY, the model's one calibrated number.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.core.model_config import ModelConfig

KERNEL_EFFICIENCY = 0.69
"""Fraction of the rates below (large-matmul, flash attention, HBM bandwidth) that a training step's kernels
reach together: clocks under the sustained power draw of every GPU at once, matmul shapes off the measured best
one, kernel launch gaps, the optimizer step and data loading, none of them modelled one by one. A calibration,
not a measurement, and the time model's only fitted number: the value at which the geometric mean of predicted /
published tokens per second over the 13 published runs of tests/plan/test_plan_published.py is 1 (they span A100,
H100 and H800, dense and MoE, 8 to 16384 GPUs). That test also predicts each run with the value fitted to the
other twelve (leave-one-out): all within 25%."""
ATTENTION_EFFICIENCY = 0.5
"""Fraction of the bf16 peak flash attention reaches, forward + backward (assumption: FlashAttention-2 reaches
50-73% of the A100's peak, forward faster than backward, Dao 2023, arXiv:2307.08691, abstract and sec. 4.1;
FlashAttention-3 up to 75% forward on H100, Shah et al. 2024, arXiv:2407.08608; the backward pass, two thirds
of the FLOPs, sits at the low end)."""
BACKWARD_TRAFFIC = 2.0
"""Backward of an elementwise op moves this many times its forward bytes (assumption: it reads the saved input
and the output gradient and writes the input gradient, where the forward read the input and wrote the output)."""
LOSS_PASSES = 4
"""fp32 passes over the logits per token for the loss, forward and backward (assumption: upcast, log-softmax,
its gradient, the downcast)."""
ACT_BYTES = 2  # bf16 activations


@dataclass(frozen=True)
class Rates:
    """The GPU's rates for one precision (FLOP/s and bytes/s)."""

    matmul_flops: float  # peak * matmul_efficiency for the matmul precision
    attention_flops: float  # bf16 peak * ATTENTION_EFFICIENCY
    hbm_bytes: float
    matmul_elt: float  # bytes per matmul operand element: 2 (bf16) or 1 (fp8)


@dataclass(frozen=True)
class FBW:
    """Seconds of forward (F), input-gradient backward (B) and weight-gradient backward (W); recomputation,
    when on, is already in B."""

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0

    def __add__(self, other: FBW) -> FBW:
        return FBW(self.f + other.f, self.b + other.b, self.w + other.w)

    def scale(self, k: float) -> FBW:
        return FBW(self.f * k, self.b * k, self.w * k)

    @property
    def total(self) -> float:
        return self.f + self.b + self.w


def matmul_seconds(rows: float, k: float, n: float, rates: Rates, count: float = 1.0) -> float:
    """One pass of `count` matmuls [rows, k] @ [k, n] on the roofline (see module doc)."""
    if rows <= 0 or count <= 0:
        return 0.0
    flops = 2.0 * rows * k * n * count
    nbytes = rates.matmul_elt * (rows * k + k * n + rows * n) * count
    return max(flops / rates.matmul_flops, nbytes / rates.hbm_bytes)


def attention_gemms(cfg: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """(K, N) of the attention projections as each tp rank holds them (column-parallel: N / tp; row: K / tp)."""
    d = cfg.dim
    if cfg.attention == "mla":  # no tensor-parallel plan for MLA (ParallelDims refuses tp > 1)
        h, nope, rope, v = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = ([(d, cfg.q_lora_rank), (cfg.q_lora_rank, h * (nope + rope))] if cfg.q_lora_rank
             else [(d, h * (nope + rope))])
        return q + [(d, cfg.kv_lora_rank + rope), (cfg.kv_lora_rank, h * (nope + v)), (h * v, d)]
    q, kv = cfg.n_heads * cfg.hd, cfg.kv_heads * cfg.hd
    return [(d, q // tp), (d, kv // tp), (d, kv // tp), (q // tp, d)]


def attention_widths(cfg: ModelConfig) -> tuple[int, int]:
    """(query-key width, value width) summed over heads: what the score and value matmuls contract over."""
    if cfg.attention == "mla":
        return cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.n_heads * cfg.v_head_dim
    return cfg.n_heads * cfg.hd, cfg.n_heads * cfg.hd


def elementwise_elements(cfg: ModelConfig, moe_layer: bool) -> float:
    """Activation elements one token's forward reads plus writes in one layer outside matmuls and attention.

    Each op reads its inputs once and writes its output once (fused kernels; assumption):
    two RMSNorms (read + write D each: 4D), two residual adds (two reads, one write: 6D), RoPE on the rotated
    query and key widths (read + write), q/k norms, MLA's latent norms and the per-head concatenation of the
    RoPE and non-RoPE query/key parts, the SwiGLU product silu(a) * b (read 2F, write F for the FFN width F a
    token touches), and for an MoE layer the router scores (E) and the permutation of each token's K copies
    into expert order and back (read D, write KD; read KD, write D).
    """
    d = cfg.dim
    n = 4 * d + 6 * d
    if cfg.attention == "mla":
        h, nope, rope = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        n += 2 * (h * rope + rope) + 2 * (cfg.q_lora_rank + cfg.kv_lora_rank) + 2 * 2 * h * (nope + rope)
    else:
        q, kv = cfg.n_heads * cfg.hd, cfg.kv_heads * cfg.hd
        n += 2 * (q + kv)
        if cfg.qk_norm != "none":
            n += 2 * (q + kv)
    if moe_layer:
        m = cfg.moe
        n += 3 * (m.top_k * m.ffn_dim + m.shared_width) + m.num_experts + 2 * d * (1 + m.top_k)
    else:
        n += 3 * cfg.ffn_dim
    return n


def scores_cost(cfg: ModelConfig, seq: int, mb: int, tp: int, rates: Rates, flash: bool) -> tuple[float, float]:
    """(forward, backward) seconds of the attention scores softmax(QK^T)V of one layer, one micro-batch."""
    qk, v = attention_widths(cfg)
    flops = seq * mb * seq * (qk + v) / tp  # 2 s (qk + v) per token forward, halved by the causal mask
    if flash:
        forward = flops / rates.attention_flops
        return forward, 2.5 * forward
    heads = cfg.n_heads / tp
    gemms = 2 * flops / rates.matmul_flops  # the whole square, masked afterwards
    traffic = 2 * 5 * heads * seq * seq * mb / rates.hbm_bytes
    return gemms + traffic, 2 * (gemms + traffic)


def moe_matmul_seconds(cfg: ModelConfig, tokens: float, ep: int, rates: Rates) -> tuple[float, float, float]:
    """(router, shared experts, routed experts) matmul seconds of one MoE layer's forward over `tokens` tokens of
    this rank (under tp its sequence-parallel shard: the MoE's weights are not split over tp)."""
    m = cfg.moe
    router = matmul_seconds(tokens, cfg.dim, m.num_experts, rates)
    shared = matmul_seconds(tokens, cfg.dim, m.shared_width, rates, 3) if m.shared_width else 0.0
    local, rows = m.num_experts // ep, tokens * ep * m.top_k / m.num_experts
    return router, shared, matmul_seconds(rows, cfg.dim, m.ffn_dim, rates, 3 * local)


def layer_cost(cfg: ModelConfig, moe_layer: bool, seq: int, mb: int, tp: int, ep: int, ac: str,
               rates: Rates, flash: bool = True) -> FBW:
    """F/B/W seconds of one layer for one micro-batch (mb sequences of seq tokens) on one GPU."""
    tokens = seq * mb  # rows of the tensor-parallel matmuls (sequence-parallel shards are gathered)
    attn = sum((matmul_seconds(tokens, k, n, rates) for k, n in attention_gemms(cfg, tp)), 0.0)
    if moe_layer:
        ffn = sum(moe_matmul_seconds(cfg, tokens / tp, ep, rates))
    else:
        ffn = matmul_seconds(tokens, cfg.dim, cfg.ffn_dim // tp, rates, 3)
    mm = attn + ffn  # one pass: forward, input gradient and weight gradient each take this long
    scores_f, scores_b = scores_cost(cfg, seq, mb, tp, rates, flash)
    elem = tokens / tp * elementwise_elements(cfg, moe_layer) * ACT_BYTES / rates.hbm_bytes
    forward = mm + scores_f + elem
    redo = {"none": 0.0, "selective": 0.0 if flash else scores_f, "full": forward}[ac]
    return FBW(forward, mm + scores_b + BACKWARD_TRAFFIC * elem + redo, mm)


def head_cost(cfg: ModelConfig, seq: int, mb: int, tp: int, rates: Rates) -> FBW:
    """The output projection (vocab split over tp) and the fp32 loss over the vocabulary, one micro-batch."""
    tokens = seq * mb
    mm = matmul_seconds(tokens, cfg.dim, cfg.vocab_size / tp, rates)
    loss = tokens * LOSS_PASSES * 4 * cfg.vocab_size / tp / rates.hbm_bytes
    return FBW(mm + loss / 2, mm + loss / 2, mm)
