"""Checkpoints under RUN_DIR/checkpoints/step-N/, written with torch.distributed.checkpoint (DCP).

Atomic: every rank writes into step-N.tmp/; when all are done, rank 0 writes a manifest (COMPLETE.json:
each file's size) and renames the folder. A folder without a manifest, or whose files do not match
it, is refused on resume (and the previous complete one is used), so a crash mid-save loses nothing.
Because DCP stores tensors by fully-qualified name, a checkpoint reloads under another layout.
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moeflow.train.distributed import barrier, broadcast_object

MANIFEST = "COMPLETE.json"
_EP_TAG = re.compile(r"@ep\d+of\d+")
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


def _expert_tag(model) -> str:
    """A per-EP-rank key suffix for expert tensors ('' without expert parallelism).

    Under EP each rank holds different experts under the same parameter name; DCP would keep only
    one rank's copy of a name, so each EP rank's experts are stored under their own key. (Resuming
    under another EP size therefore needs the same ep; resharding experts is future work.)
    """
    dims = getattr(model, "parallel_dims", None)
    if dims is None or dims.ep == 1:
        return ""
    return f"@ep{dims.submesh(model.device_mesh, 'ep').get_local_rank()}of{dims.ep}"


def _tag_experts(model_sd: dict, optim_sd: dict, tag: str) -> tuple[dict, dict]:
    """Rename expert keys (model and optimizer state) to carry `tag`; tag '' strips any tag."""

    def rename(key: str) -> str:
        key = _EP_TAG.sub("", key)
        return key + tag if tag and ".experts." in key else key

    model_sd = {rename(k): v for k, v in model_sd.items()}
    optim_sd = dict(optim_sd)
    optim_sd["state"] = {rename(k): v for k, v in optim_sd.get("state", {}).items()}
    optim_sd["param_groups"] = [
        {**g, "params": [rename(k) for k in g["params"]]} for g in optim_sd.get("param_groups", [])
    ]
    return model_sd, optim_sd


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
        model_sd, optim_sd = _tag_experts(*get_state_dict(model, optimizer), _expert_tag(model))
        with warnings.catch_warnings():  # DCP warns that a 1-process save is a 1-process save
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        # RNG state differs per rank, so each rank keeps its own small file.
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   tmp / f"rng-rank{self.rank}.pt")
        barrier()
        if self.rank == 0:
            (tmp / "extra.json").write_text(json.dumps(extra, indent=1))
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
        dims = getattr(model, "parallel_dims", None)
        saved_ep, ep = extra.get("ep", 1), dims.ep if dims is not None else 1
        if saved_ep != ep:
            raise ValueError(
                f"checkpoint {path} was saved with parallel.ep={saved_ep}; resuming with ep={ep} is not "
                f"supported yet: use --parallel.ep={saved_ep} or start a new --run-dir"
            )
        model_sd, optim_sd = _tag_experts(*get_state_dict(model, optimizer), _expert_tag(model))
        state = {"model": model_sd, "optim": optim_sd}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path))
        model_sd, optim_sd = _tag_experts(state["model"], state["optim"], "")
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
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
