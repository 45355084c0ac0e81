import os

import pytest

# One BLAS thread per process: multi-process tests start several ranks at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def tiny_args():
    """Overrides that make a training run take seconds: a small model and a small corpus."""
    return [
        "--model.name=tiny-moe", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=2",
        "--model.n_kv_heads=1", "--model.ffn_dim=64", "--model.moe.ffn_dim=32", "--model.moe.num_experts=4",
        "--data.seq_len=16", "--data.max_bytes=100000", "--training.global_batch=4", "--training.warmup_steps=2",
        "--metrics.log_every=1", "--metrics.tensorboard=false", "--eval.every=0", "--eval.batches=1",
    ]
