"""Model code: shapes, gradients, causality; MoE and Router against references written here; expert paths;
parameter-count formulas; presets against published counts; config validation messages.

Every reference below is independent of the code under test: hand-worked numbers, or naive per-token
Python loops that read only the modules' weights.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moeflow.models.config import ModelConfig, MoEConfig
from moeflow.models.moe import GroupedExperts, MoE, Router, expert_matmuls, permute_by_expert
from moeflow.models.presets import PRESETS, PUBLISHED, get_preset
from moeflow.models.transformer import Attention, Transformer

torch.set_num_threads(1)

SMALL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=32)


def small_moe(**moe) -> MoEConfig:
    base = dict(num_experts=4, top_k=2, ffn_dim=24)
    base.update(moe)
    return MoEConfig(**base)


MLA_SMALL = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)


def _seed_model(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    model.init_weights(seed=seed)
    return model


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
        torch.testing.assert_close(second(first(tokens)), full(tokens), atol=1e-5, rtol=1e-5)


def test_sequence_longer_than_max_seq_len_is_rejected():
    cfg = ModelConfig(**{**SMALL, "max_seq_len": 8})
    model = Transformer(cfg)
    with pytest.raises(ValueError, match=r"sequence length 9 exceeds model.max_seq_len \(8\)"):
        model(torch.zeros(1, 9, dtype=torch.long))


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


# -------------------------------------------------------------------------- MoE vs a naive reference


def _make_moe(seed: int = 0, dim: int = 16, **moe) -> MoE:
    cfg = ModelConfig(**{**SMALL, "dim": dim}, moe=MoEConfig(**moe))
    m = MoE(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.router.gate.weight.copy_(torch.randn(m.router.gate.weight.shape, generator=g) * 0.5)
        for w in (m.experts.w1, m.experts.w3, m.experts.w2):
            w.copy_(torch.randn(w.shape, generator=g) * 0.2)
        if m.shared_experts is not None:
            for p in m.shared_experts.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        if m.router.cfg.load_balance == "aux_free":
            m.router.expert_bias.copy_(torch.randn(m.router.expert_bias.shape, generator=g) * 0.05)
    return m


def _naive_route(logits: list[float], bias: list[float], c: MoEConfig) -> tuple[list[int], list[float]]:
    """One token: (chosen experts in rank order, their weights), written from the definitions."""
    E = len(logits)
    if c.score_func == "softmax":
        mx = max(logits)
        ex = [math.exp(v - mx) for v in logits]
        scores = [v / sum(ex) for v in ex]
    else:
        scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    choice = [s + b for s, b in zip(scores, bias)] if c.load_balance == "aux_free" else list(scores)
    allowed = set(range(E))
    if c.n_group > 1:
        per = E // c.n_group
        gscore = []
        for g in range(c.n_group):
            members = sorted((choice[e] for e in range(g * per, (g + 1) * per)), reverse=True)
            gscore.append(sum(members[:2]))
        best_groups = sorted(range(c.n_group), key=lambda g: -gscore[g])[: c.topk_group]
        allowed = {e for g in best_groups for e in range(g * per, (g + 1) * per)}
    chosen = sorted(allowed, key=lambda e: -choice[e])[: c.top_k]
    w = [scores[e] for e in chosen]
    if c.norm_topk_prob and c.top_k > 1:
        w = [v / sum(w) for v in w]
    return chosen, [v * c.route_scale for v in w]


@torch.no_grad()
def _naive_moe(m: MoE, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Per-token loop: route, drop over capacity in (token, k) order, weighted SwiGLU experts, + shared."""
    c = m.router.cfg
    x_TD = x.reshape(-1, x.shape[-1]).double()
    T = x_TD.shape[0]
    gate = m.router.gate.weight.detach().double()
    bias = m.router.expert_bias.tolist()
    w1, w3, w2 = (w.detach().double() for w in (m.experts.w1, m.experts.w3, m.experts.w2))
    cap = math.ceil(c.capacity_factor * T * c.top_k / c.num_experts) if c.capacity_factor else None
    load = [0] * c.num_experts
    out = torch.zeros_like(x_TD)
    for t in range(T):
        xt = x_TD[t]
        logits = [float(gate[e] @ xt) for e in range(c.num_experts)]
        chosen, weights = _naive_route(logits, bias, c)
        for e, w in zip(chosen, weights):
            if cap is not None and load[e] >= cap:
                continue
            load[e] += 1
            h = F.silu(xt @ w1[e]) * (xt @ w3[e])
            out[t] += w * (h @ w2[e])
        if m.shared_experts is not None:
            s = m.shared_experts
            h = F.silu(s.w1.weight.double() @ xt) * (s.w3.weight.double() @ xt)
            out[t] += s.w2.weight.double() @ h
    return out.float().view_as(x), load


