"""Balance losses and drop policies of the MoE layer: DeepSeek-V3's sequence-wise loss and Qwen3's global-batch loss
against hand-worked examples from the papers' formulas, the global loss's deferred gradient, the `probs` drop policy
against a per-expert sort, padding to capacity and to kernel alignment against the unpadded layer. Under parallel
layouts both losses (with multi-token prediction on) equal one process: tests/parallel/test_layouts_objective.py."""

from __future__ import annotations

import math

import pytest
import torch

import moeflow.models.moe as moe_module
from moeflow.core.model_config import ModelConfig, MoEConfig
from moeflow.models.moe import MoE, Router, pad_groups
from moeflow.models.transformer import Transformer
from moeflow.parallel.runner import LocalRunner
from tests.support.model_helpers import SMALL
from tests.support.numerics import assert_same_up_to_order

torch.set_num_threads(1)
ALPHA = 0.1

# Six tokens' routing probabilities over E = 4 experts (K = 2), in two sequences of three. With a softmax router and
# logits log(p), the scores are p itself, and so are the renormalised probabilities of the balance losses.
SEQ1 = [[0.4, 0.3, 0.2, 0.1],    # top-2 {0, 1}
        [0.1, 0.5, 0.3, 0.1],    # {1, 2}
        [0.3, 0.2, 0.1, 0.4]]    # {3, 0}
SEQ2 = [[0.6, 0.2, 0.15, 0.05],  # {0, 1}
        [0.5, 0.1, 0.3, 0.1],    # {0, 2}
        [0.1, 0.1, 0.2, 0.6]]    # {3, 2}


def _router(aux_loss_type: str, **moe) -> Router:
    r = Router(4, MoEConfig(num_experts=4, top_k=2, ffn_dim=4, score_func="softmax", load_balance="none",
                            aux_loss_coef=ALPHA, aux_loss_type=aux_loss_type, **moe))
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(4))  # the input row is the logits
    return r


