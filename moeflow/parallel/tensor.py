"""Tensor parallelism with sequence parallelism (Megatron-LM SP, Korthikanti et al. 2022) as plans that are data.

A plan is `{module fqn pattern: ParallelStyle}`. Each dot-separated token of a pattern is an fnmatch pattern
matched against one child name ("layers.*.attention.wq" matches every block's wq), which is how torch's
`parallelize_module` reads it; the empty pattern "" means the model itself.

Layout on the tp mesh (B batch, S sequence, D width, V vocab, H query heads, Hk kv heads, tp ranks):

    tokens [B, S], the same on every tp rank
    -> embedding, vocab rows sharded (RowwiseParallel) -> reduce-scatter -> h [B, S/tp, D]: Shard(1)
       (an embedding holding more than its table, a norm: whole on every tp rank, its output cut; WholeEmbedding)
    per block
        attention_norm: SequenceParallel (weight replicated, runs on this rank's S/tp positions)
        attention: all-gather S -> wq, wk, wv column-sharded (H/tp, Hk/tp heads per rank) -> SDPA on the local
                   heads with RoPE tables for all S positions -> wo row-sharded -> reduce-scatter -> [B, S/tp, D]
        ffn_norm: SequenceParallel
        dense FFN: all-gather -> w1, w3 column-sharded, w2 row-sharded -> reduce-scatter
        MoE FFN, folded (parallelize's default): this rank's S/tp tokens enter the MoE (LocalTokens); expert
                   parallelism over the ep x tp ranks moves them to their experts; no sequence all-gather
        MoE FFN, replicated: all-gather -> every tp rank runs the whole MoE on plain tensors (ReplicatedModule)
                   -> keeps its S/tp slice (no communication on the way out; an all-gather of the gradient back)
    final norm: SequenceParallel -> all-gather -> output head column-sharded -> logits [B, S, V/tp]: Shard(-1)
    -> tp_loss: cross-entropy over the vocab shards (three all-reduces of B*S numbers); the full logits never exist.

The residual stream between blocks is a DTensor with the global shape [B, S, D], so `Transformer.forward` sees
the full sequence length and slices the RoPE tables to all S positions; the attention receives them after its
all-gather, where its queries and keys cover all S positions as well. S must be divisible by tp. A pipeline
stage without the embedding takes, and one without the head returns, plain [B, S/tp, D] hidden states.

Query/key norms: per head (Qwen3) the [Dh] weight is replicated and its gradient summed over tp ranks
(HeadShardedNorm); over all heads (OLMoE, 'full') the [H*Dh] weight is sharded like wq's columns and the mean
of squares all-reduced (WidthShardedNorm). Multi-head latent attention has no plan yet.

Hugging Face decoders (Llama, Qwen2/3, Mistral layouts: self_attn.q/k/v/o_proj, mlp.gate/up/down_proj, norms)
get the same plan by their module names, sequence parallelism included: their decoder layers only add and pass
on the residual, which works on DTensors, and their rotary module sees the global shape.

MoE under TP, two ways (parallel.ep_over_tp). Folded (the default under parallelize): each tp rank routes its own
S/tp tokens, the experts are spread over the ep x tp ranks, the router's gradient, from one rank's tokens, is
summed over tp after backward, and the shared experts, data-parallel over tp, are FSDP-sharded over dp x cp x tp
(moeflow.parallel.fsdp; its reduce-scatter sums them); `Router.last_load` counts each token once. Replicated:
expert compute is repeated tp-fold, every tp rank's MoE parameters get the same gradient (the same full sequence
and the same output gradient reach each), so no reduction over tp is needed -- nor for the router's aux loss,
which each rank computes on the same tokens; `Router.last_load` counts every token once per tp rank.

Composition with FSDP2 (TorchTitan's order): tensor parallelism on mesh["tp"] first, then `fully_shard` of each
block and of the root on the data-parallel mesh, which makes 2-D (dp, tp) DTensor parameters.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from moeflow.core.parallel_dims import MLA_TP_UNSUPPORTED
from moeflow.parallel.hf_loop import carries_state
from moeflow.parallel.module_names import (
    attentions_of,
    beside_moe,
    experts_in_layer,
    ffn_of,
    is_moe,
    is_norm,
    is_per_token,
    mlp_projections,
    named_parts,
    other_ffns,
    sequence_mixers,
    takes_hidden_states,
    token_mixers,
)
from moeflow.parallel.tp_styles import (
    HeadShardedNorm,
    HeadShardedParameters,
    LocalInput,
    LocalTokens,
    PartialGradColwise,
    PerTokenPart,
    ReplicatedModule,
    ReplicatedParameters,
    Styles,
    WholeEmbedding,
    WholeMixer,
    WidthShardedNorm,
)

HOW_TO_PASS_A_PLAN = (
    "pass a plan: parallelize(model, dims, ParallelOptions(tp_plan={'<fqn pattern>': ColwiseParallel(), ...})) "
    "(styles from torch.distributed.tensor.parallel and moeflow.parallel.tp_styles)"
)


# ---- plans -------------------------------------------------------------------------------------------------


def _embedding_style() -> ParallelStyle:
    # Vocab rows sharded; the partial embeddings are reduce-scattered straight onto the sequence shards.
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)


def _head_style(loss_parallel: bool) -> ParallelStyle:
    if loss_parallel:  # keep the logits vocab-sharded for tp_loss
        return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True)


def _gather_sequence(**kwargs) -> ParallelStyle:
    # The module receives a Replicate DTensor; its column-parallel linears' input gradients are partial sums
    # that meet here and are reduce-scattered once (rather than all-reduced per linear).
    return PrepareModuleInput(**kwargs, use_local_output=False)


def _rowwise_to_sequence() -> ParallelStyle:
    return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)


def _layer_patterns(prefix: str, layers: dict[str, nn.Module], kind_of) -> dict:
    """{kind: [pattern of the layers of that kind]}: one 'prefix.*' when all layers share a kind."""
    kinds: dict = {}
    for name, layer in layers.items():
        kinds.setdefault(kind_of(layer), []).append(name)
    if len(kinds) == 1:
        return {kind: [f"{prefix}.*"] for kind in kinds}
    return {kind: [f"{prefix}.{n}" for n in names] for kind, names in kinds.items()}


def _dense_ffn_plan(ffn: str, projections: tuple[str | None, str, str]) -> dict[str, ParallelStyle]:
    """A dense (gate,) up / down MLP at pattern `ffn`: the sequence gathered into it, gate and up column-sharded,
    down row-sharded back to the sequence-sharded residual stream."""
    gate, up, down = projections
    return {ffn: _gather_sequence(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            **{f"{ffn}.{p}": ColwiseParallel() for p in (gate, up) if p is not None},
            f"{ffn}.{down}": _rowwise_to_sequence()}


def _moe_style(fold_experts: bool) -> ParallelStyle:
    return LocalTokens() if fold_experts else ReplicatedModule()


def _attention_gather(names) -> ParallelStyle:
    """All-gather the sequence into the attention: its hidden states come positionally (with the RoPE tables
    beside them) or by keyword (Hugging Face layers call self_attn(hidden_states=..., position_embeddings=...),
    whose (cos, sin) cover all S positions: the rotary module sees the residual DTensor's global shape)."""
    if names.attention_input is None:
        return _gather_sequence(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None))
    return _gather_sequence(input_kwarg_layouts={names.attention_input: Shard(1)},
                            desired_input_kwarg_layouts={names.attention_input: Replicate()})


