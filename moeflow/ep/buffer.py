"""moeflow.ep.Buffer: DeepEP's V1 Buffer call shapes on any torch.distributed backend.

Shape legend: T tokens, K top-k, E experts, L local experts (E // R), D hidden, S fp8 scale columns
(D // 128), R ranks, M nodes, G ranks per node, N received rows, W num_worst_tokens.

    buffer = Buffer(group)                                  # backend="auto", ranks_per_node=LOCAL_WORLD_SIZE
    n_rank, n_node, n_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=n_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    y, _, _ = buffer.combine(expert_out, handle)             # unweighted sum over the copies of a token

Nothing about one dispatch is kept in `self` (micro-batches may overlap): it lives in the handle.
dispatch and combine are differentiable w.r.t. x and topk_weights; backward of dispatch is a combine,
backward of combine is a cached dispatch, both reusing the handle.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.ep import layout as L_
from moeflow.ep import wire
from moeflow.ep.backends import BACKENDS, make_backend
from moeflow.ep.backends.base import Counts, Route, Topology, from_f32
from moeflow.ep.comm import Comm, EPStats
from moeflow.ep.fp8 import FP8_BLOCK, check_fp8_hidden

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BUFFER_IDS = itertools.count()
_SUBGROUPS: dict[tuple, tuple[list, list]] = {}


class EventOverlap:
    """DeepEP's event wrapper. Collectives here finish before the call returns, so waiting is a no-op."""

    def __init__(self, event=None):
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()


@dataclass
class EPHandle:
    """Everything combine (and a cached dispatch) needs from a dispatch."""

    buffer_id: int
    hidden: int  # D
    num_tokens: int  # T on this rank
    num_recv: int  # N actual received rows
    num_worst_tokens: int  # W (0: the receive size is N)
    num_experts: int
    num_topk: int  # K (0 when dispatched without topk_idx)
    is_token_in_rank: torch.Tensor  # [T, R]
    recv_topk_idx: torch.Tensor | None  # [N or W, K] local expert ids, -1 elsewhere
    plan: object  # the backend's routing plan

    @property
    def num_rows(self) -> int:
        """Rows of recv_x (and of combine's input): W when static, else N."""
        return self.num_worst_tokens or self.num_recv


def _split_x(x):
    """x or (x_fp8, scales) -> (x, scales | None), checking dtypes and ranks."""
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


def _check_weights(w, T: int, K: int, setting: str) -> None:
    if w is None:
        return
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or tuple(w.shape) != (T, K):
        raise ValueError(
            f"{setting} must be float32 of shape {(T, K)}, got {getattr(w, 'dtype', type(w))} "
            f"{tuple(getattr(w, 'shape', ()))}; pass topk_weights.float() shaped like topk_idx"
        )


def _resolve_ranks_per_node(ranks_per_node, global_ranks: list[int]) -> int:
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


