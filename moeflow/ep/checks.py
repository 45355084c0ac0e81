"""moeflow.ep.Buffer's argument checks. Each refusal names the argument, the value it got and what to pass, and comes
before any collective starts: every rank makes the same mistake at once, so each raises instead of leaving its
peers waiting in a collective.

Shape legend: T tokens, K top-k, E experts, D hidden, S fp8 scale columns (D // 128), R ranks, M nodes.
"""

from __future__ import annotations

import os

import torch

from moeflow.ep import counts as L_
from moeflow.ep.fp8 import FP8_BLOCK, check_fp8_hidden
from moeflow.ep.routing import EPHandle, LayoutCounts, NewDispatch

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def split_x(x) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, D] or the fp8 pair (x [T, D], scales [T, S]) -> (x, scales | None), dtypes and shapes checked."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"fp8 x must be a tuple (x_fp8 [T, D], scales [T, D // 128]), got {len(x)} items")
        x_TD, s_TS = x
        if not isinstance(x_TD, torch.Tensor) or x_TD.dtype != torch.float8_e4m3fn or x_TD.dim() != 2:
            raise ValueError(
                f"fp8 x[0] must be a 2-D float8_e4m3fn tensor [T, D], got "
                f"{getattr(x_TD, 'dtype', type(x_TD))} {tuple(getattr(x_TD, 'shape', ()))}; "
                "quantize with moeflow.ep.per_token_cast_to_fp8"
            )
        check_fp8_hidden(x_TD.shape[1])
        want = (x_TD.shape[0], x_TD.shape[1] // FP8_BLOCK)
        if not isinstance(s_TS, torch.Tensor) or s_TS.dtype != torch.float32 or tuple(s_TS.shape) != want:
            raise ValueError(
                f"fp8 scales x[1] must be float32 of shape {want}, got "
                f"{getattr(s_TS, 'dtype', type(s_TS))} {tuple(getattr(s_TS, 'shape', ()))}; "
                "quantize with moeflow.ep.per_token_cast_to_fp8"
            )
        return x_TD, s_TS
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(
            f"x must be a 2-D [T, D] tensor of {[str(d) for d in X_DTYPES]} or an fp8 tuple, got "
            f"{getattr(x, 'dtype', type(x))} of shape {tuple(getattr(x, 'shape', ()))}; reshape to "
            "[-1, hidden]"
        )
    return x, None


def new_dispatch(x, *, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, num_tokens_per_rdma_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, num_experts, num_ranks: int,
                 num_nodes: int) -> NewDispatch:
    """Buffer.dispatch's arguments without a handle, checked; num_experts and is_token_in_rank derived when left out."""
    x_TD, scales_TS = split_x(x)
    if num_experts is None and num_tokens_per_expert is not None:
        num_experts = num_tokens_per_expert.numel()
    T = x_TD.shape[0]
    static = bool(num_worst_tokens) if isinstance(num_worst_tokens, int) else False
    if topk_idx is not None:
        if num_experts is None:
            raise ValueError(
                "dispatch with topk_idx needs num_tokens_per_expert (from get_dispatch_layout) or "
                "num_experts=...; pass one of them"
            )
        check_num_experts(num_experts, num_ranks)
        # The static path trusts the ids (reading them back would be the host sync it exists to avoid), and so
        # does a call given get_dispatch_layout's tensors: that call read these ids already.
        L_.check_topk_idx(topk_idx, num_experts, check_values=not static and is_token_in_rank is None)
        if topk_idx.shape[0] != T:
            raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {T}; they must match")
        check_weights(topk_weights, T, topk_idx.shape[1], "topk_weights")
    elif is_token_in_rank is None:
        raise ValueError("dispatch needs topk_idx or is_token_in_rank (from get_dispatch_layout), or a handle")
    elif topk_weights is not None:
        raise ValueError("topk_weights without topk_idx cannot be mapped to experts; pass topk_idx too")
    elif static:
        raise ValueError("num_worst_tokens > 0 needs topk_idx (padding rows are told apart by their -1 ids); "
                         "pass topk_idx, or num_worst_tokens=0")
    if is_token_in_rank is None:
        is_token_in_rank = L_.token_rank_mask(topk_idx, num_experts, num_ranks)
    elif is_token_in_rank.dtype != torch.bool or tuple(is_token_in_rank.shape) != (T, num_ranks):
        raise ValueError(
            f"is_token_in_rank must be bool of shape {(T, num_ranks)}, got {is_token_in_rank.dtype} "
            f"{tuple(is_token_in_rank.shape)}; take it from get_dispatch_layout"
        )
    _check_sizes(expert_alignment, num_worst_tokens, num_ranks)
    if scales_TS is not None and (x_TD.requires_grad or topk_weights is not None
                                  and topk_weights.requires_grad) and torch.is_grad_enabled():
        raise ValueError("fp8 dispatch is not differentiable; dispatch bf16/fp32 x for training")
    given = _given_counts(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, num_ranks, num_nodes,
                          num_experts if topk_idx is not None else None)
    xs = [x_TD] if scales_TS is None else [x_TD, scales_TS]
    return NewDispatch(xs, topk_idx, topk_weights, is_token_in_rank, num_experts, expert_alignment, num_worst_tokens,
                       given)


def _check_sizes(expert_alignment, num_worst_tokens, num_ranks: int) -> None:
    if not isinstance(expert_alignment, int) or expert_alignment < 1:
        raise ValueError(f"expert_alignment = {expert_alignment!r} must be an int >= 1 (1 = no padding)")
    if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
        raise ValueError(f"num_worst_tokens = {num_worst_tokens!r} must be an int >= 0 (0 = exact size)")
    if num_worst_tokens and num_worst_tokens < num_ranks:
        raise ValueError(f"num_worst_tokens = {num_worst_tokens} must be at least the EP group size "
                         f"({num_ranks}): each peer gets num_worst_tokens // {num_ranks} slots")


def cached_dispatch(x, handle, topk_idx, topk_weights, buffer_id: int) -> list[torch.Tensor]:
    """Buffer.dispatch's arguments with a handle, checked -> xs: [x [T, D]] or [x [T, D], scales [T, S]]."""
    x_TD, scales_TS = split_x(x)
    check_handle(handle, buffer_id, x_TD.shape[1], "dispatch")
    if topk_idx is not None or topk_weights is not None:
        raise ValueError(
            "cached dispatch (handle=...) reuses the handle's routing; do not pass topk_idx or "
            "topk_weights (dispatch without a handle to route anew)"
        )
    if x_TD.shape[0] != handle.num_tokens:
        raise ValueError(f"cached dispatch: x has {x_TD.shape[0]} rows, the handle {handle.num_tokens}")
    return [x_TD] if scales_TS is None else [x_TD, scales_TS]


def combine(x, handle, topk_weights, bias, async_finish: bool, buffer_id: int) -> None:
    """Buffer.combine's arguments, checked."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(
            f"combine x must be a 2-D [N, D] tensor of {[str(d) for d in X_DTYPES]}, got "
            f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}"
        )
    check_handle(handle, buffer_id, x.shape[1], "combine")
    if x.shape[0] != handle.num_rows:
        raise ValueError(
            f"combine x has {x.shape[0]} rows; the dispatch delivered {handle.num_rows} (recv_x's rows)"
        )
    if topk_weights is not None:
        K = topk_weights.shape[-1] if isinstance(topk_weights, torch.Tensor) and topk_weights.dim() == 2 else -1
        check_weights(topk_weights, handle.num_rows, K, "combine topk_weights")
    if bias is not None and async_finish:
        raise ValueError("combine(bias=..., async_finish=True): add the bias after waiting, or pass "
                         "async_finish=False")


def low_latency(where: str, async_finish: bool, return_recv_hook: bool) -> None:
    """The flags of low_latency_dispatch / low_latency_combine (the other arguments: moeflow/ep/low_latency.py)."""
    if async_finish and return_recv_hook:
        raise ValueError(f"{where}: async_finish and return_recv_hook cannot be combined (DeepEP's rule); use one")


def check_handle(handle, buffer_id: int, hidden: int, where: str) -> None:
    if not isinstance(handle, EPHandle):
        raise ValueError(f"{where}: handle must be the EPHandle a dispatch of this Buffer returned")
    if handle.buffer_id != buffer_id:
        raise ValueError(
            f"{where}: the handle comes from another Buffer (id {handle.buffer_id}, this is {buffer_id}); "
            "combine with the Buffer that dispatched"
        )
    if hidden != handle.hidden:
        raise ValueError(
            f"{where}: hidden size {hidden} differs from the dispatched hidden size {handle.hidden}; "
            "a handle is tied to one hidden size, dispatch again for another"
        )


def check_weights(w, T: int, K: int, setting: str) -> None:
    if w is None:
        return
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or tuple(w.shape) != (T, K):
        raise ValueError(
            f"{setting} must be float32 of shape {(T, K)}, got {getattr(w, 'dtype', type(w))} "
            f"{tuple(getattr(w, 'shape', ()))}; pass topk_weights.float() shaped like topk_idx"
        )


def check_num_experts(num_experts, num_ranks: int) -> None:
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % num_ranks:
        R = num_ranks
        raise ValueError(
            f"num_experts = {num_experts} must be a positive multiple of the EP group size {R} (each rank "
            f"keeps num_experts / {R} experts); choose num_experts in {[R * i for i in range(1, 5)]}... "
            f"or an EP size dividing {num_experts}"
        )


def _given_counts(per_rank, per_node, per_expert, num_ranks: int, num_nodes: int,
                  num_experts: int | None) -> LayoutCounts:
    """The layout counts a caller passed (get_dispatch_layout's), checked for shape only: their values are on the
    device."""
    given = {}
    for key, name, t, n in (("per_rank", "num_tokens_per_rank", per_rank, num_ranks),
                            ("per_node", "num_tokens_per_rdma_rank", per_node, num_nodes),
                            ("per_expert", "num_tokens_per_expert", per_expert, num_experts)):
        if t is None or n is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,) or t.dtype.is_floating_point:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be an integer tensor of shape ({n},), got {got}; "
                             "take it from get_dispatch_layout")
        given[key] = t
    return LayoutCounts(given.get("per_rank"), given.get("per_node"), given.get("per_expert"))


def resolve_ranks_per_node(ranks_per_node, global_ranks: list[int]) -> int:
    """Buffer(ranks_per_node=...): as given (it must divide R), or from LOCAL_WORLD_SIZE, or R (one node)."""
    R = len(global_ranks)
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if not env:
            return R
        lws = int(env)
        node_ids = [g // lws for g in global_ranks]
        sizes = [node_ids.count(n) for n in dict.fromkeys(node_ids)]
        contiguous = all(node_ids[i] <= node_ids[i + 1] for i in range(R - 1))
        if len(set(sizes)) != 1 or not contiguous:
            raise ValueError(
                f"the EP group's ranks {global_ranks} do not split into equal contiguous nodes of "
                f"LOCAL_WORLD_SIZE={lws}; pass Buffer(ranks_per_node=...) explicitly"
            )
        return sizes[0]
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or R % ranks_per_node:
        divs = [d for d in range(1, R + 1) if R % d == 0]
        raise ValueError(
            f"ranks_per_node = {ranks_per_node!r} must divide the EP group size {R}; choose one of {divs}"
        )
    return ranks_per_node
