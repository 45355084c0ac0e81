"""ParallelState: what `parallelize` returns (the model itself gains no attributes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moeflow.core.parallel_dims import ParallelDims


@dataclass
class ParallelState:
    model: nn.Module
    dims: ParallelDims
    mesh: Any = None  # DeviceMesh (pp, dp_replicate, efsdp, ep, tp) with dp_shard_cp / dp_cp views; None at world 1
    runner: Any = None  # the step runner: moeflow.parallel.runner.LocalRunner or pipeline.PipelineRunner
    tp_mesh: Any = None  # the 1-D tensor-parallel mesh when tp > 1
    # MoE folded over tp: parameters whose gradients are partial sums over the tp ranks (the router; FSDP sums the
    # shared experts') and parameters that differ between tp ranks (their experts); see moeflow.parallel.grads.
    tp_partial: list = field(default_factory=list)
    tp_distinct: list = field(default_factory=list)
    tp_reduced: dict = field(default_factory=dict)  # id(param) -> (weakref, version) of its gradient once summed
    # token mixers the tp plan does not shard, {fqn in its stage: module}: whole on every tp rank (WholeMixer)
    tp_whole: dict = field(default_factory=dict)
    # parts of a layer that work token by token beside its mixer, on the rank's tokens (PerTokenPart): partial
    tp_per_token: dict = field(default_factory=dict)
    cp_mesh: Any = None  # the 1-D context-parallel mesh when cp > 1
    # sequence mixers that are not attention, {fqn in its stage: module}: whole on every cp rank (hf_context)
    cp_whole: dict = field(default_factory=dict)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that see different data."""
        if self.mesh is None:
            return 0
        from moeflow.parallel.mesh import submesh

        # dp_cp is (dp_replicate, dp_shard, cp) flattened with cp innermost (moeflow.parallel.mesh)
        return submesh(self.mesh, "dp_cp").get_local_rank() // self.dims.cp

    def local_sequence(self, x_BS: torch.Tensor) -> torch.Tensor:
        """This rank's part of a batch of whole sequences [B, S]: under context parallelism its two chunks
        (moeflow.parallel.context.shard_sequence), else x_BS itself. Inputs and their next-token targets are
        cut the same way, so the targets were shifted on the whole sequence."""
        if self.cp_mesh is None:
            return x_BS
        from moeflow.parallel.context import shard_sequence

        return shard_sequence(x_BS, self.cp_mesh.get_local_rank(), self.dims.cp)
