"""Step time of one layout: compute per operation, TP / EP / PP / DP communication, the schedule's bubble.

- Compute: moeflow.plan.compute (matmuls on the roofline at the measured large-matmul efficiency, flash
  attention, memory-bound elementwise work), per layer and micro-batch, summed over the layers each pipeline
  rank holds under the schedule's placement (moeflow.core.schedules.pipeline_layout, the trainer's split).
- Communication: alpha-beta per link class (Hockney 1994). Ring all-reduce moves 2(n-1)/n of the buffer per
  GPU, all-gather and reduce-scatter (n-1)/n each (Patarasuk & Yuan 2009; Thakur et al. 2005).
- TP with sequence parallelism (Korthikanti et al. 2022 sec. 4.2.2): a dense layer all-gathers and
  reduce-scatters s*b*h twice forward and twice backward; an MoE layer once each (its tokens enter the MoE as
  the sequence-parallel shard); full recomputation repeats the forward ones. Not overlapped (assumption).
- EP: expected per-rank dispatch/combine copies under uniform routing from moeflow.sim.ep (the `rank` strategy
  inside a node, `node` across nodes), forward and backward. Overlapped as the trainer does it
  (`Job.ep_chunks`, its `parallel.ep_overlap_chunks`; 0 for `parallel.ep_overlap = false`): inside the layer,
  behind the shared experts and the other chunks' experts (moeflow.plan.overlap). Or, under `Job.ep_overlap`
  (DualPipe, which the trainer does not run), hidden up to the rank's compute of a micro-batch, which slows by
  the SMs the communication kernels hold (20 of an H800's 132, DeepSeek-V3 report sec. 3.2.2). Full
  recomputation repeats the forward's dispatch and combine in backward.
- CP (context parallelism, `cp_seconds`): each cp rank computes 1/cp of every sequence (balanced causal chunks),
  and per layer all-gathers the whole sequence's K and V forward and reduce-scatters their gradients backward,
  not overlapped.
- PP: the schedule's bubble (moeflow.plan.schedule) from the slowest rank's forward / input-gradient /
  weight-gradient seconds, plus a point-to-point send of the s*b*h/t activation per stage boundary per
  micro-batch, forward and backward.
- DP / ZeRO, as the trainer runs them (bf16 parameter all-gathers, fp32 gradient reduce-scatters:
  moeflow.parallel.fsdp's MixedPrecisionPolicy, which keeps fp32 gathers for the stage roots (embedding, head),
  norms, router gates, chunked experts, and all under zero-bubble schedules or torch.compile: charged here at bf16
  too; no gradient reduction between micro-batches): ZeRO-1 reduces
  gradients and gathers parameters once per step (Megatron-Core's distributed optimizer); ZeRO-2 gathers the
  parameters for each micro-batch's forward, ZeRO-3 for its forward and its backward; under the zero-bubble
  schedules both gather once per step (parameters stay gathered, moeflow.parallel.pipeline). Gathers overlap
  their micro-batch's compute, the step's reduce-scatter the last backward and the step's gather the first
  forward; only what exceeds its window is exposed. HSDP all-reduces each shard across replicas.
- ZeRO-Offload (`Layout.offload`): under 'params' (ZeRO-3 only) per micro-batch each fp32 weight shard crosses
  PCIe to the device for the forward's gather and again for the backward's (FSDP2 copies the shard, then
  gathers), and each fp32 gradient shard back after its reduce-scatter; under 'optimizer' once per step each fp32
  gradient shard of the optimizer's crosses to the host and its updated fp32 weights back. Either way the AdamW
  step runs on the host, memory-bound: 28 bytes per parameter of its shard (read weight, gradient, two moments;
  write weight and moments) at the GPU's `host_step_gbps`. Muon's parameters instead take 24 bytes there (two
  passes, each reading gradient and momentum: the momentum's update, then Nesterov's update matrix), their fp32
  update crosses to the device for Newton-Schulz (in place of the weights under 'optimizer'; under 'params' also
  its bf16 result back, and the weight's decay and update on the host: 26 bytes more). Not overlapped (an upper
  bound).
- The optimizer: AdamW's step (elementwise, on each shard) and data loading are not modelled; Muon adds its
  Newton-Schulz FLOPs and its gathers of whole matrices after backward (moeflow.plan.optimizer), not overlapped.
"""

