"""Model adapters: what `parallelize` needs to know of one model family, in one place.

parallelize works on modules, not on a model class, but some steps need a family's facts: where the transformer
blocks are (FSDP wraps them, activation checkpointing and torch.compile take them one by one), what its modules
are called (the tensor-parallel plan is one plan over a naming scheme: `ModuleNames`), which dimensions it
supports, and its moeflow config where it has one (multi-token prediction, the pipeline's counting pass).

    adapter = adapter_for(model)      # MoeflowAdapter for a moeflow Transformer, HuggingFaceAdapter for a
                                      # transformers decoder LM; ValueError for anything else
    adapter.check(dims)               # one line per refusal, before anything is wrapped
    adapter.blocks() / adapter.names / adapter.config

A new family is a new adapter: the steps of parallelize and the plan in moeflow.parallel.tensor stay as they are.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from moeflow.core.model_config import ModelConfig
from moeflow.core.parallel_dims import ParallelDims
from moeflow.models.moe import MoE
from moeflow.parallel.module_names import HF_NAMES, MOEFLOW_NAMES, ModuleNames, embedding_name, is_norm


class ModelAdapter:
    """The facts parallelize reads of one model family (subclasses fill them in)."""

    family = "model"
    names: ModuleNames
    supports_pp = supports_cp = False

    def __init__(self, model: nn.Module):
        self.model = model

    @property
    def config(self) -> ModelConfig | None:
        """The moeflow config of the model, where it has one."""
        return None

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (no tensor-parallel plan for its low-rank projections yet)."""
        return False

    @property
    def has_moe(self) -> bool:
        return any(isinstance(m, MoE) for m in self.model.modules())

    @property
    def has_hf_experts(self) -> bool:
        """Experts modules of transformers' experts interface (expert parallelism: moeflow/parallel/hf_experts.py)."""
        from moeflow.parallel.hf_experts import hf_experts_modules

        return bool(hf_experts_modules(self.model))

    def blocks(self) -> dict[str, nn.Module]:
        """{layer key: transformer block}, the units FSDP, activation checkpointing and torch.compile take."""
        raise NotImplementedError

    @staticmethod
    def logits(model: nn.Module, inputs, **model_kwargs):
        """The forward the step runner calls: tokens [B, S] (and positions, document ids) -> logits [B, S, V]."""
        return model(inputs, **model_kwargs)

    def check(self, dims: ParallelDims, pp_boundaries=None, pp_microbatch_shape: tuple | None = None) -> None:
        """ValueError (one line naming the setting, the value and what works) for sizes this model cannot take;
        `pp_boundaries`, `pp_microbatch_shape`: ParallelOptions' (None: an even split; not known yet)."""
        name = type(self.model).__name__
        if dims.pp > 1 and not self.supports_pp:
            raise ValueError(f"parallel.pp = {dims.pp} for a {name}: pipeline parallelism is supported for moeflow "
                             f"models only yet (model.hf_impl = 'native' where moeflow maps the architecture, or "
                             f"moeflow.models.hf.from_pretrained); use ep and data parallelism, or pp = 1")
        if dims.cp > 1 and not self.supports_cp:
            raise ValueError(f"parallel.cp = {dims.cp} for a {name}: context parallelism swaps the core of "
                             f"moeflow's attention modules and is supported for moeflow models only yet "
                             f"(model.hf_impl = 'native' where moeflow maps the architecture, or "
                             f"moeflow.models.hf.from_pretrained); use cp = 1")


class MoeflowAdapter(ModelAdapter):
    """moeflow's own Transformer (or a pipeline stage of one): every dimension; sizes checked against its config."""

    family = "moeflow"
    names = MOEFLOW_NAMES
    supports_pp = supports_cp = True

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def is_mla(self) -> bool:
        return self.model.cfg.attention == "mla"

    def blocks(self) -> dict[str, nn.Module]:
        # the MTP modules are blocks too, keyed 'mtp.<k>' (moeflow.models.mtp)
        mtp = getattr(self.model, "mtp", None) or {}
        return {**dict(self.model.layers.items()), **{f"mtp.{k}": module for k, module in mtp.items()}}

    def check(self, dims: ParallelDims, pp_boundaries=None, pp_microbatch_shape: tuple | None = None) -> None:
        dims.check_model(self.model.cfg)
        super().check(dims, pp_boundaries, pp_microbatch_shape)


