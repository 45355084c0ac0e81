"""On NCCL, moeflow turns on the flight recorder so that a collective timeout dumps every rank's recent collectives
into the run directory (beside hang-rank<N>.txt); what the user set is kept. No GPU here: the NCCL process group
is simulated (the device choice and init_process_group are monkeypatched), which is what decides it."""

from __future__ import annotations

import os

import pytest
import torch

from moeflow.train import distributed

NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
         "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@pytest.fixture
def simulated_nccl(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)  # and restored after the test, whatever the code under test sets
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen = {}

    def init_process_group(backend, **kwargs):
        seen["backend"] = backend
        seen["env"] = {name: os.environ.get(name) for name in NAMES}

    monkeypatch.setattr(distributed, "choose_device", lambda pref, local_ranks: "cuda")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", init_process_group)
    return seen


def test_nccl_runs_dump_their_collectives_into_the_run_dir(simulated_nccl, tmp_path):
    distributed.init_distributed("cuda", 60, run_dir=str(tmp_path / "run"))
    env = simulated_nccl["env"]
    assert simulated_nccl["backend"] == "nccl"
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "nccl-trace-rank")


def test_what_the_user_set_is_kept(simulated_nccl, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the older name counts too
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/elsewhere/fr")
    distributed.init_distributed("cuda", 60, run_dir=str(tmp_path))
    env = simulated_nccl["env"]
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and env["TORCH_FR_BUFFER_SIZE"] is None
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and env["TORCH_FR_DUMP_TEMP_FILE"] == "/elsewhere/fr"


def test_gloo_runs_are_left_alone(monkeypatch, tmp_path):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kw: None)
    distributed.init_distributed("cpu", 60, run_dir=str(tmp_path))
    assert not any(name in os.environ for name in NAMES)
