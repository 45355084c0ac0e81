"""What a rank does when something goes wrong during training, and the exit code it ends with.

- A stop signal (SIGTERM, or SIGUSR1 which Slurm sends before a time limit), to the launcher or to any rank:
  the rank notes it; at the end of the step every rank learns of it through the step's sync, all write a
  checkpoint and stop (`Preempted`, exit code 75).
- A hang: a watchdog thread per rank; when a step takes longer than training.step_timeout_s it writes every
  thread's Python stack and the collective the main thread waits in to RUN_DIR/hang-rank{N}.txt, says where,
  and exits with 124.
- A slow rank: every step each rank's busy time is gathered (in the same sync); each logging step names the
  ranks slower than metrics.straggler_factor x the median.
- A failed peer (a killed rank, a broken connection, a collective timeout): one line, exit code 69; the
  launcher names the rank that failed first.
- A disk that is full or read-only: `CheckpointWriteError` from the checkpoint writer, exit code 74.

The exit codes (README, "When things go wrong"): 0 done, 2 bad input, 69 a peer rank failed, 74 a checkpoint or
the run dir could not be written, 75 stopped by a signal after a checkpoint (the same command resumes), 124 a
step exceeded training.step_timeout_s.

`MOEFLOW_TEST_FAULTS` (tests only) injects faults at given steps; see `_test_faults`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

EXIT_PEER_FAILED = 69  # sysexits EX_UNAVAILABLE: a peer rank is gone
EXIT_WRITE_FAILED = 74  # sysexits EX_IOERR
EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: try again (the same command resumes)
EXIT_HANG = 124  # what timeout(1) returns
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOPPED_FILE = "stopped.json"  # rank 0 writes it on a stop, for the launcher's one line
LAUNCHER_ENV = "MOEFLOW_LAUNCHER"  # set by `moeflow train --nproc-per-node`: ranks stop with exit 0 (see exit_code)
FIRST_STEP_ALLOWANCE = 10  # the first step after a start compiles and warms up: it may take this many times longer
BACKSTOP_S = 15  # after the watchdog's deadline, faulthandler's stderr dump if the watchdog thread cannot run


class CheckpointWriteError(OSError):
    """A checkpoint (or the run dir) could not be written; the message is one line with the fix. `agreed`: every
    rank raised it with the same message (so rank 0 alone prints it)."""

    def __init__(self, message: str, agreed: bool = True):
        super().__init__(message)
        self.agreed = agreed


class Preempted(Exception):
    def __init__(self, step: int, signal_name: str, checkpoint: Path | None):
        super().__init__(f"stopped by {signal_name} at step {step}")
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint


def is_peer_failure(e: BaseException) -> bool:
    """A collective failed because another rank is gone or silent (gloo / NCCL wording)."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out waiting",
        "timed out", "Socket Timeout", "NCCL communicator was aborted", "DistBackendError"))


