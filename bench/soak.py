"""Soak: a long run with faults along the way loses nothing and leaks nothing.

    .venv/bin/python bench/soak.py                      # 2,000 steps, all parts (about 15 minutes on 2 cores)
    .venv/bin/python bench/soak.py --steps 300          # a shorter rehearsal
    .venv/bin/python bench/soak.py --part reference     # the parts one at a time (each under ~8 minutes here);
    .venv/bin/python bench/soak.py --part faulted       #   `report` reads what they left in --out
    .venv/bin/python bench/soak.py --part report

The job: tiny-moe at ep=2 on 2 local gloo ranks (`moeflow train --nproc-per-node 2`), a checkpoint every 50 steps
with checkpoint.keep_last = 3 and async saves, TensorBoard on. Two runs of the same job:
- reference: uninterrupted (the baseline, measured in the same invocation or an earlier part);
- faulted: with --max-restarts 2, a SIGKILL to rank 1 at 25% of the steps and to rank 0 at 50% (each restarts by
  itself from the newest complete checkpoint), a SIGTERM to the launcher at 70% (every rank checkpoints and the job
  exits 75) and a second start that finishes the run.
While each runs, every second: each rank's resident memory and open file descriptors (/proc), the step, and the
bytes under RUN_DIR/checkpoints. The report: the losses of every step against the reference (bit for bit), the
slope of memory and descriptors against the step after warm-up for each process (per 1,000 steps; a leak is a
positive slope), the largest disk use against one checkpoint's size, a table, bench/out/soak.json and soak.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 200  # after (re)starting, memory grows while allocator pools and caches fill


def job(run_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "moeflow", "train", "--config", str(REPO / "configs/default.toml"),
            "--nproc-per-node", "2", f"--run-dir={run_dir}", f"--training.steps={steps}",
            "--training.global_batch=8", "--checkpoint.every=50", "--checkpoint.keep_last=3",
            "--checkpoint.async=true", "--eval.every=500", "--metrics.log_every=10", "--no-progress"]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def ranks(launcher: int) -> dict[int, int]:
    """{rank: pid} of the launcher's worker processes."""
    found = {}
    for pid in _children(launcher):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            if "RANK" in env:
                found[int(env["RANK"])] = pid
        except OSError:
            pass
    return found


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def disk_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:  # removed while walking (a checkpoint being pruned)
            pass
    return total


def current_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


