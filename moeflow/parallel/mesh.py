"""The DeviceMesh of a ParallelDims: dims (pp, dp_replicate, efsdp, ep, tp), plus flattened dp_shard_cp and dp_cp
views, the cp mesh, and, when the MoE is folded over the tp ranks, ep_tp (the expert-parallel group) and
dp_shard_cp_tp (what FSDP shards the folded MoE's shared experts over).

efsdp x ep covers the dp_shard x cp ranks (both are row-major splits of the same block, cp innermost), so expert
parallelism can borrow context-parallel ranks; without cp, dp_shard_cp is dp_shard and dp_cp is dp.
"""

from __future__ import annotations

import warnings

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moeflow.core.parallel_dims import ParallelDims

MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "tp")


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    mesh = init_device_mesh(device_type, (dims.pp, dims.dp_replicate, dims.efsdp, dims.ep, dims.tp),
                            mesh_dim_names=MESH_DIMS)
    mesh["efsdp", "ep"]._flatten("dp_shard_cp")  # FSDP shards the dense weights over these
    mesh["dp_replicate", "efsdp", "ep"]._flatten("dp_cp")
    if dims.fold_experts:
        mesh["ep", "tp"]._flatten("ep_tp")
        mesh["efsdp", "ep", "tp"]._flatten("dp_shard_cp_tp")
    return mesh


def expert_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The ranks the experts are spread over: ep, or ep x tp when folded."""
    return submesh(mesh, "ep_tp" if dims.fold_experts else "ep")


def folded_moe_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The ranks the shared experts of a folded MoE are data-parallel over: each tp rank computes them whole on its
    own tokens, as each dp x cp rank does, so FSDP shards them over dp_shard x cp x tp (dp_replicate: HSDP)."""
    if dims.dp_replicate > 1:
        return submesh(mesh, "dp_replicate", "dp_shard_cp_tp")
    return submesh(mesh, "dp_shard_cp_tp")


def cp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The 1-D mesh of this rank's context-parallel group: dp_shard_cp split into (dp_shard, cp), cp innermost,
    so the ranks of one sequence are neighbours (inside a node on a cluster)."""
    return submesh(mesh, "dp_shard_cp")._unflatten(0, (dims.dp_shard, dims.cp), ("dp_shard", "cp"))["cp"]


def submesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """mesh[names], quiet about torch's notice that slicing flattened dims from the root will change
    (torch 2.13 still supports it; the 2-D HSDP mesh needs it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names if len(names) > 1 else names[0]]