MOE_CASES = [
    dict(score_func="softmax", norm_topk_prob=True),
    dict(score_func="softmax", norm_topk_prob=False),
    dict(score_func="softmax", norm_topk_prob=False, top_k=1, load_balance="none"),
    dict(score_func="sigmoid", norm_topk_prob=True, route_scale=2.5),
    dict(score_func="sigmoid", norm_topk_prob=False, route_scale=1.5, num_shared_experts=2, shared_ffn_dim=8),
    dict(score_func="sigmoid", norm_topk_prob=True, route_scale=2.5, n_group=4, topk_group=2,
         num_shared_experts=1),
    dict(score_func="softmax", num_shared_experts=1, capacity_factor=0.75),
]


@pytest.mark.parametrize("impl", ["grouped_mm", "bmm", "loop"])
@pytest.mark.parametrize("case", range(len(MOE_CASES)))
def test_moe_matches_per_token_reference(case, impl):
    kw = dict(num_experts=8, top_k=2, ffn_dim=12, expert_impl=impl)
    kw.update(MOE_CASES[case])
    m = _make_moe(seed=case, **kw)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(100 + case))
    got = m(x)
    want, load = _naive_moe(m, x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert m.router.last_load.tolist() == [float(v) for v in load]
    assert m.router.last_dropped.item() == 21 * m.top_k - sum(load)
    if kw.get("capacity_factor"):
        assert sum(load) < 21 * m.top_k  # the setting really drops something


def test_permute_by_expert_hand_example():
    topk_idx = torch.tensor([[2, 0], [-1, 2], [1, -1]])
    order, counts = permute_by_expert(topk_idx, 4)
    assert counts.tolist() == [1, 1, 2, 0]
    assert order.tolist() == [1, 4, 0, 3]  # flat t*K+k positions: e0 (t0), e1 (t2), e2 (t0, t1)


# ------------------------------------------------------------------------------------------------ Router


def _identity_router(E: int, **moe) -> Router:
    """Router whose gate is the identity, so the input row *is* the logits."""
    r = Router(E, MoEConfig(num_experts=E, ffn_dim=4, **moe))
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(E))
    return r


def test_group_limited_routing_hand_example():
    sig = lambda v: 1.0 / (1.0 + math.exp(-v))
    # groups of 2: G0 = {0, 1}, G1 = {2, 3}, G2 = {4, 5}, G3 = {6, 7}
    logits = [3.0, -3.0, 1.2, 0.8, 0.5, 2.0, -1.0, -1.0]
    # group scores (sum of the two members' sigmoids): G0 = 1.000, G1 = 1.459, G2 = 1.503, G3 = 0.538
    # -> groups G2 and G1 win; expert 0 (the best single score, 0.953) lies in the losing G0.
    # Inside G1 u G2 the best two are expert 5 (0.881) and expert 2 (0.769).
    x = torch.tensor([logits])
    kw = dict(top_k=2, score_func="sigmoid", norm_topk_prob=True, route_scale=2.5, load_balance="none")
    out = _identity_router(8, n_group=4, topk_group=2, **kw)(x)
    assert out.topk_idx.tolist() == [[5, 2]]
    s5, s2 = sig(2.0), sig(1.2)
    torch.testing.assert_close(out.topk_weights, torch.tensor([[2.5 * s5 / (s5 + s2), 2.5 * s2 / (s5 + s2)]]))

    # Without group limiting the same scores pick experts 0 and 5.
    assert _identity_router(8, n_group=1, topk_group=1, **kw)(x).topk_idx.tolist() == [[0, 5]]

    # topk_group=3 adds G0 (1.000 > G3's 0.538) -> experts 0 and 5 again.
    assert _identity_router(8, n_group=4, topk_group=3, **kw)(x).topk_idx.tolist() == [[0, 5]]

    # The aux-free bias takes part in choosing groups and experts but not in the weights: +1 on expert 1
    # lifts G0 to 2.000, so G0 and G2 win, and the biased choices are e1 (1.047) and e0 (0.953).
    r = _identity_router(8, n_group=4, topk_group=2, **{**kw, "load_balance": "aux_free"})
    r.expert_bias[1] = 1.0
    out = r(x)
    assert out.topk_idx.tolist() == [[1, 0]]
    # unbiased sigmoid(-3) + sigmoid(3) = 1, so the normalised weights are the scores themselves (* 2.5)
    torch.testing.assert_close(out.topk_weights, torch.tensor([[2.5 * sig(-3.0), 2.5 * sig(3.0)]]))