class HuggingFaceAdapter(ModelAdapter):
    """A transformers decoder LM (`*ForCausalLM` with model.embed_tokens / model.layers / model.norm): FSDP2,
    expert parallelism of transformers' own experts modules (moeflow/parallel/hf_experts.py) or of moeflow MoE
    layers swapped in (moeflow.models.hf_live), tensor parallelism by the same plan under its module names."""

    family = "huggingface"
    supports_pp = True  # one stage per rank (moeflow.parallel.hf_pipeline)
    supports_cp = True  # through transformers' attention interface (moeflow.parallel.hf_context)

    @property
    def hf_config(self):
        cfg = self.model.config
        return getattr(cfg, "text_config", None) or cfg  # multimodal configs keep the decoder's here

    @property
    def is_mla(self) -> bool:
        return bool(getattr(self.hf_config, "kv_lora_rank", None))

    @property
    def names(self) -> ModuleNames:
        """transformers' module names; the final norm by its place where a family names it otherwise (Jamba's
        final_layernorm): the base model's last child whose class is a norm."""
        base = getattr(self.model, "model", None)
        norms = [name for name, child in (base.named_children() if base is not None else ()) if is_norm(child)]
        names = HF_NAMES
        if norms and norms[-1] != "norm":
            names = replace(names, final_norm=f"model.{norms[-1]}")
        embedding = embedding_name(self.model) if base is not None else None
        if embedding not in (None, "embed_tokens"):
            names = replace(names, embedding=f"model.{embedding}")
        return names

    def blocks(self) -> dict[str, nn.Module]:
        from moeflow.parallel.hf_pipeline import is_skipped

        # a pipeline stage holds its own layers; the others' are parameterless placeholders
        return {str(i): block for i, block in enumerate(self.model.model.layers) if not is_skipped(block)}

    @staticmethod
    def logits(model: nn.Module, inputs, **model_kwargs):
        from moeflow.models.hf_transformers import logits

        return logits(model, inputs, **model_kwargs)

    def check(self, dims: ParallelDims, pp_boundaries=None, pp_microbatch_shape: tuple | None = None) -> None:
        super().check(dims, pp_boundaries, pp_microbatch_shape)
        name = type(self.model).__name__
        if dims.pp > 1:
            from moeflow.parallel.hf_pipeline import hf_pipeline_refusal

            shape = None if dims.tp > 1 else pp_microbatch_shape or ()
            why = hf_pipeline_refusal(self.model, dims.pp_schedule, shape, dims.pp, pp_boundaries)
            if why:
                raise ValueError(why)
        if dims.cp > 1:
            from moeflow.parallel.hf_context import hf_context_refusal

            why = hf_context_refusal(self.model)
            if why:
                raise ValueError(why)
        if dims.ep > 1 and not (self.has_moe or self.has_hf_experts):
            raise ValueError(f"parallel.ep = {dims.ep} but {name} has no experts module (neither transformers' "
                             f"experts interface nor a moeflow MoE layer); use ep = 1")
        ranks = dims.expert_parallel  # ep, or ep x tp with the MoE folded over tp
        if ranks > 1 and self.has_hf_experts and not self.has_moe:
            from moeflow.parallel.hf_experts import hf_experts_modules

            counts = sorted({m.num_experts for m in hf_experts_modules(self.model) if m.num_experts % ranks})
            if counts:
                over = f"parallel.ep = {dims.ep}" if ranks == dims.ep else \
                    f"parallel.ep x tp = {dims.ep} x {dims.tp} (the MoE folded over tp)"
                raise ValueError(f"{over} does not divide the {counts[0]} experts of {name}; choose sizes whose "
                                 f"product divides {counts[0]}")
        if dims.tp > 1:
            self.check_tp_widths(dims.tp)

    def check_tp_widths(self, tp: int) -> None:
        """tp must divide what the plan shards: heads, kv heads and the dense MLP width."""
        from moeflow.core.errors import divisors

        cfg = self.hf_config
        heads = cfg.num_attention_heads
        sizes = [("num_attention_heads", heads), ("num_key_value_heads", getattr(cfg, "num_key_value_heads", 0)
                                                  or heads)]
        if getattr(cfg, "intermediate_size", None):
            sizes.append(("intermediate_size", cfg.intermediate_size))
        for name, value in sizes:
            if value % tp:
                raise ValueError(f"parallel.tp ({tp}) must divide {name} ({value}) in the Hugging Face config; "
                                 f"choose tp in {divisors(value)}")


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter of `model`'s family; ValueError naming what was expected for anything else."""
    from moeflow.models.transformer import Transformer

    if isinstance(model, Transformer):
        return MoeflowAdapter(model)
    inner = getattr(model, "model", None)
    if hasattr(model, "config") and isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return HuggingFaceAdapter(model)
    raise ValueError(f"parallelize: cannot find the transformer blocks of {type(model).__name__} (expected a "
                     f"moeflow Transformer's .layers or a Hugging Face model's .model.layers)")
