"""ParallelState: what `parallelize` returns (the model itself gains no attributes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from moeflow.layout import ParallelDims


@dataclass
class ParallelState:
    model: nn.Module
    dims: ParallelDims
    mesh: Any = None  # DeviceMesh (pp, dp_replicate, efsdp, ep, tp) with dp_shard / dp views; None at world size 1
    runner: Any = None  # the step runner: moeflow.parallel.runner.LocalRunner or pipeline.PipelineRunner
    tp_mesh: Any = None  # the 1-D tensor-parallel mesh when tp > 1
    # MoE folded over tp: parameters whose gradients are partial sums over the tp ranks (router, shared experts)
    # and parameters that differ between tp ranks (their experts); see moeflow.parallel.grads.
    tp_partial: list = field(default_factory=list)
    tp_distinct: list = field(default_factory=list)
    tp_reduced: dict = field(default_factory=dict)  # id(param) -> (weakref, version) of its gradient once summed

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that see different data."""
        if self.mesh is None:
            return 0
        from moeflow.parallel.mesh import submesh

        return submesh(self.mesh, "dp").get_local_rank()
