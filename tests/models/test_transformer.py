"""The transformer: shapes, gradients, causality, stage slices, and attention (GQA, MLA) against naive loops
that read only the modules' weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moeflow.core.model_config import ModelConfig, MoEConfig
from moeflow.core.presets import get_preset
from moeflow.models.transformer import Attention, Transformer
from tests.support.model_helpers import MLA_SMALL, SMALL, _seed_model, small_moe
from tests.support.numerics import assert_same_up_to_order, forward_reduction

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------ model shapes, grads


def _tiny_mla_group_cfg() -> ModelConfig:
    return ModelConfig(
        name="tiny-mla", vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=48, max_seq_len=32,
        q_lora_rank=16, **MLA_SMALL,
        moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=16, num_shared_experts=1, first_k_dense=1,
                      score_func="sigmoid", route_scale=2.5, n_group=4, topk_group=2),
    )


MODEL_CASES = {
    "tiny-moe": lambda: get_preset("tiny-moe"),
    "tiny-dense": lambda: get_preset("tiny-dense"),
    "mla-group-sigmoid": _tiny_mla_group_cfg,
    "tied": lambda: ModelConfig(**SMALL, tie_embeddings=True, moe=small_moe()),
    "qk-per-head": lambda: ModelConfig(**SMALL, n_kv_heads=2, qk_norm="per_head", moe=small_moe()),
    "qk-full": lambda: ModelConfig(**SMALL, n_kv_heads=1, qk_norm="full"),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_logits_shape_and_finite_grads(case):
    cfg = MODEL_CASES[case]()
    model = _seed_model(Transformer(cfg))
    B, S = 2, 12
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (B, S, cfg.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
    # Attention, norms, embedding and the router gate must really be trained (not just zero grads).
    for name, p in model.named_parameters():
        if ".feed_forward.experts." not in name:  # a routed expert can legitimately receive no token
            assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


@pytest.mark.parametrize("case", ["tiny-moe", "mla-group-sigmoid", "qk-full"])
def test_causality(case):
    cfg = MODEL_CASES[case]()
    model = _seed_model(Transformer(cfg)).eval()
    S, j = 10, 6
    tokens = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, j] = (changed[:, j] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :j], b[:, :j], atol=1e-6, rtol=0)
    assert (a[:, j] - b[:, j]).abs().max() > 1e-4  # the change is visible where it happens


def test_no_embedding_no_head_and_stage_split_reproduces_full_model():
    cfg = get_preset("tiny-moe").replace(n_layers=4)
    full = _seed_model(Transformer(cfg), seed=3).eval()
    body = Transformer(cfg, embed=False, head=False)
    assert body.tok_embeddings is None and body.norm is None and body.output is None
    h = torch.randn(2, 7, cfg.dim)
    assert body(h).shape == (2, 7, cfg.dim)

    # Two pipeline stages built with layer subsets and the full model's weights reproduce its logits.
    first = Transformer(cfg, head=False, layers=[0, 1])
    second = Transformer(cfg, embed=False, layers=[2, 3])
    state = full.state_dict()
    for stage in (first, second):
        stage.load_state_dict({k: state[k] for k in stage.state_dict()}, strict=True)
    assert isinstance(first.layers["0"].feed_forward, torch.nn.Module)
    assert not hasattr(first.layers["0"].feed_forward, "router")  # first_k_dense=1 follows the global index
    assert hasattr(second.layers["2"].feed_forward, "router")
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert_same_up_to_order(second(first(tokens)), full(tokens), forward_reduction(cfg, 9), "two stages")


def test_sequence_longer_than_max_seq_len_is_rejected():
    cfg = ModelConfig(**{**SMALL, "max_seq_len": 8})
    model = Transformer(cfg)
    with pytest.raises(ValueError, match=r"sequence length 9 exceeds model.max_seq_len \(8\)"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("case", ["tiny-moe", "mla-group-sigmoid"])
def test_positions_drive_rope(case):
    """positions=: 0..S-1 is the default; RoPE sees only relative positions, so a shift per row changes nothing;
    a stretch changes the logits; [B, S] positions act row by row (what context parallelism and packing pass)."""
    model = _seed_model(Transformer(MODEL_CASES[case]()))
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model(tokens)
        torch.testing.assert_close(model(tokens, positions=torch.arange(6)), plain, atol=0, rtol=0)
        shifted = torch.stack([torch.arange(6), torch.arange(6) + 3])
        reduction = forward_reduction(model.cfg, 6)
        assert_same_up_to_order(model(tokens, positions=shifted), plain, reduction, "shifted")
        stretched = torch.stack([torch.arange(6) * 2, torch.tensor([0, 1, 2, 7, 8, 9])])
        rows = model(tokens, positions=stretched)
        assert (rows - plain).abs().max() > 1e-4  # (3e-4 for the MLA model: RoPE is 4 of its 12 widths)
        for b in range(2):
            assert_same_up_to_order(rows[b:b + 1], model(tokens[b:b + 1], positions=stretched[b]), reduction, "row")


# ------------------------------------------------------------------ attention vs a naive reference


def _naive_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _naive_rope(v: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on one vector: pair (i, i + d/2) turns by pos * theta^(-2i/d)."""
    d = v.shape[-1]
    half = d // 2
    out = v.clone()
    for i in range(half):
        ang = pos * theta ** (-2 * i / d)
        c, s = math.cos(ang), math.sin(ang)
        out[..., i] = v[..., i] * c - v[..., i + half] * s
        out[..., i + half] = v[..., i + half] * c + v[..., i] * s
    return out