def exit_code(e: BaseException, run_dir: str | Path) -> int | None:
    """The documented exit code for an error that ends training, after printing its one line (None: not a fault
    this module knows; the caller re-raises it)."""
    rank = int(os.environ.get("RANK", "0"))
    if isinstance(e, Preempted):
        where = f"checkpoint {e.checkpoint}" if e.checkpoint else "no checkpoint (checkpoint.enabled = false)"
        under_launcher = bool(os.environ.get(LAUNCHER_ENV))
        if rank == 0:
            print(f"moeflow train: stopped by {e.signal_name} at step {e.step} after writing {where}; run the "
                  f"same command to resume", file=sys.stderr)
            if under_launcher:
                record = {"step": e.step, "signal": e.signal_name, "checkpoint": str(e.checkpoint or "")}
                Path(run_dir, STOPPED_FILE).write_text(json.dumps(record))
        if dist.is_initialized():
            dist.destroy_process_group()
        # Under moeflow's launcher a non-zero code would make torch.distributed.run restart the ranks
        # (--max-restarts); the launcher reads stopped.json and exits with 75 itself.
        return 0 if under_launcher else EXIT_PREEMPTED
    if isinstance(e, CheckpointWriteError):
        if rank == 0 or not e.agreed:
            print(f"moeflow train: {e}" if e.agreed else f"moeflow train: rank {rank}: {e}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    if is_peer_failure(e):
        # gloo's text: "[.../pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer. This is ..."
        what = str(e).splitlines()[0].split("] ", 1)[-1].split(". ")[0]
        print(f"moeflow train: rank {rank}: a peer rank failed or stopped answering ({what}); the launcher names "
              f"it", file=sys.stderr)
        return EXIT_PEER_FAILED
    return None


def make_deterministic() -> None:
    """training.deterministic: deterministic kernels or an error (cuBLAS needs its workspace setting)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


class _StopSignals:
    """SIGTERM / SIGUSR1 handlers that only take note (the loop acts at the end of the step)."""

    def __init__(self):
        self.received: int | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # Python allows handlers there only
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum, _frame) -> None:
        self.received = self.received or signum

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _waiting_in(frame) -> str:
    """Where the main thread is: the innermost torch.distributed frame or read_after_collective (the collective it
    waits in: on NCCL the host waits only where it reads a result back) and the innermost moeflow frame that led
    there."""
    collective = caller = None
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if collective is None and ("/torch/distributed/" in path or frame.f_code.co_name == "read_after_collective"):
            collective = f"{frame.f_code.co_name} ({_package_path(path)}:{frame.f_lineno})"
        if caller is None and "/moeflow/" in path:
            caller = f"{frame.f_code.co_name} ({_package_path(path)}:{frame.f_lineno})"
        frame = frame.f_back
    if collective:
        return f"waiting in the collective {collective}, called from {caller}"
    return f"not in a collective; in {caller or 'code outside moeflow'}"


def _package_path(path: str) -> str:
    """torch/... or moeflow/...: a frame's file from its package on."""
    package = "torch" if "/torch/" in path else "moeflow"
    return f"{package}/{path.split(f'/{package}/')[-1]}"


class _Watchdog:
    """A thread that ends the process when a step outlasts its deadline, after writing every thread's stack."""

    def __init__(self, timeout_s: float, run_dir: Path, rank: int, world: int):
        self.timeout_s, self.run_dir, self.rank, self.world = timeout_s, run_dir, rank, world
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._step, self._closed = 0, False
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="moeflow-step-watchdog", daemon=True)
        self._thread.start()

    def arm(self, step: int, allowance: float = 1.0) -> None:
        with self._cv:
            self._step, self._deadline = step, time.monotonic() + self.timeout_s * allowance
            self._cv.notify()
        # This thread needs the interpreter lock, which a main thread stuck in some C++ calls keeps (a CUDA
        # .item() waiting for a hung NCCL kernel): then faulthandler's own thread, which needs no lock, prints
        # every stack to stderr a little later and ends the process (exit code 1).
        faulthandler.dump_traceback_later(self.timeout_s * allowance + BACKSTOP_S, exit=True)

    def disarm(self) -> None:
        with self._cv:
            self._deadline = None
        faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if self._deadline is None:
                    self._cv.wait()
                elif (left := self._deadline - time.monotonic()) > 0:
                    self._cv.wait(left)
                else:
                    self._fire(self._step)

    def _fire(self, step: int) -> None:
        path = self.run_dir / f"hang-rank{self.rank}.txt"
        where = _waiting_in(sys._current_frames().get(self._main))
        with open(path, "w") as fh:
            fh.write(f"rank {self.rank} of {self.world}: step {step} took longer than training.step_timeout_s = "
                     f"{self.timeout_s:g} s\nmain thread: {where}\n\nPython stacks of every thread (most recent "
                     f"call first):\n")
            fh.flush()
            faulthandler.dump_traceback(file=fh, all_threads=True)
        print(f"moeflow train: rank {self.rank}: step {step} exceeded training.step_timeout_s = {self.timeout_s:g} "
              f"s, {where}; every thread's stack is in {path}", file=sys.stderr, flush=True)
        # The peers' watchdogs fire within milliseconds (steps start together); give them time to write their
        # own stacks before this exit breaks their collectives.
        time.sleep(1.0)
        os._exit(EXIT_HANG)