# q/k norms under the names architectures give them (Qwen3's, Hunyuan's)
QK_NORMS = (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"))
# output gates of the attention, one value (or Dh values) per query head, multiplied into the attention's output
# before o_proj (AFMoE's and Beam's gate_proj, Laguna's g_proj): column-sharded with the heads they gate
ATTENTION_GATES = ("gate_proj", "g_proj")


# transformers' multi-head latent attention (DeepSeek-V2/V3 and kin): the projections to and from the latents.
# The per-head ones (q_proj or q_b_proj, kv_b_proj) are column-sharded with the heads; the down-projections
# (q_a_proj, kv_a_proj_with_mqa) and their norms are shared by all heads and stay whole on every tp rank
# (LocalInput). Every gradient inside the attention stays each rank's partial sum (its local heads'): the
# up-projections hand theirs back unreduced (PartialGradColwise), as does k_rot, which the heads read directly;
# the shared modules' parameter gradients are summed over tp after backward, their input's by the attention's
# gather (parallelize: tp_partial).
MLA_PER_HEAD = ("q_b_proj", "kv_b_proj")
MLA_SHARED = ("q_a_proj", "kv_a_proj_with_mqa")
MLA_NORMS = ("q_a_layernorm", "kv_a_layernorm")


def _is_latent(attention: nn.Module) -> bool:
    return all(hasattr(attention, p) for p in ("kv_a_proj_with_mqa", "kv_b_proj"))


def shared_by_heads(attention: nn.Module | None) -> list[nn.Module]:
    """The modules of a latent attention that stay whole on every tp rank, their gradients partial there."""
    if attention is None or not _is_latent(attention):
        return []
    return [m for m in (getattr(attention, n, None) for n in (*MLA_SHARED, *MLA_NORMS)) if m is not None]


def _attention_parts(model: nn.Module, layers: dict[str, nn.Module], names) -> tuple[tuple[str, ...], dict[str, str]]:
    """Which layers' attention the plan shards: q/k/v/o projections (or latent attention's), q/k norms, output
    gates, and parameters of the attention's own with one row per query head (gpt-oss's sinks, Beam's gate bias),
    all in one shape (the plan is built from the first such layer's). Returns (the names of those per-head
    parameters, which follow the heads onto their tp ranks; {layer key: why its token mixer is not sharded} for
    the other layers: a linear attention, a Mamba mixer, an attention with a part the plan cannot place)."""
    config = getattr(model, "config", None)  # a transformers config (moeflow's attention has no own parameters)
    heads = config.get_text_config().num_attention_heads if hasattr(config, "get_text_config") else None
    per_head: dict[str, None] = {}
    whole: dict[str, str] = {}
    first_shape = None
    for key, block in layers.items():
        attentions = attentions_of(block, names) or {names.attention: None}
        why = next(filter(None, (_unplaced_attention_part(model, key, block, name, attention, names, heads)
                                 for name, attention in attentions.items())), None)
        if why is None:  # the plan is built from the first sharded attention: the others must be shaped alike
            for name, attention in attentions.items():
                shape = (_is_latent(attention), tuple(g for g in ATTENTION_GATES if hasattr(attention, g)))
                first_shape = first_shape or shape
                if shape != first_shape:
                    why = (f"{type(model).__name__}: attentions of different shapes (latent, output gates) in one "
                           f"model; layer {key}'s {name} differs from the first's; {HOW_TO_PASS_A_PLAN}")
                    break
        if why is not None:
            whole[key] = why
            continue
        for attention in attentions.values():
            per_head.update(dict.fromkeys(name for name, _ in attention.named_parameters(recurse=False)))
    return tuple(per_head), whole


def _unplaced_attention_part(model, key: str, block: nn.Module, name: str, attention: nn.Module | None, names,
                             heads: int | None) -> str | None:
    """Why the plan cannot shard layer `key`'s attention `name` (None: it can)."""
    projections = (names.q, names.k, names.v, names.o)
    placed = (*projections, *(n for pair in QK_NORMS for n in pair), *ATTENTION_GATES,
              *MLA_PER_HEAD, *MLA_SHARED, *MLA_NORMS)
    latent = attention is not None and _is_latent(attention) and hasattr(attention, names.o) and (
        getattr(attention, names.q, None) is not None or getattr(attention, "q_b_proj", None) is not None)
    if attention is None or not (latent or all(hasattr(attention, p) for p in projections)):
        which = (f"layer {key}'s is {type(attention).__name__}" if attention is not None else
                 f"layer {key} has none (its parts: {', '.join(n for n, _ in block.named_children())})")
        return (f"{type(model).__name__}: an attention without {'/'.join(projections)} (or latent attention's "
                f"kv_a_proj_with_mqa/kv_b_proj) has no built-in tensor-parallel plan; {which}; {HOW_TO_PASS_A_PLAN}")
    for part, child in attention.named_children():
        gate_widths = (heads, heads * getattr(attention, "head_dim", 0)) if heads else ()
        if part in ATTENTION_GATES and not (isinstance(child, nn.Linear) and child.out_features in gate_widths):
            return (f"{type(model).__name__}: an attention gate that is not one value or one head's width per query "
                    f"head; layer {key}'s {name}.{part} ({type(child).__name__}); {HOW_TO_PASS_A_PLAN}")
        if part not in placed and any(True for _ in child.parameters()):
            return (f"{type(model).__name__}: an attention submodule the built-in tensor-parallel plan does not "
                    f"place; layer {key}'s {name}.{part} ({type(child).__name__}); {HOW_TO_PASS_A_PLAN}")
    for part, p in attention.named_parameters(recurse=False):
        if heads is None or p.ndim == 0 or p.shape[0] != heads:
            return (f"{type(model).__name__}: an attention parameter that is neither a projection's nor one row per "
                    f"head; layer {key}'s {name}.{part} {tuple(p.shape)}; {HOW_TO_PASS_A_PLAN}")
    return None


def _block_norms(layers: dict[str, nn.Module], names) -> list[str]:
    """Plan patterns of the blocks' own norms: the pre-norms, and the post or sandwich norms some architectures add
    (children other than the attention and the FFN whose class is a norm). Each runs on this rank's sequence
    slice (SequenceParallel): one pattern over all layers for a name, or each layer's own where that name is in
    some layers a norm that holds an MLP (a per-token part)."""
    found: dict[str, dict[str, bool]] = {}  # name -> {layer key: a plain norm there}
    for key, block in layers.items():
        for name, child in named_parts(block):
            if name.partition(".")[0] not in (names.attention, names.ffn) and is_norm(child):
                found.setdefault(name, {})[key] = not _holds_linear(child)
    patterns = []
    for name, plain in found.items():
        if all(plain.values()):
            patterns.append(f"{names.layers}.*.{name}")
        else:
            patterns += [f"{names.layers}.{key}.{name}" for key, is_plain in plain.items() if is_plain]
    return patterns


def _holds_linear(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) for m in module.modules())