def _logits(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log().float()


def test_sequence_wise_loss_hand_example():
    """DeepSeek-V3 eqs. 17-20 per sequence (T = 3 tokens, N_r = 4, K_r = 2, so f_i = 4/6 * count_i):
    seq 1: counts [2, 2, 1, 1], f = [4/3, 4/3, 2/3, 2/3], P = [0.8, 1.0, 0.6, 0.6] / 3  -> sum f P = 3.2 / 3
    seq 2: counts [2, 1, 2, 1], f = [4/3, 2/3, 4/3, 2/3], P = [1.2, 0.4, 0.65, 0.75] / 3 -> sum f P = (97/30) / 3
    averaged over the two sequences: alpha * (96/90 + 97/90) / 2 = alpha * 193/180."""
    out = _router("sequence")(_logits(*SEQ1, *SEQ2), num_sequences=2)
    assert out.aux_loss.item() == pytest.approx(ALPHA * 193 / 180, rel=1e-6)
    # one sequence at a time gives each sequence's own term
    assert _router("sequence")(_logits(*SEQ1)).aux_loss.item() == pytest.approx(ALPHA * 3.2 / 3, rel=1e-6)
    # the micro-batch loss over the same six tokens differs: counts [4, 3, 3, 2], f = [4/3, 1, 1, 2/3],
    # P = [2.0, 1.4, 1.25, 1.35] / 6 -> (8/3 + 1.4 + 1.25 + 0.9) / 6
    micro = _router("micro_batch")(_logits(*SEQ1, *SEQ2)).aux_loss.item()
    assert micro == pytest.approx(ALPHA * (8 / 3 + 1.4 + 1.25 + 0.9) / 6, rel=1e-6)
    assert abs(micro - ALPHA * 193 / 180) > 1e-3


def test_global_batch_loss_hand_example():
    """Qiu et al. 2025 (arXiv:2501.11873): f from the selections of the whole global batch, here the six tokens
    split over two micro-batches (or ranks): counts [4, 3, 3, 2] of 12, f = 4 * counts / 12 = [4/3, 1, 1, 2/3].
    Each micro-batch's loss is alpha * sum f P with its own P (the sums written out below); their mean equals the
    loss over all six tokens in one forward, as the gradients' averaging over micro-batches and ranks makes it."""
    counts = torch.tensor([4.0, 3.0, 3.0, 2.0])
    losses = []
    for rows, want in ((SEQ1, (4 / 3 * 0.8 + 1.0 + 0.6 + 2 / 3 * 0.6) / 3),
                       (SEQ2, (4 / 3 * 1.2 + 0.4 + 0.65 + 2 / 3 * 0.75) / 3)):
        r = _router("global_batch")
        r.global_selected = counts
        out = r(_logits(*rows))
        assert out.aux_loss.item() == pytest.approx(ALPHA * want, rel=1e-6)
        losses.append(out.aux_loss.item())
    assert sum(losses) / 2 == pytest.approx(ALPHA * (8 / 3 + 1.4 + 1.25 + 0.9) / 6, rel=1e-6)


def _gate_grad(r: Router, x: torch.Tensor, supply=None, num_sequences: int = 1) -> torch.Tensor:
    r.gate.weight.grad = None
    out = r(x, num_sequences=num_sequences)
    if supply is not None:
        r.global_selected = supply  # between forward and backward, as the step runner does
    (out.topk_weights.sum() * 0).backward()  # only the aux loss reaches the gate
    return r.gate.weight.grad.clone()


def test_balance_loss_gradients_match_the_formulas():
    """The gate's gradient from each loss equals autograd of the formula written here; for global_batch with the
    counts known before the forward and with the counts supplied only before the backward (the deferred path)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 4, generator=g)
    r = _router("sequence")
    with torch.no_grad():
        r.gate.weight.copy_(torch.randn(4, 4, generator=g))
    W = r.gate.weight.detach().clone().requires_grad_(True)

    def formula(kind: str, counts=None):
        probs = (x @ W.T).softmax(-1)
        chosen = (x @ W.T).topk(2, -1).indices
        if kind == "sequence":  # three sequences of four tokens
            f = torch.stack([torch.stack([(chosen[4 * b:4 * b + 4] == e).sum() for e in range(4)]) for b in range(3)])
            f = f.float() * 4 / (2 * 4)
            return ALPHA * (f * probs.view(3, 4, 4).mean(1)).sum(-1).mean()
        f = counts / counts.sum() * 4
        return ALPHA * (f * probs.mean(0)).sum()

    formula("sequence").backward()
    torch.testing.assert_close(_gate_grad(r, x, num_sequences=3), W.grad)

    counts = torch.tensor([9.0, 1.0, 5.0, 9.0])  # a whole batch's loads, unlike these 12 tokens'
    W.grad = None
    formula("global", counts).backward()
    known = _router("global_batch")
    known.load_state_dict(r.state_dict())
    known.global_selected = counts
    torch.testing.assert_close(_gate_grad(known, x), W.grad)
    deferred = _router("global_batch")
    deferred.load_state_dict(r.state_dict())
    torch.testing.assert_close(_gate_grad(deferred, x, supply=counts), W.grad)

    late = _router("global_batch")
    late.load_state_dict(r.state_dict())
    with pytest.raises(RuntimeError, match="needs the expert loads of the whole step"):
        _gate_grad(late, x)


def _tiny(aux_loss_type: str, **changes) -> Transformer:
    cfg = ModelConfig(**{**SMALL, "n_layers": 2}, moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=24, aux_loss_coef=0.3,
                                                                 aux_loss_type=aux_loss_type), **changes)
    model = Transformer(cfg)
    model.init_weights(seed=3)
    return model


@pytest.mark.parametrize("aux_loss_type", ["global_batch", "sequence"])
def test_gradient_accumulation_equals_one_forward(aux_loss_type):
    """One process: 4 micro-batches of 2 sequences (global_batch: the counting pass) give the gradient of one forward
    over the 8 (global_batch: counts supplied between forward and backward); micro_batch, the control, does not."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (8, 17), generator=g)
    grads = {}
    for kind in (aux_loss_type, "micro_batch"):
        for n in (1, 4):
            model = _tiny(kind)
            loss_fn = lambda logits, y, reduction="mean": torch.nn.functional.cross_entropy(  # noqa: E731
                logits.flatten(0, 1), y.flatten(), reduction=reduction)
            LocalRunner(model, loss_fn, microbatches=n).train_step(tokens[:, :-1], tokens[:, 1:])
            grads[kind, n] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(grads[aux_loss_type, 4], grads[aux_loss_type, 1], rtol=1e-5, atol=1e-7)
    assert (grads["micro_batch", 4] - grads["micro_batch", 1]).abs().max() > 1e-5


def test_global_batch_loss_under_activation_checkpointing():
    """Recomputed blocks take the counting pass (parallelize sees to it): gradients as without recomputation."""
    from moeflow.core.parallel_dims import ParallelDims
    from moeflow.parallel.options import ParallelOptions
    from moeflow.parallel.parallelize import parallelize

    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(2))
    grads = []
    for ac in ("none", "full"):
        model = _tiny("global_batch")
        state = parallelize(model, ParallelDims(1), ParallelOptions(activation_checkpointing=ac))
        state.runner.train_step(tokens[:, :-1], tokens[:, 1:])
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------- drop policies