def test_softmax_routing_hand_example():
    x = torch.tensor([[0.0, math.log(2.0), math.log(3.0), math.log(4.0)]])  # softmax = [1, 2, 3, 4] / 10
    kw = dict(top_k=2, score_func="softmax", load_balance="none")
    out = _identity_router(4, norm_topk_prob=False, **kw)(x)
    assert out.topk_idx.tolist() == [[3, 2]]
    torch.testing.assert_close(out.topk_weights, torch.tensor([[0.4, 0.3]]))
    out = _identity_router(4, norm_topk_prob=True, route_scale=2.0, **kw)(x)
    torch.testing.assert_close(out.topk_weights, torch.tensor([[2.0 * 4 / 7, 2.0 * 3 / 7]]))
    assert out.tokens_per_expert.tolist() == [0, 0, 1, 1]


def test_aux_free_bias_update_moves_load_toward_balance():
    E = 8
    cfg = MoEConfig(num_experts=E, top_k=2, ffn_dim=8, load_balance="aux_free", bias_update_rate=0.02)
    r = Router(16, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        r.gate.weight.copy_(torch.randn(E, 16, generator=g) * 0.3)
    # Skewed input: every token leans toward expert 0's gate row.
    x = torch.randn(256, 16, generator=g) + 2.0 * r.gate.weight[0] / r.gate.weight[0].norm()

    r(x)
    load0 = r.last_load.clone()
    assert load0.sum() == 256 * 2
    imbalance0 = (load0.max() / load0.mean()).item()
    assert imbalance0 > 2.0  # really skewed
    r.update_bias(load0)
    mean = load0.mean()
    # First step, by hand: +rate for under-loaded experts, -rate for over-loaded ones.
    want = torch.where(load0 > mean, -0.02, torch.where(load0 < mean, 0.02, 0.0))
    torch.testing.assert_close(r.expert_bias, want)
    assert r.expert_bias[0] < 0

    imbalances = [imbalance0]
    for _ in range(40):
        r(x)
        imbalances.append((r.last_load.max() / r.last_load.mean()).item())
        r.update_bias(r.last_load)
    assert min(imbalances[-10:]) < imbalance0
    assert max(imbalances[-10:]) < 0.5 * imbalance0
    assert r.expert_bias[0] == r.expert_bias.min() and r.expert_bias[0] < 0

    # load_balance='none' leaves the bias alone.
    r_none = Router(16, MoEConfig(num_experts=E, top_k=2, ffn_dim=8, load_balance="none"))
    r_none.update_bias(load0)
    assert r_none.expert_bias.abs().sum() == 0


def test_capacity_drops_latest_tokens_top1():
    # E=4, K=1, T=8, cf=1 -> capacity ceil(1 * 8 * 1 / 4) = 2; every token prefers expert 2.
    r = _identity_router(4, top_k=1, score_func="softmax", load_balance="none", capacity_factor=1.0)
    x = torch.tensor([[0.0, 0.0, 5.0, 0.0]]) + 0.1 * torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    out = r(x)
    assert out.topk_idx[:, 0].tolist() == [2, 2, -1, -1, -1, -1, -1, -1]
    assert (out.topk_weights[2:] == 0).all() and (out.topk_weights[:2] > 0).all()
    assert out.tokens_per_expert.tolist() == [0, 0, 2, 0]
    assert r.last_dropped.item() == 6


def test_capacity_drops_latest_tokens_top2():
    # E=4, K=2, T=6, cf=0.5 -> capacity ceil(0.5 * 6 * 2 / 4) = 2. Tokens 0-3 pick (2, 1); tokens 4-5 pick (0, 3).
    r = _identity_router(4, top_k=2, score_func="softmax", norm_topk_prob=True, load_balance="none",
                         capacity_factor=0.5)
    x = torch.tensor([[0.0, 2.0, 3.0, -1.0]] * 4 + [[3.0, -1.0, -1.0, 2.0]] * 2)
    out = r(x)
    assert out.topk_idx.tolist() == [[2, 1], [2, 1], [-1, -1], [-1, -1], [0, 3], [0, 3]]
    assert (out.topk_weights[2:4] == 0).all()
    # kept weights are still the top-k-normalised scores (normalised before dropping)
    e2, e1 = math.exp(3.0), math.exp(2.0)
    torch.testing.assert_close(out.topk_weights[0], torch.tensor([e2 / (e1 + e2), e1 / (e1 + e2)]))
    assert out.tokens_per_expert.tolist() == [2, 2, 2, 2]
    assert r.last_dropped.item() == 4


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_and_z_loss_match_hand_computation(score_func):
    E, K, T, D = 4, 2, 6, 5
    r = Router(D, MoEConfig(num_experts=E, top_k=K, ffn_dim=4, score_func=score_func, load_balance="none",
                            aux_loss_coef=0.1, z_loss_coef=0.01))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        r.gate.weight.copy_(torch.randn(E, D, generator=g))
    x = torch.randn(T, D, generator=g)
    out = r(x)

    logits = [[float(r.gate.weight[e].detach().double() @ x[t].double()) for e in range(E)] for t in range(T)]
    counts = [0] * E
    P = [0.0] * E
    z = 0.0
    for t in range(T):
        if score_func == "softmax":
            ex = [math.exp(v) for v in logits[t]]
        else:
            ex = [1.0 / (1.0 + math.exp(-v)) for v in logits[t]]
        probs = [v / sum(ex) for v in ex]  # sigmoid scores renormalised to a distribution
        for e in range(E):
            P[e] += probs[e] / T
        for e in sorted(range(E), key=lambda e: -logits[t][e])[:K]:
            counts[e] += 1
        z += math.log(sum(math.exp(v) for v in logits[t])) ** 2 / T
    aux = E * sum(counts[e] / (T * K) * P[e] for e in range(E))
    assert out.tokens_per_expert.tolist() == counts
    assert out.aux_loss.item() == pytest.approx(0.1 * aux + 0.01 * z, rel=1e-5)
    # balanced routing makes the aux term 1: a uniform check of the normalisation
    assert 0.5 < aux < E

    r.cfg.aux_loss_coef, r.cfg.z_loss_coef = 0.0, 0.0
    assert r(x).aux_loss.item() == 0.0


def test_aux_loss_gradient_reaches_gate():
    """grad(gate | coefs on) - grad(gate | coefs off) == grad of the hand-written aux + z loss."""
    kw = dict(num_experts=4, top_k=2, ffn_dim=8, score_func="softmax", load_balance="none")
    on = _make_moe(seed=7, **kw, aux_loss_coef=0.3, z_loss_coef=0.05)
    off = _make_moe(seed=7, **kw)
    on.router.aux_loss_scale = 0.5  # e.g. two gradient-accumulation steps
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(8))
    on(x).pow(2).sum().backward()
    off(x).pow(2).sum().backward()
    diff = on.router.gate.weight.grad - off.router.gate.weight.grad
    assert diff.abs().max() > 1e-6

    W = off.router.gate.weight.detach().clone().requires_grad_(True)
    logits = x @ W.T
    probs = logits.softmax(-1)
    chosen = logits.topk(2, -1).indices
    f = torch.stack([(chosen == e).sum() for e in range(4)]).float() / (10 * 2)
    aux = 4 * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    (0.5 * (0.3 * aux + 0.05 * z)).backward()
    torch.testing.assert_close(diff, W.grad, atol=1e-6, rtol=1e-4)
    # the expert weights see no aux gradient
    torch.testing.assert_close(on.experts.w1.grad, off.experts.w1.grad)


