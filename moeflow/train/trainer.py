"""The training loop: build -> resume -> steps (with evaluation, metrics and checkpoints on their cadence) ->
summary.

One step trains on training.global_batch sequences whatever the number of ranks: each data-parallel rank takes
its contiguous share, splits it into micro-batches, and the parallel layout averages the gradients.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from moeflow.config import JobConfig, to_toml
from moeflow.models.hf_transformers import model_label
from moeflow.train.build import Setup, build
from moeflow.train.checkpoint import CheckpointManager, check_writable
from moeflow.train.distributed import init_distributed
from moeflow.train.faults import Preempted, StepGuard, make_deterministic
from moeflow.train.metrics import MetricsLogger, peak_flops_per_device, peak_memory_mb
from moeflow.train.profile import StepProfiler
from moeflow.train.save_hf import save_hf
from moeflow.train.step import StepResult, evaluate, state_bytes, train_step


@dataclass
class LoopState:
    """What the steps of one invocation leave for its summary."""

    stop: int  # the last step this invocation runs
    peak_flops_known: bool  # this device is in the peak-FLOP/s table, so metrics.jsonl's mfu is a number
    first_loss: float | None = None
    last_loss: float | None = None
    val_loss: float | None = None  # the latest evaluation's
    checkpoint: Path | None = None  # the latest checkpoint this invocation wrote
    grad_bytes: int | None = None  # this rank's gradient bytes after the last step's backward
    hf_folder: Path | None = None  # RUN_DIR/hf/ when checkpoint.save_hf wrote it

    def took(self, result: StepResult) -> None:
        self.first_loss = result.loss if self.first_loss is None else self.first_loss
        self.last_loss, self.grad_bytes = result.loss, result.grad_bytes


@dataclass
class RunSummary:
    """The end of a run, as summary.json writes it (summary_json; README and tests read its keys)."""

    model: str
    params: int
    active_params: int
    layout: str
    steps: int  # the last step run
    start_step: int  # the step this invocation resumed after (0: from the start)
    first_loss: float | None  # of this invocation's first step
    final_loss: float | None
    val_loss: float | None
    tokens_per_s: float  # over this invocation's steps, evaluation and checkpoints included
    elapsed_s: float
    checkpoint: str | None  # the latest complete checkpoint: written by this invocation or resumed from
    metrics: str
    tensorboard: str
    peak_flops_known: bool  # summary.json's "mfu": null (the MFU of each logged step is in metrics.jsonl) or "unknown"
    state_bytes_per_rank: dict[str, int] | None  # the largest rank's (moeflow.train.step.state_bytes)
    hf_bytes_read_rank0: int | None  # set when each rank read its own Hugging Face shards
    data: dict | None  # records, truncated conversations, packing fill (token cache path)
    loss_curve: str | None  # loss.png (rank 0; None where nothing was logged)
    adapter: dict | None = None  # a LoRA run's RUN_DIR/adapter/ (rank 0): path, rank, trained params, bytes
    hf: str | None = None  # RUN_DIR/hf/, the Hugging Face folder checkpoint.save_hf wrote


def summary_json(summary: RunSummary) -> dict:
    """summary.json's object: the summary's fields in order, peak_flops_known written as "mfu"."""
    out = {}
    for key, value in asdict(summary).items():
        if key == "peak_flops_known":
            key, value = "mfu", None if value else "unknown"
        out[key] = value
    return out


def train(cfg: JobConfig, resume: bool = False, fresh: bool = False, progress: bool = True) -> dict:
    """Train; resume from the newest complete checkpoint in run_dir unless `fresh`.
    `resume=True` makes a missing checkpoint an error. Returns summary.json's object (summary_json)."""
    info = init_distributed(cfg.training.device, cfg.parallel.timeout_s, cfg.run_dir)
    dims, batch = cfg.layout(info.world_size)
    run_dir = Path(cfg.run_dir)
    check_writable(run_dir, info.rank)
    if cfg.training.deterministic:
        make_deterministic()
    s = build(cfg, info, dims, batch)
    ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep_last, info.rank, cfg.checkpoint.async_save,
                             on_commit=_adapter_writer(cfg) if cfg.peft.method == "lora" else None)
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
    if cfg.checkpoint.save_hf and loop.checkpoint is not None:
        loop.hf_folder = save_hf(cfg, loop.checkpoint, info.rank, info.world_size)
    summary = summary_json(_summary(cfg, s, start, loop, resumed_from, time.perf_counter() - t_start))
    if info.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _adapter_writer(cfg: JobConfig):
    """RUN_DIR/adapter/ in PEFT's format from each committed checkpoint (rank 0; moeflow/models/peft_format.py)."""
    from moeflow.models.peft_format import ADAPTER_DIR, write_adapter
    from moeflow.train.checkpoint import read_factors

    return lambda checkpoint: write_adapter(read_factors(checkpoint), cfg.model, cfg.peft,
                                            Path(cfg.run_dir) / ADAPTER_DIR)


