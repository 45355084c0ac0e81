"""Low-latency mode: fixed per-expert receive slots, no count-dependent split sizes, weighted combine.

Shape legend: T tokens, K top-k, E experts, L local experts, R ranks, Tm num_max_dispatch_tokens_per_rank,
D hidden, B bytes per row, Q = R * L * Tm receive slots.

Every (token, expert) pair is one copy (no rank dedup, as in DeepEP's low-latency kernels). The send
buffer has Tm slots per expert, so rank r's block is rows [r * L * Tm, (r + 1) * L * Tm) and one
all_to_all_single with equal splits moves everything: no counts are needed on the host to size it.
The receiver packs expert l's rows from all sources into recv_x[l, :count] in (source rank, token) order.
The stats count the copies actually holding a token (what DeepEP's one-sided writes send); this
collective-based path also moves the empty slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.ep import counts as L_
from moeflow.ep import wire
from moeflow.ep.event import EventOverlap
from moeflow.ep.fp8 import check_fp8_hidden, per_token_cast_to_fp8
from moeflow.ep.inflight import InFlight


@dataclass
class LowLatencyHandle:
    buffer_id: int
    hidden: int
    num_experts: int
    num_max_tokens: int  # Tm
    slot_TK: torch.Tensor  # send slot of each (token, k) pair, E * Tm for -1 entries (a dump slot)
    packed_pos_Q: torch.Tensor | None  # packed position of each receive slot, L * R * Tm for empty ones (None
    # until the receive is complete)
    recv_count_L: torch.Tensor


def _check(buffer, x, topk_idx, Tm: int, num_experts: int, use_fp8: bool) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"low_latency_dispatch x must be a 2-D float tensor [T, D], got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    L_.check_topk_idx(topk_idx, num_experts)
    if topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {x.shape[0]}; they must match")
    if x.shape[0] > Tm:
        raise ValueError(f"num_max_dispatch_tokens_per_rank = {Tm} but this rank has {x.shape[0]} tokens; "
                         f"raise it to at least {x.shape[0]}")
    if use_fp8:
        check_fp8_hidden(x.shape[1])
    s, _ = topk_idx.sort(dim=1)
    # host sync: a token listing one expert twice would need two slots of that expert
    if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
        raise ValueError("low_latency_dispatch: a token lists the same expert twice in topk_idx; "
                         "each expert may appear once per token (use -1 for unused entries)")


def ll_dispatch(buffer, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, Tm: int, E: int, use_fp8: bool,
                cumulative_stats_L: torch.Tensor | None = None) -> tuple:
    """Buffer.low_latency_dispatch's work -> (recv_x, recv_count [L] int32, handle, in_flight); in_flight fills
    recv_x and recv_count (and adds recv_count to cumulative_stats_L) on wait."""
    _check(buffer, x_TD, topk_idx_TK, Tm, E, use_fp8)
    comm, R = buffer.topo.main, buffer.group_size
    L = E // R
    T, K = topk_idx_TK.shape
    dev = x_TD.device
    payload = list(per_token_cast_to_fp8(x_TD)) if use_fp8 else [x_TD]
    specs = [wire.spec_of(t) for t in payload]
    rows_TB = wire.pack(payload)
    B = rows_TB.shape[1]

    # Slot of each pair: expert * Tm + its position among the pairs of that expert (token order).
    flat = topk_idx_TK.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, E))
    order = torch.argsort(key, stable=True)
    count_E1 = L_.tokens_per_expert(topk_idx_TK, E, keep_dropped=True)
    start_E1 = torch.cumsum(count_E1, 0) - count_E1
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(flat.numel(), device=dev) - start_E1[key[order]]
    slot_TK = torch.where(flat >= 0, flat * Tm + pos, torch.full_like(flat, E * Tm)).view(T, K)
    send = rows_TB.new_zeros((E * Tm + 1, B))
    send.index_copy_(0, slot_TK.reshape(-1), rows_TB.repeat_interleave(K, dim=0))
    count_E = count_E1[:E]

    buffer.stats.calls += 1
    # host sync: byte counters only (the collectives below need no counts on the host)
    comm.record("dispatch", count_E.view(R, L).sum(1).tolist(), B)
    # Both in flight at once; the outputs below are filled when they have arrived (the receive hook).
    got = comm.all_to_all(send[:-1], [L * Tm] * R, [L * Tm] * R, "Buffer.low_latency_dispatch", None, True)
    cnt_rows = comm.all_to_all(wire.pack([count_E.view(R, L)]), [1] * R, [1] * R,
                               "Buffer.low_latency_dispatch (counts)", None, True)
    full = L * R * Tm
    recv = [torch.zeros((L, R * Tm, *shape), dtype=dt, device=dev) for dt, shape in specs]
    recv_count = torch.zeros(L, dtype=torch.int32, device=dev)
    handle = LowLatencyHandle(buffer._id, x_TD.shape[1], E, Tm, slot_TK, None, recv_count)

    def arrived(got_QB):
        cnt_RL = wire.unpack(cnt_rows.wait(), [(torch.int64, (L,))])[0]  # [source rank, local expert]
        # Receive slot (s, l, i) holds a token iff i < cnt[s, l]; it goes to packed row off[s, l] + i of expert l.
        off_RL = torch.cumsum(cnt_RL, 0) - cnt_RL
        i_Q = torch.arange(Tm, device=dev).view(1, 1, Tm)
        l_Q = torch.arange(L, device=dev).view(1, L, 1)
        packed_pos = torch.where(i_Q < cnt_RL.unsqueeze(2), l_Q * (R * Tm) + off_RL.unsqueeze(2) + i_Q,
                                 torch.full_like(i_Q, full)).reshape(-1)
        packed = got_QB.new_zeros((full + 1, B)).index_copy_(0, packed_pos, got_QB)[:-1]
        for out, value in zip(recv, wire.unpack(packed, specs)):
            out.copy_(value.view(out.shape))
        recv_count.copy_(cnt_RL.sum(0).to(torch.int32))
        if cumulative_stats_L is not None:
            cumulative_stats_L.add_(recv_count.to(cumulative_stats_L.dtype))
        handle.packed_pos_Q = packed_pos
        return got_QB

    recv_x = (recv[0], recv[1]) if use_fp8 else recv[0]
    return recv_x, recv_count, handle, got.then(arrived)


def ll_combine(buffer, x_LQD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
               handle: LowLatencyHandle, out: torch.Tensor | None = None) -> tuple[torch.Tensor, InFlight]:
    """Buffer.low_latency_combine's work -> (combined [T, D], in_flight filling it on wait)."""
    if not isinstance(handle, LowLatencyHandle) or handle.buffer_id != buffer._id:
        raise ValueError("low_latency_combine needs the handle low_latency_dispatch of this Buffer returned")
    if handle.packed_pos_Q is None:
        raise ValueError("low_latency_combine: the dispatch has not been received yet; call its receive hook "
                         "(or wait on its event) first")
    comm, R = buffer.topo.main, buffer.group_size
    E, Tm, D = handle.num_experts, handle.num_max_tokens, handle.hidden
    L = E // R
    if not isinstance(x_LQD, torch.Tensor) or tuple(x_LQD.shape) != (L, R * Tm, D):
        raise ValueError(f"low_latency_combine x must be [{L}, {R * Tm}, {D}] (local experts, slots, hidden), "
                         f"got {tuple(getattr(x_LQD, 'shape', ()))}")
    _ = topk_idx_TK  # the slots are in the handle; topk_idx is accepted for DeepEP's signature
    flat_x = torch.cat([x_LQD.reshape(L * R * Tm, D), x_LQD.new_zeros(1, D)])
    send = flat_x[handle.packed_pos_Q]  # back to (source rank, local expert, slot) order
    buffer.stats.calls += 1
    cnt_RL = (handle.packed_pos_Q.view(R, L, Tm) < L * R * Tm).sum(2)
    # host sync: byte counters only
    comm.record("combine", cnt_RL.sum(1).tolist(), D * x_LQD.element_size())
    rows = wire.pack([send])
    got = comm.all_to_all(rows, [L * Tm] * R, [L * Tm] * R, "Buffer.low_latency_combine", None, True)
    T, K = handle.slot_TK.shape
    result = out if out is not None else x_LQD.new_empty(T, D)

    def arrived(got_QB):
        y = torch.cat([wire.unpack(got_QB, [(x_LQD.dtype, (D,))])[0], x_LQD.new_zeros(1, D)])
        y_TKD = y[handle.slot_TK.reshape(-1)].view(T, K, D).float()
        w_TK = topk_weights_TK.float().masked_fill(handle.slot_TK == E * Tm, 0.0)
        acc = torch.zeros(T, D, dtype=torch.float32, device=x_LQD.device)
        for k in range(K):  # k ascending, as moeflow.ep.reference
            acc += w_TK[:, k:k + 1] * y_TKD[:, k]
        result.copy_(acc)
        return got_QB

    return result, got.then(arrived)


def ll_finish(in_flight: InFlight, async_finish: bool, return_recv_hook: bool) -> tuple:
    """-> (event, hook) of a low-latency call: waited for here unless asynchronous or hooked (DeepEP's semantics)."""
    if not (async_finish or return_recv_hook):
        in_flight.wait()

    def hook() -> None:
        in_flight.wait()

    return EventOverlap(in_flight=in_flight if async_finish else None), hook if return_recv_hook else None