class Buffer:
    """Expert-parallel dispatch/combine over a process group, with DeepEP's (V1) Buffer API."""

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, backend: str = "auto", ranks_per_node: int | None = None,
                 timeout_s: float = 300.0):
        from moeflow.errors import check_choice

        check_choice("Buffer(backend=...)", backend, ("auto", *BACKENDS, "deep_ep", "uccl"))
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        if group is None:
            self.rank, global_ranks = 0, [0]
        else:
            self.rank = dist.get_rank(group)
            global_ranks = dist.get_process_group_ranks(group)
        self.group_size = R = len(global_ranks)
        self.ranks_per_node = G = _resolve_ranks_per_node(ranks_per_node, global_ranks)
        self.num_nodes = R // G
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.num_qps_per_rank = low_latency_mode, num_qps_per_rank
        self.timeout_s = timeout_s
        self.stats = EPStats()
        self._id = next(_BUFFER_IDS)
        self._external = None
        if backend in ("deep_ep", "uccl"):
            from moeflow.ep.backends.external import make_external

            self._external = make_external(backend, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
                                           num_qps_per_rank)
        if backend == "auto":
            backend = "hierarchical" if self.num_nodes > 1 else "alltoall"
        self.backend_name = backend
        node_of = [r // G for r in range(R)]
        main = Comm(group, list(range(R)), self.rank, node_of, timeout_s, self.stats)
        self.topo = Topology(R, G, self.rank, main)
        if backend == "hierarchical":
            self.topo.inter, self.topo.intra = self._subgroup_comms(global_ranks, node_of)
        self._backend = make_backend(backend, self.topo) if self._external is None else None

    def _subgroup_comms(self, global_ranks: list[int], node_of: list[int]) -> tuple[Comm, Comm]:
        """Comms over the ranks sharing our local rank (one per node) and over our node.

        dist.new_group is collective over the whole default group, so every rank builds every subgroup
        in the same order (cached per group and ranks_per_node, so later Buffers build none).
        """
        R, G, M = self.group_size, self.ranks_per_node, self.num_nodes
        inter_members = [[n * G + j for n in range(M)] for j in range(G)]
        intra_members = [[n * G + j for j in range(G)] for n in range(M)]
        key = (tuple(global_ranks), G)
        if key not in _SUBGROUPS and R > 1:
            def build(members_list):
                return [
                    dist.new_group([global_ranks[m] for m in ms], sort_ranks=False) if len(ms) > 1 else None
                    for ms in members_list
                ]
            _SUBGROUPS[key] = (build(inter_members), build(intra_members))
        inter_groups, intra_groups = _SUBGROUPS.get(key, ([None] * G, [None] * M))
        node, local = self.rank // G, self.rank % G
        return (
            Comm(inter_groups[local], inter_members[local], self.rank, node_of, self.timeout_s, self.stats),
            Comm(intra_groups[node], intra_members[node], self.rank, node_of, self.timeout_s, self.stats),
        )

    # ---- DeepEP's static helpers (sizes do not matter here: buffers are allocated per call) ----------
    @staticmethod
    def get_dispatch_config(num_ranks: int):
        return None

    @staticmethod
    def get_combine_config(num_ranks: int):
        return None

    @staticmethod
    def set_num_sms(num_sms: int) -> None:
        pass

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of the fixed receive slots of one low-latency dispatch (bf16 rows)."""
        return num_experts * num_max_dispatch_tokens_per_rank * hidden * 2

    def reset_stats(self) -> None:
        for name in EPStats.__dataclass_fields__:
            setattr(self.stats, name, 0)

    def destroy(self) -> None:
        pass

    def clean_low_latency_buffer(self, *args, **kwargs) -> None:
        pass

    # ---- layout -----------------------------------------------------------------------------------
    def check_num_experts(self, num_experts: int) -> None:
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % self.group_size:
            R = self.group_size
            raise ValueError(
                f"num_experts = {num_experts} must be a positive multiple of the EP group size {R} (each rank "
                f"keeps num_experts / {R} experts); choose num_experts in {[R * i for i in range(1, 5)]}... "
                f"or an EP size dividing {num_experts}"
            )

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """-> num_tokens_per_rank [R], num_tokens_per_rdma_rank [M] | None, num_tokens_per_expert [E],
        is_token_in_rank [T, R], event. Local only (no communication)."""
        if self._external is not None:
            return self._external.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                                      allocate_on_comm_stream)
        self.check_num_experts(num_experts)
        L_.check_topk_idx(topk_idx, num_experts)
        lay = L_.get_dispatch_layout(topk_idx, num_experts, self.group_size, self.ranks_per_node)
        return (*lay, EventOverlap())

    # ---- dispatch ---------------------------------------------------------------------------------
    def dispatch(self, x, handle: EPHandle | None = None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, num_experts: int | None = None):
        """Send each token once to every rank owning one of its experts.

        -> recv_x ([N or W, D], or the fp8 pair), recv_topk_idx [N or W, K] (local ids, -1 elsewhere and on
        padding rows), recv_topk_weights (0 where the id is -1), num_recv_tokens_per_expert_list (python
        ints, each rounded up to expert_alignment), handle, event.
        With `handle` (cached dispatch) the routing is reused: -> (recv_x, None, None, None, None, event).
        `num_experts` is a moeflow extension for callers that pass topk_idx without num_tokens_per_expert.
        """
        if self._external is not None:
            return self._external.dispatch(
                x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                previous_event, async_finish, allocate_on_comm_stream, num_experts=num_experts)
        x_TD, scales_TS = _split_x(x)
        if handle is not None:
            self._check_handle(handle, x_TD.shape[1], "dispatch")
            if topk_idx is not None or topk_weights is not None:
                raise ValueError(
                    "cached dispatch (handle=...) reuses the handle's routing; do not pass topk_idx or "
                    "topk_weights (dispatch without a handle to route anew)"
                )
            if x_TD.shape[0] != handle.num_tokens:
                raise ValueError(f"cached dispatch: x has {x_TD.shape[0]} rows, the handle {handle.num_tokens}")
            if scales_TS is not None:
                recv = self._send_cached([x_TD, scales_TS], handle, "Buffer.dispatch")
                return (recv[0], recv[1]), None, None, None, None, EventOverlap()
            recv_x = _Dispatch.apply(self, handle, {}, x_TD, None)[0]
            return recv_x, None, None, None, None, EventOverlap()

        if num_experts is None and num_tokens_per_expert is not None:
            num_experts = num_tokens_per_expert.numel()
        T = x_TD.shape[0]
        if topk_idx is not None:
            if num_experts is None:
                raise ValueError(
                    "dispatch with topk_idx needs num_tokens_per_expert (from get_dispatch_layout) or "
                    "num_experts=...; pass one of them"
                )
            self.check_num_experts(num_experts)
            L_.check_topk_idx(topk_idx, num_experts)
            if topk_idx.shape[0] != T:
                raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {T}; they must match")
            _check_weights(topk_weights, T, topk_idx.shape[1], "topk_weights")
        elif is_token_in_rank is None:
            raise ValueError("dispatch needs topk_idx or is_token_in_rank (from get_dispatch_layout), or a handle")
        elif topk_weights is not None:
            raise ValueError("topk_weights without topk_idx cannot be mapped to experts; pass topk_idx too")
        if is_token_in_rank is None:
            is_token_in_rank = L_.token_rank_mask(topk_idx, num_experts, self.group_size)
        elif (is_token_in_rank.dtype != torch.bool
              or tuple(is_token_in_rank.shape) != (T, self.group_size)):
            raise ValueError(
                f"is_token_in_rank must be bool of shape {(T, self.group_size)}, got {is_token_in_rank.dtype} "
                f"{tuple(is_token_in_rank.shape)}; take it from get_dispatch_layout"
            )
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"expert_alignment = {expert_alignment!r} must be an int >= 1 (1 = no padding)")
        if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens = {num_worst_tokens!r} must be an int >= 0 (0 = exact size)")
        if scales_TS is not None and (x_TD.requires_grad or topk_weights is not None
                                      and topk_weights.requires_grad) and torch.is_grad_enabled():
            raise ValueError("fp8 dispatch is not differentiable; dispatch bf16/fp32 x for training")

        args = (topk_idx, is_token_in_rank, num_experts, expert_alignment, num_worst_tokens)
        if scales_TS is not None:
            out = self._dispatch_new([x_TD, scales_TS], topk_weights, *args)
            (recv_x, recv_s), recv_w, extras = out
            recv_x = (recv_x, recv_s)
        else:
            box: dict = {}
            recv_x, recv_w = _Dispatch.apply(self, args, box, x_TD, topk_weights)
            extras = box["extras"]
        recv_idx, counts, handle = extras
        return recv_x, recv_idx, recv_w, counts, handle, EventOverlap()

    def _check_handle(self, handle, hidden: int, where: str) -> None:
        if not isinstance(handle, EPHandle):
            raise ValueError(f"{where}: handle must be the EPHandle a dispatch of this Buffer returned")
        if handle.buffer_id != self._id:
            raise ValueError(
                f"{where}: the handle comes from another Buffer (id {handle.buffer_id}, this is {self._id}); "
                "combine with the Buffer that dispatched"
            )
        if hidden != handle.hidden:
            raise ValueError(
                f"{where}: hidden size {hidden} differs from the dispatched hidden size {handle.hidden}; "
                "a handle is tied to one hidden size, dispatch again for another"
            )

    def _dispatch_new(self, xs: list[torch.Tensor], topk_weights, topk_idx, mask_TR, num_experts,
                      expert_alignment, num_worst_tokens):
        """Route and send; -> (recv xs, recv_topk_weights, (recv_topk_idx, counts list, handle))."""
        topo, R, G = self.topo, self.group_size, self.ranks_per_node
        T = xs[0].shape[0]
        dev = mask_TR.device
        vec = [torch.tensor([T], device=dev), mask_TR.sum(0), L_.node_mask(mask_TR, G).sum(0)]
        if topk_idx is not None:
            # -1 entries count in a last bin that is dropped (no boolean indexing: no sync on GPUs)
            key = torch.where(topk_idx >= 0, topk_idx, num_experts).reshape(-1)
            vec.append(torch.bincount(key, minlength=num_experts + 1)[:num_experts])
        vec_C = torch.cat([v.to(torch.int64) for v in vec])
        # host sync: the count exchange; split sizes of the all-to-all must be python ints
        rows = topo.main.all_gather(vec_C, "Buffer.dispatch (count exchange)").tolist()
        counts = Counts(rows, R, self.num_nodes)
        recv_per_rank = [sum(counts.to_rank(s, r) for s in range(R)) for r in range(R)]
        if num_worst_tokens and max(recv_per_rank) > num_worst_tokens:
            # Every rank sees every count, so all ranks raise together and none waits in the next collective.
            worst = max(recv_per_rank)
            raise ValueError(
                f"num_worst_tokens = {num_worst_tokens} is too small: rank {recv_per_rank.index(worst)} would "
                f"receive {worst} rows (this rank {recv_per_rank[self.rank]}); raise num_worst_tokens to at "
                f"least {worst} (the safe bound is the sum of all ranks' token counts)"
            )
        payload = list(xs)
        K = 0
        if topk_idx is not None:
            K = topk_idx.shape[1]
            payload.append(topk_idx)
            if topk_weights is not None:
                payload.append(topk_weights)
        specs = [wire.spec_of(t) for t in payload]
        mask_from_rows = None
        if topk_idx is not None:
            idx_off = wire.row_nbytes(specs[:len(xs)])

            def mask_from_rows(rows_nB):
                idx = wire.column(rows_nB, idx_off, 8 * K, torch.int64)
                return L_.token_rank_mask(idx, num_experts, R)

        self.stats.calls += 1
        recv_rows, plan = self._backend.dispatch(
            wire.pack(payload), Route(mask_TR, counts, mask_from_rows), "Buffer.dispatch"
        )
        recv = wire.unpack(recv_rows, specs)
        N = recv_rows.shape[0]
        W = num_worst_tokens
        recv_idx = recv_w = None
        counts_list: list[int] = []
        if topk_idx is not None:
            Lx = num_experts // R
            lo = self.rank * Lx
            gidx = recv[len(xs)]
            local = gidx - lo
            recv_idx = torch.where((gidx >= lo) & (gidx < lo + Lx), local, torch.full_like(local, -1))
            if topk_weights is not None:
                recv_w = torch.where(recv_idx >= 0, recv[len(xs) + 1], torch.zeros_like(recv[len(xs) + 1]))
            per_expert = [sum(counts.extra(s)[lo + e] for s in range(R)) for e in range(Lx)]
            a = expert_alignment
            counts_list = [(c + a - 1) // a * a for c in per_expert]
            if W:
                recv_idx = torch.cat([recv_idx, recv_idx.new_full((W - N, K), -1)])
                if recv_w is not None:
                    recv_w = torch.cat([recv_w, recv_w.new_zeros(W - N, K)])
        recv_xs = recv[:len(xs)]
        if W:
            recv_xs = [torch.cat([r, r.new_zeros((W - N, *r.shape[1:]))]) for r in recv_xs]
        handle = EPHandle(self._id, xs[0].shape[1], T, N, W, num_experts or 0, K, mask_TR, recv_idx, plan)
        return recv_xs, recv_w, (recv_idx, counts_list, handle)

    def _send_cached(self, xs: list[torch.Tensor], handle: EPHandle, op: str) -> list[torch.Tensor]:
        """Dispatch per-token tensors along a handle's routing; padded to W rows when static."""
        self.stats.calls += 1
        specs = [wire.spec_of(t) for t in xs]
        recv = wire.unpack(self._backend.dispatch_cached(wire.pack(xs), handle.plan, op), specs)
        if handle.num_worst_tokens:
            pad = handle.num_worst_tokens - handle.num_recv
            recv = [torch.cat([r, r.new_zeros((pad, *r.shape[1:]))]) for r in recv]
        return recv

    def _reduce(self, vals: list[torch.Tensor], handle: EPHandle, op: str) -> list[torch.Tensor]:
        """Sum the copies of each token back on its source rank (float32 accumulation, caller dtypes)."""
        self.stats.calls += 1
        vals = [v[:handle.num_recv] for v in vals]
        specs = [wire.spec_of(v) for v in vals]
        return from_f32(self._backend.combine(vals, handle.plan, op), specs)

    # ---- combine ----------------------------------------------------------------------------------
    def combine(self, x, handle: EPHandle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """-> combined_x [T, D] (the unweighted sum over the copies of each token, plus bias),
        combined_topk_weights [T, K] | None (the sum of the copies' weights), event."""
        if self._external is not None:
            return self._external.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                          allocate_on_comm_stream)
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in X_DTYPES:
            raise ValueError(
                f"combine x must be a 2-D [N, D] tensor of {[str(d) for d in X_DTYPES]}, got "
                f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}"
            )
        self._check_handle(handle, x.shape[1], "combine")
        if x.shape[0] != handle.num_rows:
            raise ValueError(
                f"combine x has {x.shape[0]} rows; the dispatch delivered {handle.num_rows} (recv_x's rows)"
            )
        if topk_weights is not None:
            K = topk_weights.shape[-1] if isinstance(topk_weights, torch.Tensor) and topk_weights.dim() == 2 else -1
            _check_weights(topk_weights, handle.num_rows, K, "combine topk_weights")
        out_x, out_w = _Combine.apply(self, handle, x, topk_weights)
        if bias is not None:
            for b in bias if isinstance(bias, tuple | list) else (bias,):
                if b is not None:
                    out_x = out_x + b.to(out_x.dtype)
        return out_x, out_w, EventOverlap()

    # ---- low latency --------------------------------------------------------------------------------
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """-> recv_x [L, R * Tm, D] (or the fp8 pair), recv_count [L] int32, handle, event, hook."""
        if self._external is not None:
            return self._external.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        from moeflow.ep.low_latency import ll_dispatch

        self.check_num_experts(num_experts)
        recv_x, recv_count, handle = ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                 num_experts, use_fp8)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += recv_count.to(cumulative_local_expert_recv_stats.dtype)
        return recv_x, recv_count, handle, EventOverlap(), (lambda: None) if return_recv_hook else None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None):
        """-> combined_x [T, D] = sum_k topk_weights[:, k] * expert_k(x), event, hook."""
        if self._external is not None:
            return self._external.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt,
                                                      zero_copy, async_finish, return_recv_hook, out)
        from moeflow.ep.low_latency import ll_combine

        y = ll_combine(self, x, topk_idx, topk_weights, handle)
        if out is not None:
            out.copy_(y)
            y = out
        return y, EventOverlap(), (lambda: None) if return_recv_hook else None


