"""Expert-parallel bytes and link times, counted exactly as docs/ep-bytes.md defines them.

Shape legend: R ranks in the EP group, T tokens per source rank, K top-k, E experts, G ranks per node.
`topk_idx_RTK[s, t, k]` is the k-th expert of token t on source rank s (-1 = none); expert e lives on
rank e // (E // R); rank r lives on node r // G.

Two modes:
- exact: `count_copies` on a given routing (every token of every source rank), summed per source rank;
- estimate: `simulate_ep` samples a bounded number of tokens per rank and scales the counts (thousands
  of GPUs), and `expected_uniform_copies` gives the closed-form expectation for uniform routing.

Time (alpha-beta, Hockney 1994): a link class c moving n bytes takes alpha_c + n / beta_c. The busiest
rank's sent or received bytes on a class set that class's time; NVLink and the NIC run concurrently, so a
dispatch takes the max over classes (DeepEP overlaps the RDMA and NVLink phases of its internode kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

STRATEGIES = ("pair", "rank", "node", "allgather")
STRATEGY_DOC = {
    "pair": "one copy per (token, expert) pair (TorchTitan / Megatron all-to-all)",
    "rank": "per-rank dedup (DeepEP intranode, moeflow alltoall)",
    "node": "two-phase per-node dedup (DeepEP internode / Hybrid-EP, moeflow hierarchical)",
    "allgather": "gather every token then mask (Megatron allgather dispatcher)",
}


@dataclass
class Links:
    """Per-GPU, per-direction bandwidths in GB/s (1e9 bytes/s) and per-message latencies in seconds."""

    intra_gbps: float
    inter_gbps: float
    alpha_intra_s: float = 5e-6  # assumption: NCCL-class intra-node latency, a few microseconds
    alpha_inter_s: float = 10e-6  # assumption: RDMA latency incl. software, ~10 us

    def time(self, bytes_intra: float, bytes_inter: float) -> float:
        t_intra = self.alpha_intra_s + bytes_intra / (self.intra_gbps * 1e9) if bytes_intra else 0.0
        t_inter = self.alpha_inter_s + bytes_inter / (self.inter_gbps * 1e9) if bytes_inter else 0.0
        return max(t_intra, t_inter)


ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}


def row_bytes(hidden: int, top_k: int, dtype: str = "bf16", with_ids: bool = True,
              combine_dtype: str = "bf16") -> tuple[int, int]:
    """(dispatch row, combine row) in bytes for one token copy, per docs/ep-bytes.md.

    `dtype` is the dispatched x ('fp8' adds a float32 scale per 128 channels); `combine_dtype` the
    combined x (bf16 by default, as DeepEP combines; 'fp8' is not a combine dtype). `with_ids`: the
    dispatch carries int64 topk_idx and float32 topk_weights, and the combine the float32 weights.
    """
    for name, value, allowed in (("dtype", dtype, ELEMENT_BYTES), ("combine_dtype", combine_dtype,
                                                                    ("fp32", "bf16"))):
        if value not in allowed:
            raise ValueError(f"{name} = {value!r} is not one of {list(allowed)}")
    dispatch = hidden * ELEMENT_BYTES[dtype]
    if dtype == "fp8":
        dispatch += hidden // 128 * 4  # float32 scale per 128 channels
    if with_ids:
        dispatch += top_k * 8 + top_k * 4  # int64 topk_idx + float32 topk_weights
    combine = hidden * ELEMENT_BYTES[combine_dtype] + (top_k * 4 if with_ids else 0)  # (+ weights)
    return dispatch, combine


@dataclass
class Copies:
    """Per-rank token-copy counts of one dispatch (combine is the same copies reversed)."""

    send_intra_R: np.ndarray
    send_inter_R: np.ndarray
    recv_intra_R: np.ndarray
    recv_inter_R: np.ndarray

    @property
    def intra(self) -> float:
        return float(self.send_intra_R.sum())

    @property
    def inter(self) -> float:
        return float(self.send_inter_R.sum())

    def busiest(self) -> tuple[float, float]:
        """(intra, inter) copies on the busiest rank's busiest direction (send or receive)."""
        bi = max(self.send_intra_R.max(), self.recv_intra_R.max())
        be = max(self.send_inter_R.max(), self.recv_inter_R.max())
        return float(bi), float(be)

    def scaled(self, factor: float) -> Copies:
        return Copies(*(a * factor for a in (self.send_intra_R, self.send_inter_R,
                                             self.recv_intra_R, self.recv_inter_R)))


