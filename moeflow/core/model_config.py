"""Model configuration: plain dataclasses, no torch import (the planner uses these without torch).

Parameter-count formulas live next to the fields they count, so `num_params()` of a config equals
`sum(p.numel() for p in model.parameters())` of the model built from it (tested), and the real
presets' counts can be checked against the published ones without building anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moeflow.core.choices import SETTINGS


@dataclass
class MoEConfig:
    """Routed (and shared) experts of an MoE FFN. `num_experts == 0` in ModelConfig.moe means dense."""

    num_experts: int = 8
    """Routed experts per MoE layer (E)."""
    top_k: int = 2
    """Experts each token is sent to (K)."""
    ffn_dim: int = 256
    """Hidden width of one routed expert (F)."""
    num_shared_experts: int = 0
    """Always-on shared experts, fused into one SwiGLU of width num_shared_experts * shared_ffn_dim."""
    shared_ffn_dim: int = 0
    """Width of one shared expert; 0 means ffn_dim."""
    first_k_dense: int = 0
    """The first k layers use a dense FFN (ModelConfig.ffn_dim) instead of experts (DeepSeek-V3: 3)."""
    score_func: str = "softmax"
    """Router score: 'softmax' over experts (Mixtral, Qwen3-MoE) or per-expert 'sigmoid' (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k weights to sum to 1."""
    route_scale: float = 1.0
    """Multiply the routing weights by this (DeepSeek-V3's routed_scaling_factor, 2.5)."""
    n_group: int = 1
    """Group-limited routing: experts are split into n_group groups (DeepSeek-V3: 8)."""
    topk_group: int = 1
    """... and each token picks experts only inside its best topk_group groups (DeepSeek-V3: 4)."""
    load_balance: str = "aux_free"
    """'aux_free': a per-expert selection bias updated from the observed load (DeepSeek-V3); 'none'."""
    bias_update_rate: float = 1e-3
    """Step of the aux-free bias update: bias += rate * sign(mean_load - load)."""
    aux_loss_coef: float = 0.0
    """Coefficient of the auxiliary balance loss E * sum_e f_e * P_e (0 = off); aux_loss_type says over which
    tokens f (share of top-k selections) and P (mean routing probability) are counted."""
    aux_loss_type: str = "micro_batch"
    """'micro_batch': f and P over one forward's tokens on this rank (Switch Transformers); 'sequence': per
    sequence, averaged over sequences (DeepSeek-V3's complementary sequence-wise loss, sec. 2.1.2); 'global_batch':
    f over every token of the optimizer step on all ranks (Qwen3; Qiu et al. 2025, arXiv:2501.11873). The last two
    give the same loss and gradients under every parallel layout."""
    z_loss_coef: float = 0.0
    """Coefficient of the router z-loss mean(logsumexp(logits)^2) (ST-MoE; 0 = off)."""
    capacity_factor: float | None = None
    """None = dropless. Otherwise each expert takes at most ceil(cf * T * K / E) tokens; the rest drop."""
    drop_policy: str = "position"
    """With a capacity factor, which assignments an expert keeps: 'position' (the earliest tokens, GShard) or
    'probs' (the highest routing weights; ties to the earlier token)."""
    pad_to_capacity: bool = False
    """With a capacity factor, every expert computes exactly its capacity in rows (zeros where fewer tokens
    came): static shapes for the expert matmuls and no host sync in dispatch."""
    expert_impl: str = "auto"
    """Grouped matmul path: 'grouped_mm', 'bmm', 'loop' or 'auto' (grouped_mm; bmm for fp32 on CUDA or widths
    grouped_mm cannot align)."""
    norm_top1: bool = False
    """With top_k = 1 and norm_topk_prob, normalise the single weight to exactly 1 as Hugging Face's Mixtral and
    Qwen3-MoE do (the router then gets no gradient); by default the score is kept so the router still learns."""

    @property
    def shared_width(self) -> int:
        return self.num_shared_experts * (self.shared_ffn_dim or self.ffn_dim)


@dataclass
class RopeScaling:
    """Long-context rescaling of the RoPE frequencies (Hugging Face's `rope_parameters`, formerly `rope_scaling`)."""

    type: str = "none"
    """'none', 'llama3' (Llama 3.1 and later) or 'yarn' (YaRN, Peng et al. 2023, arXiv:2309.00071; DeepSeek-V3)."""
    factor: float = 1.0
    """How many times longer than original_max_seq_len the context is made."""
    original_max_seq_len: int = 0
    """Context length the model was pre-trained with before the extension; 0 means model.max_seq_len."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths longer than original_max_seq_len / low_freq_factor are slowed down by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths shorter than original_max_seq_len / high_freq_factor are kept; those between blend."""
    beta_fast: float = 32.0
    """yarn: frequencies with more than beta_fast rotations over the original context are kept."""
    beta_slow: float = 1.0
    """yarn: frequencies with fewer than beta_slow rotations are interpolated (slowed down by factor)."""
    mscale: float = 0.0
    """yarn: numerator coefficient of the cos/sin magnitude correction (0 = the YaRN default 0.1 ln(factor) + 1)."""
    mscale_all_dim: float = 0.0
    """yarn: denominator coefficient of that correction; with MLA it also scales the softmax (DeepSeek-V3)."""
    attention_factor: float = 0.0
    """yarn: multiplier of cos and sin; 0 means derived from factor, mscale and mscale_all_dim."""


@dataclass
class ModelConfig:
    """A decoder-only transformer, dense or MoE."""

    name: str = "custom"
    """Preset name or 'custom'."""
    vocab_size: int = 256
    """Vocabulary size (V)."""
    dim: int = 128
    """Model width (D)."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means n_heads."""
    head_dim: int = 0
    """Per-head width; 0 means dim // n_heads."""
    ffn_dim: int = 256
    """Hidden width of a dense SwiGLU FFN (dense models, and the first_k_dense layers of MoE models)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """Long-context rescaling of the RoPE frequencies (none by default)."""
    max_seq_len: int = 256
    """Longest sequence RoPE tables are built for."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    qk_norm: str = "none"
    """RMSNorm on queries and keys: 'none', 'per_head' (Qwen3), 'full' (OLMoE, over all heads)."""
    attention: str = "gqa"
    """'gqa' (grouped-query attention) or 'mla' (DeepSeek multi-head latent attention)."""
    attention_bias: bool = False
    """GQA: biases on the query, key, value and output projections (a Hugging Face `attention_bias` option)."""
    q_lora_rank: int = 0
    """MLA: rank of the low-rank query projection (0 = full-rank query)."""
    kv_lora_rank: int = 512
    """MLA: rank of the compressed key/value latent."""
    qk_nope_head_dim: int = 128
    """MLA: per-head query/key width without RoPE."""
    qk_rope_head_dim: int = 64
    """MLA: per-head decoupled RoPE width (the RoPE key is shared by all heads)."""
    v_head_dim: int = 128
    """MLA: per-head value width."""
    rope_interleave: bool = False
    """MLA: RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... - the layout of DeepSeek's checkpoints -
    rather than the two halves of the RoPE width."""
    latent_norm_eps: float = 0.0
    """MLA: epsilon of the RMSNorms on the query and key/value latents; 0 means norm_eps (Hugging Face's
    DeepSeek-V3 fixes it at 1e-6 whatever rms_norm_eps is)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init."""
    moe: MoEConfig = field(default_factory=lambda: MoEConfig(num_experts=0))
    """Experts; moe.num_experts == 0 makes every layer dense."""
    mtp_depth: int = 0
    """Multi-token prediction modules (DeepSeek-V3 report, sec. 2.2; 1 there): module k also predicts the token
    k + 1 ahead from the previous depth's hidden state and the embedding of the token k ahead, through one
    transformer block and the shared output head. Training only: forward in eval mode returns the main logits."""
    mtp_loss_coef: float = 0.3
    """Weight lambda of the MTP loss: lambda / mtp_depth * sum_k CE_k is added to the objective (DeepSeek-V3:
    0.3 for the first 10T tokens, then 0.1)."""
    hf_path: str = ""
    """Load the architecture and weights from this Hugging Face folder (config.json + *.safetensors); its
    architecture replaces the model.* settings, which keep only the training knobs (expert_impl, losses, ...; on
    transformers' own modules moe.load_balance and moe.bias_update_rate). A model.* setting given with it that the
    folder contradicts is refused."""
    hf_impl: str = "auto"
    """Which code runs model.hf_path: 'native' (moeflow's own model, for the architectures it maps exactly: the
    fast path), 'transformers' (transformers' own modules for any decoder LM, experts through moeflow.ep), or
    'auto' (native where the architecture maps, else transformers)."""

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def runs_transformers(self) -> bool:
        """The model is transformers' own (model.hf_impl resolved to 'transformers'); this config describes its
        shapes (sizes, FLOPs) and builds nothing."""
        return bool(self.hf_path) and self.hf_impl == "transformers"

    @property
    def is_moe(self) -> bool:
        return self.moe.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.moe.first_k_dense

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> ModelConfig:
        """Raise ValueError naming the setting, its value and a fix; return self."""
        from moeflow.core.errors import check_choice, divisors

        check_choice("model.attention", self.attention, SETTINGS["model.attention"])
        check_choice("model.qk_norm", self.qk_norm, SETTINGS["model.qk_norm"])
        check_choice("model.hf_impl", self.hf_impl, SETTINGS["model.hf_impl"])
        self._validate_rope_scaling()
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key} must be positive, got {getattr(self, key)}")
        if self.attention == "gqa":
            if not self.head_dim and self.dim % self.n_heads:
                raise ValueError(
                    f"model.n_heads ({self.n_heads}) must divide model.dim ({self.dim}); "
                    f"choose n_heads in {divisors(self.dim, limit=64)} or set model.head_dim"
                )
            if self.n_heads % self.kv_heads:
                raise ValueError(
                    f"model.n_kv_heads ({self.kv_heads}) must divide model.n_heads ({self.n_heads}); "
                    f"choose n_kv_heads in {divisors(self.n_heads)}"
                )
            if self.hd % 2:
                raise ValueError(f"head width ({self.hd}) must be even for RoPE; change model.head_dim")
        if self.is_moe:
            m = self.moe
            for name in ("score_func", "load_balance", "expert_impl", "aux_loss_type", "drop_policy"):
                check_choice(f"model.moe.{name}", getattr(m, name), SETTINGS[f"model.moe.{name}"])
            if m.pad_to_capacity and m.capacity_factor is None:
                raise ValueError("model.moe.pad_to_capacity = true needs a capacity to pad to; set "
                                 "model.moe.capacity_factor (e.g. 1.25) or turn pad_to_capacity off")
            if not 1 <= m.top_k <= m.num_experts:
                raise ValueError(
                    f"model.moe.top_k ({m.top_k}) must be between 1 and model.moe.num_experts "
                    f"({m.num_experts}); lower top_k or add experts"
                )
            if m.n_group < 1 or m.num_experts % m.n_group:
                raise ValueError(
                    f"model.moe.num_experts ({m.num_experts}) must split into model.moe.n_group "
                    f"({m.n_group}) equal groups; choose n_group in {divisors(m.num_experts)}"
                )
            if not 1 <= m.topk_group <= m.n_group:
                raise ValueError(
                    f"model.moe.topk_group ({m.topk_group}) must be between 1 and model.moe.n_group "
                    f"({m.n_group}); lower topk_group or raise n_group"
                )
            if m.top_k > m.topk_group * (m.num_experts // m.n_group):
                raise ValueError(
                    f"model.moe.top_k ({m.top_k}) exceeds the experts in topk_group ({m.topk_group}) groups "
                    f"of {m.num_experts // m.n_group}; raise topk_group or lower top_k"
                )
            if m.capacity_factor is not None and m.capacity_factor <= 0:
                raise ValueError(
                    f"model.moe.capacity_factor must be positive or unset (dropless), got {m.capacity_factor}"
                )
            if not 0 <= m.first_k_dense <= self.n_layers:
                raise ValueError(
                    f"model.moe.first_k_dense ({m.first_k_dense}) must be in [0, n_layers={self.n_layers}]"
                )
        if self.mtp_depth < 0:
            raise ValueError(f"model.mtp_depth must be 0 (off) or more, got {self.mtp_depth}")
        if self.mtp_depth and self.mtp_loss_coef < 0:
            raise ValueError(f"model.mtp_loss_coef must not be negative, got {self.mtp_loss_coef}")
        return self

    def _validate_rope_scaling(self) -> None:
        from moeflow.core.errors import check_choice

        r = self.rope_scaling
        check_choice("model.rope_scaling.type", r.type, SETTINGS["model.rope_scaling.type"])
        if r.type == "none":
            return
        if r.factor <= 0:
            raise ValueError(f"model.rope_scaling.factor must be positive, got {r.factor}")
        if r.type == "llama3" and r.high_freq_factor <= r.low_freq_factor:
            raise ValueError(
                f"model.rope_scaling.high_freq_factor ({r.high_freq_factor}) must exceed low_freq_factor "
                f"({r.low_freq_factor}); Llama 3.1 uses 4 and 1"
            )

    def shape_settings(self) -> dict[str, object]:
        """The settings (effective values) that decide the parameters' shapes: what a checkpoint of this model
        fixes. Settings that change only the computation (RoPE, routing, norms' epsilon) are not here."""
        shape: dict[str, object] = {
            "model.vocab_size": self.vocab_size, "model.dim": self.dim, "model.n_layers": self.n_layers,
            "model.n_heads": self.n_heads, "model.tie_embeddings": self.tie_embeddings,
            "model.attention": self.attention, "model.moe.num_experts": self.moe.num_experts,
        }
        if self.attention == "gqa":
            shape.update({"model.n_kv_heads": self.kv_heads, "model.head_dim": self.hd, "model.qk_norm": self.qk_norm,
                          "model.attention_bias": self.attention_bias})
        else:
            shape.update({f"model.{k}": getattr(self, k) for k in (
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")})
        if not self.is_moe or self.moe.first_k_dense:
            shape["model.ffn_dim"] = self.ffn_dim
        if self.is_moe:
            m = self.moe
            shape.update({"model.moe.ffn_dim": m.ffn_dim, "model.moe.first_k_dense": m.first_k_dense,
                          "model.moe.num_shared_experts": m.num_shared_experts})
            if m.num_shared_experts:
                shape["model.moe.shared_ffn_dim"] = m.shared_ffn_dim or m.ffn_dim
        return shape

    # ---- parameter counts ----------------------------------------------------------------
    def attention_params(self) -> int:
        d = self.dim
        if self.attention == "mla":
            h, nope, rope, v = self.n_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
            if self.q_lora_rank:
                q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * (nope + rope)
            else:
                q = d * h * (nope + rope)
            kv = d * (self.kv_lora_rank + rope) + self.kv_lora_rank + self.kv_lora_rank * h * (nope + v)
            return q + kv + h * v * d
        q, kv = self.n_heads * self.hd, self.kv_heads * self.hd
        norms = {"none": 0, "per_head": 2 * self.hd, "full": q + kv}[self.qk_norm]
        biases = q + 2 * kv + d if self.attention_bias else 0
        return d * q + 2 * d * kv + q * d + norms + biases

    def dense_ffn_params(self) -> int:
        return 3 * self.dim * self.ffn_dim

    def moe_params(self, active: bool = False) -> int:
        m, d = self.moe, self.dim
        routed = (m.top_k if active else m.num_experts) * 3 * d * m.ffn_dim
        return d * m.num_experts + routed + 3 * d * m.shared_width

    def layer_params(self, layer: int, active: bool = False) -> int:
        ffn = self.moe_params(active) if self.is_moe_layer(layer) else self.dense_ffn_params()
        return 2 * self.dim + self.attention_params() + ffn

    def embedding_params(self) -> int:
        return self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)

    def mtp_params(self, active: bool = False) -> int:
        """The MTP modules: per depth two input norms, the [2D -> D] projection, one block (an MoE block when the
        model is MoE) and the output norm; the embedding and head are the main model's."""
        per_depth = 3 * self.dim + 2 * self.dim * self.dim + self.layer_params(self.n_layers, active)
        return self.mtp_depth * per_depth

    def num_params(self) -> int:
        """Every parameter: embeddings, output head (unless tied), final norm, all blocks, MTP modules."""
        return (self.embedding_params() + self.dim + sum(self.layer_params(i) for i in range(self.n_layers))
                + self.mtp_params())

    def num_active_params(self) -> int:
        """Parameters one token touches: as num_params but top_k of the routed experts per MoE layer."""
        return self.embedding_params() + self.dim + sum(
            self.layer_params(i, active=True) for i in range(self.n_layers)
        ) + self.mtp_params(active=True)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * active non-embedding matmul params + attention scores.

        6N for forward+backward (Kaplan et al. 2020, "Scaling Laws", sec. 2.1), with N counted as the
        active parameters used in matmuls (the output head counts; the embedding lookup does not), plus
        the attention term 6 * n_layers * seq_len * (qk width + v width) per token for causal attention
        (12 * L * S * D in Kaplan's notation for full attention, halved for the causal mask). Each MTP depth
        adds its block (one more layer of attention) and runs the output head once more.
        """
        n_matmul = self.num_active_params() - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1)
        n_matmul -= self.dim  # final norm is not a matmul; per-layer norms are negligible and kept
        n_matmul += self.mtp_depth * self.vocab_size * self.dim  # the shared head, once per MTP depth
        if self.attention == "mla":
            qk, v = self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim), self.n_heads * self.v_head_dim
        else:
            qk = v = self.n_heads * self.hd
        attn = 6 * (self.n_layers + self.mtp_depth) * seq_len * (qk + v) / 2
        return 6.0 * n_matmul + attn

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def grouped_mm_alignment_error(dim: int, ffn_dim: int, element_size: int, dtype_name: str) -> str | None:
    """Why model.moe.expert_impl = 'grouped_mm' cannot run these widths in this dtype, or None: torch's grouped
    matmul wants rows of a multiple of 16 bytes ("strides should be multiple of 16 bytes")."""
    if (dim * element_size) % 16 == 0 and (ffn_dim * element_size) % 16 == 0:
        return None
    return (f"model.moe.expert_impl = 'grouped_mm' needs rows of a multiple of 16 bytes: dim {dim} and ffn_dim "
            f"{ffn_dim} in {dtype_name} are not; use expert_impl = 'auto' (it takes bmm there) or widths that are "
            f"multiples of {16 // element_size}")
