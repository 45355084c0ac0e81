"""`checkpoint.save_hf`: RUN_DIR/hf/ as a Hugging Face folder at the end of training, written by every rank.

The run's last checkpoint holds the model by global shape, experts one per key (moeflow.train.state_dict), so
no rank needs another's memory: the folder's tensors are cut into one contiguous run per rank of about equal
bytes, each rank reads only its run's tensors from the checkpoint (DCP reads the regions asked for), writes them
as its own `model-0000R-of-0000N.safetensors`, and rank 0 writes the index (from the files' headers),
config.json and the tokenizer files, all into `hf.tmp/`, renamed to `hf/` once every rank has written: a folder
named hf/ is complete. No rank ever holds more than its share of the model.

Two sources of tensors, each the one `moeflow convert moeflow-to-hf` uses, so the folder equals its output:
- moeflow's own modules: the Hugging Face tensors of moeflow.core.hf_arch.tensor_rules (the architecture the run
  started from, or the native model's export architecture);
- transformers' own modules (model.hf_impl = 'transformers'): the model's state dict, tied copies dropped and
  transformers' weight conversions reverted as save_pretrained does - those recorded when it loads the folder
  the run started from, so the files keep that folder's on-disk format. A rank writes whole layers (reverting
  a conversion may need every tensor of one).
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

OUT_DTYPE = torch.bfloat16  # as `moeflow convert moeflow-to-hf` writes by default


@dataclass
class _Export:
    nbytes: list[int]  # per item, in the order the items are cut into runs
    tensors: Callable[[list[int]], dict[str, torch.Tensor]]  # the Hugging Face tensors of some items
    write_config: Callable[[Path], None]  # config.json and the side files into a folder (rank 0)


def save_hf(cfg, checkpoint: Path, rank: int, world: int) -> Path:
    """Write RUN_DIR/hf/ from `checkpoint` (collective over the run's ranks when there are several)."""
    from safetensors.torch import save_file

    from moeflow.models.hf import INDEX_FILE, SINGLE_FILE, read_header

    run_dir = Path(cfg.run_dir)
    meta = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    export = (_transformers_export if cfg.model.runs_transformers else _native_export)(cfg, checkpoint, meta)
    runs = _split(export.nbytes, world)
    files = [SINGLE_FILE] if len(runs) == 1 else [f"model-{i + 1:05d}-of-{len(runs):05d}.safetensors"
                                                  for i in range(len(runs))]
    tmp, final = run_dir / "hf.tmp", run_dir / "hf"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(world)
    if rank < len(runs):
        save_file(export.tensors(runs[rank]), str(tmp / files[rank]), metadata={"format": "pt"})
    _barrier(world)
    if rank == 0:
        if len(runs) > 1:
            headers = {f: read_header(tmp / f) for f in files}
            weight_map = {name: f for f, header in headers.items() for name in header}
            total = sum(h["data_offsets"][1] - h["data_offsets"][0] for header in headers.values()
                        for h in header.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        export.write_config(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier(world)
    return final


def _read(checkpoint: Path, shapes: dict[str, torch.Size], meta: dict) -> dict[str, torch.Tensor]:
    """{key: tensor} of the model tensors named (checkpoint keys, 'model.<fqn>'), read from the checkpoint alone;
    a key stored one expert per key ('<key>.<expert id>') comes back stacked."""
    if not shapes:
        return {}
    flat = {}
    for key, shape in shapes.items():
        names = [key] if key in meta else [f"{key}.{e}" for e in range(shape[0])]
        flat.update({n: torch.empty(meta[n].size, dtype=meta[n].properties.dtype, device="cpu") for n in names})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, checkpoint_id=str(checkpoint), no_dist=True)
    return {key: flat[key] if key in meta else torch.stack([flat[f"{key}.{e}"] for e in range(shape[0])])
            for key, shape in shapes.items()}


def _native_export(cfg, checkpoint: Path, meta: dict) -> _Export:
    from moeflow.convert import export_source
    from moeflow.core.hf_arch import arch_named, config_to_hf, infer_arch, tensor_rules
    from moeflow.models.hf import copy_side_files, kept_fields

    run_dir = Path(cfg.run_dir)
    model_cfg, original, origin = export_source(cfg.model, run_dir)
    named = (original.get("architectures") or [None])[0]
    arch = arch_named(named) if named else infer_arch(model_cfg)
    rules = tensor_rules(model_cfg, arch)
    key = lambda r: f"model.{r.mf}" + (f".{r.expert}" if r.expert is not None else "")
    missing = [key(r) for r in rules if key(r) not in meta]
    if missing:
        raise ValueError(f"checkpoint.save_hf: {checkpoint} lacks {missing[:3]} for {arch.class_name}")
    _check_expert_bias(checkpoint, arch, meta)  # on every rank: a refusal must not leave peers in a barrier
    dtype_of = lambda r: torch.float32 if r.mf.endswith("router.expert_bias") else OUT_DTYPE

    def tensors(items: list[int]) -> dict[str, torch.Tensor]:
        mine = [rules[i] for i in items]
        flat = _read(checkpoint, {key(r): meta[key(r)].size for r in mine}, meta)
        return {r.hf: _exported(flat[key(r)], r).to(dtype_of(r)).contiguous() for r in mine}

    def write_config(folder: Path) -> None:
        hf = config_to_hf(model_cfg, arch, str(OUT_DTYPE).removeprefix("torch."))
        hf.update({k: v for k, v in kept_fields(original).items() if k not in hf})
        (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        copy_side_files(origin, folder)

    nbytes = [meta[key(r)].size.numel() * dtype_of(r).itemsize for r in rules]
    return _Export(nbytes, tensors, write_config)


def _transformers_export(cfg, checkpoint: Path, meta: dict) -> _Export:
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from moeflow.models import hf_transformers
    from moeflow.models.hf import copy_side_files

    origin = Path(cfg.model.hf_path)
    model = hf_transformers.load(origin, "meta")
    model._weight_conversions = _loaded_conversions(model, origin)  # what revert_weight_conversion reverses
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    missing = [k for k in state if f"model.{k}" not in meta and f"model.{k}.0" not in meta]
    if missing:
        raise ValueError(f"checkpoint.save_hf: {checkpoint} lacks {missing[:3]} of transformers' "
                         f"{type(model).__name__}; is config.toml's model.hf_path the folder the run trained?")
    groups: dict[str, list[str]] = {}
    for name in state:
        layer = re.match(r".*?\.\d+\.", name)  # 'model.layers.3.': a layer's tensors stay on one rank
        groups.setdefault(layer.group(0) if layer else name, []).append(name)
    groups_list = list(groups.values())
    out_bytes = lambda t: t.numel() * (OUT_DTYPE.itemsize if t.is_floating_point() else t.element_size())

    def tensors(items: list[int]) -> dict[str, torch.Tensor]:
        names = [n for i in items for n in groups_list[i]]
        flat = _read(checkpoint, {f"model.{n}": state[n].shape for n in names}, meta)
        cast = {n: (t.to(OUT_DTYPE) if t.is_floating_point() else t) for n in names for t in [flat[f"model.{n}"]]}
        return {k: v.contiguous() for k, v in revert_weight_conversion(model, cast).items()}

    def write_config(folder: Path) -> None:
        model.config.dtype = str(OUT_DTYPE).removeprefix("torch.")  # as save_pretrained of the bf16 model writes
        model.config.save_pretrained(folder)
        if model.can_generate():
            model.generation_config.save_pretrained(folder)
        copy_side_files(origin, folder)

    return _Export([sum(out_bytes(state[n]) for n in g) for g in groups_list], tensors, write_config)


def _loaded_conversions(model, origin: Path) -> list:
    """The weight conversions transformers' from_pretrained applies to `origin`'s tensor names (it records the
    ones any name matched, and save_pretrained reverses those), found from the files' headers alone."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from moeflow.models.hf import read_header, weight_files

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    state = model.state_dict()
    for file in weight_files(origin):
        for name in read_header(file):
            rename_source_key(name, renamings, converters, model.base_model_prefix, state)
    return [m for m in mapping if m.was_used()]


def _split(nbytes: list[int], parts: int) -> list[list[int]]:
    """Indices 0..n-1 in at most `parts` contiguous non-empty runs of about equal total bytes."""
    total, runs, size = sum(nbytes), [[]], 0
    for i, n in enumerate(nbytes):
        if runs[-1] and size + n / 2 > total * len(runs) / parts and len(runs) < parts:
            runs.append([])
        runs[-1].append(i)
        size += n
    return runs


def _exported(t: torch.Tensor, rule) -> torch.Tensor:
    """A checkpoint tensor (one expert's, for per-expert rules) in the Hugging Face on-disk layout."""
    if rule.transform == "transposed":
        return t.T
    if rule.transform in ("same", "copy"):
        return t
    raise ValueError(f"checkpoint.save_hf: {rule.hf} needs the load-only transform {rule.transform!r}")


def _check_expert_bias(checkpoint: Path, arch, meta: dict) -> None:
    """The exported architecture must not drop a learnt selection bias (as moeflow.models.hf.save_pretrained)."""
    if arch.router_bias:
        return
    biases = {k: m.size for k, m in meta.items() if k.startswith("model.") and k.endswith("router.expert_bias")}
    learnt = [k for k, t in _read(checkpoint, biases, meta).items() if bool(t.any())]
    if learnt:
        raise ValueError(f"checkpoint.save_hf: {learnt[0]} is nonzero but {arch.class_name} has no expert bias; "
                         f"train with model.moe.load_balance = 'none' or export with moeflow convert "
                         f"--architecture DeepseekV3ForCausalLM")


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()
