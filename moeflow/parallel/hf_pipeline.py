"""Pipeline stages of a transformers causal LM (model.hf_impl = 'transformers'), for torch.distributed.pipelining.

moeflow's own model is split by dropping what a rank does not hold (moeflow.parallel.pipeline). A transformers
model's forward is the architecture's own code (masks, rotary tables, per-layer types, embedding scales), so each
stage still runs that whole forward and only changes what flows through it:

  - the layers of other stages become `SkippedLayer` placeholders: no parameters, they hand the hidden states on and
    keep the plain attributes the model's loop reads of a layer (its attention type, its index), so layer indices
    and parameter names stay the full model's, as checkpoints need;
  - a stage after the first receives the previous stage's hidden states: the model runs on placeholder token ids
    (its embedding is a parameterless `NoEmbedding` of zeros) and the received tensor replaces the hidden states
    entering this stage's first layer (a forward pre-hook on it, registered for the call: under activation
    checkpointing the layer saves the replaced input, so its recomputation sees it too);
  - a stage before the last returns what its last layer produced, and holds no final norm or output head.

The last stage returns the causal LM's own logits (its head, and any logit scale or cap the architecture applies).
One stage per rank (GPipe, 1F1B). Refused before anything changes: tied embeddings (the embedding and the head
would live on different stages), a model with parameters outside its layers, embedding, norm and head (per-layer
embeddings computed from the token ids, which later stages do not have), and layers that hand the next one more than
the hidden states (an indexer's top-k selection: read from the model's forward, where its loop unpacks a layer's
output).

    stages = build_hf_stage_modules(model, pp_rank, pp_size, schedule_name, boundaries)   # [model], trimmed
"""

from __future__ import annotations

import inspect
import re
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from moeflow.core.schedules import SCHEDULES, pipeline_layout, resolve_schedule
from moeflow.parallel.module_names import embedding_name, is_norm


def _final_norms(model: nn.Module) -> list[str]:
    """The names of the base model's own norms (children of `model.model` whose class is a norm: `norm`, or
    `final_layernorm` in some architectures), which run after the last layer."""
    return [n for n, child in model.model.named_children() if is_norm(child)]


def _placed(model: nn.Module) -> tuple[str, ...]:
    """The parameter name prefixes a stage split places; parameters anywhere else refuse the split."""
    return (f"model.{embedding_name(model)}.", "model.layers.", "lm_head.",
            *(f"model.{n}." for n in _final_norms(model)))


@dataclass(frozen=True)
class _Role:
    first: bool
    last: bool
    first_layer: int  # global index of this stage's first and last layers
    last_layer: int


# stage module -> its role; kept beside the module, which gains no attribute
_ROLES: weakref.WeakKeyDictionary[nn.Module, _Role] = weakref.WeakKeyDictionary()


class SkippedLayer(nn.Module):
    """Stands for a layer of another stage: returns the hidden states it is given."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for key, value in vars(layer).items():  # plain attributes (modules and parameters live in _modules, ...)
            if not key.startswith("_") and key != "training":
                setattr(self, key, value)

    def forward(self, *args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]


class NoEmbedding(nn.Module):
    """A later stage's embedding: zeros of the hidden width (the received hidden states replace them)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, device=ids.device)


# `hidden_states, index_pool = decoder_layer(`: a layer's output unpacked into more than the hidden states
_UNPACKED_LAYER_OUTPUT = re.compile(r"^\s*\w+(?:\s*,\s*\w+)+\s*=\s*\w*layer\w*\(", re.MULTILINE)


def carried_state(model_class: type) -> str | None:
    """The line of the base model's forward that unpacks a layer's output into more than the hidden states
    (state one layer passes to the next, such as an indexer's top-k selection), read from its source."""
    try:
        source = inspect.getsource(model_class.forward)
    except (OSError, TypeError):
        return None
    found = _UNPACKED_LAYER_OUTPUT.search(source)
    return found.group(0) if found else None


def carries_state(model: nn.Module) -> bool:
    """Whether a transformers model's layers hand each other more than the hidden states (carried_state)."""
    base = getattr(model, "model", None)
    return base is not None and carried_state(type(base)) is not None