class _Dispatch(torch.autograd.Function):
    """recv_x, recv_topk_weights = dispatch(x, topk_weights); backward = combine along the same handle.

    `how` is a handle (cached dispatch of x) or the routing arguments of a new dispatch; the non-tensor
    results (recv_topk_idx, counts, handle) are returned through `box`.
    """

    @staticmethod
    def forward(ctx, buffer: Buffer, how, box: dict, x_TD, topk_weights_TK):
        if isinstance(how, EPHandle):
            handle, recv_w = how, None
            recv_x = buffer._send_cached([x_TD], handle, "Buffer.dispatch")[0]
        else:
            (recv_x,), recv_w, extras = buffer._dispatch_new([x_TD], topk_weights_TK, *how)
            box["extras"], handle = extras, extras[2]
        ctx.buffer, ctx.handle, ctx.has_w, ctx.x_dtype = buffer, handle, recv_w is not None, x_TD.dtype
        ctx.device = x_TD.device
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, g_recv_x, g_recv_w):
        handle = ctx.handle
        if g_recv_x is None:
            g_recv_x = torch.zeros(handle.num_rows, handle.hidden, dtype=ctx.x_dtype, device=ctx.device)
        vals = [g_recv_x]
        if ctx.has_w:
            g = g_recv_w if g_recv_w is not None else torch.zeros_like(handle.recv_topk_idx, dtype=torch.float32)
            # Entries of experts elsewhere were forwarded as 0, so they carry no gradient.
            vals.append(g.masked_fill(handle.recv_topk_idx < 0, 0.0))
        out = ctx.buffer._reduce(vals, handle, "Buffer.dispatch backward (combine)")
        return None, None, None, out[0], (out[1] if ctx.has_w else None)


class _Combine(torch.autograd.Function):
    """combined_x, combined_w = combine(x, topk_weights); backward = a cached dispatch of the gradients."""

    @staticmethod
    def forward(ctx, buffer: Buffer, handle: EPHandle, x_ND, w_NK):
        vals = [x_ND] + ([w_NK] if w_NK is not None else [])
        out = buffer._reduce(vals, handle, "Buffer.combine")
        ctx.buffer, ctx.handle, ctx.has_w = buffer, handle, w_NK is not None
        return out[0], (out[1] if w_NK is not None else None)

    @staticmethod
    def backward(ctx, g_x_TD, g_w_TK):
        vals = [g_x_TD]
        if ctx.has_w:
            vals.append(g_w_TK if g_w_TK is not None else g_x_TD.new_zeros(g_x_TD.shape[0], ctx.handle.num_topk))
        out = ctx.buffer._send_cached(vals, ctx.handle, "Buffer.combine backward (dispatch)")
        return None, None, out[0], (out[1] if ctx.has_w else None)
