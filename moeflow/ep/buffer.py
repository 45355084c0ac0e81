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

Asynchronous calls (DeepEP's semantics): with async_finish=True dispatch and combine return as soon as the
communication is started; the outputs hold their values after `event.current_stream_wait()` (or `with event:`).
`event.wait(*outputs)` does the same and returns the outputs through an autograd node whose backward starts
the reverse communication early, so backward overlaps as forward does (moeflow/ep/autograd.py).
`previous_event` makes a call wait for an earlier one first. With num_worst_tokens = W > 0 the receive size is
static and dispatch reads nothing back to the host (backends/static.py): no host sync, as CUDA graphs need.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.ep import layout as L_
from moeflow.ep import wire
from moeflow.ep.autograd import Flight, issue
from moeflow.ep.autograd import wait as wait_node
from moeflow.ep.backends import BACKENDS, make_backend
from moeflow.ep.backends.base import Counts, Route, Topology, from_f32
from moeflow.ep.backends.static import StaticBackend
from moeflow.ep.comm import Comm, EPStats, Pending, new_group_in_order
from moeflow.ep.fp8 import FP8_BLOCK, check_fp8_hidden

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BUFFER_IDS = itertools.count()
_SUBGROUPS: dict[tuple, tuple[list, list]] = {}


class EventOverlap:
    """DeepEP's event wrapper: the communication a call started (a Flight), or a CUDA event, or nothing (the
    call finished before returning). Waiting finishes the communication: on a GPU the current stream waits
    for NCCL's (no host sync); on gloo the host waits for the worker thread."""

    def __init__(self, event=None, flight: Flight | None = None):
        self.event, self.flight = event, flight

    def current_stream_wait(self) -> None:
        if self.flight is not None:
            self.flight.wait()
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        """Wait for the communication and for the device (a host sync)."""
        self.current_stream_wait()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()

    def wait(self, *tensors):
        """current_stream_wait(), then return `tensors` (this call's outputs) through an autograd node whose
        backward starts the gradients' communication without waiting (moeflow/ep/autograd.py)."""
        if self.flight is None:
            return tensors
        return wait_node(self.flight, *tensors)

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
    plan: object  # the backend's routing plan (None while the dispatch is in flight)
    pending: Pending | None = None  # the dispatch, while in flight
    static: bool = False  # sent in fixed-size blocks (num_worst_tokens): num_recv is W, no host counts
    dtype: torch.dtype = torch.float32  # of the dispatched x

    @property
    def num_rows(self) -> int:
        """Rows of recv_x (and of combine's input): W when static, else N."""
        return self.num_worst_tokens or self.num_recv

    def ready(self) -> EPHandle:
        """The routing, once the dispatch that made it has arrived (waits for it if still in flight)."""
        if self.pending is not None:
            self.pending.finish()
            self.pending = None
        return self


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


def _given_counts(per_rank, per_node, per_expert, num_ranks: int, num_nodes: int,
                  num_experts: int | None) -> dict:
    """The layout counts a caller passed (get_dispatch_layout's), checked for shape only (their values are on the
    device): {"rank": [R], "node": [M], "expert": [E]}, the missing ones left out."""
    given = {}
    for key, name, t, n in (("rank", "num_tokens_per_rank", per_rank, num_ranks),
                            ("node", "num_tokens_per_rdma_rank", per_node, num_nodes),
                            ("expert", "num_tokens_per_expert", per_expert, num_experts)):
        if t is None or n is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,) or t.dtype.is_floating_point:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be an integer tensor of shape ({n},), got {got}; "
                             "take it from get_dispatch_layout")
        given[key] = t
    return given


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
        self._static = StaticBackend(self.topo)  # the num_worst_tokens path, whatever the backend

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
                    new_group_in_order([global_ranks[m] for m in ms]) if len(ms) > 1 else None
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
        self._static.overflow = None

    def destroy(self) -> None:
        pass

    def clean_low_latency_buffer(self, *args, **kwargs) -> None:
        pass

    # ---- layout -----------------------------------------------------------------------------------
    @property
    def is_external(self) -> bool:
        """Tokens move through the installed deep_ep package (backend 'deep_ep' / 'uccl')."""
        return self._external is not None

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
        ints, each rounded up to expert_alignment; [] when num_worst_tokens > 0, as DeepEP: the counts stay on
        the device), handle, event.
        With `handle` (cached dispatch) the routing is reused: -> (recv_x, None, None, None, None, event).
        `num_experts` is a moeflow extension for callers that pass topk_idx without num_tokens_per_expert.
        allocate_on_comm_stream is accepted for DeepEP's signature (outputs are allocated on the caller's stream).
        """
        if self._external is not None:
            return self._external.dispatch(
                x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                previous_event, async_finish, allocate_on_comm_stream, num_experts=num_experts)
        if previous_event is not None:
            previous_event.current_stream_wait()
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
                outs, flight = self._start_cached([x_TD, scales_TS], handle, "Buffer.dispatch", async_finish)
                return (outs[0], outs[1]), None, None, None, None, EventOverlap(flight=flight)
            (recv_x,), flight = issue(
                lambda x_: self._start_cached([x_], handle, "Buffer.dispatch", async_finish), x_TD)
            return recv_x, None, None, None, None, EventOverlap(flight=flight)

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
            self.check_num_experts(num_experts)
            # The static path trusts the ids (reading them back would be the host sync it exists to avoid), and so
            # does a call given get_dispatch_layout's tensors: that call read these ids already.
            L_.check_topk_idx(topk_idx, num_experts, check_values=not static and is_token_in_rank is None)
            if topk_idx.shape[0] != T:
                raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {T}; they must match")
            _check_weights(topk_weights, T, topk_idx.shape[1], "topk_weights")
        elif is_token_in_rank is None:
            raise ValueError("dispatch needs topk_idx or is_token_in_rank (from get_dispatch_layout), or a handle")
        elif topk_weights is not None:
            raise ValueError("topk_weights without topk_idx cannot be mapped to experts; pass topk_idx too")
        elif static:
            raise ValueError("num_worst_tokens > 0 needs topk_idx (padding rows are told apart by their -1 ids); "
                             "pass topk_idx, or num_worst_tokens=0")
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
        if static and num_worst_tokens < self.group_size:
            raise ValueError(f"num_worst_tokens = {num_worst_tokens} must be at least the EP group size "
                             f"({self.group_size}): each peer gets num_worst_tokens // {self.group_size} slots")
        if scales_TS is not None and (x_TD.requires_grad or topk_weights is not None
                                      and topk_weights.requires_grad) and torch.is_grad_enabled():
            raise ValueError("fp8 dispatch is not differentiable; dispatch bf16/fp32 x for training")

        given = _given_counts(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                              self.group_size, self.num_nodes, num_experts if topk_idx is not None else None)
        args = (topk_idx, is_token_in_rank, num_experts, expert_alignment, num_worst_tokens, async_finish, given)
        if scales_TS is not None:
            (recv_x, recv_s, recv_w), extras, flight = self._start_new([x_TD, scales_TS], topk_weights, *args)
            recv_x = (recv_x, recv_s)
        else:
            box: dict = {}

            def start(x_, w_):
                outs, extras_, flight_ = self._start_new([x_], w_, *args)
                box["extras"] = extras_
                return outs, flight_

            (recv_x, recv_w), flight = issue(start, x_TD, topk_weights)
            extras = box["extras"]
        recv_idx, counts, handle = extras
        return recv_x, recv_idx, recv_w, counts, handle, EventOverlap(flight=flight)

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

    # ---- the internals: start a communication, fill preallocated outputs when it arrives --------------
    def _start_new(self, xs: list[torch.Tensor], topk_weights, topk_idx, mask_TR, num_experts, expert_alignment,
                   num_worst_tokens, async_op, given: dict):
        """Route and start sending -> ([recv xs..., recv_topk_weights], (recv_topk_idx, counts list, handle),
        flight). The outputs are allocated here and filled when the flight finishes."""
        R = self.group_size
        T, W = xs[0].shape[0], num_worst_tokens
        static = W > 0
        payload = list(xs)
        K = 0
        if topk_idx is not None:
            K = topk_idx.shape[1]
            payload.append(topk_idx)
            if topk_weights is not None:
                payload.append(topk_weights)
        specs = [wire.spec_of(t) for t in payload]
        idx_off = wire.row_nbytes(specs[:len(xs)])
        idx_of = (lambda rows_nB: wire.column(rows_nB, idx_off, 8 * K, torch.int64)) if K else None
        self.stats.calls += 1
        counts_list: list[int] = []
        if static:
            rows = W
            backend = self._static
            pending = backend.dispatch(
                wire.pack(payload), backend.plan_slots(mask_TR, W), _padding_row(specs, len(xs), K, xs[0].device),
                lambda rows_nB: (idx_of(rows_nB) >= 0).any(1), W, "Buffer.dispatch", async_op=True)
        else:
            counts = self._exchange_counts(T, mask_TR, topk_idx, num_experts, given)
            recv_per_rank = [sum(counts.to_rank(s, r) for s in range(R)) for r in range(R)]
            rows = recv_per_rank[self.rank]
            mask_from_rows = None
            if K:
                def mask_from_rows(rows_nB):
                    return L_.token_rank_mask(idx_of(rows_nB), num_experts, R)
                Lx = num_experts // R
                lo = self.rank * Lx
                per_expert = [sum(counts.extra(s)[lo + e] for s in range(R)) for e in range(Lx)]
                a = expert_alignment
                counts_list = [(c + a - 1) // a * a for c in per_expert]
            pending = self._backend.dispatch(wire.pack(payload), Route(mask_TR, counts, mask_from_rows),
                                             "Buffer.dispatch", async_op=True)
        dev = xs[0].device
        recv_xs = [x.new_empty((rows, *x.shape[1:])) for x in xs]
        recv_idx = torch.empty((rows, K), dtype=torch.int64, device=dev) if K else None
        recv_w = torch.empty((rows, K), dtype=torch.float32, device=dev) if topk_weights is not None else None
        handle = EPHandle(self._id, xs[0].shape[1], T, rows, W, num_experts or 0, K, mask_TR, recv_idx, None,
                          static=static, dtype=xs[0].dtype)

        def arrived(result):
            recv_rows, plan = result
            recv, n = wire.unpack(recv_rows, specs), recv_rows.shape[0]
            with torch.no_grad():  # filling this call's own outputs
                for out, got in zip(recv_xs, recv):
                    out[:n].copy_(got)
                    out[n:].zero_()
                if K:
                    self._local_ids(recv[len(xs)], num_experts, recv_idx)
                if recv_w is not None:
                    recv_w[:n].copy_(torch.where(recv_idx[:n] >= 0, recv[len(xs) + 1], 0.0))
                    recv_w[n:].zero_()
            handle.plan = plan
            return None  # the outputs are filled; a returned value would stay alive in the Pending until backward

        pending.then(arrived)
        handle.pending = pending
        with_w = recv_w is not None
        flight = Flight(pending, lambda grads, async_op_: self._dispatch_backward(handle, grads, with_w, async_op_),
                        overlap=async_op)
        if not async_op:
            handle.ready()
        return [*recv_xs, recv_w], (recv_idx, counts_list, handle), flight

    @property
    def static_overflow(self) -> torch.Tensor | None:
        """(token, rank) copies the static path could not send (num_worst_tokens too small), on the device;
        read it where the caller syncs anyway. None before any static dispatch."""
        return self._static.overflow

    def _exchange_counts(self, T: int, mask_TR, topk_idx, num_experts, given: dict) -> Counts:
        """Every rank's tokens per destination rank, node and expert (one all_gather). Counts the caller passed
        (get_dispatch_layout's) are sent as they are; the others are counted here."""
        per_rank = given.get("rank")
        per_node = given.get("node")
        # T by a fill on the device, not torch.tensor([T]): a host-to-device copy from pageable memory syncs a GPU
        vec = [mask_TR.new_full((1,), T, dtype=torch.int64), mask_TR.sum(0) if per_rank is None else per_rank,
               L_.node_mask(mask_TR, self.ranks_per_node).sum(0) if per_node is None else per_node]
        if topk_idx is not None:
            per_expert = given.get("expert")
            vec.append(L_.tokens_per_expert(topk_idx, num_experts) if per_expert is None else per_expert)
        vec_C = torch.cat([v.to(torch.int64) for v in vec])
        # host sync: the count exchange; split sizes of the all-to-all must be python ints
        rows = self.topo.main.all_gather(vec_C, "Buffer.dispatch (count exchange)").tolist()
        return Counts(rows, self.group_size, self.num_nodes)

    def _local_ids(self, gidx: torch.Tensor, num_experts: int, out: torch.Tensor) -> None:
        """out[:n] = global expert ids -> this rank's local ids (-1 elsewhere); the padding rows -1."""
        Lx = num_experts // self.group_size
        lo = self.rank * Lx
        local = gidx - lo
        n = gidx.shape[0]
        out[:n].copy_(torch.where((gidx >= lo) & (gidx < lo + Lx), local, torch.full_like(local, -1)))
        out[n:].fill_(-1)

    def _start_cached(self, xs: list[torch.Tensor], handle: EPHandle, op: str, async_op: bool):
        """Send per-token tensors along a handle's routing -> (outputs [rows, ...] filled on arrival, flight)."""
        handle.ready()
        self.stats.calls += 1
        specs = [wire.spec_of(t) for t in xs]
        backend = self._static if handle.static else self._backend
        pending = backend.dispatch_cached(wire.pack(xs), handle.plan, op, async_op=True)
        outs = [x.new_empty((handle.num_rows, *x.shape[1:])) for x in xs]

        def arrived(recv_rows):
            with torch.no_grad():
                for out, got in zip(outs, wire.unpack(recv_rows, specs)):
                    out[:got.shape[0]].copy_(got)
                    out[got.shape[0]:].zero_()
            return None  # (see _start_new's arrived)

        pending.then(arrived)
        flight = Flight(pending, lambda grads, async_op_: self._cached_backward(handle, grads, async_op_),
                        overlap=async_op)
        if not async_op:
            flight.wait()
        return outs, flight

    def _start_reduce(self, vals: list[torch.Tensor], handle: EPHandle, op: str, async_op: bool,
                      outs: list[torch.Tensor] | None = None):
        """Sum the copies of each token back on its source rank (float32 accumulation, caller dtypes)
        -> (outputs [T, ...] filled on arrival, flight)."""
        handle.ready()
        self.stats.calls += 1
        if not handle.static:
            vals = [v[:handle.num_recv] for v in vals]
        specs = [wire.spec_of(v) for v in vals]
        backend = self._static if handle.static else self._backend
        pending = backend.combine(vals, handle.plan, op, async_op=True)
        if outs is None:
            outs = [v.new_empty((handle.num_tokens, *v.shape[1:])) for v in vals]

        def arrived(mat_TC):
            with torch.no_grad():
                for out, got in zip(outs, from_f32(mat_TC, specs)):
                    out.copy_(got)
            return None  # (see _start_new's arrived)

        pending.then(arrived)
        return outs, pending

    def _dispatch_backward(self, handle: EPHandle, grads: list, with_w: bool, async_op: bool):
        """Gradients of (recv_x, recv_w) -> of (x, topk_weights): a combine along the handle."""
        g_x, g_w = grads[0], grads[1] if len(grads) > 1 else None
        if g_x is None:
            g_x = torch.zeros(handle.num_rows, handle.hidden, dtype=handle.dtype, device=handle.is_token_in_rank.device)
        vals = [g_x]
        if with_w:
            g = g_w if g_w is not None else torch.zeros_like(handle.recv_topk_idx, dtype=torch.float32)
            # Entries of experts elsewhere were forwarded as 0, so they carry no gradient.
            vals.append(g.masked_fill(handle.recv_topk_idx < 0, 0.0))
        outs, pending = self._start_reduce(vals, handle, "Buffer.dispatch backward (combine)", async_op)
        result = lambda _: [outs[0], outs[1] if with_w else None]
        pending.then(result)
        return pending if async_op else pending.finish()

    def _cached_backward(self, handle: EPHandle, grads: list, async_op: bool):
        outs, pending = self._start_reduce([grads[0]], handle, "Buffer.dispatch backward (combine)", async_op)
        pending.then(lambda _: [outs[0]])
        return pending if async_op else pending.finish()

    def _combine_backward(self, handle: EPHandle, grads: list, with_w: bool, async_op: bool):
        """Gradients of (combined_x, combined_w) -> of (x, topk_weights): a cached dispatch along the handle."""
        g_x, g_w = grads[0], grads[1] if len(grads) > 1 else None
        vals = [g_x]
        if with_w:
            vals.append(g_w if g_w is not None else g_x.new_zeros(g_x.shape[0], handle.num_topk))
        outs, flight = self._start_cached(vals, handle, "Buffer.combine backward (dispatch)", async_op)
        result = [outs[0], outs[1] if with_w else None]
        if async_op:
            return flight.pending.then(lambda _: result)
        return result

    # ---- combine ----------------------------------------------------------------------------------
    def combine(self, x, handle: EPHandle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """-> combined_x [T, D] (the unweighted sum over the copies of each token, plus bias),
        combined_topk_weights [T, K] | None (the sum of the copies' weights), event."""
        if self._external is not None:
            return self._external.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                          allocate_on_comm_stream)
        if previous_event is not None:
            previous_event.current_stream_wait()
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
        with_w = topk_weights is not None

        def start(x_, w_):
            outs, pending = self._start_reduce([x_] + ([w_] if with_w else []), handle, "Buffer.combine",
                                               async_finish)
            flight = Flight(pending, lambda grads, a: self._combine_backward(handle, grads, with_w, a),
                            overlap=async_finish)
            if not async_finish:
                flight.wait()
            return [outs[0], outs[1] if with_w else None], flight

        (out_x, out_w), flight = issue(start, x, topk_weights)
        if bias is not None:
            if async_finish:
                raise ValueError("combine(bias=..., async_finish=True): add the bias after waiting, or pass "
                                 "async_finish=False")
            for b in bias if isinstance(bias, tuple | list) else (bias,):
                if b is not None:
                    out_x = out_x + b.to(out_x.dtype)
        return out_x, out_w, EventOverlap(flight=flight)

    # ---- low latency --------------------------------------------------------------------------------
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """-> recv_x [L, R * Tm, D] (or the fp8 pair), recv_count [L] int32, handle, event, hook.
        With return_recv_hook the call only starts the sends; calling hook() completes the receive (the
        outputs hold their values after it)."""
        if self._external is not None:
            return self._external.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        from moeflow.ep.low_latency import ll_dispatch

        if async_finish and return_recv_hook:
            raise ValueError("low_latency_dispatch: async_finish and return_recv_hook cannot be combined "
                             "(DeepEP's rule); use one")
        self.check_num_experts(num_experts)
        recv_x, recv_count, handle, pending = ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                          num_experts, use_fp8)
        if cumulative_local_expert_recv_stats is not None:
            stats = cumulative_local_expert_recv_stats

            def count(value):
                stats.add_(recv_count.to(stats.dtype))
                return value

            pending.then(count)
        return self._ll_result((recv_x, recv_count, handle), pending, async_finish, return_recv_hook)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None):
        """-> combined_x [T, D] = sum_k topk_weights[:, k] * expert_k(x), event, hook."""
        if self._external is not None:
            return self._external.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt,
                                                      zero_copy, async_finish, return_recv_hook, out)
        from moeflow.ep.low_latency import ll_combine

        if async_finish and return_recv_hook:
            raise ValueError("low_latency_combine: async_finish and return_recv_hook cannot be combined "
                             "(DeepEP's rule); use one")
        y, pending = ll_combine(self, x, topk_idx, topk_weights, handle, out)
        return self._ll_result((y,), pending, async_finish, return_recv_hook)

    @staticmethod
    def _ll_result(outputs: tuple, pending: Pending, async_finish: bool, return_recv_hook: bool) -> tuple:
        flight = Flight(pending, None, overlap=False)
        if not (async_finish or return_recv_hook):
            flight.wait()
        hook = flight.wait if return_recv_hook else None
        return (*outputs, EventOverlap(flight=flight if async_finish else None), hook)


def _padding_row(specs: list, num_x: int, K: int, device: torch.device) -> torch.Tensor:
    """One packed row of zeros whose topk_idx columns read -1 (how static padding rows are told apart)."""
    row = torch.zeros(wire.row_nbytes(specs), dtype=torch.uint8, device=device)
    off = wire.row_nbytes(specs[:num_x])
    row[off:off + 8 * K] = 255  # int64 -1 is all ones
    return row
