"""`moeflow convert`: Hugging Face model folders <-> moeflow run directories (DCP checkpoints).

  moeflow convert hf-to-moeflow HF_FOLDER RUN_DIR
  moeflow convert moeflow-to-hf RUN_DIR_OR_CHECKPOINT HF_FOLDER

A run directory is what `moeflow train --run-dir` writes: config.toml and checkpoints/step-N/ (DCP, complete
when COMPLETE.json is there). hf-to-moeflow writes one: the model as moeflow settings in config.toml, its
weights as checkpoints/step-0/, the source config.json as hf_config.json (so converting back keeps its token
ids) and the tokenizer files. moeflow-to-hf reads a run's newest complete checkpoint (or the one given) with
the model settings of the run's config.toml and writes a folder transformers loads.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

HELP = __doc__.split("\n", 2)[2]
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeflow convert", description="Convert checkpoints between Hugging Face "
                                "and moeflow.", epilog=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="direction", required=True, metavar="{hf-to-moeflow,moeflow-to-hf}")
    a = sub.add_parser("hf-to-moeflow", help="HF folder -> moeflow run directory (config.toml + DCP step-0)",
                       description="Read a Hugging Face folder (config.json + safetensors) and write a moeflow run "
                       "directory: config.toml, checkpoints/step-0/ (DCP), hf_config.json and tokenizer files. "
                       f"Supported architectures: {_supported()}.")
    a.add_argument("src", metavar="HF_FOLDER", help="folder with config.json and model*.safetensors")
    a.add_argument("dst", metavar="RUN_DIR", help="moeflow run directory to create")
    b = sub.add_parser("moeflow-to-hf", help="moeflow checkpoint -> HF folder",
                       description="Read a moeflow checkpoint (a run directory: its newest complete checkpoint; or "
                       "one checkpoints/step-N folder) with the model settings of the run's config.toml, and "
                       "write a Hugging Face folder (config.json + safetensors) that transformers loads.")
    b.add_argument("src", metavar="RUN_DIR_OR_CHECKPOINT", help="run directory, or RUN_DIR/checkpoints/step-N")
    b.add_argument("dst", metavar="HF_FOLDER", help="folder to write")
    b.add_argument("--config", help="the run's config.toml (default: RUN_DIR/config.toml)")
    b.add_argument("--architecture", help=f"HF class to write (default: the source's, else inferred): {_supported()}")
    b.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the written weights (bf16)")
    b.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MB (5GB)")
    return p


def _supported() -> str:
    from moeflow.core.hf_arch import SUPPORTED

    return SUPPORTED


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", text.upper())
    if not m:
        raise ValueError(f"--max-shard-size {text!r}: use a byte count or a size such as 5GB or 500MB")
    scale = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30,
             "T": 2**40, "TB": 2**40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def hf_to_moeflow(src: str | Path, dst: str | Path) -> Path:
    """Write RUN_DIR (config.toml, checkpoints/step-0, hf_config.json, tokenizer files); returns the checkpoint."""
    import torch

    from moeflow.config import JobConfig, to_toml
    from moeflow.models.hf import copy_side_files, from_pretrained
    from moeflow.train.checkpoint import CheckpointManager

    src, dst = Path(src), Path(dst)
    model, cfg = from_pretrained(src, dtype=torch.float32)
    cfg.hf_path = ""  # the run continues from the checkpoint written here, not from the folder again
    job = JobConfig(run_dir=str(dst), model=cfg)
    job.data.seq_len = min(job.data.seq_len, cfg.max_seq_len)
    dst.mkdir(parents=True, exist_ok=True)
    if "tokenizer.json" in copy_side_files(src, dst):
        job.data.tokenizer = str(dst / "tokenizer.json")
    (dst / "config.toml").write_text(to_toml(job))
    (dst / "hf_config.json").write_text((src / "config.json").read_text())
    # A never-stepped optimizer has no state, so the checkpoint holds the model only.
    optimizer = torch.optim.AdamW(model.parameters())
    return CheckpointManager(dst, keep=1, rank=0).save(0, model, optimizer, {"step": 0, "converted_from": str(src)})


def moeflow_to_hf(src: str | Path, dst: str | Path, *, config: str | None = None, architecture: str | None = None,
                  dtype: str = "bf16", max_shard_bytes: int = 5 * 2**30) -> Path:
    import torch

    from moeflow.config import load_config
    from moeflow.models.hf import copy_side_files, kept_fields, save_pretrained

    checkpoint, run_dir = _find_checkpoint(Path(src))
    config_path = Path(config) if config else run_dir / "config.toml"
    if not config_path.is_file():
        raise ValueError(f"{config_path} does not exist; pass the run's config.toml with --config")
    cfg = load_config(config_path, given=()).model
    if cfg.runs_transformers:
        return _transformers_to_hf(checkpoint, load_config(config_path, given=()), Path(dst), architecture, dtype,
                                   max_shard_bytes)
    cfg, original, origin = export_source(cfg, run_dir)
    model = native_model(load_config(config_path, given=()), cfg, checkpoint)
    architecture = architecture or (original.get("architectures") or [None])[0]
    dst = Path(dst)
    save_pretrained(model, cfg, dst, architecture=architecture, dtype=getattr(torch, DTYPES[dtype]),
                    max_shard_bytes=max_shard_bytes, extra_config=kept_fields(original))
    copy_side_files(origin, dst)
    return dst


def export_source(cfg, run_dir: Path) -> tuple:
    """(the model config to export, the original config.json's entries or {}, the folder holding the tokenizer)
    of a native run: a run that started from a Hugging Face folder trained that folder's architecture."""
    from moeflow.models.hf import read_hf_config

    original: dict = {}
    origin = run_dir  # where the tokenizer and the source config.json are
    if (run_dir / "hf_config.json").is_file():
        original = json.loads((run_dir / "hf_config.json").read_text())
    if cfg.hf_path:
        original, cfg = read_hf_config(cfg.hf_path)
        origin = Path(cfg.hf_path)
    return cfg, original, origin


def _transformers_to_hf(checkpoint: Path, job, dst: Path, architecture: str | None, dtype: str,
                        max_shard_bytes: int) -> Path:
    """A run on transformers' own modules: its weights written by transformers' save_pretrained, in the
    architecture (and on-disk tensor format) of the folder it started from."""
    import torch

    from moeflow.models import hf_transformers
    from moeflow.models.hf import copy_side_files

    origin = Path(job.model.hf_path)
    named = (hf_transformers.read_config(origin).get("architectures") or [None])[0]
    if architecture and architecture != named:
        raise ValueError(f"--architecture {architecture}: this run trained transformers' {named} (from {origin}) "
                         f"and exports as that architecture only; drop --architecture")
    model = transformers_model(job, checkpoint)
    model.to(getattr(torch, DTYPES[dtype])).save_pretrained(dst, max_shard_size=max_shard_bytes)
    copy_side_files(origin, dst)
    return dst


def _find_checkpoint(src: Path) -> tuple[Path, Path]:
    """(checkpoint folder, run directory) from either of them."""
    from moeflow.train.checkpoint import CheckpointManager, verify

    if (src / "checkpoints").is_dir():
        found = CheckpointManager(src, keep=1, rank=0).complete_checkpoints()
        if not found:
            raise ValueError(f"{src}/checkpoints has no complete checkpoint (step-N with COMPLETE.json)")
        return found[0][1], src
    if not src.is_dir():
        raise ValueError(f"{src} does not exist; pass a run directory or one of its checkpoints/step-N folders")
    problem = verify(src)
    if problem:
        raise ValueError(f"{src} is not a complete moeflow checkpoint: {problem}")
    return src, src.parent.parent


def native_model(job, cfg, checkpoint: Path, dtype=None, device="cpu"):
    """moeflow's model with a run's trained weights (`cfg`: the model config, the folder's for an HF-started
    run). A LoRA run's checkpoint holds its adapter only: the base is rebuilt as training built it (the folder's
    weights, or the seed's), the adapter loaded, and folded into the weights (a plain model, exported as one)."""
    import torch

    from moeflow.models.hf import build_empty

    dtype = dtype or torch.float32
    if job.peft.method == "none":
        model = build_empty(cfg, dtype, device)
        _load_model_state(checkpoint, model)
        return model
    from moeflow.models.hf import from_pretrained
    from moeflow.models.transformer import Transformer

    if cfg.hf_path:
        model, _ = from_pretrained(cfg.hf_path, dtype=torch.float32)
    else:
        model = Transformer(cfg)
        model.init_weights(seed=job.training.seed)  # as the trainer built the base (moeflow/train/build.py)
    return _with_run_weights(job, model, checkpoint).to(device=device, dtype=dtype)


def transformers_model(job, checkpoint: Path, device="cpu"):
    """transformers' own model of a run on its modules (the folder's base), with the run's trained weights."""
    from moeflow.models import hf_transformers

    return _with_run_weights(job, hf_transformers.load(job.model.hf_path, device), checkpoint)


def _with_run_weights(job, model, checkpoint: Path):
    """`model` with the checkpoint's weights; for a LoRA run (whose checkpoint holds the adapter only) `model` is
    the base, which gains the adapter, loaded, and folded into its weights."""
    if job.peft.method == "none":
        _load_model_state(checkpoint, model)
        return model
    from moeflow.models import lora

    p = job.peft
    lora.add(model, p.rank, p.alpha, p.dropout, p.modules, p.experts)
    _load_model_state(checkpoint, model)
    return lora.merge(model)


def _load_model_state(checkpoint: Path, model) -> None:
    """Only the model's tensors from a trainer checkpoint (the optimizer state is not read)."""
    import torch

    from moeflow.train.checkpoint import FORMAT, load_state

    extra = json.loads((checkpoint / "extra.json").read_text())
    if extra.get("format") != FORMAT:
        raise ValueError(f"{checkpoint} has checkpoint format {extra.get('format', 1)}; this moeflow reads {FORMAT}")
    # placeholders() names tensors through an optimizer's parameters; one that never stepped holds no state.
    optimizer = torch.optim.AdamW(model.parameters())
    load_state(checkpoint, [model], optimizer, model_only=True, local=True,
               fix="does config.toml describe the model that was trained?")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.direction == "hf-to-moeflow":
        checkpoint = hf_to_moeflow(args.src, args.dst)
        print(f"wrote {args.dst}: config.toml and the checkpoint {checkpoint}")
    else:
        out = moeflow_to_hf(args.src, args.dst, config=args.config, architecture=args.architecture,
                            dtype=args.dtype, max_shard_bytes=parse_size(args.max_shard_size))
        print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0
