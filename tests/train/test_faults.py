"""Faults do not lose work: a killed rank (with and without automatic restarts), preemption signals to a rank and
to the launcher, a hung rank, a full or read-only disk, async checkpoints, stragglers, and reproducible runs.

The reference for every resumed run is an uninterrupted run of the same command (fp32, same layout: losses equal
bit for bit). Faults are injected with MOEFLOW_TEST_FAULTS (moeflow/train/faults.py), or by the test itself (a
signal to the launcher, a patched file writer, a read-only folder).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed.checkpoint.filesystem as dcp_fs

from moeflow import cli
from moeflow.config import load_config, parse_overrides
from moeflow.train.checkpoint import verify
from tests.parallel.layout_worker import BASE, LAYOUTS, launch
from tests.support.cli import REPO, old_torch

EP2 = ["--parallel.ep=2", "--nproc-per-node", "2", "--checkpoint.every=2", "--no-progress"]


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run_dir)}


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def _start(args, faults=None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if faults:
        env["MOEFLOW_TEST_FAULTS"] = json.dumps(faults)
    return subprocess.Popen([sys.executable, "-m", "moeflow", "train", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run(args, faults=None, timeout=120) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, time.time() at exit)."""
    proc = _start(args, faults)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err, time.time()


def _moeflow_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("moeflow train:")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """12 steps of ep=2 on 2 ranks without a fault; rank 1 burns 0.15 s of CPU in every step (a straggler: the
    arithmetic is unchanged)."""
    run = tmp_path_factory.mktemp("uninterrupted")
    tiny = _tiny_args()
    code, out, err, _ = _run([*tiny, *EP2, "--training.steps=12", f"--run-dir={run}"],
                             faults=[{"do": "burn", "rank": 1, "step": 1, "seconds": 0.15}])
    assert code == 0, err[-3000:]
    return run, out


def _tiny_args() -> list[str]:
    return [
        "--model.name=tiny-moe", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=2",
        "--model.n_kv_heads=1", "--model.ffn_dim=64", "--model.moe.ffn_dim=32", "--model.moe.num_experts=4",
        "--data.seq_len=16", "--data.max_bytes=100000", "--training.global_batch=4", "--training.warmup_steps=2",
        "--metrics.log_every=1", "--metrics.tensorboard=false", "--eval.every=0", "--eval.batches=1",
    ]


def test_stragglers_are_named_in_the_log_and_metrics(uninterrupted):
    """Rank 1 spends 0.15 s more CPU per step than rank 0 (a few hundredths): it is named at every logged step,
    rank 0 never."""
    run, out = uninterrupted
    records = _records(run)
    named = [[s["rank"] for s in r.get("stragglers", [])] for r in records]
    assert all(n in ([], [1]) for n in named), named
    assert sum(n == [1] for n in named) >= 0.8 * len(records), named
    assert all(r["rank_step_s"]["slowest_rank"] == 1 for r in records if r.get("stragglers"))
    assert re.search(r"step \d+: straggler: rank 1 \(0\.\d+ s, [\d.]+x\) against the median", out)


