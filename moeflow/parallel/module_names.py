"""A model family's module names, and the parts of a transformer block found by what they are.

The tensor-parallel plan (moeflow.parallel.tensor), context parallelism of transformers' modules
(moeflow.parallel.hf_context) and parallelize's gradient bookkeeping address a block's children by a family's names
(`ModuleNames`: moeflow's own, transformers'), and find what the names do not say - a norm, an MLP, the MoE, the FFN
under another name, the token mixers - by the class of each child, since transformers' families share no base
classes for them. A leaf: it imports no other part of moeflow.parallel.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from moeflow.models.hf_transformers import is_hf_experts
from moeflow.models.moe import Router


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer, by its class's name (RMSNorm, LayerNorm, Qwen3MoeRMSNorm, ...: no common base)."""
    return type(module).__name__.lower().endswith("norm")


def is_mlp(module: nn.Module) -> bool:
    """An MLP or an expert, by its class's name (GraniteMoeSharedMLP, ...: as for norms, no common base)."""
    name = type(module).__name__.lower()
    return "mlp" in name or "expert" in name


@dataclass(frozen=True)
class ModuleNames:
    """A family's module names, as the tensor-parallel plan addresses them (dotted paths from the model; a block's
    children relative to the block). `attention_input` is how a block hands the attention its hidden states: the
    first positional argument, or a keyword. `per_head_norm_dim`: the dimension of the heads in the tensors a
    per-head query/key norm sees ([B, H, S, Dh] -> 1, [B, S, H, Dh] -> 2). A block's own norms need no names: the
    plan finds them by their class (moeflow.parallel.tensor._block_norms)."""

    embedding: str
    layers: str
    attention: str
    q: str
    k: str
    v: str
    o: str
    ffn: str
    gate: str  # the dense MLP's input projections (SwiGLU's gate and up) and its output projection
    up: str
    down: str
    final_norm: str
    head: str
    attention_input: str | None  # None: positional; else the keyword's name
    per_head_norm_dim: int


MOEFLOW_NAMES = ModuleNames(
    embedding="tok_embeddings", layers="layers", attention="attention",
    q="wq", k="wk", v="wv", o="wo", ffn="feed_forward", gate="w1", up="w3", down="w2",
    final_norm="norm", head="output", attention_input=None, per_head_norm_dim=1)

HF_NAMES = ModuleNames(
    embedding="model.embed_tokens", layers="model.layers", attention="self_attn",
    q="q_proj", k="k_proj", v="v_proj", o="o_proj", ffn="mlp",
    gate="gate_proj", up="up_proj", down="down_proj", final_norm="model.norm", head="lm_head",
    attention_input="hidden_states", per_head_norm_dim=2)


# class-name endings of the parts of a layer (or of the model, around its layers) that work token by token: a
# hyper-connection's stream mixing and its head, a gated or scaled residual (DeepseekV4HyperConnection, HYV4HyperHead,
# ErgoResidualGate, Qwen4ExpTextGatedResidual, ZayaResidualScaling)
PER_TOKEN_ENDINGS = ("hyperconnection", "hyperhead", "residualgate", "gatedresidual", "residualscaling")


def is_per_token(module: nn.Module) -> bool:
    """A part that works token by token: an MLP or expert, or a class named as one of PER_TOKEN_ENDINGS (not a
    norm)."""
    name = type(module).__name__.lower()
    return not is_norm(module) and (is_mlp(module) or name.endswith(PER_TOKEN_ENDINGS))


def is_moe(module: nn.Module) -> bool:
    """A moeflow MoE, or any wrapper of one (e.g. the block that replaces an HF sparse MoE), or a transformers
    sparse MoE block (its experts module is transformers' experts interface: moeflow.parallel.hf_experts)."""
    return any(isinstance(m, Router) or is_hf_experts(m) for m in module.modules())


def experts_in_layer(block: nn.Module) -> list[str]:
    """Names of a block's own children that are transformers experts modules: an MoE the block's forward computes
    itself from its router and experts (Gemma 4's, beside its dense MLP), rather than in an MoE block of its own."""
    return [name for name, child in named_parts(block) if is_hf_experts(child)]


def named_parts(block: nn.Module):
    """(name, module) of a block's children, each item of a ModuleList child under its own dotted name (LongCat-Flash's
    layer holds its two attentions, two MLPs and their norms in lists: self_attn.0, self_attn.1, mlps.0, ...). A
    part's module is `block.get_submodule(name)`."""
    for name, child in block.named_children():
        if isinstance(child, nn.ModuleList):
            yield from ((f"{name}.{i}", item) for i, item in enumerate(child))
        else:
            yield name, child


