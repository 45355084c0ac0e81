"""`[profile]`: a window of steps under torch.profiler, a Chrome trace per rank, and where the step's time went.

Each profiling rank writes RUN_DIR/profile/rank{N}-steps{A}-{B}.json.gz (Perfetto or chrome://tracing open it).
The trace is also what the summary is read from: the ranges moeflow marks (moeflow.core.phases) give each phase's
own time per step (its range minus the phases nested in it), `other` is the rest of the step, and rank 0 prints
and writes profile/summary.txt with every profiling rank's figures and the slowest rank per phase.

On CUDA the ranges synchronize the device at their end while the window is open, so a range's host time is the
time of the kernels it launched (the window's steps lose their overlap; the trace still shows the kernels). With
`profile.memory`, CUDA records the allocator's history from the first step (so that a step running out of memory
at any point leaves profile/memory-rank{N}.pickle before the process exits) and dumps it after the window too;
on a CPU the summary gains two columns per phase: the peak of the tensor memory allocated since the window began
(the profiler's memory events) and the peak resident set size of the process inside the phase's ranges
(moeflow/models/phase_range.py; Linux), the step's own in the step row.
"""

from __future__ import annotations

import contextlib
import gzip
import json
from pathlib import Path

import torch
import torch.distributed as dist

from moeflow.core.phases import STEP, phase_of
from moeflow.models.phase_range import RssTracer, phase_range

MEMORY_ENTRIES = 100_000  # allocator events kept (torch's default)


class StepProfiler:
    """`with profiler.step(n): train_step(...)` for every step; collective at the window's last step."""

    def __init__(self, cfg, rank: int, world_size: int, device: torch.device, first_step: int):
        pr = cfg.profile
        ranks = cfg.profiled_ranks()
        self.enabled = pr.enabled and pr.start >= first_step
        self.profiles = self.enabled and (ranks is None or rank in ranks)
        stop = min(cfg.training.steps, cfg.training.stop_at) if cfg.training.stop_at > 0 else cfg.training.steps
        self.start, self.stop = pr.start, min(pr.start + pr.steps - 1, stop)
        self.memory, self.rank, self.world, self.device = pr.memory, rank, world_size, device
        self.folder = Path(cfg.run_dir) / "profile"
        self._prof = None
        self._rss: RssTracer | None = None
        self.summary: str | None = None
        # a run resumed past the window's start: said once, rather than a profile that silently never comes
        self.skipped = (f"profile: no profile this run: the window starts at profile.start = {pr.start} but the run "
                        f"resumes at step {first_step}; set --profile.start={first_step + 1} or later (after warm-up)"
                        if pr.enabled and pr.start < first_step and first_step <= stop else None)
        if self.profiles and self.memory and device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)

    @contextlib.contextmanager
    def step(self, step: int):
        if not self.enabled or not self.start <= step <= self.stop:
            with self._dump_on_oom():
                yield
            return
        if step == self.start and self.profiles:
            self._prof = _start(self.device, self.memory)
            if self.memory and self.device.type == "cpu" and RssTracer.available():
                self._rss = RssTracer()
                self._rss.start()
        with self._dump_on_oom(), phase_range(STEP):
            yield
            _sync(self.device)
        if step == self.stop:
            self._finish()

    @contextlib.contextmanager
    def _dump_on_oom(self):
        try:
            yield
        except torch.OutOfMemoryError:
            if self.profiles and self.memory and self.device.type == "cuda":
                self.folder.mkdir(parents=True, exist_ok=True)
                torch.cuda.memory._dump_snapshot(str(self.folder / f"memory-rank{self.rank}.pickle"))
            raise

    def _finish(self) -> None:
        table = None
        if self._prof is not None:
            self._prof.stop()
            self.folder.mkdir(parents=True, exist_ok=True)
            trace = self.folder / f"rank{self.rank}-steps{self.start}-{self.stop}.json.gz"
            self._prof.export_chrome_trace(str(trace))
            self._prof = None
            if self.memory and self.device.type == "cuda":
                torch.cuda.memory._dump_snapshot(str(self.folder / f"memory-rank{self.rank}.pickle"))
            table = phase_table(trace, self.stop - self.start + 1)
            if self._rss is not None:
                self._rss.stop()
                table["peak_rss_mb"] = rss_table(self._rss.peaks)
                self._rss = None
        tables = [table]
        if self.world > 1:
            tables = [None] * self.world
            dist.all_gather_object(tables, table)
        if self.rank == 0:
            self.summary = format_summary({r: t for r, t in enumerate(tables) if t is not None}, self.start,
                                          self.stop)
            (self.folder / "summary.txt").write_text(self.summary + "\n")


