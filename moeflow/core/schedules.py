"""Pipeline schedules and stage splits as data (no torch import): what the trainer runs and the planner costs.

A schedule is described by where its stages sit and what it asks of the micro-batches; the torch classes
that run it are attached in moeflow.parallel.pipeline. A split is the global layer indices of each stage, so
parameter names stay those of the full model (docs/design.md, "plans are data").

How stages map to pp ranks (pp = 2, 8 layers shown):

  single (GPipe, 1F1B)          1 stage per rank; rank r holds stage r
      rank 0: stage 0 = embed + layers 0-3          rank 1: stage 1 = layers 4-7 + norm + output
  loop   (Interleaved1F1B,      `stages_per_rank` stages (default 2); rank r holds r, r + pp, r + 2pp, ...
          LoopedBFS,              rank 0: stage 0 = embed + layers 0-1, stage 2 = layers 4-5
          InterleavedZeroBubble)  rank 1: stage 1 = layers 2-3, stage 3 = layers 6-7 + norm + output
  v      (ZBVZeroBubble,        exactly 2 stages per rank; rank r holds r and 2pp - 1 - r, so rank 0
          DualPipeV)              holds the first and the last stage (torch 2.13 requires this "V" order)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    placement: str  # "single" | "loop" | "v"
    splits_backward: bool = False  # zero-bubble: backward for inputs (I) and for weights (W) run apart
    min_microbatches: str = ""  # "pp" | "stages": the least n_microbatches torch 2.13 accepts
    rounds: bool = False  # micro-batches must be a multiple of their rounds (max(1, m // pp))


SCHEDULES: dict[str, Schedule] = {
    "GPipe": Schedule("single"),
    "1F1B": Schedule("single", min_microbatches="pp"),
    "Interleaved1F1B": Schedule("loop", rounds=True),
    "LoopedBFS": Schedule("loop"),
    "InterleavedZeroBubble": Schedule("loop", splits_backward=True, rounds=True),
    "ZBVZeroBubble": Schedule("v", splits_backward=True),
    "DualPipeV": Schedule("v", splits_backward=True, min_microbatches="stages"),
}


def resolve_schedule(name: str) -> str:
    """The canonical name of a schedule, matched case-insensitively; ValueError listing the valid ones."""
    by_lower = {key.lower(): key for key in SCHEDULES}
    canonical = by_lower.get(str(name).lower())
    if canonical is None:
        raise ValueError(
            f"parallel.pp_schedule = {name!r} is not a pipeline schedule; choose one of {list(SCHEDULES)} "
            f"(case-insensitive)"
        )
    return canonical


def default_stages_per_rank(schedule_name: str) -> int:
    return 1 if SCHEDULES[resolve_schedule(schedule_name)].placement == "single" else 2


def validate_microbatches(batch: int, n_microbatches: int, schedule_name: str, pp_size: int,
                          stages_per_rank: int | None = None) -> None:
    """ValueError unless `n_microbatches` splits `batch` (rows per pp rank) into equal micro-batches that
    the schedule accepts."""
    if n_microbatches < 1 or batch % n_microbatches:
        raise ValueError(
            f"pipeline micro-batches ({n_microbatches}) must divide the per-rank batch ({batch}) so that all "
            f"micro-batches have equal size (the loss is their mean); choose one of "
            f"{[d for d in range(1, batch + 1) if batch % d == 0]}"
        )
    check_schedule_microbatches(n_microbatches, schedule_name, pp_size, stages_per_rank)


def check_schedule_microbatches(n_microbatches: int, schedule_name: str, pp_size: int,
                                stages_per_rank: int | None) -> None:
    """torch 2.13's own limits on n_microbatches, checked up front with a message that says what to change."""
    name = resolve_schedule(schedule_name)
    info = SCHEDULES[name]
    num_stages = pp_size * (default_stages_per_rank(name) if stages_per_rank is None else stages_per_rank)
    if n_microbatches < 1:
        raise ValueError(f"pipeline micro-batches must be at least 1, got {n_microbatches}")
    need = {"pp": pp_size, "stages": num_stages}.get(info.min_microbatches, 1)
    if n_microbatches < need:
        raise ValueError(
            f"parallel.pp_schedule = {name!r} with {num_stages} stages needs at least {need} micro-batches, "
            f"got {n_microbatches}; use more micro-batches (a smaller micro-batch) or another schedule"
        )
    if info.rounds:
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            raise ValueError(
                f"parallel.pp_schedule = {name!r} needs the micro-batches ({n_microbatches}) to be a multiple of "
                f"their rounds (max(1, micro-batches // pp) = {rounds}); use a multiple of parallel.pp ({pp_size})"
            )


# ---- the split ----------------------------------------------------------------------------------------


def _layer_index(item: int | str, n_layers: int) -> int:
    """3, "3" or "layers.3" -> 3."""
    text = str(item)
    text = text[len("layers."):] if text.startswith("layers.") else text
    if not text.isdigit() or int(text) >= n_layers:
        raise ValueError(
            f"parallel.pp_boundaries names layer {item!r}, which is not a layer of the model "
            f"(layers 0..{n_layers - 1}, or 'layers.<i>')"
        )
    return int(text)


