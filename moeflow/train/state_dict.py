"""Model and optimizer state as one flat, layout-independent dict, so a checkpoint reshards.

Keys are the fully-qualified names of the single-device model (every parallel layout keeps them):
`model.<fqn>` for parameters and persistent buffers and `optim.state.<fqn>.<key>` for optimizer state.
Values are whatever the layout holds - DTensors under FSDP2 / TP, plain tensors otherwise - and DCP
(torch.distributed.checkpoint) stores them by global shape, so any other layout can read any region.

Two things DCP cannot reshard on its own, handled here:
- Experts under expert parallelism (moeflow's GroupedExperts and transformers' experts modules): each EP
  rank holds a different slice [E/ep, ...] under the same name. They are stored one expert per key
  (`<fqn>.<global expert id>`) under every layout, so a checkpoint from ep=2 loads under ep=4 or ep=1.
- A LoRA run (moeflow/models/lora.py) stores its adapter factors only: the frozen base is rebuilt from where
  it came from (the seed or model.hf_path), never re-saved.
- Parameters spread over several stage modules (pipeline parallelism) and optimizers that hold only
  a partition of the state (ZeRO-1): both are handled by walking parameters by identity rather than
  asking torch for one module's state dict.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moeflow.models import lora
from moeflow.parallel.fp8 import high_precision
from moeflow.train.offload import placed_as


def expert_slices(parts: list[nn.Module]) -> dict[str, tuple[int, int]]:
    """{fqn of an expert weight: (first global expert id held here, experts held here)}."""
    from moeflow.models.moe import GroupedExperts
    from moeflow.parallel.hf_experts import hf_expert_slices

    out = {}
    for part in parts:
        out.update(hf_expert_slices(part))  # transformers' own experts modules (model.hf_impl = 'transformers')
        for name, module in part.named_modules():
            if isinstance(module, GroupedExperts):  # w1, w2, w3 and a LoRA adapter's factors: all [E, ...]
                first = getattr(module, "expert_offset", 0)
                for w, _ in module.named_parameters(recurse=False):
                    out[f"{name}.{w}"] = (first, module.num_experts)
    return out


def model_state(part: nn.Module) -> dict[str, torch.Tensor]:
    """The part's tensors a checkpoint holds: all of its state dict, or a LoRA run's adapter factors."""
    state = part.state_dict()
    if any(lora.is_factor(k) for k in state):
        return {k: v for k, v in state.items() if lora.is_factor(k)}
    return state


def _full(t: torch.Tensor) -> torch.Tensor:
    # Experts are FSDP-sharded over a few ranks that hold the same experts: gather them (one layer at a
    # time, inside that small group) so each expert can be written under its own key.
    if not isinstance(t, DTensor):
        return t
    if t.to_local().device.type != t.device_mesh.device_type:  # host memory (parallel.offload): gathered there
        t = DTensor.from_local(t.to_local().to(t.device_mesh.device_type), t.device_mesh, t.placements,
                               run_check=False, shape=t.shape, stride=t.stride())
    return t.full_tensor()


def _param_names(parts: list[nn.Module]) -> dict[int, str]:
    return {id(p): n for part in parts for n, p in part.named_parameters()}


def _expert_ids(experts: dict, fqn: str, like: torch.Tensor) -> range | None:
    """The global ids of the experts `like` (a tensor stored under `fqn`) holds; None if not expert-indexed."""
    if fqn in experts and like.dim() > 0:
        first, count = experts[fqn]
        return range(first, first + count)
    return None


def _optimizer_params(parts: list[nn.Module], optimizer) -> list:
    """[(parameter, fqn)] in the optimizer's order."""
    names = _param_names(parts)
    return [(p, names[id(p)]) for group in optimizer.param_groups for p in group["params"]]


