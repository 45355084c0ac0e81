"""Step time of one layout: compute, TP / EP / PP / DP communication, pipeline bubble.

- Compute: model FLOPs per token (6N + attention, Kaplan et al. 2020 sec. 2.1; ModelConfig.
  flops_per_token) at peak * efficiency, efficiency falling for small matmuls (GPU.efficiency *
  n / (n + GPU.half_tokens), an assumption), n = tokens per GPU per micro-batch, or for routed experts
  the tokens one expert receives, T * ep * K / E (the reason EP pays off: bigger grouped GEMMs).
  --precision fp8 / mxfp8 runs at the fp8 peak exactly what training.fp8 converts (moeflow.parallel.fp8:
  routed experts, attention projections, dense FFNs, shared experts) and the rest at the bf16 peak (routers,
  output head, attention scores, MTP modules' dense layers).
  Recomputation adds FLOPs: selective redoes the attention core forward, full redoes the whole forward
  (+1/3 of 6N; Korthikanti et al. 2022 sec. 5).
- Communication: alpha-beta per link class (Hockney 1994). Ring all-reduce moves 2(n-1)/n of the buffer
  per GPU, all-gather and reduce-scatter (n-1)/n each (Patarasuk & Yuan 2009; Thakur et al. 2005).
- TP with sequence parallelism (Korthikanti et al. 2022 sec. 4.2.2): per layer 2 all-gathers + 2
  reduce-scatters of s*b*h forward, the same backward; not overlapped with compute (assumption).
- EP: expected per-rank dispatch/combine copies under uniform routing from moeflow.sim.ep (the `rank`
  strategy inside a node, `node` across nodes), twice per layer for training; not overlapped.
- PP: 1F1B bubble, step = (m + p - 1) micro-batch times, bubble fraction (p-1)/(m+p-1) (Narayanan et
  al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", sec. 2.2.1), plus a
  point-to-point send of s*b*h/t per boundary per micro-batch, forward and backward.
- DP / ZeRO (Rajbhandari et al. 2020 sec. 7): ZeRO-1 reduces gradients and gathers weights once per step
  (all-reduce volume), overlapped with the last micro-batch's backward; ZeRO-2 reduce-scatters each
  micro-batch (overlapped with that backward) and gathers weights once per step; ZeRO-3 all-gathers the
  weights forward and backward and reduce-scatters gradients each micro-batch (1.5x all-reduce volume),
  overlapped with that micro-batch's compute. Only the part longer than its overlap window is exposed.
The optimizer step and data loading are not modelled.
"""

from __future__ import annotations

from functools import lru_cache

from moeflow.plan.layout import Job, Layout
from moeflow.plan.memory import stage_layers, stage_params
from moeflow.sim.ep import Links, expected_uniform_copies, row_bytes


