"""`moeflow train --nproc-per-node N`: start N local ranks through torch.distributed.run and end in one line.

torch.distributed.run (the agent) watches the ranks: when one fails it stops the others and, with
--max-restarts, starts them all again (each resumes from the newest complete checkpoint); a SIGTERM / SIGUSR1
to this process is passed to every rank, which checkpoints and stops (moeflow/train/faults.py). What the agent
reports (a table per failed rank) is turned here into one line naming the rank that failed first and an exit
code from moeflow.train.faults.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from moeflow.train import faults

# The agent passes these to the ranks (SIGUSR1: what Slurm sends before a time limit; its default would end the
# agent alone and leave the ranks running).
HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def launch(nproc: int, rest: list[str], run_dir: str, max_restarts: int) -> int:
    """Run `moeflow train *rest` on nproc local ranks; returns the exit code (moeflow.train.faults)."""
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    cores = os.cpu_count() or 1
    if not torch.cuda.is_available() and nproc > cores:
        print(f"warning: --nproc-per-node {nproc} is more than the {cores} CPU cores here; "
              f"each rank will get less than a core and training will be slow", file=sys.stderr)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    stopped = Path(run_dir, faults.STOPPED_FILE)
    stopped.unlink(missing_ok=True)
    os.environ[faults.LAUNCHER_ENV] = "1"  # the ranks inherit it
    # The agent shares its TCP store with the ranks by default, and a restarted rank can then read a dead rank's
    # address from the previous attempt and fail to connect (seen here with torch 2.13; pytorch/pytorch#135712).
    # Unshared, every attempt gets a store of its own.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The agent's folders for each attempt's per-rank error files: in a temporary folder of ours, removed after the
    # job, where the agent's default (a torchelastic_* folder in the temp dir) is left behind by every launch.
    # The failure report reads exit codes, not those files.
    agent_logs = tempfile.TemporaryDirectory(prefix="moeflow-launch-", ignore_cleanup_errors=True)
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                  f"--signals-to-handle={HANDLED_SIGNALS}", f"--log-dir={agent_logs.name}", "--no-python",
                  sys.executable, "-m", "moeflow", "train", *rest])
    except ChildFailedError as e:
        return _report_failure(e.failures, run_dir, max_restarts)
    except SignalException as e:
        return _report_stop(stopped, run_dir, e.sigval)
    finally:
        del os.environ[faults.LAUNCHER_ENV]
        agent_logs.cleanup()
    if stopped.is_file():  # a rank received the signal itself; every rank checkpointed and stopped
        return _report_stop(stopped, run_dir, None)
    return 0


def _newest(run_dir: str) -> str:
    import warnings

    from moeflow.train.checkpoint import CheckpointManager

    with warnings.catch_warnings():  # an incomplete step-N is skipped here without a word; the ranks said it
        warnings.simplefilter("ignore")
        found = CheckpointManager(run_dir, keep=1, rank=0).complete_checkpoints()
    return f"resumes from {found[0][1]}" if found else "starts from step 0 (no complete checkpoint)"


def _report_stop(stopped: Path, run_dir: str, sigval) -> int:
    if stopped.is_file():
        info = json.loads(stopped.read_text())
        stopped.unlink()
        # each rank printed nothing else; rank 0 printed the step and the checkpoint already
        print(f"moeflow train: every rank stopped on {info['signal']} at step {info['step']} (exit code "
              f"{faults.EXIT_PREEMPTED}); the same command {_newest(run_dir)}", file=sys.stderr)
        return faults.EXIT_PREEMPTED
    name = signal.Signals(sigval).name if sigval else "a signal"
    print(f"moeflow train: stopped by {name} before the ranks could write a checkpoint (they get "
          f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default); the same command {_newest(run_dir)}", file=sys.stderr)
    return 128 + int(sigval or signal.SIGTERM)


def _cause(failure) -> tuple[int, str, int]:
    """(how likely this rank's failure caused the others', what happened, the job's exit code): a rank killed
    by a signal other than the agent's SIGTERM, a hang, a disk error, a crash; a rank that only lost its peer
    last."""
    code = failure.exitcode
    if code == -signal.SIGABRT:  # NCCL's watchdog aborts a rank whose collective timed out or lost a peer
        return 5, "was aborted (SIGABRT: NCCL does this to a rank whose collective timed out or lost a peer)", 1
    if code < 0:
        name = signal.Signals(-code).name
        return (0 if -code != signal.SIGTERM else 4), f"was killed by {name}", 1
    if code == faults.EXIT_HANG:
        return 1, "exceeded training.step_timeout_s", faults.EXIT_HANG
    if code == faults.EXIT_WRITE_FAILED:
        return 2, "could not write to the run dir (its line is above)", faults.EXIT_WRITE_FAILED
    if code == faults.EXIT_PEER_FAILED:
        return 5, "lost a peer", 1
    if code == 2:
        return 2, "refused its input (its line is above)", 2
    return 3, f"exited with code {code} (its traceback is above)", 1


def _hang_culprits(run_dir: str) -> set[int]:
    """Ranks whose watchdog found them outside any collective: the ones the others waited for."""
    out = set()
    for path in Path(run_dir).glob("hang-rank*.txt"):
        if "main thread: not in a collective" in path.read_text(errors="replace"):
            out.add(int(path.stem.removeprefix("hang-rank")))
    return out


def _report_failure(failures: dict, run_dir: str, max_restarts: int) -> int:
    culprits = _hang_culprits(run_dir)
    rank, failure = min(failures.items(), key=lambda kv: (_cause(kv[1])[0], kv[0] not in culprits, kv[0]))
    _, what, code = _cause(failure)
    extra = ""
    if code == faults.EXIT_HANG:
        files = sorted(str(p) for p in Path(run_dir).glob("hang-rank*.txt"))
        if rank in culprits:
            extra = " outside any collective (the other ranks waited for it in one)"
        extra += f"; every rank's stacks: {', '.join(files) or 'none written'}"
    restarts = (f"after {max_restarts} restart{'s' * (max_restarts > 1)}" if max_restarts
                else "(--max-restarts N restarts it automatically)")
    print(f"moeflow train: rank {rank} (pid {failure.pid}) {what}{extra}; the job stopped {restarts}; the same "
          f"command {_newest(run_dir)}", file=sys.stderr)
    return code
