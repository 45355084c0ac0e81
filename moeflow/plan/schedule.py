"""The pipeline schedules the trainer runs (moeflow.core.schedules.SCHEDULES), costed: bubble and in-flight
micro-batches.

F, B and W are one pipeline rank's seconds per micro-batch (all its stages): forward, backward for the inputs
(with any recomputation) and backward for the weights. m micro-batches, p pipeline ranks, v stages per rank.
The step takes m (F + B + W) plus the bubble:

- GPipe, 1F1B: (p - 1)(F + B + W); Narayanan et al. 2021 (arXiv:2104.04473) sec. 2.2.1, fraction (p - 1)/m.
- Interleaved1F1B, LoopedBFS: (p - 1)(F + B + W) / v; Narayanan et al. 2021 sec. 2.2.2; Lamy-Poirier 2023
  (arXiv:2211.05953).
- InterleavedZeroBubble: (p - 1)(F + B - W) / v; ZB-H1 of Qi et al. 2024 (arXiv:2401.10241) sec. 3.1, per chunk.
- ZBVZeroBubble: (p - 1) max(0, F + B - 2W) / 2; Qi et al. 2024b (arXiv:2405.15362) state zero when F = B = W
  (assumption: the unmatched part of F + B over 2W stays, per chunk).
- DualPipeV: (p - 1)(F + 2B - W) / 2; DeepSeek-V3 report (arXiv:2412.19437) Table 2 and the deepseek-ai/DualPipe
  README: (PP/2 - 1)(F&B + B - 3W) per chunk over PP = 2p chunks, with F&B = F + B + W (no overlap).

The zero-bubble formulas are written with B for the input gradient only (the DualPipe table's "full backward"
is B + W). Under ZeRO-3 the zero-bubble schedules keep the parameters gathered for the whole step
(moeflow.parallel.pipeline._keep_fsdp_unsharded_in_step), which the DP model in plan/time.py follows.

In flight (activations a rank holds at once, in micro-batches of its own layers; Korthikanti et al. 2022 sec.
4.2.3): stage i of 1F1B min(p - i, m); GPipe and LoopedBFS all m (every forward before any backward); the
interleaved schedules (1 + (p - 1)/(p v)) times 1F1B's; the V schedules, like 1F1B (Qi et al. 2024b; DualPipe
README: PP + 1 chunks of 1/(2p) of the model).
"""

from __future__ import annotations

from moeflow.core.schedules import SCHEDULES, check_schedule_microbatches, default_stages_per_rank
from moeflow.plan.compute import FBW

SEARCHED = ("1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
"""Schedules the search scores when pp > 1. The others are dominated under this model, so scoring them would
only slow the search (pin one with --pp-schedule to see it): GPipe and LoopedBFS have the bubble of 1F1B /
Interleaved1F1B and hold all m micro-batches' activations; Interleaved1F1B has InterleavedZeroBubble's
placement, memory and micro-batch rules and a larger bubble ((F + B + W) / v against (F + B - W) / v);
DualPipeV has ZBVZeroBubble's placement and memory, a larger bubble ((F + 2B - W) / 2 against
max(0, F + B - 2W) / 2, as B >= 0) and needs at least 2p micro-batches."""
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def stages_per_rank(schedule: str, virtual_stages: int = 0) -> int:
    return virtual_stages or default_stages_per_rank(schedule)


def bubble_seconds(schedule: str, p: int, v: int, rank: FBW) -> float:
    """Idle seconds of the slowest rank in one step (module doc)."""
    if p <= 1:
        return 0.0
    f, b, w = rank.f, rank.b, rank.w
    formula = {
        "GPipe": f + b + w,
        "1F1B": f + b + w,
        "Interleaved1F1B": (f + b + w) / v,
        "LoopedBFS": (f + b + w) / v,
        "InterleavedZeroBubble": (f + b - w) / v,
        "ZBVZeroBubble": max(0.0, f + b - 2 * w) / 2,
        "DualPipeV": (f + 2 * b - w) / 2,
    }[schedule]
    return (p - 1) * max(0.0, formula)


def in_flight(schedule: str, p: int, v: int, stage: int, m: int) -> float:
    """Micro-batches of activations pipeline rank `stage` holds at its peak (module doc)."""
    if p <= 1:
        return 1.0
    if schedule in ("GPipe", "LoopedBFS"):
        return float(m)
    base = min(p - stage, m)
    if SCHEDULES[schedule].placement == "loop":
        return base * (1 + (p - 1) / (p * v))
    return float(base)


def schedule_refusal(schedule: str, m: int, p: int, v: int) -> str | None:
    """Why torch's schedule refuses m micro-batches on p ranks (moeflow.core.schedules), or None."""
    try:
        check_schedule_microbatches(m, schedule, p, v)
    except ValueError as e:
        return str(e)
    return None
