"""Context parallelism of transformers' own attention modules: the layout and the key/value all-gather of
moeflow.parallel.context, reached through transformers' attention and mask interfaces instead of a class swap.

transformers' attention modules compute q, k and v (RoPE applied from the position ids they are given) and hand
them, with the mask the model built for the layer, to `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`;
the model builds its masks through `ALL_MASK_ATTENTION_FUNCTIONS[...]` from a mask function of (batch, head,
query index, key index) that says what the architecture wants (causal, a sliding window, chunks, ...).
`apply_hf_context_parallel` registers one of each and points the model at them:
- the decoder receives the global positions of this rank's two chunks (a forward pre-hook fills `position_ids`)
  and an all-ones padding mask of the whole sequence's length, so RoPE rotates every token as in the whole
  sequence and transformers sizes the keys of each mask at S (and reads no packing into the positions' jump);
- the mask function evaluates the architecture's own mask function at the global positions of this rank's
  queries against all S keys: None where that is plain causal attention, else the [B, 1, L, S] boolean mask;
- the attention function all-gathers keys and values over the cp group, then lets each local query attend to
  the keys before it (context.context_parallel_attention) where the mask is None and the layer has no attention
  sinks or logit soft-cap, else computes the masked attention over the gathered keys itself.
So each layer attends as transformers' own mask says, by construction. A layer whose sequence mixer is not such
attention runs that mixer whole on every cp rank: a linear attention, a Mamba mixer or a short convolution, and an
attention with a sparse-attention indexer (DeepSeek-V3.2's DSA: it ranks each query's whole row of keys, and hands
the attention function its top-k `indices`, which the whole-sequence path here turns into the mask transformers'
eager path builds), and a hybrid layer's attention beside short convolutions (Inkling's: each of its mixers whole,
an attention's `position_bias` added to the whole sequence's scores). A forward pre-hook all-gathers the mixer's
input (and the RoPE tables, positions and mask rows it is handed) into sequence order, a forward hook cuts this
rank's chunks from its output; the all-gather's backward sums every rank's gradient of the rank's tokens, and each
rank's parameter gradients come from its own chunks' outputs, which the gradient reduction over cp adds up as it
does the attention's. It costs cp times the mixer's compute, and the indexer's attention its [S, S] scores. Other
layers (compressed attention, a mixer of another input than the hidden states) are refused (`hf_context_refusal`),
as are layers that hand each other state where some run whole and others split.

Shape suffixes as in moeflow.parallel.context: B batch, H query heads, Hk key/value heads, L local tokens, S whole
sequence, Dk query/key width, Dv value width.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeflow.models.layers import autocast_input
from moeflow.parallel.context import (
    ContextParallelTokenScale,
    context_parallel_attention,
    gather_keys_values,
    gather_sequence,
    local_positions,
)

ATTENTION = "moeflow_context_parallel"
# layer kinds whose mixing along the sequence is attention under a mask transformers builds, or none at all
_SPLITTABLE_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "mlp", "moe"}
# layer kinds whose sequence mixers run whole: not attention (linear attention, Mamba, a short convolution),
# attention whose sparse-attention indexer picks keys from each query's whole row of scores, or attention beside
# short convolutions (Inkling's and Zaya's hybrid layers)
_WHOLE_LAYERS = {"linear_attention", "conv", "indexed_attention", "hybrid", "hybrid_sliding",
                 "compressed_sparse_attention", "heavily_compressed_attention"}
# what some architectures hand an attention function to change its scores, which `_attention` does not apply
# (it applies `s_aux` sinks, `softcap`, an indexer's `indices` and `position_bias`): refused rather than dropped
_SCORE_TERMS = ("sinks", "block_indices", "alibi", "attention_bias", "relative_position_bias")
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> its cp process group
# the forward under way (set by its pre-hook): its global query positions [L] and the sequence length S
_QUERIES: list[tuple[torch.Tensor, int]] = []
# the forward under way's masks gathered whole for the mixers that run whole: (the local mask, the whole one)
_WHOLE_MASKS: list[tuple[weakref.ref, torch.Tensor]] = []


def hf_context_refusal(model: nn.Module) -> str | None:
    """Why this transformers model cannot split its sequences over cp ranks (None when it can)."""
    cfg = model.config.get_text_config()
    name = type(model).__name__
    others = sorted(set(getattr(cfg, "layer_types", None) or []) - _SPLITTABLE_LAYERS - _WHOLE_LAYERS)
    if others:
        return (f"{name}: its {', '.join(others)} layers are neither full, sliding-window or chunked attention, "
                f"which context parallelism splits here, nor linear attention, convolutions or indexed attention, "
                f"or hybrid layers of attention beside convolutions, which it runs whole; use cp = 1")
    why = _whole_mixers(model)[1]
    if why:
        return why
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in ("dynamic", "longrope"):  # the tables follow max(position_ids), which differs between cp ranks
        return f"{name}: {rope} RoPE scales by the longest position a rank holds, which cp splits; use cp = 1"
    if getattr(cfg, "attn_temperature_tuning", False):  # Llama 4 scales queries by arange(local length)
        return f"{name}: attention temperature tuning reads the local positions, not the sequence's; use cp = 1"
    return None


def _whole_mixers(model: nn.Module) -> tuple[dict[str, nn.Module], str | None]:
    """({fqn: module} of the sequence mixers that run whole on every cp rank: in each layer of a kind in
    _WHOLE_LAYERS, its one sequence mixer, or its several where each takes the hidden states (its per-token parts
    stay on the rank's tokens); why not, where such a layer has none, or a mixer of another input)."""
    from moeflow.parallel.hf_loop import carries_state
    from moeflow.parallel.hf_pipeline import is_skipped
    from moeflow.parallel.module_names import HF_NAMES, sequence_mixers, takes_hidden_states

    kinds = getattr(model.config.get_text_config(), "layer_types", None) or []
    found = {}
    if not _WHOLE_LAYERS & set(kinds):
        return found, None
    for i, block in enumerate(model.model.layers):
        if i >= len(kinds) or kinds[i] not in _WHOLE_LAYERS or is_skipped(block):
            continue
        mixers = sequence_mixers(block, HF_NAMES)
        several = len(mixers) > 1 and all(takes_hidden_states(block.get_submodule(m)) for m in mixers)
        if len(mixers) != 1 and not several:
            return {}, (f"{type(model).__name__}: its {kinds[i]} layer {i} has {', '.join(mixers) or 'no part'} "
                        f"beside its FFN, where context parallelism runs whole one sequence mixer, or several that "
                        f"each take the hidden states; use cp = 1")
        found.update({f"model.layers.{i}.{m}": block.get_submodule(m) for m in mixers})
    if found and set(kinds) - _WHOLE_LAYERS - {"mlp", "moe"} and carries_state(model):
        return {}, (f"{type(model).__name__}: its layers hand each other more than the hidden states, and some run "
                    f"whole on every cp rank while others split the sequence; use cp = 1")
    return found, None


def whole_sequence_mixers(model: nn.Module) -> dict[str, nn.Module]:
    """{fqn: module} of the sequence mixers context parallelism runs whole on every cp rank (module docstring)."""
    return _whole_mixers(model)[0]


def _run_whole(mixer: nn.Module, group, additive: bool = False) -> None:
    """Hooks that give `mixer` the whole sequences in order and hand its caller this rank's chunks of its output;
    `additive`: its whole masks as eager attention's (0 where seen, the dtype's lowest elsewhere)."""

    def whole_mask(mask):
        seen = _whole_mask(mask, group)
        if not additive:
            return seen
        return torch.zeros(seen.shape, device=seen.device).masked_fill(~seen, torch.finfo(torch.float32).min)

    def gather(module, args, kwargs):
        whole = lambda t: gather_sequence(t, group, dim=1)  # noqa: E731
        tables = lambda v: tuple(whole(t) for t in v)  # noqa: E731  (RoPE's cos, sin [B, L, d] of this rank)
        if args:  # hidden states first, then (Qwen4-style) the RoPE tables
            args = (whole(args[0]), *(tables(a) if _is_tables(a) else a for a in args[1:]))
        elif "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}
        else:
            raise ValueError(f"context parallelism: {type(module).__name__} got no positional input nor "
                             f"hidden_states=; use parallel.cp = 1")
        rope = kwargs.get("position_embeddings")
        if isinstance(rope, dict):  # one pair of tables per kind (DeepSeek-V4's main and compressed attention)
            kwargs["position_embeddings"] = {kind: tables(pair) for kind, pair in rope.items()}
        elif rope is not None:
            kwargs["position_embeddings"] = tables(rope)
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = whole(kwargs["position_ids"])
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 4:  # [B, 1, L, S] of this rank's queries: every row
            kwargs["attention_mask"] = whole_mask(mask)
        elif isinstance(mask, dict):  # one per kind of mixer (Zaya's causal and sliding masks): each made whole
            kwargs["attention_mask"] = {kind: whole_mask(m) if isinstance(m, torch.Tensor) and m.ndim == 4
                                        else m for kind, m in mask.items()}
        return args, kwargs

    def cut(module, args, kwargs, output):
        ((q_pos_L, _),) = _QUERIES
        local = lambda y: y.index_select(1, q_pos_L.to(y.device))  # noqa: E731
        return (local(output[0]), *output[1:]) if isinstance(output, tuple) else local(output)

    # inside tensor parallelism's hooks where tp also runs the mixer whole (WholeMixer, applied first): its
    # all-gather over tp runs before this one, its cut after this one
    mixer.register_forward_pre_hook(gather, with_kwargs=True)
    mixer.register_forward_hook(cut, with_kwargs=True, prepend=True)


def _whole_mask(mask_B1LS: torch.Tensor, group) -> torch.Tensor:
    """Every rank's rows of a layer's mask, [B, 1, S, S] in sequence order: gathered once per forward for each mask
    the model built (its layers of one kind share it)."""
    for ref, whole in _WHOLE_MASKS:
        if ref() is mask_B1LS:
            return whole
    rows = gather_sequence(mask_B1LS.to(torch.uint8) if mask_B1LS.dtype == torch.bool else mask_B1LS, group, dim=2)
    whole = rows.bool() if mask_B1LS.dtype == torch.bool else rows
    _WHOLE_MASKS.append((weakref.ref(mask_B1LS), whole))
    return whole


def _is_tables(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(isinstance(t, torch.Tensor) for t in value)


def apply_hf_context_parallel(model: nn.Module, cp_mesh) -> ContextParallelTokenScale:
    """Make `model` (a transformers causal LM, or its pipeline stage) compute over this rank's chunks of each
    sequence with the other ranks of the 1-D `cp_mesh`; returns the runner's loss scale (as context.py's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    why = hf_context_refusal(model)
    if why:
        raise ValueError(why)
    group, rank, cp = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _mask)
    for module in model.modules():
        _GROUPS[module] = group
    # an architecture written for transformers' eager attention may extend the mask itself with additive terms
    # (DeepSeek-V4 appends its compressed keys' 0 / -inf block bias): its whole-sequence mixers get the mask in that
    # form, as eager would have built it
    additive = model.config.get_text_config()._attn_implementation == "eager"
    for mixer in whole_sequence_mixers(model).values():
        _run_whole(mixer, group, additive)
    model.set_attn_implementation(ATTENTION)
    if model.config.get_text_config()._attn_implementation != ATTENTION:  # transformers only warns when it cannot
        raise ValueError(f"{type(model).__name__}: transformers kept attention implementation "
                         f"{model.config.get_text_config()._attn_implementation!r}; context parallelism needs its "
                         f"own; use cp = 1")

    def whole_sequence(decoder, args, kwargs):
        if kwargs.get("position_ids") is not None or kwargs.get("attention_mask") is not None:
            raise ValueError("context parallelism gives each rank the positions of its chunks itself; packed or "
                             "padded rows (data.packing) need parallel.cp = 1")
        tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
        B, L = tokens.shape[:2]
        positions = local_positions(L * cp, rank, cp, device=tokens.device)
        _QUERIES[:] = [(positions, L * cp)]
        _WHOLE_MASKS.clear()
        ones = torch.ones(B, L * cp, dtype=torch.long, device=tokens.device)
        return args, {**kwargs, "position_ids": positions.expand(B, L), "attention_mask": ones, "use_cache": False}

    model.model.register_forward_pre_hook(whole_sequence, with_kwargs=True)
    return ContextParallelTokenScale(group)


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
          mask_function=None, device=None, **kwargs) -> torch.Tensor | None:
    """transformers' mask-interface signature: the architecture's `mask_function` at this rank's global query
    positions against the whole sequence's keys; None where it is plain causal attention."""
    from transformers.masking_utils import causal_mask_function

    ((q_pos_L, S),) = _QUERIES
    if q_offset or kv_offset or q_length != len(q_pos_L) or kv_length != S:  # (on the host: no device sync)
        raise ValueError("context parallelism splits whole sequences; a KV cache needs parallel.cp = 1")
    mask_function = mask_function or causal_mask_function
    index = lambda n, dim: torch.arange(n, device=device).view([-1 if d == dim else 1 for d in range(4)])
    q_pos = q_pos_L.to(device).view(1, 1, -1, 1)
    seen = mask_function(index(batch_size, 0), index(1, 1), q_pos, index(kv_length, 3))
    if kwargs.get("allow_is_causal_skip", True) and torch.equal(seen, causal_mask_function(0, 0, q_pos,
                                                                                         index(kv_length, 3))):
        return None
    return seen.expand(batch_size, 1, q_length, kv_length)


def _attention(module: nn.Module, q_BHLDk: torch.Tensor, k_BHkLDk: torch.Tensor, v_BHkLDv: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """transformers' attention-function signature (`attention_mask` from `_mask`: None or [B, 1, L, S]);
    returns ([B, L, H, Dv], no weights)."""
    if dropout:
        raise ValueError(f"attention dropout {dropout} under context parallelism; set the architecture's "
                         f"attention_dropout to 0 or use parallel.cp = 1")
    unknown = [k for k in _SCORE_TERMS if kwargs.get(k) is not None]
    if unknown:
        raise ValueError(f"context parallelism: {type(module).__name__} hands the attention {', '.join(unknown)}, "
                         f"which its attention function does not apply; use cp = 1")
    group = _GROUPS[module]
    ((_, S),) = _QUERIES
    bias = kwargs.get("position_bias")  # [.., L, S] added to the scores (Inkling's relative logits)
    if q_BHLDk.shape[2] == S:  # an attention run whole on every rank (_run_whole); its keys may be more (compressed)
        seen = attention_mask
        if seen is not None and seen.dtype != torch.bool:  # eager's additive form (_run_whole's `additive`)
            seen = seen > torch.finfo(seen.dtype).min / 2
        if kwargs.get("indices") is not None:  # a sparse-attention indexer's top-k keys per query [B, S, k]
            seen = _selected(kwargs["indices"], S) & (_causal(S, q_BHLDk.device) if seen is None else seen)
        if softcap is None and s_aux is None and bias is None and seen is not None:
            # SDPA with the mask: no [B, H, S, S] in fp32
            repeat = q_BHLDk.shape[1] // k_BHkLDk.shape[1]
            k, v = (t.repeat_interleave(repeat, dim=1) for t in (k_BHkLDk, v_BHkLDv))
            out_BHLDv = F.scaled_dot_product_attention(q_BHLDk, k, v, attn_mask=seen, scale=scaling)
        else:
            out_BHLDv = _masked_attention(q_BHLDk, k_BHkLDk, v_BHkLDv, None, seen, scaling, softcap, s_aux, bias)
    elif kwargs.get("indices") is not None or bias is not None:
        what = "a sparse-attention indexer's picks" if bias is None else "a position bias"
        raise ValueError(f"context parallelism: {type(module).__name__} hands the attention {what} in a layer "
                         f"whose attention cp splits, which would lose them; use cp = 1")
    elif attention_mask is None and softcap is None and s_aux is None:
        out_BHLDv = context_parallel_attention(q_BHLDk, k_BHkLDk, v_BHkLDv, group, scaling)
    else:
        out_BHLDv = _masked_attention(q_BHLDk, k_BHkLDk, v_BHkLDv, group, attention_mask, scaling, softcap, s_aux)
    return out_BHLDv.transpose(1, 2).contiguous(), None


def _selected(indices_BLk: torch.Tensor, S: int) -> torch.Tensor:
    """[B, 1, L, S] True at each query's selected keys (what transformers' eager path masks the others with)."""
    B, L, _ = indices_BLk.shape
    none = torch.zeros(B, L, S, dtype=torch.bool, device=indices_BLk.device)
    return none.scatter(-1, indices_BLk.long(), True)[:, None]


def _causal(S: int, device) -> torch.Tensor:
    return torch.ones(S, S, dtype=torch.bool, device=device).tril()[None, None]


def _masked_attention(q_BHLDk, k_BHkLDk, v_BHkLDv, group, seen_B1LS, scaling, softcap, sinks_H, bias=None):
    """Attention of this rank's queries over the gathered keys with the mask written out (`seen_B1LS`, or plain
    causal where None), a bias added to the scores (whole sequences only), scores soft-capped, and a per-head sink
    logit in the softmax's denominator (gpt-oss); `group` None: queries and keys are the whole sequence's already.
    The [B, H, L, S] scores are materialised: the exact path, not the fast one."""
    L, Dk = q_BHLDk.shape[2], k_BHkLDk.shape[-1]
    # as the plain path does: the gather's dtype is the same on every rank, whichever path each takes
    q_BHLDk, k_BHkLDk, v_BHkLDv = (autocast_input(t) for t in (q_BHLDk, k_BHkLDk, v_BHkLDv))
    k_BHkSDk, v_BHkSDv = (k_BHkLDk, v_BHkLDv) if group is None else gather_keys_values(k_BHkLDk, v_BHkLDv, group)
    S, repeat = k_BHkSDk.shape[2], q_BHLDk.shape[1] // k_BHkSDk.shape[1]
    k_BHSDk, v_BHSDv = k_BHkSDk.repeat_interleave(repeat, dim=1), v_BHkSDv.repeat_interleave(repeat, dim=1)
    if seen_B1LS is None:
        device = q_BHLDk.device
        q_pos_L1 = (torch.arange(S, device=device) if group is None else
                    local_positions(S, dist.get_rank(group), dist.get_world_size(group), device=device))[:, None]
        seen_B1LS = (torch.arange(S, device=device)[None, :] <= q_pos_L1)[None, None]
    scale = Dk ** -0.5 if scaling is None else scaling
    scores_BHLS = (q_BHLDk @ k_BHSDk.transpose(-1, -2)).float() * scale
    if bias is not None:
        scores_BHLS = scores_BHLS + bias.float()
    if softcap is not None:
        scores_BHLS = softcap * torch.tanh(scores_BHLS / softcap)
    scores_BHLS = scores_BHLS.masked_fill(~seen_B1LS, float("-inf"))
    if sinks_H is None:
        probs_BHLS = scores_BHLS.softmax(dim=-1)
    else:
        B, H = scores_BHLS.shape[:2]
        sinks_BHL1 = sinks_H.float().reshape(1, H, 1, 1).expand(B, H, L, 1)
        logits = torch.cat([scores_BHLS, sinks_BHL1], dim=-1)
        probs_BHLS = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
    return probs_BHLS.to(v_BHSDv.dtype) @ v_BHSDv