def attentions_of(block: nn.Module, names) -> dict[str, nn.Module]:
    """{name: attention} of a block: its `names.attention` child, or each item where that child is a ModuleList."""
    return {name: part for name, part in named_parts(block) if name.partition(".")[0] == names.attention}


def ffn_of(block: nn.Module, names) -> tuple[str, nn.Module] | None:
    """(name, module) of a block's FFN: its `names.ffn` child, else the child holding an MoE (transformers names
    some sparse MoE blocks otherwise: granitemoe's block_sparse_moe), else a child with the gate/up/down
    projections (Jamba's feed_forward); None when it has none of these."""
    ffn = getattr(block, names.ffn, None)
    if ffn is not None:
        return names.ffn, ffn
    named = (is_moe, lambda child: mlp_projections(child, names) is not None)  # Jamba's, LFM2's feed_forward
    return next(((name, child) for found in named for name, child in named_parts(block) if found(child)), None)


# a dense MLP's (gate, up, down) projections where a family names them otherwise: LFM2's (as moeflow's own) w1/w3/w2
OTHER_MLP_PROJECTIONS = ("w1", "w3", "w2")


def mlp_projections(module: nn.Module, names) -> tuple[str | None, str, str] | None:
    """The names of a dense MLP's (gate, up, down) projections - `names`' or OTHER_MLP_PROJECTIONS; gate None for
    an ungated MLP (Ergo's ReLU^2) - or None where `module` is no such MLP (one with parameters elsewhere, say a
    norm over the hidden width, would not survive their sharding)."""
    for gate, up, down in ((names.gate, names.up, names.down), OTHER_MLP_PROJECTIONS):
        if hasattr(module, up) and hasattr(module, down):
            others = [n for n, child in module.named_children() if n not in (gate, up, down)
                      and any(True for _ in child.parameters())]
            if others or any(True for _ in module.parameters(recurse=False)):
                return None
            return (gate if hasattr(module, gate) else None), up, down
    return None


def beside_moe(block: nn.Module, names) -> list[str]:
    """Names of a block's children that run beside its MoE block on the same input, outside it (Granite-MoE's
    shared_mlp, a shared expert the layer adds to the MoE's output): the MLPs other than the FFN in a block whose
    FFN is an MoE, but for dense FFNs of their own (other_ffns). They take the MoE block's style."""
    found = ffn_of(block, names)
    if found is None or not is_moe(found[1]):
        return []
    return [name for name, child in named_parts(block) if name.partition(".")[0] not in (names.attention, found[0])
            and is_mlp(child) and mlp_projections(child, names) is None]


def other_ffns(block: nn.Module, names) -> list[str]:
    """Names of a block's dense gate/up/down MLPs other than its FFN (LongCat-Flash's mlps.0 and mlps.1, each after
    one of its two attentions, beside the MoE that is its FFN): each is sharded as a dense FFN is."""
    found = ffn_of(block, names)
    ffn = found[0] if found else names.ffn
    return [name for name, child in named_parts(block) if name.partition(".")[0] not in (names.attention, ffn)
            and is_mlp(child) and mlp_projections(child, names) is not None]


def token_mixers(block: nn.Module, names) -> list[str]:
    """The children of a block with parameters but its norms, its FFN, the MLPs beside its MoE and its other dense
    FFNs: its attention, or what stands in for one (a linear attention, a Mamba mixer, a short convolution), and
    whatever else an architecture adds to its layers (hyper-connections, residual gates)."""
    found = ffn_of(block, names)
    skip = {*beside_moe(block, names), *other_ffns(block, names)}
    ffn = found[0] if found else names.ffn
    return [name for name, child in named_parts(block) if name not in skip and name.partition(".")[0] != ffn
            and not is_norm(child) and any(True for _ in child.parameters())]


def sequence_mixers(block: nn.Module, names) -> list[str]:
    """A block's token mixers that mix the sequence (not its per-token parts)."""
    return [name for name in token_mixers(block, names) if not is_per_token(block.get_submodule(name))]


def takes_hidden_states(module: nn.Module) -> bool:
    """Whether `module`'s forward takes the hidden states first: a sequence mixer that mixes what it is handed
    (not another layer's state), which tensor and context parallelism can run whole beside others."""
    return next(iter(inspect.signature(module.forward).parameters), None) == "hidden_states"


def embedding_name(model: nn.Module) -> str | None:
    """The name of the transformers base model's child holding the token embedding (`embed_tokens`; NemotronH's
    `embeddings`), found by get_input_embeddings; None where it is not such a child."""
    try:
        found = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return next((n for n, child in model.model.named_children() if child is found), None)
