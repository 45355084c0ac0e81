"""The names of a training step's phases, as the profiler ranges moeflow marks them with
(torch.profiler.record_function; `[profile]` in the job config) and the summary reports them.

Ranges of one thread nest: a phase's own time is its range minus the phases inside it (the gradient reduction
inside the backward, the dispatch inside attention's neighbours never), so the phases of a step and `other`
add up to the step. FSDP2 marks its own collectives (`FSDP::all_gather ...`, `FSDP::post_backward_reduce ...`);
they count as the parameter gather and the gradient reduction.
"""

from __future__ import annotations

STEP = "moeflow::step"
ATTENTION = "moeflow::attention"
ROUTER = "moeflow::router"
DISPATCH = "moeflow::ep_dispatch"
EXPERTS = "moeflow::expert_matmuls"
COMBINE = "moeflow::ep_combine"
SHARED_EXPERTS = "moeflow::shared_experts"
BACKWARD = "moeflow::backward"
GRAD_NORM = "moeflow::grad_norm"
OPTIMIZER = "moeflow::optimizer_step"

# range name (or its start) -> the phase the summary reports it as, in the summary's order
PHASES = {
    ATTENTION: "attention",
    ROUTER: "router",
    DISPATCH: "ep dispatch",
    EXPERTS: "expert matmuls",
    COMBINE: "ep combine",
    SHARED_EXPERTS: "shared experts",
    "FSDP::all_gather": "parameter gather",
    "FSDP::post_backward_reduce": "gradient reduction",
    "FSDP::post_backward_rs_wait": "gradient reduction",
    BACKWARD: "backward (the rest)",
    GRAD_NORM: "gradient norm",
    OPTIMIZER: "optimizer step",
}


def phase_of(range_name: str) -> str | None:
    """The phase a profiler range counts as, or None (FSDP2 appends its module's name to its ranges)."""
    if range_name in PHASES:
        return PHASES[range_name]
    for prefix, phase in PHASES.items():
        if prefix.startswith("FSDP::") and range_name.startswith(prefix + " "):
            return phase
    return None
