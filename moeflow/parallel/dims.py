"""ParallelDims: the one object that owns the parallel sizes, validates them, and builds the mesh.

Every size is checked once, before any process group exists, with a message that names the setting,
the value and a fix (DESIGN.md, principle 3). Expert parallelism borrows its ranks from the
data-parallel shard dimension: dp_shard = efsdp x ep, and the experts are FSDP-sharded over efsdp.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.errors import divisors
from moeflow.models.config import ModelConfig


@dataclass
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        for key in ("dp_replicate", "tp", "pp", "ep"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key} must be at least 1, got {getattr(self, key)}")
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

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Ranks each expert is FSDP-sharded over."""
        return self.dp_shard // self.ep

    def check_model(self, cfg: ModelConfig) -> None:
        if self.ep > 1:
            if not cfg.is_moe:
                raise ValueError(f"parallel.ep = {self.ep} needs an MoE model; model {cfg.name!r} is dense")
            if cfg.moe.num_experts % self.ep:
                raise ValueError(
                    f"parallel.ep ({self.ep}) must divide model.moe.num_experts ({cfg.moe.num_experts}); "
                    f"choose ep in {divisors(cfg.moe.num_experts)}"
                )
        if self.tp > 1:  # the widths tensor parallelism shards (not MoE layers, which it replicates)
            from moeflow.parallel.tensor import check_tp

            check_tp(cfg, self.tp)
        if self.pp > cfg.n_layers:
            raise ValueError(
                f"parallel.pp ({self.pp}) is larger than model.n_layers ({cfg.n_layers}); each stage needs a layer"
            )

    def build_mesh(self, device_type: str):
        """A DeviceMesh with dims (pp, dp_replicate, efsdp, ep, tp) and the flattened dp_shard / dp views."""
        from torch.distributed.device_mesh import init_device_mesh

        names = ("pp", "dp_replicate", "efsdp", "ep", "tp")
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.efsdp, self.ep, self.tp),
                                mesh_dim_names=names)
        mesh["efsdp", "ep"]._flatten("dp_shard")
        mesh["dp_replicate", "efsdp", "ep"]._flatten("dp")
        return mesh

    @staticmethod
    def submesh(mesh, *names: str):
        """mesh[names], quiet about torch's notice that slicing flattened dims from the root will change
        (torch 2.13 still supports it; the 2-D HSDP mesh needs it)."""
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return mesh[names if len(names) > 1 else names[0]]

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("dp_replicate", "dp_shard", "tp", "pp", "ep")
                 if getattr(self, k) > 1]
        return " x ".join(parts) if parts else "1 process"