class Sampler(threading.Thread):
    """Every second: (time, step, rank, pid, RSS MB, open fds) per worker, and the checkpoint bytes."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.run_dir, self.launcher, self.stop = run_dir, None, threading.Event()
        self.samples, self.disk = [], []

    def run(self) -> None:
        while not self.stop.wait(1.0):
            if self.launcher is None:
                continue
            step = current_step(self.run_dir)
            for rank, pid in ranks(self.launcher).items():
                try:
                    self.samples.append({"t": time.time(), "step": step, "rank": rank, "pid": pid,
                                         "rss_mb": rss_mb(pid), "fds": len(os.listdir(f"/proc/{pid}/fd"))})
                except OSError:
                    pass
            if (self.run_dir / "checkpoints").is_dir():
                self.disk.append({"step": step, "bytes": disk_bytes(self.run_dir / "checkpoints")})


def run_job(run_dir: Path, steps: int, faults: list[tuple[float, str]], sampler: Sampler, restarts: int) -> dict:
    """Start the job (again after a stop, up to 3 starts); fire each (fraction of steps, action) once."""
    events, starts, pending = [], [], list(faults)
    while len(starts) < 3:
        cmd = job(run_dir, steps) + (["--max-restarts", str(restarts)] if restarts else [])
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        sampler.launcher = proc.pid
        err_lines: list[str] = []
        reader = threading.Thread(target=lambda p=proc, out=err_lines: out.extend(p.stderr), daemon=True)
        reader.start()
        while proc.poll() is None:
            time.sleep(0.2)
            step = current_step(run_dir)
            if pending and step >= pending[0][0] * steps:
                fraction, action = pending[0]
                workers = ranks(proc.pid)
                if action == "term":
                    proc.send_signal(signal.SIGTERM)
                else:
                    rank = int(action.removeprefix("kill-rank"))
                    if rank not in workers:
                        continue  # between a failure and the restart: try again in a moment
                    os.kill(workers[rank], signal.SIGKILL)
                events.append({"step": step, "action": action, "t": time.time()})
                pending.pop(0)
        reader.join()
        starts.append({"code": proc.returncode, "lines": [ln.rstrip() for ln in err_lines
                                                          if ln.startswith("moeflow train:")]})
        if proc.returncode != 75:  # 75: stopped by the signal after a checkpoint; start again to finish
            break
    return {"events": events, "starts": starts}


def measure(part: str, out: Path, steps: int) -> None:
    run_dir = out / part
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    sampler = Sampler(run_dir)
    sampler.start()
    t0 = time.time()
    if part == "reference":
        result = run_job(run_dir, steps, [], sampler, restarts=0)
    else:
        result = run_job(run_dir, steps, [(0.25, "kill-rank1"), (0.5, "kill-rank0"), (0.7, "term")], sampler,
                         restarts=2)
    sampler.stop.set()
    sampler.join()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    losses = {r["step"]: r["loss"] for r in map(json.loads, lines)}
    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"))
    one_checkpoint = disk_bytes(checkpoint[-1]) if checkpoint else 0
    record = {**result, "wall_s": time.time() - t0, "samples": sampler.samples, "disk": sampler.disk,
              "losses": losses, "one_checkpoint_bytes": one_checkpoint}
    (out / f"{part}.json").write_text(json.dumps(record))
    print(f"{part}: {len(losses)} steps logged in {record['wall_s']:.0f} s; starts: "
          f"{[s['code'] for s in result['starts']]}; events: {result['events']}")
    for start in result["starts"]:
        for line in start["lines"]:
            print("   ", line)


def slope_per_1000(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y against x, per 1,000 of x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def process_lives(samples: list[dict]) -> list[dict]:
    """Per worker process (pid): its samples after warm-up, with the slopes of RSS and fds against the step."""
    lives = []
    for pid in sorted({s["pid"] for s in samples}):
        mine = [s for s in samples if s["pid"] == pid]
        first, last = min(s["step"] for s in mine), max(s["step"] for s in mine)
        # From warm-up's end to before its last logged step: not the exit (files closed, memory freed) or the
        # moments after a peer died.
        late = [s for s in mine if first + WARMUP_STEPS <= s["step"] < last]
        if len({s["step"] for s in late}) < 5:
            continue  # too short-lived to say anything
        lives.append({
            "pid": pid, "rank": mine[0]["rank"], "steps": [late[0]["step"], late[-1]["step"]],
            "rss_mb": [round(late[0]["rss_mb"], 1), round(late[-1]["rss_mb"], 1)],
            "rss_mb_per_1000_steps": round(slope_per_1000([(s["step"], s["rss_mb"]) for s in late]), 2),
            "fds": [late[0]["fds"], late[-1]["fds"]],
            "fds_per_1000_steps": round(slope_per_1000([(s["step"], s["fds"]) for s in late]), 2),
        })
    return lives


def report(out: Path) -> dict:
    ref, flt = (json.loads((out / f"{p}.json").read_text()) for p in ("reference", "faulted"))
    steps = sorted(int(k) for k in ref["losses"])
    equal = [k for k in steps if flt["losses"].get(str(k)) == ref["losses"][str(k)]]
    summary = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
               "steps_logged": len(steps), "losses_equal": len(equal), "final_step": steps[-1] if steps else 0,
               "final_loss": {"reference": ref["losses"].get(str(steps[-1])), "faulted": flt["losses"].get(
                   str(steps[-1]))}, "events": flt["events"], "starts": flt["starts"],
               "wall_s": {"reference": round(ref["wall_s"]), "faulted": round(flt["wall_s"])}}
    for part, data in (("reference", ref), ("faulted", flt)):
        lives = process_lives(data["samples"])
        peak = max((d["bytes"] for d in data["disk"]), default=0)
        summary[part] = {"processes": lives, "peak_checkpoint_bytes": peak,
                         "one_checkpoint_bytes": data["one_checkpoint_bytes"],
                         "peak_over_one": round(peak / max(1, data["one_checkpoint_bytes"]), 2)}
    (out / "soak.json").write_text(json.dumps(summary, indent=1))
    _plot(out, ref, flt)
    print(f"\n{summary['machine']}; {summary['steps_logged']} logged steps, losses equal bit for bit: "
          f"{summary['losses_equal']}/{summary['steps_logged']}; final loss {summary['final_loss']}")
    print("faults:", ", ".join(f"{e['action']} at step {e['step']}" for e in flt["events"]),
          "; exit codes of the starts:", [s["code"] for s in flt["starts"]])
    print(f"\n{'run':<10} {'rank':>4} {'pid':>7} {'steps':>11} {'RSS MB':>13} {'MB/1000 st':>10} "
          f"{'fds':>9} {'fds/1000 st':>11}")
    for part in ("reference", "faulted"):
        for life in summary[part]["processes"]:
            print(f"{part:<10} {life['rank']:>4} {life['pid']:>7} {life['steps'][0]:>5}-{life['steps'][1]:<5} "
                  f"{life['rss_mb'][0]:>6}->{life['rss_mb'][1]:<6} {life['rss_mb_per_1000_steps']:>10} "
                  f"{life['fds'][0]:>4}->{life['fds'][1]:<4} {life['fds_per_1000_steps']:>11}")
    for part in ("reference", "faulted"):
        s = summary[part]
        print(f"{part}: checkpoints used at most {s['peak_checkpoint_bytes'] / 2**20:.1f} MB = {s['peak_over_one']} "
              f"x one checkpoint ({s['one_checkpoint_bytes'] / 2**20:.1f} MB; keep_last = 3)")
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return summary


def _plot(out: Path, ref: dict, flt: dict) -> None:
    sys.path.insert(0, str(REPO))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for part, data, style in (("reference", ref, ":"), ("faulted", flt, "-")):
        for pid in sorted({s["pid"] for s in data["samples"]}):
            mine = [s for s in data["samples"] if s["pid"] == pid]
            label = f"{part} rank {mine[0]['rank']}"
            axes[0].plot([s["step"] for s in mine], [s["rss_mb"] for s in mine], style, label=label)
            axes[1].plot([s["step"] for s in mine], [s["fds"] for s in mine], style, label=label)
        axes[2].plot([d["step"] for d in data["disk"]], [d["bytes"] / 2**20 for d in data["disk"]], style,
                     label=part)
    for e in flt["events"]:
        for ax in axes:
            ax.axvline(e["step"], color="grey", lw=0.8)
        axes[0].annotate(e["action"], (e["step"], axes[0].get_ylim()[1]), fontsize=7, rotation=90, va="top")
    axes[0].set_ylabel("resident MB")
    axes[1].set_ylabel("open fds")
    axes[2].set_ylabel("checkpoints MB")
    axes[2].set_xlabel("step (metrics.jsonl)")
    axes[0].legend(fontsize=7, ncol=2)
    axes[0].set_title("soak: tiny-moe ep=2, 2 ranks; faults at the grey lines")
    save_figure(fig, str(out / "soak.png"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--part", choices=("all", "reference", "faulted", "report"), default="all")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "soak"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for part in ("reference", "faulted"):
        if args.part in ("all", part):
            measure(part, out, args.steps)
    if args.part in ("all", "report"):
        report(out)


if __name__ == "__main__":
    main()