# ------------------------------------------------------------------------------------ expert paths agree


def _naive_experts(x_ND, counts, w1, w3, w2):
    rows, n = [], 0
    for e, c in enumerate(counts):
        for _ in range(c):
            xr = x_ND[n]
            rows.append((F.silu(xr @ w1[e]) * (xr @ w3[e])) @ w2[e])
            n += 1
    return torch.stack(rows) if rows else x_ND.new_zeros(0, w2.shape[-1])


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 9, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
def test_expert_impls_agree(counts):
    E, D, Fh = 4, 8, 4  # fp32 rows of 32 and 16 bytes: grouped_mm needs 16-byte-aligned strides
    g = torch.Generator().manual_seed(sum(counts) + 11)
    base_w = [torch.randn(E, D, Fh, generator=g), torch.randn(E, D, Fh, generator=g),
              torch.randn(E, Fh, D, generator=g)]
    base_x = torch.randn(sum(counts), D, generator=g)
    grad_out = torch.randn(sum(counts), D, generator=g)
    counts_E = torch.tensor(counts)

    want = _naive_experts(base_x, counts, *base_w)
    results = {}
    for impl in ("grouped_mm", "bmm", "loop"):
        x = base_x.clone().requires_grad_(True)
        ws = [w.clone().requires_grad_(True) for w in base_w]
        y = expert_matmuls(x, counts_E, *ws, impl)
        assert y.shape == (sum(counts), D)
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
        (y * grad_out).sum().backward()
        for w in ws:
            assert w.grad is not None  # zero rows still give (zero) expert gradients
        results[impl] = [x.grad] + [w.grad for w in ws]
    for impl in ("bmm", "loop"):
        for a, b in zip(results["grouped_mm"], results[impl]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for e, c in enumerate(counts):  # an expert with no rows has exactly zero gradient
        if c == 0:
            assert all(results["grouped_mm"][i][e].abs().sum() == 0 for i in (1, 2, 3))
    if sum(counts):  # and the gradient of a used expert matches autograd through the naive loop
        ws = [w.clone().requires_grad_(True) for w in base_w]
        (_naive_experts(base_x, counts, *ws) * grad_out).sum().backward()
        for a, w in zip(results["loop"][1:], ws):
            torch.testing.assert_close(a, w.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim,hidden", [(6, 8), (8, 5), (8, 4)])
def test_grouped_experts_auto_handles_unaligned_widths_and_sum_gradient(dim, hidden):
    """'auto' must not pick grouped_mm where torch rejects the strides, and y.sum().backward() (a stride-0
    upstream gradient, which grouped_mm's backward rejects) must work."""
    experts = GroupedExperts(3, dim, hidden, impl="auto")
    g = torch.Generator().manual_seed(dim)
    with torch.no_grad():
        for w in (experts.w1, experts.w3, experts.w2):
            w.copy_(torch.randn(w.shape, generator=g))
    x = torch.randn(7, dim, generator=g, requires_grad=True)
    counts = [2, 0, 5]
    y = experts(x, torch.tensor(counts))
    torch.testing.assert_close(y, _naive_experts(x.detach(), counts, experts.w1, experts.w3, experts.w2))
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and experts.w2.grad[1].abs().sum() == 0


def test_unknown_expert_impl_rejected():
    x = torch.randn(2, 3)
    w = torch.randn(1, 3, 4)
    with pytest.raises(ValueError, match="expert_impl = 'fast'"):
        expert_matmuls(x, torch.tensor([2]), w, w, torch.randn(1, 4, 3), "fast")


# ------------------------------------------------------------------------------------ parameter formulas


PARAM_CASES = {
    "dense": dict(),
    "dense-tied": dict(tie_embeddings=True),
    "dense-qk-per-head": dict(qk_norm="per_head", n_kv_heads=2),
    "dense-qk-full": dict(qk_norm="full", n_kv_heads=1),
    "gqa-kv1-headdim": dict(n_kv_heads=1, head_dim=12),
    "gqa-kv2-full-headdim": dict(n_kv_heads=2, head_dim=6, qk_norm="full"),
    "gqa-attention-bias": dict(n_kv_heads=2, attention_bias=True, qk_norm="per_head"),
    "moe": dict(moe=small_moe()),
    "moe-shared": dict(moe=small_moe(num_shared_experts=2)),
    "moe-shared-width": dict(moe=small_moe(num_shared_experts=1, shared_ffn_dim=40, first_k_dense=1)),
    "moe-tied-qk": dict(tie_embeddings=True, qk_norm="per_head", n_kv_heads=2,
                        moe=small_moe(first_k_dense=2)),
    "mla": dict(**MLA_SMALL),
    "mla-qlora": dict(**MLA_SMALL, q_lora_rank=10, moe=small_moe(num_shared_experts=1, first_k_dense=1)),
}


@pytest.mark.parametrize("case", list(PARAM_CASES))
def test_num_params_matches_built_model(case):
    cfg = ModelConfig(**SMALL).replace(**PARAM_CASES[case])
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_num_active_params_hand_count():
    cfg = ModelConfig(vocab_size=10, dim=4, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=6, max_seq_len=8,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=3, num_shared_experts=1, first_k_dense=1))
    # embeddings 2 * 10 * 4 = 80, final norm 4
    # per layer: 2 norms (8) + attention wq 16 + wk 8 + wv 8 + wo 16 = 56
    # layer 0 dense SwiGLU 3 * 4 * 6 = 72 -> 128
    # layer 1: gate 4 * 4 = 16, shared 3 * 4 * 3 = 36, each routed expert 3 * 4 * 3 = 36
    #   active: 56 + 16 + 2 * 36 + 36 = 180;  total: 56 + 16 + 4 * 36 + 36 = 252
    assert cfg.num_active_params() == 80 + 4 + 128 + 180
    assert cfg.num_params() == 80 + 4 + 128 + 252
    assert sum(p.numel() for p in Transformer(cfg).parameters()) == 464


# ------------------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_real_presets_match_published_counts(name):
    cfg = get_preset(name).validate()
    total, active = PUBLISHED[name]
    assert cfg.num_params() == pytest.approx(total, rel=0.02)
    assert cfg.num_active_params() == pytest.approx(active, rel=0.02)
    assert cfg.num_active_params() <= cfg.num_params()


def test_every_preset_validates_and_is_a_fresh_copy():
    for name in PRESETS:
        assert get_preset(name).validate().name == name
    a = get_preset("tiny-moe")
    a.moe.top_k = 7
    assert get_preset("tiny-moe").moe.top_k == 2


# -------------------------------------------------------------------------------------------- bad input


BAD = [
    (dict(moe=small_moe(num_experts=2, top_k=3)), r"model\.moe\.top_k \(3\) must be between 1 and "
     r"model\.moe\.num_experts \(2\)"),
    (dict(n_heads=5), r"model\.n_heads \(5\) must divide model\.dim \(32\); choose n_heads in \[1, 2, 4, 8, 16, 32\]"),
    (dict(n_kv_heads=3), r"model\.n_kv_heads \(3\) must divide model\.n_heads \(4\); choose n_kv_heads in \[1, 2, 4\]"),
    (dict(moe=small_moe(num_experts=8, n_group=2, topk_group=3)),
     r"model\.moe\.topk_group \(3\) must be between 1 and model\.moe\.n_group \(2\)"),
    (dict(moe=small_moe(num_experts=8, n_group=3)),
     r"model\.moe\.num_experts \(8\) must split into model\.moe\.n_group \(3\) equal groups; "
     r"choose n_group in \[1, 2, 4, 8\]"),
    (dict(moe=small_moe(num_experts=8, top_k=3, n_group=4, topk_group=1)),
     r"model\.moe\.top_k \(3\) exceeds the experts in topk_group \(1\) groups of 2"),
    (dict(moe=small_moe(score_func="softmx")), r"model\.moe\.score_func = 'softmx'.*Did you mean 'softmax'"),
    (dict(qk_norm="perhead"), r"model\.qk_norm = 'perhead'.*Did you mean 'per_head'"),
    (dict(moe=small_moe(capacity_factor=0.0)), r"capacity_factor must be positive"),
]


@pytest.mark.parametrize("changes,message", BAD)
def test_bad_config_rejected(changes, message):
    cfg = ModelConfig(**SMALL).replace(**changes)
    with pytest.raises(ValueError, match=message):
        cfg.validate()
    with pytest.raises(ValueError, match=message):
        Transformer(cfg)  # building a model validates too


def test_unknown_preset_suggests_closest():
    with pytest.raises(ValueError, match=r"'tiny-mo' is not a preset\. Did you mean 'tiny-moe'\?"):
        get_preset("tiny-mo")
    with pytest.raises(ValueError, match=r"Did you mean 'deepseek-v3'\?"):
        get_preset("deepseek-v2")
    with pytest.raises(ValueError, match=r"Presets: tiny-moe, tiny-dense"):
        get_preset("zzz")
