"""The planner's ZeRO-Offload (parallel.offload = 'params' and 'optimizer'): where the bytes go and what the copies
cost, by hand; offered only when nothing fits on the devices; its host memory checked; the 70B fine-tune it exists
for."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moeflow.core.presets import get_preset
from moeflow.plan.cli import main as plan_main
from moeflow.plan.cli import plan
from moeflow.plan.memory import memory_per_gpu
from moeflow.plan.search import search
from moeflow.plan.time import step_time
from tests.plan.test_plan import HAND, HAND_PARAMS, job_for, lay


def test_offload_moves_the_shards_to_the_host_hand_worked():
    """HAND (2920 parameters) on 4 GPUs under ZeRO-3: 16 bytes per parameter (bf16 weights and gradients, fp32
    AdamW state) / 4 leave the device; per micro-batch the fp32 weight shard crosses PCIe twice (forward and
    backward gathers) and the fp32 gradient shard once; the host's step reads and writes 28 bytes per parameter."""
    job = job_for(HAND, gpn=4)
    plain, off = lay(dp_shard=4, zero=3), replace(lay(dp_shard=4, zero=3), offload="params")
    m_plain, m_off = memory_per_gpu(job, plain), memory_per_gpu(job, off)
    assert m_off["host"] * 1e9 == pytest.approx(16 * HAND_PARAMS / 4)
    assert m_off["params"] == m_off["grads"] == m_off["optimizer"] == m_plain["host"] == 0
    assert m_plain["total"] - m_off["total"] == pytest.approx(16 * HAND_PARAMS / 4 / 1e9)
    assert m_off["zero3_gather"] == m_plain["zero3_gather"]  # the layers being gathered stay on the device
    t_plain, t_off = step_time(job, plain), step_time(job, off)
    micro = plain.num_micro_batches(job)
    shard = HAND_PARAMS / 4
    want = 3 * micro * 4 * shard / (job.gpu.pcie_gbps * 1e9) + 28 * shard / (job.gpu.host_step_gbps * 1e9)
    assert t_off["offload_s"] == pytest.approx(want) and t_plain["offload_s"] == 0
    assert t_off["step_s"] == pytest.approx(t_plain["step_s"] + want)


def test_optimizer_offload_moves_the_optimizer_state_hand_worked():
    """HAND on 4 GPUs under ZeRO-1: the trainer's fp32 weights (unsharded) and fp32 gradient shard stay on the
    device, its fp32 master copy, moments and gradient buffer (16 bytes per parameter / 4) go to the host; once per
    step the gradient shard crosses to the host and the weights back, and the host's step reads and writes 28
    bytes per parameter."""
    job = job_for(HAND, gpn=4)
    plain, off = lay(dp_shard=4, zero=1), replace(lay(dp_shard=4, zero=1), offload="optimizer")
    m_plain, m_off = memory_per_gpu(job, plain), memory_per_gpu(job, off)
    shard = HAND_PARAMS / 4
    assert m_off["host"] * 1e9 == pytest.approx(16 * shard)
    assert m_off["optimizer"] == 0
    assert m_off["params"] * 1e9 == pytest.approx(4 * HAND_PARAMS) and m_off["grads"] * 1e9 == pytest.approx(4 * shard)
    # 4 + 4 bytes on the device against 2 + 2 + 12
    assert m_plain["total"] - m_off["total"] == pytest.approx((10 * shard - 2 * HAND_PARAMS) / 1e9)
    t_plain, t_off = step_time(job, plain), step_time(job, off)
    want = 8 * shard / (job.gpu.pcie_gbps * 1e9) + 28 * shard / (job.gpu.host_step_gbps * 1e9)
    assert t_off["offload_s"] == pytest.approx(want) and t_off["step_s"] == pytest.approx(t_plain["step_s"] + want)