def check_topology(num_experts: int, ep: int, ranks_per_node: int) -> None:
    if ep < 1 or num_experts % ep:
        raise ValueError(
            f"ep ({ep}) must divide the number of experts ({num_experts}); "
            f"choose ep in {[d for d in range(1, num_experts + 1) if num_experts % d == 0]}"
        )
    if ep > ranks_per_node and ep % ranks_per_node:
        raise ValueError(
            f"ep ({ep}) spans nodes, so it must be a multiple of gpus per node ({ranks_per_node}); "
            f"choose ep <= {ranks_per_node} or a multiple of it"
        )


def count_copies(topk_idx_RTK: np.ndarray, num_experts: int, ranks_per_node: int, strategy: str,
                 num_tokens_R=None) -> Copies:
    """Exact per-rank copy counts of one dispatch for `strategy` (docs/ep-bytes.md), vectorised.

    `num_tokens_R` ([R] ints, optional) makes a ragged routing fit one array: only the first
    num_tokens_R[s] rows of rank s are tokens, the rest is padding. It matters for 'allgather', which
    sends every token whatever its routing (so a padding row of -1 would count as a token); for the
    other strategies a padding row sends nothing, like a token routed to no expert.
    Combine sends the same copies back, so a rank's combine sends are its dispatch receives (recv_*_R).
    """
    R, T, K = topk_idx_RTK.shape
    G = ranks_per_node
    check_topology(num_experts, R, G)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy = {strategy!r} is not one of {list(STRATEGIES)}")
    if num_tokens_R is None:
        tokens_R = np.full(R, T, dtype=np.int64)
    else:
        tokens_R = np.asarray(num_tokens_R, dtype=np.int64)
        if tokens_R.shape != (R,) or (tokens_R < 0).any() or (tokens_R > T).any():
            raise ValueError(f"num_tokens_R must be {R} ints in [0, {T}], got {np.asarray(num_tokens_R).tolist()}")
        topk_idx_RTK = np.where((np.arange(T) < tokens_R[:, None])[:, :, None], topk_idx_RTK, -1)
    src_R11 = np.arange(R).reshape(R, 1, 1)
    zeros = lambda: np.zeros(R, dtype=np.float64)
    out = Copies(zeros(), zeros(), zeros(), zeros())

    def add(sender, receiver, mask, inter: bool):
        s = np.broadcast_to(sender, mask.shape)[mask]
        r = np.broadcast_to(receiver, mask.shape)[mask]
        send, recv = (out.send_inter_R, out.recv_inter_R) if inter else (out.send_intra_R, out.recv_intra_R)
        send += np.bincount(s, minlength=R)
        recv += np.bincount(r, minlength=R)

    if strategy == "allgather":
        # rank s sends its T_s tokens to every other rank; rank r receives every other rank's tokens
        local = min(G, R) - 1
        node_total_R = np.bincount(np.arange(R) // G, weights=tokens_R)[np.arange(R) // G]
        out.send_intra_R[:] = tokens_R * local
        out.send_inter_R[:] = tokens_R * (R - 1 - local)
        out.recv_intra_R[:] = node_total_R - tokens_R
        out.recv_inter_R[:] = tokens_R.sum() - node_total_R
        return out

    valid_RTK = topk_idx_RTK >= 0
    dest_RTK = np.where(valid_RTK, topk_idx_RTK // (num_experts // R), -1)
    if strategy == "pair":
        keep = valid_RTK & (dest_RTK != src_R11)
    else:
        # sort destinations per token so duplicates are adjacent; -1 (no expert) sorts first
        dest_RTK = np.sort(dest_RTK, axis=2)
        prev = np.concatenate([np.full((R, T, 1), -2), dest_RTK[:, :, :-1]], axis=2)
        keep = (dest_RTK >= 0) & (dest_RTK != prev)  # each destination rank once per token
        if strategy == "node":
            node_RTK = dest_RTK // G
            prev_node = np.concatenate([np.full((R, T, 1), -2), node_RTK[:, :, :-1]], axis=2)
            first_of_node = keep & (node_RTK != prev_node)
            peer_RTK = node_RTK * G + src_R11 % G  # forwarding peer: same local rank on node n
            # phase 1: one inter copy s -> p per destination node other than s's own
            add(src_R11, peer_RTK, first_of_node & (node_RTK != src_R11 // G), inter=True)
            # phase 2: one intra copy p -> r per destination rank r != p
            add(peer_RTK, dest_RTK, keep & (dest_RTK != peer_RTK), inter=False)
            return out
        keep &= dest_RTK != src_R11
    same_node = dest_RTK // G == src_R11 // G
    add(src_R11, dest_RTK, keep & same_node, inter=False)
    add(src_R11, dest_RTK, keep & ~same_node, inter=True)
    return out


def expected_uniform_copies(num_experts: int, top_k: int, ep: int, ranks_per_node: int,
                            strategy: str) -> tuple[float, float]:
    """Closed-form expected (intra, inter) copies per source token under uniform routing.

    A token picks K of E experts without replacement; a rank holds m = E/R of them, so it is missed with
    probability C(E-m, K)/C(E, K) (hypergeometric), a node (G*m experts) with C(E-G*m, K)/C(E, K).
    By symmetry every rank sends and receives the same expectation, so this is also the busiest rank's.
    """
    E, K, R = num_experts, top_k, ep
    G = min(ranks_per_node, R)
    nodes, m = R // G, E // R
    p_rank = 1 - comb(E - m, K) / comb(E, K)
    p_node = 1 - comb(E - G * m, K) / comb(E, K)
    if strategy == "pair":
        return K * (G - 1) / R, K * (R - G) / R
    if strategy == "rank":
        return (G - 1) * p_rank, (R - G) * p_rank
    if strategy == "node":
        # phase 2 forwards, on each of the `nodes` nodes, to the G-1 ranks other than the peer
        return nodes * (G - 1) * p_rank, (nodes - 1) * p_node
    if strategy == "allgather":
        return G - 1, R - G
    raise ValueError(f"strategy = {strategy!r} is not one of {list(STRATEGIES)}")


def sample_copies(routing: str, num_experts: int, top_k: int, ep: int, ranks_per_node: int,
                  tokens_per_gpu: int, strategies=STRATEGIES, budget: int = 1 << 21, seed: int = 0,
                  n_group: int = 1, topk_group: int = 1) -> tuple[dict[str, Copies], bool]:
    """Copies per strategy for `tokens_per_gpu` tokens on each of `ep` ranks.

    Exact when ep * tokens_per_gpu * top_k <= budget; otherwise samples fewer tokens per rank and scales
    the counts (the busiest-rank figure then carries sampling noise of order 1/sqrt(sampled tokens)).
    Returns ({strategy: Copies}, exact).
    """
    from moeflow.sim.routing import get_routing

    G = min(ranks_per_node, ep)
    t_s = max(1, min(tokens_per_gpu, budget // (ep * top_k)))
    idx_TK = get_routing(routing, ep * t_s, num_experts, top_k, seed, n_group, topk_group)
    idx_RTK = idx_TK.reshape(ep, t_s, top_k)
    scale = tokens_per_gpu / t_s
    out = {s: count_copies(idx_RTK, num_experts, G, s).scaled(scale) for s in strategies}
    return out, t_s == tokens_per_gpu


def ep_layer_time(copies: Copies, dispatch_row: int, combine_row: int, links: Links) -> dict:
    """Bytes and busiest-link times of one MoE layer's dispatch + combine (forward only)."""
    bi, be = copies.busiest()
    t_dispatch = links.time(bi * dispatch_row, be * dispatch_row)
    t_combine = links.time(bi * combine_row, be * combine_row)
    return {
        "bytes_intra": copies.intra * (dispatch_row + combine_row),
        "bytes_inter": copies.inter * (dispatch_row + combine_row),
        "busiest_bytes_intra": bi * (dispatch_row + combine_row),
        "busiest_bytes_inter": be * (dispatch_row + combine_row),
        "dispatch_s": t_dispatch,
        "combine_s": t_combine,
        # training: backward of dispatch is a combine and vice versa, so each layer pays both twice
        "layer_train_s": 2 * (t_dispatch + t_combine),
    }
