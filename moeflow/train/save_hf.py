"""`checkpoint.save_hf`: RUN_DIR/hf/ as a Hugging Face folder at the end of training, written by every rank.

The run's last checkpoint holds the model by global shape, experts one per key (moeflow.train.state_dict), so
no rank needs another's memory: the Hugging Face tensors (moeflow.core.hf_arch.tensor_rules, the architecture
`moeflow convert moeflow-to-hf` picks) are cut into one contiguous run per rank of about equal bytes, each rank
reads only its run's tensors from the checkpoint (DCP reads the regions asked for), writes them as its own
`model-0000R-of-0000N.safetensors`, and rank 0 writes the index, config.json and the tokenizer files, all into
`hf.tmp/`, renamed to `hf/` once every rank has written: a folder named hf/ is complete. No rank ever holds more
than its share of the model.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

OUT_DTYPE = torch.bfloat16  # as `moeflow convert moeflow-to-hf` writes by default


def save_hf(cfg, checkpoint: Path, rank: int, world: int) -> Path:
    """Write RUN_DIR/hf/ from `checkpoint` (collective over the run's ranks when there are several)."""
    from safetensors.torch import save_file

    from moeflow.convert import export_source
    from moeflow.core.hf_arch import arch_named, config_to_hf, infer_arch, tensor_rules
    from moeflow.models.hf import INDEX_FILE, SINGLE_FILE, copy_side_files, kept_fields

    run_dir = Path(cfg.run_dir)
    model_cfg, original, origin = export_source(cfg.model, run_dir)
    named = (original.get("architectures") or [None])[0]
    arch = arch_named(named) if named else infer_arch(model_cfg)
    rules = tensor_rules(model_cfg, arch)
    meta = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    key = lambda r: f"model.{r.mf}" + (f".{r.expert}" if r.expert is not None else "")
    missing = [key(r) for r in rules if key(r) not in meta]
    if missing:
        raise ValueError(f"checkpoint.save_hf: {checkpoint} lacks {missing[:3]} for {arch.class_name}")
    dtype_of = lambda r: torch.float32 if r.mf.endswith("router.expert_bias") else OUT_DTYPE
    nbytes = [meta[key(r)].size.numel() * dtype_of(r).itemsize for r in rules]
    runs = _split(nbytes, world)
    files = [SINGLE_FILE] if len(runs) == 1 else [f"model-{i + 1:05d}-of-{len(runs):05d}.safetensors"
                                                  for i in range(len(runs))]
    tmp, final = run_dir / "hf.tmp", run_dir / "hf"
    _check_expert_bias(checkpoint, arch, meta)  # on every rank: a refusal must not leave peers in a barrier
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(world)
    if rank < len(runs):
        mine = [rules[i] for i in runs[rank]]
        flat = {key(r): torch.empty(meta[key(r)].size, dtype=meta[key(r)].properties.dtype, device="cpu") for r in mine}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(flat, checkpoint_id=str(checkpoint), no_dist=True)
        save_file({r.hf: _exported(flat[key(r)], r).to(dtype_of(r)).contiguous() for r in mine},
                  str(tmp / files[rank]), metadata={"format": "pt"})
    if rank == 0:
        if len(runs) > 1:
            weight_map = {rules[i].hf: files[f] for f, run in enumerate(runs) for i in run}
            index = {"metadata": {"total_size": sum(nbytes)}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        hf = config_to_hf(model_cfg, arch, str(OUT_DTYPE).removeprefix("torch."))
        hf.update({k: v for k, v in kept_fields(original).items() if k not in hf})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        copy_side_files(origin, tmp)
    _barrier(world)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier(world)
    return final


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
    biases = {k: torch.empty(m.size, dtype=m.properties.dtype, device="cpu") for k, m in meta.items()
              if k.startswith("model.") and k.endswith("router.expert_bias")}
    if not biases:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(biases, checkpoint_id=str(checkpoint), no_dist=True)
    learnt = [k for k, t in biases.items() if bool(t.any())]
    if learnt:
        raise ValueError(f"checkpoint.save_hf: {learnt[0]} is nonzero but {arch.class_name} has no expert bias; "
                         f"train with model.moe.load_balance = 'none' or export with moeflow convert "
                         f"--architecture DeepseekV3ForCausalLM")


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()
