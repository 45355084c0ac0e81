"""The MoE layer: routed + shared experts against a per-token reference, the permutation, the router (hand-worked
routing, aux-free bias, capacity, aux and z losses) and the expert matmul paths against each other."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moeflow.core.model_config import ModelConfig, MoEConfig
from moeflow.models.moe import GroupedExperts, MoE, Router, expert_matmuls, permute_by_expert
from tests.support.host_syncs import count_host_syncs
from tests.support.model_helpers import SMALL
from tests.support.numerics import assert_same_up_to_order

torch.set_num_threads(1)


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
    # the gate and the first expert matmul over dim, the second over ffn_dim, the combine over top_k
    assert_same_up_to_order(got, want, 2 * 16 + kw["ffn_dim"] + kw["top_k"], "output")
    assert m.router.last_load.tolist() == [float(v) for v in load]
    assert m.router.last_dropped.item() == 21 * m.top_k - sum(load)
    if kw.get("capacity_factor"):
        assert sum(load) < 21 * m.top_k  # the setting really drops something


def test_permute_by_expert_hand_example():
    topk_idx = torch.tensor([[2, 0], [-1, 2], [1, -1]])
    order, counts = permute_by_expert(topk_idx, 4)
    assert counts.tolist() == [1, 1, 2, 0]
    assert order.tolist() == [1, 4, 0, 3]  # flat t*K+k positions: e0 (t0), e1 (t2), e2 (t0, t1)

    # dropless (no -1 can occur): every pair is kept without reading the count back
    order, counts = permute_by_expert(torch.tensor([[2, 0], [3, 2], [1, 0]]), 4, dropless=True)
    assert counts.tolist() == [2, 1, 2, 1] and order.tolist() == [1, 5, 4, 0, 3, 2]


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_a_dropless_moe_layer_traces_as_one_graph(capacity_factor):
    """torch.compile takes the dropless layer (routing, sort, grouped matmuls, combine) whole: no size is read back
    to the host (tests/support/host_syncs.py counts none). With a capacity the kept pairs' count is data dependent:
    the graph breaks where it is read.
    (In bf16: torch._grouped_mm's shape function checks the CUDA kernel's bf16 inputs, whatever the device.)"""
    cfg = ModelConfig(dim=16, moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=16, capacity_factor=capacity_factor,
                                            expert_impl="grouped_mm", load_balance="none")).validate()
    torch.manual_seed(0)
    moe = MoE(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():  # (the model's init_weights sets them in a whole model)
            p.normal_(0, 0.3)
    x = torch.randn(2, 6, 16, dtype=torch.bfloat16)
    explained = torch._dynamo.explain(moe)(x)
    torch._dynamo.reset()
    if capacity_factor is not None:
        assert "Tensor.item()" in explained.break_reasons[0].reason
        return
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(moe, backend="eager", fullgraph=True)  # a graph break would raise here
    torch.testing.assert_close(compiled(x), moe(x), rtol=0, atol=0)
    torch._dynamo.reset()
    with count_host_syncs() as syncs:  # and eagerly, forward and backward, nothing is read back either
        moe(x).float().sum().backward()
    assert sum(syncs.values()) == 0, dict(syncs)

    # a capacity set on the built layer: the router drops pairs and the dispatch skips them, as when built with it
    moe.router.cfg.capacity_factor = 0.5
    twin = MoE(ModelConfig(dim=16, moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=16, capacity_factor=0.5,
                                                 expert_impl="grouped_mm", load_balance="none")).validate())
    twin.load_state_dict(moe.state_dict())
    twin.to(torch.bfloat16)
    torch.testing.assert_close(moe(x), twin(x), rtol=0, atol=0)
    assert moe.router.last_dropped.item() > 0



def test_a_transformer_block_traces_as_one_graph_under_bf16_autocast(monkeypatch):
    """A whole block (norms, GQA attention with per-head qk norm, the dropless MoE) under bf16 autocast: one graph,
    as training.compile traces it, even where dynamo cannot trace torch.amp.is_autocast_available (torch 2.11: a
    graph break at each autocast check, six in this block; mimicked here by hiding the function from dynamo)."""
    from moeflow.models.transformer import Transformer

    monkeypatch.setattr(torch.amp, "is_autocast_available", torch._dynamo.disable(torch.amp.is_autocast_available))
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64,
                      max_seq_len=32, qk_norm="per_head",
                      moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=32, load_balance="none")).validate()
    model = Transformer(cfg)
    model.init_weights(seed=0)
    seen = {}
    hook = model.layers["1"].register_forward_pre_hook(lambda m, args, kwargs: seen.update(a=args, k=kwargs),
                                                       with_kwargs=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 64, (2, 16)))
        hook.remove()
        explained = torch._dynamo.explain(model.layers["1"])(*seen["a"], **seen["k"])
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, [r.reason.splitlines()[0] for r in explained.break_reasons]


@pytest.mark.parametrize("autocast_dtype, impl", [(torch.bfloat16, "auto"), (None, "bmm"), (torch.float16, "bmm")])
@pytest.mark.parametrize("built_on", ["cpu", "meta"])
def test_compiled_blocks_keep_the_grouped_gemm_under_bf16_autocast(autocast_dtype, impl, built_on):
    """training.compile on fp32 weights: under bf16 autocast the experts take bf16 rows and keep grouped_mm (which
    torch.compile traces in bf16 only); in fp32 or fp16 they take the padded bmm, which it traces. The same for a
    model built on the meta device (the trainer's way when each rank reads its own share of a checkpoint)."""
    from moeflow.core.parallel_dims import ParallelDims
    from moeflow.models.transformer import Transformer
    from moeflow.parallel.options import ParallelOptions
    from moeflow.parallel.parallelize import parallelize

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=32,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=32, first_k_dense=1)).validate()
    with torch.device(built_on):
        model = Transformer(cfg)
    parallelize(model, ParallelDims(1), ParallelOptions(compile=True, autocast_dtype=autocast_dtype,
                                                        device_type="cpu"))
    assert model.layers["1"].feed_forward.experts.impl == impl
    torch._dynamo.reset()


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