def test_probs_drop_policy_equals_a_per_expert_sort():
    """drop_policy 'probs': each expert keeps its `capacity` heaviest assignments (ties to the earlier token)."""
    E, K, T, cf = 4, 2, 20, 0.6
    r = Router(8, MoEConfig(num_experts=E, top_k=K, ffn_dim=4, score_func="sigmoid", load_balance="none",
                            capacity_factor=cf, drop_policy="probs"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        r.gate.weight.copy_(torch.randn(E, 8, generator=g))
    x = torch.randn(T, 8, generator=g)
    x[7] = x[3]  # two identical tokens: equal weights, so the tie rule is exercised
    out = r(x)
    capacity = math.ceil(cf * T * K / E)

    scores = torch.sigmoid(x.double() @ r.gate.weight.detach().double().T).tolist()
    keep = set()
    chosen = [sorted(range(E), key=lambda e: -scores[t][e])[:K] for t in range(T)]
    for e in range(E):
        pairs = [(t, k) for t in range(T) for k in range(K) if chosen[t][k] == e]
        weight = {(t, k): scores[t][e] / sum(scores[t][c] for c in chosen[t]) for t, k in pairs}
        keep |= set(sorted(pairs, key=lambda p: (-weight[p], p[0]))[:capacity])
    want = [[chosen[t][k] if (t, k) in keep else -1 for k in range(K)] for t in range(T)]
    assert out.topk_idx.tolist() == want
    assert out.tokens_per_expert.max().item() <= capacity and (out.topk_idx < 0).any()
    # 'position' keeps the earliest tokens instead, which here is a different set
    r.cfg.drop_policy = "position"
    assert r(x).topk_idx.tolist() != want


def _moe(**moe) -> MoE:
    m = MoE(ModelConfig(**SMALL, moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=24, load_balance="none", **moe)))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _reduction(m: MoE, tokens: int) -> int:
    """The summed reduction lengths on an MoE output's and its gradients' paths: the gate and the first expert
    matmul over dim, the second over ffn_dim, the combine over top_k; backward adds a weight gradient's sum over the
    tokens and the input gradient's sums over ffn_dim and dim."""
    moe = m.router.cfg
    return 2 * SMALL["dim"] + 2 * moe.ffn_dim + moe.top_k + tokens


def _assert_same_up_to_order(a, b, tokens: int, m: MoE) -> None:
    """Padding changes the matmul shapes, hence the BLAS blocking: the same sums in another order."""
    (y_a, grads_a), (y_b, grads_b) = a, b
    assert_same_up_to_order(y_a, y_b, _reduction(m, tokens), "output")
    for name, grad in grads_b.items():
        assert_same_up_to_order(grads_a[name], grad, _reduction(m, tokens), name)


def _run(m: MoE, x: torch.Tensor):
    rows = []
    hook = m.experts.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0]))
    y = m(x)
    y.pow(2).sum().backward()
    hook.remove()
    return y, {n: p.grad for n, p in m.named_parameters()}, rows


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_pad_to_capacity_equals_unpadded(policy):
    """pad_to_capacity: the experts see E * C rows (static) and the layer's output and gradients are unchanged."""
    x = torch.randn(2, 9, SMALL["dim"], generator=torch.Generator().manual_seed(4))
    y, grads, rows = _run(_moe(capacity_factor=0.75, drop_policy=policy), x)
    y_pad, grads_pad, rows_pad = _run(_moe(capacity_factor=0.75, drop_policy=policy, pad_to_capacity=True), x)
    _assert_same_up_to_order((y_pad, grads_pad), (y, grads), 18, _moe())
    assert rows_pad == [4 * math.ceil(0.75 * 18 * 2 / 4)] and rows[0] < rows_pad[0]


def test_expert_groups_padded_to_kernel_alignment(monkeypatch):
    counts = torch.tensor([3, 0, 17, 1])
    x = torch.randn(21, 5)
    padded, counts_pad, rows = pad_groups(x, counts, 16)
    assert all(c % 16 == 0 for c in counts_pad.tolist()) and padded.shape[0] == counts_pad.sum()
    # each expert's rows, in order, at the start of its padded group; zeros elsewhere
    starts = [0, 16, 16, 48]
    want = torch.zeros_like(padded)
    for e, (s, n) in enumerate(zip(starts, counts.tolist())):
        want[s:s + n] = x[counts[:e].sum():counts[:e].sum() + n]
    torch.testing.assert_close(padded, want)
    torch.testing.assert_close(padded.index_select(0, rows), x)

    m = _moe()
    y, grads, _ = _run(m, torch.randn(10, SMALL["dim"], generator=torch.Generator().manual_seed(6)))
    aligned = _moe()
    aligned.experts.group_alignment = 16
    seen = []  # the groups the expert matmuls receive: padded, whatever the routing gave
    real = moe_module.expert_matmuls
    monkeypatch.setattr(moe_module, "expert_matmuls", lambda x, c, *a: seen.append(c.tolist()) or real(x, c, *a))
    y16, grads16, _ = _run(aligned, torch.randn(10, SMALL["dim"], generator=torch.Generator().manual_seed(6)))
    assert seen and all(c % 16 == 0 for counts in seen for c in counts)
    _assert_same_up_to_order((y16, grads16), (y, grads), 10, m)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="aux_loss_type = 'global'.*Did you mean 'global_batch'"):
        ModelConfig(moe=MoEConfig(aux_loss_type="global")).validate()
    with pytest.raises(ValueError, match="pad_to_capacity = true needs a capacity"):
        ModelConfig(moe=MoEConfig(pad_to_capacity=True)).validate()
    with pytest.raises(ValueError, match="drop_policy"):
        ModelConfig(moe=MoEConfig(drop_policy="random")).validate()
    from moeflow.core.parallel_dims import ParallelDims

    with pytest.raises(ValueError, match="pad_to_capacity with expert parallelism"):
        ParallelDims(2, ep=2).check_model(ModelConfig(moe=MoEConfig(capacity_factor=1.0, pad_to_capacity=True)))