def _resume(cfg: JobConfig, s: Setup, ckpt: CheckpointManager, resume: bool, fresh: bool):
    """(first step to run, checkpoint resumed from or None)."""
    if fresh:
        ckpt.supersede_earlier()
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


def _peak_memory(peaks_R: list[float]) -> dict:
    """The largest rank's peak memory and which rank it is."""
    rank = max(range(len(peaks_R)), key=peaks_R.__getitem__)
    return {"peak_memory_mb": peaks_R[rank], "peak_memory_rank": rank}


class _Throughput:
    """Tokens per second over the steps since the last logging step (evaluation and checkpoints included)."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.t_window, self.steps, self.tokens_per_s = time.perf_counter(), 0, 0.0

    def step(self) -> None:
        self.steps += 1

    def measure(self) -> float:
        """The window's tokens per second; starts the next window."""
        now = time.perf_counter()
        self.tokens_per_s = self.steps * self.tokens_per_step / (now - self.t_window)
        self.t_window, self.steps = now, 0
        return self.tokens_per_s


def _run_steps(cfg: JobConfig, s: Setup, ckpt: CheckpointManager, start: int, progress: bool,
               guard: StepGuard) -> LoopState:
    """Steps start+1 .. stop; evaluation, metrics and checkpoints when due. Returns what the summary needs.
    A stop signal on any rank ends the run after the current step with a checkpoint (raises Preempted)."""
    t, info = cfg.training, s.info
    logger = MetricsLogger(Path(cfg.run_dir), info.is_main, cfg.metrics.tensorboard, _wandb(cfg, info.is_main))
    flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)
    peak = peak_flops_per_device(info.device, t.dtype)
    loop = LoopState(stop=min(t.steps, t.stop_at) if t.stop_at > 0 else t.steps, peak_flops_known=bool(peak))
    throughput = _Throughput(t.global_batch * cfg.data.seq_len)
    bar = tqdm(total=t.steps, initial=start, desc="train", unit="step", disable=not (info.is_main and progress),
               dynamic_ncols=True, mininterval=0.5)
    profiler = StepProfiler(cfg, info.rank, info.world_size, info.device, start + 1)
    if profiler.skipped and info.is_main:
        tqdm.write(profiler.skipped)
    for step in range(start + 1, loop.stop + 1):
        is_last = step == loop.stop
        logged = _due(cfg.metrics.log_every, step, is_last)
        guard.begin(step)
        with profiler.step(step):
            result = train_step(cfg, s, with_moe_stats=logged, measure=is_last,
                                per_rank=lambda: {**guard.row(), "peak_memory_mb": peak_memory_mb(info.device)})
        if profiler.summary and step == profiler.stop:
            tqdm.write(profiler.summary)
        stopping = guard.end(step, result.per_rank) and not is_last
        ckpt.poll()
        throughput.step()
        loop.took(result)
        validated = _due(cfg.eval.every, step, is_last)
        if validated:
            loop.val_loss = evaluate(cfg, s)
        if logged:
            tokens_per_s = throughput.measure()
            mfu = tokens_per_s * flops_per_token / (peak * info.world_size) if peak else "unknown"
            logger.log(step, {**_metrics_record(result, tokens_per_s, mfu, loop.val_loss if validated else None,
                                                guard.log_record(step)), **_blend_record(cfg, s)})
        if cfg.checkpoint.enabled and (_due(cfg.checkpoint.every, step, is_last) or stopping):
            extra = {"step": step, "scheduler": s.scheduler.state_dict(), "sampler": s.sampler.state_dict(),
                     "layout": s.layout}
            loop.checkpoint = ckpt.save(step, s.model, s.optimizer, extra)
        if stopping:
            ckpt.wait()
            bar.close()
            logger.close()
            raise Preempted(step, guard.stop_signal, loop.checkpoint if cfg.checkpoint.enabled else None)
        bar.set_postfix(loss=f"{result.loss:.3f}", lr=f"{result.lr:.1e}", tok_s=f"{throughput.tokens_per_s:,.0f}")
        bar.update(1)
    bar.close()
    ckpt.wait()  # an async save still in flight completes before the summary names it
    logger.close()
    return loop