from __future__ import annotations

from moeflow.plan.compute import ATTENTION_EFFICIENCY, FBW, Rates, head_cost, layer_cost, moe_matmul_seconds
from moeflow.plan.layout import Job, Layout
from moeflow.plan.memory import kv_width, rank_model_state, rank_stages, stage_params
from moeflow.plan.optimizer import muon_rank_cost, muon_seconds, rank_layers
from moeflow.plan.overlap import exposed_ep_seconds
from moeflow.plan.schedule import ZERO_BUBBLE, bubble_seconds
from moeflow.sim.ep import Links, expected_uniform_copies, row_bytes

COMM_SM_SHARE = 20 / 132
"""Share of the SMs EP communication kernels hold while overlapping compute (DeepSeek-V3 sec. 3.2.2)."""


def ring_time(nbytes: float, n: int, factor: float, bw_gbps: float, alpha: float) -> float:
    """Ring collective over n ranks moving factor*(n-1)/n of nbytes per GPU."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return alpha * (n - 1) * factor + factor * (n - 1) / n * nbytes / (bw_gbps * 1e9)


def rates(job: Job, precision: str | None = None) -> Rates:
    """The GPU's rates with matmuls in `precision` (default the job's)."""
    gpu, k, precision = job.gpu, job.kernel_efficiency, precision or job.precision
    return Rates(matmul_flops=k * gpu.peak_flops(precision) * gpu.matmul_fraction(precision),
                 attention_flops=k * gpu.peak_flops("bf16") * ATTENTION_EFFICIENCY,
                 hbm_bytes=k * gpu.hbm_gbps * 1e9, matmul_elt=1 if precision in ("fp8", "mxfp8") else 2)


def _layer_costs(job: Job, lay: Layout) -> tuple[FBW, FBW, FBW]:
    """(dense layer, MoE layer, output head) compute for one micro-batch, cached per job."""
    key = ("cost", lay.micro_batch, lay.tp, lay.ep, lay.activation_checkpointing, job.precision,
           job.kernel_efficiency, job.flash_attention)
    cache = job.stats.cache
    if key not in cache:
        cfg, r, s, b, t = job.model, rates(job), job.seq_len, lay.micro_batch, lay.tp
        ac, ep = lay.activation_checkpointing, lay.ep
        fa = job.flash_attention
        cache[key] = (layer_cost(cfg, False, s, b, t, ep, ac, r, fa),
                      layer_cost(cfg, True, s, b, t, ep, ac, r, fa) if cfg.is_moe else FBW(),
                      head_cost(cfg, s, b, t, rates(job, "bf16")))  # training.fp8 keeps the head in bf16
    return cache[key]


def _ep_moves(job: Job, lay: Layout, chunks: int = 1) -> tuple[float, float, float]:
    """(dispatch, combine, count exchange) seconds of one chunk of one MoE layer's forward for one micro-batch,
    its tokens split into `chunks` chunks (the backward moves the same bytes the other way)."""
    cfg = job.model
    key = ("ep", lay.micro_batch, lay.tp, lay.ep, job.intra, job.inter, chunks)
    cache = job.stats.cache
    if key not in cache:
        links = Links(job.intra, job.inter)
        rpn = max(1, min(lay.ep, job.gpus_per_node // lay.tp))
        strategy = "node" if lay.ep > rpn else "rank"
        c_intra, c_inter = expected_uniform_copies(cfg.moe.num_experts, cfg.moe.top_k, lay.ep, rpn, strategy)
        d_row, c_row = row_bytes(cfg.dim, cfg.moe.top_k, "bf16")  # training.fp8 converts matmuls, not the EP wire
        tok = job.seq_len * lay.micro_batch / lay.tp / max(chunks, 1)
        # the count exchange: an all-gather of (1 + ranks + nodes + experts) int64 per rank (moeflow.ep.Buffer)
        counts = 8 * lay.ep * (1 + lay.ep + lay.ep // rpn + cfg.moe.num_experts)
        cache[key] = (*(links.time(tok * c_intra * row, tok * c_inter * row) for row in (d_row, c_row)),
                      links.time(counts, 0) if lay.ep <= rpn else links.time(0, counts))
    return cache[key]


def moe_layer_projection(job: Job, lay: Layout, chunks: int) -> dict:
    """One MoE layer, forward + backward of one micro-batch per rank, as the trainer overlaps its expert-parallel
    communication in `chunks` chunks (0: no overlap; moeflow.plan.overlap): its unchunked compute, and the
    seconds forward and backward take beyond it."""
    dispatch, combine, counts = _ep_moves(job, lay, chunks)
    tokens, r = job.seq_len * lay.micro_batch / lay.tp, rates(job)
    _, shared, routed = moe_matmul_seconds(job.model, tokens, lay.ep, r)
    chunk = moe_matmul_seconds(job.model, tokens / max(chunks, 1), lay.ep, r)[2]
    zero_bubble = lay.pp > 1 and lay.pp_schedule in ZERO_BUBBLE
    fwd, bwd = exposed_ep_seconds(dispatch, chunk, combine, shared, chunks, routed,
                                  None if job.ep_static_sizes else counts, 1.0 if zero_bubble else 2.0)
    compute = 3 * (routed + shared)
    return {"chunks": chunks, "compute_s": compute, "forward_s": fwd, "backward_s": bwd,
            "layer_s": compute + fwd + bwd}


def _ep_exposed(job: Job, lay: Layout) -> tuple[float, float]:
    """(forward, backward) expert-parallel seconds one MoE layer adds to one micro-batch: per the trainer's overlap
    (`Job.ep_chunks`), or under `Job.ep_overlap` all of it (the caller hides it behind another micro-batch)."""
    if not job.model.is_moe or lay.ep == 1:
        return 0.0, 0.0
    if job.ep_overlap:
        dispatch, combine, _ = _ep_moves(job, lay)
        return dispatch + combine, dispatch + combine
    p = moe_layer_projection(job, lay, job.ep_chunks)
    return p["forward_s"], p["backward_s"]


def _ranks(job: Job, lay: Layout) -> list[tuple]:
    """The distinct pipeline ranks under the trainer's split and the schedule's placement:
    (dense layers, MoE layers, holds the head, stages, non-expert params, routed-expert params)."""
    key = ("ranks", lay.pp, lay.pp_schedule, lay.stages_per_rank)
    cache = job.stats.cache
    if key not in cache:
        per_rank = rank_stages(job, lay)
        kinds = set()
        for stages in per_rank:
            n_moe = sum(job.stats.is_moe[i] for layers, _, _ in stages for i in layers)
            n_all = sum(len(layers) for layers, _, _ in stages)
            params = [stage_params(job, layers, embed, head) for layers, embed, head in stages]
            kinds.add((n_all - n_moe, n_moe, any(h for _, _, h in stages), len(stages),
                       sum(d for d, _ in params), sum(e for _, e in params)))
        cache[key] = sorted(kinds)
    return cache[key]


def _rank_micro_batch(job: Job, lay: Layout, rank: tuple, links: Links) -> dict:
    """One rank's seconds per micro-batch: compute F/B/W, TP, EP (exposed) and point-to-point."""
    cfg = job.model
    n_dense, n_moe, has_head, n_stages = rank[:4]
    dense, moe, head = _layer_costs(job, lay)
    if has_head and cfg.mtp_depth:  # each MTP depth: one more block (an MoE one in an MoE model) and the head again
        n_moe, n_dense = (n_moe + cfg.mtp_depth, n_dense) if cfg.is_moe else (n_moe, n_dense + cfg.mtp_depth)
    comp = dense.scale(n_dense) + moe.scale(n_moe)
    if has_head:
        comp = comp + head.scale(1 + cfg.mtp_depth)
    # context parallelism: each cp rank computes 1/cp of every sequence (load-balanced causal chunks: the attention
    # too), and moves 1/cp of its activations
    comp = comp.scale(1 / lay.cp)
    t, s, b = lay.tp, job.seq_len / lay.cp, lay.micro_batch
    tp = 0.0
    if t > 1:
        bw, alpha = ((links.intra_gbps, links.alpha_intra_s) if t <= job.gpus_per_node
                     else (links.inter_gbps, links.alpha_inter_s))
        one = ring_time(s * b * cfg.dim * 2, t, 1.0, bw, alpha)
        tp = one * (4 * n_dense + 2 * n_moe)  # forward collectives; the backward has as many
    tp_f, tp_b = tp, tp * (2 if lay.activation_checkpointing == "full" else 1)
    ep_f, ep_b = (n_moe / lay.cp * s for s in _ep_exposed(job, lay))
    if job.ep_overlap and ep_f > 0:
        comp = comp.scale(1 / (1 - COMM_SM_SHARE))
        ep_f = ep_b = max(0.0, ep_f + ep_b - comp.total) / 2
    if lay.activation_checkpointing == "full":
        ep_b += ep_f  # the recomputed forward dispatches and combines again
    p2p = 0.0
    if lay.pp > 1:
        p2p = n_stages * (links.alpha_inter_s + s * b * cfg.dim * 2 / t / (links.inter_gbps * 1e9))
    cp_f, cp_b = cp_seconds(job, lay, n_dense + n_moe, links)
    fbw = FBW(comp.f + tp_f + ep_f + p2p + cp_f, comp.b + tp_b + ep_b + p2p + cp_b, comp.w)
    return {"fbw": fbw, "comp": comp, "tp": tp_f + tp_b, "ep": ep_f + ep_b, "p2p": 2 * p2p, "cp": cp_f + cp_b}


