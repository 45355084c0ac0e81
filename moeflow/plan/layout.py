"""The job being planned and one candidate parallel layout (plain dataclasses)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from moeflow.core.choices import PLANNED_ACTIVATION_CHECKPOINTING
from moeflow.core.hardware import GPU
from moeflow.core.model_config import ModelConfig
from moeflow.core.parallel_dims import SIZE_KEYS, ParallelDims
from moeflow.core.schedules import SCHEDULES
from moeflow.plan.compute import KERNEL_EFFICIENCY

AC_MODES = PLANNED_ACTIVATION_CHECKPOINTING


class ModelStats:
    """Per-layer counts computed once per job (the search scores tens of thousands of layouts)."""

    def __init__(self, cfg: ModelConfig, seq_len: int):
        moe = cfg.moe
        self.cache: dict = {}  # stage sums keyed by (first layer, end layer, has embedding, has head)
        self.routed = [moe.num_experts * 3 * cfg.dim * moe.ffn_dim if cfg.is_moe_layer(i) else 0
                       for i in range(cfg.n_layers)]
        self.layer = [cfg.layer_params(i) for i in range(cfg.n_layers)]
        self.mlp_width = [moe.top_k * moe.ffn_dim + moe.shared_width if cfg.is_moe_layer(i) else cfg.ffn_dim
                          for i in range(cfg.n_layers)]
        self.is_moe = [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
        # What every tp rank holds whole (the trainer's plan): the norms, and an MoE layer's router (the MoE takes
        # each rank's sequence slice; its routed experts are spread over ep x tp). Its shared experts are not: data-
        # parallel over tp, they are sharded over dp x cp x tp (moeflow.parallel.fsdp), as tp-split weights are.
        qk_norms = 2 * cfg.hd if cfg.qk_norm == "per_head" else 0
        self.tp_whole = [2 * cfg.dim + qk_norms + (cfg.dim * moe.num_experts if cfg.is_moe_layer(i) else 0)
                         for i in range(cfg.n_layers)]
        self.flops_per_token = cfg.flops_per_token(seq_len)
        n_matmul = cfg.num_active_params() - cfg.vocab_size * cfg.dim * (1 - cfg.tie_embeddings) - cfg.dim
        n_matmul += cfg.mtp_depth * cfg.vocab_size * cfg.dim  # the head, once more per MTP depth
        self.attn_flops_per_token = self.flops_per_token - 6.0 * n_matmul  # the attention-score term
        # routed-expert matmuls run as grouped GEMMs whose row count is tokens per expert, not per GPU
        moe_blocks = sum(self.is_moe) + (cfg.mtp_depth if cfg.is_moe else 0)
        self.routed_flops_per_token = 6.0 * moe.top_k * 3 * cfg.dim * moe.ffn_dim * moe_blocks
        # what training.fp8 computes in FP8 besides the routed experts (moeflow.parallel.fp8): the decoder layers'
        # attention projections, dense FFNs and shared experts; not the routers, the head, the MTP modules' dense
        # layers, nor the attention scores (norm weights, counted in attention_params, are negligible here)
        dense_ffn = sum(3 * cfg.dim * (moe.shared_width if m else cfg.ffn_dim) for m in self.is_moe)
        self.fp8_dense_flops_per_token = 6.0 * (cfg.n_layers * cfg.attention_params() + dense_ffn)
        # MTP modules sit with the head on the last stage: their parameters (dense part, routed experts)
        mtp_routed = moe.num_experts * 3 * cfg.dim * moe.ffn_dim if cfg.is_moe else 0
        self.mtp_params = (cfg.mtp_params() - cfg.mtp_depth * mtp_routed, cfg.mtp_depth * mtp_routed)


@dataclass
class Job:
    model: ModelConfig
    gpu: GPU
    nodes: int
    gpus_per_node: int
    seq_len: int
    global_batch_tokens: int
    precision: str = "bf16"
    intra_gbps: float | None = None
    inter_gbps: float | None = None
    kernel_efficiency: float = KERNEL_EFFICIENCY
    """Fraction of the isolated-kernel rates a training step reaches (moeflow.plan.compute.KERNEL_EFFICIENCY)."""
    flash_attention: bool = True
    """The attention scores are never materialized (flash attention: what torch's scaled_dot_product_attention,
    which the trainer calls, runs on GPUs). False models Megatron-LM before flash attention (moeflow.plan.compute)."""
    ep_chunks: int = 1
    """The trainer's expert-parallel overlap inside the MoE layer (moeflow.plan.overlap): its tokens in this many
    chunks, one chunk's dispatch and another's combine in flight while a chunk's experts compute, the first
    dispatch behind the shared experts. The trainer's `parallel.ep_overlap_chunks` (default 1); 0 for
    `parallel.ep_overlap = false`."""
    ep_static_sizes: bool = False
    """The trainer's `parallel.ep_num_worst_tokens = -1`: static receive sizes, so a dispatch does not wait on the
    host for its counts (moeflow.plan.overlap); false is the default exact sizes, one host sync per dispatch."""
    ep_overlap: bool = False
    """Expert-parallel dispatch/combine runs while another micro-batch computes (DualPipe, DeepSeek-V3 report
    sec. 3.2.1), hidden up to that compute (moeflow.plan.time). The trainer does not schedule micro-batches
    this way; this models published runs that do. Replaces `ep_chunks` when set."""
    optimizer: str = "adamw"
    """The trainer's training.optimizer: 'adamw' (the baseline: its step is not modelled) or 'muon', whose state,
    Newton-Schulz FLOPs and gathers the plan adds (moeflow.plan.optimizer)."""
    ns_steps: int = 5
    """Muon's Newton-Schulz iterations (training.muon_ns_steps)."""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @cached_property
    def stats(self) -> ModelStats:
        return ModelStats(self.model, self.seq_len)

    @property
    def intra(self) -> float:
        return self.gpu.intra_gbps if self.intra_gbps is None else self.intra_gbps

    @property
    def inter(self) -> float:
        return self.gpu.inter_gbps if self.inter_gbps is None else self.inter_gbps

    def validate(self) -> Job:
        for key in ("nodes", "gpus_per_node", "seq_len", "global_batch_tokens"):
            if getattr(self, key) <= 0:
                raise ValueError(f"--{key.replace('_', '-')} must be positive, got {getattr(self, key)}")
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(
                f"--global-batch-tokens ({self.global_batch_tokens}) must be a multiple of --seq-len "
                f"({self.seq_len}); use {self.global_batch_tokens // self.seq_len * self.seq_len or self.seq_len}"
            )
        seqs = self.global_batch_tokens // self.seq_len
        if seqs < self.world:
            # every GPU group needs at least one sequence unless tp/pp absorb the difference; only say so
            # when even the deepest model split cannot use all GPUs
            max_split = self.gpus_per_node * self.model.n_layers
            if seqs * max_split < self.world:
                raise ValueError(
                    f"--global-batch-tokens ({self.global_batch_tokens}) is {seqs} sequences of {self.seq_len}, "
                    f"too few for {self.world} GPUs; raise it to at least "
                    f"{self.world // max_split * self.seq_len} or use fewer --nodes"
                )
        if not 0 <= self.ep_chunks <= self.seq_len:
            raise ValueError(f"--ep-chunks must be 0 (no overlap) to --seq-len ({self.seq_len}), got "
                             f"{self.ep_chunks}; the trainer's default is 1")
        for flag, value in (("--intra-gbps", self.intra_gbps), ("--inter-gbps", self.inter_gbps)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} must be a positive number of GB/s, got {value}; leave it out for the "
                                 f"GPU's own ({self.gpu.name})")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"--optimizer {self.optimizer!r}: use 'adamw' or 'muon'")
        if self.ns_steps < 1:
            raise ValueError(f"--ns-steps must be at least 1, got {self.ns_steps}; Muon's default is 5")
        self.gpu.peak_flops(self.precision)  # raises for fp8 on a part without fp8
        if self.gpu.hbm_gbps <= 0:
            raise ValueError(f"GPU {self.gpu.name!r} has no memory bandwidth (hbm_gbps = {self.gpu.hbm_gbps}); the "
                             f"time model needs it: give the GPU entry its HBM GB/s")
        return self


