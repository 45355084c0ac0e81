"""A new dispatch's routing: which rows go to which rank, how many arrive here, and how to start them on their way.

Shape legend: T tokens, K top-k, E experts, L local experts (E // R), D hidden, S fp8 scale columns (D // 128),
R ranks, M nodes, N received rows, W num_worst_tokens, B bytes per packed row.

Two paths, chosen by num_worst_tokens (checked in moeflow/ep/checks.py):
- exact (W = 0): one all_gather of every rank's counts, a host sync (the all-to-all's split sizes are python ints);
  then the backend moves exactly the N rows this rank receives, and the counts per local expert are host ints.
- static (W > 0): every peer gets a fixed block of W // R slots (moeflow/ep/backends/static.py), so nothing is read
  back to the host (CUDA graphs need that); W rows arrive, the unused ones padding, and the counts stay on the
  device.

Also EPHandle: what a dispatch leaves for its combine and for cached dispatches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeflow.ep import counts as L_
from moeflow.ep import wire
from moeflow.ep.backends.base import Counts, Route
from moeflow.ep.backends.static import StaticBackend
from moeflow.ep.inflight import InFlight


@dataclass
class EPHandle:
    """Everything combine (and a cached dispatch) needs from a dispatch; nothing of one dispatch stays in the Buffer,
    so micro-batches may overlap. DeepEP's handle is an opaque tuple; pass this one back just as unread.

    Attributes:
        buffer_id: the Buffer that dispatched (a handle works with that Buffer only).
        hidden: D, the dispatched hidden size (combine's x must have it).
        num_tokens: T, this rank's dispatched tokens (the rows combine returns).
        num_recv: N, the rows actually received (W on the static path).
        num_worst_tokens: W; 0 when the receive size is exact.
        num_experts: E (0 when dispatched without topk_idx).
        num_topk: K (0 when dispatched without topk_idx).
        is_token_in_rank: `[T, R]` with `torch.bool`, the ranks each token went to.
        recv_topk_idx: `[N or W, K]` with `torch.int64`, local expert ids of the received rows, -1 elsewhere and on
            padding rows; None without topk_idx.
        plan: the backend's routing plan (None while the dispatch is in flight).
        in_flight: the dispatch while it is in flight (None once it has arrived).
        static: sent in fixed-size blocks (num_worst_tokens): num_recv is W and no counts reached the host.
        dtype: the dtype of the dispatched x.
        backend: the backend that made `plan`; combine and cached dispatches go back through it.
    """

    buffer_id: int
    hidden: int
    num_tokens: int
    num_recv: int
    num_worst_tokens: int
    num_experts: int
    num_topk: int
    is_token_in_rank: torch.Tensor
    recv_topk_idx: torch.Tensor | None
    plan: object
    in_flight: InFlight | None = None
    static: bool = False
    dtype: torch.dtype = torch.float32
    backend: object = None

    @property
    def num_rows(self) -> int:
        """Returns: the rows of recv_x (and of combine's input): W when static, else N."""
        return self.num_worst_tokens or self.num_recv

    def ready(self) -> EPHandle:
        """Wait for the dispatch that made this handle if it is still in flight.

        Returns:
            self, its plan and recv_topk_idx complete.
        """
        if self.in_flight is not None:
            self.in_flight.wait()
            self.in_flight = None
        return self


@dataclass(frozen=True)
class LayoutCounts:
    """The get_dispatch_layout counts a caller passed to dispatch, shape-checked; None where not passed (dispatch
    counts those itself)."""

    per_rank: torch.Tensor | None  # num_tokens_per_rank [R], integer
    per_node: torch.Tensor | None  # num_tokens_per_rdma_rank [M], integer
    per_expert: torch.Tensor | None  # num_tokens_per_expert [E], integer


@dataclass(frozen=True)
class NewDispatch:
    """A dispatch without a handle: its arguments checked (moeflow/ep/checks.py), what the caller left out derived."""

    xs: list[torch.Tensor]  # [x [T, D]], or the fp8 pair [x [T, D] float8_e4m3fn, scales [T, S] float32]
    topk_idx: torch.Tensor | None  # [T, K] int64 global expert ids, -1 for none
    topk_weights: torch.Tensor | None  # [T, K] float32
    is_token_in_rank: torch.Tensor  # [T, R] bool (from topk_idx when the caller passed none)
    num_experts: int | None  # E; None when dispatched without topk_idx
    expert_alignment: int  # each local expert's count rounded up to a multiple of it
    num_worst_tokens: int  # W; 0 for the exact path
    given: LayoutCounts

    @property
    def num_tokens(self) -> int:
        return self.xs[0].shape[0]


@dataclass(frozen=True)
class Payload:
    """What one packed row of a new dispatch holds: the xs (x, or the fp8 pair), then topk_idx [K] int64, then
    topk_weights [K] float32 (each where dispatched)."""

    specs: list[wire.Spec]
    num_x: int  # how many of `specs` are the xs
    topk_idx: torch.Tensor | None  # [T, K] int64: it travels with the rows but is not differentiated

    @staticmethod
    def of(args: NewDispatch) -> Payload:
        tensors = [*args.xs, *(t for t in (args.topk_idx, args.topk_weights) if t is not None)]
        return Payload([wire.spec_of(t) for t in tensors], len(args.xs), args.topk_idx)

    @property
    def num_topk(self) -> int:
        return 0 if self.topk_idx is None else self.topk_idx.shape[1]

    def pack(self, xs: list[torch.Tensor], topk_weights: torch.Tensor | None) -> torch.Tensor:
        """xs [T, ...] and topk_weights [T, K] (the differentiable inputs) -> uint8 [T, B]."""
        extra = [t for t in (self.topk_idx, topk_weights) if t is not None]
        return wire.pack([*xs, *extra])

    def topk_idx_of(self, rows_nB: torch.Tensor) -> torch.Tensor:
        """Packed rows [n, B] -> their topk_idx [n, K] int64 (a view where aligned)."""
        return wire.column(rows_nB, wire.row_nbytes(self.specs[:self.num_x]), 8 * self.num_topk, torch.int64)

    def padding_row(self, device: torch.device) -> torch.Tensor:
        """One packed row [B] of zeros whose topk_idx reads -1 (how static padding rows are told apart)."""
        row = torch.zeros(wire.row_nbytes(self.specs), dtype=torch.uint8, device=device)
        off = wire.row_nbytes(self.specs[:self.num_x])
        row[off:off + 8 * self.num_topk] = 255  # int64 -1 is all ones
        return row


@dataclass(frozen=True)
class Routing:
    """Where a new dispatch's rows go, decided before any row moves."""

    payload: Payload
    num_rows: int  # rows of recv_x: N (exact) or W (static)
    counts_list: list[int]  # num_recv_tokens_per_expert_list, aligned; [] on the static path (counts stay on device)
    send: Callable[[torch.Tensor], InFlight]  # packed rows [T, B] -> InFlight of (received rows [n, B], plan)
    backend: object  # what `send` runs on (combine and cached dispatches go back through it)
    local_experts: range  # this rank's global expert ids
    static: bool


def exact_routing(backend, args: NewDispatch) -> Routing:
    """The exact path (num_worst_tokens = 0): one count exchange (a host sync), then exactly N rows arrive."""
    topo, payload = backend.topo, Payload.of(args)
    counts = exchange_counts(topo, args)
    num_rows = sum(counts.to_rank(s, topo.rank) for s in range(topo.num_ranks))
    local_experts = _local_experts(args.num_experts, topo)
    mask_from_rows, counts_list = None, []
    if payload.num_topk:
        def mask_from_rows(rows_nB):
            return L_.token_rank_mask(payload.topk_idx_of(rows_nB), args.num_experts, topo.num_ranks)
        a = args.expert_alignment
        per_expert = [sum(counts.extra(s)[e] for s in range(topo.num_ranks)) for e in local_experts]
        counts_list = [(c + a - 1) // a * a for c in per_expert]
    route = Route(args.is_token_in_rank, counts, mask_from_rows)

    def send(rows_TB):
        return backend.dispatch(rows_TB, route, "Buffer.dispatch", async_op=True)

    return Routing(payload, num_rows, counts_list, send, backend, local_experts, static=False)


def static_routing(backend: StaticBackend, args: NewDispatch) -> Routing:
    """The static path (num_worst_tokens = W > 0, which needs topk_idx): fixed blocks of W // R slots per peer, W rows
    arrive and nothing is read back to the host."""
    payload, W = Payload.of(args), args.num_worst_tokens
    slot_TR = backend.plan_slots(args.is_token_in_rank, W)
    pad_B = payload.padding_row(args.xs[0].device)

    def send(rows_TB):
        valid_of = lambda rows_nB: (payload.topk_idx_of(rows_nB) >= 0).any(1)  # padding rows read -1
        return backend.dispatch(rows_TB, slot_TR, pad_B, valid_of, W, "Buffer.dispatch", async_op=True)

    return Routing(payload, W, [], send, backend, _local_experts(args.num_experts, backend.topo), static=True)


def exchange_counts(topo, args: NewDispatch) -> Counts:
    """Every rank's tokens per destination rank, node and expert (one all_gather). Counts the caller passed
    (get_dispatch_layout's) are sent as they are; the others are counted here."""
    mask_TR, given = args.is_token_in_rank, args.given
    # T by a fill on the device, not torch.tensor([T]): a host-to-device copy from pageable memory syncs a GPU
    vec = [mask_TR.new_full((1,), args.num_tokens, dtype=torch.int64),
           mask_TR.sum(0) if given.per_rank is None else given.per_rank,
           L_.node_mask(mask_TR, topo.ranks_per_node).sum(0) if given.per_node is None else given.per_node]
    if args.topk_idx is not None:
        per_expert = given.per_expert
        vec.append(L_.tokens_per_expert(args.topk_idx, args.num_experts) if per_expert is None else per_expert)
    vec_C = torch.cat([v.to(torch.int64) for v in vec])
    # host sync: the count exchange; split sizes of the all-to-all must be python ints
    rows = topo.main.all_gather(vec_C, "Buffer.dispatch (count exchange)").tolist()
    return Counts(rows, topo.num_ranks, topo.num_nodes)


def local_ids(gidx_nK: torch.Tensor, local_experts: range, out_XK: torch.Tensor) -> None:
    """out[:n] = the global expert ids gidx as this rank's local ids (-1 for other ranks' experts); the rows past n
    (static padding) -1."""
    lo, n = local_experts.start, gidx_nK.shape[0]
    local = gidx_nK - lo
    mine = (gidx_nK >= lo) & (gidx_nK < local_experts.stop)
    out_XK[:n].copy_(torch.where(mine, local, torch.full_like(local, -1)))
    out_XK[n:].fill_(-1)


def _local_experts(num_experts: int | None, topo) -> range:
    per_rank = (num_experts or 0) // topo.num_ranks
    return range(topo.rank * per_rank, (topo.rank + 1) * per_rank)
