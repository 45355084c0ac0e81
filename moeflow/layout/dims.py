"""ParallelDims: the sizes of one run's parallel layout and every rule they must satisfy (no torch import).

Sizes: dp_replicate x dp_shard x tp x pp = world size (dp_shard = -1 takes the rest). Expert parallelism
borrows its ep ranks from dp_shard, and each expert is FSDP-sharded over the remaining efsdp = dp_shard / ep
ranks. Every rule raises ValueError naming the setting, the value and a fix (docs/design.md, "errors").
The mesh itself is built from these sizes by moeflow.parallel.mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.errors import divisors
from moeflow.layout.schedules import default_stages_per_rank, resolve_schedule, validate_microbatches
from moeflow.models.config import ModelConfig

SIZE_KEYS = ("dp_replicate", "dp_shard", "tp", "pp", "ep")
MLA_TP_UNSUPPORTED = ("multi-head latent attention (model.attention = 'mla', DeepSeek-V2/V3) is not supported with "
                      "parallel.tp > 1 yet; use parallel.tp=1 with data and expert parallelism")


@dataclass(frozen=True)
class BatchSplit:
    """How one optimizer step's sequences are split on each data-parallel rank."""

    per_rank: int  # sequences per data-parallel rank per step
    microbatches: int  # forwards per step: pipeline micro-batches, or gradient-accumulation steps
    micro_batch: int  # sequences per forward (per_rank // microbatches)


@dataclass
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 3
    pp_schedule: str = "1F1B"

    def __post_init__(self):
        for key in ("dp_replicate", "tp", "pp", "ep"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key} must be at least 1, got {getattr(self, key)}")
        if self.world_size < 1:
            raise ValueError(f"the world size must be at least 1, got {self.world_size}")
        fixed = self.dp_replicate * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % fixed:
                raise ValueError(
                    f"parallel.dp_replicate x tp x pp = {self.dp_replicate} x {self.tp} x {self.pp} = {fixed} "
                    f"does not divide the world size ({self.world_size}); choose sizes whose product divides it"
                )
            self.dp_shard = self.world_size // fixed
        if self.dp_shard < 1 or fixed * self.dp_shard != self.world_size:
            raise ValueError(
                f"parallel sizes dp_replicate x dp_shard x tp x pp = {self.dp_replicate} x {self.dp_shard} x "
                f"{self.tp} x {self.pp} = {fixed * self.dp_shard} must equal the world size ({self.world_size}); "
                f"set --parallel.dp_shard=-1 to use the rest"
            )
        if self.dp_shard % self.ep:
            raise ValueError(
                f"parallel.ep ({self.ep}) must divide the data-parallel shard size (dp_shard = {self.dp_shard}), "
                f"whose ranks it borrows; choose ep in {divisors(self.dp_shard)}"
            )
        if self.zero not in (1, 2, 3):
            raise ValueError(f"parallel.zero = {self.zero}; use 1 (replicated parameters, sharded optimizer state), "
                             f"2 (FSDP2, parameters kept gathered between forward and backward) or 3 (FSDP2)")
        if self.zero == 1 and (self.dp < self.world_size or self.ep > 1):
            raise ValueError(f"parallel.zero = 1 with {self.describe()} is not supported yet: ZeRO-1 runs pure data "
                             f"parallelism only; use --parallel.zero=3 (or 2) with tp, pp or ep")
        self.pp_schedule = resolve_schedule(self.pp_schedule)

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Ranks each expert is FSDP-sharded over."""
        return self.dp_shard // self.ep

    @property
    def sizes(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in SIZE_KEYS}

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.sizes.items() if v > 1]
        return " x ".join(parts) if parts else "1 process"

    # ---- rules against the model and the batch ---------------------------------------------------------
    def check_model(self, cfg: ModelConfig) -> None:
        """The sizes against a moeflow model config (a Hugging Face model object is checked by parallelize)."""
        if self.ep > 1:
            if not cfg.is_moe:
                raise ValueError(f"parallel.ep = {self.ep} needs an MoE model; model {cfg.name!r} is dense")
            if cfg.moe.num_experts % self.ep:
                raise ValueError(
                    f"parallel.ep ({self.ep}) must divide model.moe.num_experts ({cfg.moe.num_experts}); "
                    f"choose ep in {divisors(cfg.moe.num_experts)}"
                )
            if cfg.moe.pad_to_capacity:
                raise ValueError(f"model.moe.pad_to_capacity with parallel.ep = {self.ep} is not supported yet (it "
                                 f"pads one process's experts); turn it off, or use ep = 1")
        if self.tp > 1:
            self._check_tp_widths(cfg)
            if cfg.mtp_depth:
                raise ValueError(f"model.mtp_depth = {cfg.mtp_depth} with parallel.tp = {self.tp} is not supported yet "
                                 f"(the MTP blocks have no tensor-parallel plan); use tp = 1 with data, expert and "
                                 f"pipeline parallelism")
        if self.pp > 1:
            stages = self.pp * default_stages_per_rank(self.pp_schedule)
            if self.pp > cfg.n_layers:
                raise ValueError(f"parallel.pp ({self.pp}) is larger than model.n_layers ({cfg.n_layers}); each "
                                 f"stage needs a layer")
            if stages > cfg.n_layers:
                raise ValueError(
                    f"parallel.pp ({self.pp}) with parallel.pp_schedule = {self.pp_schedule!r} makes {stages} "
                    f"stages for model.n_layers ({cfg.n_layers}); each stage needs a layer: lower parallel.pp"
                )
            if cfg.tie_embeddings:
                raise ValueError("model.tie_embeddings = true with parallel.pp > 1: the embedding and the output head "
                                 "live on different stages; set --model.tie_embeddings=false or parallel.pp = 1")

    def _check_tp_widths(self, cfg: ModelConfig) -> None:
        """tp divides the widths tensor parallelism shards: heads, kv heads and the dense FFN width (MoE layers
        are computed whole on every tp rank). Multi-head latent attention has no plan yet."""
        if cfg.attention == "mla":
            raise ValueError(MLA_TP_UNSUPPORTED)
        sizes = [("model.n_heads", cfg.n_heads), ("model.n_kv_heads", cfg.kv_heads)]
        if cfg.n_layers > cfg.num_moe_layers:
            sizes.append(("model.ffn_dim", cfg.ffn_dim))
        for name, value in sizes:
            if value % self.tp:
                raise ValueError(f"parallel.tp ({self.tp}) must divide {name} ({value}); "
                                 f"choose tp in {divisors(value)}")

    def split_batch(self, global_batch: int, micro_batch: int = 0, pp_microbatches: int = 0) -> BatchSplit:
        """Sequences per rank and per forward for `global_batch` sequences per step. micro_batch 0: the whole
        per-rank share in one forward (one sequence per pipeline micro-batch under pp); pp_microbatches 0:
        per-rank share / micro_batch."""
        if global_batch % self.dp:
            raise ValueError(
                f"training.global_batch ({global_batch}) must be divisible by the data-parallel size ({self.dp}); "
                f"use a multiple of {self.dp}"
            )
        per_rank = global_batch // self.dp
        micro = micro_batch or (1 if self.pp > 1 else per_rank)
        if per_rank % micro:
            raise ValueError(
                f"training.micro_batch ({micro}) must divide the per-rank batch ({per_rank} = global_batch / "
                f"{self.dp})"
            )
        if self.pp == 1:
            return BatchSplit(per_rank, per_rank // micro, micro)
        n = pp_microbatches or per_rank // micro
        validate_microbatches(per_rank, n, self.pp_schedule, self.pp)
        return BatchSplit(per_rank, n, per_rank // n)