def _blend_record(cfg: JobConfig, s: Setup) -> dict:
    """metrics.jsonl's `data_tokens` under data.blend: the tokens trained from each source so far (every rank's)."""
    if not cfg.data.blend:
        return {}
    return {"data_tokens": {src.name: n for src, n in zip(s.sampler.sources, s.sampler.trained)}}


def _data_summary(cfg: JobConfig, s: Setup) -> dict | None:
    """The data's summary, a blend's trained tokens per source filled in from the sampler."""
    if not s.data_summary:
        return None
    if cfg.data.blend:
        for entry, trained in zip(s.data_summary["sources"], s.sampler.trained):
            entry["trained_tokens"] = trained
    if cfg.data.streaming:  # where the stream stands: its epoch and the record the next window starts in
        position = s.sampler.state_dict()
        s.data_summary.update(epoch=position["epoch"], next_record=position["record"])
    return s.data_summary


def _metrics_record(result: StepResult, tokens_per_s: float, mfu: float | str, val_loss: float | None,
                    guard_record: dict) -> dict:
    """One line of metrics.jsonl (README names its keys): `mfu` is "unknown" without a peak FLOP/s; `val_loss` only
    on evaluation steps, `skipped` only on skipped steps."""
    record = {
        "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm, "tokens_per_s": tokens_per_s,
        "mfu": mfu, **_peak_memory(result.per_rank["peak_memory_mb"]), **result.losses,
    }
    if result.skipped:
        record["skipped"] = True
    if result.max_logits is not None:  # training.muon_clip: each layer's largest attention logit, before the clip
        record["max_logit"] = {str(layer): v for layer, v in result.max_logits.items()}
    if val_loss is not None:
        record["val_loss"] = val_loss
    if result.moe is not None:
        record["moe"] = {str(layer): stats.record() for layer, stats in result.moe.items()}
    return {**record, **guard_record}


def _wandb(cfg: JobConfig, is_main: bool):
    if not (cfg.metrics.wandb and is_main):
        return None
    import tomllib

    from moeflow.train.run_outputs import WandbSink

    return WandbSink(Path(cfg.run_dir), cfg.metrics.wandb_project, tomllib.loads(to_toml(cfg)))


def _summary(cfg: JobConfig, s: Setup, start: int, loop: LoopState, resumed_from, elapsed: float) -> RunSummary:
    ran = loop.stop > start
    last_ckpt = loop.checkpoint or resumed_from
    run_dir = Path(cfg.run_dir)
    return RunSummary(
        model=model_label(cfg.model), params=cfg.model.num_params(), active_params=cfg.model.num_active_params(),
        layout=s.layout, steps=loop.stop, start_step=start, first_loss=loop.first_loss, final_loss=loop.last_loss,
        val_loss=loop.val_loss,
        tokens_per_s=(loop.stop - start) * cfg.training.global_batch * cfg.data.seq_len / elapsed if ran else 0.0,
        elapsed_s=elapsed, checkpoint=str(last_ckpt) if last_ckpt else None,
        metrics=str(run_dir / "metrics.jsonl"), tensorboard=str(run_dir / "tb"),
        peak_flops_known=loop.peak_flops_known,
        state_bytes_per_rank=state_bytes(s, loop.grad_bytes) if ran else None,
        hf_bytes_read_rank0=s.hf_bytes_read, data=_data_summary(cfg, s),
        loss_curve=_loss_curve(run_dir) if s.info.is_main else None,
        adapter=_adapter_summary(cfg) if s.info.is_main and cfg.peft.method == "lora" else None,
        hf=str(loop.hf_folder) if loop.hf_folder else None,
    )


def _adapter_summary(cfg: JobConfig) -> dict | None:
    from moeflow.models.peft_format import ADAPTER_DIR, ADAPTER_WEIGHTS

    weights = Path(cfg.run_dir) / ADAPTER_DIR / ADAPTER_WEIGHTS
    if not weights.is_file():  # no checkpoint committed yet
        return None
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return {"path": str(weights.parent), "rank": cfg.peft.rank, "trained_params": params,
            "bytes": weights.stat().st_size}



def _loss_curve(run_dir: Path) -> str | None:
    from moeflow.train.run_outputs import write_loss_curve

    curve = write_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss.png")
    return str(curve) if curve else None


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop metrics lines logged after the checkpoint (they will be logged again)."""
    if path.is_file():
        lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= last_step]
        path.write_text("".join(ln + "\n" for ln in lines))