@pytest.mark.parametrize("qk_norm", ["none", "per_head", "full"])
def test_gqa_attention_matches_naive_loop(qk_norm):
    cfg = ModelConfig(**{**SMALL, "dim": 16, "n_heads": 4, "n_kv_heads": 2, "qk_norm": qk_norm})
    model = _seed_model(Transformer(cfg), seed=5)
    attn: Attention = model.layers["0"].attention
    with torch.no_grad():
        for p in attn.parameters():  # larger weights and non-trivial norm scales
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    B, S, H, Hk, Dh = 2, 5, 4, 2, 4
    x = torch.randn(B, S, cfg.dim, generator=torch.Generator().manual_seed(6))
    got = attn(x, model.rope_cos[:S], model.rope_sin[:S])

    want = torch.zeros(B, S, cfg.dim)
    with torch.no_grad():
        for b in range(B):
            q_all = x[b] @ attn.wq.weight.T
            k_all = x[b] @ attn.wk.weight.T
            v_all = x[b] @ attn.wv.weight.T
            if qk_norm == "full":
                q_all = _naive_rms(q_all, attn.q_norm.weight, cfg.norm_eps)
                k_all = _naive_rms(k_all, attn.k_norm.weight, cfg.norm_eps)
            outs = []
            for h in range(H):
                hk = h // (H // Hk)  # query head h reads kv head h // group
                q = q_all[:, h * Dh:(h + 1) * Dh]
                k = k_all[:, hk * Dh:(hk + 1) * Dh]
                v = v_all[:, hk * Dh:(hk + 1) * Dh]
                if qk_norm == "per_head":
                    q = _naive_rms(q, attn.q_norm.weight, cfg.norm_eps)
                    k = _naive_rms(k, attn.k_norm.weight, cfg.norm_eps)
                q = torch.stack([_naive_rope(q[s], s, cfg.rope_theta) for s in range(S)])
                k = torch.stack([_naive_rope(k[s], s, cfg.rope_theta) for s in range(S)])
                o = torch.zeros(S, Dh)
                for s in range(S):
                    sc = torch.tensor([float(q[s] @ k[t]) / math.sqrt(Dh) for t in range(s + 1)])
                    p = sc.softmax(0)
                    o[s] = sum(p[t] * v[t] for t in range(s + 1))
                outs.append(o)
            want[b] = torch.cat(outs, -1) @ attn.wo.weight.T
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [0, 10])
def test_mla_matches_naive_loop(q_lora_rank):
    cfg = ModelConfig(**{**SMALL, "dim": 16, "n_heads": 2}, **{**MLA_SMALL, "kv_lora_rank": 6}, q_lora_rank=q_lora_rank)
    model = _seed_model(Transformer(cfg), seed=9)
    attn = model.layers["1"].attention
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.4)
    B, S, H = 2, 5, 2
    nope, rope, vd, L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    x = torch.randn(B, S, cfg.dim, generator=torch.Generator().manual_seed(10))
    got = attn(x, model.rope_cos[:S], model.rope_sin[:S])

    want = torch.zeros(B, S, cfg.dim)
    with torch.no_grad():
        for b in range(B):
            if q_lora_rank:
                q_all = _naive_rms(x[b] @ attn.wq_a.weight.T, attn.q_norm.weight, cfg.norm_eps) @ attn.wq_b.weight.T
            else:
                q_all = x[b] @ attn.wq.weight.T
            kv_a = x[b] @ attn.wkv_a.weight.T
            latent, k_pe = kv_a[:, :L], kv_a[:, L:]  # k_pe: one RoPE key shared by every head
            k_pe = torch.stack([_naive_rope(k_pe[s], s, cfg.rope_theta) for s in range(S)])
            kv = _naive_rms(latent, attn.kv_norm.weight, cfg.norm_eps) @ attn.wkv_b.weight.T
            outs = []
            for h in range(H):
                qh = q_all[:, h * (nope + rope):(h + 1) * (nope + rope)]
                q_nope = qh[:, :nope]
                q_pe = torch.stack([_naive_rope(qh[s, nope:], s, cfg.rope_theta) for s in range(S)])
                k_nope = kv[:, h * (nope + vd):h * (nope + vd) + nope]
                v = kv[:, h * (nope + vd) + nope:(h + 1) * (nope + vd)]
                o = torch.zeros(S, vd)
                for s in range(S):
                    sc = torch.tensor([(float(q_nope[s] @ k_nope[t]) + float(q_pe[s] @ k_pe[t]))
                                       / math.sqrt(nope + rope) for t in range(s + 1)])
                    p = sc.softmax(0)
                    o[s] = sum(p[t] * v[t] for t in range(s + 1))
                outs.append(o)
            want[b] = torch.cat(outs, -1) @ attn.wo.weight.T
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_repeated_kv_heads_equal_grouped_query_attention_with_a_mask():
    """attend() repeats the key/value heads for a masked GQA call on CUDA (so a fused kernel takes it): the
    repetition must group heads as enable_gqa does (query head h reads key head h // (H / Hk))."""
    from moeflow.models.attention import document_causal_mask, repeat_kv_heads

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 6, 8, generator=g) for h in (6, 2, 2))
    mask = document_causal_mask(torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]]))
    grouped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    repeated = F.scaled_dot_product_attention(q, repeat_kv_heads(k, 6), repeat_kv_heads(v, 6), attn_mask=mask)
    assert_same_up_to_order(repeated, grouped, 8 + 6, "repeated")  # scores over the head dim, values over keys
    wrong = F.scaled_dot_product_attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1), attn_mask=mask)
    assert not torch.allclose(wrong, grouped, atol=1e-3)  # the other grouping differs: the test can tell
