"""[profile]: a Chrome trace per rank that parses and names moeflow's phases, a summary whose phases add up to the
step (and whose own-time rule is checked on a hand-built trace), the peak resident memory per phase on a CPU (its
nesting rule hand-worked, and a real allocation seen), the CUDA memory snapshot written when a step runs out of
memory (the allocator simulated), a resumed run that skips the window saying so, and bad settings in one line."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from moeflow.config import load_config
from moeflow.core import phases
from moeflow.models import phase_range as pr
from moeflow.train import profile
from moeflow.train.profile import StepProfiler, phase_table
from tests.parallel.layout_worker import BASE, launch
from tests.support.cli import assert_one_line


def test_an_ep2_run_writes_a_trace_per_rank_and_a_summary_that_adds_up(tmp_path):
    run = tmp_path / "run"
    argv = [*BASE, "--parallel.ep=2", "--profile.enabled=true", "--profile.start=2", "--profile.steps=2",
            "--profile.memory=true", f"--run_dir={run}"]
    assert launch(2, [("ep2", argv, str(run), False)]) == {"ep2": "ok"}
    for rank in (0, 1):
        events = json.loads(gzip.open(run / "profile" / f"rank{rank}-steps2-3.json.gz").read())["traceEvents"]
        names = {e.get("name", "") for e in events}
        for name in (phases.STEP, phases.ATTENTION, phases.DISPATCH, phases.EXPERTS, phases.COMBINE,
                     phases.OPTIMIZER, phases.BACKWARD):
            assert name in names, (rank, name)
        assert any(n.startswith("FSDP::post_backward_reduce") for n in names)  # the gradient reduction
        assert sum(e.get("name") == phases.STEP for e in events) == 2
    summary = (run / "profile" / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("profile of steps 2-3 on 2 ranks (0, 1)")
    rows = {line[2:24].strip(): line[24:].split() for line in summary[2:]}
    for phase in ("attention", "ep dispatch", "expert matmuls", "ep combine", "gradient reduction",
                  "optimizer step", "other"):
        assert float(rows[phase][0]) > 0, phase
    step = float(rows.pop("step")[0])
    assert sum(float(r[0]) for r in rows.values()) == pytest.approx(step, abs=0.01 * len(rows))
    assert sum(float(r[1].rstrip("%")) for r in rows.values()) == pytest.approx(100, abs=0.1 * len(rows))
    assert all(r[2] in ("0", "1") for r in rows.values())  # the slowest rank, named
    if pr.RssTracer.available():  # tensors MB, then RSS MB; the step's own RSS peak holds every phase's
        assert summary[1].split()[-4:] == ["tensors", "MB", "RSS", "MB"]
        end = len(summary[1])  # a right-aligned column; FSDP2's own ranges and `other` have none
        rss = {line[2:24].strip(): line[end - 10:end].strip() for line in summary[2:]}
        assert {p for p, v in rss.items() if not v} == {"parameter gather", "gradient reduction", "other"}
        rss = {p: float(v) for p, v in rss.items() if v}
        assert min(rss.values()) > 50  # a process with torch loaded: tens of MB resident at least
        assert rss["step"] >= max(rss.values())


def test_own_time_subtracts_nested_phases_hand_worked(tmp_path):
    """One 100 us step holding attention [10, 40) and a backward [50, 95) with a gradient reduction [60, 70)
    and an FSDP range that is no phase [75, 80) inside it; another thread's range does not nest."""
    x = lambda name, ts, dur, tid=1: {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur,
                                     "tid": tid}
    events = [x(phases.STEP, 0, 100), x(phases.ATTENTION, 10, 30), x(phases.BACKWARD, 50, 45),
              x("FSDP::post_backward_reduce (layers.0)", 60, 10), x("FSDP::pre_backward (layers.0)", 75, 5),
              x(phases.OPTIMIZER, 52, 2, tid=2)]
    trace = tmp_path / "t.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    table = phase_table(trace, steps=1)
    assert table["step_ms"] == pytest.approx(0.1)
    assert table["phases"] == pytest.approx({"attention": 0.03, "backward (the rest)": 0.035,
                                             "gradient reduction": 0.01, "optimizer step": 0.002, "other": 0.023})


