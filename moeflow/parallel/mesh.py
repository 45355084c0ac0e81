"""The DeviceMesh of a ParallelDims: dims (pp, dp_replicate, efsdp, ep, tp), plus flattened dp_shard and dp views
(and ep_tp, the expert-parallel group, when the experts are folded over the tp ranks)."""

from __future__ import annotations

import warnings

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moeflow.layout import ParallelDims

MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "tp")


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    mesh = init_device_mesh(device_type, (dims.pp, dims.dp_replicate, dims.efsdp, dims.ep, dims.tp),
                            mesh_dim_names=MESH_DIMS)
    mesh["efsdp", "ep"]._flatten("dp_shard")
    mesh["dp_replicate", "efsdp", "ep"]._flatten("dp")
    if dims.fold_experts:
        mesh["ep", "tp"]._flatten("ep_tp")
    return mesh


def expert_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The ranks the experts are spread over: ep, or ep x tp when folded."""
    return submesh(mesh, "ep_tp" if dims.fold_experts else "ep")


def submesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """mesh[names], quiet about torch's notice that slicing flattened dims from the root will change
    (torch 2.13 still supports it; the 2-D HSDP mesh needs it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names if len(names) > 1 else names[0]]
