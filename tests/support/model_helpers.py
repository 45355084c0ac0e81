"""Small model configs shared by the model tests (test_transformer.py, test_moe.py, test_model_config.py), and
metric(), which reads a training run's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moeflow.core.model_config import MoEConfig

SMALL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=32)


def small_moe(**moe) -> MoEConfig:
    base = dict(num_experts=4, top_k=2, ffn_dim=24)
    base.update(moe)
    return MoEConfig(**base)


MLA_SMALL = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)


def _seed_model(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    model.init_weights(seed=seed)
    return model


def metric(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """{step: value of `key`} from the run's metrics.jsonl (records without the key are skipped)."""
    records = map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r[key] for r in records if key in r}
