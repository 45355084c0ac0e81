"""ParallelDims: the sizes of one run's parallel layout and every rule they must satisfy (no torch import).

Sizes: dp_replicate x dp_shard x cp x tp x pp = world size (dp_shard = -1 takes the rest). Context
parallelism splits each sequence over its cp ranks, which see the same sequences (the data-parallel size is
dp_replicate x dp_shard) and hold the same weights (FSDP shards them over dp_shard x cp). Expert parallelism
borrows its ep ranks from dp_shard x cp, and each expert is FSDP-sharded over the remaining
efsdp = dp_shard x cp / ep ranks. With tensor parallelism the experts are also spread over the tp ranks
(ep_over_tp, Megatron's "MoE parallel folding"): the expert-parallel group is then ep x tp ranks and each rank
routes its sequence slice. Every rule raises ValueError naming the setting, the value and a fix
(docs/design.md, principle 3).
The mesh itself is built from these sizes by moeflow.parallel.mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeflow.core.errors import divisors
from moeflow.core.model_config import ModelConfig
from moeflow.core.schedules import default_stages_per_rank, resolve_schedule, validate_microbatches

SIZE_KEYS = ("dp_replicate", "dp_shard", "tp", "pp", "ep", "cp")
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
    ep_over_tp: bool = True
    cp: int = 1  # context parallel: ranks one sequence is split over

    def __post_init__(self):
        for key in ("dp_replicate", "tp", "pp", "ep", "cp"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key} must be at least 1, got {getattr(self, key)}")
        if self.world_size < 1:
            raise ValueError(f"the world size must be at least 1, got {self.world_size}")
        fixed = self.dp_replicate * self.tp * self.pp * self.cp
        cp_names, cp_sizes = (" x cp", f" x {self.cp}") if self.cp > 1 else ("", "")
        if self.dp_shard == -1:
            if self.world_size % fixed:
                raise ValueError(
                    f"parallel.dp_replicate x tp x pp{cp_names} = {self.dp_replicate} x {self.tp} x {self.pp}"
                    f"{cp_sizes} = {fixed} does not divide the world size ({self.world_size}); choose sizes whose "
                    f"product divides it"
                )
            self.dp_shard = self.world_size // fixed
        if self.dp_shard < 1 or fixed * self.dp_shard != self.world_size:
            raise ValueError(
                f"parallel sizes dp_replicate x dp_shard x tp x pp{cp_names} = {self.dp_replicate} x "
                f"{self.dp_shard} x {self.tp} x {self.pp}{cp_sizes} = {fixed * self.dp_shard} must equal the world "
                f"size ({self.world_size}); set --parallel.dp_shard=-1 to use the rest"
            )
        if (self.dp_shard * self.cp) % self.ep:
            borrowed = (f"(dp_shard = {self.dp_shard})" if self.cp == 1 else
                        f"times the context-parallel size (dp_shard x cp = {self.dp_shard} x {self.cp} = "
                        f"{self.dp_shard * self.cp})")
            raise ValueError(
                f"parallel.ep ({self.ep}) must divide the data-parallel shard size {borrowed}, whose ranks it "
                f"borrows; choose ep in {divisors(self.dp_shard * self.cp)}"
            )
        if self.zero not in (1, 2, 3):
            raise ValueError(f"parallel.zero = {self.zero}; use 1 (parameters gathered once per step, gradients and "
                             f"optimizer state sharded), 2 (parameters gathered from each forward to its backward) "
                             f"or 3 (parameters gathered per layer)")
        self.pp_schedule = resolve_schedule(self.pp_schedule)

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Ranks each expert is FSDP-sharded over (the rest of dp_shard x cp after ep)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def fold_experts(self) -> bool:
        """MoE layers route each tp rank's sequence slice and spread the experts over the tp ranks too."""
        return self.ep_over_tp and self.tp > 1

    @property
    def expert_parallel(self) -> int:
        """Ranks the experts are spread over: ep, times tp when folded."""
        return self.ep * self.tp if self.fold_experts else self.ep

    @property
    def moe_token_copies(self) -> int:
        """How many ranks route each token of a data-parallel rank: tp when the MoE runs whole on every tp rank."""
        return 1 if self.fold_experts else self.tp

    @property
    def sizes(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in SIZE_KEYS}

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.sizes.items() if v > 1]
        return " x ".join(parts) if parts else "1 process"

    # ---- rules against the model and the batch ---------------------------------------------------------
    def check_model(self, cfg: ModelConfig) -> None:
        """The sizes against a moeflow model config (a Hugging Face model object is checked by parallelize)."""
        if self.ep > 1 and not cfg.is_moe:
            raise ValueError(f"parallel.ep = {self.ep} needs an MoE model; model {cfg.name!r} is dense")
        if cfg.is_moe and cfg.moe.num_experts % self.expert_parallel:
            E = cfg.moe.num_experts
            if self.fold_experts:
                raise ValueError(
                    f"the experts are spread over parallel.ep x tp = {self.ep} x {self.tp} = {self.expert_parallel} "
                    f"ranks, which must divide model.moe.num_experts ({E}); choose ep x tp in {divisors(E)}, or "
                    f"set --parallel.ep_over_tp=false to compute the MoE layers whole on every tp rank"
                )
            raise ValueError(f"parallel.ep ({self.ep}) must divide model.moe.num_experts ({E}); "
                             f"choose ep in {divisors(E)}")
        if cfg.is_moe and self.expert_parallel > 1 and cfg.moe.pad_to_capacity:
            raise ValueError(f"model.moe.pad_to_capacity with expert parallelism (parallel.ep x tp folded = "
                             f"{self.expert_parallel} ranks) is not supported yet (it pads one process's experts); "
                             f"turn it off, or use ep = 1 (and parallel.ep_over_tp = false with tp > 1)")
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
        splits_sequences = self.cp > 1 or (self.fold_experts and self.tp > 1)
        if cfg.is_moe and cfg.moe.aux_loss_type == "sequence" and cfg.moe.aux_loss_coef > 0 and splits_sequences:
            raise ValueError(
                f"model.moe.aux_loss_type = 'sequence' with {'parallel.cp' if self.cp > 1 else 'parallel.tp'} = "
                f"{self.cp if self.cp > 1 else self.tp} is not supported yet: the sequence-wise balance loss needs "
                f"each sequence's routed tokens on one rank, and this layout splits them; use aux_loss_type = "
                f"'global_batch' or 'micro_batch'" + ("" if self.cp > 1 else ", or parallel.ep_over_tp = false"))
        if cfg.mtp_depth and self.cp > 1:
            raise ValueError(f"model.mtp_depth = {cfg.mtp_depth} with parallel.cp = {self.cp} is not supported yet "
                             f"(multi-token prediction shifts whole sequences, which cp splits); use cp = 1")

    def _check_tp_widths(self, cfg: ModelConfig) -> None:
        """tp divides the widths tensor parallelism shards: heads, kv heads and the dense FFN width (MoE layers
        are folded over tp, or whole on every tp rank with ep_over_tp = false). Multi-head latent attention has no
        plan yet."""
        if cfg.attention == "mla":
            raise ValueError(MLA_TP_UNSUPPORTED)
        sizes = [("model.n_heads", cfg.n_heads), ("model.n_kv_heads", cfg.kv_heads)]
        if cfg.n_layers > cfg.num_moe_layers:  # the dense FFN's width (an MoE's routes whole rows)
            sizes.append(("model.ffn_dim", cfg.ffn_dim))
        for name, value in sizes:
            if value % self.tp:
                raise ValueError(f"parallel.tp ({self.tp}) must divide {name} ({value}); "
                                 f"choose tp in {divisors(value)}")

    def check_sequence(self, seq_len: int) -> None:
        """Context parallelism cuts each sequence into 2 x cp equal chunks (rank r keeps chunks r and
        2cp - 1 - r: causal load balance); sequence parallelism then splits a rank's S / cp tokens over tp."""
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise ValueError(
                f"data.seq_len ({seq_len}) must be divisible by 2 x parallel.cp (= {2 * self.cp}): each sequence is "
                f"cut into 2 x cp equal chunks; use data.seq_len = {max(1, seq_len // (2 * self.cp)) * 2 * self.cp}"
            )
        if self.cp == 1 and seq_len % self.tp:
            raise ValueError(f"data.seq_len ({seq_len}) must be divisible by parallel.tp ({self.tp}) with sequence "
                             f"parallelism (each tp rank keeps S / tp positions between the blocks); use data.seq_len "
                             f"= {max(1, seq_len // self.tp) * self.tp}")
        if self.cp > 1 and self.tp > 1 and (seq_len // self.cp) % self.tp:
            raise ValueError(
                f"data.seq_len / parallel.cp ({seq_len} / {self.cp} = {seq_len // self.cp} tokens per rank) must be "
                f"divisible by parallel.tp ({self.tp}) with sequence parallelism; use a data.seq_len divisible by "
                f"{2 * self.cp * self.tp // math.gcd(2, self.tp)}"
            )

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