class StepGuard:
    """Per-rank fault handling around each step: `begin(step)` before the step, `row()` inside it (this rank's
    stop flag and busy time, which the step's one all-reduce gathers), `end(step, per_rank)` after it, `log_record()`
    on logging steps."""

    def __init__(self, cfg, info):
        self.info, self.factor = info, cfg.metrics.straggler_factor
        self.signals = _StopSignals()
        run_dir = Path(cfg.run_dir)
        self.watchdog = (_Watchdog(cfg.training.step_timeout_s, run_dir, info.rank, info.world_size)
                         if cfg.training.step_timeout_s > 0 else None)
        self.faults = _test_faults(info.rank)
        self._first = True
        self._t0 = 0.0
        # host-side bookkeeping: the per-rank times arrive on the host already (summed here between reports)
        self._busy_sum_R = torch.zeros(info.world_size, dtype=torch.float64, device="cpu")
        self._steps = 0
        self.stop_signal = ""

    def _busy_clock(self) -> float:
        # On the CPU a rank's own work is its CPU time: time blocked in a collective, waiting for a slower
        # peer, does not count, so the slow rank stands out instead of every rank looking as slow as it.
        # On CUDA the host only queues kernels; the wall time up to the step's all-reduce is used (less telling).
        return time.process_time() if self.info.device.type == "cpu" else time.perf_counter()

    def begin(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.arm(step, FIRST_STEP_ALLOWANCE if self._first else 1.0)
        self._first = False
        self._t0 = self._busy_clock()
        _inject(self.faults, "step", step)

    def row(self) -> dict[str, float]:
        """This rank's stop flag (the signal number, or 0) and busy time so far in the step, for the step's one
        all-reduce (moeflow.train.step.train_step's per_rank): no collective or host sync of its own. Read before
        the optimizer step: a signal that arrives after it is acted on at the end of the next step."""
        return {"stop_signal": float(self.signals.received or 0), "busy_s": self._busy_clock() - self._t0}

    def end(self, step: int, per_rank: dict[str, list[float]]) -> bool:
        """True when every rank is to stop after this step (any rank received a stop signal); `per_rank`: every
        rank's row() as the step gathered them (StepResult.per_rank; further names are ignored)."""
        if self.watchdog is not None:
            self.watchdog.disarm()
        self._busy_sum_R += torch.tensor(per_rank["busy_s"], dtype=torch.float64, device="cpu")
        self._steps += 1
        signals = [int(flag) for flag in per_rank["stop_signal"] if flag]
        if signals and not self.stop_signal:
            self.stop_signal = signal.Signals(signals[0]).name
        return bool(signals)

    def log_record(self, step: int) -> dict:
        """Per-rank busy time per step over the steps since the last logging step; ranks slower than
        metrics.straggler_factor x the median are named (in the returned record and on rank 0's output)."""
        if not self._steps:
            return {}
        per_step_R = (self._busy_sum_R / self._steps).tolist()
        self._busy_sum_R.zero_()
        self._steps = 0
        # The lower median: with two ranks the median is the faster one, so the slower is compared with it.
        median = statistics.median_low(per_step_R)
        slowest = max(range(len(per_step_R)), key=per_step_R.__getitem__)
        record = {"rank_step_s": {"median": round(median, 6), "max": round(per_step_R[slowest], 6),
                                  "slowest_rank": slowest}}
        if self.factor > 0 and len(per_step_R) > 1 and median > 0:
            slow = [{"rank": r, "step_s": round(t, 6), "x_median": round(t / median, 2)}
                    for r, t in enumerate(per_step_R) if t > self.factor * median]
            if slow:
                record["stragglers"] = slow
                if self.info.is_main:
                    named = ", ".join(f"rank {s['rank']} ({s['step_s']:.3f} s, {s['x_median']}x)" for s in slow)
                    from tqdm import tqdm

                    tqdm.write(f"step {step}: straggler: {named} against the median {median:.3f} s per step "
                               f"(metrics.straggler_factor = {self.factor:g})")
        return record

    def close(self) -> None:
        self.signals.close()
        if self.watchdog is not None:
            self.watchdog.close()


# ---- test-only fault injection --------------------------------------------------------------------------------


def _test_faults(rank: int) -> list[dict]:
    """MOEFLOW_TEST_FAULTS, a JSON list of {"do", "rank", "step", "seconds", "attempt"}: what this rank is to do
    in this attempt (torchrun's restart count). For the fault tests only; nothing sets it otherwise.
    do: "kill" (SIGKILL itself), "term" / "usr1" (send itself the signal), "sleep" (for `seconds`, inside the
    step), "burn" (use `seconds` of CPU in every step from `step` on), "kill_before_commit" (rank 0: SIGKILL
    itself once the checkpoint of `step` is written, before its manifest and rename; with async saves that is in
    the writer thread, mid-save as far as the trainer knows)."""
    spec = os.environ.get("MOEFLOW_TEST_FAULTS")
    if not spec:
        return []
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return [f for f in json.loads(spec) if f.get("rank", 0) == rank and f.get("attempt", attempt) == attempt]


def _inject(faults: list[dict], where: str, step: int) -> None:
    for f in faults:
        do = f["do"]
        if (where == "commit") != (do == "kill_before_commit"):
            continue
        if do == "burn":
            if step >= f.get("step", 0):
                end = time.process_time() + f["seconds"]
                while time.process_time() < end:
                    pass
            continue
        if step != f["step"]:
            continue
        print(f"test fault: rank {f.get('rank', 0)} {do} at step {step} (t={time.time():.3f})", file=sys.stderr,
              flush=True)
        if do in ("kill", "kill_before_commit"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif do in ("term", "usr1"):
            os.kill(os.getpid(), signal.SIGTERM if do == "term" else signal.SIGUSR1)
        elif do == "sleep":
            time.sleep(f["seconds"])


def inject_before_commit(step: int) -> None:
    """The checkpoint writer's test hook (see _test_faults)."""
    faults = _test_faults(int(os.environ.get("RANK", "0")))
    if faults:
        _inject(faults, "commit", step)
