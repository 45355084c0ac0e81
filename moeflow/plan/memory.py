"""Bytes per GPU of one layout: parameters, gradients, optimizer state, activations, EP buffers.

Model state (ZeRO, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", sec. 3.1 and 5.1, Fig. 1): mixed-precision AdamW keeps 2 bytes/param of bf16
weights (2Ψ), 2 bytes of bf16 gradients (2Ψ) and K=12 bytes of optimizer state (fp32 master weights,
momentum, variance: 12Ψ). ZeRO-1 shards the 12Ψ over the data-parallel group N_d, ZeRO-2 also the
gradients, ZeRO-3 also the weights. moeflow's ZeRO-1 reduce-scatters gradients as backward produces them
(FSDP2, like Megatron-Core's distributed optimizer, without its full-size gradient buffer), so its gradients are
sharded as ZeRO-2's: stages 1 and 2 differ in how often they gather the weights, not in what a GPU holds. Here
the sharding group is dp_shard (dp_replicate copies it: HSDP); expert weights are split over ep and their
data-parallel group is dp_shard / ep.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
sec. 4, Table 2), bytes per layer per micro-batch with tensor + sequence parallelism of size t:
  none       s*b*h*(34 + 5*a*s/h) / t
  selective  s*b*h*34 / t          (recompute the attention core; what flash attention also does)
  full       s*b*h*2 / t           (keep only each layer's input)
The 34 = 11 (attention) + 4 (norms) + 19 (MLP with width 4h). The MLP part is rescaled to the FFN width
a token actually touches (dense ffn_dim, or top_k * expert width + shared width): 2 + 17 * F_tok / (4h).
With 1F1B pipelining stage i holds min(pp - i, m) micro-batches in flight (sec. 4.2.3); other schedules:
moeflow.plan.schedule.in_flight. Under flash attention (Job.flash_attention) "none" keeps what "selective" does.

Context parallelism of size c (moeflow.parallel.context): a rank holds S/c of each sequence's tokens, so every
activation term above is divided by c (the scores too: S/c queries against S keys); FSDP shards the weights over
dp_shard x c, and experts over dp_shard x c / ep. The all-gather variant also keeps, per layer, the whole
sequence's keys and values: (c - 1) / c of them beyond the rank's own share (`cp_gathered_kv_bytes`).

ZeRO-Offload (`Layout.offload`; Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training") puts
state in host memory (`host`, checked against the GPU's `host_gb`): under 'params' (ZeRO-3) the shards of the
weights, their gradients and the optimizer state (the 16 bytes per parameter above, sharded), the device keeping
the layers being gathered (`zero3_gather`), activations and buffers; under 'optimizer' (any ZeRO stage, the
trainer's moeflow/train/offload.py) the device keeps the weights and gradients in fp32 (4 + 4 bytes per parameter:
the weights are the master copy) and the host an fp32 master copy, the two moments and a gradient buffer (16
bytes per parameter of the optimizer's shard; 8 for Muon's parameters: its momentum and the gradient buffer).
"""

from __future__ import annotations

from moeflow.core.hardware import RESERVED_GB
from moeflow.core.model_config import ModelConfig
from moeflow.core.schedules import pipeline_layout
from moeflow.plan.layout import Job, Layout
from moeflow.plan.optimizer import MUON_STATE_BYTES, muon_memory_bytes, muon_rank_cost, rank_layers
from moeflow.plan.schedule import in_flight as schedule_in_flight

GB = 1e9


def rank_stages(job: Job, lay: Layout) -> list[tuple[tuple[range, bool, bool], ...]]:
    """Per pipeline rank, the stages it holds as (layers, holds the embedding, holds the head): the trainer's split
    and the schedule's placement (moeflow.core.schedules.pipeline_layout). A balanced split of the layers over
    pp ranks is not what runs: the trainer cuts pp x stages-per-rank stages, the first ones taking the remainder
    (61 layers on pp=16 under a V schedule: rank 0 holds layers 0-1 and 60, not 0-3), which moves dense and MoE
    layers between ranks and changes the fullest rank."""
    key = ("rank_stages", lay.pp, lay.pp_schedule, lay.stages_per_rank)
    cache = job.stats.cache
    if key not in cache:
        n = job.model.n_layers
        if lay.pp == 1:
            cache[key] = [((range(n), True, True),)]
        else:
            per_rank: list[list] = [[] for _ in range(lay.pp)]
            for spec in pipeline_layout(n, lay.pp, lay.pp_schedule, None, lay.stages_per_rank):
                per_rank[spec.rank].append((range(spec.layers[0], spec.layers[-1] + 1), spec.embed, spec.head))
            cache[key] = [tuple(stages) for stages in per_rank]
    return cache[key]


