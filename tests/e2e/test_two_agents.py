"""The multi-node launch the README shows, on one machine: two torchrun agents ("nodes") of one process each,
meeting through c10d rendezvous, train the one-process losses under ep=2; then, with --max-restarts 1, a worker
SIGKILLed at step 5 is restarted by the agents, the job resumes from its step-4 checkpoint and ends with the
same losses (nothing lost). Slow: `make test` runs it, CI does not."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.cli import REPO

pytestmark = pytest.mark.slow

TINY = ["--model.name=tiny-moe", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=2", "--model.n_kv_heads=1",
        "--model.ffn_dim=64", "--model.moe.ffn_dim=32", "--model.moe.num_experts=4", "--data.seq_len=16",
        "--data.max_bytes=100000", "--training.global_batch=4", "--training.warmup_steps=2", "--training.steps=8",
        "--metrics.log_every=1", "--metrics.tensorboard=false", "--eval.every=0", "--checkpoint.every=2",
        "--no-progress"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir) -> np.ndarray:
    return np.array([json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()])


def _two_agents(run_dir, *more, faults=None) -> list[subprocess.CompletedProcess]:
    # As the README says: without it a restarted rank can read a dead rank's address (pytorch/pytorch#135712).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if faults:
        env["MOEFLOW_TEST_FAULTS"] = json.dumps(faults)
    port = _port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two-agents-{port}",
           # the agents' per-attempt folders beside the run (torchrun's default puts them in the temp dir, to stay)
           "--log-dir", str(Path(run_dir).parent / "agent-logs"),
           *more, "-m", "moeflow", "train", *TINY, "--parallel.ep=2", f"--run-dir={run_dir}"]
    agents = [subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for _ in range(2)]
    return [subprocess.CompletedProcess(cmd, a.wait(timeout=300), *a.communicate()) for a in agents]


def test_two_agents_train_the_one_process_losses_and_survive_a_killed_worker(tmp_path):
    one = subprocess.run([sys.executable, "-m", "moeflow", "train", *TINY, f"--run-dir={tmp_path / 'one'}"],
                         cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    want = _losses(tmp_path / "one")

    for agent in _two_agents(tmp_path / "two"):
        assert agent.returncode == 0, agent.stderr[-3000:]
    np.testing.assert_allclose(_losses(tmp_path / "two"), want, rtol=1e-5)

    faults = [{"do": "kill", "rank": 1, "step": 5, "attempt": 0}]
    agents = _two_agents(tmp_path / "restarted", "--max-restarts", "1", faults=faults)
    for agent in agents:
        assert agent.returncode == 0, agent.stderr[-3000:]
    assert any("test fault: rank 1 kill at step 5" in a.stderr for a in agents)
    np.testing.assert_allclose(_losses(tmp_path / "restarted"), want, rtol=1e-5)
