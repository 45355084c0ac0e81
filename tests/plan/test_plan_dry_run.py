"""Every layout the planner recommends runs, and holds what the planner says it holds.

For four models on two clusters each (`slow` but for Mixtral's: CI runs those), the planner's top layouts go
through the trainer's own checks (JobConfig.layout: the rules a real run is refused by) and its dry run
(moeflow.train.dry_run: the model built on the meta device and parallelized as a given rank of the N-rank job
would, under a fake process group). The per-rank parameter, gradient and optimizer-state element counts the dry run
measures on the built tensors must be within 5% of the planner's formulas (moeflow.plan.memory: per-layer counts
from the model config, split by ZeRO stage, tp, ep and data-parallel size, never a model). The two share only the
pipeline split, the trainer's (moeflow.core.schedules.pipeline_layout), which is what places layers on ranks.

Units: the planner's memory is bytes of bf16 weights (2), bf16 gradients (2) and fp32 AdamW state (12: master
weights and two moments) per parameter (ZeRO, Rajbhandari et al. 2020); the dry run's are fp32 weights and
gradients (4 each) and AdamW's two moments (8). Both are turned into element counts here. "Parameters" is what
a rank holds at its peak, during the step, on both sides: under ZeRO-1/2 (and ZeRO-3 under a zero-bubble
pipeline schedule) the gathered weights of every layer it runs, under ZeRO-3 its shard.

Each layout gets the checks plus one rank built through the trainer: the planner's fullest pipeline rank (the
one its memory figures describe). The best layout of each cluster is dry-run on every pipeline rank, each
compared with the planner's count for that rank. Building a rank costs 0.1-0.5 s (mesh, FSDP and pipeline
schedule setup inside torch); dry-running all ranks of every layout would take about a minute, mostly the ten
16-stage DeepSeek-V3 layouts.
"""

from __future__ import annotations

import pytest

from moeflow.config import load_config
from moeflow.core.hardware import get_gpu
from moeflow.core.parallel_dims import SIZE_KEYS, ParallelDims
from moeflow.core.presets import get_preset
from moeflow.plan.cli import plan
from moeflow.plan.layout import Job, Layout
from moeflow.plan.memory import GB, model_state_per_rank
from moeflow.plan.search import Constraints, memory_layout
from moeflow.train.dry_run import BYTES, dry_run, rank_state

SEQ, GPUS_PER_NODE, TOP, REL = 4096, 8, 5, 0.05
PLANNER_BYTES = {"params": 2, "grads": 2, "optimizer": 12}  # bf16 weights and grads, fp32 AdamW state (16 / param)
# (model, GPU, nodes, global batch in tokens, sizes pinned in the plan)
CLUSTERS = [
    # DeepSeek-V3 was trained on 2048 H800s (report sec. 3.1), with batches of up to 15360 sequences of 4K tokens
    ("deepseek-v3", "H800", 256, 16 << 20, {}),
    ("deepseek-v3", "H100-80GB", 128, 16 << 20, {}),
    ("qwen3-moe-30b-a3b", "H100-80GB", 8, 4 << 20, {}),
    ("qwen3-moe-30b-a3b", "H100-80GB", 32, 4 << 20, {}),
    ("mixtral-8x7b", "A100-80GB", 4, 4 << 20, {}),
    ("mixtral-8x7b", "H100-80GB", 16, 4 << 20, {}),
    ("llama3-70b", "H100-80GB", 8, 4 << 20, {}),
    ("llama3-70b", "H100-80GB", 64, 4 << 20, {}),
    # The search lists ZeRO-3 under a zero-bubble schedule only when --zero 3 is pinned: the trainer then keeps the
    # parameters gathered for the whole step (ZeRO-2's memory), which the dry run must count too.
    ("mixtral-8x7b", "A100-80GB", 4, 4 << 20, {"zero": 3, "pp": 4}),
]


def _id(case) -> str:
    name, gpu, nodes, _, pinned = case
    return f"{name}-{gpu}-{nodes}x{GPUS_PER_NODE}" + "".join(f"-{k}{v}" for k, v in pinned.items())


def _layout(row: dict) -> Layout:
    sizes = {key: row[key] for key in (*SIZE_KEYS, "zero", "pp_schedule")}
    world = row["dp_replicate"] * row["dp_shard"] * row["tp"] * row["pp"] * row["cp"]
    return Layout(ParallelDims(world, **sizes), row["micro_batch"], row["activation_checkpointing"],
                  row["virtual_stages"])


def _config(job: Job, row: dict):
    """The trainer's settings for one planned layout (what `moeflow train --dry-run` would be given)."""
    # The trainer always runs a schedule's default stages per rank; a planned layout with other virtual stages
    # could not be written as settings at all.
    assert row["virtual_stages"] == 0, row
    overrides = {"model.name": job.model.name, "data.seq_len": job.seq_len,
                 "training.global_batch": job.global_batch_tokens // job.seq_len,
                 "training.micro_batch": row["micro_batch"],
                 "training.activation_checkpointing": row["activation_checkpointing"],
                 **{f"parallel.{k}": row[k] for k in (*SIZE_KEYS, "zero", "pp_schedule")}}
    return load_config(None, overrides)


def _planned(state_bytes: dict, unit: float = 1.0) -> dict[str, float]:
    """Elements from the planner's bytes (or GB, unit=GB)."""
    return {k: state_bytes[k] * unit / PLANNER_BYTES[k] for k in PLANNER_BYTES}


