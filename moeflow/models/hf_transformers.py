"""model.hf_impl = 'transformers': a Hugging Face folder run by transformers' own modules.

moeflow's own model (moeflow.models.hf) computes the architectures core/hf_arch.py maps exactly, and is the fast
path for them. Every other decoder LM of the installed transformers runs as transformers builds it: attention
sinks, sliding windows, router biases, clamped SwiGLU, partial RoPE and the like are transformers' code, so the
math is transformers' by construction. parallelize reaches such a model through its adapter
(moeflow.parallel.adapter.HuggingFaceAdapter): FSDP2, activation checkpointing, compile, and expert parallelism
of its experts modules through transformers' experts interface (moeflow.parallel.hf_experts).

The run's ModelConfig then only describes the model (`describe`: widths, layers, experts for the FLOP count, the
planner and the resume check); it builds nothing.

    resolve_impl(cfg, hf)       -> 'native' | 'transformers' for model.hf_impl (ValueError for what cannot train)
    describe(hf)                -> the ModelConfig of the model's sizes
    load(folder, device)        -> transformers' model, fp32 (on the meta device: no weights read)
    load_empty(folder)          -> the same with its parameters on the meta device and its buffers computed
    logits(model, inputs, ...)  -> [B, S, V]: the forward the step runner calls
    GenerationModel(model, cfg) -> the interface moeflow generate / eval call (tokens -> logits, a KV cache)
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from pathlib import Path

import torch
from torch import nn

from moeflow.core.hf_arch import config_json
from moeflow.core.model_config import ModelConfig, MoEConfig

# config.json keys of the same quantity under the names different architectures use, in order of preference
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "moe_k")
_EXPERT_WIDTH = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")
_SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")


def text_config(hf: dict) -> dict:
    """The decoder's part of a config.json dict (multimodal configs nest it under text_config)."""
    return hf.get("text_config") or hf


def _with_aliases(t: dict) -> dict:
    """config.json's fields, plus the same values under the names transformers' config class maps onto them (its
    attribute_map: longcat_flash stores its experts' width as expert_ffn_hidden_size, read as moe_intermediate_size)."""
    from transformers import CONFIG_MAPPING

    model_type = t.get("model_type")
    aliases = CONFIG_MAPPING[model_type].attribute_map if model_type in CONFIG_MAPPING else {}
    return {**{alias: t[name] for alias, name in aliases.items() if name in t}, **t}


def _first(d: dict, keys: tuple[str, ...], default=0):
    for key in keys:
        value = d.get(key)
        if value:
            return value[0] if isinstance(value, list) else value
    return default


def causal_lm_class(hf: dict):
    """transformers' causal-LM class for this config.json: AutoModelForCausalLM, or the *ForCausalLM class the
    config names where the auto mapping lacks its model type (transformers registers a few only elsewhere);
    None when there is neither."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if hf.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    named = (hf.get("architectures") or [""])[0]
    return getattr(transformers, named, None) if named.endswith("ForCausalLM") else None


def uses_experts_interface(hf: dict) -> bool:
    """Whether the architecture's experts module is transformers' experts interface (`use_experts_implementation`,
    what moeflow's expert parallelism plugs into): read from its modeling file, nothing is built."""
    import sys

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf.get("model_type")) or (hf.get("architectures") or [""])[0]
    cls = getattr(transformers, name, None)
    source = getattr(sys.modules.get(cls.__module__) if cls else None, "__file__", None)
    return bool(source) and "use_experts_implementation" in Path(source).read_text()


def causal_lm_refusal(hf: dict) -> str | None:
    """Why transformers has no causal LM for this config.json (None when it has one)."""
    if causal_lm_class(hf) is not None:
        return None
    model_type = hf.get("model_type")
    named = (hf.get("architectures") or [model_type])[0]
    kind = "an encoder-decoder model" if hf.get("is_encoder_decoder") else "not a causal language model"
    import transformers

    return (f"config.json describes {named!r} (model_type {model_type!r}), {kind} in transformers "
            f"{transformers.__version__}; moeflow trains decoder LMs (a *ForCausalLM)")


def resolve_impl(cfg: ModelConfig, hf: dict) -> str:
    """model.hf_impl as it will run: 'native' where moeflow maps the architecture exactly (or was told to, which
    then raises the mapping's own one-line reason), 'transformers' otherwise."""
    from moeflow.core.hf_arch import config_from_hf

    if cfg.hf_impl == "native":
        config_from_hf(hf)  # its ValueError names what moeflow's model does not compute
        return "native"
    if cfg.hf_impl == "auto":
        try:
            config_from_hf(hf)
            return "native"
        except ValueError:
            pass
    refusal = causal_lm_refusal(hf)
    if refusal:
        raise ValueError(refusal)
    return "transformers"


