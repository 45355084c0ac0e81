"""Checkpoints under RUN_DIR/checkpoints/step-N/, written with torch.distributed.checkpoint (DCP).

Atomic: every rank writes into step-N.tmp/; when all are done, rank 0 writes a manifest (COMPLETE.json:
each file's size) and renames the folder. A folder without a manifest, or whose files do not match
it, is refused on resume (and the previous complete one is used), so a crash mid-save loses nothing.
Keys are layout-independent (moeflow.train.state_dict), so a checkpoint reloads under another layout.

With checkpoint.async_save the tensors are copied to host memory during the step and written by a background
thread (torch.distributed.checkpoint.async_save, over a process group of its own so its collectives never
interleave with training's); rank 0 writes the manifest and renames the folder once the write has finished, so
a crash before that leaves the previous complete checkpoint in place. A write that fails (a full or read-only
disk) raises CheckpointWriteError on every rank with one line; the partial folder is removed and never renamed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moeflow.models.lora import is_factor
from moeflow.train import state_dict
from moeflow.train.distributed import barrier, broadcast_object
from moeflow.train.faults import CheckpointWriteError, inject_before_commit

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


FORMAT = 2  # flat, layout-independent keys (moeflow.train.state_dict); 1 was nested with per-EP-rank expert keys


def load_state(path: Path, parts: list, optimizer, fix: str, model_only: bool = False, local: bool = False) -> None:
    """Read a checkpoint's flat state (moeflow.train.state_dict) into the model parts and the optimizer, each rank
    only what it owns under the current layout. A tensor the model needs but the checkpoint lacks is an error
    ending in `fix`. `local`: this process alone reads the whole model (convert, eval, generate), whether or not
    it belongs to a process group."""
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    if model_only:
        saved = {k for k in saved if k.startswith("model.")}
    flat = state_dict.placeholders(parts, optimizer, saved)
    missing = sorted(set(flat) - saved)
    # Ranks own different keys (pipeline stages, EP ranks): decide together, so none waits in dcp.load for a
    # peer that has already raised.
    if torch.distributed.is_initialized() and not local:
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
        dcp.load(flat, checkpoint_id=str(path), no_dist=local or not torch.distributed.is_initialized())
    state_dict.apply(parts, optimizer, flat)


def read_factors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """{moeflow fqn: whole factor} from a checkpoint (experts' factors reassembled from their per-expert keys)."""
    meta = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype, device="cpu") for k, m in meta.items()
            if k.startswith("model.") and hasattr(m, "size") and _factor_name(k) is not None}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, checkpoint_id=str(checkpoint), no_dist=True)
    experts: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    out = {}
    for key, tensor in flat.items():
        fqn = key.removeprefix("model.")
        name = _factor_name(key)
        if name == fqn:
            out[fqn] = tensor
        else:  # <fqn>.<global expert id>
            experts[name][int(fqn.rsplit(".", 1)[1])] = tensor
    for fqn, by_id in experts.items():
        out[fqn] = torch.stack([by_id[i] for i in range(len(by_id))])
    return out


def _factor_name(key: str) -> str | None:
    """The factor's fqn for a checkpoint key (with or without a trailing expert id), None if not a factor."""
    fqn = key.removeprefix("model.")
    if is_factor(fqn):
        return fqn
    head, _, tail = fqn.rpartition(".")
    return head if tail.isdigit() and is_factor(head) else None