def _qk_norm_style(attention: nn.Module, q_norm_name: str, names) -> ParallelStyle | None:
    """Per head (Qwen3: a [Dh] weight) or over all heads (OLMoE, OLMo2: the projection's whole width). A per-head
    norm is wrapped as sharded on the heads' dim (which dim the local tensor is cut on does not change a norm over
    the last dim, only that its weight's gradient is summed over tp), so a norm applied after the heads are
    transposed (Hunyuan's) takes the same style."""
    q_norm = getattr(attention, q_norm_name, None)
    if q_norm is None or getattr(q_norm, "weight", None) is None:
        return None
    if q_norm.weight.numel() == attention.head_dim:
        return HeadShardedNorm(head_dim_index=names.per_head_norm_dim)
    return WidthShardedNorm()


def _module(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at a dotted path, or None where any part is missing (None in a moeflow pipeline stage, a
    placeholder in a transformers one)."""
    from moeflow.parallel.hf_pipeline import is_placeholder

    for part in path.split("."):
        model = getattr(model, part, None)
        if model is None or is_placeholder(model):
            return None
    return model


def styled_modules(model: nn.Module, plan: dict[str, ParallelStyle], style: type) -> dict[str, nn.Module]:
    """{fqn: module} of the modules `plan` gives `style`: the token mixers it runs whole on every tp rank
    (WholeMixer), the per-token parts it runs on the rank's tokens (PerTokenPart)."""
    patterns = [pattern for pattern, s in plan.items() if isinstance(s, style)]
    return {fqn: m for fqn, m in model.named_modules() if any(_pattern_matches(p, fqn) for p in patterns)}


def _attention_plan(attn: str, first_attention: nn.Module, gather: ParallelStyle, head_parameters: tuple[str, ...],
                    names) -> dict[str, ParallelStyle]:
    """The entries for the attention at pattern `attn`, shaped like `first_attention`: heads over the tp ranks."""
    plan: dict[str, ParallelStyle] = {
        attn: Styles(gather, HeadShardedParameters(head_parameters)) if head_parameters else gather,
        f"{attn}.{names.o}": _rowwise_to_sequence(),
    }
    if _is_latent(first_attention):
        per_head = [p for p in (names.q, *MLA_PER_HEAD) if getattr(first_attention, p, None) is not None]
        plan.update({f"{attn}.{p}": PartialGradColwise() for p in per_head if p != names.q})
        if getattr(first_attention, names.q, None) is not None:  # no q latent: q_proj reads the attention input
            plan[f"{attn}.{names.q}"] = ColwiseParallel()
        plan.update({f"{attn}.{p}": LocalInput() for p in MLA_SHARED if getattr(first_attention, p, None) is not None})
    else:
        plan.update({f"{attn}.{p}": ColwiseParallel() for p in (names.q, names.k, names.v)})
    for q_norm, k_norm in QK_NORMS:
        qk_norm = _qk_norm_style(first_attention, q_norm, names)
        if qk_norm is not None:
            plan[f"{attn}.{q_norm}"] = plan[f"{attn}.{k_norm}"] = qk_norm
    plan.update({f"{attn}.{gate}": ColwiseParallel() for gate in ATTENTION_GATES
                 if isinstance(getattr(first_attention, gate, None), nn.Linear)})
    return plan


def _plan(model: nn.Module, adapter, loss_parallel: bool, fold_experts: bool) -> dict[str, ParallelStyle]:
    """One plan for every family, addressed by the family's module names (moeflow.parallel.adapter)."""
    names = adapter.names
    if adapter.is_mla and adapter.family == "moeflow":  # no plan for moeflow's own latent attention yet
        raise ValueError(MLA_TP_UNSUPPORTED)
    layers = {str(k): block for k, block in adapter.blocks().items() if not str(k).startswith("mtp.")}
    head_parameters, whole = _attention_parts(model, layers, names)
    carried = whole and len(whole) < len(layers) and carries_state(model)
    for key, why in whole.items():
        # the layer's sequence mixers run whole (on every tp rank): its one mixer, or several that each mix the
        # hidden states they are handed (Inkling's short convolutions beside its attention), not another layer's
        # state (Inkling2's attention over earlier blocks); moeflow's own attention always fits the plan (unless
        # changed), and whole and sharded layers that hand each other more than the hidden states (an indexer's
        # selection) have no built-in plan
        mixers = [layers[key].get_submodule(name) for name in sequence_mixers(layers[key], names)]
        ffn_only = not mixers and ffn_of(layers[key], names) is not None  # NemotronH's MoE or MLP layers
        several = len(mixers) > 1 and all(map(takes_hidden_states, mixers))
        if adapter.family == "moeflow" or not (len(mixers) == 1 or several or ffn_only) or carried:
            raise ValueError(why)
    gather = _attention_gather(names)
    plan: dict[str, ParallelStyle] = {}
    embedding = _module(model, names.embedding)
    if embedding is not None:
        holds_more = any(True for _ in embedding.children())  # a norm of the rows, with or without a weight
        if holds_more and _module(model, names.head) is not None and any(
                p is embedding.weight for p in _module(model, names.head).parameters()):
            raise ValueError(f"{type(model).__name__}: an embedding that holds more than its table runs whole on "
                             f"every tp rank, and the head tied to it is vocab-sharded; {HOW_TO_PASS_A_PLAN}")
        plan[names.embedding] = WholeEmbedding() if holds_more else _embedding_style()
    plan.update({pattern: SequenceParallel() for pattern in _block_norms(layers, names)})
    sharded = [key for key in layers if key not in whole]
    # A layer whose token mixer the plan cannot shard (a linear attention, a Mamba mixer, an attention with a
    # sparse-attention indexer) runs that mixer whole on every tp rank, on the all-gathered sequence.
    for key in whole:
        plan.update({f"{names.layers}.{key}.{name}": WholeMixer() for name in sequence_mixers(layers[key], names)})
    # parts beside the mixer that work token by token (hyper-connections, residual gates; a norm scaled by an MLP of
    # the token, AXK2's) run on the rank's tokens; each layer's own, as a name may be a mixer in another layer
    for key, layer in layers.items():
        per_token = [name for name in token_mixers(layer, names) if is_per_token(layer.get_submodule(name))]
        per_token += [name for name, child in named_parts(layer) if is_norm(child) and _holds_linear(child)]
        plan.update({f"{names.layers}.{key}.{name}": PerTokenPart() for name in per_token})
    base = names.layers.rpartition(".")[0]  # and the model's own, around its layers (a hyper-connection's head)
    if base and adapter.family != "moeflow":
        plan.update({f"{base}.{name}": PerTokenPart() for name, child in _module(model, base).named_children()
                     if is_per_token(child) and any(True for _ in child.parameters())})
        if any(True for _ in _module(model, base).parameters(recurse=False)):  # applied outside any module (Zaya's)
            plan[base] = ReplicatedParameters()
    if sharded:
        # every attention of a sharded layer (two in LongCat-Flash's) takes the first one's plan
        first_attention = next(iter(attentions_of(layers[sharded[0]], names).values()))
        same = not whole and len({tuple(attentions_of(layer, names)) for layer in layers.values()}) == 1
        attns = ([f"{names.layers}.*.{name}" for name in attentions_of(layers[sharded[0]], names)] if same else
                 [f"{names.layers}.{key}.{name}" for key in sharded for name in attentions_of(layers[key], names)])
        for attn in attns:
            plan.update(_attention_plan(attn, first_attention, gather, head_parameters, names))

    def ffn_kind(layer):
        name, ffn = ffn_of(layer, names) or (names.ffn, None)
        if ffn is None and len(sequence_mixers(layer, names)) == 1:
            return "none", name  # a layer of its mixer alone (NemotronH's attention and Mamba layers)
        if ffn is not None and is_moe(ffn):
            return "moe", name
        projections = mlp_projections(ffn, names) if ffn is not None else None
        if projections is not None:
            return "dense", name, projections
        return "unknown", name

    by_kind = _layer_patterns(names.layers, layers, ffn_kind)
    unknown = [pattern for (kind, *_), patterns in by_kind.items() if kind == "unknown" for pattern in patterns]
    if unknown:
        raise ValueError(f"{type(model).__name__}: an FFN that is neither an {names.up}/{names.down} MLP (gated by "
                         f"{names.gate} or not) nor an MoE block with a moeflow router or transformers' experts "
                         f"interface has no built-in tensor-parallel plan; layers {unknown[:4]}; {HOW_TO_PASS_A_PLAN}")
    for (kind, name, *projections), patterns in by_kind.items():
        if kind == "none":
            continue
        for pattern in patterns:
            ffn = f"{pattern}.{name}"
            if kind == "moe":
                plan[ffn] = _moe_style(fold_experts)
                key = pattern.rsplit(".", 1)[1]
                beside = {other: None for k, layer in layers.items() if key in ("*", k)
                          for other in beside_moe(layer, names)}
                plan.update({f"{pattern}.{other}": _moe_style(fold_experts) for other in beside})
                continue
            plan.update(_dense_ffn_plan(ffn, projections[0]))
    # a layer's dense MLPs other than its FFN (LongCat-Flash's, one after each of its attentions)
    def dense_others(layer):
        return tuple((name, mlp_projections(layer.get_submodule(name), names)) for name in other_ffns(layer, names))

    for found, patterns in _layer_patterns(names.layers, layers, dense_others).items():
        plan.update({key: style for pattern in patterns for name, projections in found
                     for key, style in _dense_ffn_plan(f"{pattern}.{name}", projections).items()})
    if any(experts_in_layer(layer) for layer in layers.values()):
        plan = _layers_on_local_tokens(model, plan, layers, names, fold_experts, bool(whole))
    if _module(model, names.final_norm) is not None:
        plan[names.final_norm] = SequenceParallel()
    has_embedding, has_head = _module(model, names.embedding) is not None, _module(model, names.head) is not None
    if has_head:
        plan[names.head] = _head_style(loss_parallel)
    # A pipeline stage without the embedding receives plain [B, S/tp, D] hidden states; one without the head
    # hands plain ones on (pipelining sends plain tensors).
    if not has_embedding or not has_head:
        plan[""] = PrepareModuleInputOutput(
            input_layouts=None if has_embedding else (Shard(1),),
            desired_input_layouts=None if has_embedding else (Shard(1),),
            output_layouts=(None,) if has_head else (Shard(1),),
            desired_output_layouts=(None,) if has_head else (Shard(1),),
            use_local_output=True,
        )
    return plan


def _layers_on_local_tokens(model: nn.Module, plan: dict, layers: dict[str, nn.Module], names, fold_experts: bool,
                            whole: bool) -> dict[str, ParallelStyle]:
    """The plan of layers whose forward computes its MoE itself (Gemma 4's: router and experts are the layer's own
    children, called on `residual.reshape(-1, D)`, which a sequence-sharded DTensor cannot take without gathering):
    each layer runs on this tp rank's sequence slice (LocalTokens), as a folded MoE block does. Inside it the
    attention and the dense MLP gather the sequence from their plain input and hand back plain local rows (their
    row-sharded projections' reduce-scatter, then `use_local_output`); every other part with parameters (norms, the
    router) is a PerTokenPart, its replicated parameters' gradients summed over tp after backward; the experts are
    spread over the ep x tp ranks by expert parallelism."""
    name = type(model).__name__
    itself = f"{name}: its layers compute their MoE in their own forward (no MoE block to hand the sequence slice)"
    if not fold_experts:
        raise ValueError(f"{itself}, which runs on each tp rank's tokens only with the MoE folded over tp; set "
                         f"parallel.ep_over_tp = true")
    if whole or not all(experts_in_layer(layer) for layer in layers.values()):
        why = "some of its layers' token mixers run whole on every tp rank" if whole else "only some of them do"
        raise ValueError(f"{itself}, and {why}; {HOW_TO_PASS_A_PLAN}")
    experts = {key: set(experts_in_layer(layer)) for key, layer in layers.items()}
    every_experts = set().union(*experts.values())
    depth = names.layers.count(".") + 2  # tokens of "<layers>.<key>." before a part's own name
    out: dict[str, ParallelStyle] = {f"{names.layers}.*": LocalTokens()}
    for pattern, style in plan.items():
        part = ".".join(pattern.split(".")[depth:]) if pattern.startswith(f"{names.layers}.") else ""
        if not part:
            out[pattern] = style
        elif isinstance(style, SequenceParallel) and not isinstance(style, HeadShardedNorm):  # a layer's norm
            out[pattern] = PerTokenPart()
        elif isinstance(style, RowwiseParallel) and style.output_layouts == (Shard(1),):  # o_proj, down_proj
            style.use_local_output = True
            out[pattern] = style
        elif not (isinstance(style, PerTokenPart) and part in every_experts):
            out[pattern] = style  # (the experts, per-token before, take no style: expert parallelism spreads them)
    for key, layer in layers.items():  # the rest with parameters runs on the rank's tokens: the router
        for part, child in named_parts(layer):
            fqn = f"{names.layers}.{key}.{part}"
            if (any(True for _ in child.parameters()) and part not in experts[key]
                    and not any(_pattern_matches(p, fqn) for p in out)):
                out[fqn] = PerTokenPart()
        if any(True for _ in layer.parameters(recurse=False)):
            raise ValueError(f"{name}: layer {key} applies parameters of its own to its sequence slice; "
                             f"{HOW_TO_PASS_A_PLAN}")
    return out


def tp_plan(model: nn.Module, *, loss_parallel: bool = True, fold_experts: bool = False) -> dict[str, ParallelStyle]:
    """The built-in plan for a moeflow Transformer (or a pipeline stage of one) or a Hugging Face decoder LM
    (attention with q/k/v/o projections, gate/up/down MLPs or MoE blocks), one plan under each family's module names
    (moeflow.parallel.module_names.ModuleNames); in a Hugging Face model, a layer's token mixers the plan cannot
    shard run whole on every tp rank (WholeMixer). ValueError otherwise.

    loss_parallel: the output head leaves vocab-sharded DTensor logits for tp_loss; else plain full logits.
    fold_experts: MoE layers take this rank's sequence slice (LocalTokens; their experts are spread over the tp
    ranks by expert parallelism); else every tp rank computes the whole MoE layer (ReplicatedModule).
    """
    from moeflow.parallel.adapter import adapter_for

    try:
        adapter = adapter_for(model)
    except ValueError:
        raise ValueError(f"{type(model).__name__} has no built-in tensor-parallel plan; {HOW_TO_PASS_A_PLAN}") from None
    return _plan(model, adapter, loss_parallel, fold_experts)


# ---- checks ------------------------------------------------------------------------------------------------


def _pattern_matches(pattern: str, fqn: str) -> bool:
    """parallelize_module's rule: same number of tokens, each matched by fnmatch."""
    tokens, names = pattern.split("."), fqn.split(".")
    return len(tokens) == len(names) and all(fnmatch(n, t) for t, n in zip(tokens, names))


def check_plan_covers(model: nn.Module, plan: dict[str, ParallelStyle]) -> None:
    """Every Linear / Embedding matched by a pattern (or inside a ReplicatedModule / LocalTokens); every pattern
    matches."""
    modules = dict(model.named_modules())
    unused = [p for p in plan if p and not any(_pattern_matches(p, fqn) for fqn in modules)]
    if unused:
        raise ValueError(f"tensor-parallel plan keys {unused[:5]} match no module of {type(model).__name__} "
                         f"(patterns are dot-separated fnmatch tokens, e.g. 'layers.*.attention.wq')")
    replicated = [p for p, style in plan.items() if isinstance(style, ReplicatedModule | LocalTokens)]
    uncovered = []
    for fqn, module in modules.items():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        if any(_pattern_matches(p, fqn) for p in plan):
            continue
        parts = fqn.split(".")
        if any(_pattern_matches(p, ".".join(parts[:i])) for p in replicated for i in range(1, len(parts))):
            continue
        uncovered.append(fqn)
    if uncovered:
        raise ValueError(
            f"a Linear or Embedding the tensor-parallel plan does not place would mix plain and sharded tensors; "
            f"{len(uncovered)} are left: {uncovered[:5]}{' ...' if len(uncovered) > 5 else ''}. "
            f"{HOW_TO_PASS_A_PLAN[0].upper()}{HOW_TO_PASS_A_PLAN[1:]}; ReplicatedModule() runs a whole module "
            f"unsharded on every tp rank"
        )


# ---- applying ----------------------------------------------------------------------------------------------


def _tied_parameters(model: nn.Module) -> list[tuple[str, str]]:
    """(first fqn, other fqn) for every parameter registered under more than one name (tied embeddings)."""
    first: dict[int, str] = {}
    ties = []
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties.append((first[id(param)], fqn))
        else:
            first[id(param)] = fqn
    return ties


def _retie(model: nn.Module, ties: list[tuple[str, str]]) -> None:
    # Each style registers its own new Parameter, which unties shared weights; tie them back when both sides
    # ended up with the same layout (the embedding and the head are both sharded on the vocab rows).
    for keep_fqn, other_fqn in ties:
        keep, other = model.get_parameter(keep_fqn), model.get_parameter(other_fqn)
        if keep is other:
            continue
        keep_layout, other_layout = (getattr(p, "placements", "unsharded") for p in (keep, other))
        if keep_layout != other_layout:
            raise ValueError(f"tied parameters {keep_fqn} and {other_fqn} got different tensor-parallel layouts "
                             f"({keep_layout} vs {other_layout}); give them the same sharding in the plan")
        owner_fqn, _, name = other_fqn.rpartition(".")
        setattr(model.get_submodule(owner_fqn), name, keep)


def _broadcast_replicated(model: nn.Module, tp_mesh) -> None:
    """Copy every tensor that tp ranks hold whole from tp rank 0, as parallelize_module does for the sharded
    ones (src_data_rank=0): replicated compute is only correct if the replicas start equal. Not the experts of an
    MoE layer that expert parallelism already spread over the tp ranks: each rank holds other experts."""
    from moeflow.models.moe import MoE
    from moeflow.parallel.hf_experts import is_expert_parallel_hf

    group = tp_mesh.get_group()
    own = {id(p) for m in model.modules() if isinstance(m, MoE) and _spread(m) for p in m.experts.parameters()}
    own |= {id(p) for m in model.modules() if is_expert_parallel_hf(m) for p in m.parameters()}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in own:
            continue
        if isinstance(tensor, DTensor):
            if not all(p.is_replicate() for p in tensor.placements):
                continue
            tensor = tensor.to_local()
        if tensor.device.type == "meta":
            continue
        with torch.no_grad():
            dist.broadcast(tensor.data, group=group, group_src=0)


def _spread(moe) -> bool:
    """Expert parallelism has replaced this MoE's dispatcher (its experts are a slice)."""
    from moeflow.models.moe import LocalDispatcher

    return not isinstance(moe.dispatcher, LocalDispatcher)


def _place_lora_factors(model: nn.Module, tp_mesh) -> None:
    """A LoRA adapter's factors (moeflow/models/lora.py) sharded as its layer's weight: a column-sharded layer's B
    by rows and A whole, a row-sharded layer's A by columns and B whole, so that the adapter's output is sharded
    (or partial) as the layer's. The styles shard every parameter of a column layer by rows and leave a row
    layer's extra parameters alone."""
    from moeflow.models.lora import LoRALinear

    for module in model.modules():
        if not (isinstance(module, LoRALinear) and isinstance(module.weight, DTensor)):
            continue
        by_rows = module.weight.placements[0] == Shard(0)
        placements = {"lora_A": Replicate() if by_rows else Shard(1), "lora_B": Shard(0) if by_rows else Replicate()}
        for name, placement in placements.items():
            factor = getattr(module, name)
            whole = factor.full_tensor() if isinstance(factor, DTensor) else factor
            # (every rank holds the same factors here: zeros until moeflow.models.lora.init sets them)
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(whole.detach(), tp_mesh, [placement], src_data_rank=None),
                requires_grad=factor.requires_grad))


