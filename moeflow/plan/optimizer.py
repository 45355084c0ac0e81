"""What the optimizer adds to a layout: Muon's state, its Newton-Schulz FLOPs and the bytes its scheme moves.

AdamW is the planner's baseline (its state is moeflow.plan.memory's 12 bytes per parameter; its step, elementwise
and local to each shard, is not modelled). Under `training.optimizer = "muon"` (moeflow.train.muon) the matrices
of the blocks keep fp32 master weights and one fp32 momentum (8 bytes per parameter, not AdamW's 12); the
embedding, head, norms and router gates stay with AdamW. Each step every matrix is orthogonalised once, by one
rank (moeflow.train.muon). A Muon parameter cut over one mesh dim of n ranks (FSDP2 alone, TP alone, the experts'
sharding group) goes by two all-to-alls: each rank sends its fp32 shard of matrix i to the matrix's owner (rank
i mod n) and the owner sends each rank its piece of the bf16 result, so per matrix of s elements 4 s (n - 1) / n
bytes travel there and 2 s (n - 1) / n back, summed over the ranks: 6 n_el (n - 1) / n^2 per rank on average for a
tensor of n_el elements (the figure costed), in 2 (n - 1) point-to-point hops; a 3-D experts tensor with at least
as many experts as ranks, which FSDP2 cuts between matrices (along E), is orthogonalised where it lies and moves
nothing. Under HSDP each of the r replicas does this for 1 / r of the matrices and the bf16 results are summed over
the replicas (an all-reduce of each rank's shard: 2 x 2 (n_el / n) (r - 1) / r). A parameter cut over several mesh
dims (FSDP over TP), or only replicated, is gathered whole (an all-gather: 4 n_el (s - 1) / s
bytes per rank over the s ranks that cut it; HSDP's replicas hold copies), matrix i orthogonalised on rank i mod g
(the mesh's size) alone, and the bf16 results summed over each mesh dim (an all-reduce: 2 x 2 n_el (n - 1) / n per
dim of n ranks). A parameter a rank holds whole (g = 1: an expert slice under ep with no expert sharding) moves
nothing. Newton-Schulz on an [A, B] matrix with s = min(A, B), l = max(A, B) costs per iteration 2 s^2 l
(X X^T), 2 s^3 ((X X^T)^2) and 2 s^2 l (the update times X): steps x (4 s^2 l + 2 s^3) FLOPs, timed at the bf16
matmul rate. None of it overlaps the step's compute
(it runs after backward).
"""

from __future__ import annotations

import math

from moeflow.core.model_config import ModelConfig
from moeflow.plan.layout import Job, Layout
from moeflow.sim.ep import Links

MUON_STATE_BYTES = 8
"""fp32 master weight + fp32 momentum per Muon parameter (AdamW's 12 keep a second moment too)."""
ADAMW_STATE_BYTES = 12


def block_matrices(cfg: ModelConfig, moe: bool) -> list[tuple[int, int, int, bool]]:
    """The Muon parameters of one block, one entry per tensor as (matrices, rows, cols, routed experts), in the
    shapes moeflow's own model stores (moeflow.models): the attention projections, the dense MLP or the routed
    experts (one [E, in, out] tensor each of w1, w3, w2) and the shared experts; the router gate and the norms
    are AdamW's."""
    d = cfg.dim
    if cfg.attention == "mla":
        h, nope, rope, v = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = ([(cfg.q_lora_rank, d), (h * (nope + rope), cfg.q_lora_rank)] if cfg.q_lora_rank
             else [(h * (nope + rope), d)])
        attn = q + [(cfg.kv_lora_rank + rope, d), (h * (nope + v), cfg.kv_lora_rank), (d, h * v)]
    else:
        q, kv = cfg.n_heads * cfg.hd, cfg.kv_heads * cfg.hd
        attn = [(q, d), (kv, d), (kv, d), (d, q)]
    if not moe:
        return [(1, r, c, False) for r, c in attn + _mlp(d, cfg.ffn_dim)]
    m = cfg.moe
    routed = [(m.num_experts, c, r, True) for r, c in _mlp(d, m.ffn_dim)]  # stored [E, in, out]: x @ w
    shared = _mlp(d, m.shared_width) if m.shared_width else []
    return [(1, r, c, False) for r, c in attn + shared] + routed


def _mlp(dim: int, width: int) -> list[tuple[int, int]]:
    return [(width, dim), (width, dim), (dim, width)]  # w1 (gate), w3 (up), w2 (down)


def layer_matrices(cfg: ModelConfig, layer: int) -> list[tuple[int, int, int, bool]]:
    """block_matrices of decoder layer `layer`; layer n_layers and above are the MTP modules (their [D, 2D]
    projection and their block)."""
    if layer < cfg.n_layers:
        return block_matrices(cfg, cfg.is_moe_layer(layer))
    return [(1, cfg.dim, 2 * cfg.dim, False)] + block_matrices(cfg, cfg.is_moe)


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """Newton-Schulz FLOPs for one matrix (module doc)."""
    s, long = min(rows, cols), max(rows, cols)
    return steps * (4.0 * s * s * long + 2.0 * s ** 3)


