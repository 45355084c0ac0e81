"""Hugging Face architectures <-> moeflow: config.json fields and tensor names, one small table per architecture.

Pure data and dict code (no torch), read by moeflow.models.hf (files on disk) and moeflow.models.hf_live (live
`transformers` modules). Each mapping follows the architecture's `configuration_*.py` and `modeling_*.py` in
transformers 5; where moeflow computes something differently (DeepSeek's interleaved RoPE, Hugging Face's
renormalised top-1 weight, YaRN's softmax scale) the moeflow config has a field for it, so logits agree.

A `Rule` ties one Hugging Face tensor to one moeflow tensor (or one expert's slice of it) and says how the
tensor changes between the two (its `transform`):
  same        identical
  copy        a second copy of a moeflow tensor another rule fills: DeepSeek-V3's MTP layers store the shared
              embedding and output head again; loading checks the copy is equal, saving writes it
  transposed  one expert's nn.Linear weight [out, in] <-> moeflow's [in, out] slice of a 3-D expert tensor
  gate_half   fused gate_up_proj [E, 2F, D] (transformers 5 in memory) -> gate half, as moeflow's w1 [E, D, F]
  up_half     ... the up half, as w3 [E, D, F]
  down_fused  fused down_proj [E, D, F] -> moeflow's w2 [E, F, D]
Checkpoints on disk (the Hub, and transformers' save_pretrained) keep one tensor per expert; the fused names
appear in checkpoints saved with save_original_format=False and in live modules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moeflow.core.model_config import ModelConfig, MoEConfig, RopeScaling


@dataclass(frozen=True)
class Arch:
    class_name: str  # config.json "architectures"[0]
    model_type: str
    moe_block: str = "mlp"  # where a layer's sparse block lives on disk ("block_sparse_moe" in Mixtral)
    expert_linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert names on disk
    router_bias: bool = False  # the router has a selection bias (DeepSeek-V3's e_score_correction_bias)
    defaults: dict = field(default_factory=dict)  # the HF config class's defaults for optional fields


_COMMON = {"tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "rope_theta": 10000.0,
           "rms_norm_eps": 1e-6, "initializer_range": 0.02}
ARCHS = {
    a.model_type: a
    for a in (
        Arch("LlamaForCausalLM", "llama", defaults={**_COMMON, "max_position_embeddings": 2048, "mlp_bias": False}),
        Arch("Qwen3ForCausalLM", "qwen3", defaults={**_COMMON, "max_position_embeddings": 32768, "head_dim": 128}),
        Arch("Qwen3MoeForCausalLM", "qwen3_moe", defaults={
            **_COMMON, "max_position_embeddings": 32768, "norm_topk_prob": False, "decoder_sparse_step": 1,
            "mlp_only_layers": []}),
        Arch("MixtralForCausalLM", "mixtral", moe_block="block_sparse_moe", expert_linears=("w1", "w3", "w2"),
             defaults={**_COMMON, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072,
                       "router_jitter_noise": 0.0}),
        Arch("OlmoeForCausalLM", "olmoe", defaults={
            **_COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "norm_topk_prob": False}),
        Arch("DeepseekV3ForCausalLM", "deepseek_v3", router_bias=True, defaults={
            **_COMMON, "max_position_embeddings": 4096, "norm_topk_prob": True, "rope_interleave": True,
            "n_shared_experts": 1, "q_lora_rank": 1536, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
            "first_k_dense_replace": 3, "num_nextn_predict_layers": 1}),
        # GLM-4.5's MoE is DeepSeek-V3's (sigmoid scores, selection bias, shared experts, dense first layers)
        # under grouped-query attention; moeflow computes it with whole-head RoPE (partial_rotary_factor 1)
        Arch("Glm4MoeForCausalLM", "glm4_moe", router_bias=True, defaults={
            **_COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "norm_topk_prob": True,
            "n_shared_experts": 1, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "use_qk_norm": False, "partial_rotary_factor": 0.5}),
    )
}
SUPPORTED = ", ".join(a.class_name for a in ARCHS.values())
# HF DeepSeek-V3's two latent RMSNorms keep their class default epsilon, whatever config.rms_norm_eps says.
DEEPSEEK_LATENT_EPS = 1e-6


def arch_of(hf: dict) -> Arch:
    """The architecture of a config.json dict (by model_type, else architectures[0]), or a ValueError."""
    for arch in ARCHS.values():
        if hf.get("model_type") == arch.model_type or arch.class_name in (hf.get("architectures") or []):
            return arch
    named = hf.get("architectures") or hf.get("model_type")
    raise ValueError(
        f"config.json describes {named!r}, which moeflow cannot load; supported architectures: {SUPPORTED}"
    )


def arch_named(name: str) -> Arch:
    for arch in ARCHS.values():
        if name in (arch.class_name, arch.model_type):
            return arch
    raise ValueError(f"unknown architecture {name!r}; choose one of {SUPPORTED}")


# ---- config.json -> ModelConfig -----------------------------------------------------------------------------


class _Fields:
    """config.json fields: required ones with a clear error, optional ones with the HF class default."""

    def __init__(self, hf: dict, arch: Arch):
        self.hf, self.arch = hf, arch

    def need(self, key: str):
        if self.hf.get(key) is None:
            raise ValueError(f"config.json ({self.arch.class_name}) lacks {key!r}; is it a complete config?")
        return self.hf[key]

    def get(self, key: str):
        return self.hf[key] if key in self.hf else self.arch.defaults.get(key)

    def reject(self, key: str, ok, why: str) -> None:
        """ValueError unless the field (or its default) passes `ok`: a feature moeflow does not compute."""
        value = self.get(key)
        if not ok(value):
            raise ValueError(f"config.json ({self.arch.class_name}) sets {key} = {value!r}: {why}")


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig computing what the Hugging Face model computes (ValueError for what moeflow does not)."""
    arch = arch_of(hf)
    f = _Fields(hf, arch)
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"config.json has a quantization_config ({method}); moeflow loads unquantized weights only: "
            f"dequantize the checkpoint to bf16 first"
        )
    f.reject("hidden_act", lambda v: v == "silu", "moeflow's FFNs are SwiGLU (silu); no other activation")
    f.reject("mlp_bias", lambda v: not v, "moeflow's FFNs have no biases")
    f.reject("use_sliding_window", lambda v: not v, "moeflow has no sliding-window attention")
    # transformers 5 reads the fraction of each head that RoPE rotates from rope_parameters (a top-level value
    # is what older configs, or a class default, left beside it)
    rope_fraction = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", f.get("partial_rotary_factor"))
    if rope_fraction not in (None, 1, 1.0):
        raise ValueError(f"config.json ({arch.class_name}) sets partial_rotary_factor = {rope_fraction}: moeflow "
                         f"applies RoPE to the whole head")
    window = hf.get("sliding_window") if arch.model_type == "mixtral" else None
    if window is not None and window < f.get("max_position_embeddings"):
        raise ValueError(
            f"config.json (MixtralForCausalLM) sets sliding_window = {window}, shorter than "
            f"max_position_embeddings; moeflow has no sliding-window attention (set it to null)"
        )

    dim, heads = f.need("hidden_size"), f.need("num_attention_heads")
    head_dim = f.get("head_dim") or dim // heads
    cfg = ModelConfig(
        name="custom", vocab_size=f.need("vocab_size"), dim=dim, n_layers=f.need("num_hidden_layers"),
        n_heads=heads, n_kv_heads=f.get("num_key_value_heads") or heads, head_dim=head_dim,
        ffn_dim=f.need("intermediate_size"), norm_eps=float(f.get("rms_norm_eps")),
        max_seq_len=f.get("max_position_embeddings"), tie_embeddings=bool(f.get("tie_word_embeddings")),
        init_std=float(f.get("initializer_range")), attention_bias=bool(f.get("attention_bias")),
    )
    cfg.rope_theta, cfg.rope_scaling = _rope_from_hf(f, cfg.max_seq_len)
    _ARCH_READERS[arch.model_type](f, cfg)
    return cfg.validate()