def test_preemption_and_killed_ranks_resume_exactly(uninterrupted, tmp_path):
    """One run dir, five starts; the losses of steps 1-12 equal the uninterrupted run's bit for bit.
    1. SIGTERM to rank 1 at step 3: every rank checkpoints step 3 and the job exits 75.
    2. SIGUSR1 to the launcher (async saves from here on): a checkpoint at the step it lands in, exit 75.
    3. Rank 0 is SIGKILLed after writing step 8's async checkpoint but before its manifest, without restarts:
       the job ends within parallel.timeout_s + 5 s with one line naming rank 0; step-8 is not taken.
    4. With --max-restarts 1 rank 1 is SIGKILLed at step 11: the ranks restart by themselves and finish."""
    reference, _ = uninterrupted
    run = tmp_path / "run"
    job = [*_tiny_args(), *EP2, "--training.steps=12", f"--run-dir={run}"]

    code, _, err, _ = _run(job, faults=[{"do": "term", "rank": 1, "step": 3}])
    assert code == 75, err[-3000:]
    assert "stopped by SIGTERM at step 3 after writing checkpoint" in err
    assert _checkpoints(run) == ["step-2", "step-3"]

    proc = _start([*job, "--checkpoint.async=true"])
    deadline = time.time() + 60
    while not (run / "metrics.jsonl").is_file() or max(_losses(run)) < 5:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-3000:]
    stopped = int(re.search(r"stopped by SIGUSR1 at step (\d+)", err).group(1))
    assert 5 <= stopped < 8 and f"step-{stopped}" in _checkpoints(run)
    assert _moeflow_lines(err)[-1].startswith("moeflow train: every rank stopped on SIGUSR1")

    timeout_s = 10  # the peers of the killed rank wait this long in a collective
    code, _, err, ended = _run([*job, "--checkpoint.async=true", f"--parallel.timeout_s={timeout_s}"],
                               faults=[{"do": "kill_before_commit", "rank": 0, "step": 8}])
    killed_at = float(re.search(r"test fault: rank 0 kill_before_commit at step 8 \(t=([\d.]+)\)", err).group(1))
    assert code == 1 and ended - killed_at < timeout_s + 5, (code, ended - killed_at)
    (line,) = [ln for ln in _moeflow_lines(err) if "the job stopped" in ln]
    assert re.match(r"moeflow train: rank 0 \(pid \d+\) was killed by SIGKILL", line), line
    assert f"resumes from {run / 'checkpoints' / f'step-{stopped}'}" in line
    assert "step-8.tmp" in _checkpoints(run) and verify(run / "checkpoints" / "step-8.tmp") is not None

    code, out, err, _ = _run([*job, "--checkpoint.async=true", "--max-restarts", "1"],
                             faults=[{"do": "kill", "rank": 1, "step": 11, "attempt": 0}])
    assert code == 0, err[-3000:]
    assert err.count("test fault: rank 1 kill at step 11") == 1 and "summary" in out
    assert _losses(run) == _losses(reference)
    assert _checkpoints(run) == ["step-10", "step-12"]  # checkpoint.keep_last = 2; no step-8.tmp left


def test_a_hung_rank_is_reported_with_every_ranks_stacks(tmp_path):
    """Rank 1 sleeps inside step 3; with training.step_timeout_s = 3 both ranks write their stacks (rank 0 names the
    collective it waits in), the job exits 124 soon after, naming the files."""
    run = tmp_path / "run"
    code, _, err, ended = _run([*_tiny_args(), *EP2, "--training.steps=6", "--training.step_timeout_s=3",
                                f"--run-dir={run}"], faults=[{"do": "sleep", "rank": 1, "step": 3, "seconds": 60}])
    slept_at = float(re.search(r"test fault: rank 1 sleep at step 3 \(t=([\d.]+)\)", err).group(1))
    assert code == 124 and ended - slept_at < 3 + 10, (code, ended - slept_at, err[-3000:])
    line = [ln for ln in _moeflow_lines(err) if "the job stopped" in ln][0]
    assert re.match(r"moeflow train: rank 1 \(pid \d+\) exceeded training.step_timeout_s outside any collective", line)
    assert str(run / "hang-rank0.txt") in line and str(run / "hang-rank1.txt") in line
    waiting = (run / "hang-rank0.txt").read_text()
    assert "step 3 took longer than training.step_timeout_s = 3 s" in waiting
    assert re.search(r"main thread: waiting in the collective \w+ \(torch/distributed/", waiting)
    assert "train_step" in waiting
    sleeping = (run / "hang-rank1.txt").read_text()
    assert "main thread: not in a collective" in sleeping and "faults.py" in sleeping