def split_layers(
    n_layers: int, num_stages: int, boundaries: Sequence[int] | Sequence[Sequence[int | str]] | None = None
) -> list[list[int]]:
    """The layer indices of each stage, in order; every layer exactly once, every stage at least one.

    boundaries=None: an even split; when n_layers % num_stages = r > 0 the first r stages take one layer
    more (the last stage already runs the output head and the loss, the largest matmul of a step, and
    the first stage's embedding is a lookup; e.g. 10 layers / 4 stages -> 3, 3, 2, 2).
    boundaries=[0, 3, 5, ...]: the first layer of each stage (num_stages entries, starting at 0).
    boundaries=[[0, 1, 2], [3, 4], ...] (ints or 'layers.<i>' names): each stage's layers.
    """
    if num_stages < 1:
        raise ValueError(f"the number of pipeline stages must be at least 1, got {num_stages}")
    if num_stages > n_layers:
        raise ValueError(
            f"{num_stages} pipeline stages for model.n_layers = {n_layers}: each stage needs at least one layer; "
            f"lower parallel.pp (or the stages per rank) to at most {n_layers} stages in all, or add layers"
        )
    if boundaries is None:
        base, extra = divmod(n_layers, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
        starts = [sum(sizes[:s]) for s in range(num_stages)]
        return [list(range(start, start + size)) for start, size in zip(starts, sizes)]

    boundaries = list(boundaries)
    if len(boundaries) != num_stages:
        raise ValueError(
            f"parallel.pp_boundaries has {len(boundaries)} entries but the pipeline has {num_stages} stages; "
            f"give one entry per stage (its first layer, or its list of layers)"
        )
    if all(isinstance(b, (list, tuple)) for b in boundaries):
        stages = [[_layer_index(item, n_layers) for item in stage] for stage in boundaries]
        if any(not stage for stage in stages):
            raise ValueError(f"parallel.pp_boundaries = {boundaries}: every stage needs at least one layer")
        flat = [i for stage in stages for i in stage]
        if flat != list(range(n_layers)):
            raise ValueError(
                f"parallel.pp_boundaries = {boundaries} must list layers 0..{n_layers - 1} in order, each once "
                f"(stage k's output feeds stage k + 1); got {flat}"
            )
        return stages
    if any(isinstance(b, (list, tuple)) for b in boundaries):
        raise ValueError(
            f"parallel.pp_boundaries = {boundaries} mixes layer lists and first-layer indices; use one form"
        )
    starts = [_layer_index(b, n_layers) for b in boundaries]
    if starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])):
        raise ValueError(
            f"parallel.pp_boundaries = {boundaries} must be the first layer of each stage: start at 0 and "
            f"strictly increase (each stage needs at least one layer), all below model.n_layers = {n_layers}"
        )
    ends = starts[1:] + [n_layers]
    return [list(range(a, b)) for a, b in zip(starts, ends)]


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index, the pp rank that runs it, and what it holds."""

    index: int
    rank: int
    layers: tuple[int, ...]
    embed: bool  # holds tok_embeddings (the first stage)
    head: bool  # holds norm + output (the last stage)

    @property
    def layer_names(self) -> list[str]:
        return [f"layers.{i}" for i in self.layers]


def stage_rank(stage_index: int, pp_size: int, num_stages: int, placement: str) -> int:
    if placement == "v":  # 0, 1, ..., pp-1, pp-1, ..., 1, 0
        return stage_index if stage_index < pp_size else num_stages - 1 - stage_index
    return stage_index % pp_size


def pipeline_layout(
    n_layers: int,
    pp_size: int,
    schedule_name: str,
    boundaries=None,
    stages_per_rank: int | None = None,
) -> list[StageSpec]:
    """Every stage of the pipeline (all ranks), in stage order. Pure data: the planner can print it."""
    name = resolve_schedule(schedule_name)
    placement = SCHEDULES[name].placement
    per_rank = default_stages_per_rank(name) if stages_per_rank is None else stages_per_rank
    if pp_size < 1 or per_rank < 1:
        raise ValueError(f"parallel.pp ({pp_size}) and the stages per rank ({per_rank}) must be at least 1")
    if placement == "single" and per_rank != 1:
        raise ValueError(
            f"parallel.pp_schedule = {name!r} runs one stage per rank, got stages_per_rank = {per_rank}; "
            f"use an interleaved schedule (e.g. 'Interleaved1F1B') for more"
        )
    if placement == "v" and per_rank != 2:
        raise ValueError(f"parallel.pp_schedule = {name!r} needs exactly 2 stages per rank, got {per_rank}")
    num_stages = pp_size * per_rank
    stages = split_layers(n_layers, num_stages, boundaries)
    return [
        StageSpec(s, stage_rank(s, pp_size, num_stages, placement), tuple(layers), s == 0, s == num_stages - 1)
        for s, layers in enumerate(stages)
    ]
