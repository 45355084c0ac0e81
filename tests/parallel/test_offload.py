"""parallel.offload = 'params' (ZeRO-Offload through FSDP2's CPUOffloadPolicy): a run trains exactly what the same
layout trains without it (the same operations, the shards in host memory), under dp ZeRO-3, ZeRO-1, ep and tp on
2 gloo ranks; the dry run reports the state on the host as FSDP2 placed it; what it cannot take is one line."""

from __future__ import annotations

import json

import pytest

from moeflow.config import load_config
from moeflow.train.dry_run import dry_run
from tests.parallel.layout_worker import BASE, launch
from tests.support.cli import assert_one_line

LAYOUTS = {"zero3": ["--parallel.zero=3"], "zero1-ep2": ["--parallel.zero=1", "--parallel.ep=2"],
           "tp2": ["--parallel.tp=2"]}


def _steps(run_dir) -> list[tuple[float, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


@pytest.mark.slow  # 13 s: make test runs it, CI does not (the dry-run test checks the placement)
def test_offloaded_runs_train_what_the_layout_trains(tmp_path):
    cases = []
    for name, argv in LAYOUTS.items():
        for offload in ("none", "params"):
            run = tmp_path / f"{name}-{offload}"
            cases.append((run.name, [*BASE, *argv, f"--parallel.offload={offload}", f"--run_dir={run}"], str(run),
                          False))
    results = launch(2, cases)
    assert set(results.values()) == {"ok"}, results
    for name in LAYOUTS:
        plain, offloaded = _steps(tmp_path / f"{name}-none"), _steps(tmp_path / f"{name}-params")
        assert offloaded == plain and len(plain) == 3, name


def test_the_dry_run_puts_the_state_on_the_host():
    overrides = {"parallel.ep": 2}
    plain = dry_run(load_config(None, overrides), 4)["ranks"][0]
    off = dry_run(load_config(None, {**overrides, "parallel.offload": "params"}), 4)["ranks"][0]
    assert not plain["offload"] and off["offload"]
    assert sum(plain["host_bytes"].values()) == 0 and plain["device_bytes"] == plain["bytes"]
    # the shards, their gradients and the optimizer state move to the host; ZeRO-3 gathers one unit at a time
    assert off["host_bytes"]["optimizer"] == plain["bytes"]["optimizer"] > 0
    assert off["host_bytes"]["grads"] == plain["bytes"]["grads"]
    assert off["device_bytes"]["optimizer"] == off["device_bytes"]["grads"] == 0
    assert 0 < off["device_bytes"]["params"] < plain["bytes"]["params"] * 4


@pytest.mark.parametrize("changes, message", [
    ({"parallel.offload": "optimizer"}, r"parallel.offload = 'optimizer' \(the optimizer state alone on the host\)"),
    ({"parallel.offload": "nvme"}, r"parallel.offload"),
    ({"parallel.offload": "params", "training.optimizer": "muon"},
     r"parallel.offload = 'params' with training.optimizer = 'muon'"),
])
def test_what_offload_cannot_take_is_one_line(changes, message):
    assert_one_line(lambda: load_config(None, changes).layout(2), message)