def hf_pipeline_refusal(model: nn.Module, pp_schedule: str) -> str | None:
    """Why this transformers model cannot be split into pipeline stages (None when it can)."""
    name = type(model).__name__
    if SCHEDULES[resolve_schedule(pp_schedule)].placement != "single":
        return (f"{name}: transformers' modules run one pipeline stage per rank; parallel.pp_schedule = "
                f"{pp_schedule!r} runs several: use 'GPipe' or '1F1B'")
    where = embedding_name(model)
    if where is None:
        return (f"{name}: a model whose token embedding is not a child of model.model has no pipeline split; use "
                f"pp = 1")
    head, embedding = getattr(model, "lm_head", None), getattr(model.model, where)
    if getattr(head, "weight", None) is embedding.weight:  # (the config's flag has no one name in every family)
        return (f"{name}: tied embeddings would sit on two pipeline stages (the embedding on the first, the output "
                f"head on the last); use pp = 1")
    carried = carried_state(type(model.model))
    if carried:
        return (f"{name}: its layers hand the next one more than the hidden states, which a pipeline stage does "
                f"not receive; its loop reads `{carried.split('=')[0].strip()}` from each; use pp = 1")
    placed = _placed(model)
    outside = [n for n, _ in model.named_parameters() if not n.startswith(placed)]
    if outside:
        return (f"{name}: parameters outside the layers, embedding, final norm and head have no pipeline stage; "
                f"{outside[0]} is one; use pp = 1")
    return None


def build_hf_stage_modules(model: nn.Module, pp_rank: int, pp_size: int, schedule_name: str,
                           boundaries=None) -> list[nn.Module]:
    """This rank's stage of `model` (trimmed in place to what it holds; its class gains the stage's forward):
    [model]. ValueError (hf_pipeline_refusal) before anything changes."""
    why = hf_pipeline_refusal(model, schedule_name)
    if why:
        raise ValueError(why)
    layers = model.model.layers
    (spec,) = [s for s in pipeline_layout(len(layers), pp_size, schedule_name, boundaries) if s.rank == pp_rank]
    for i, layer in enumerate(layers):
        if i not in spec.layers:
            layers[i] = SkippedLayer(layer)
    if not spec.embed:
        setattr(model.model, embedding_name(model), NoEmbedding(model.config.get_text_config().hidden_size))
    if not spec.head:
        for name in _final_norms(model):
            setattr(model.model, name, nn.Identity())
        model.lm_head = nn.Identity()
    model.__class__ = _stage_class(type(model))
    _ROLES[model] = _Role(spec.embed, spec.head, spec.layers[0], spec.layers[-1])
    return [model]


def is_placeholder(module: nn.Module | None) -> bool:
    """A part a pipeline stage does not hold (another stage's embedding, final norm or head)."""
    return isinstance(module, NoEmbedding | nn.Identity)


def is_skipped(layer: nn.Module) -> bool:
    return isinstance(layer, SkippedLayer)


class _Stage:
    """Mixed in before a transformers causal-LM class by build_hf_stage_modules: the stage's forward."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, S] (first stage) or hidden states [B, S, D] -> hidden states [B, S, D], or logits [B, S, V]
        on the last stage. Packed rows need no document ids (models.hf_transformers.logits)."""
        del document_ids
        role = _ROLES[self]
        layers = self.model.layers
        ids = x if role.first else torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
        hooks, produced = [], []
        if not role.first:
            def received(module, args, kwargs):
                if args:
                    return (x, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": x}

            hooks.append(layers[role.first_layer].register_forward_pre_hook(received, with_kwargs=True))
        if not role.last:
            def keep(module, args, output):
                produced.append(output[0] if isinstance(output, tuple) else output)

            hooks.append(layers[role.last_layer].register_forward_hook(keep))
        try:
            if role.last:
                return super().forward(input_ids=ids, position_ids=positions, use_cache=False).logits
            self.model(input_ids=ids, position_ids=positions, use_cache=False)
            return produced[-1]
        finally:
            for hook in hooks:
                hook.remove()


_CLASSES: dict[type, type] = {}


def _stage_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"PipelineStage{cls.__name__}", (_Stage, cls), {})
    return _CLASSES[cls]