def test_muon_offload_hand_worked():
    """HAND under Muon (1280 of its 2920 parameters are Muon's, tests/plan/test_optimizer.py) on 4 GPUs. 'optimizer'
    (ZeRO-1): the host keeps AdamW's 16 bytes per parameter and Muon's momentum and gradient buffer (8 bytes), the
    shards' gradients go down and the weights or Muon's updates up once per step, and the host's step moves 28
    bytes per AdamW parameter and 24 per Muon one (two passes over gradient and momentum). 'params' (ZeRO-3): all
    of the state (Muon's 4 bytes lighter), per micro-batch the weight and gradient copies, and once per step
    Muon's update up and its bf16 result down (6 bytes), its host step 26 bytes more for the weight's decay and
    update (8 + 6 for the result's fp32 copy + 12). Nothing fits on the devices: offload is
    offered under Muon as well."""
    shard, muon = HAND_PARAMS / 4, 1280 / 4
    pcie = lambda job: job.gpu.pcie_gbps * 1e9
    host_rate = lambda job: job.gpu.host_step_gbps * 1e9
    job = job_for(HAND, gpn=4, optimizer="muon")
    off = replace(lay(dp_shard=4, zero=1), offload="optimizer")
    assert memory_per_gpu(job, off)["host"] * 1e9 == pytest.approx(16 * (shard - muon) + 8 * muon)
    want = 8 * shard / pcie(job) + (28 * (shard - muon) + 24 * muon) / host_rate(job)
    assert step_time(job, off)["offload_s"] == pytest.approx(want)
    off = replace(lay(dp_shard=4, zero=3), offload="params")
    assert memory_per_gpu(job, off)["host"] * 1e9 == pytest.approx(16 * shard - 4 * muon)
    micro = off.num_micro_batches(job)
    want = (3 * micro * 4 * shard + 6 * muon) / pcie(job) + (28 * (shard - muon) + 50 * muon) / host_rate(job)
    assert step_time(job, off)["offload_s"] == pytest.approx(want)
    out = plan(job_for(get_preset("llama3-70b"), "A100-40GB", nodes=2, seq=4096, batch=64 * 4096, optimizer="muon"))
    assert out["layouts"][0]["offload"] == "params" and out["layouts"][0]["memory_gb"]["total"] <= 40


def test_offload_only_when_nothing_else_fits():
    assert all(r.layout.offload == "none" for r in search(job_for(HAND, gpn=4)))
    # llama3-70b on 2 x 8 A100-40GB: 16 bytes x 70.6B / 16 GPUs = 70.6 GB of state per GPU, more than 40 GB; the
    # fp32 weights and gradients alone (8 bytes per parameter, 35 GB) leave no room for activations, so only
    # 'params' (all of the state on the host) fits
    out = plan(job_for(get_preset("llama3-70b"), "A100-40GB", nodes=2, seq=4096, batch=64 * 4096))
    best = out["layouts"][0]
    assert best["offload"] == "params" and best["memory_gb"]["total"] <= 40
    # (plus, under tp, the norms every tp rank holds whole: 1e-5 of the model)
    assert best["memory_gb"]["host"] == pytest.approx(16 * get_preset("llama3-70b").num_params() / 16 / 1e9,
                                                      rel=1e-4)
    assert "parallel.offload = 'params'" in out["recommendation"]["text"]
    # on 4 x 8 both fit, and 'optimizer', which copies once per step rather than per micro-batch, is faster
    results = search(job_for(get_preset("llama3-70b"), "A100-40GB", nodes=4, seq=4096, batch=64 * 4096))
    best = {mode: next(r for r in results if r.feasible and r.layout.offload == mode)
            for mode in ("optimizer", "params")}
    assert results[0] is best["optimizer"]
    assert best["optimizer"].time["tokens_per_s_per_gpu"] > best["params"].time["tokens_per_s_per_gpu"]


def test_host_memory_is_a_limit(capsys):
    # on one node the same state is 141 GB per GPU, past the 128 GB a DGX A100 320GB host has per GPU
    assert plan_main(["--model", "llama3-70b", "--gpu", "A100-40GB", "--global-batch-tokens", str(64 * 4096)]) == 2
    err = capsys.readouterr().err
    assert "with ZeRO-Offload the leanest needs 141.1 GB of host memory per GPU" in err and "\n" not in err.strip()
