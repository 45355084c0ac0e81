"""moeflow.ep.Buffer: DeepEP's V1 Buffer call shapes on any torch.distributed backend.

Shape legend: T tokens, K top-k, E experts, L local experts (E // R), D hidden, S fp8 scale columns
(D // 128), R ranks, M nodes, G ranks per node, N received rows, W num_worst_tokens, Tm
num_max_dispatch_tokens_per_rank.

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
static and dispatch reads nothing back to the host (moeflow/ep/routing.py): no host sync, as CUDA graphs need.

The pieces: argument checks in checks.py, the two routing paths in routing.py, moving rows and their gradients in
transfer.py, the in-flight type in inflight.py.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from moeflow.core.choices import EP_BACKENDS, EP_LIBRARIES
from moeflow.ep import checks, transfer
from moeflow.ep import counts as L_
from moeflow.ep.backends import make_backend
from moeflow.ep.backends.base import Topology
from moeflow.ep.backends.static import StaticBackend
from moeflow.ep.comm import Comm, EPStats, node_comms
from moeflow.ep.event import EventOverlap
from moeflow.ep.low_latency import LowLatencyHandle, ll_combine, ll_dispatch, ll_finish
from moeflow.ep.routing import EPHandle, exact_routing, static_routing

_BUFFER_IDS = itertools.count()

XOrFp8 = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # x [T, D], or the fp8 pair (x [T, D], scales [T, S])


class Buffer:
    """Expert-parallel dispatch/combine over a process group, with DeepEP's (V1) Buffer API."""

    def __init__(self, group: dist.ProcessGroup | None = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, backend: str = "auto", ranks_per_node: int | None = None,
                 timeout_s: float = 300.0) -> None:
        """
        Arguments:
            group: the EP process group; None: the default group if one is initialised, else one process.
            num_nvl_bytes: the library Buffer's NVLink bytes (backend 'deep_ep' / 'uccl'; 0 with num_rdma_bytes 0:
                sized from the library's hints and shared per group); moeflow's own backends allocate per call.
            num_rdma_bytes: the library Buffer's RDMA bytes (likewise).
            low_latency_mode: passed to the library's Buffer ('deep_ep' / 'uccl'); kept as an attribute otherwise.
            num_qps_per_rank: passed to the library's Buffer ('deep_ep' / 'uccl').
            allow_nvlink_for_low_latency_mode: accepted for DeepEP's signature (ignored).
            allow_mnnvl: accepted for DeepEP's signature (ignored).
            explicitly_destroy: accepted for DeepEP's signature (ignored: destroy() has nothing to free).
            backend: 'auto' ('hierarchical' over several nodes, else 'alltoall'), 'alltoall', 'hierarchical',
                'allgather', or 'deep_ep' / 'uccl' (the installed library, moeflow/ep/backends/external.py).
            ranks_per_node: G, dividing the group size; None: from LOCAL_WORLD_SIZE, or the whole group as one node.
            timeout_s: how long a collective may wait for its peers before a TimeoutError names the call.
        """
        from moeflow.core.errors import check_choice

        check_choice("Buffer(backend=...)", backend, EP_BACKENDS)
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        if group is None:
            self.rank, global_ranks = 0, [0]
        else:
            self.rank = dist.get_rank(group)
            global_ranks = dist.get_process_group_ranks(group)
        self.group_size = R = len(global_ranks)
        self.ranks_per_node = G = checks.resolve_ranks_per_node(ranks_per_node, global_ranks)
        self.num_nodes = R // G
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.num_qps_per_rank = low_latency_mode, num_qps_per_rank
        self.timeout_s = timeout_s
        self.stats = EPStats()
        self._id = next(_BUFFER_IDS)
        self._external = None
        if backend in EP_LIBRARIES:
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
            self.topo.inter, self.topo.intra = node_comms(global_ranks, G, self.rank, timeout_s, self.stats)
        self._backend = make_backend(backend, self.topo) if self._external is None else None
        self._static = StaticBackend(self.topo)  # the num_worst_tokens path, whatever the backend

    # ---- DeepEP's static helpers (sizes do not matter here: buffers are allocated per call) ----------
    @staticmethod
    def get_dispatch_config(num_ranks: int) -> None:
        """DeepEP's tuning config for dispatch; moeflow's dispatch takes any `config` and ignores it.

        Arguments:
            num_ranks: R.

        Returns:
            None.
        """
        return None

    @staticmethod
    def get_combine_config(num_ranks: int) -> None:
        """DeepEP's tuning config for combine; moeflow's combine takes any `config` and ignores it.

        Arguments:
            num_ranks: R.

        Returns:
            None.
        """
        return None

    @staticmethod
    def set_num_sms(num_sms: int) -> None:
        """Accepted for DeepEP's API (moeflow launches no kernels of its own).

        Arguments:
            num_sms: ignored.
        """

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """The size of one low-latency dispatch's receive slots.

        Arguments:
            num_max_dispatch_tokens_per_rank: Tm.
            hidden: D.
            num_ranks: R (the slots are per expert, so it does not enter).
            num_experts: E.

        Returns:
            E * Tm * D * 2 bytes (bf16 rows).
        """
        return num_experts * num_max_dispatch_tokens_per_rank * hidden * 2

    def reset_stats(self) -> None:
        """Zero `self.stats` (the byte and call counters) and `static_overflow`."""
        for name in EPStats.__dataclass_fields__:
            setattr(self.stats, name, 0)
        self._static.overflow = None

    def destroy(self) -> None:
        """Accepted for DeepEP's API: nothing is held between calls."""

    def clean_low_latency_buffer(self, *args: object, **kwargs: object) -> None:
        """Accepted for DeepEP's API, with any arguments: low-latency receive slots are allocated per call."""

    # ---- layout -----------------------------------------------------------------------------------
    @property
    def is_external(self) -> bool:
        """Tokens move through the installed deep_ep package (backend 'deep_ep' / 'uccl')."""
        return self._external is not None

    def check_num_experts(self, num_experts: int) -> None:
        """Refuse an expert count the group cannot split (each rank keeps E // R experts).

        Arguments:
            num_experts: E; ValueError unless a positive multiple of R.
        """
        checks.check_num_experts(num_experts, self.group_size)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple[
            torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """The layout dispatch needs, computed locally (no communication).

        Arguments:
            topk_idx: `[T, K]` with `torch.int64`, each token's experts, -1 for none; ids in [-1, E) (checked: a host
                sync).
            num_experts: E, a multiple of the group size.
            previous_event: accepted for DeepEP's signature (the call is local, so there is nothing to order).
            async_finish: accepted for DeepEP's signature (the call is complete when it returns).
            allocate_on_comm_stream: accepted for DeepEP's signature (outputs live on the caller's stream).

        Returns:
            num_tokens_per_rank: `[R]` with `torch.int32`, tokens with at least one expert on each rank.
            num_tokens_per_rdma_rank: `[M]` with `torch.int32`, the same per node; None on one node.
            num_tokens_per_expert: `[E]` with `torch.int32`, tokens per expert (-1 entries not counted).
            is_token_in_rank: `[T, R]` with `torch.bool`, whether a token goes to a rank.
            event: an empty EventOverlap.
        """
        if self._external is not None:
            return self._external.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                                      allocate_on_comm_stream)
        self.check_num_experts(num_experts)
        L_.check_topk_idx(topk_idx, num_experts)
        lay = L_.get_dispatch_layout(topk_idx, num_experts, self.group_size, self.ranks_per_node)
        return (*lay, EventOverlap())

    # ---- dispatch ---------------------------------------------------------------------------------
    def dispatch(self, x: XOrFp8, handle: EPHandle | None = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: object = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, num_experts: int | None = None) -> tuple[
            XOrFp8, torch.Tensor | None, torch.Tensor | None, list[int] | None, EPHandle | None, EventOverlap]:
        """Send each token once to every rank owning one of its experts; received rows are in (source rank,
        token) order. Differentiable w.r.t. x and topk_weights (backward is a combine along the handle).

        Arguments:
            x: `[T, D]` with `torch.float32`, `torch.bfloat16` or `torch.float16`; or the fp8 pair (`[T, D]` with
                `torch.float8_e4m3fn`, `[T, S]` with `torch.float32`, D % 128 == 0), not differentiable.
            handle: a handle an earlier dispatch of this Buffer returned: reuse its routing (a cached dispatch; x must
                have its T and D, and no topk_idx / topk_weights / layout is passed).
            num_tokens_per_rank: `[R]` with an integer dtype, get_dispatch_layout's (sent as given, not recounted);
                None: counted here.
            num_tokens_per_rdma_rank: `[M]` with an integer dtype, get_dispatch_layout's; None: counted here.
            is_token_in_rank: `[T, R]` with `torch.bool`, get_dispatch_layout's (then topk_idx's values are not
                checked again); None: derived from topk_idx. Needed without topk_idx.
            num_tokens_per_expert: `[E]` with an integer dtype, get_dispatch_layout's; its length gives E.
            topk_idx: `[T, K]` with `torch.int64`, global expert ids, -1 for none.
            topk_weights: `[T, K]` with `torch.float32`, the weights to send along (needs topk_idx).
            expert_alignment: round each local expert's count in num_recv_tokens_per_expert_list up to a multiple.
            num_worst_tokens: W > 0: receive exactly W rows (padding after the real ones), each peer sending at most
                W // R (W >= R); copies beyond are dropped and counted in `static_overflow`; no host sync. Needs
                topk_idx. 0: receive exactly N rows.
            config: accepted for DeepEP's signature (ignored).
            previous_event: wait for this event first.
            async_finish: return before the rows arrive; the outputs hold their values after waiting on `event`.
            allocate_on_comm_stream: accepted for DeepEP's signature (outputs live on the caller's stream).
            num_experts: E (moeflow's extension), for callers passing topk_idx without num_tokens_per_expert.

        Returns:
            recv_x: `[N or W, D]` with x's dtype, or the fp8 pair (`[N or W, D]`, `[N or W, S]`); padding rows 0.
            recv_topk_idx: `[N or W, K]` with `torch.int64`, local expert ids (0..L-1), -1 for experts on other ranks
                and on padding rows; None without topk_idx or with a handle.
            recv_topk_weights: `[N or W, K]` with `torch.float32`, 0 where recv_topk_idx is -1; None without
                topk_weights or with a handle.
            num_recv_tokens_per_expert_list: python ints `[L]`, rows per local expert rounded up to expert_alignment;
                [] without topk_idx or with num_worst_tokens > 0 (the counts stay on the device, as DeepEP's); None
                with a handle.
            handle: the EPHandle for combine and cached dispatches; None with a handle.
            event: an EventOverlap to wait on (empty unless async_finish).
        """
        if self._external is not None:
            return self._external.dispatch(
                x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                previous_event, async_finish, allocate_on_comm_stream, num_experts=num_experts)
        if previous_event is not None:
            previous_event.current_stream_wait()
        if handle is not None:
            xs = checks.cached_dispatch(x, handle, topk_idx, topk_weights, self._id)
            return transfer.dispatch_cached(xs, handle, async_finish, self.stats)
        args = checks.new_dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, is_token_in_rank=is_token_in_rank,
            num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            num_tokens_per_expert=num_tokens_per_expert, expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens, num_experts=num_experts, num_ranks=self.group_size,
            num_nodes=self.num_nodes)
        if args.num_worst_tokens:
            routing = static_routing(self._static, args)
        else:
            routing = exact_routing(self._backend, args)
        return transfer.dispatch_new(args, routing, self._id, async_finish, self.stats)

    @property
    def static_overflow(self) -> torch.Tensor | None:
        """(token, rank) copies the static path could not send (num_worst_tokens too small) since reset_stats().

        Returns:
            a 0-d `torch.int64` tensor on the device (read it where the caller syncs anyway); None before any static
            dispatch.
        """
        return self._static.overflow

    # ---- combine ----------------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None, config: object = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Sum each token's copies back on its source rank (without weights, as DeepEP's), in float32.
        Differentiable w.r.t. x, topk_weights and bias (backward is a cached dispatch).

        Arguments:
            x: `[N or W, D]` (recv_x's rows, in its order) with `torch.float32`, `torch.bfloat16` or `torch.float16`.
            handle: the EPHandle the dispatch returned (D must match).
            topk_weights: `[N or W, K]` with `torch.float32`, summed over the copies like x; or None.
            bias: `[T, D]` tensor(s), one or a tuple (None entries skipped), added to the result in x's dtype; not
                with async_finish.
            config: accepted for DeepEP's signature (ignored).
            previous_event: wait for this event first.
            async_finish: return before the rows arrive; the outputs hold their values after waiting on `event`.
            allocate_on_comm_stream: accepted for DeepEP's signature (outputs live on the caller's stream).

        Returns:
            combined_x: `[T, D]` with x's dtype, the sum over the token's copies (plus bias).
            combined_topk_weights: `[T, K]` with `torch.float32`, the sum of the copies' weights; None without
                topk_weights.
            event: an EventOverlap to wait on (empty unless async_finish).
        """
        if self._external is not None:
            return self._external.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                          allocate_on_comm_stream)
        if previous_event is not None:
            previous_event.current_stream_wait()
        checks.combine(x, handle, topk_weights, bias, async_finish, self._id)
        return transfer.combine(x, topk_weights, bias, handle, async_finish, self.stats)

    # ---- low latency --------------------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> tuple[XOrFp8, torch.Tensor, LowLatencyHandle,
                                                                      EventOverlap, object]:
        """Send one copy per (token, expert) into fixed per-expert slots: no count reaches the host. Not
        differentiable (inference).

        Arguments:
            x: `[T, D]` floating point, T <= Tm (D % 128 == 0 with use_fp8).
            topk_idx: `[T, K]` with `torch.int64`, global expert ids, -1 for none; an expert at most once per token.
            num_max_dispatch_tokens_per_rank: Tm, the same on every rank.
            num_experts: E, a multiple of the group size.
            cumulative_local_expert_recv_stats: `[L]` integer tensor; recv_count is added to it on arrival.
            dispatch_wait_recv_cost_stats: accepted for DeepEP's signature (ignored).
            use_fp8: send x cast to fp8 (moeflow.ep.per_token_cast_to_fp8) and return the fp8 pair.
            round_scale, use_ue8m0: accepted for DeepEP's signature (ignored).
            async_finish: return before the rows arrive; wait on `event`.
            return_recv_hook: only start the sends; calling `hook()` completes the receive. Not with async_finish.

        Returns:
            recv_x: `[L, R * Tm, D]` with x's dtype, or with use_fp8 the pair (`[L, R * Tm, D]` with
                `torch.float8_e4m3fn`, `[L, R * Tm, S]` with `torch.float32`); local expert l's recv_count[l] rows
                first, in (source rank, token) order, the other slots 0.
            recv_count: `[L]` with `torch.int32`, the rows each local expert received.
            handle: the LowLatencyHandle for low_latency_combine.
            event: an EventOverlap to wait on (empty unless async_finish).
            hook: with return_recv_hook, a function completing the receive; else None.
        """
        if self._external is not None:
            return self._external.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        checks.low_latency("low_latency_dispatch", async_finish, return_recv_hook)
        self.check_num_experts(num_experts)
        recv_x, recv_count, handle, in_flight = ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                            num_experts, use_fp8, cumulative_local_expert_recv_stats)
        return (recv_x, recv_count, handle, *ll_finish(in_flight, async_finish, return_recv_hook))

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None) -> tuple[
            torch.Tensor, EventOverlap, object]:
        """Send the expert outputs back and sum each token's, weighted (float32 accumulation, k ascending).

        Arguments:
            x: `[L, R * Tm, D]` floating point, the expert outputs in recv_x's slots.
            topk_idx: `[T, K]` with `torch.int64`, as dispatched (accepted for DeepEP's signature: the slots are in
                the handle).
            topk_weights: `[T, K]` floating point, each copy's weight (0 where topk_idx is -1).
            handle: the LowLatencyHandle of this Buffer's low_latency_dispatch, received.
            use_logfmt, zero_copy, combine_wait_recv_cost_stats: accepted for DeepEP's signature (ignored).
            async_finish: return before the rows arrive; wait on `event`.
            return_recv_hook: only start the sends; calling `hook()` completes the receive. Not with async_finish.
            out: `[T, D]` with x's dtype to write the result into; None: a new tensor.

        Returns:
            combined_x: `[T, D]` with x's dtype (or `out`), sum_k topk_weights[:, k] * expert_k(token).
            event: an EventOverlap to wait on (empty unless async_finish).
            hook: with return_recv_hook, a function completing the receive; else None.
        """
        if self._external is not None:
            return self._external.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt,
                                                      zero_copy, async_finish, return_recv_hook, out)
        checks.low_latency("low_latency_combine", async_finish, return_recv_hook)
        y, in_flight = ll_combine(self, x, topk_idx, topk_weights, handle, out)
        return (y, *ll_finish(in_flight, async_finish, return_recv_hook))
