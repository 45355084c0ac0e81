"""ZeRO-Offload. parallel.offload = 'params' (FSDP2's CPUOffloadPolicy) and 'optimizer' (the optimizer's state
and step on the host, moeflow/train/offload.py), with AdamW and with Muon: a run trains exactly what the same
layout trains without it (the same operations, the state in host memory), under dp ZeRO-3, ZeRO-1, ep, tp and pp on
2 gloo ranks; the host optimizers are torch.optim.AdamW and moeflow's Muon step for step, their state loads back,
and a run stopped under them resumes exactly, also under another layout without offload; the dry run reports
what sits on the host; what offload cannot take is one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow.config import load_config
from moeflow.train.dry_run import dry_run
from moeflow.train.muon import Muon
from moeflow.train.offload import HostOffloadAdamW
from tests.parallel.layout_worker import BASE, launch
from tests.support.cli import assert_one_line
from tests.support.model_helpers import steps

LAYOUTS = {"zero3": ["--parallel.zero=3"], "zero1-ep2": ["--parallel.zero=1", "--parallel.ep=2"],
           "tp2": ["--parallel.tp=2"], "pp2": ["--parallel.pp=2"]}


def _stepper(shapes):
    """run(make, steps, state=None, init=None) -> (parameters, optimizer): parameters of `shapes` (from `init`, else
    seeded random values), the optimizer `make(parameters)` given `state`, stepped on the same seeded gradients."""
    torch.manual_seed(0)
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]

    def run(make, steps, state=None, init=start):
        params = [torch.nn.Parameter(t.detach().clone()) for t in init]
        opt = make(params)
        if state is not None:
            opt.load_state_dict(state)
        for step in steps:
            for p, g in zip(params, grads[step]):
                p.grad = g.clone()
            opt.step()
        return params, opt
    return run


def test_the_host_optimizer_is_torch_adamw_step_for_step():
    """Two groups (decayed matrices, undecayed vectors), 4 steps of the same random gradients: the same weights as
    torch.optim.AdamW (multi-tensor) bit for bit; the state sits apart from the weights and a fresh optimizer
    given its state_dict continues as the first does."""
    def groups(params):
        return [{"params": [params[0], params[2]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}]

    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    run = _stepper([(6, 5), (5,), (3, 4)])
    want, _ = run(lambda params: torch.optim.AdamW(groups(params), foreach=True, **kw), range(4))
    got, opt = run(lambda params: HostOffloadAdamW(groups(params), **kw), range(4))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    state = opt.state[got[0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 4
    assert state["exp_avg"].data_ptr() != got[0].data_ptr()
    halfway, first = run(lambda params: HostOffloadAdamW(groups(params), **kw), range(2))
    resumed, _ = run(lambda params: HostOffloadAdamW(groups(params), **kw), range(2, 4), state=first.state_dict(),
                     init=halfway)
    assert all(torch.equal(a, b) for a, b in zip(resumed, want))


@pytest.mark.slow  # 30 s: make test runs it, CI does not (the one-process and dry-run tests check the parts)
def test_offloaded_runs_train_what_the_layout_trains(tmp_path):
    """AdamW and Muon, each layout without offload and under both modes; a stop under 'optimizer' resumed as it
    was and under dp=2 ZeRO-3 without offload."""
    cases = []
    for optimizer in ("adamw", "muon"):
        base = [*BASE, f"--training.optimizer={optimizer}"]
        for name, argv in LAYOUTS.items():
            for offload in ("none", "params", "optimizer"):
                run = tmp_path / f"{optimizer}-{name}-{offload}"
                cases.append((run.name, [*base, *argv, f"--parallel.offload={offload}", f"--run_dir={run}"],
                              str(run), False))
        # stopped at step 2 under offload = 'optimizer' (ep=2, ZeRO-1), resumed as it was and under dp=2 ZeRO-3
        stop = [*base, *LAYOUTS["zero1-ep2"], "--parallel.offload=optimizer"]
        for run, resume_as in ((f"{optimizer}-stop", stop), (f"{optimizer}-stop-resharded",
                                                              [*base, "--parallel.zero=3"])):
            cases.append((run, [*stop, "--training.stop_at=2", f"--run_dir={tmp_path / run}"], str(tmp_path / run),
                          False))
            cases.append((run, [*resume_as, f"--run_dir={tmp_path / run}"], str(tmp_path / run), True))
    results = launch(2, cases)
    assert set(results.values()) == {"ok"}, results
    for optimizer in ("adamw", "muon"):
        for name in LAYOUTS:
            plain = steps(tmp_path / f"{optimizer}-{name}-none")
            for offload in ("params", "optimizer"):
                got = steps(tmp_path / f"{optimizer}-{name}-{offload}")
                assert got == plain and len(plain) == 3, (optimizer, name, offload)
        plain = steps(tmp_path / f"{optimizer}-zero1-ep2-none")
        assert steps(tmp_path / f"{optimizer}-stop") == plain, optimizer
        np.testing.assert_allclose(steps(tmp_path / f"{optimizer}-stop-resharded"), plain, rtol=1e-5)


def test_the_dry_run_puts_the_state_on_the_host():
    overrides = {"parallel.ep": 2}
    plain = dry_run(load_config(None, overrides), 4)["ranks"][0]
    off = dry_run(load_config(None, {**overrides, "parallel.offload": "params"}), 4)["ranks"][0]
    assert plain["offload"] == "none" and off["offload"] == "params"
    assert sum(plain["host_bytes"].values()) == 0 and plain["device_bytes"] == plain["bytes"]
    # the shards, their gradients and the optimizer state move to the host; ZeRO-3 gathers one unit at a time
    assert off["host_bytes"]["optimizer"] == plain["bytes"]["optimizer"] > 0
    assert off["host_bytes"]["grads"] == plain["bytes"]["grads"]
    assert off["device_bytes"]["optimizer"] == off["device_bytes"]["grads"] == 0
    assert 0 < off["device_bytes"]["params"] < plain["bytes"]["params"] * 4
    # 'optimizer': the weights and gradients stay; the moments, an fp32 master copy and a gradient buffer go
    opt = dry_run(load_config(None, {**overrides, "parallel.offload": "optimizer"}), 4)["ranks"][0]
    assert opt["offload"] == "optimizer" and opt["device_bytes"] == {**plain["bytes"], "optimizer": 0}
    assert opt["host_bytes"] == {"params": plain["bytes"]["grads"], "grads": plain["bytes"]["grads"],
                                 "optimizer": plain["bytes"]["optimizer"]}


def test_host_muon_is_muon_step_for_step():
    """Muon with its state on the host (parallel.offload = 'optimizer'): every matrix, 3-D experts tensor and AdamW
    parameter equals Muon's bit for bit over 4 steps of the same random gradients; the momentum and AdamW's moments
    sit in host buffers of their own; a fresh host optimizer given its state_dict continues as the first does.
    (Muon itself is held to torch.optim.Muon and torch.optim.AdamW in tests/train/test_muon.py.)"""
    def muon(on_host):
        return lambda params: Muon(params[:2], params[2:], lr=1e-2, adamw_lr=3e-3, weight_decay=0.1,
                                   betas=(0.9, 0.95), on_host=on_host)

    run = _stepper([(6, 5), (3, 4, 5), (5,), (7, 6)])
    want, _ = run(muon(False), range(4))
    got, opt = run(muon(True), range(4))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert set(opt.state[got[0]]) == {"momentum_buffer"} and set(opt.state[got[3]]) == {"step", "exp_avg",
                                                                                          "exp_avg_sq"}
    assert opt.state[got[0]]["momentum_buffer"].data_ptr() != got[0].data_ptr()
    halfway, first = run(muon(True), range(2))
    resumed, _ = run(muon(True), range(2, 4), state=first.state_dict(), init=halfway)
    assert all(torch.equal(a, b) for a, b in zip(resumed, want))


def test_the_dry_run_puts_muons_state_on_the_host():
    """Muon under 'optimizer': its momentum and every gradient buffer on the host, fp32 master copies only for
    AdamW's parameters (Muon updates the device's weights); under 'params' all of the state, as for AdamW."""
    overrides = {"parallel.ep": 2, "training.optimizer": "muon"}
    plain = dry_run(load_config(None, overrides), 4)["ranks"][0]
    opt = dry_run(load_config(None, {**overrides, "parallel.offload": "optimizer"}), 4)["ranks"][0]
    adamw = dry_run(load_config(None, {"parallel.ep": 2, "parallel.offload": "optimizer"}), 4)["ranks"][0]
    assert opt["offload"] == "optimizer" and opt["device_bytes"] == {**plain["bytes"], "optimizer": 0}
    assert opt["host_bytes"]["optimizer"] == plain["bytes"]["optimizer"] > 0
    assert opt["host_bytes"]["grads"] == adamw["host_bytes"]["grads"] == plain["bytes"]["grads"]
    assert 0 < opt["host_bytes"]["params"] < adamw["host_bytes"]["params"] / 4  # the embedding, head, norms, routers
    off = dry_run(load_config(None, {**overrides, "parallel.offload": "params"}), 4)["ranks"][0]
    assert off["host_bytes"]["optimizer"] == plain["bytes"]["optimizer"] and off["device_bytes"]["optimizer"] == 0


@pytest.mark.parametrize("changes, message", [
    ({"parallel.offload": "nvme"}, r"parallel.offload"),
])
def test_what_offload_cannot_take_is_one_line(changes, message):
    assert_one_line(lambda: load_config(None, changes).layout(2), message)
