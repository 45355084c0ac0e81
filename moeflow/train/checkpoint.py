"""Checkpoints under RUN_DIR/checkpoints/step-N/, written with torch.distributed.checkpoint (DCP).

Atomic: every rank writes into step-N.tmp/; when all are done, rank 0 writes a manifest (COMPLETE.json:
each file's size) and renames the folder. A folder without a manifest, or whose files do not match
it, is refused on resume (and the previous complete one is used), so a crash mid-save loses nothing.
Keys are layout-independent (moeflow.train.state), so a checkpoint reloads under another layout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moeflow.train import state
from moeflow.train.distributed import barrier, broadcast_object

MANIFEST = "COMPLETE.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(path: Path) -> str | None:
    """None when `path` is a complete checkpoint, else the reason it is not."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"{MANIFEST} is missing (the save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {size}"
    return None


FORMAT = 2  # flat, layout-independent keys (moeflow.train.state); 1 was nested with per-EP-rank expert keys


def load_state(path: Path, parts: list, optimizer, fix: str, model_only: bool = False) -> None:
    """Read a checkpoint's flat state (moeflow.train.state) into the model parts and the optimizer, each rank
    only what it owns under the current layout. A tensor the model needs but the checkpoint lacks is an error
    ending in `fix`."""
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    if model_only:
        saved = {k for k in saved if k.startswith("model.")}
    flat = state.placeholders(parts, optimizer, saved)
    missing = sorted(set(flat) - saved)
    # Ranks own different keys (pipeline stages, EP ranks): decide together, so none waits in dcp.load for a
    # peer that has already raised.
    if torch.distributed.is_initialized():
        nccl = torch.distributed.get_backend() == "nccl"  # NCCL reduces device tensors only
        count = torch.tensor([len(missing)], device="cuda" if nccl else "cpu")
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    else:
        count = torch.tensor([len(missing)], device="cpu")
    if int(count):
        shown = f" (first: {missing[:3]})" if missing else " (on another rank)"
        raise ValueError(f"checkpoint {path} lacks tensors this model needs{shown}; {fix}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, checkpoint_id=str(path))
    state.apply(parts, optimizer, flat)


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int, rank: int):
        self.root = Path(run_dir) / "checkpoints"
        self.keep, self.rank = keep, rank

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, newest first; incomplete or corrupted ones are reported and skipped."""
        found = []
        if self.root.is_dir():
            for p in self.root.iterdir():
                m = _STEP_DIR.match(p.name)
                if m and p.is_dir():
                    problem = verify(p)
                    if problem is None:
                        found.append((int(m.group(1)), p))
                    elif self.rank == 0:
                        warnings.warn(f"refusing checkpoint {p}: {problem}; using an older one", stacklevel=2)
        return sorted(found, reverse=True)

    def save(self, step: int, model, optimizer, extra: dict) -> Path:
        final = self.root / f"step-{step}"
        tmp = self.root / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        flat = state.gather([model], optimizer)
        with warnings.catch_warnings():  # DCP warns that a 1-process save is a 1-process save
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(flat, checkpoint_id=str(tmp))
        # RNG state differs per rank, so each rank keeps its own small file.
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   tmp / f"rng-rank{self.rank}.pt")
        barrier()
        if self.rank == 0:
            (tmp / "extra.json").write_text(json.dumps({**extra, "format": FORMAT}, indent=1))
            files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
            with open(tmp / MANIFEST, "w") as fh:
                json.dump({"step": step, "files": files}, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            for _, old in self.complete_checkpoints()[self.keep:]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def load(self, path: Path, model, optimizer) -> dict:
        extra = json.loads((path / "extra.json").read_text())
        if extra.get("format") != FORMAT:
            raise ValueError(
                f"checkpoint {path} was written by an older moeflow (format {extra.get('format', 1)}, this one "
                f"reads {FORMAT}); start a new --run-dir or pass --fresh"
            )
        load_state(path, [model], optimizer,
                   fix="was it saved from another model? Start a new --run-dir or pass --fresh")
        rng_file = path / f"rng-rank{self.rank}.pt"
        if rng_file.is_file():  # absent when resuming with more ranks than were saved
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["cpu"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        return extra

    def find_resume(self) -> Path | None:
        """The newest complete checkpoint, agreed on by every rank (rank 0 decides)."""
        found = self.complete_checkpoints() if self.rank == 0 else []
        return broadcast_object(found[0][1] if found else None)