def rank_model_state(job: Job, lay: Layout, stages: tuple[tuple[range, bool, bool], ...]) -> dict[str, float]:
    """model_state_bytes of the parameters one pipeline rank holds (its `stages`, from rank_stages)."""
    dense = expert = tp_whole = 0.0
    for layers, embed, head in stages:
        d, e = stage_params(job, layers, embed, head)
        dense, expert = dense + d, expert + e
        tp_whole += stage_tp_whole(job, layers, head) if lay.tp > 1 else 0
    return model_state_bytes(dense, expert, lay, tp_whole)


def model_state_per_rank(job: Job, lay: Layout) -> list[dict[str, float]]:
    """Per pipeline rank, in rank order: bytes of bf16 weights, bf16 gradients and fp32 AdamW state it holds."""
    return [rank_model_state(job, lay, stages) for stages in rank_stages(job, lay)]


def stage_params(job: Job, layers: range, first: bool, last: bool) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of one pipeline stage (whole, before any split)."""
    cfg, st = job.model, job.stats
    key = (layers.start, layers.stop, first, last)
    if key in st.cache:
        return st.cache[key]
    expert = sum(st.routed[i] for i in layers)
    dense = sum(st.layer[i] for i in layers) - expert
    emb = cfg.vocab_size * cfg.dim
    if first:
        dense += emb
    if last:
        dense += cfg.dim + (emb if not cfg.tie_embeddings or not first else 0)
        dense, expert = dense + st.mtp_params[0], expert + st.mtp_params[1]  # MTP modules sit with the head
    st.cache[key] = dense, expert
    return dense, expert


def stage_tp_whole(job: Job, layers: range, last: bool) -> int:
    """Parameters of one stage that every tp rank holds whole (norms, MoE routers; not the shared experts, which
    the folded MoE shards over dp x cp x tp)."""
    return sum(job.stats.tp_whole[i] for i in layers) + (job.model.dim if last else 0)


def model_state_bytes(dense: float, expert: float, lay: Layout, tp_whole: float = 0.0) -> dict[str, float]:
    """Per-GPU bf16 weights, bf16 grads and fp32 AdamW state (ZeRO 2Ψ/2Ψ/12Ψ) of one stage's params.
    `tp_whole` of the `dense` parameters are held whole by every tp rank (stage_tp_whole)."""
    d_local = (dense - tp_whole) / lay.tp + tp_whole
    e_local = expert / (lay.ep * lay.tp)
    d_shard = lay.dp_shard * lay.cp  # FSDP shards over the data- and context-parallel ranks
    e_shard = max(1, d_shard // lay.ep)  # expert data-parallel group inside dp_shard x cp
    shard = lambda stage_on: (d_local / d_shard + e_local / e_shard) if stage_on else d_local + e_local
    return {
        "params": 2 * shard(lay.zero >= 3),
        "grads": 2 * shard(lay.zero >= 1),  # every stage reduce-scatters gradients (moeflow's ZeRO-1 too)
        "optimizer": 12 * shard(lay.zero >= 1),
    }


def layer_activation_bytes(cfg: ModelConfig, mlp_width: int, seq: int, mb: int, tp: int, ac: str) -> float:
    """Korthikanti et al. 2022 Table 2 (see module doc), one layer, one micro-batch, per GPU.

    `mlp_width` is the FFN width one token touches (ffn_dim, or top_k * expert width + shared width).
    """
    sbh = seq * mb * cfg.dim
    if ac == "full":
        return 2 * sbh / tp
    mlp = 2 + 17 * mlp_width / (4 * cfg.dim)
    per = sbh * (11 + 4 + mlp)
    if ac == "none":
        per += 5 * cfg.n_heads * seq * seq * mb  # attention scores + softmax + dropout mask
    return per / tp


def ep_buffer_bytes(cfg: ModelConfig, job: Job, lay: Layout) -> float:
    """Receive buffers for dispatch and combine of one micro-batch, double-buffered.

    Sized for T local tokens times min(K, ep) copies each (the average a rank receives under balanced
    routing is at most that), bf16 rows for dispatch and for combine, times 2 so two micro-batches can
    overlap (DeepEP sizes its buffers per call in the same spirit: num_nvl_bytes / num_rdma_bytes).
    """
    if lay.ep == 1 or not cfg.is_moe:
        return 0.0
    tokens = job.seq_len * lay.micro_batch / (lay.tp * lay.cp)
    copies = tokens * min(cfg.moe.top_k, lay.ep)
    return 2 * copies * cfg.dim * 2 * 2


def kv_width(cfg: ModelConfig) -> int:
    """Key plus value elements per token of one layer: GQA kv heads x 2 x head width; multi-head latent
    attention's per-head keys (no-RoPE + RoPE part) and values, as its core receives them."""
    if cfg.attention == "mla":
        return cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return 2 * cfg.kv_heads * cfg.hd