@pytest.mark.slow  # 14 s; bench/reproducibility.py checks every layout so too
def test_the_same_layouts_twice_give_identical_losses(tmp_path):
    """Two layouts of the matrix (tensor parallel, and the zero-bubble pipeline schedule), each trained in two
    separate launches of two processes: losses and gradient norms equal bit for bit."""
    picked = {name: LAYOUTS[2][name] for name in ("tp2", "pp2-1f1b" if old_torch() else "pp2-zbv")}
    runs = []
    for attempt in ("first", "second"):
        cases = [(name, [*BASE, *extra], str(tmp_path / attempt / name), False) for name, extra in picked.items()]
        results = launch(2, cases)
        assert all(outcome == "ok" for outcome in results.values()), results
        runs.append({name: _records(tmp_path / attempt / name) for name in picked})
    for name in picked:
        first, second = ([(r["step"], r["loss"], r["grad_norm"]) for r in run[name]] for run in runs)
        assert len(first) == 3 and first == second, name


# ---- one process: the disk, the stop signal, settings -----------------------------------------------------------


def _job(run, *extra) -> list[str]:
    return ["train", *_tiny_args(), "--no-progress", f"--run-dir={run}", "--training.steps=6",
            "--checkpoint.every=2", "--checkpoint.keep_last=2", *extra]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run = tmp_path_factory.mktemp("one_process")
    assert cli.main(_job(run)) == 0
    return _losses(run)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_loses_nothing(one_process, tmp_path, monkeypatch, capsys, async_save):
    """The writer fails with ENOSPC half-way through step 4's file: one line, exit 74, step-2 intact, nothing
    named step-4; the next start resumes from step-2 and ends on the uninterrupted losses."""
    run = tmp_path / "run"
    write_item = dcp_fs._write_item

    def disk_full(transforms, stream, data, write_item_, storage_key, *args, **kwargs):
        if "step-4.tmp" in str(getattr(stream, "name", "")):
            stream.write(b"half a tensor")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)
        return write_item(transforms, stream, data, write_item_, storage_key, *args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", disk_full)
    job = _job(run, f"--checkpoint.async={async_save}")
    assert cli.main(job) == 74
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "checkpoint step-4 could not be written" in line and "No space left on device" in line, line
    assert "the newest complete checkpoint, step-2, is intact" in line
    assert _checkpoints(run) == ["step-2"] and verify(run / "checkpoints" / "step-2") is None
    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    assert cli.main(job) == 0
    assert _losses(run) == one_process
    assert _checkpoints(run) == ["step-4", "step-6"]  # keep_last = 2


@contextlib.contextmanager
def _read_only(path):
    """Make `path` and everything in it unwritable: permissions for a normal user; root ignores them, so there
    the immutable attribute (chattr +i), when this file system has it."""
    if os.geteuid() != 0:
        paths = [path, *path.rglob("*")]
        modes = {p: p.stat().st_mode for p in paths}
        for p in paths:
            p.chmod(modes[p] & ~0o222)
        try:
            yield
        finally:
            for p in reversed(paths):
                p.chmod(modes[p])
        return
    if subprocess.run(["chattr", "-R", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root on a file system without chattr +i: no way to make a folder read-only")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-R", "-i", str(path)], check=True)


def test_a_read_only_run_dir_is_one_line_before_any_step(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(_job(run, "--training.stop_at=2")) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with _read_only(run):
        assert cli.main(_job(run)) == 74
        # one line for the error (after the note that the run dir's own config.toml is the starting point)
        (line,) = [ln for ln in capsys.readouterr().err.strip().splitlines() if "continuing with" not in ln]
    assert f"the run dir {run} is not writable" in line and "checkpoints are intact" in line, line
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_stop_signal_checkpoints_the_step_and_resumes_exactly(one_process, tmp_path, monkeypatch, capsys):
    """One process: SIGUSR1 at step 3 (no checkpoint is due) -> step-3 written, exit 75; the next start resumes
    there on the uninterrupted losses."""
    run = tmp_path / "run"
    monkeypatch.setenv("MOEFLOW_TEST_FAULTS", json.dumps([{"do": "usr1", "step": 3}]))
    assert cli.main(_job(run)) == 75
    assert "stopped by SIGUSR1 at step 3 after writing checkpoint" in capsys.readouterr().err
    assert _checkpoints(run) == ["step-2", "step-3"]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the trainer's handler is gone again
    monkeypatch.delenv("MOEFLOW_TEST_FAULTS")
    assert cli.main(_job(run)) == 0
    assert _losses(run) == one_process


def test_deterministic_kernels_train_the_same_steps_on_the_cpu(one_process, tmp_path):
    """training.deterministic turns on torch's deterministic algorithms; on the CPU the run was deterministic
    already, so the losses are those of the default run, bit for bit."""
    import torch

    try:
        assert cli.main(_job(tmp_path, "--training.deterministic=true")) == 0
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert _losses(tmp_path) == one_process


def test_fault_settings_are_checked_and_spelled_both_ways():
    cfg = load_config(None, parse_overrides(["--checkpoint.keep=3", "--checkpoint.async=true"]))
    assert cfg.checkpoint.keep_last == 3 and cfg.checkpoint.async_save
    for bad, named in [("--parallel.timeout_s=0", "parallel.timeout_s = 0.0"),
                       ("--metrics.straggler_factor=0.5", "metrics.straggler_factor = 0.5"),
                       ("--checkpoint.keep_last=0", "checkpoint.keep_last = 0"),
                       ("--training.step_timeout_s=-1", "training.step_timeout_s = -1.0")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            load_config(None, parse_overrides([bad]))


def test_a_rank_nccl_aborted_is_not_named_as_the_cause(tmp_path, capsys):
    """NCCL's watchdog ends a rank whose collective timed out or lost its peer with SIGABRT: the launcher names the
    rank that failed by itself (here one that crashed), as it does for a rank that lost its peer under gloo."""
    import signal
    from types import SimpleNamespace

    from moeflow.train.launch import _report_failure

    failures = {0: SimpleNamespace(exitcode=-signal.SIGABRT, pid=100), 1: SimpleNamespace(exitcode=1, pid=101)}
    assert _report_failure(failures, str(tmp_path), max_restarts=0) == 1
    line = capsys.readouterr().err
    assert "rank 1 (pid 101) exited with code 1" in line, line
    _report_failure({0: failures[0]}, str(tmp_path), max_restarts=0)
    assert "rank 0 (pid 100) was aborted (SIGABRT: NCCL" in capsys.readouterr().err


def test_a_rank_reading_a_collective_back_counts_as_waiting_in_it(monkeypatch):
    """On NCCL the host waits for a collective only where it reads the result (dist.all_reduce just queues it): a
    hang report taken there says the rank waits in a collective, not that it is the one the others wait for."""
    import sys

    import torch

    from moeflow.train.distributed import read_after_collective
    from moeflow.train.faults import _waiting_in

    seen = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: seen.append(_waiting_in(sys._getframe(1))))
    read_after_collective(torch.zeros(2))
    assert seen[0].startswith("waiting in the collective read_after_collective (moeflow/train/distributed.py:"), seen
    assert _waiting_in(sys._getframe()).startswith("not in a collective")


def test_a_multi_machine_launch_with_restarts_and_a_shared_store_is_warned(monkeypatch, capsys):
    from moeflow.train.distributed import _warn_shared_store

    env = {"TORCHELASTIC_MAX_RESTARTS": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _warn_shared_store(rank=0)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().err
    _warn_shared_store(rank=1)  # one line per job
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # unshared: each attempt has a store of its own
    _warn_shared_store(rank=0)
    assert capsys.readouterr().err == ""
