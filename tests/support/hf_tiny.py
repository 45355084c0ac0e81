"""Tiny random models of every MoE architecture of the installed transformers, found rather than listed.

An architecture is a transformers/models/<dir>/ whose modeling file uses transformers' experts interface
(`use_experts_implementation`), so a transformers upgrade that adds one is covered without an edit here.
Each gets a tiny fp32 config built from its config class's own defaults by shrinking the fields it has
(TINY), cutting per-layer lists to one layer of each kind, plus the few per-architecture OVERRIDES the
generic rule cannot know. Weights are then redrawn at order one, so that experts and routing matter.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MARK = "use_experts_implementation"
V = 256  # vocabulary of every tiny config

# field -> tiny value, applied to every field a config class has (hidden 64, 4 heads of 16, 8 experts of width 32)
TINY = dict(
    vocab_size=V, unpadded_vocab_size=V, vocab_size_per_layer_input=V, hidden_size=64, hidden_size_per_layer_input=16,
    intermediate_size=128, dense_intermediate_size=128, prefix_dense_intermediate_size=128, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32, shared_experts_intermediate_size=32,
    shared_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, tie_word_embeddings=False,
    max_position_embeddings=256, model_max_length=256,  # past moeflow's default data.seq_len (128)
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8,
    num_experts_per_tok=2, num_experts_per_token=2, moe_topk=2, moe_k=2, top_k_experts=2,
    kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,  # MLA
    index_topk=8, index_head_dim=16, index_n_heads=2, index_num_heads=2,  # sparse-attention indexers
    # kolibri1_1's: a pool of 4 blocks of 2, one sink and two local tokens, so that the last queries of a
    # 12-token row choose among their keys
    index_pool_size=8, index_compression=2, index_num_sink_tokens=1, index_num_local_tokens=2,
    first_dense_intermediate_size=128, mlp_only_intermediate_size=128,  # dense MLPs of the leading layers
    zero_expert_num=2,  # identity experts beside the 8 (longcat_flash): the routed ones keep most of the tokens
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_head_dim=16, linear_num_heads=4,
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16, mamba_dt_rank=8, mamba_num_heads=8,
    mamba_head_dim=16, ssm_state_size=16, chunk_size=16, n_groups=2,
    sliding_window=8, sliding_window_size=8,
    router_jitter_noise=0.0, input_jitter_noise=0.0, num_nextn_predict_layers=0,  # deterministic, no MTP heads
)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the full-size ids are past the tiny vocabulary

# what the generic rule cannot know, each with why
OVERRIDES = {
    "zaya": dict(num_experts_per_tok=1),  # its config validator allows top-1 only
    # its experts sit beside the dense MLP, off by default; and as in its MoE release (26B-A4B), no per-layer
    # embeddings (those are its small dense models') and the full-attention layers' values are their keys
    "gemma4": dict(enable_moe_block=True, hidden_size_per_layer_input=0, attention_k_eq_v=True),
    "dots1": dict(n_shared_experts=1),  # the default None crashes the shared-expert MLP
    "dots3_note": dict(head_dim=32),  # MLA whose head_dim (the whole query-key head) is a fixed default, not derived
    # default layer_types is None (lfm2_moe) or all linear attention (granitemoehybrid, which then fails in
    # get_seq_length): one convolution/linear layer and one attention layer, and a dense first one for lfm2_moe
    "lfm2_moe": dict(num_hidden_layers=3, layer_types=["conv", "conv", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    # its indexer's defaults are None (the config refuses them); the hyper-connections' rank is full size
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                      indexer_compress_ratio=2, hc_lowrank=16),
}


@functools.cache
def _exports() -> dict[str, tuple[str, list[str]]]:
    """{dir: (modeling module, its __all__)} for the modeling files that use the experts interface, by a text
    search (importing every modeling file would take minutes)."""
    root = Path(importlib.util.find_spec("transformers").origin).parent / "models"
    found = {}
    for path in sorted(root.glob("*/modeling_*.py")):
        src = path.read_text()
        if MARK in src:
            names = re.search(r"^__all__\s*=\s*\[(.*?)\]", src, re.S | re.M)
            found[path.parent.name] = (path.stem, re.findall(r"\"(\w+)\"", names.group(1)) if names else [])
    return found


def moe_architectures() -> dict[str, str | None]:
    """{dir: its text-only *ForCausalLM class name, or None when it has none (see not_fitting_reason)}."""
    out = {}
    for d, (_, names) in _exports().items():
        lms = [n for n in names if n.endswith("ForCausalLM")]
        out[d] = min(lms, key=lambda n: "Text" not in n) if lms else None  # a *TextForCausalLM is the text-only one
    return out


def not_fitting_reason(d: str) -> str:
    """Why architecture `d` has no tiny model: its task heads (the *For... classes it exports) are not a text LM."""
    heads = [n for n in _exports()[d][1] if re.search(r"For[A-Z]\w*$", n)]
    if any(n.endswith("ForConditionalGeneration") for n in heads):
        return "only *ForConditionalGeneration (multimodal), no text-only *ForCausalLM"
    return f"not a causal LM ({', '.join(heads)})"


def causal_lm_class(d: str) -> type:
    """The *ForCausalLM class of `d`, importing only its modeling module."""
    name = moe_architectures()[d]
    if name is None:
        raise ValueError(f"{d}: {not_fitting_reason(d)}")
    return getattr(importlib.import_module(f"transformers.models.{d}.{_exports()[d][0]}"), name)


def _layer_count_key(defaults: dict) -> str | None:
    """The field that counts the layers: num_hidden_layers, or num_layers where num_hidden_layers is derived from
    it (longcat_flash: two attention sublayers per layer, so num_hidden_layers is a property, not a field)."""
    return next((k for k in ("num_hidden_layers", "num_layers") if k in defaults), None)


def _layer_refs(defaults: dict, n: int) -> tuple[dict, dict]:
    """({field: per-layer list of layer indices}, {field: list of some layer indices}): the `*_layers` fields of
    ints that name layers, e.g. kolibri1_1's kv_source_layers (the layer whose K/V each layer reads) and
    index_layers. Kept layers keep their references, renumbered (tiny_config)."""
    per_layer, subsets = {}, {}
    for k, v in defaults.items():
        if (k.endswith("_layers") and isinstance(v, list) and v
                and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in v)):
            (per_layer if len(v) == n else subsets)[k] = v
    return per_layer, subsets


def _layers(defaults: dict) -> tuple[int, list[int]]:
    """(default layer count, the layers kept): the first layer of each kind in every per-layer list of names
    (attention, MLP or block type), the first in and the first out of every list of layer indices (an indexer and a
    layer that is not one), the first that reads another layer (its K/V) and the layers it reads, at least two."""
    n = defaults.get(_layer_count_key(defaults)) or len(defaults.get("layers_block_type") or ())
    kinds = [v for v in defaults.values() if isinstance(v, list) and len(v) == n and all(isinstance(x, str) for x in v)]
    per_layer, subsets = _layer_refs(defaults, n)
    kinds += [[i == x for i, x in enumerate(v)] for v in per_layer.values()]
    kinds += [[i in v for i in range(n)] for v in subsets.values()]
    keep = {v.index(x) for v in kinds for x in v}
    spare = (i for i in range(n) if i not in keep)
    while len(keep) < 2:
        keep.add(next(spare))
    for v in per_layer.values():  # the layers a kept layer reads are kept too (they read themselves)
        keep |= {v[i] for i in keep}
    return n, sorted(keep)


def tiny_config(d: str, **changes) -> PretrainedConfig:
    """The tiny fp32 PretrainedConfig of architecture `d` (a key of moe_architectures()), with `changes` to its
    fields made before the config derives anything from them."""
    cls = causal_lm_class(d).config_class
    defaults = cls().to_dict()
    kw = {k: v for k, v in TINY.items() if k in defaults}
    # fields the config also knows by TINY's names (its attribute_map: longcat_flash's expert_ffn_hidden_size is
    # moe_intermediate_size), where no field of that name is there
    aliases = {a: f for a, f in getattr(cls, "attribute_map", {}).items() if f in defaults and a not in defaults}
    for a, f in aliases.items():
        if a in TINY:
            kw.setdefault(f, TINY[a])
    if defaults.get("q_lora_rank") is not None:
        kw["q_lora_rank"] = 32
    if "kv_lora_rank" in defaults:  # MLA: kv heads are the query heads
        kw["num_key_value_heads"] = kw["num_attention_heads"]
        # head_dim is the RoPE part or the whole query-key head, by family, derived by most but a fixed default of
        # some (longcat_flash): the part its default equals, at the tiny sizes (else left to the family)
        rope, nope = defaults.get("qk_rope_head_dim") or 0, defaults.get("qk_nope_head_dim") or 0
        tiny = {rope: TINY["qk_rope_head_dim"], rope + nope: TINY["qk_rope_head_dim"] + TINY["qk_nope_head_dim"]}
        kw.pop("head_dim", None)
        if defaults.get("head_dim") in tiny:
            kw["head_dim"] = tiny[defaults["head_dim"]]
    if "moe_intermediate_size" not in defaults and "moe_intermediate_size" not in aliases:
        kw["intermediate_size"] = 32  # intermediate_size is the experts' width
    for group in ("n_group", "num_expert_group"):  # group-limited routing: 2 groups of 4, one chosen
        if defaults.get(group) is not None:
            kw.update({group: 2, "topk_group": 1} if "topk_group" in defaults else {group: 2})
    kw.update({k: v for k, v in TOKENS.items() if k in defaults})
    n, keep = _layers(defaults)
    if _layer_count_key(defaults):
        kw[_layer_count_key(defaults)] = len(keep)
    for k, v in defaults.items():  # per-layer lists: the kept layers (numbers per layer take the tiny value)
        if isinstance(v, list) and len(v) == n:
            kw[k] = [v[i] for i in keep]
            if k.removesuffix("_per_layer") in TINY:
                kw[k] = [TINY[k.removesuffix("_per_layer")]] * len(keep)
    per_layer, subsets = _layer_refs(defaults, n)
    for k, v in per_layer.items():  # layer indices renumbered among the kept layers (_layers keeps what they name)
        kw[k] = [keep.index(v[i]) for i in keep]
    for k, v in subsets.items():
        kw[k] = [keep.index(i) for i in v if i in keep]
    rope = defaults.get("rope_parameters")
    if isinstance(rope, dict) and "original_max_position_embeddings" in rope:  # YaRN: a context 4x the original
        tiny = {k: TINY[k] for k in rope if k in TINY}  # mistral4 repeats max_position_embeddings here
        original = TINY["max_position_embeddings"] // 4
        kw["rope_parameters"] = {**rope, **tiny, "original_max_position_embeddings": original, "factor": 4.0}
    if "per_layer_config" in defaults:  # per-layer shapes of the full-size model
        kw["per_layer_config"] = {}
    for k in [k for k in defaults if k.endswith("_layer_period")]:  # interleaving (jamba): period 2
        kw[k], offset = 2, k.replace("_period", "_offset")
        kw[offset] = defaults[offset] % 2
    # a dense first layer where the family can have one (as many as the kept mlp_layer_types lead with)
    mlp = kw.get("mlp_layer_types")
    if defaults.get("first_k_dense_replace") is not None:
        kw["first_k_dense_replace"] = next((i for i, x in enumerate(mlp) if x != "dense"), len(mlp)) if mlp else 1
    if "num_dense_layers" in defaults:
        kw["num_dense_layers"] = 1
    if "mlp_only_layers" in defaults:
        kw["mlp_only_layers"] = [0]
    kw.update(OVERRIDES.get(d, {}))
    kw.update(changes)
    return cls(**kw)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order one (transformers' 0.02 init leaves routing near ties): matrices N(0,1)/sqrt(fan-in),
    embeddings N(0,1); vectors the model's own init plus 0.2 N (norms and scales around 1, biases around 0, a
    norm stored as its offset from 1 around 0); selection-bias buffers plus 0.1 N. So a swapped or transposed
    expert slice cannot go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.ndim == 1:
            p.add_(0.2 * noise)
        else:
            p.copy_(noise * (1.0 if "embed" in name else p.shape[-1] ** -0.5))
    for name, b in model.named_buffers():  # e_score_correction_bias, expert_bias (lfm2_moe), balancing_biases (zaya)
        if b.is_floating_point() and re.search(r"_bias(es)?$", name):
            b.add_(0.1 * torch.randn(b.shape, generator=gen))


def tiny_model(d: str, seed: int = 0) -> torch.nn.Module:
    """The *ForCausalLM of `d` in fp32 from tiny_config, its weights drawn from `seed` (randomize)."""
    cls, config = causal_lm_class(d), tiny_config(d)
    with torch.random.fork_rng(devices=[]):  # some vectors (attention sinks, A_log) start random: seed them too
        torch.manual_seed(seed)
        model = cls(config).float()
    randomize(model, seed)
    return model


def with_unknown_layer_kind() -> torch.nn.Module:
    """A tiny Qwen3-Next whose full-attention layers are of a kind context parallelism does not know
    ('sparse_attention'): what its refusal of an unknown layer kind is tested on."""
    model = tiny_model("qwen3_next")
    model.config.layer_types = ["sparse_attention" if t == "full_attention" else t for t in model.config.layer_types]
    return model
