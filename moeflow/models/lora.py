"""LoRA (Hu et al. 2021) on moeflow's own model: low-rank adapters beside frozen base weights.

A linear layer W gains A [r, in] and B [out, r] and computes x W^T + (alpha / r) * dropout(x) A^T B^T; B starts
at zero, so training starts from the base model. Experts are adapted the way peft adapts a Hugging Face experts
module's 3-D `gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F] (`LoraConfig.target_parameters`): per expert,
one A shared by the gate and up halves and one B over both, so an adapter trained here loads in peft unchanged.

Why moeflow's own and not peft's wrappers (docs/design.md, "LoRA"): the adapter factors must live where the
parallel model keeps the weight they adapt - the experts' factors sliced along E with the experts under expert
parallelism, every factor sharded by FSDP2 with its block - and keep the module names the tensor-parallel plans,
FSDP units and checkpoints refer to. peft replaces each module by a wrapper (`q_proj` becomes
`q_proj.base_layer`) and re-registers a parametrization of each expert weight on every forward.

On transformers' own modules (model.hf_impl = 'transformers') the same adapters sit on its nn.Linear layers and
on each 3-D weight of its experts modules, shaped as peft shapes them (`hf_factor_shapes`); the experts module then
runs under the experts implementation `moeflow_lora`, which calls transformers' grouped-matmul experts function
on the adapted weights W + (alpha / r) B A - the delta peft's parametrization adds - so biases, interleaved
gate/up, transposed weights and custom gates stay the architecture's.

Factors are initialised per name from the seed (`init`), after the model is parallelized and its base loaded:
every layout starts from the one-process factors without any rank reading another's.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.models.moe import GroupedExperts

# The expert factors, each [E, ...] along the experts (expert parallelism slices them with w1/w2/w3).
EXPERT_FACTORS = ("lora_gate_up_A", "lora_gate_up_B", "lora_up_A", "lora_up_B", "lora_down_A", "lora_down_B")
# transformers' 3-D experts weights a LoRA adapts -> the name of their factors (lora_<kind>_A / _B)
HF_EXPERT_WEIGHTS = {"gate_up_proj": "gate_up", "up_proj": "up", "down_proj": "down"}
# the experts implementation (transformers' experts interface) of an experts module with an adapter
LORA_EXPERTS_IMPLEMENTATION = "moeflow_lora"
# what an experts module runs once its adapter is merged (transformers' grouped-matmul experts function)
MERGED_EXPERTS_IMPLEMENTATION = "grouped_mm"
LINEAR_FACTORS = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """An nn.Linear with a LoRA adapter; keeps the base's `weight` and `bias` (and so their names)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.zeros(rank, base.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **like))
        self.lora_scale, self.lora_dropout = alpha / rank, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        # alpha / r on the [.., r] rows (the narrowest), the sum in place (F.linear's backward does not read its output)
        return F.linear(x, self.weight, self.bias).add_(F.linear(self.lora_scale * F.linear(h, self.lora_A),
                                                                 self.lora_B))

    def merged(self) -> nn.Linear:
        """A plain nn.Linear holding W + (alpha / r) B A."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            out.weight.copy_(self.weight + self.lora_scale * self.lora_B @ self.lora_A)
            if self.bias is not None:
                out.bias.copy_(self.bias)
        return out


def add_expert_factors(experts: GroupedExperts, rank: int, alpha: float) -> None:
    """Give `experts` the factors of a LoRA on gate_up [E, 2F, D] and down [E, D, F] (zero until `init`)."""
    E, D, Fh = experts.num_experts, experts.dim, experts.hidden
    like = dict(device=experts.w1.device, dtype=experts.w1.dtype)
    shapes = {"lora_gate_up_A": (E, rank, D), "lora_gate_up_B": (E, 2 * Fh, rank),
              "lora_down_A": (E, rank, Fh), "lora_down_B": (E, D, rank)}
    for name, shape in shapes.items():
        setattr(experts, name, nn.Parameter(torch.zeros(shape, **like)))
    experts.lora_scale = alpha / rank


def linear_targets(model: nn.Module) -> dict[str, nn.Linear]:
    """{leaf name: one such layer} of every nn.Linear a LoRA can adapt, for the error message's list."""
    return {name.rsplit(".", 1)[-1]: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


# The default targets: attention projections (GQA and MLA) and the SwiGLU MLPs (dense layers, shared experts), by
# the names of moeflow's model and of transformers' (its Llama-style and DeepSeek-style MLA attention, its MLPs).
DEFAULT_MODULES = ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b", "w1", "w2", "w3",
                   "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                   "gate_proj", "up_proj", "down_proj")


def target_names(modules: str) -> tuple[str, ...]:
    return DEFAULT_MODULES if modules == "auto" else tuple(m.strip() for m in modules.split(",") if m.strip())


def hf_factor_shapes(experts: nn.Module, rank: int) -> dict[str, tuple[int, int, int]]:
    """{factor name: shape} of an adapter on each 3-D weight of a transformers experts module, as peft's
    target_parameters lays them out per expert: A [E, r, in], B [E, out, r], where a weight [E, a, b] is
    [E, out, in] unless the module `is_transposed` ([E, in, out], gpt-oss's)."""
    out = {}
    for weight, kind in HF_EXPERT_WEIGHTS.items():
        w = getattr(experts, weight, None)
        if isinstance(w, torch.Tensor) and w.ndim == 3:
            E, a, b = w.shape
            fan_in, fan_out = (a, b) if getattr(experts, "is_transposed", False) else (b, a)
            out[f"lora_{kind}_A"], out[f"lora_{kind}_B"] = (E, rank, fan_in), (E, fan_out, rank)
    return out


def _add_hf_expert_factors(experts: nn.Module, rank: int, alpha: float) -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    like = next(experts.parameters())
    for name, shape in hf_factor_shapes(experts, rank).items():
        setattr(experts, name, nn.Parameter(torch.zeros(shape, device=like.device, dtype=like.dtype)))
    experts.lora_scale = alpha / rank
    ALL_EXPERTS_FUNCTIONS.register(LORA_EXPERTS_IMPLEMENTATION, _lora_experts_forward)
    experts.config._experts_implementation = LORA_EXPERTS_IMPLEMENTATION  # (the model's config: every module's)


def hf_expert_delta(experts: nn.Module, kind: str) -> torch.Tensor:
    """The adapter's change to the experts weight of `kind`, in the weight's own layout (peft's delta)."""
    delta = experts.lora_scale * getattr(experts, f"lora_{kind}_B") @ getattr(experts, f"lora_{kind}_A")
    return delta.mT if getattr(experts, "is_transposed", False) else delta  # [E, out, in] or [E, in, out]


class _AdaptedWeights:
    """An experts module as seen with its adapted weights; every other attribute (biases, `_apply_gate`, sizes) is
    the module's own."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor]):
        self.__dict__.update(weights)
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _lora_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped-matmul experts function on W + delta for every adapted weight of the module `self`."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    weights = {weight: getattr(self, weight) + hf_expert_delta(self, kind).to(getattr(self, weight).dtype)
               for weight, kind in HF_EXPERT_WEIGHTS.items() if hasattr(self, f"lora_{kind}_A")}
    return grouped_mm_experts_forward(_AdaptedWeights(self, weights), hidden_states, top_k_index, top_k_weights)


def add(model: nn.Module, rank: int, alpha: float, dropout: float, modules: str, experts: bool) -> int:
    """Freeze every base parameter and add adapters to the layers named by `modules` (leaf names, 'auto' for
    DEFAULT_MODULES) and, with `experts`, to every GroupedExperts and transformers experts module; returns how
    many layers got one."""
    from moeflow.models.hf_transformers import is_hf_experts

    for p in model.parameters():
        p.requires_grad_(False)
    names = set(target_names(modules))
    adapted = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child_name in names:
                setattr(parent, child_name, LoRALinear(child, rank, alpha, dropout))
                adapted += 1
    if experts:
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                add_expert_factors(m, rank, alpha)
                adapted += 1
            elif is_hf_experts(m) and hf_factor_shapes(m, rank):
                _add_hf_expert_factors(m, rank, alpha)
                adapted += 1
    return adapted


def is_factor(fqn: str) -> bool:
    return fqn.rsplit(".", 1)[-1] in LINEAR_FACTORS + EXPERT_FACTORS


def _seed_of(seed: int, fqn: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % 2**63


@torch.no_grad()
def init(parts: list[nn.Module], seed: int, expert_slices: dict[str, tuple[int, int]],
         num_experts: dict[str, int]) -> None:
    """Every A as peft initialises it (Kaiming-uniform with a = sqrt(5), as nn.Linear's weight), every B zero.
    Each factor is drawn whole from a generator seeded by (seed, its name) and this rank keeps its part: its
    experts (`expert_slices`: {fqn: (first global expert, count)} of the layer's `num_experts[fqn]`) and, under
    FSDP2 / TP, its shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for part in parts:
        for fqn, p in part.named_parameters():
            if not is_factor(fqn):
                continue
            if not fqn.endswith("_A"):
                p.zero_()
                continue
            first, count = expert_slices.get(fqn, (0, None))
            shape = list(p.shape)
            if count is not None:  # experts held here of the layer's E: draw all E, keep ours
                shape[0] = num_experts[fqn]
            gen = torch.Generator().manual_seed(_seed_of(seed, fqn))
            fan_in = shape[-1]
            bound = 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / (1 + 5)) * sqrt(3 / fan_in)
            full = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound
            if count is not None:
                full = full[first:first + count]
            full = full.to(p.dtype)
            if isinstance(p, DTensor):
                p.copy_(distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None))
            else:
                p.copy_(full)


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """The model with every adapter folded into its base weight and removed (a plain moeflow model again)."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, child_name, child.merged())
    from moeflow.models.hf_transformers import is_hf_experts

    for m in model.modules():
        if isinstance(m, GroupedExperts) and hasattr(m, "lora_gate_up_A"):
            for w, delta in zip((m.w1, m.w3, m.w2), m.lora_deltas()):
                w.add_(delta)
        elif is_hf_experts(m) and getattr(m, "lora_scale", 0.0):
            for weight, kind in HF_EXPERT_WEIGHTS.items():
                if hasattr(m, f"lora_{kind}_A"):
                    getattr(m, weight).add_(hf_expert_delta(m, kind))
            m.config._experts_implementation = MERGED_EXPERTS_IMPLEMENTATION
        else:
            continue
        for name in EXPERT_FACTORS:
            if hasattr(m, name):
                delattr(m, name)
        m.lora_scale = 0.0
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def meta_model(cfg) -> nn.Module:
    """The run's model on the meta device (nothing allocated): transformers' own for model.hf_impl =
    'transformers', else moeflow's."""
    if cfg.runs_transformers:
        from moeflow.models import hf_transformers

        return hf_transformers.load(cfg.hf_path, "meta")
    from moeflow.models.transformer import Transformer

    with torch.device("meta"):
        return Transformer(cfg)


def check_targets(cfg, rank: int, modules: str, experts: bool) -> None:
    """ValueError naming the setting when `modules` names a layer the model lacks, nothing would be adapted, or
    `rank` exceeds the narrowest adapted layer (checked on the meta device: nothing is allocated)."""
    from moeflow.models.hf_transformers import is_hf_experts

    model = meta_model(cfg)
    present = linear_targets(model)
    names = target_names(modules)
    unknown = [n for n in names if n not in present] if modules != "auto" else []
    if unknown:
        raise ValueError(f"peft.modules = {modules!r}: this model has no linear layer named "
                         f"{', '.join(map(repr, unknown))}; it has {', '.join(sorted(present))} (or use 'auto')")
    widths = {n: min(m.in_features, m.out_features) for n, m in present.items() if n in names}
    if experts:
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                width = min(m.dim, m.hidden)
            elif is_hf_experts(m) and hf_factor_shapes(m, 1):
                width = min(min(getattr(m, w).shape[1:]) for w, kind in HF_EXPERT_WEIGHTS.items()
                            if f"lora_{kind}_A" in hf_factor_shapes(m, 1))
            else:
                continue
            widths["experts"] = min(width, widths.get("experts", width))
    if not widths:
        raise ValueError(f"peft.modules = {modules!r} with peft.experts = {str(experts).lower()} adapts nothing in "
                         f"this model; name some of {', '.join(sorted(present))}")
    name, width = min(widths.items(), key=lambda kv: kv[1])
    if rank > width:
        raise ValueError(f"peft.rank = {rank} is above the width of {name} ({width}), the narrowest adapted "
                         f"layer; use peft.rank <= {width}")
