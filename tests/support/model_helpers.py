"""Small model configs shared by the model tests (test_transformer.py, test_moe.py, test_model_config.py);
metric() and steps(), which read a training run's metrics.jsonl; random_lora_factors() and next_token_loss(), for
comparing LoRA against peft."""

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


def steps(run_dir: Path) -> list[tuple[float, float]]:
    """(loss, grad_norm) of every logged step of the run."""
    records = map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
    return [(r["loss"], r["grad_norm"]) for r in records if "loss" in r]


@torch.no_grad()
def random_lora_factors(model: torch.nn.Module, seed: int = 3) -> dict[str, torch.Tensor]:
    """Every LoRA factor of `model` drawn at 0.1 x N(0, 1) (B nonzero, so the adapter changes the output);
    {name: factor}."""
    from moeflow.models import lora

    gen = torch.Generator().manual_seed(seed)
    factors = {n: p for n, p in model.named_parameters() if lora.is_factor(n)}
    for p in factors.values():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return {n: p.detach() for n, p in factors.items()}


@torch.no_grad()
def next_token_loss(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Cross-entropy of the first sequence of `ids` [1, S + 1] predicting its next tokens (moeflow's model gives
    logits, transformers' an output with .logits)."""
    out = model(ids[:, :-1])
    return float(torch.nn.functional.cross_entropy(getattr(out, "logits", out).flatten(0, 1), ids[0, 1:]))