def _size(name: str) -> property:
    return property(lambda self: getattr(self.dims, name), doc=f"dims.{name}")


@dataclass(frozen=True)
class Layout:
    """One candidate the planner scores: the parallel sizes, as the ParallelDims the trainer checks (so a layout
    the planner lists is one `moeflow train` accepts), and the choices that change memory and time but not which
    rank does what."""

    dims: ParallelDims
    micro_batch: int
    activation_checkpointing: str  # one of AC_MODES
    virtual_stages: int = 0  # pipeline stages per rank; 0 = the schedule's default (what the trainer runs)
    offload: str = "none"  # parallel.offload: 'optimizer' or 'params' state in host memory (moeflow.plan.memory)

    dp_replicate, dp_shard, tp, pp, ep = (_size(n) for n in ("dp_replicate", "dp_shard", "tp", "pp", "ep"))
    zero, cp, dp, world = (_size(n) for n in ("zero", "cp", "dp", "world_size"))
    pp_schedule = _size("pp_schedule")  # only matters with pp > 1

    def with_dims(self, **sizes) -> Layout:
        """This layout with some sizes changed (checked again)."""
        return replace(self, dims=replace(self.dims, **sizes))

    @property
    def stages_per_rank(self) -> int:
        if self.pp == 1:
            return 1
        return self.virtual_stages or (1 if SCHEDULES[self.pp_schedule].placement == "single" else 2)

    @property
    def schedule_label(self) -> str:
        """'-' without pipelining, else the schedule, with its stages per rank when they are a choice."""
        if self.pp == 1:
            return "-"
        loop = SCHEDULES[self.pp_schedule].placement == "loop"
        return f"{self.pp_schedule} v{self.stages_per_rank}" if loop else self.pp_schedule

    def num_micro_batches(self, job: Job) -> int:
        """Micro-batches per step per pipeline: global batch = dp * m * micro_batch * seq_len."""
        seqs_per_replica, rem = divmod(job.global_batch_tokens // job.seq_len, self.dp * self.micro_batch)
        return 0 if rem else seqs_per_replica

    def as_dict(self) -> dict:
        """The layout as one flat record (plan --json)."""
        sizes = {key: getattr(self.dims, key) for key in (*SIZE_KEYS, "zero", "pp_schedule")}
        return {**sizes, "micro_batch": self.micro_batch, "activation_checkpointing": self.activation_checkpointing,
                "virtual_stages": self.virtual_stages, "stages_per_rank": self.stages_per_rank,
                "offload": self.offload}

    def short(self) -> str:
        sched = "" if self.pp == 1 else f" {self.schedule_label}"
        return (f"dp{self.dp_replicate}x{self.dp_shard} tp{self.tp} pp{self.pp}{sched} ep{self.ep} "
                f"{f'cp{self.cp} ' if self.cp > 1 else ''}"
                f"z{self.zero} mb{self.micro_batch} ac={self.activation_checkpointing}"
                f"{'' if self.offload == 'none' else f' offload={self.offload}'}")
