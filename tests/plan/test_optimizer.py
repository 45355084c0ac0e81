"""moeflow.plan.optimizer against what runs: the Muon matrices it counts are the model's, its Newton-Schulz FLOPs
are torch's FLOP counter's, and the bytes it predicts per step are the mean of the bytes the trainer's Muon step
sends on 2 gloo ranks (counted from the collectives' own tensors: tests/support/collective_bytes.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from moeflow.config import load_config
from moeflow.core.hardware import get_gpu
from moeflow.core.presets import get_preset
from moeflow.models.transformer import Transformer
from moeflow.plan.layout import Job, Layout
from moeflow.plan.memory import memory_per_gpu
from moeflow.plan.optimizer import layer_matrices, muon_rank_cost, ns_flops
from moeflow.plan.time import rates, step_time
from moeflow.train.muon import muon_parameters, newton_schulz
from tests.support.dist_harness import check_results, launch


def _model_config(name: str):
    if name.endswith(".toml"):
        return load_config(name).model
    return get_preset(name).validate()


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense", "configs/deepseek-v3-tiny.toml"])
def test_the_matrices_are_the_models(name):
    cfg = _model_config(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    built = Counter((p.shape[0] if p.ndim == 3 else 1, *p.shape[-2:]) for p in muon_parameters(model)[0])
    counted = Counter((m, r, c) for layer in range(cfg.n_layers + cfg.mtp_depth)
                      for m, r, c, _ in layer_matrices(cfg, layer))
    assert counted == built


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8)])
def test_newton_schulz_flops_are_torchs_count(shape):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        newton_schulz(torch.randn(shape), steps=3, dtype=torch.float32)
    assert counter.get_total_flops() == ns_flops(*shape, steps=3)


LAYOUTS = {"dp_shard=2": {"parallel.zero": 3}, "ep=2": {"parallel.ep": 2}, "tp=2": {"parallel.tp": 2},
           "ep=2 zero=1": {"parallel.ep": 2, "parallel.zero": 1},
           "dp_replicate=2": {"parallel.dp_replicate": 2}}  # replicas only: the results summed, nothing cut


def _config(overrides: dict):
    return load_config(None, {"training.optimizer": "muon", "data.seq_len": 16, "training.global_batch": 4,
                              "model.dim": 64, "model.n_layers": 2, "model.vocab_size": 128, **overrides})


def _measure_case(_, case) -> None:
    from moeflow.train.build import build_model
    from tests.support.collective_bytes import CollectiveBytes

    name, overrides = case
    cfg = _config(overrides)
    world = torch.distributed.get_world_size()
    dims, batch = cfg.layout(world)
    torch.manual_seed(0)
    par, opt, _ = build_model(cfg, torch.device("cpu"), dims, batch)
    ids = torch.randint(0, cfg.model.vocab_size, (4 // world, 17), generator=torch.Generator().manual_seed(0))
    par.runner.train_step(ids[:, :-1], ids[:, 1:])
    with CollectiveBytes() as measured:
        opt.step()
    # each matrix's owner receives and sends more than the others: the plan costs the mean rank
    sent = torch.tensor(measured.sent, dtype=torch.float64)
    torch.distributed.all_reduce(sent)
    job = Job(cfg.model, get_gpu("H100-80GB"), 1, world, 16, 64, optimizer="muon")
    cost = muon_rank_cost(job, Layout(dims, 1, "none"), list(range(cfg.model.n_layers)))
    assert float(sent) / world == pytest.approx(cost["intra_bytes"], rel=1e-12), (name, measured.ops, cost)


def test_the_bytes_per_step_are_the_trainers():
    cases = [(name, overrides) for name, overrides in LAYOUTS.items()]
    check_results(launch(2, cases, _measure_case), cases)


def test_the_bytes_per_step_under_hsdp_are_the_trainers():
    """2 replicas of a 2-way cut (4 ranks): each replica's all-to-alls for its share of the matrices, the results
    summed over the replicas."""
    cases = [("hsdp 2 x 2", {"parallel.dp_replicate": 2})]
    check_results(launch(4, cases, _measure_case), cases)


def test_muon_in_the_plan_hand_worked():
    """The HAND model of tests/plan/test_plan.py (dim 8, 2 layers, ffn 16: per layer q, k, v, o [8, 8] and w1, w3
    [16, 8], w2 [8, 16] under Muon, 640 parameters): 4 bytes fewer state each, sharded like the rest; on one GPU
    Newton-Schulz alone (5 steps: 4 x (5 (4 64 8 + 2 512)) + 3 x (5 (4 64 16 + 2 512)) FLOPs per layer) at the bf16
    matmul rate; on 4 it is split 4 ways and the gathers cost their bytes."""
    from tests.plan.test_plan import HAND, job_for, lay

    per_layer_flops = 4 * 5 * (4 * 64 * 8 + 2 * 512) + 3 * 5 * (4 * 64 * 16 + 2 * 512)
    for gpus in (1, 4):
        adamw, muon = (job_for(HAND, gpn=gpus, optimizer=o) for o in ("adamw", "muon"))
        layout = lay(dp_shard=gpus, zero=3)
        saved = memory_per_gpu(adamw, layout)["optimizer"] - memory_per_gpu(muon, layout)["optimizer"]
        assert saved * 1e9 == pytest.approx(4 * 2 * 640 / gpus)
        t_adamw, t_muon = step_time(adamw, layout), step_time(muon, layout)
        assert t_adamw["optimizer_s"] == 0
        ns_s = 2 * per_layer_flops / gpus / rates(muon, "bf16").matmul_flops
        # two all-to-alls: 4 + 2 bytes per element over (n - 1) / n^2 of each tensor on the mean rank, 7 tensors
        # per layer, 2 x 3 hops each
        comm = 0 if gpus == 1 else ((4 + 2) * 2 * 640 * 3 / 16 / (muon.intra * 1e9) + 2 * 7 * 6 * 5e-6)
        assert t_muon["optimizer_s"] == pytest.approx(ns_s + comm)
        assert t_muon["step_s"] == pytest.approx(t_adamw["step_s"] + t_muon["optimizer_s"])