def _start(device: torch.device, memory: bool):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities, profile_memory=memory)
    prof.start()
    return prof


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def phase_table(trace: Path, steps: int) -> dict:
    """{'phases': {phase: ms per step}, 'step_ms', and with memory events 'peak_mb': {phase: MB}} of one rank's
    trace: each phase's own time, nested phases subtracted; `other` the step's time no phase took."""
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    steps_ = [e for e in ranges if e["name"] == STEP]
    marked = sorted(((e["ts"], e["ts"] + e["dur"], e.get("tid"), phase_of(e["name"])) for e in ranges
                     if phase_of(e["name"])), key=lambda r: (r[0], -r[1]))
    own: dict[str, float] = {}
    for i, (start, end, tid, phase) in enumerate(marked):
        inner, reach = 0.0, start  # the outermost phases nested in this one, on its thread
        for s2, e2, tid2, _ in marked[i + 1:]:
            if s2 >= end:
                break
            if tid2 == tid and s2 >= reach and e2 <= end:
                inner += e2 - s2
                reach = e2
        own[phase] = own.get(phase, 0.0) + (end - start - inner)
    step_us = sum(e["dur"] for e in steps_)
    phases = {p: us / 1e3 / steps for p, us in own.items()}
    phases["other"] = max(0.0, step_us / 1e3 / steps - sum(phases.values()))
    table = {"phases": phases, "step_ms": step_us / 1e3 / steps}
    memory = sorted((e["ts"], e["args"].get("Total Allocated", 0)) for e in events if e.get("name") == "[memory]")
    if memory:
        peak: dict[str, float] = {}
        for start, end, _, phase in marked:
            inside = [b for ts, b in memory if start <= ts <= end]
            if inside:
                peak[phase] = max(peak.get(phase, 0.0), max(inside) / 1e6)
        table["peak_mb"] = peak
    return table


def rss_table(peaks: dict[str, int]) -> dict[str, float]:
    """{phase (or 'step'): peak resident MB} from an RssTracer's {range name: bytes}."""
    out: dict[str, float] = {}
    for name, nbytes in peaks.items():
        phase = "step" if name == STEP else phase_of(name)
        if phase:
            out[phase] = max(out.get(phase, 0.0), nbytes / 1e6)
    return out


def format_summary(tables: dict[int, dict], start: int, stop: int) -> str:
    """Per phase: the mean over the profiling ranks of its ms per step and share of the step, and the slowest
    rank with its figure (and the peak memory per phase, the largest over the ranks, where it was recorded)."""
    order = list(dict.fromkeys(p for t in tables.values() for p in t["phases"] if p != "other")) + ["other"]
    n = len(tables)
    columns = [(key, title) for key, title in (("peak_mb", "tensors MB"), ("peak_rss_mb", "RSS MB"))
               if any(key in t for t in tables.values())]
    step = sum(t["step_ms"] for t in tables.values()) / n
    lines = [f"profile of steps {start}-{stop} on {n} rank{'s' if n > 1 else ''} ({', '.join(map(str, tables))}): "
             f"{step:.2f} ms per step",
             f"  {'phase':<22} {'ms/step':>9} {'share':>7}   {'slowest rank (ms/step)':<24}"
             + "".join(f" {title:>10}" for _, title in columns)]

    def peaks(phase: str) -> str:
        found = [[t[key][phase] for t in tables.values() if phase in t.get(key, {})] for key, _ in columns]
        return "".join(f" {max(f):>10.1f}" if f else f" {'':>10}" for f in found)

    for phase in order:
        per_rank = {r: t["phases"].get(phase, 0.0) for r, t in tables.items()}
        mean = sum(per_rank.values()) / n
        slow = max(per_rank, key=per_rank.get)
        lines.append(f"  {phase:<22} {mean:>9.2f} {mean / step if step else 0:>7.1%}   "
                     f"{f'{slow} ({per_rank[slow]:.2f})':<24}" + peaks(phase))
    slow = max(tables, key=lambda r: tables[r]["step_ms"])
    slowest = f"{slow} ({tables[slow]['step_ms']:.2f})"
    lines.append(f"  {'step':<22} {step:>9.2f} {1:>7.1%}   {slowest:<24}" + peaks("step"))
    return "\n".join(line.rstrip() for line in lines)