def cp_seconds(job: Job, lay: Layout, layers: int, links: Links) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of context parallelism's collectives (moeflow.parallel.context)
    for `layers` layers: per layer an all-gather of the whole sequence's bf16 keys and values (this tp rank's
    heads) over the cp ranks, a reduce-scatter of their gradients in backward, and one more all-gather when full
    activation checkpointing recomputes the forward. Ring volumes (cp-1)/cp of the whole buffer; inside a node when
    cp x tp GPUs fit in one (cp sits next to tp in the mesh); not overlapped with compute (an assumption)."""
    if lay.cp == 1:
        return 0.0, 0.0
    kv_bytes = 2 * job.seq_len * lay.micro_batch * kv_width(job.model) / lay.tp
    intra = lay.cp * lay.tp <= job.gpus_per_node
    bw, alpha = (links.intra_gbps, links.alpha_intra_s) if intra else (links.inter_gbps, links.alpha_inter_s)
    one = layers * ring_time(kv_bytes, lay.cp, 1.0, bw, alpha)
    return one, one * (2 if lay.activation_checkpointing == "full" else 1)


def _dp_exposed(job: Job, lay: Layout, m: int, rank: tuple, comp: FBW, links: Links) -> float:
    """Exposed data-parallel seconds per step for one pipeline rank (module doc); `comp` is its compute per
    micro-batch (collectives overlap computation, not other communication)."""
    dense, expert = rank[4:]
    t = lay.tp
    d_shard = lay.dp_shard * lay.cp  # FSDP shards over the data- and context-parallel ranks
    groups = [(dense / t, d_shard), (expert / (lay.ep * t), max(1, d_shard // lay.ep))]
    spans = t * d_shard > job.gpus_per_node
    bw, alpha = (links.inter_gbps, links.alpha_inter_s) if spans else (links.intra_gbps, links.alpha_intra_s)
    gather = lambda n_params, n: ring_time(2 * n_params, n, 1.0, bw, alpha)  # bf16 parameters
    reduce = lambda n_params, n: ring_time(4 * n_params, n, 1.0, bw, alpha)  # fp32 gradients
    gathers_per_mb = 0 if (lay.zero == 1 or (lay.pp > 1 and lay.pp_schedule in ZERO_BUBBLE)) else lay.zero - 1
    per_mb = sum(gathers_per_mb * gather(p, n) for p, n in groups)
    step_reduce = sum(reduce(p, n) for p, n in groups)
    step_gather = 0.0 if gathers_per_mb else sum(gather(p, n) for p, n in groups)
    if lay.dp_replicate > 1:  # HSDP: all-reduce each shard's fp32 gradients across replicas, across nodes
        step_reduce += sum(ring_time(4 * p / n, lay.dp_replicate, 2.0, links.inter_gbps, links.alpha_inter_s)
                           for p, n in groups)
    return (m * max(0.0, per_mb - comp.total) + max(0.0, step_reduce - (comp.b + comp.w))
            + max(0.0, step_gather - comp.f))


def optimizer_seconds(job: Job, lay: Layout, links: Links) -> float:
    """What the optimizer adds to the step beyond AdamW's (unmodelled) one: Muon's Newton-Schulz and gathers on
    the slowest pipeline rank (moeflow.plan.optimizer), after its backward."""
    if job.optimizer != "muon":
        return 0.0
    matmul = rates(job, "bf16").matmul_flops
    return max(muon_seconds(muon_rank_cost(job, lay, rank_layers(job, stages)), links, matmul)
               for stages in rank_stages(job, lay))


def offload_seconds(job: Job, lay: Layout, micro_batches: int) -> float:
    """PCIe copies and the host's optimizer step per step under ZeRO-Offload, on the rank with the largest shard
    (module doc)."""
    if lay.offload == "none":
        return 0.0

    def seconds(stages) -> float:
        # the parameters of the optimizer's shard (12 bytes of AdamW state each), and how many of them are Muon's
        shard = rank_model_state(job, lay, stages)["optimizer"] / 12
        muon = muon_rank_cost(job, lay, rank_layers(job, stages))["muon_params"] if job.optimizer == "muon" else 0
        if lay.offload == "params":
            copied = 3 * micro_batches * 4 * shard + (4 + 2) * muon  # Muon: its update up, the bf16 result down
            host = 28 * (shard - muon) + (24 + 26) * muon  # Muon: the momentum step, then the weight's update
        else:
            copied = 8 * shard
            host = 28 * (shard - muon) + 24 * muon
        return copied / (job.gpu.pcie_gbps * 1e9) + host / (job.gpu.host_step_gbps * 1e9)
    return max(seconds(stages) for stages in rank_stages(job, lay))


def step_time(job: Job, lay: Layout) -> dict[str, float]:
    """Seconds per training step (and its parts) for the slowest pipeline rank."""
    links = Links(job.intra, job.inter)
    m = lay.num_micro_batches(job)
    per_rank = [(rank, _rank_micro_batch(job, lay, rank, links)) for rank in _ranks(job, lay)]
    slow = max((r for _, r in per_rank), key=lambda r: r["fbw"].total)
    fbw = slow["fbw"]
    bubble = bubble_seconds(lay.pp_schedule, lay.pp, lay.stages_per_rank, fbw)
    t_pipe = m * fbw.total + bubble
    t_dp = max(_dp_exposed(job, lay, m, rank, r["comp"], links) for rank, r in per_rank)
    t_opt = optimizer_seconds(job, lay, links)
    t_off = offload_seconds(job, lay, m)
    step = t_pipe + t_dp + t_opt + t_off
    tps = job.global_batch_tokens / job.world / step
    return {
        "step_s": step,
        "compute_s": m * slow["comp"].total,
        "tp_s": m * slow["tp"],
        "ep_s": m * slow["ep"],
        "pp_p2p_s": m * slow["p2p"],
        "cp_s": m * slow["cp"],
        "bubble_s": bubble,
        "dp_exposed_s": t_dp,
        "optimizer_s": t_opt,
        "offload_s": t_off,
        "bubble_fraction": bubble / t_pipe if t_pipe else 0.0,
        "tokens_per_s_per_gpu": tps,
        "mfu": job.stats.flops_per_token * tps / job.gpu.peak_flops(job.precision),
    }