def ring_time(nbytes: float, n: int, factor: float, bw_gbps: float, alpha: float) -> float:
    """Ring collective over n ranks moving factor*(n-1)/n of nbytes per GPU."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return alpha * (n - 1) * factor + factor * (n - 1) / n * nbytes / (bw_gbps * 1e9)


@lru_cache(maxsize=4096)
def _ep_copies(E: int, K: int, ep: int, rpn: int) -> tuple[str, float, float]:
    strategy = "node" if ep > rpn else "rank"
    intra, inter = expected_uniform_copies(E, K, ep, rpn, strategy)
    return strategy, intra, inter


def step_time(job: Job, lay: Layout) -> dict[str, float]:
    """Seconds per training step (and its parts) for the slowest pipeline stage."""
    cfg, gpu = job.model, job.gpu
    links = Links(job.intra, job.inter)
    m = lay.num_micro_batches(job)
    s, b, t = job.seq_len, lay.micro_batch, lay.tp
    peak = gpu.peak_flops(job.precision)
    peak_bf16 = gpu.peak_flops("bf16")
    tokens_mb = s * b  # tokens of one micro-batch of one data-parallel replica

    # ---- compute ------------------------------------------------------------------------
    st = job.stats
    fpt, attn = st.flops_per_token, st.attn_flops_per_token
    extra = {"none": 0.0, "selective": max(attn, 0.0) / 3, "full": fpt / 3}[lay.activation_checkpointing]
    eff_at = lambda n: gpu.efficiency * n / (n + gpu.half_tokens)
    n_per_gpu = tokens_mb / t
    eff = eff_at(n_per_gpu)
    routed = st.routed_flops_per_token
    # an expert sees the tokens of all ep ranks that picked it: T * ep * K / E rows on average
    n_expert = n_per_gpu * lay.ep * cfg.moe.top_k / cfg.moe.num_experts if cfg.is_moe else n_per_gpu
    recompute = (fpt + extra) / fpt  # recomputation scales every matmul alike (close enough)
    fp8_dense = st.fp8_dense_flops_per_token if job.precision != "bf16" else 0.0
    t_compute = tokens_mb / (t * lay.pp) * recompute * (
        (fpt - routed - fp8_dense) / (peak_bf16 * eff) + fp8_dense / (peak * eff) + routed / (peak * eff_at(n_expert)))

    stages = stage_layers(cfg.n_layers, lay.pp)
    layers_per_stage = max(len(r) for r in stages)
    moe_per_stage = max(sum(st.is_moe[i] for i in r) for r in stages)
    intra_tp = t <= job.gpus_per_node

    # ---- TP: 4 all-gather/reduce-scatter per layer forward, 4 backward, each (t-1)/t of s*b*h bf16 ----
    bw, alpha = (links.intra_gbps, links.alpha_intra_s) if intra_tp else (links.inter_gbps, links.alpha_inter_s)
    t_tp = 8 * layers_per_stage * ring_time(tokens_mb * cfg.dim * 2, t, 1.0, bw, alpha)

    # ---- EP ---------------------------------------------------------------------------------
    t_ep = 0.0
    if cfg.is_moe and lay.ep > 1:
        rpn = max(1, min(lay.ep, job.gpus_per_node // t))
        _, c_intra, c_inter = _ep_copies(cfg.moe.num_experts, cfg.moe.top_k, lay.ep, rpn)
        d_row, c_row = row_bytes(cfg.dim, cfg.moe.top_k, "bf16")  # training.fp8 converts matmuls, not the EP wire
        tok = tokens_mb / t
        per_layer = sum(links.time(tok * c_intra * row, tok * c_inter * row) for row in (d_row, c_row))
        t_ep = 2 * moe_per_stage * per_layer

    # ---- PP point-to-point ---------------------------------------------------------------------
    t_p2p = 0.0
    if lay.pp > 1:
        t_p2p = 2 * (links.alpha_inter_s + tokens_mb * cfg.dim * 2 / t / (links.inter_gbps * 1e9))

    t_mb = t_compute + t_tp + t_ep + t_p2p
    t_pipe = (m + lay.pp - 1) * t_mb

    # ---- DP / ZeRO ------------------------------------------------------------------------------
    per_stage = [stage_params(job, r, i == 0, i == lay.pp - 1) for i, r in enumerate(stages)]
    dense = max(d for d, _ in per_stage) / t
    expert = max(e for _, e in per_stage) / (lay.ep * t)
    spans = t * lay.dp_shard > job.gpus_per_node
    bw, alpha = (links.inter_gbps, links.alpha_inter_s) if spans else (links.intra_gbps, links.alpha_intra_s)
    groups = [(2 * dense, lay.dp_shard), (2 * expert, max(1, lay.dp_shard // lay.ep))]
    per_mb = per_step = 0.0
    for nbytes, n in groups:
        if lay.zero == 1:
            per_step += ring_time(nbytes, n, 2.0, bw, alpha)
        elif lay.zero == 2:
            per_mb += ring_time(nbytes, n, 1.0, bw, alpha)
            per_step += ring_time(nbytes, n, 1.0, bw, alpha)
        else:
            per_mb += ring_time(nbytes, n, 3.0, bw, alpha)
    if lay.dp_replicate > 1:  # HSDP: all-reduce each shard across replicas, across nodes
        for nbytes, n in groups:
            per_step += ring_time(nbytes / n, lay.dp_replicate, 2.0, links.inter_gbps, links.alpha_inter_s)
    t_dp = m * max(0.0, per_mb - t_compute) + max(0.0, per_step - 2 / 3 * t_compute)

    step = t_pipe + t_dp
    tokens_per_gpu = job.global_batch_tokens / job.world
    tps = tokens_per_gpu / step
    return {
        "step_s": step,
        "compute_s": m * t_compute,
        "tp_s": m * t_tp,
        "ep_s": m * t_ep,
        "pp_p2p_s": m * t_p2p,
        "bubble_s": (lay.pp - 1) * t_mb,
        "dp_exposed_s": t_dp,
        "bubble_fraction": (lay.pp - 1) / (m + lay.pp - 1),
        "matmul_efficiency": eff,
        "tokens_per_s_per_gpu": tps,
        "mfu": fpt * tps / peak,
    }