def describe(hf: dict, folder: str = "") -> ModelConfig:
    """The sizes of the model config.json describes, as a ModelConfig (FLOPs, parameter counts, the planner); the
    computation is transformers'."""
    t = _with_aliases(text_config(hf))
    dim, heads = t["hidden_size"], t["num_attention_heads"]
    experts = int(_first(t, _EXPERTS))
    moe = MoEConfig(num_experts=0)
    if experts:
        dense_first = t.get("first_k_dense_replace") or 0
        moe = MoEConfig(num_experts=experts, top_k=int(_first(t, _TOP_K, 1)), ffn_dim=int(_first(t, _EXPERT_WIDTH)),
                        num_shared_experts=int(_first(t, _SHARED) or bool(t.get("shared_expert_intermediate_size"))),
                        first_k_dense=int(dense_first), n_group=1, topk_group=1)
        if moe.num_shared_experts:
            moe.shared_ffn_dim = int(t.get("shared_expert_intermediate_size") or moe.ffn_dim)
    return ModelConfig(
        name="custom", vocab_size=t["vocab_size"], dim=dim,
        # num_layers: the decoder layers where num_hidden_layers is not stored (longcat_flash derives it, counting
        # the two attention sublayers of each layer)
        n_layers=(t.get("num_hidden_layers") or t.get("num_layers")
                  or len(t.get("layers_block_type") or t.get("layer_types") or ())),
        n_heads=heads, n_kv_heads=t.get("num_key_value_heads") or heads,
        head_dim=t.get("head_dim") or dim // heads, ffn_dim=int(t.get("intermediate_size") or 4 * dim),
        max_seq_len=int(t.get("max_position_embeddings") or 4096),
        tie_embeddings=bool(hf.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
        moe=moe, hf_path=folder, hf_impl="transformers")


def read_config(folder: str | Path) -> dict:
    """config.json of a Hugging Face folder (a ValueError saying what the folder lacks)."""
    return config_json(folder)


def architecture_of(folder: str | Path) -> str:
    """config.json's architecture (its first `architectures` entry, else its model_type)."""
    hf = read_config(folder)
    return (hf.get("architectures") or [hf.get("model_type", "?")])[0]


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module decorated with `use_experts_implementation` (it sets `_is_expert_parallel`)."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "num_experts")


def model_label(m: ModelConfig) -> str:
    """What a run's summary calls its model: the preset's name, or for a Hugging Face folder its architecture and
    whose modules ran it."""
    if not m.hf_path:
        return m.name
    code = "transformers' modules" if m.runs_transformers else "moeflow's modules"
    return f"{architecture_of(m.hf_path)} ({code})"


def load(folder: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """transformers' own model of `folder` in fp32 (training precision), in train mode. On the meta device the
    model is built from config.json alone (dry runs). ValueError, in one line, when the weights do not fill the
    model (a tensor missing, or shaped unlike the config)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # the trainer's bar is the one progress bar
    device = torch.device(device)
    if device.type == "meta":
        with torch.device("meta"):
            return _build(folder)
    cls = causal_lm_class(read_config(folder))
    try:
        model, info = cls.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    except (OSError, RuntimeError) as e:  # a missing shard, a size that disagrees with config.json
        raise ValueError(f"{folder}: transformers cannot load the weights ({str(e).splitlines()[0]})") from None
    missing = [k for k in info.get("missing_keys", ()) if k not in _tied_names(model)]
    bad = missing or list(info.get("mismatched_keys", ()))
    if bad:
        raise ValueError(f"{folder}: the weights do not match config.json ({len(bad)} tensors missing or of "
                         f"another shape, e.g. {bad[0]}); is config.json the one the weights were saved with?")
    return model.to(device).train()


def load_empty(folder: str | Path) -> nn.Module:
    """transformers' model of `folder` with its parameters on the meta device and its buffers as the modules
    compute them (rotary frequencies, never stored): what a rank parallelizes before reading its own part of the
    weights (moeflow/train/hf_sharded_transformers.py). Each parameter passes through host memory as its module
    creates it, one at a time (uninitialised where the module uses torch.empty, as nn.Linear does), and goes to
    the meta device as it is registered; the model's own initialisation then runs on nothing."""
    with _parameters_on_meta():
        return _build(folder)


def _build(folder: str | Path) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    cls = causal_lm_class(read_config(folder))
    config = transformers.AutoConfig.from_pretrained(str(folder))
    if cls is transformers.AutoModelForCausalLM:
        return cls.from_config(config, dtype=torch.float32).train()
    return cls(config).float().train()


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters registered inside go to the meta device as they are registered (so the modules' own
    initialisation runs on nothing); buffers stay as computed."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _tied_names(model: nn.Module) -> set[str]:
    """Parameters that share another's storage (tied embeddings): never in the files, never missing."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if model.config.tie_word_embeddings else set()


def logits(model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None = None,
           document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, V] logits of transformers' model. Packed rows need no document ids: their positions restart at 0 at
    each document, and transformers' mask builder turns such position ids into block-diagonal causal masks."""
    del document_ids
    return model(input_ids=inputs, position_ids=positions, use_cache=False).logits


class GenerationModel(nn.Module):
    """transformers' model behind the interface moeflow generate and eval call: `model(ids, cache=KVCache)`
    -> logits, and `.cfg`. A moeflow KVCache stands for the cache transformers' model returns from its first
    call."""

    def __init__(self, model: nn.Module, cfg: ModelConfig):
        super().__init__()
        self.hf, self.cfg = model, cfg
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # transformers 5.24 renamed past_key_values to cache (the old name still works, with a warning)
        self._cache_key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(self, ids: torch.Tensor, cache=None, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        if cache is None:
            return logits(self.hf, ids, positions, document_ids)
        # the first call lets the model make its own cache (some architectures have a class of their own)
        past = self._caches.get(cache)
        out = self.hf(input_ids=ids, use_cache=True, **({self._cache_key: past} if past is not None else {}))
        self._caches[cache] = out.past_key_values
        return out.logits