def _measured(rank: dict) -> dict[str, float]:
    """Elements a dry-run rank holds: parameters at the peak, gradient shards, parameters with AdamW state."""
    return {"params": rank["params"], "grads": rank["bytes"]["grads"] / BYTES["grads"],
            "optimizer": rank["optimizer_params"]}


def _assert_close(got: dict, want: dict, what) -> None:
    for part in want:
        assert got[part] == pytest.approx(want[part], rel=REL), (what, part, got, want)


# `slow` (make test runs them, CI does not): every cluster but Mixtral's smaller two; CI also dry-runs DeepSeek-V3
# at 2,048 ranks and Qwen3 at 1,024 below.
SLOW_CLUSTERS = {("deepseek-v3", 256), ("deepseek-v3", 128), ("qwen3-moe-30b-a3b", 8), ("qwen3-moe-30b-a3b", 32),
                 ("mixtral-8x7b", 16), ("llama3-70b", 8), ("llama3-70b", 64)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if (c[0], c[2]) in SLOW_CLUSTERS else [])
                                  for c in CLUSTERS], ids=[_id(c) for c in CLUSTERS])
def test_every_recommended_layout_dry_runs_as_planned(case):
    name, gpu, nodes, tokens, pinned = case
    job = Job(get_preset(name), get_gpu(gpu), nodes, GPUS_PER_NODE, SEQ, tokens)
    rows = plan(job, Constraints(**pinned), top=TOP, infeasible=0)["layouts"]
    assert len(rows) == TOP and all(r["feasible"] for r in rows)
    for i, row in enumerate(rows):
        lay, cfg = _layout(row), _config(job, row)
        what = (_id(case), i + 1, lay.short(), lay.schedule_label)
        dims, batch = cfg.layout(job.world)  # raises what a real run would be refused with
        assert dims.sizes == {k: row[k] for k in SIZE_KEYS}, what
        assert (batch.micro_batch, batch.microbatches) == (lay.micro_batch, lay.num_micro_batches(job)), what
        fullest = row["memory_gb"]["stage"]  # the pipeline rank the planner's memory figures are for
        if i == 0:
            ranks = dry_run(cfg, job.world)["ranks"]
            per_rank = model_state_per_rank(job, memory_layout(lay))
            assert len(ranks) == len(per_rank) == lay.pp, what
            for pp_rank, (got, want) in enumerate(zip(ranks, per_rank)):
                _assert_close(_measured(got), _planned(want), (*what, "pp rank", pp_rank))
            got = ranks[fullest]
        else:
            got = rank_state(cfg, job.world, fullest * (job.world // lay.pp))
        _assert_close(_measured(got), _planned(row["memory_gb"], GB), (*what, "fullest pp rank", fullest))


def _conserves_parameters(out: dict, cfg) -> None:
    """Independent of the planner: the optimizer shards of all ranks together cover every parameter once per
    data-parallel replica (each pipeline stage's ranks hold alike, up to FSDP's padding of uneven shards and the
    norms and routers every tp rank keeps whole: well under 1% of these models)."""
    world, pp = out["world_size"], cfg.parallel.pp
    covered = sum(r["optimizer_params"] for r in out["ranks"]) * (world // pp)
    assert covered == pytest.approx(out["total_params"] * cfg.parallel.dp_replicate, rel=0.01)


def test_deepseek_v3_zero1_at_2048_ranks():
    """`moeflow train --dry-run --world-size 2048 --model.name=deepseek-v3 --parallel.pp=16 --parallel.ep=64
    --parallel.zero=1`: runs, and every pipeline rank holds what the planner says."""
    world = 2048
    cfg = load_config(None, {"model.name": "deepseek-v3", "parallel.pp": 16, "parallel.ep": 64, "parallel.zero": 1,
                             "data.seq_len": SEQ, "training.global_batch": 4096})
    out = dry_run(cfg, world)
    assert out["ranks"][0]["dims"] == {"dp_replicate": 1, "dp_shard": 128, "tp": 1, "pp": 16, "ep": 64, "cp": 1}
    _conserves_parameters(out, cfg)
    job = Job(cfg.model, get_gpu("H800"), world // GPUS_PER_NODE, GPUS_PER_NODE, SEQ, 4096 * SEQ)
    dims = ParallelDims(world, dp_shard=128, pp=16, ep=64, zero=1)
    lay = Layout(dims, micro_batch=1, activation_checkpointing="none")
    for pp_rank, (got, want) in enumerate(zip(out["ranks"], model_state_per_rank(job, lay), strict=True)):
        _assert_close(_measured(got), _planned(want), ("pp rank", pp_rank))


def test_qwen3_tp4_pp4_ep8_at_1024_ranks_near_ideal():
    """qwen3-moe-30b-a3b at tp=4 x pp=4 x ep=8 (ZeRO-3) on 1024 ranks: no rank holds more than 1.1x the ideal
    total / N of parameters, gradients or optimizer state."""
    world = 1024
    cfg = load_config(None, {"model.name": "qwen3-moe-30b-a3b", "parallel.tp": 4, "parallel.pp": 4,
                             "parallel.ep": 8, "data.seq_len": SEQ, "training.global_batch": 1024})
    out = dry_run(cfg, world)
    assert out["ranks"][0]["dims"] == {"dp_replicate": 1, "dp_shard": 64, "tp": 4, "pp": 4, "ep": 8, "cp": 1}
    _conserves_parameters(out, cfg)
    ideal = cfg.model.num_params() / world
    for rank in out["ranks"]:
        for part, held in _measured(rank).items():
            assert held <= 1.1 * ideal, (rank["rank"], part, held / ideal)
