"""Fill transformers' own modules (model.hf_impl = 'transformers'), parallelized, each rank reading what it holds.

The counterpart of moeflow/train/hf_sharded.py for a model transformers builds. The checkpoint's names are the
architecture's published ones, which transformers maps onto its modules with its own conversion table
(`get_model_conversion_mapping`: renamings, and converters that merge one-tensor-per-expert keys into a fused
[E, ...] tensor, concatenate gate and up, ...). Each rank applies that same table, but to the tensors it needs:
- an experts tensor this rank holds a slice of (expert parallelism) takes only its experts' keys, or the rows
  [first, first + count) of a fused one, so ranks of different EP groups read disjoint expert bytes;
- every other tensor is read whole, converted, and cut to this rank's shard (FSDP2, TP) on the host;
- a tensor another pipeline stage holds is not read at all.
The model is built with its parameters on the meta device and its buffers real (rotary frequencies and the like
are computed by the modules' own constructors, never stored), parallelized, then given storage.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from moeflow.models import hf_transformers
from moeflow.models.hf import read_header, weight_files
from moeflow.models.lora import is_factor
from moeflow.parallel.hf_experts import hf_expert_slices
from moeflow.train.hf_sharded import _place


def load_owned(model: nn.Module, folder: str | Path, device: torch.device) -> int:
    """Give `model` (built by hf_transformers.load_empty, parallelized) storage on `device` and copy this rank's part of
    the folder's weights into it; returns the bytes read here. ValueError, in one line, for a tensor the files
    lack or shape otherwise."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    folder = Path(folder)
    buffers = {name: b.clone() for name, b in model.named_buffers(remove_duplicate=False)}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers(remove_duplicate=False):
            b.copy_(buffers[name])
    state = model.state_dict()
    shapes = {name: h["shape"] for file in weight_files(folder) for name, h in read_header(file).items()}
    where = {name: file for file in weight_files(folder) for name in read_header(file)}
    # the table is looked up by the model's class, which FSDP2 has swapped for a subclass of its own: ask it of
    # the same model unparallelized (on the meta device, nothing allocated)
    transforms = get_model_conversion_mapping(hf_transformers.load(folder, "meta"))
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
    # target tensor -> (the converter's source pattern or None, {source pattern or key: [keys, experts in order]})
    targets: dict[str, tuple[str | None, dict[str, list[str]]]] = {}
    for key in sorted(shapes, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if target not in state and key in state:  # a renaming meant for other keys (transformers' own rule)
            target, pattern = key, None
        if target in state:  # else: another pipeline stage's, or not part of the causal LM (an MTP layer)
            targets.setdefault(target, (pattern, defaultdict(list)))[1][pattern or key].append(key)
    experts = hf_expert_slices(model)

    handles: dict[Path, object] = {}
    read, filled = 0, set()

    def reader(key: str, rows: tuple[int, int] | None = None):
        def read_it() -> torch.Tensor:
            nonlocal read
            file = where[key]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            t = handles[file].get_slice(key)[rows[0]:rows[1]] if rows else handles[file].get_tensor(key)
            read += t.numel() * t.element_size()
            return t
        return read_it

    with contextlib.ExitStack() as stack, torch.no_grad():
        for target, (pattern, sources) in targets.items():
            first, count = experts.get(target, (0, None))
            collected = {}
            for source, keys in sources.items():
                ndim = len(shapes[keys[0]])
                if count is not None and ndim == state[target].ndim - 1:  # one key per expert: this rank's only
                    keys = keys[first:first + count]
                rows = (first, first + count) if count is not None and ndim == state[target].ndim else None
                collected[source] = [reader(k, rows) for k in keys]
            if pattern is None:
                values = {target: collected[next(iter(collected))][0]()}
            else:
                converter = copy.deepcopy(converter_of[pattern])
                for source, funcs in collected.items():
                    converter.collected_tensors[source] = funcs
                values = converter.convert(target, model=model, config=model.config)
            for name, value in values.items():
                value = value[0] if isinstance(value, list) else value
                dst = state[name]
                if list(value.shape) != list(dst.shape):
                    raise ValueError(f"{folder}: {name} reads as {list(value.shape)} from the files but the model "
                                     f"holds {list(dst.shape)} here; is config.json the one the weights were saved "
                                     f"with?")
                _place(dst, value.to(dst.dtype))
                filled.add(name)
    tied = model.all_tied_weights_keys  # {tied name: the name it shares storage with}
    # (a LoRA adapter's factors are not the folder's: moeflow.models.lora.init sets them after)
    missing = [k for k in state if k not in filled and k not in tied and k not in buffers and not is_factor(k)]
    if missing:
        raise ValueError(f"{folder}: no tensor in the files fills {missing[0]} ({len(missing)} in all); is "
                         f"config.json the one the weights were saved with?")
    return read