def test_router_scores_in_fp32_under_bf16_autocast():
    """Routing stays fp32 under autocast (a bf16 gate matmul rounds the logits: ~3 significant digits)."""
    moe = _make_moe(seed=3, dim=64, num_experts=16, top_k=4)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    plain = moe.router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = moe.router(x)
    assert under.topk_weights.dtype == torch.float32
    assert torch.equal(under.topk_idx, plain.topk_idx)
    assert torch.equal(under.topk_weights, plain.topk_weights)


@pytest.mark.parametrize("pad_to_capacity", [False, True])
def test_experts_run_in_the_autocast_dtype(pad_to_capacity):
    """Under bf16 autocast the expert matmuls take bf16 (autocast does not cover torch._grouped_mm on a CPU); the
    block's output keeps the input's dtype, and it is close to the fp32 block (bf16 rounding only)."""
    kw = dict(capacity_factor=2.0, pad_to_capacity=True) if pad_to_capacity else {}
    moe = _make_moe(seed=5, dim=64, num_experts=8, top_k=2, **kw)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(6))
    seen = []
    moe.experts.register_forward_hook(lambda _m, inputs, out: seen.append((inputs[0].dtype, out.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert y.dtype == torch.float32
    y32 = moe(x)
    rel = float((y - y32).norm().detach() / y32.norm().detach())
    assert 0 < rel < 1e-2, rel  # bf16 keeps ~3 significant digits: the roundings show, and nothing else


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
        assert_same_up_to_order(y, want, D + Fh, impl)
        (y * grad_out).sum().backward()
        for w in ws:
            assert w.grad is not None  # zero rows still give (zero) expert gradients
        results[impl] = [x.grad] + [w.grad for w in ws]
    reduction = 2 * (D + Fh) + sum(counts)  # backward adds the input's sums and a weight's sum over the rows
    for impl in ("bmm", "loop"):
        for a, b in zip(results["grouped_mm"], results[impl]):
            assert_same_up_to_order(a, b, reduction, impl)
    for e, c in enumerate(counts):  # an expert with no rows has exactly zero gradient
        if c == 0:
            assert all(results["grouped_mm"][i][e].abs().sum() == 0 for i in (1, 2, 3))
    if sum(counts):  # and the gradient of a used expert matches autograd through the naive loop
        ws = [w.clone().requires_grad_(True) for w in base_w]
        (_naive_experts(base_x, counts, *ws) * grad_out).sum().backward()
        for a, w in zip(results["loop"][1:], ws):
            assert_same_up_to_order(a, w.grad, reduction, "naive")


@pytest.mark.parametrize("impl", ["grouped_mm", "bmm", "loop", "aligned"])
def test_expert_impls_take_a_static_tail(impl):
    """A static receive size hands the experts more rows than the counts cover (the tail is masked out by the
    combine): every path computes the counted rows as the naive loop does, and bmm / loop give the tail zeros."""
    E, D, Fh, counts, tail = 3, 8, 4, [2, 0, 3], 4
    g = torch.Generator().manual_seed(5)
    w = [torch.randn(E, D, Fh, generator=g), torch.randn(E, D, Fh, generator=g), torch.randn(E, Fh, D, generator=g)]
    x = torch.randn(sum(counts) + tail, D, generator=g)
    if impl == "aligned":  # the FP8 path: groups padded to a kernel's alignment first
        experts = GroupedExperts(E, D, Fh, impl="grouped_mm")
        with torch.no_grad():
            for p, v in zip((experts.w1, experts.w3, experts.w2), w):
                p.copy_(v)
        experts.group_alignment = 16
        y = experts(x, torch.tensor(counts))
    else:
        y = expert_matmuls(x, torch.tensor(counts), *w, impl)
    assert y.shape == (sum(counts) + tail, D)
    assert_same_up_to_order(y[:sum(counts)], _naive_experts(x[:sum(counts)], counts, *w), D + Fh, impl)
    if impl in ("bmm", "loop"):
        assert y[sum(counts):].abs().sum() == 0


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


def test_explicit_grouped_mm_with_misaligned_rows_is_refused_by_name():
    """expert_impl = 'grouped_mm' with rows torch's kernel rejects (12 bf16 = 24 bytes) says what to change."""
    experts = GroupedExperts(2, 16, 12, impl="grouped_mm")
    x = torch.randn(4, 16).bfloat16()
    with pytest.raises(ValueError, match="expert_impl = 'grouped_mm'.*ffn_dim 12.*'auto'"):
        experts(x, torch.tensor([1, 3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_autograds_composition_bit_for_bit_saving_less(dtype):
    """The experts' SwiGLU gives silu(h1) * h3 and its gradients exactly as autograd composes them, and saves only
    its inputs for backward (autograd's composition keeps silu(h1) too)."""
    from moeflow.models.moe import _swiglu

    gen = torch.Generator().manual_seed(0)
    h1, h3, grad = (torch.randn(37, 24, generator=gen).to(dtype) for _ in range(3))

    def run(fn):
        a, b = h1.clone().requires_grad_(), h3.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.data_ptr()) or t, lambda t: t):
            y = fn(a, b)
        y.backward(grad)
        return y, a.grad, b.grad, len(set(saved))

    *want, saved_by_autograd = run(lambda a, b: torch.nn.functional.silu(a) * b)
    *got, saved = run(_swiglu)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert (saved, saved_by_autograd) == (2, 3)
