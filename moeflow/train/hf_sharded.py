"""Fill a parallelized model from a Hugging Face folder, each rank reading only what it holds.

The model is built on the meta device, parallelized (FSDP2 / HSDP / TP / PP / expert parallelism), then given
uninitialised local storage (`to_empty`). Each rank then streams the safetensors files and:
- skips expert tensors of experts other EP ranks hold (with EP, most of an MoE checkpoint's bytes),
- for every other tensor, assembles the moeflow tensor it feeds (one at a time: the HF tensors of one
  moeflow tensor, e.g. the two halves of a fused gate_up_proj, may come in any order) and keeps only its
  own shard (DTensor local chunking, no communication).
So no rank ever holds the full model, and ranks of different EP groups read disjoint expert bytes.
Under pipeline parallelism the trimmed stage model simply lacks the other stages' tensors, which are skipped.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moeflow.core.hf_arch import arch_of, tensor_rules
from moeflow.core.model_config import ModelConfig
from moeflow.models.hf import _check_names, copy_into, hf_shape, read_header, read_hf_config, weight_files
from moeflow.models.lora import is_factor
from moeflow.train.state_dict import expert_slices


def _global_shape(t: torch.Tensor) -> torch.Size:
    return t.shape  # a DTensor reports its global shape; a plain tensor is whole


def load_owned(model: torch.nn.Module, cfg: ModelConfig) -> int:
    """Copy cfg.hf_path's weights into `model` (parallelized, storage allocated); returns the bytes read here."""
    folder = Path(cfg.hf_path)
    hf, _ = read_hf_config(folder)
    arch = arch_of(hf)
    files = weight_files(folder)
    present = {name: (file, h["shape"]) for file in files for name, h in read_header(file).items()}
    fused = any(name.endswith(".experts.gate_up_proj") for name in present)
    rules = tensor_rules(cfg, arch, fused)
    _check_names(folder, hf, rules, present)

    state = model.state_dict()
    experts = expert_slices([model])  # fqn -> (first global expert here, experts here)

    def wanted(rule) -> bool:
        if rule.mf not in state or rule.transform == "copy":  # MTP copies of the embedding / head: the main ones fill
            return False
        if rule.mf in experts and rule.expert is not None:
            first, count = experts[rule.mf]
            return first <= rule.expert < first + count
        return True

    by_name = defaultdict(list)
    for r in rules:
        if wanted(r):
            by_name[r.hf].append(r)
            if r.mf not in experts and list(hf_shape(r, state[r.mf].shape)) != list(present[r.hf][1]):
                raise ValueError(f"{r.hf} has shape {list(present[r.hf][1])} in {folder}, but the model needs "
                                 f"{hf_shape(r, state[r.mf].shape)} for {r.mf}; does config.json match the weights?")
    filled = {r.mf for rs in by_name.values() for r in rs}
    unfilled = [k for k in state if k not in filled and not k.endswith("router.expert_bias")
                and not (cfg.tie_embeddings and k == "output.weight") and not is_factor(k)]  # (LoRA: set after)
    if unfilled:
        raise ValueError(f"no tensor in {folder} fills {unfilled[:3]} ({len(unfilled)} in all); is it a "
                         f"complete {arch.name if hasattr(arch, 'name') else 'model'} checkpoint?")
    remaining = Counter(r.mf for rs in by_name.values() for r in rs)
    staging: dict[str, torch.Tensor] = {}
    read = 0

    from safetensors import safe_open

    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in by_name:
                        continue
                    rules_here = by_name[name]
                    fused_experts = [experts[r.mf] for r in rules_here if r.mf in experts and r.expert is None]
                    if fused_experts:  # a fused [E, ...] tensor: read only this rank's experts
                        first, count = fused_experts[0]
                        src = f.get_slice(name)[first:first + count]
                    else:
                        src = f.get_tensor(name)
                    read += src.numel() * src.element_size()
                    for r in rules_here:
                        dst = state[r.mf]
                        if r.mf not in staging:
                            staging[r.mf] = torch.empty(_global_shape(dst), dtype=dst.dtype)
                        if r.mf in experts and r.expert is not None:  # one expert's tensor, by local index
                            r = dataclasses.replace(r, expert=r.expert - experts[r.mf][0])
                        copy_into(staging[r.mf], src, r)
                        remaining[r.mf] -= 1
                        if remaining[r.mf] == 0:
                            _place(dst, staging.pop(r.mf))
    assert not staging, f"tensors never completed: {sorted(staging)}"
    for key, t in state.items():  # routers without a selection bias in the checkpoint start unbiased
        if key.endswith("router.expert_bias") and key not in remaining:
            (t.to_local() if isinstance(t, DTensor) else t).zero_()
    model.reset_rope()
    return read


def _place(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` (on the host) into `dst` (a DTensor's local shard, or a whole tensor)."""
    if not isinstance(dst, DTensor):
        dst.copy_(full)
    elif all(type(p) in (Shard, Replicate) for p in dst.placements):
        # cut on the host, so only this rank's part goes to the device (distribute_tensor would move all of it)
        shape, offset = compute_local_shape_and_global_offset(full.shape, dst.device_mesh, dst.placements)
        dst.to_local().copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
    else:  # FSDP over TP on the same dim (_StridedShard): not one contiguous block; torch's own chunking
        dst.to_local().copy_(distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None).to_local())