def cp_gathered_kv_bytes(cfg: ModelConfig, seq: int, mb: int, tp: int, cp: int) -> float:
    """bf16 keys and values one layer gathers from the other cp ranks and keeps for backward."""
    return 2 * seq * mb * kv_width(cfg) / tp * (cp - 1) / cp


def memory_per_gpu(job: Job, lay: Layout) -> dict[str, float]:
    """Memory in GB of the fullest pipeline rank, by part, plus 'total' and 'stage' (that rank's pp index)."""
    cfg, st = job.model, job.stats
    m = max(1, lay.num_micro_batches(job))
    # flash attention keeps no attention scores: without recomputation it holds what selective recomputation does
    ac = "selective" if lay.activation_checkpointing == "none" and job.flash_attention else lay.activation_checkpointing
    act_by_width = {w: layer_activation_bytes(cfg, w, job.seq_len, lay.micro_batch, lay.tp, ac)
                    for w in set(st.mlp_width)}
    best: dict[str, float] = {}
    for i, stages in enumerate(rank_stages(job, lay)):
        last = any(head for _, _, head in stages)
        layers = [j for span, _, _ in stages for j in span]  # every layer this rank holds
        parts = rank_model_state(job, lay, stages)
        parts["optimizer_step"] = 0.0
        muon = 0.0  # the Muon parameters of this rank's optimizer shard
        if job.optimizer == "muon":
            cost = muon_rank_cost(job, lay, rank_layers(job, stages))
            saved, gathered = muon_memory_bytes(cost)
            muon = cost["muon_params"]
            parts["optimizer"] -= saved
            parts["optimizer_step"] = gathered
        in_flight = schedule_in_flight(lay.pp_schedule, lay.pp, lay.stages_per_rank, i, m)
        acts = sum(act_by_width[st.mlp_width[j]] for j in layers) * in_flight
        if ac == "full" and len(layers):
            # recomputing one layer needs its full working set once more
            acts += layer_activation_bytes(cfg, st.mlp_width[layers[-1]], job.seq_len, lay.micro_batch,
                                           lay.tp, "selective")
        if last:
            # fp32 logits, of the main head and of each MTP depth, whose block is one more layer of activations
            acts += (1 + cfg.mtp_depth) * 4 * job.seq_len * lay.micro_batch * cfg.vocab_size / lay.tp
            acts += cfg.mtp_depth * act_by_width[st.mlp_width[-1]] * in_flight
        # context parallelism: S/cp tokens per rank, plus the gathered keys and values of the layers that keep
        # them (one at a time while recomputing under full checkpointing)
        kv_layers = min(1, len(layers)) if ac == "full" else len(layers) * in_flight
        parts["activations"] = acts / lay.cp + kv_layers * cp_gathered_kv_bytes(
            cfg, job.seq_len, lay.micro_batch, lay.tp, lay.cp)
        parts["ep_buffers"] = ep_buffer_bytes(cfg, job, lay)
        if lay.zero >= 3 and len(layers):
            # FSDP/ZeRO-3 gathers a layer's full weights, and prefetches the next one: 2 layers of bf16
            big = max(st.layer[j] - st.routed[j] * (1 - 1 / lay.ep) for j in layers)
            parts["zero3_gather"] = 2 * 2 * big / lay.tp
        else:
            parts["zero3_gather"] = 0.0
        host = 0.0
        if lay.offload == "params":
            host = sum(parts.pop(k) for k in ("params", "grads", "optimizer"))
            parts.update(params=0.0, grads=0.0, optimizer=0.0)
        elif lay.offload == "optimizer":  # AdamW: 16 bytes per parameter; Muon: its momentum and a gradient buffer
            host = (parts["optimizer"] - MUON_STATE_BYTES * muon) * 16 / 12 + 8 * muon
            parts.update(params=2 * parts["params"], grads=2 * parts["grads"], optimizer=0.0)
        parts = {k: v / GB for k, v in parts.items()}
        parts["reserved"] = RESERVED_GB
        parts["total"] = sum(parts.values())
        parts["host"] = host / GB  # not part of the device's total
        parts["stage"] = i
        if not best or parts["total"] > best["total"]:
            best = parts
    return best