def _rope_from_hf(f: _Fields, max_seq_len: int) -> tuple[float, RopeScaling]:
    # transformers 5 writes `rope_parameters` (theta inside); older configs have rope_theta + rope_scaling.
    rope = dict(f.hf.get("rope_parameters") or f.hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta") or f.get("rope_theta"))
    kind = rope.get("rope_type", rope.get("type", "default"))
    original = rope.get("original_max_position_embeddings") or max_seq_len
    if kind == "default":
        return theta, RopeScaling()
    if kind == "llama3":
        return theta, RopeScaling(type="llama3", factor=float(rope["factor"]), original_max_seq_len=original,
                                  low_freq_factor=float(rope["low_freq_factor"]),
                                  high_freq_factor=float(rope["high_freq_factor"]))
    if kind == "yarn":
        if rope.get("truncate", True) is False:
            raise ValueError("config.json sets rope_parameters.truncate = false; moeflow's YaRN always truncates")
        return theta, RopeScaling(
            type="yarn", factor=float(rope.get("factor") or max_seq_len / original), original_max_seq_len=original,
            beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
            attention_factor=float(rope.get("attention_factor") or 0),
        )
    raise ValueError(
        f"config.json uses RoPE scaling of type {kind!r}; moeflow computes 'default', 'llama3' and 'yarn' only"
    )


def _qk_norm_per_head(f: _Fields, cfg: ModelConfig) -> None:
    cfg.qk_norm = "per_head"


def _qwen3_moe(f: _Fields, cfg: ModelConfig) -> None:
    cfg.qk_norm = "per_head"
    f.reject("decoder_sparse_step", lambda v: v == 1, "moeflow puts experts in every layer after the first dense ones")
    dense = sorted(f.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise ValueError(
            f"config.json (Qwen3MoeForCausalLM) sets mlp_only_layers = {dense}; moeflow supports dense layers "
            f"only as the first k layers ([0, 1, ..., k-1])"
        )
    experts = f.hf.get("num_experts") or f.need("num_local_experts")
    cfg.moe = _softmax_moe(f, experts, f.need("moe_intermediate_size"), bool(f.get("norm_topk_prob")))
    cfg.moe.first_k_dense = len(dense)


def _mixtral(f: _Fields, cfg: ModelConfig) -> None:
    f.reject("router_jitter_noise", lambda v: not v, "moeflow's router has no jitter noise (set it to 0)")
    cfg.moe = _softmax_moe(f, f.need("num_local_experts"), cfg.ffn_dim, renormalise=True)


def _olmoe(f: _Fields, cfg: ModelConfig) -> None:
    f.reject("clip_qkv", lambda v: v is None, "moeflow does not clip queries, keys and values (set it to null)")
    if cfg.hd * cfg.n_heads != cfg.dim:
        raise ValueError("config.json (OlmoeForCausalLM): OLMoE's q_norm spans hidden_size = heads * head_dim")
    cfg.qk_norm = "full"
    experts = f.hf.get("num_experts") or f.need("num_local_experts")
    cfg.moe = _softmax_moe(f, experts, cfg.ffn_dim, bool(f.get("norm_topk_prob")))


def _softmax_moe(f: _Fields, experts: int, width: int, renormalise: bool) -> MoEConfig:
    top_k = f.need("num_experts_per_tok")
    # The balance loss of HF's MoE models counts only with output_router_logits; moeflow's is off likewise
    # (model.moe.aux_loss_coef turns it on), and no selection bias is learnt (load_balance 'none').
    return MoEConfig(num_experts=experts, top_k=top_k, ffn_dim=width, score_func="softmax",
                     norm_topk_prob=renormalise, norm_top1=renormalise and top_k == 1, load_balance="none")


def _deepseek_v3(f: _Fields, cfg: ModelConfig) -> None:
    f.reject("scoring_func", lambda v: v in (None, "sigmoid"), "HF's DeepSeek-V3 routes with sigmoid scores only")
    f.reject("topk_method", lambda v: v in (None, "noaux_tc"), "HF's DeepSeek-V3 routes with 'noaux_tc' only")
    f.reject("attention_bias", lambda v: not v, "moeflow's MLA projections have no biases")
    cfg.attention, cfg.n_kv_heads, cfg.head_dim = "mla", 0, 0
    cfg.q_lora_rank = f.get("q_lora_rank") or 0
    cfg.kv_lora_rank, cfg.v_head_dim = f.need("kv_lora_rank"), f.need("v_head_dim")
    cfg.qk_nope_head_dim, cfg.qk_rope_head_dim = f.need("qk_nope_head_dim"), f.need("qk_rope_head_dim")
    cfg.rope_interleave = bool(f.get("rope_interleave"))
    cfg.latent_norm_eps = DEEPSEEK_LATENT_EPS
    cfg.moe = _sigmoid_moe(f)
    # Multi-token prediction layers follow the decoder layers in the checkpoint. Only an explicit field counts
    # (transformers' class default is 1, but its own save_pretrained writes no MTP tensors); the loader lowers it
    # to 0 for a checkpoint that holds none (moeflow.models.hf.read_hf_config).
    cfg.mtp_depth = int(f.hf.get("num_nextn_predict_layers") or f.hf.get("num_mtp_layers") or 0)


def _glm4_moe(f: _Fields, cfg: ModelConfig) -> None:
    f.reject("attention_bias", lambda v: not v, "GLM-4.5's output projection has no bias, unlike moeflow's")
    cfg.qk_norm = "per_head" if f.get("use_qk_norm") else "none"
    cfg.moe = _sigmoid_moe(f)


def _sigmoid_moe(f: _Fields) -> MoEConfig:
    """DeepSeek-V3's routing (also GLM-4.5's): sigmoid scores, a selection bias, shared experts, groups."""
    top_k, norm = f.need("num_experts_per_tok"), bool(f.get("norm_topk_prob"))
    return MoEConfig(
        num_experts=f.need("n_routed_experts"), top_k=top_k, ffn_dim=f.need("moe_intermediate_size"),
        num_shared_experts=f.get("n_shared_experts") or 0, first_k_dense=f.get("first_k_dense_replace"),
        score_func="sigmoid", norm_topk_prob=norm, norm_top1=norm and top_k == 1,
        route_scale=float(f.get("routed_scaling_factor")), n_group=f.get("n_group"), topk_group=f.get("topk_group"),
        load_balance="aux_free",  # HF adds e_score_correction_bias to the scores that choose experts
    )


_ARCH_READERS = {
    "llama": lambda f, cfg: None, "qwen3": _qk_norm_per_head, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral,
    "olmoe": _olmoe, "deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe,
}


def ignored_on_load(hf: dict, name: str) -> bool:
    """Tensors a checkpoint may hold that the causal LM does not use: stale RoPE tables of old checkpoints."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return name == "lm_head.weight" and bool(hf.get("tie_word_embeddings"))


def mtp_tensor_names(hf: dict, names) -> list[str]:
    """The names among `names` that belong to DeepSeek-V3 MTP layers (model.layers.<i> with i >= num_hidden_layers)."""
    if hf.get("model_type") != "deepseek_v3":
        return []
    first = hf["num_hidden_layers"]
    return [n for n in names if n.startswith("model.layers.") and int(n.split(".")[2]) >= first]


# ---- ModelConfig -> config.json -----------------------------------------------------------------------------


def infer_arch(cfg: ModelConfig) -> Arch:
    """The Hugging Face architecture a moeflow config is exported as, from what it computes."""
    if cfg.attention == "mla":
        return ARCHS["deepseek_v3"]
    if cfg.is_moe and (cfg.moe.score_func == "sigmoid" or cfg.moe.num_shared_experts):
        return ARCHS["glm4_moe"]  # DeepSeek-V3's MoE under grouped-query attention
    if cfg.qk_norm == "full":
        return ARCHS["olmoe"]
    if cfg.qk_norm == "per_head":
        return ARCHS["qwen3_moe" if cfg.is_moe else "qwen3"]
    return ARCHS["mixtral" if cfg.is_moe else "llama"]


def renormalises(m: MoEConfig) -> bool:
    """Whether moeflow's router rescales the top-k weights to sum to 1 (see Router.forward)."""
    return m.norm_topk_prob and (m.top_k > 1 or m.norm_top1)


def check_exportable(cfg: ModelConfig, arch: Arch) -> None:
    """ValueError naming each setting the architecture cannot express."""
    m, problems = cfg.moe, []

    def need(ok: bool, text: str) -> None:
        if not ok:
            problems.append(text)

    kind = arch.model_type
    sigmoid_routed = kind in ("deepseek_v3", "glm4_moe")
    need((cfg.attention == "mla") == (kind == "deepseek_v3"), f"attention = {cfg.attention!r}")
    want_norm = {"qwen3": "per_head", "qwen3_moe": "per_head", "olmoe": "full"}.get(kind, "none")
    if kind == "glm4_moe":  # use_qk_norm chooses
        want_norm = cfg.qk_norm if cfg.qk_norm in ("none", "per_head") else "none' or 'per_head"
    need(cfg.qk_norm == want_norm, f"qk_norm = {cfg.qk_norm!r} (the architecture has {want_norm!r})")
    need(cfg.is_moe == (kind in ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe")),
         f"moe.num_experts = {m.num_experts}")
    need(not cfg.attention_bias or kind in ("llama", "qwen3", "qwen3_moe", "olmoe"), "attention_bias = true")
    need(cfg.mtp_depth == 0 or kind == "deepseek_v3",
         f"mtp_depth = {cfg.mtp_depth} (only DeepSeek-V3 checkpoints store MTP layers)")
    if kind == "olmoe":
        need(cfg.hd * cfg.n_heads == cfg.dim, f"head_dim = {cfg.hd} with n_heads * head_dim != dim ({cfg.dim})")
    if kind == "deepseek_v3":
        need((cfg.latent_norm_eps or cfg.norm_eps) == DEEPSEEK_LATENT_EPS,
             f"latent_norm_eps = {cfg.latent_norm_eps or cfg.norm_eps} (HF's DeepSeek-V3 uses 1e-6)")
    if cfg.is_moe:
        if sigmoid_routed:
            need(m.score_func == "sigmoid", f"moe.score_func = {m.score_func!r}")
            need(m.shared_ffn_dim in (0, m.ffn_dim), f"moe.shared_ffn_dim = {m.shared_ffn_dim} (must equal ffn_dim)")
            need(m.n_group == 1 or m.num_experts // m.n_group >= 2, "groups of one expert (n_group = num_experts)")
        else:
            need(m.score_func == "softmax", f"moe.score_func = {m.score_func!r}")
            need(m.num_shared_experts == 0, f"moe.num_shared_experts = {m.num_shared_experts}")
            need(m.n_group == 1, f"moe.n_group = {m.n_group}")
            need(m.route_scale == 1.0, f"moe.route_scale = {m.route_scale}")
            need(m.first_k_dense == 0 or kind == "qwen3_moe", f"moe.first_k_dense = {m.first_k_dense}")
        if kind == "mixtral":
            need(renormalises(m), "top-k weights that are not renormalised (Mixtral always renormalises)")
    if problems:
        raise ValueError(
            f"this moeflow model cannot be written as {arch.class_name}: " + "; ".join(problems)
            + f". Pick another architecture ({SUPPORTED}) or change those settings"
        )


def config_to_hf(cfg: ModelConfig, arch: Arch, dtype: str) -> dict:
    """config.json for `arch`, written as a dict (transformers is not needed to save)."""
    check_exportable(cfg, arch)
    m = cfg.moe
    hf = {
        "architectures": [arch.class_name], "model_type": arch.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.hd, "intermediate_size": cfg.ffn_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std, "dtype": dtype,
        "torch_dtype": dtype, "use_cache": True, **_rope_to_hf(cfg),
    }
    if arch.model_type in ("llama", "qwen3", "qwen3_moe", "olmoe"):
        hf["attention_bias"] = cfg.attention_bias
    if arch.model_type == "qwen3_moe":
        hf.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.ffn_dim,
                  norm_topk_prob=renormalises(m), decoder_sparse_step=1,
                  mlp_only_layers=list(range(m.first_k_dense)), output_router_logits=False)
    elif arch.model_type in ("mixtral", "olmoe"):
        # Both name the expert width intermediate_size and have no dense layers.
        hf.update(num_experts_per_tok=m.top_k, intermediate_size=m.ffn_dim, output_router_logits=False)
        hf["num_local_experts" if arch.model_type == "mixtral" else "num_experts"] = m.num_experts
        if arch.model_type == "olmoe":
            hf.update(norm_topk_prob=renormalises(m), clip_qkv=None)
        else:
            hf.update(sliding_window=None, router_jitter_noise=0.0)
    elif arch.model_type == "glm4_moe":
        hf.update(
            n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.ffn_dim,
            n_shared_experts=m.num_shared_experts, first_k_dense_replace=m.first_k_dense,
            routed_scaling_factor=m.route_scale, n_group=m.n_group, topk_group=m.topk_group,
            norm_topk_prob=renormalises(m), use_qk_norm=cfg.qk_norm == "per_head", attention_bias=False,
            partial_rotary_factor=1.0, num_mtp_layers=0)
        hf["rope_parameters"]["partial_rotary_factor"] = 1.0  # where transformers 5 reads it
    elif arch.model_type == "deepseek_v3":
        hf.update(
            num_key_value_heads=cfg.n_heads, head_dim=cfg.qk_rope_head_dim, q_lora_rank=cfg.q_lora_rank or None,
            kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave,
            n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.ffn_dim,
            n_shared_experts=m.num_shared_experts, first_k_dense_replace=m.first_k_dense,
            routed_scaling_factor=m.route_scale, n_group=m.n_group, topk_group=m.topk_group,
            norm_topk_prob=renormalises(m), num_nextn_predict_layers=cfg.mtp_depth, attention_bias=False,
        )
    return hf


def _rope_to_hf(cfg: ModelConfig) -> dict:
    r = cfg.rope_scaling
    params: dict = {"rope_type": "default"}
    if r.type == "llama3":
        params = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                  "high_freq_factor": r.high_freq_factor}
    elif r.type == "yarn":
        params = {"rope_type": "yarn", "factor": r.factor, "beta_fast": r.beta_fast, "beta_slow": r.beta_slow}
        params.update({k: getattr(r, k) for k in ("mscale", "mscale_all_dim", "attention_factor") if getattr(r, k)})
    if r.type != "none":
        params["original_max_position_embeddings"] = r.original_max_seq_len or cfg.max_seq_len
    # transformers 5 reads rope_parameters; older readers (transformers 4, vLLM) rope_theta and rope_scaling.
    return {"rope_theta": cfg.rope_theta, "rope_parameters": {**params, "rope_theta": cfg.rope_theta},
            "rope_scaling": None if r.type == "none" else {**params, "type": params["rope_type"]}}


# ---- tensor names -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    hf: str  # Hugging Face tensor name
    mf: str  # moeflow state_dict key
    expert: int | None = None  # the slice [expert] of the moeflow tensor, for per-expert HF tensors
    transform: str = "same"  # how the tensor changes between the formats (the module docstring)


def moe_block_rules(cfg: ModelConfig, arch: Arch, fused: bool, block: str) -> list[Rule]:
    """Rules for one sparse block: HF names under `block` ('' for a live block), moeflow names under MoE."""
    m, p = cfg.moe, f"{block}." if block else ""
    rules = [Rule(f"{p}gate.weight", "router.gate.weight")]
    if arch.router_bias:
        rules.append(Rule(f"{p}gate.e_score_correction_bias", "router.expert_bias"))
    if fused:
        rules += [Rule(f"{p}experts.gate_up_proj", "experts.w1", transform="gate_half"),
                  Rule(f"{p}experts.gate_up_proj", "experts.w3", transform="up_half"),
                  Rule(f"{p}experts.down_proj", "experts.w2", transform="down_fused")]
    else:
        gate, up, down = arch.expert_linears
        for e in range(m.num_experts):
            rules += [Rule(f"{p}experts.{e}.{gate}.weight", "experts.w1", e, "transposed"),
                      Rule(f"{p}experts.{e}.{up}.weight", "experts.w3", e, "transposed"),
                      Rule(f"{p}experts.{e}.{down}.weight", "experts.w2", e, "transposed")]
    if m.num_shared_experts:
        rules += [Rule(f"{p}shared_experts.{hf}.weight", f"shared_experts.{mf}.weight") for hf, mf in _SWIGLU]
    return rules


_SWIGLU = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
_GQA = (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo"))
_MLA = (("kv_a_proj_with_mqa.weight", "wkv_a.weight"), ("kv_a_layernorm.weight", "kv_norm.weight"),
        ("kv_b_proj.weight", "wkv_b.weight"), ("o_proj.weight", "wo.weight"))
_MLA_Q_LORA = (("q_a_proj.weight", "wq_a.weight"), ("q_a_layernorm.weight", "q_norm.weight"),
               ("q_b_proj.weight", "wq_b.weight"))


def _attention_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(HF name under self_attn, moeflow name under attention)."""
    if cfg.attention == "mla":
        query = _MLA_Q_LORA if cfg.q_lora_rank else (("q_proj.weight", "wq.weight"),)
        return [*query, *_MLA]
    suffixes = ("weight", "bias") if cfg.attention_bias else ("weight",)
    pairs = [(f"{h}.{s}", f"{m}.{s}") for h, m in _GQA for s in suffixes]
    if cfg.qk_norm != "none":
        pairs += [("q_norm.weight", "q_norm.weight"), ("k_norm.weight", "k_norm.weight")]
    return pairs


def layer_rules(cfg: ModelConfig, arch: Arch, layer: int, fused: bool, mf: str | None = None) -> list[Rule]:
    """One decoder layer's rules; `mf`: the moeflow prefix of its block (default 'layers.<layer>.')."""
    hf, mf = f"model.layers.{layer}.", mf or f"layers.{layer}."
    rules = [Rule(hf + "input_layernorm.weight", mf + "attention_norm.weight"),
             Rule(hf + "post_attention_layernorm.weight", mf + "ffn_norm.weight")]
    rules += [Rule(f"{hf}self_attn.{h}", f"{mf}attention.{m}") for h, m in _attention_pairs(cfg)]
    if not cfg.is_moe_layer(layer):
        return rules + [Rule(f"{hf}mlp.{h}.weight", f"{mf}feed_forward.{m}.weight") for h, m in _SWIGLU]
    # transformers 5 renames Mixtral's block_sparse_moe to mlp in memory, so fused names always say mlp.
    block = "mlp" if fused else arch.moe_block
    return rules + [Rule(hf + r.hf, f"{mf}feed_forward.{r.mf}", r.expert, r.transform)
                    for r in moe_block_rules(cfg, arch, fused, block)]


def tensor_rules(cfg: ModelConfig, arch: Arch, fused: bool = False) -> list[Rule]:
    """Every tensor of the checkpoint, in the order Hugging Face's own save writes them (roughly)."""
    rules = [Rule("model.embed_tokens.weight", "tok_embeddings.weight")]
    for layer in range(cfg.n_layers):
        rules += layer_rules(cfg, arch, layer, fused)
    rules.append(Rule("model.norm.weight", "norm.weight"))
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", "output.weight"))
    for k in range(cfg.mtp_depth):
        rules += mtp_rules(cfg, arch, k, fused)
    return rules


def mtp_rules(cfg: ModelConfig, arch: Arch, k: int, fused: bool) -> list[Rule]:
    """DeepSeek-V3's MTP depth k+1, stored as decoder layer n_layers + k (the names vLLM's and transformers'
    loaders read): its own norms, projection and block, and copies of the shared embedding and head."""
    layer = cfg.n_layers + k
    hf, mf = f"model.layers.{layer}.", f"mtp.{k}."
    own = [Rule(hf + "enorm.weight", mf + "enorm.weight"), Rule(hf + "hnorm.weight", mf + "hnorm.weight"),
           Rule(hf + "eh_proj.weight", mf + "eh_proj.weight"),
           Rule(hf + "shared_head.norm.weight", mf + "norm.weight"),
           Rule(hf + "embed_tokens.weight", "tok_embeddings.weight", transform="copy"),
           Rule(hf + "shared_head.head.weight", "output.weight", transform="copy")]
    return own + layer_rules(cfg, arch, layer, fused, mf=mf + "block.")


def config_json(path: str | Path) -> dict:
    """A Hugging Face folder's config.json, or a ValueError saying what the folder lacks."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"Hugging Face folder {str(folder)!r} does not exist; pass the folder holding config.json")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"{str(folder)!r} has no config.json; pass a Hugging Face model folder (config.json + *.safetensors), "
            f"e.g. one written by transformers' save_pretrained or downloaded with `hf download`"
        )
    try:
        hf = json.loads(config_file.read_text())
    except ValueError as e:
        raise ValueError(f"{config_file} is not valid JSON ({e})") from None
    return hf
