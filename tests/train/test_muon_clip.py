"""training.muon_clip (MuonClip's qk-clip): the largest logit per head equals a plain full-matrix oracle (causal,
document masks, GQA, queries in blocks); the clip scales exactly the query rows of the heads over the threshold,
hand-worked; a run logs every layer's largest logit and, with a threshold nothing reaches, trains plain Muon's
losses bit for bit, while a low one changes them and keeps the next steps' logits down; 2-rank layouts train the
one-process clipped run; bad settings are one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moeflow.config import load_config
from moeflow.models import attention
from moeflow.models.attention import document_causal_mask, max_logits
from moeflow.train import qk_clip
from moeflow.train.trainer import train
from tests.support.cli import assert_one_line


def _oracle(q, k, mask):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = torch.einsum("bhsd,bhtd->bhst", q.double(), k.double()) / q.shape[-1] ** 0.5
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return logits.masked_fill(~mask, -torch.inf).amax(dim=(0, 2, 3)).float()


@pytest.mark.parametrize("masked", [False, True])
def test_the_largest_logit_per_head_is_the_full_matrix_one(monkeypatch, masked):
    monkeypatch.setattr(attention, "LOGIT_BLOCK", 3)  # 8 queries in blocks of 3, 3 and 2
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 8, 16, generator=g), torch.randn(2, 2, 8, 16, generator=g)
    k[:, :, 2] = 5.0  # a key of the first document that the last queries (the second document) align with
    q[:, :, 6:] = 5.0
    mask = None
    if masked:  # two documents per row, split at different places
        docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]])
        mask = document_causal_mask(docs)
    torch.testing.assert_close(max_logits(q, k, mask), _oracle(q, k, mask), rtol=1e-6, atol=1e-5)
    causal = _oracle(q, k, None)
    assert masked == (not torch.equal(_oracle(q, k, mask), causal))  # the mask changes what is seen


def test_the_clip_scales_the_query_rows_of_the_heads_over_the_threshold():
    """Layer 0: head 1 reached 2 x tau (its rows and bias halved), head 0 0.5 x tau (untouched); layer 1: nothing
    over the threshold."""
    from moeflow.core.presets import get_preset
    from moeflow.models.transformer import Transformer

    cfg = get_preset("tiny-dense")
    cfg.n_layers, cfg.attention_bias = 2, True
    model = Transformer(cfg)
    tau, heads, hd = 10.0, cfg.n_heads, cfg.hd
    modules = qk_clip.attention_modules([model])
    assert sorted(modules) == [0, 1]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    qk_clip.track([model])
    modules[0].max_logits = torch.tensor([0.5 * tau, 2 * tau] + [1.0] * (heads - 2))
    modules[1].max_logits = torch.full((heads,), 0.9 * tau)
    got = qk_clip.clip([model], tau, 2, heads)
    assert got == {0: 2 * tau, 1: pytest.approx(0.9 * tau)}
    scale = torch.ones(heads * hd)
    scale[hd:2 * hd] = 0.5
    for name, p in model.named_parameters():
        if name.startswith("layers.0.attention.wq."):
            want = before[name] * (scale[:, None] if p.dim() == 2 else scale)
            assert torch.equal(p, want), name
        else:
            assert torch.equal(p, before[name]), name
    assert modules[0].max_logits is None  # read once: the next step records its own


def _overrides(run_dir, **more) -> dict:
    return {"training.optimizer": "muon", "model.dim": 32, "model.n_layers": 2, "model.moe.num_experts": 4,
            "model.n_heads": 4, "model.n_kv_heads": 2, "model.moe.ffn_dim": 16, "data.seq_len": 16,
            "data.max_bytes": 50_000, "training.global_batch": 4, "training.steps": 6,
            "eval.every": 0, "metrics.tensorboard": False, "metrics.log_every": 1, "checkpoint.every": 3,
            "run_dir": str(run_dir), **more}


def _rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_logs_the_largest_logits_and_clips_only_above_the_threshold(tmp_path):
    train(load_config(None, _overrides(tmp_path / "muon")), progress=False)
    train(load_config(None, _overrides(tmp_path / "high", **{"training.muon_clip": 1e9})), progress=False)
    high = _rows(tmp_path / "high")
    assert [r["loss"] for r in high] == [r["loss"] for r in _rows(tmp_path / "muon")]  # nothing reached 1e9
    assert all(set(r["max_logit"]) == {"0", "1"} and min(r["max_logit"].values()) > 0 for r in high)
    tau = 0.5 * min(high[0]["max_logit"].values())  # below every head's first-step maximum: every step clips
    train(load_config(None, _overrides(tmp_path / "low", **{"training.muon_clip": tau})), progress=False)
    low = _rows(tmp_path / "low")
    assert [r["loss"] for r in low] != [r["loss"] for r in high]
    # each step's weights were clipped to what the previous step's logits allow: the next steps' largest logits
    # stay near tau (a new batch and one update away), the unclipped run's grow past 1.5 tau
    for r_low, r_high in zip(low[2:], high[2:]):
        assert max(r_low["max_logit"].values()) < 1.5 * tau < max(r_high["max_logit"].values())


LAYOUTS = {"dp2-zero3": {"parallel.zero": 3}, "tp2": {"parallel.tp": 2}, "ep2": {"parallel.ep": 2},
           "pp2": {"parallel.pp": 2}}


@pytest.mark.parametrize("names", [["tp2"], pytest.param(["dp2-zero3", "ep2", "pp2"], marks=pytest.mark.slow)],
                         ids=["tp", "fsdp-ep-pp"])
def test_layouts_train_the_one_process_clipped_run(tmp_path, names):
    """2 ranks under FSDP2, tp, ep and pp: the first step's largest logits equal one process's (rtol 1e-5: the
    gather over ranks and heads is exact), and the clipped run's losses, gradient norms and logits follow it within
    5e-4 (measured 1.7e-4 after 6 steps, against 8e-6 unclipped: a head's largest logit here is a small difference
    of large products, ~0.03, so its rounding error, which gamma = tau / max carries into the whole query
    projection, is ~20x the loss's)."""
    from tests.parallel.layout_worker import launch

    clip = {"training.muon_clip": 0.03}  # low enough to clip (the largest logits start near 0.05 here)
    train(load_config(None, _overrides(tmp_path / "one", **clip)), fresh=True, progress=False)
    argv = lambda run, **more: [f"--{k}={v}" for k, v in _overrides(tmp_path / run, **clip, **more).items()]
    results = launch(2, [(n, argv(n, **LAYOUTS[n]), str(tmp_path / n), False) for n in names])
    assert set(results.values()) == {"ok"}, results
    steps = lambda run: np.array([(r["loss"], r["grad_norm"], *r["max_logit"].values()) for r in _rows(tmp_path / run)])
    assert (steps("one")[:, 2:] > 0.03).any()  # it did clip
    for run in names:
        np.testing.assert_allclose(steps(run)[0, 2:], steps("one")[0, 2:], rtol=1e-5, err_msg=run)
        np.testing.assert_allclose(steps(run), steps("one"), rtol=5e-4, err_msg=run)


@pytest.mark.parametrize("changes, message", [
    ({"training.optimizer": "adamw"}, r"training.muon_clip = 100.0 with training.optimizer = 'adamw': the clip is "
                                      r"MuonClip's"),
    ({"model.qk_norm": "per_head"}, r"model.qk_norm = 'per_head' renormalises the queries"),
    ({"model.name": "deepseek-v3"}, r"MLA splits each head in parts"),
    ({"training.muon_clip": -1.0}, r"training.muon_clip = -1.0; use a positive threshold"),
    ({"model.mtp_depth": 1}, r"the multi-token-prediction blocks' attention is not clipped yet"),
])
def test_bad_muon_clip_settings_are_one_line(changes, message):
    base = {"training.optimizer": "muon", "training.muon_clip": 100.0}
    assert_one_line(lambda: load_config(None, {**base, **changes}).layout(1), message)