def _check_sequence_divisible(tp: int):
    def hook(module, args, kwargs):
        tokens = args[0] if args else kwargs.get("input_ids")
        # Token ids only: a pipeline stage without the embedding receives hidden states already sharded.
        if isinstance(tokens, torch.Tensor) and not tokens.is_floating_point() and tokens.dim() >= 2:
            if tokens.shape[1] % tp:
                raise ValueError(f"sequence length {tokens.shape[1]} must be divisible by parallel.tp ({tp}) "
                                 f"with sequence parallelism; choose data.seq_len as a multiple of {tp}")

    return hook


def apply_tensor_parallel(model: nn.Module, tp_mesh, plan: dict[str, ParallelStyle] | None = None, *,
                          loss_parallel: bool = True, fold_experts: bool = False) -> nn.Module:
    """Shard `model` in place over the 1-D `tp_mesh` (e.g. mesh["tp"]) by `plan` (default `tp_plan(model)`).

    A no-op when tp_mesh is None or has one rank. Checks that the plan names every Linear / Embedding and that every
    pattern matches something; copies what the tp ranks hold whole (norm weights, MoE parameters, buffers) from tp
    rank 0; adds a check that the sequence length divides by tp. The widths must divide by tp
    (ParallelDims.check_model, or HuggingFaceAdapter.check_tp_widths for Hugging Face models). Apply it before FSDP
    (fully_shard on the data-parallel mesh) and after wrapping MoE layers for expert parallelism (the plan hooks the
    MoE module itself).
    """
    if tp_mesh is None or tp_mesh.size() == 1:
        return model
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tp mesh (mesh['tp']), got {tp_mesh.ndim} dims")
    tp = tp_mesh.size()
    if plan is None:
        plan = tp_plan(model, loss_parallel=loss_parallel, fold_experts=fold_experts)
    check_plan_covers(model, plan)
    ties = _tied_parameters(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    _place_lora_factors(model, tp_mesh)
    for name, param in model.named_parameters():  # the styles re-create parameters trainable (a LoRA's base is not)
        if name in frozen:
            param.requires_grad_(False)
    _retie(model, ties)
    _broadcast_replicated(model, tp_mesh)
    model.register_forward_pre_hook(_check_sequence_divisible(tp), with_kwargs=True, prepend=True)
    return model