def check_writable(run_dir: str | Path, rank: int) -> None:
    """Fail on every rank before the first step when rank 0 cannot write the run dir (a read-only or full disk),
    rather than after a checkpoint interval of work that could not be kept."""
    run_dir, problem = Path(run_dir), None
    if rank == 0:
        try:
            for folder in (run_dir, run_dir / "checkpoints"):
                folder.mkdir(parents=True, exist_ok=True)
                probe = folder / f".write-test-{os.getpid()}"
                probe.write_bytes(b"moeflow")
                probe.unlink()
            for existing in (run_dir / "metrics.jsonl", run_dir / "config.toml"):
                if existing.exists():
                    open(existing, "a").close()  # appending nothing: writable, unchanged
        except OSError as e:
            problem = str(e)
    problem = broadcast_object(problem)
    if problem:
        raise CheckpointWriteError(f"the run dir {run_dir} is not writable ({problem}); nothing in it was changed "
                                   f"and its checkpoints are intact. Make it writable or give another --run-dir")


def _reason(e: BaseException) -> str:
    """The first line of the root cause: DCP wraps each rank's exception in a CheckpointException."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return (str(e).splitlines() or [type(e).__name__])[0]


@dataclass
class _Pending:
    """An async save in flight; `done` is set by the writer thread once it is written (and, on rank 0, committed)."""

    step: int
    tmp: Path
    final: Path
    future: object
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int, rank: int, async_save: bool = False, on_commit=None):
        self.root = Path(run_dir) / "checkpoints"
        self.keep, self.rank, self.async_save = keep, rank, async_save
        self.on_commit = on_commit  # rank 0, each committed checkpoint's folder (a LoRA run writes its adapter)
        self.superseded: list[Path] = []  # an earlier run's checkpoints, removed at this run's first commit
        self.pending: _Pending | None = None  # an async save in flight
        # The background write runs its collectives on a group of its own (gloo: it works on host copies).
        self._group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None

    def supersede_earlier(self) -> None:
        """A fresh start in a run directory that holds checkpoints: they go once this run has one of its own, so
        that a later resume (a restart by the agents included) never picks an earlier run's higher step."""
        if self.rank == 0:
            self.superseded = [path for _, path in self.complete_checkpoints()]
            if self.superseded:
                print(f"--fresh: the {len(self.superseded)} checkpoint(s) in {self.root} (newest "
                      f"{self.superseded[0].name}) are removed when this run writes its first")

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

    def _agree(self, step: int, tmp: Path, error: BaseException | None) -> None:
        """Every rank raises CheckpointWriteError if any rank failed (so none waits in a collective for a peer that
        gave up); rank 0 removes the partial folder."""
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"  # NCCL reduces device tensors only
        failed = torch.tensor([float(error is not None)], device="cuda" if nccl else "cpu")
        if dist.is_initialized():
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if not float(failed):
            return
        reasons = [_reason(error) if error is not None else None]
        if dist.is_initialized():
            reasons = [None] * dist.get_world_size()
            dist.all_gather_object(reasons, _reason(error) if error is not None else None)
        rank, reason = next((r, why) for r, why in enumerate(reasons) if why is not None)
        if dist.is_initialized():
            reason = f"rank {rank}: {reason}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(self._failed(step, tmp, reason)) from error

    def _failed(self, step: int, tmp: Path, reason: str) -> str:
        newest = self.complete_checkpoints()
        kept = (f"the newest complete checkpoint, {newest[0][1].name}, is intact and the next start resumes there"
                if newest else "no complete checkpoint exists yet")
        return (f"checkpoint step-{step} could not be written to {tmp} ({reason}); nothing half-written is kept: "
                f"{kept}. Free disk space (checkpoint.keep_last bounds what checkpoints use) or give a writable "
                f"--run-dir")

    def save(self, step: int, model, optimizer, extra: dict) -> Path:
        """Write step-N. Synchronous: complete on return. Async: the tensors are copied now and written in the
        background; `poll` (every step) or `wait` completes it."""
        self.wait()
        final = self.root / f"step-{step}"
        tmp = self.root / f"step-{step}.tmp"
        error = None
        if self.rank == 0:
            try:
                for stale in self.root.glob("step-*.tmp"):  # left by a crash mid-save; none is in flight now
                    shutil.rmtree(stale)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = e
        self._agree(step, tmp, error)
        try:  # this rank's own files first: a failure here is agreed on before any rank enters DCP's collectives
            flat = state_dict.gather([model], optimizer)
            torch.save(rng_state(), tmp / f"rng-rank{self.rank}.pt")  # differs per rank: a small file each
            if self.rank == 0:
                (tmp / "extra.json").write_text(json.dumps({**extra, "format": FORMAT}, indent=1))
        except OSError as e:
            error = e
        self._agree(step, tmp, error)
        try:  # DCP gathers every rank's exception and raises on all of them
            with warnings.catch_warnings():  # DCP warns that a 1-process save is a 1-process save
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                if self.async_save:
                    future = dcp.async_save(flat, checkpoint_id=str(tmp), process_group=self._group)
                else:
                    dcp.save(flat, checkpoint_id=str(tmp))
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            error = e
        self._agree(step, tmp, error)
        if self.async_save:
            pending = self.pending = _Pending(step, tmp, final, future)
            future.add_done_callback(lambda _: self._on_written(pending))
            return final
        self._finish(step, tmp, final)
        return final

    def poll(self) -> None:
        """Raise now if the async save in flight failed; forget it once it is complete. No collective."""
        if self.pending is not None and self.pending.done.is_set():
            self._complete_pending()

    def wait(self) -> None:
        """Wait for the async save in flight, if any, to be written and committed. No collective."""
        if self.pending is not None:
            self.pending.done.wait()
            self._complete_pending()

    def _on_written(self, pending: _Pending) -> None:
        """Runs in the writer thread when this rank's write ends: rank 0 commits at once (its write finishing means
        every rank's has, since DCP ends a save with a collective), so a crash a moment later loses nothing."""
        try:
            pending.future.result()
            if self.rank == 0:
                self._commit(pending.step, pending.tmp, pending.final)
        except (Exception, CheckpointException) as e:
            pending.error = e
            if self.rank == 0:
                shutil.rmtree(pending.tmp, ignore_errors=True)
        finally:
            pending.done.set()

    def _complete_pending(self) -> None:
        pending, self.pending = self.pending, None
        if pending.error is not None:
            # each rank finds out at its own step, so each says it
            raise CheckpointWriteError(self._failed(pending.step, pending.tmp, _reason(pending.error)),
                                       agreed=False) from pending.error

    def _finish(self, step: int, tmp: Path, final: Path) -> None:
        """Synchronous save: rank 0 commits once every rank has written; every rank learns whether it worked."""
        barrier()
        error = None
        if self.rank == 0:
            try:
                self._commit(step, tmp, final)
            except OSError as e:
                error = e
        self._agree(step, tmp, error)

    def _commit(self, step: int, tmp: Path, final: Path) -> None:
        """Rank 0: manifest, atomic rename, then drop checkpoints beyond keep_last."""
        inject_before_commit(step)
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        with open(tmp / MANIFEST, "w") as fh:
            json.dump({"step": step, "files": files}, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        for old in self.superseded:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        self.superseded = []
        for _, old in self.complete_checkpoints()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        if self.on_commit is not None:
            self.on_commit(final)

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
            restore_rng(torch.load(rng_file, weights_only=False))
        return extra

    def find_resume(self) -> Path | None:
        """The newest complete checkpoint, agreed on by every rank (rank 0 decides)."""
        found = self.complete_checkpoints() if self.rank == 0 else []
        return broadcast_object(found[0][1] if found else None)


def rng_state() -> dict:
    """The CPU generator's state and that of this rank's GPU only: a resume may see fewer GPUs, or others."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    if not torch.cuda.is_available():
        return
    state = rng["cuda"]
    if isinstance(state, list):  # written by an older moeflow: one state per visible GPU; this rank's, if there
        device = torch.cuda.current_device()
        state = state[device] if device < len(state) else None
    if isinstance(state, torch.Tensor):
        torch.cuda.set_rng_state(state)