def gather(parts: list[nn.Module], optimizer) -> dict[str, torch.Tensor]:
    """The flat state to save (see the module docstring)."""
    experts = expert_slices(parts)
    flat: dict[str, torch.Tensor] = {}

    def put(key: str, fqn: str, value: torch.Tensor) -> None:
        value = high_precision(value)  # FP8 is a compute format: checkpoints hold the high-precision tensors
        ids = _expert_ids(experts, fqn, value)
        if ids is None:
            flat[key] = value
            return
        full = _full(value)  # one layer's experts, unsharded: copied to the host, not kept on the GPU
        for i, expert in enumerate(ids):
            flat[f"{key}.{expert}"] = full[i].to("cpu", copy=True)

    for part in parts:
        for fqn, value in model_state(part).items():
            put(f"model.{fqn}", fqn, value)
    for p, fqn in _optimizer_params(parts, optimizer):
        for k, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                put(f"optim.state.{fqn}.{k}", fqn, v)
    return flat


def placeholders(parts: list[nn.Module], optimizer, saved_keys: set[str]) -> dict[str, torch.Tensor]:
    """Tensors shaped like what this rank owns under the current layout, for DCP to load into.

    Optimizer entries are created only for keys the checkpoint has (a fresh optimizer has no state yet).
    """
    experts = expert_slices(parts)
    flat: dict[str, torch.Tensor] = {}

    def want(key: str, fqn: str, like: torch.Tensor) -> None:
        like = high_precision(like)
        ids = _expert_ids(experts, fqn, like)
        if ids is None:
            flat[key] = torch.empty_like(like)
            return
        for expert in ids:  # on the host: every layer's unsharded experts would not fit beside training's state
            flat[f"{key}.{expert}"] = torch.empty(like.shape[1:], dtype=like.dtype, device="cpu")

    for part in parts:
        for fqn, value in model_state(part).items():
            want(f"model.{fqn}", fqn, value)
    params = _optimizer_params(parts, optimizer)
    for p, fqn in params:
        prefix = f"optim.state.{fqn}."
        for state_key in _state_keys(saved_keys, prefix):
            if state_key == "step":
                flat[prefix + state_key] = torch.zeros((), dtype=torch.float32)
            else:
                want(prefix + state_key, fqn, _state_like(optimizer, p))
    return flat


def _state_like(optimizer, p: torch.Tensor) -> torch.Tensor:
    """What p's optimizer state looks like: p, or a host tensor where the optimizer keeps it there
    (parallel.offload = 'optimizer', moeflow/train/offload.py)."""
    return optimizer.state_like(p) if hasattr(optimizer, "state_like") else p.data


def _state_keys(keys, prefix: str) -> list[str]:
    """Optimizer state names (exp_avg, step, ...) stored under `prefix`, with or without an expert id."""
    return sorted({k[len(prefix):].split(".")[0] for k in keys if k.startswith(prefix)})


def apply(parts: list[nn.Module], optimizer, flat: dict[str, torch.Tensor]) -> None:
    """Copy a loaded flat state into the model parts and the optimizer."""
    experts = expert_slices(parts)

    def take(key: str, fqn: str, like: torch.Tensor) -> torch.Tensor:
        ids = _expert_ids(experts, fqn, like)
        if ids is None:
            return flat[key]
        full = torch.stack([flat[f"{key}.{expert}"] for expert in ids])
        if isinstance(like, DTensor):  # local chunking only: every rank in the group loaded the same
            out = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
            if out.to_local().device != like.to_local().device:  # host shards (parallel.offload): stay there
                out = placed_as(like, out.to_local().to(like.to_local().device))
            return out
        return full.to(like.device)

    for part in parts:
        sd = {fqn: take(f"model.{fqn}", fqn, v) for fqn, v in model_state(part).items()}
        missing, _ = part.load_state_dict(sd, strict=False)
        assert set(missing) == set(part.state_dict()) - set(sd), missing
    for p, fqn in _optimizer_params(parts, optimizer):
        prefix = f"optim.state.{fqn}."
        state_keys = _state_keys(flat, prefix)
        if state_keys:
            optimizer.state[p] = {k: (flat[prefix + k] if k == "step" else take(prefix + k, fqn, p.data))
                                  for k in state_keys}
