"""What moeflow cannot do on torch older than 2.13, as one clear error instead of torch's own failure mid-step.

moeflow runs on torch 2.11 or later (2.13 is what `make` installs). On 2.11 the
whole suite passes except what is refused here (and MXFP8, `training.fp8`), each checked there:
- V-shaped pipeline schedules on gloo: a rank holds two neighbouring stages, and torch 2.11 connects them by a send
  to itself, which gloo refuses ("Pair is not connected").
- A pipeline whose first pass is forward-only (the global-batch balance loss counts expert loads so) or whose
  evaluation returns another shape than training (multi-token prediction appends its logits only when training):
  torch 2.11's stages keep the gradient flags and shapes of their first forward; 2.13 infers them again.
"""

from __future__ import annotations

import torch


def torch_minor() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def pipeline_refusal(schedule: str, v_shaped: bool, backend: str, mtp_depth: int, counting_pass: bool) -> str | None:
    """Why this pipeline cannot run on this torch (None: it can)."""
    if torch_minor() >= (2, 13) or backend == "fake":  # a dry run (moeflow.train.dry_run) takes no step
        return None
    here = f"torch {torch.__version__}"
    if v_shaped and backend == "gloo":
        return (f"parallel.pp_schedule = {schedule!r} keeps two neighbouring stages on each rank, which {here} "
                f"connects by a send to itself that gloo refuses: use torch 2.13 or newer, or '1F1B' / "
                f"'Interleaved1F1B'")
    if counting_pass:
        return (f"model.moe.aux_loss_type = 'global_batch' under parallel.pp > 1 starts each step with a forward-only "
                f"pass, after which {here}'s pipeline stages compute no input gradients: use torch 2.13 or newer, "
                f"or aux_loss_type = 'micro_batch'")
    if mtp_depth:
        return (f"model.mtp_depth = {mtp_depth} under parallel.pp > 1: evaluation returns fewer positions than "
                f"training, which {here}'s pipeline stages refuse: use torch 2.13 or newer")
    return None