def test_rss_peaks_nest_hand_worked(monkeypatch):
    """A [peak 150 before B] holds B [peak 300]; after B, A reads 120: A's peak is 300, B's 300; C (entered at 90,
    a peak between ranges) reads 80."""
    readings = iter([100, 100, 150, 300, 120, 90, 80])  # start, enter A, enter B, leave B, leave A, enter C, leave C
    monkeypatch.setattr(pr, "_read_and_reset_peak", lambda: next(readings))
    tracer = pr.RssTracer()
    tracer.start()
    try:
        with pr.phase_range(phases.ATTENTION):
            with pr.phase_range(phases.EXPERTS):
                pass
        with pr.phase_range(phases.OPTIMIZER):
            pass
    finally:
        tracer.stop()
    assert tracer.peaks == {phases.ATTENTION: 300, phases.EXPERTS: 300, phases.OPTIMIZER: 80}
    assert profile.rss_table(tracer.peaks) == {"attention": 300e-6, "expert matmuls": 300e-6, "optimizer step": 80e-6}
    with pr.phase_range(phases.ROUTER):  # off again: nothing read
        pass


@pytest.mark.skipif(not pr.RssTracer.available(), reason="needs /proc/self/clear_refs (Linux)")
def test_rss_peak_sees_memory_touched_and_freed_inside_a_range():
    tracer = pr.RssTracer()
    tracer.start()
    try:
        with pr.phase_range(phases.OPTIMIZER):
            pass
        with pr.phase_range(phases.EXPERTS):
            x = torch.ones(64 * 2**20 // 4)  # 64 MiB written, then freed before the range ends
            del x
        with pr.phase_range(phases.ATTENTION):
            pass
    finally:
        tracer.stop()
    before, inside, after = (tracer.peaks[n] for n in (phases.OPTIMIZER, phases.EXPERTS, phases.ATTENTION))
    assert inside - before > 60 * 2**20 and inside - after > 60 * 2**20


def test_a_run_resumed_past_the_window_says_so(tmp_path):
    cfg = load_config(None, {"profile.enabled": True, "profile.start": 3, "training.steps": 10,
                             "run_dir": str(tmp_path)})
    resumed = StepProfiler(cfg, 0, 1, torch.device("cpu"), first_step=5)
    assert not resumed.enabled
    assert resumed.skipped == ("profile: no profile this run: the window starts at profile.start = 3 but the run "
                               "resumes at step 5; set --profile.start=6 or later (after warm-up)")
    assert StepProfiler(cfg, 0, 1, torch.device("cpu"), first_step=3).skipped is None


def test_a_step_out_of_memory_leaves_a_snapshot(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    cfg = load_config(None, {"profile.enabled": True, "profile.memory": True, "profile.start": 5,
                             "training.steps": 10, "run_dir": str(tmp_path)})
    prof = StepProfiler(cfg, 0, 1, torch.device("cuda"), first_step=1)
    assert calls == [("record", {"max_entries": profile.MEMORY_ENTRIES})]  # from the first step on
    with pytest.raises(torch.OutOfMemoryError):
        with prof.step(2):  # before the window: the history is kept all along
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert calls[-1] == ("dump", str(tmp_path / "profile" / "memory-rank0.pickle"))


@pytest.mark.parametrize("changes, world, message", [
    ({"profile.start": 0}, 1, r"profile.start = 0, profile.steps = 2: both must be at least 1"),
    ({"profile.start": 50, "training.steps": 10}, 1, r"profile.start = 50 is past training.steps = 10"),
    ({"profile.ranks": "0,x"}, 1, r"profile.ranks = '0,x'; use comma-separated rank numbers"),
    ({"profile.ranks": "0,2"}, 2, r"profile.ranks = '0,2' names a rank past the 2 ranks of this run"),
])
def test_bad_profile_settings_are_one_line(changes, world, message):
    assert_one_line(lambda: load_config(None, {"profile.enabled": True, **changes}).layout(world), message)
