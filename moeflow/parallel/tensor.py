"""Tensor parallelism with sequence parallelism (Megatron-LM SP, Korthikanti et al. 2022) as plans that are data.

A plan is `{module fqn pattern: ParallelStyle}`. Each dot-separated token of a pattern is an fnmatch pattern
matched against one child name ("layers.*.attention.wq" matches every block's wq), which is how torch's
`parallelize_module` reads it; the empty pattern "" means the model itself.

Layout on the tp mesh (B batch, S sequence, D width, V vocab, H query heads, Hk kv heads, tp ranks):

    tokens [B, S], the same on every tp rank
    -> embedding, vocab rows sharded (RowwiseParallel) -> reduce-scatter -> h [B, S/tp, D]: Shard(1)
    per block
        attention_norm: SequenceParallel (weight replicated, runs on this rank's S/tp positions)
        attention: all-gather S -> wq, wk, wv column-sharded (H/tp, Hk/tp heads per rank) -> SDPA on the local
                   heads with RoPE tables for all S positions -> wo row-sharded -> reduce-scatter -> [B, S/tp, D]
        ffn_norm: SequenceParallel
        dense FFN: all-gather -> w1, w3 column-sharded, w2 row-sharded -> reduce-scatter
        MoE FFN:   all-gather -> every tp rank runs the whole MoE on plain tensors (ReplicatedModule) -> keeps
                   its S/tp slice (no communication on the way out; an all-gather of the gradient on the way back)
    final norm: SequenceParallel -> all-gather -> output head column-sharded -> logits [B, S, V/tp]: Shard(-1)
    -> tp_loss: cross-entropy over the vocab shards (three all-reduces of B*S numbers); the full logits never exist.

The residual stream between blocks is a DTensor with the global shape [B, S, D], so `Transformer.forward` sees
the full sequence length and slices the RoPE tables to all S positions; the attention receives them after its
all-gather, where its queries and keys cover all S positions as well. S must be divisible by tp. A pipeline
stage without the embedding takes, and one without the head returns, plain [B, S/tp, D] hidden states.

Query/key norms: per head (Qwen3) the [Dh] weight is replicated and its gradient summed over tp ranks
(HeadShardedNorm); over all heads (OLMoE, 'full') the [H*Dh] weight is sharded like wq's columns and the mean
of squares all-reduced (WidthShardedNorm). Multi-head latent attention is rejected (check_tp).

Hugging Face decoders (Llama, Qwen2/3, Mistral layouts: self_attn.q/k/v/o_proj, mlp.gate/up/down_proj, norms)
get the same plan by their module names, sequence parallelism included: their decoder layers only add and pass
on the residual, which works on DTensors, and their rotary module sees the global shape.

MoE under TP: expert compute (router, routed and shared experts) is replicated tp-fold, and every tp rank's
MoE parameters get the same gradient (the same full sequence and the same output gradient reach each), so no
reduction over tp is needed for them -- nor for the router's aux loss, which each rank computes on the same
tokens. `Router.last_load` then counts every token once per tp rank. Expert-tensor-parallelism (F sharded over
tp) or routing the S/tp local tokens with the tp ranks acting as extra data-parallel ranks for the experts
would remove the redundancy; both are follow-ups.

Composition with FSDP2 (TorchTitan's order): tensor parallelism on mesh["tp"] first, then `fully_shard` of each
block and of the root on the data-parallel mesh, which makes 2-D (dp, tp) DTensor parameters.
"""

from __future__ import annotations

import math
from fnmatch import fnmatch

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from moeflow.errors import divisors

HOW_TO_PASS_A_PLAN = (
    "pass a plan: parallelize(model, tp=..., tp_plan={'<fqn pattern>': ColwiseParallel(), ...}) "
    "(styles from torch.distributed.tensor.parallel and moeflow.parallel.tensor)"
)


# ---- styles beyond torch's ---------------------------------------------------------------------------------


