"""The training loop: build -> resume -> steps (with evaluation, metrics and checkpoints on their cadence) ->
summary.

One step trains on training.global_batch sequences whatever the number of ranks: each data-parallel rank takes
its contiguous share, splits it into micro-batches, and the parallel layout averages the gradients.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tqdm import tqdm

from moeflow.config import JobConfig, to_toml
from moeflow.train.build import Setup, build
from moeflow.train.checkpoint import CheckpointManager, check_writable
from moeflow.train.distributed import init_distributed
from moeflow.train.faults import Preempted, StepGuard, make_deterministic
from moeflow.train.metrics import MetricsLogger, peak_flops_per_device, peak_memory_mb
from moeflow.train.step import evaluate, state_bytes, train_step


def train(cfg: JobConfig, resume: bool = False, fresh: bool = False, progress: bool = True) -> dict:
    """Train; resume from the newest complete checkpoint in run_dir unless `fresh`.
    `resume=True` makes a missing checkpoint an error. Returns the summary (also in summary.json)."""
    info = init_distributed(cfg.training.device, cfg.parallel.timeout_s)
    dims, batch = cfg.layout(info.world_size)
    run_dir = Path(cfg.run_dir)
    check_writable(run_dir, info.rank)
    if cfg.training.deterministic:
        make_deterministic()
    s = build(cfg, info, dims, batch)
    ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep_last, info.rank, cfg.checkpoint.async_save)
    start, resumed_from = _resume(cfg, s, ckpt, resume, fresh)
    if info.is_main:
        _truncate_metrics(run_dir / "metrics.jsonl", start)  # lines the resumed (or fresh) run will log again
        run_dir.mkdir(parents=True, exist_ok=True)
        # atomically: a resumed run continues with this file's settings, so a torn write must not be read
        (run_dir / "config.toml.tmp").write_text(to_toml(cfg))
        os.replace(run_dir / "config.toml.tmp", run_dir / "config.toml")
    t_start = time.perf_counter()
    guard = StepGuard(cfg, info)  # stop signals, the step watchdog, stragglers (moeflow/train/faults.py)
    try:
        loop = _run_steps(cfg, s, ckpt, start, progress, guard)
    finally:
        guard.close()
    return _summary(cfg, s, start, loop, resumed_from, time.perf_counter() - t_start)


def _resume(cfg: JobConfig, s: Setup, ckpt: CheckpointManager, resume: bool, fresh: bool):
    """(first step to run, checkpoint resumed from or None)."""
    path = None if fresh else ckpt.find_resume()
    if resume and path is None:
        raise ValueError(f"--resume: no complete checkpoint under {cfg.run_dir}/checkpoints; drop --resume to start")
    if path is None:
        return 0, None
    extra = ckpt.load(path, s.model, s.optimizer)
    if "sampler" not in extra:
        # weights only (moeflow convert hf-to-moeflow): fresh optimizer, schedule and data order
        if s.info.is_main:
            print(f"starting from the weights in {path} (no optimizer or data state in it)")
        return 0, path
    s.scheduler.load_state_dict(extra["scheduler"])
    # Checkpoints keep no optimizer hyper-parameters (they come from the config), so the learning rate
    # of the next step is restored from the schedule.
    for group, lr in zip(s.optimizer.param_groups, s.scheduler.get_last_lr()):
        group["lr"] = lr
    s.sampler.load_state_dict(extra["sampler"])
    return extra["step"], path


def _due(every: int, step: int, is_last: bool) -> bool:
    return bool(every) and step % every == 0 or is_last


def _peak_memory(rows: list[list[float]]) -> dict:
    """The largest rank's peak memory (the last column of each rank's row) and which rank it is."""
    rank = max(range(len(rows)), key=lambda r: rows[r][-1])
    return {"peak_memory_mb": rows[rank][-1], "peak_memory_rank": rank}


def _run_steps(cfg: JobConfig, s: Setup, ckpt: CheckpointManager, start: int, progress: bool,
               guard: StepGuard) -> dict:
    """Steps start+1 .. stop; evaluation, metrics and checkpoints when due. Returns what the summary needs.
    A stop signal on any rank ends the run after the current step with a checkpoint (raises Preempted)."""
    t, info = cfg.training, s.info
    stop = min(t.steps, t.stop_at) if t.stop_at > 0 else t.steps
    logger = MetricsLogger(Path(cfg.run_dir), info.is_main, cfg.metrics.tensorboard, _wandb(cfg, info.is_main))
    tokens_per_step = t.global_batch * cfg.data.seq_len
    flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)
    peak = peak_flops_per_device(info.device, t.dtype)
    loop = {"stop": stop, "first_loss": None, "last_loss": None, "val_loss": None, "checkpoint": None,
            "grad_bytes": None, "mfu_known": bool(peak)}
    bar = tqdm(total=t.steps, initial=start, desc="train", unit="step", disable=not (info.is_main and progress),
               dynamic_ncols=True, mininterval=0.5)
    t_window, steps_window, tokens_per_s = time.perf_counter(), 0, 0.0
    for step in range(start + 1, stop + 1):
        is_last = step == stop
        guard.begin(step)
        out = train_step(cfg, s, with_moe_stats=_due(cfg.metrics.log_every, step, is_last), measure=is_last,
                         rank_row=lambda: (*guard.row(), peak_memory_mb(info.device)))
        stopping = guard.end(step, out["rank_rows"]) and not is_last
        ckpt.poll()
        steps_window += 1
        loop["first_loss"] = out["loss"] if loop["first_loss"] is None else loop["first_loss"]
        loop["last_loss"], loop["grad_bytes"] = out["loss"], out["grad_bytes"]
        validated = _due(cfg.eval.every, step, is_last)
        if validated:
            loop["val_loss"] = evaluate(cfg, s)
        if _due(cfg.metrics.log_every, step, is_last):
            now = time.perf_counter()
            tokens_per_s = steps_window * tokens_per_step / (now - t_window)
            t_window, steps_window = now, 0
            record = {
                "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"], "tokens_per_s": tokens_per_s,
                "mfu": tokens_per_s * flops_per_token / (peak * info.world_size) if peak else "unknown",
                **_peak_memory(out["rank_rows"]), **out.get("losses", {}),
            }
            if out["skipped"]:
                record["skipped"] = True
            if validated and loop["val_loss"] is not None:
                record["val_loss"] = loop["val_loss"]
            if "moe" in out:
                record["moe"] = out["moe"]
            record.update(guard.log_record(step))
            logger.log(step, record)
        if cfg.checkpoint.enabled and (_due(cfg.checkpoint.every, step, is_last) or stopping):
            extra = {"step": step, "scheduler": s.scheduler.state_dict(), "sampler": s.sampler.state_dict(),
                     "layout": s.layout}
            loop["checkpoint"] = ckpt.save(step, s.model, s.optimizer, extra)
        if stopping:
            ckpt.wait()
            bar.close()
            logger.close()
            raise Preempted(step, guard.stop_signal, loop["checkpoint"] if cfg.checkpoint.enabled else None)
        bar.set_postfix(loss=f"{out['loss']:.3f}", lr=f"{out['lr']:.1e}", tok_s=f"{tokens_per_s:,.0f}")
        bar.update(1)
    bar.close()
    ckpt.wait()  # an async save still in flight completes before the summary names it
    logger.close()
    return loop


def _wandb(cfg: JobConfig, is_main: bool):
    if not (cfg.metrics.wandb and is_main):
        return None
    import tomllib

    from moeflow.train.run_outputs import WandbSink

    return WandbSink(Path(cfg.run_dir), cfg.metrics.wandb_project, tomllib.loads(to_toml(cfg)))


def _summary(cfg: JobConfig, s: Setup, start: int, loop: dict, resumed_from, elapsed: float) -> dict:
    stop = loop["stop"]
    ran = stop > start
    last_ckpt = loop["checkpoint"] or resumed_from
    run_dir = Path(cfg.run_dir)
    summary = {
        "model": cfg.model.name, "params": cfg.model.num_params(), "active_params": cfg.model.num_active_params(),
        "layout": s.layout, "steps": stop, "start_step": start, "first_loss": loop["first_loss"],
        "final_loss": loop["last_loss"], "val_loss": loop["val_loss"],
        "tokens_per_s": (stop - start) * cfg.training.global_batch * cfg.data.seq_len / elapsed if ran else 0.0,
        "elapsed_s": elapsed, "checkpoint": str(last_ckpt) if last_ckpt else None,
        "metrics": str(run_dir / "metrics.jsonl"), "tensorboard": str(run_dir / "tb"),
        "mfu": None if loop["mfu_known"] else "unknown",
        "state_bytes_per_rank": state_bytes(s, loop["grad_bytes"]) if ran else None,
        "hf_bytes_read_rank0": s.hf_bytes_read,  # set when each rank read its own shards
        "data": s.data_summary or None,  # records, truncated conversations, packing fill (token cache path)
    }
    if s.info.is_main:
        from moeflow.train.run_outputs import write_loss_curve

        curve = write_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss.png")
        summary["loss_curve"] = str(curve) if curve else None
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop metrics lines logged after the checkpoint (they will be logged again)."""
    if path.is_file():
        lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= last_step]
        path.write_text("".join(ln + "\n" for ln in lines))