def mesh_dims(lay: Layout) -> tuple[list[int], list[int]]:
    """The (dense, routed-expert) mesh dims a Muon parameter is cut over, as their sizes (those > 1): FSDP's dp x cp
    shards and tp for the dense weights (moeflow.parallel.fsdp); the expert-sharding group (dp x cp / ep) for the
    experts, which ep x tp split whole. (HSDP's replicas, a dim of lay.dp_replicate, hold copies.)"""
    shard = lay.dp_shard * lay.cp
    return [n for n in (shard, lay.tp) if n > 1], [n for n in (max(1, shard // lay.ep),) if n > 1]


COST_KEYS = ("ns_flops", "intra_bytes", "inter_bytes", "intra_hops", "inter_hops", "muon_params")


def muon_rank_cost(job: Job, lay: Layout, layers: list[int]) -> dict[str, float]:
    """One rank's Muon work per step for the decoder `layers` it holds (MTP layers numbered from n_layers):
    Newton-Schulz FLOPs; bytes it sends and ring hops it waits on, inside a node and across nodes (a mesh larger
    than a node runs on the inter-node links); the Muon parameters it holds (its shard) and the largest tensor it
    gathers whole, in elements. Summed from one cost per kind of layer (dense, MoE, MTP), cached per mesh: the
    search asks for tens of thousands of layouts."""
    cfg = job.model
    kinds = {}
    for layer in layers:
        kind = "mtp" if layer >= cfg.n_layers else "moe" if cfg.is_moe_layer(layer) else "dense"
        kinds[kind] = kinds.get(kind, 0) + 1
    total = dict.fromkeys(COST_KEYS, 0.0) | {"largest_tensor": 0.0}
    for kind, n in kinds.items():
        one = _layer_cost(job, lay, kind)
        for key in COST_KEYS:
            total[key] += n * one[key]
        total["largest_tensor"] = max(total["largest_tensor"], one["largest_tensor"])
    return total


def _layer_cost(job: Job, lay: Layout, kind: str) -> dict[str, float]:
    cfg = job.model
    key = ("muon", kind, lay.dp_replicate, lay.dp_shard * lay.cp, lay.tp, lay.ep)
    cache = job.stats.cache
    if key in cache:
        return cache[key]
    layer = cfg.n_layers if kind == "mtp" else next(i for i in range(cfg.n_layers)
                                                    if cfg.is_moe_layer(i) == (kind == "moe"))
    dense, expert = mesh_dims(lay)
    replicas = [lay.dp_replicate] if lay.dp_replicate > 1 else []
    cost = dict.fromkeys(COST_KEYS, 0.0) | {"largest_tensor": 0.0}
    for matrices, rows, cols, routed in layer_matrices(cfg, layer):
        cut = expert if routed else dense
        dims = replicas + cut
        s, g = math.prod(cut), math.prod(dims)
        if routed:
            matrices /= lay.ep * lay.tp  # this rank's experts
        elements = matrices * rows * cols
        cost["ns_flops"] += matrices * ns_flops(rows, cols, job.ns_steps) / g
        cost["muon_params"] += elements / s  # HSDP's replicas: copies
        cost["largest_tensor"] = max(cost["largest_tensor"], elements)
        link = "inter" if g > job.gpus_per_node else "intra"
        if len(cut) == 1:  # cut over one mesh dim: the two all-to-alls, each replica its share of the matrices
            # FSDP2 cuts [E, in, out] along E (between matrices) where there are at least as many experts as
            # ranks: nothing moves; else inside them (moeflow.parallel.fsdp.balanced_shard)
            r = lay.dp_replicate
            if not (routed and matrices >= s):
                cost[f"{link}_bytes"] += 6 * elements * (s - 1) / s ** 2 / r
                cost[f"{link}_hops"] += 2 * (s - 1)
            if r > 1:  # the replicas' results summed: each rank's bf16 shard
                cost[f"{link}_bytes"] += 4 * elements / s * (r - 1) / r
                cost[f"{link}_hops"] += 2 * (r - 1)
        elif dims:  # the fp32 update gathered whole over the cut, then the bf16 results summed over each mesh dim
            cost[f"{link}_bytes"] += 4 * elements * (s - 1) / s + sum(4 * elements * (n - 1) / n for n in dims)
            cost[f"{link}_hops"] += s - 1 + sum(2 * (n - 1) for n in dims)
    cache[key] = cost
    return cost


def muon_seconds(cost: dict[str, float], links: Links, matmul_flops: float) -> float:
    """Seconds of one rank's muon_rank_cost: Newton-Schulz at `matmul_flops` (the bf16 matmul rate), then the
    collectives at the links' bandwidth and per-hop latency, nothing overlapped."""
    return (cost["ns_flops"] / matmul_flops
            + cost["intra_bytes"] / (links.intra_gbps * 1e9) + cost["intra_hops"] * links.alpha_intra_s
            + cost["inter_bytes"] / (links.inter_gbps * 1e9) + cost["inter_hops"] * links.alpha_inter_s)


def rank_layers(job: Job, stages) -> list[int]:
    """The layers one pipeline rank's `stages` hold (moeflow.plan.memory.rank_stages), the MTP modules numbered
    from n_layers on the rank with the head."""
    layers = [i for span, _, _ in stages for i in span]
    if any(head for _, _, head in stages):
        layers += range(job.model.n_layers, job.model.n_layers + job.model.mtp_depth)
    return layers


def muon_memory_bytes(cost: dict[str, float]) -> tuple[float, float]:
    """(state bytes Muon saves against AdamW's, transient bytes of its largest gather) for one rank's
    muon_rank_cost: no second moment for the Muon parameters; the whole fp32 update of one tensor and its bf16
    result while it is orthogonalised."""
    return (ADAMW_STATE_BYTES - MUON_STATE_BYTES) * cost["muon_params"], (4 + 2) * cost["largest_tensor"]

