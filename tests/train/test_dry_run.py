"""`moeflow train --dry-run`: the real parallel plan applied to a meta model under a fake process group.

The per-rank counts it reports are checked against two independent sources: the ideal total / N, and
the planner's ZeRO memory formulas (moeflow.plan.memory), which never build a model.
"""

import pytest

from moeflow.config import load_config
from moeflow.core.hardware import get_gpu
from moeflow.core.parallel_dims import ParallelDims
from moeflow.plan.layout import Job, Layout
from moeflow.plan.memory import model_state_bytes, stage_params
from moeflow.train.dry_run import rank_state
from tests.support.cli import run_cli

WORLD = 64
# (overrides, planner layout fields): pure data parallelism at every ZeRO stage, HSDP, expert
# parallelism of several sizes, and context parallelism (ep borrowing cp ranks too).
LAYOUTS = [
    ({"parallel.zero": 3}, dict(dp_replicate=1, dp_shard=64, tp=1, pp=1, ep=1, zero=3)),
    ({"parallel.zero": 2}, dict(dp_replicate=1, dp_shard=64, tp=1, pp=1, ep=1, zero=2)),
    ({"parallel.zero": 1}, dict(dp_replicate=1, dp_shard=64, tp=1, pp=1, ep=1, zero=1)),
    ({"parallel.dp_replicate": 2}, dict(dp_replicate=2, dp_shard=32, tp=1, pp=1, ep=1, zero=3)),
    ({"parallel.ep": 8}, dict(dp_replicate=1, dp_shard=64, tp=1, pp=1, ep=8, zero=3)),
    ({"parallel.ep": 64}, dict(dp_replicate=1, dp_shard=64, tp=1, pp=1, ep=64, zero=3)),
    ({"parallel.cp": 4}, dict(dp_replicate=1, dp_shard=16, tp=1, pp=1, ep=1, zero=3, cp=4)),
    ({"parallel.cp": 2, "parallel.ep": 64}, dict(dp_replicate=1, dp_shard=32, tp=1, pp=1, ep=64, zero=3, cp=2)),
]


def _cfg(**overrides):
    base = {"model.name": "olmoe-1b-7b", "data.seq_len": 128, "training.global_batch": WORLD}
    return load_config(None, {**base, **overrides})


@pytest.mark.parametrize("overrides,layout", LAYOUTS, ids=[str(o) for o, _ in LAYOUTS])
def test_dry_run_counts_match_the_planner(overrides, layout):
    cfg = _cfg(**overrides)
    got = rank_state(cfg, WORLD, rank=0)
    job = Job(cfg.model, get_gpu("H100-80GB"), nodes=8, gpus_per_node=8, seq_len=128, global_batch_tokens=128 * WORLD)
    lay = Layout(ParallelDims(WORLD, **layout), micro_batch=1, activation_checkpointing="none")
    dense, expert = stage_params(job, range(cfg.model.n_layers), first=True, last=True)
    predicted = model_state_bytes(dense, expert, lay)  # bf16 weights (2 bytes), fp32 AdamW state (12 bytes)
    assert got["params"] == pytest.approx(predicted["params"] / 2, rel=0.01)
    assert got["bytes"]["grads"] / 4 == pytest.approx(predicted["grads"] / 2, rel=0.01)
    assert got["optimizer_params"] == pytest.approx(predicted["optimizer"] / 12, rel=0.01)
    if layout["zero"] == 3 and layout["dp_replicate"] == 1:  # fully sharded: 1/N of everything
        assert got["params"] == pytest.approx(cfg.model.num_params() / WORLD, rel=0.01)


@pytest.mark.slow  # 10 s: make test runs it; CI dry-runs the planner's Mixtral layouts (test_plan_dry_run.py)
def test_dry_run_cli_at_1024_ranks():
    out = run_cli(["train", "--dry-run", "--world-size", "1024", "--model.name=deepseek-v3", "--parallel.ep=64",
                   "--data.seq_len=128", "--training.global_batch=1024", "--json"])
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    result = json.loads(out.stdout)
    rank0 = result["ranks"][0]
    assert rank0["dims"] == {"dp_replicate": 1, "dp_shard": 1024, "tp": 1, "pp": 1, "ep": 64, "cp": 1}
    assert rank0["params"] == pytest.approx(result["total_params"] / 1024, rel=0.01)
    assert rank0["bytes"]["optimizer"] == 2 * rank0["bytes"]["params"]


def test_dry_run_rejects_a_bad_layout_before_building():
    out = run_cli(["train", "--dry-run", "--world-size", "1024", "--parallel.ep=3"])
    assert out.returncode == 2
    assert "parallel.ep (3) must divide" in out.stderr and "Traceback" not in out.stderr
    out = run_cli(["train", "--world-size", "8"])
    assert out.returncode == 2 and "--world-size is only for --dry-run" in out.stderr
