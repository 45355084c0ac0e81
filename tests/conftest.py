import os
import sys
from pathlib import Path

import pytest

# One BLAS thread per process: multi-process tests start several ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tiny_args():
    """Overrides that make a training run take seconds: a small model and a small corpus."""
    return [
        "--model.name=tiny-moe", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=2",
        "--model.n_kv_heads=1", "--model.ffn_dim=64", "--model.moe.ffn_dim=32", "--model.moe.num_experts=4",
        "--data.seq_len=16", "--data.max_bytes=100000", "--training.global_batch=4", "--training.warmup_steps=2",
        "--metrics.log_every=1", "--metrics.tensorboard=false", "--eval.every=0", "--eval.batches=1",
    ]


def run_cli(args, env=None, timeout=300):
    """Run `python -m moeflow ...` in a subprocess; returns CompletedProcess with text output."""
    import subprocess

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "moeflow", *args], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


# moeflow also runs on torch 2.11 (a lent GPU machine's image), where moeflow/parallel/torch_compat.py refuses some
# pipelines; the suite leaves those cases out there (on 2.13, what `make test` installs, it runs every case).


def old_torch() -> bool:
    from moeflow.parallel.torch_compat import torch_minor

    return torch_minor() < (2, 13)


def refused_on_old_torch(argv: list[str]) -> bool:
    """Whether moeflow refuses these training flags on this torch before launching on the CPU (gloo)."""
    from moeflow.cli import _refuse_what_this_torch_cannot_run
    from moeflow.config import load_config, parse_overrides

    try:
        _refuse_what_this_torch_cannot_run(load_config(None, parse_overrides(argv)), "cpu")
    except ValueError:
        return True
    return False