class ReplicatedModule(ParallelStyle):
    """Run the whole module on every tp rank, on the all-gathered sequence, with its own plain parameters.

    Input (the first positional argument, or `hidden_states=`): a sequence-sharded DTensor (or this rank's
    plain slice of one), all-gathered and handed over as a plain tensor. Output (or the first element of a
    tuple output): the plain result, taken as Replicate and cut to this rank's sequence slice, which needs no
    communication (its backward all-gathers the gradient). Every tp rank computes the same thing, so the
    module's parameter gradients agree across tp ranks without any reduction. Linear modules inside are
    covered by this entry: apply_tensor_parallel does not ask for a plan for them.
    """

    def __init__(self, *, sequence_dim: int = 1):
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        sequence_sharded = [Shard(self.sequence_dim)]

        def gather(x):
            if not isinstance(x, torch.Tensor):
                return x
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, sequence_sharded, run_check=False)
            return x.redistribute(placements=[Replicate()]).to_local()

        def scatter(y):
            return DTensor.from_local(y, device_mesh, [Replicate()], run_check=False).redistribute(
                placements=sequence_sharded)

        def gather_input(mod, args, kwargs):
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
            raise ValueError(f"ReplicatedModule: {type(mod).__name__} got no positional input nor hidden_states=")

        def scatter_output(mod, args, kwargs, output):
            return (scatter(output[0]), *output[1:]) if isinstance(output, tuple) else scatter(output)

        module.register_forward_pre_hook(gather_input, with_kwargs=True)
        module.register_forward_hook(scatter_output, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"ReplicatedModule(sequence_dim={self.sequence_dim})"


class HeadShardedNorm(SequenceParallel):
    """A norm over each head's width (Qwen3's q_norm / k_norm) applied to the local heads of a tp rank.

    The weight [Dh] is shared by all heads, so each rank's heads contribute part of its gradient. Wrapping the
    local [.., H/tp, ..] input as a DTensor sharded on the head dim and the weight as a Replicate DTensor makes
    autograd sum those parts over the tp ranks (HF calls this 'replicated_with_grad_allreduce'). The output is
    the plain local tensor again.
    """

    def __init__(self, *, head_dim_index: int):
        super().__init__(sequence_dim=head_dim_index, use_local_output=True)


class WidthShardedNorm(ParallelStyle):
    """RMSNorm over the full width of a column-sharded activation (OLMoE's qk_norm 'full', over all heads).

    The input is this rank's columns [..., W/tp] (a ColwiseParallel output); the weight [W] is sharded the same
    way. As DTensors, the mean of squares over the sharded last dim becomes a partial sum that DTensor
    all-reduces ([..., 1] numbers), and the weight's gradient stays on its shard.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def shard_weight(name, mod, mesh):
            for p_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(p_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        def to_dtensor(mod, inputs, mesh):
            return DTensor.from_local(inputs[0], mesh, [Shard(-1)], run_check=False)

        def to_local(mod, outputs, mesh):
            return outputs.to_local()

        return distribute_module(module, device_mesh, shard_weight, to_dtensor, to_local)

    def __repr__(self) -> str:
        return "WidthShardedNorm()"


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


def _layer_patterns(prefix: str, layers: dict[str, nn.Module], kind_of) -> dict[str, list[str]]:
    """{kind: [pattern of the layers of that kind]}: one 'prefix.*' when all layers share a kind."""
    kinds: dict[str, list[str]] = {}
    for name, layer in layers.items():
        kinds.setdefault(kind_of(layer), []).append(name)
    if len(kinds) == 1:
        return {kind: [f"{prefix}.*"] for kind in kinds}
    return {kind: [f"{prefix}.{n}" for n in names] for kind, names in kinds.items()}


def _is_moe(module: nn.Module) -> bool:
    """A moeflow MoE, ExpertParallelMoE, or any wrapper of one (e.g. the block that replaces an HF sparse MoE)."""
    from moeflow.models.moe import Router

    return any(isinstance(m, Router) for m in module.modules())


def _moeflow_plan(model: nn.Module, loss_parallel: bool) -> dict[str, ParallelStyle]:
    cfg = model.cfg
    _check_supported(cfg)
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = _embedding_style()
    plan.update({
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": _gather_sequence(input_layouts=(Shard(1), None, None),
                                               desired_input_layouts=(Replicate(), None, None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": _rowwise_to_sequence(),
        "layers.*.ffn_norm": SequenceParallel(),
    })
    if cfg.qk_norm == "per_head":  # applied to q_BHSDh: heads on dim 1
        plan["layers.*.attention.q_norm"] = HeadShardedNorm(head_dim_index=1)
        plan["layers.*.attention.k_norm"] = HeadShardedNorm(head_dim_index=1)
    elif cfg.qk_norm == "full":  # applied to the colwise output [B, S, H/tp * Dh]
        plan["layers.*.attention.q_norm"] = WidthShardedNorm()
        plan["layers.*.attention.k_norm"] = WidthShardedNorm()
    by_kind = _layer_patterns("layers", dict(model.layers.items()),
                              lambda block: "moe" if _is_moe(block.feed_forward) else "dense")
    for pattern in by_kind.get("moe", []):
        plan[f"{pattern}.feed_forward"] = ReplicatedModule()
    for pattern in by_kind.get("dense", []):
        plan[f"{pattern}.feed_forward"] = _gather_sequence(input_layouts=(Shard(1),),
                                                           desired_input_layouts=(Replicate(),))
        plan[f"{pattern}.feed_forward.w1"] = ColwiseParallel()
        plan[f"{pattern}.feed_forward.w3"] = ColwiseParallel()
        plan[f"{pattern}.feed_forward.w2"] = _rowwise_to_sequence()
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = _head_style(loss_parallel)
    # A pipeline stage without the embedding receives plain [B, S/tp, D] hidden states; one without the head
    # hands plain ones on (pipelining sends plain tensors).
    if model.tok_embeddings is None or model.output is None:
        plan[""] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),) if model.tok_embeddings is None else None,
            desired_input_layouts=(Shard(1),) if model.tok_embeddings is None else None,
            output_layouts=(Shard(1),) if model.output is None else (None,),
            desired_output_layouts=(Shard(1),) if model.output is None else (None,),
            use_local_output=True,
        )
    return plan


def _hf_decoder(model: nn.Module) -> tuple[str, nn.Module]:
    """('model', the decoder with embed_tokens / layers / norm) of a Hugging Face *ForCausalLM, or raise."""
    for prefix, decoder in (("model", getattr(model, "model", None)), ("", model)):
        if decoder is not None and all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm")):
            return prefix, decoder
    raise ValueError(f"{type(model).__name__}: no built-in tensor-parallel plan (no model.embed_tokens / "
                     f"model.layers / model.norm found); {HOW_TO_PASS_A_PLAN}")


def _hf_plan(model: nn.Module, loss_parallel: bool) -> dict[str, ParallelStyle]:
    _check_supported(model.config)
    prefix, decoder = _hf_decoder(model)
    at = f"{prefix}." if prefix else ""
    layers = {str(i): layer for i, layer in enumerate(decoder.layers)}
    for name, layer in layers.items():
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ValueError(f"{type(model).__name__}: layer {name} has no self_attn.q_proj/k_proj/v_proj/o_proj; "
                             f"no built-in tensor-parallel plan; {HOW_TO_PASS_A_PLAN}")
    plan: dict[str, ParallelStyle] = {
        f"{at}embed_tokens": _embedding_style(),
        f"{at}layers.*.input_layernorm": SequenceParallel(),
        # HF decoder layers call self_attn(hidden_states=..., position_embeddings=(cos, sin), ...) by keyword;
        # (cos, sin) cover all S positions (the rotary module sees the global shape of the residual DTensor).
        f"{at}layers.*.self_attn": _gather_sequence(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        f"{at}layers.*.self_attn.q_proj": ColwiseParallel(),
        f"{at}layers.*.self_attn.k_proj": ColwiseParallel(),
        f"{at}layers.*.self_attn.v_proj": ColwiseParallel(),
        f"{at}layers.*.self_attn.o_proj": _rowwise_to_sequence(),
        f"{at}layers.*.post_attention_layernorm": SequenceParallel(),
        f"{at}norm": SequenceParallel(),
    }
    first_attn = next(iter(layers.values())).self_attn
    if getattr(first_attn, "q_norm", None) is not None:
        if first_attn.q_norm.weight.numel() == first_attn.head_dim:  # Qwen3: per head, on [B, S, H, Dh]
            qk_norm_style = HeadShardedNorm(head_dim_index=2)
        else:  # OLMo2 / OLMoE: over the whole q_proj / k_proj output
            qk_norm_style = WidthShardedNorm()
        plan[f"{at}layers.*.self_attn.q_norm"] = qk_norm_style
        plan[f"{at}layers.*.self_attn.k_norm"] = qk_norm_style

    def mlp_kind(layer):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and _is_moe(mlp):
            return "moe"
        if mlp is not None and all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            return "dense"
        return "unknown"

    by_kind = _layer_patterns(f"{at}layers", layers, mlp_kind)
    if "unknown" in by_kind:
        raise ValueError(f"{type(model).__name__}: layers {by_kind['unknown'][:4]} have an mlp that is neither "
                         f"gate/up/down_proj nor a moeflow MoE (use moeflow.models.hf_live.replace_sparse_moe_blocks "
                         f"for HF MoE blocks); {HOW_TO_PASS_A_PLAN}")
    for pattern in by_kind.get("moe", []):
        plan[f"{pattern}.mlp"] = ReplicatedModule()
    for pattern in by_kind.get("dense", []):
        plan[f"{pattern}.mlp"] = _gather_sequence(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan[f"{pattern}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{pattern}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{pattern}.mlp.down_proj"] = _rowwise_to_sequence()
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = _head_style(loss_parallel)
    return plan


def tp_plan(model: nn.Module, *, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """The built-in plan for a moeflow Transformer (or a pipeline stage of one) or a Hugging Face decoder LM
    (Llama / Qwen2 / Qwen3 / Mistral layout, MoE blocks replaced by moeflow's MoE). ValueError otherwise.

    loss_parallel: the output head leaves vocab-sharded DTensor logits for tp_loss; else plain full logits.
    """
    from moeflow.models.transformer import Transformer

    if isinstance(model, Transformer):
        return _moeflow_plan(model, loss_parallel)
    if hasattr(model, "config") and hasattr(model.config, "num_attention_heads"):
        return _hf_plan(model, loss_parallel)
    raise ValueError(f"{type(model).__name__} has no built-in tensor-parallel plan; {HOW_TO_PASS_A_PLAN}")


# ---- checks ------------------------------------------------------------------------------------------------


def _config_of(model_or_cfg):
    for attribute in ("cfg", "config"):  # a moeflow Transformer's config, a Hugging Face model's
        if getattr(model_or_cfg, attribute, None) is not None:
            model_or_cfg = getattr(model_or_cfg, attribute)
            break
    text_config = getattr(model_or_cfg, "text_config", None)  # multimodal HF configs keep the decoder's here
    return text_config if text_config is not None else model_or_cfg


def _check_supported(model_or_cfg) -> None:
    """ValueError for what the built-in plans cannot shard yet, whatever tp is."""
    cfg = _config_of(model_or_cfg)
    if hasattr(cfg, "n_heads"):  # moeflow ModelConfig
        latent_attention = cfg.attention == "mla"
    else:  # Hugging Face: DeepSeek-V2/V3 configs carry the latent ranks
        latent_attention = bool(getattr(cfg, "kv_lora_rank", None))
    if latent_attention:
        raise ValueError("multi-head latent attention (model.attention = 'mla', DeepSeek-V2/V3) is not supported "
                         "with parallel.tp > 1 yet; use parallel.tp=1 with data and expert parallelism")


def check_tp(model_or_cfg, tp: int) -> None:
    """ValueError unless tp divides the sharded widths: heads, kv heads and the dense FFN width.

    Takes a moeflow ModelConfig or Transformer, or a Hugging Face model or config. Also rejects what the plans
    cannot shard yet (multi-head latent attention).
    """
    if tp < 1:
        raise ValueError(f"parallel.tp must be at least 1, got {tp}")
    if tp == 1:
        return
    _check_supported(model_or_cfg)
    cfg = _config_of(model_or_cfg)
    if hasattr(cfg, "n_heads"):  # moeflow ModelConfig
        sizes = [("model.n_heads", cfg.n_heads), ("model.n_kv_heads", cfg.kv_heads)]
        if cfg.n_layers > cfg.num_moe_layers:  # MoE layers are replicated over tp; only dense FFNs are sharded
            sizes.append(("model.ffn_dim", cfg.ffn_dim))
        where = ""
    elif hasattr(cfg, "num_attention_heads"):  # Hugging Face PretrainedConfig
        heads = cfg.num_attention_heads
        sizes = [("num_attention_heads", heads),
                 ("num_key_value_heads", getattr(cfg, "num_key_value_heads", None) or heads)]
        if getattr(cfg, "intermediate_size", None):
            sizes.append(("intermediate_size", cfg.intermediate_size))
        where = " in the Hugging Face config"
    else:
        raise ValueError(f"check_tp: expected a moeflow or Hugging Face model or config, got {type(model_or_cfg)}")
    for name, value in sizes:
        if value % tp:
            raise ValueError(f"parallel.tp ({tp}) must divide {name} ({value}){where}; "
                             f"choose tp in {divisors(value)}")


def _pattern_matches(pattern: str, fqn: str) -> bool:
    """parallelize_module's rule: same number of tokens, each matched by fnmatch."""
    tokens, names = pattern.split("."), fqn.split(".")
    return len(tokens) == len(names) and all(fnmatch(n, t) for t, n in zip(tokens, names))


def _check_plan_covers(model: nn.Module, plan: dict[str, ParallelStyle]) -> None:
    """Every Linear / Embedding matched by a pattern (or inside a ReplicatedModule); every pattern matches."""
    modules = dict(model.named_modules())
    unused = [p for p in plan if p and not any(_pattern_matches(p, fqn) for fqn in modules)]
    if unused:
        raise ValueError(f"tensor-parallel plan keys {unused[:5]} match no module of {type(model).__name__} "
                         f"(patterns are dot-separated fnmatch tokens, e.g. 'layers.*.attention.wq')")
    replicated = [p for p, style in plan.items() if isinstance(style, ReplicatedModule)]
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
            f"tensor parallelism: {len(uncovered)} Linear/Embedding modules are not in the plan: {uncovered[:5]}"
            f"{' ...' if len(uncovered) > 5 else ''}; left alone they would mix plain and sharded tensors. "
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
    ones (src_data_rank=0): replicated compute is only correct if the replicas start equal."""
    group = tp_mesh.get_group()
    for tensor in [*model.parameters(), *model.buffers()]:
        if isinstance(tensor, DTensor):
            if not all(p.is_replicate() for p in tensor.placements):
                continue
            tensor = tensor.to_local()
        if tensor.device.type == "meta":
            continue
        with torch.no_grad():
            dist.broadcast(tensor.data, group=group, group_src=0)


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
                          loss_parallel: bool = True) -> nn.Module:
    """Shard `model` in place over the 1-D `tp_mesh` (e.g. mesh["tp"]) by `plan` (default `tp_plan(model)`).

    A no-op when tp_mesh is None or has one rank. Checks that the plan names every Linear / Embedding and that
    every pattern matches something; copies what the tp ranks hold whole (norm weights, MoE parameters,
    buffers) from tp rank 0; adds a check that the sequence length divides by tp; records `model.tp_mesh`
    (read by grad_norm_sq_local). Apply it before FSDP (fully_shard on the data-parallel mesh) and after
    wrapping MoE layers for expert parallelism (the plan hooks the MoE module itself).
    """
    if tp_mesh is None or tp_mesh.size() == 1:
        return model
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tp mesh (mesh['tp']), got {tp_mesh.ndim} dims")
    tp = tp_mesh.size()
    if plan is None:
        plan = tp_plan(model, loss_parallel=loss_parallel)
    if hasattr(model, "cfg") or hasattr(model, "config"):
        check_tp(model, tp)
    _check_plan_covers(model, plan)
    ties = _tied_parameters(model)
    parallelize_module(model, tp_mesh, plan)
    _retie(model, ties)
    _broadcast_replicated(model, tp_mesh)
    model.register_forward_pre_hook(_check_sequence_divisible(tp), with_kwargs=True, prepend=True)
    model.tp_mesh = tp_mesh
    return model


# ---- loss and gradient norm --------------------------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of logits whose vocab is split over a tp group (Megatron-LM's vocab-parallel CE).

    The gradient softmax - onehot is local to each shard, so the backward needs no communication.
    """

    @staticmethod
    def forward(ctx, logits_NVl, targets_N, vocab_start: int, group, ignore_index: int):
        x_NVl = logits_NVl.float()
        max_N = x_NVl.amax(-1)
        dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=group)
        exp_NVl = (x_NVl - max_N.unsqueeze(-1)).exp()
        sumexp_N = exp_NVl.sum(-1)
        dist.all_reduce(sumexp_N, group=group)
        local_target_N = targets_N - vocab_start
        here_N = (local_target_N >= 0) & (local_target_N < x_NVl.shape[-1])
        safe_target_N = torch.where(here_N, local_target_N, 0)
        target_logit_N = x_NVl.gather(-1, safe_target_N.unsqueeze(-1)).squeeze(-1) * here_N
        dist.all_reduce(target_logit_N, group=group)
        valid_N = targets_N != ignore_index
        loss_N = (sumexp_N.log() + max_N - target_logit_N) * valid_N
        ctx.save_for_backward(exp_NVl, sumexp_N, safe_target_N, here_N, valid_N)
        ctx.logits_dtype = logits_NVl.dtype
        return loss_N

    @staticmethod
    def backward(ctx, grad_N):
        exp_NVl, sumexp_N, safe_target_N, here_N, valid_N = ctx.saved_tensors
        grad_N = grad_N * valid_N
        grad_NVl = exp_NVl / sumexp_N.unsqueeze(-1) * grad_N.unsqueeze(-1)
        rows = torch.arange(grad_NVl.shape[0], device=grad_NVl.device)
        grad_NVl[rows, safe_target_N] -= grad_N * here_N
        return grad_NVl.to(ctx.logits_dtype), None, None, None, None


def tp_loss(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
            reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits [..., V] against targets [...]; a plain tensor, equal on every tp rank.

    With plain logits this is F.cross_entropy (in fp32). With vocab-sharded DTensor logits (the head of a
    tp_plan with loss_parallel) each rank keeps its [..., V/tp] shard; no context manager is needed around
    backward, unlike torch's loss_parallel().
    """
    if not isinstance(logits, DTensor):
        loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index,
                               reduction=reduction)
        return loss.view(targets.shape) if reduction == "none" else loss
    placement = logits.placements[0]
    if logits.device_mesh.ndim != 1 or not placement.is_shard(logits.ndim - 1):
        raise ValueError(f"tp_loss expects logits sharded on the vocab dim over a 1-D tp mesh, got "
                         f"{logits.placements} on a {logits.device_mesh.ndim}-D mesh")
    mesh = logits.device_mesh
    vocab = logits.shape[-1]
    # DTensor shards like torch.chunk: ceil(V / tp) columns per rank, the last ones possibly fewer.
    vocab_start = min(mesh.get_local_rank() * math.ceil(vocab / mesh.size()), vocab)
    local_NVl = logits.to_local().flatten(0, -2)
    loss_N = _VocabParallelCrossEntropy.apply(local_NVl, targets.flatten(), vocab_start, mesh.get_group(),
                                              ignore_index)
    if reduction == "none":
        return loss_N.view(targets.shape)
    if reduction == "sum":
        return loss_N.sum()
    if reduction == "mean":
        return loss_N.sum() / (targets != ignore_index).sum()
    raise ValueError(f"tp_loss: reduction = {reduction!r}; choose 'mean', 'sum' or 'none'")


def _spans_tp(mesh, tp_ranks: list[int], cache: dict) -> bool:
    """Whether one of the mesh's dims is the tp dim (the same ranks as tp_mesh), by ranks rather than by names."""
    key = id(mesh)
    if key not in cache:
        cache[key] = any(dist.get_process_group_ranks(mesh.get_group(d)) == tp_ranks for d in range(mesh.ndim))
    return cache[key]


def grad_norm_sq_local(model: nn.Module) -> torch.Tensor:
    """This rank's share of the squared gradient norm: summed over ALL ranks it is the exact ||g||^2.

    A gradient element held by several ranks is counted on one of them: for a DTensor, only the ranks at
    coordinate 0 of each mesh dim whose placement is Replicate count it (tp for SequenceParallel norms,
    dp_replicate under HSDP); a parameter that tensor parallelism left unsharded (plain, or a DTensor on a mesh
    without the tp dim, e.g. MoE parameters after FSDP) is replicated over tp and counted on tp rank 0 only.
    Partial gradients (SequenceParallel norm weights when no FSDP reduces them) are all-reduced first and
    replaced by the reduced ones, so every rank must call this, in the same order of parameters.
    """
    tp_mesh = getattr(model, "tp_mesh", None)
    tp_ranks = dist.get_process_group_ranks(tp_mesh.get_group()) if tp_mesh is not None else []
    tp_rank = tp_mesh.get_local_rank() if tp_mesh is not None else 0
    spans_tp_cache: dict = {}
    device = next(model.parameters()).device
    total = torch.zeros((), device=device, dtype=torch.float32)
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                # Reduce once, in place: the optimizer would otherwise all-reduce it again in each of its ops.
                grad = param.grad = grad.redistribute(
                    placements=[Replicate() if p.is_partial() else p for p in grad.placements])
            mesh = grad.device_mesh
            counted_here = all(mesh.get_local_rank(d) == 0 for d, p in enumerate(grad.placements)
                               if p.is_replicate())
            replicated_over_tp = tp_mesh is not None and not _spans_tp(mesh, tp_ranks, spans_tp_cache)
            local = grad.to_local()
        else:
            counted_here, local = True, grad
            replicated_over_tp = tp_mesh is not None
        if replicated_over_tp and tp_rank != 0:
            counted_here = False
        if counted_here:
            total = total + local.float().pow(2).sum()
    return total
