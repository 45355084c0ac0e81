"""Expert parallelism of transformers' own experts modules (moeflow/parallel/hf_experts.py), against transformers'
own model in one process on the whole batch: two gloo ranks, each with one sequence, give that sequence's logits,
the local slice of every expert gradient and (summed over the ranks) every other gradient.

Qwen3-MoE (concatenated gate/up, no bias, one expert per token) and gpt-oss (interleaved gate/up, transposed
weights, biases, clamped SwiGLU, attention sinks, sliding windows) cover the experts interface's variants."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from moeflow.parallel.hf_experts import EXPERT_TENSORS, apply_hf_expert_parallel, hf_experts_modules  # noqa: E402
from tests.support.dist_harness import check_results, launch  # noqa: E402
from tests.support.hf_models import V, hf_configs, randomize  # noqa: E402
from tests.support.numerics import assert_same_up_to_order  # noqa: E402

S = 12  # tokens per sequence
# The summed reduction lengths along a logit's path in these tiny models (2-3 layers of widths <= 64, attention
# over S, the vocabulary): under 1,000, so 1,000 x fp32 eps bounds a difference in summation order alone.
REDUCTION = 1000


def _config(arch: str):
    if arch == "gpt_oss":
        return transformers.GptOssConfig(
            vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"])
    return hf_configs()[arch]


def case_matches_one_process(arch: str, chunks: int = 1, overlap: bool | None = None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same weights and batch on every rank
    cfg = _config(arch)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float()
    randomize(ref, seed=1)
    model = copy.deepcopy(ref)
    ids = torch.randint(0, V, (world, S))
    probe = torch.randn(world, S, V)  # a linear loss: every logit's gradient is nonzero
    logits_ref = ref(ids).logits
    (logits_ref * probe).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ref.parameters() if p.requires_grad)

    assert apply_hf_expert_parallel(model, chunks=chunks, overlap=overlap) == len(hf_experts_modules(ref))
    logits = model(ids[rank:rank + 1]).logits
    (logits * probe[rank:rank + 1]).sum().backward()
    assert_same_up_to_order(logits, logits_ref[rank:rank + 1], REDUCTION, "logits")
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if name.rsplit(".", 1)[-1] in EXPERT_TENSORS:
            L = q.shape[0] // world
            assert p.shape[0] == L, name
            assert_same_up_to_order(p.grad, q.grad[rank * L:(rank + 1) * L], REDUCTION, name)
        else:  # replicated: this rank's tokens' share, summed as data parallelism would
            dist.all_reduce(p.grad)
            assert_same_up_to_order(p.grad, q.grad, REDUCTION, name)


def case_parallelize_trains_as_one_process(arch: str, zero: int, steps: int = 2, **options) -> None:
    """moeflow.parallelize(ep=2, ZeRO) on the model object: FSDP2 shards the replicated weights over the two
    ranks, each keeps its experts; losses, the global gradient norm and every parameter after AdamW steps equal one
    process on the whole batch."""
    import moeflow
    from moeflow.parallel.grads import clip_grad_norm_

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(arch)).float()
    randomize(ref, seed=1)
    state = moeflow.parallelize(copy.deepcopy(ref), moeflow.ParallelDims(world, ep=world, zero=zero),
                                moeflow.ParallelOptions(**options))
    par = state.model
    ids = torch.randint(0, V, (world, S + 1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    loss_of = lambda m, rows: torch.nn.functional.cross_entropy(m(inputs[rows]).logits.flatten(0, 1),
                                                              targets[rows].flatten())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(steps):
        ref_loss = loss_of(ref, slice(0, world))
        ref_loss.backward()
        par_loss = loss_of(par, slice(rank, rank + 1))
        par_loss.backward()
        mean = par_loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=1e-5, atol=0, msg=f"loss at {step}")
        want = torch.stack([p.grad.pow(2).sum() for p in ref.parameters()]).sum().sqrt()
        torch.testing.assert_close(clip_grad_norm_(par, float("inf"), state), want, rtol=1e-5, atol=0,
                                   msg=f"grad norm at {step}")
        for opt in (opt_ref, opt_par):
            opt.step()
            opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        got = p.full_tensor() if hasattr(p, "full_tensor") else p
        want = ref_params[name]
        if name.rsplit(".", 1)[-1] in EXPERT_TENSORS:
            L = want.shape[0] // world
            want = want[rank * L:(rank + 1) * L]
        # norm-wise, as every whole-run comparison (docs/design.md, Tolerances): AdamW's g / sqrt(v) turns a
        # near-zero gradient element's rounding into a whole lr-sized step either way
        err = float((got.detach() - want.detach()).norm() / want.detach().norm())
        assert err <= 1e-5, f"{name} after {steps} steps: relative error {err:.3g}"


def case_experts_that_do_not_split_are_refused() -> None:
    def tiny(experts: int):
        return transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(
            vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, num_experts=experts, num_experts_per_tok=1, moe_intermediate_size=16))

    model = tiny(3)
    before = [p.shape for p in model.parameters()]
    with pytest.raises(ValueError, match=r"parallel.ep = 2 does not divide the 3 experts of Qwen3MoeExperts"):
        apply_hf_expert_parallel(model)
    # and through parallelize, by the adapter's check before anything is wrapped
    import moeflow

    with pytest.raises(ValueError, match=r"parallel.ep = 2 does not divide the 3 experts of Qwen3MoeForCausalLM"):
        moeflow.parallelize(model, moeflow.ParallelDims(2, ep=2))
    assert [p.shape for p in model.parameters()] == before  # nothing changed
    # static receive sizes: transformers' experts run on the pairs each dispatch counts
    with pytest.raises(ValueError, match=r"parallel.ep_num_worst_tokens = -1 on transformers' own experts modules"):
        moeflow.parallelize(tiny(4), moeflow.ParallelDims(2, ep=2), moeflow.ParallelOptions(ep_num_worst_tokens=-1))


def _run(_, case) -> None:
    name, fn, kwargs = case
    fn(**kwargs)


@pytest.mark.slow  # 16 s: make test runs it; CI has ep=2 on transformers' experts in tests/e2e/test_hf_coverage.py
@pytest.mark.timeout(180)
def test_hf_experts_under_ep2_equal_one_process():
    cases = [("qwen3_moe", case_matches_one_process, dict(arch="qwen3_moe")),
             ("gpt_oss", case_matches_one_process, dict(arch="gpt_oss")),
             ("mixtral", case_matches_one_process, dict(arch="mixtral")),
             ("parallelize gpt_oss ep=2 zero=3", case_parallelize_trains_as_one_process, dict(arch="gpt_oss", zero=3)),
             # not qwen3_moe's tiny config: its one expert per token with normalised weights gives the router a
             # zero gradient, whose rounding noise AdamW turns into lr-sized steps either way
             ("parallelize mixtral ep=2 zero=1", case_parallelize_trains_as_one_process, dict(arch="mixtral", zero=1)),
             # the tokens in chunks, each chunk's dispatch and combine started asynchronously or not
             ("gpt_oss 2 chunks, overlap", case_matches_one_process, dict(arch="gpt_oss", chunks=2, overlap=True)),
             # (not qwen3_moe's tiny config, whose router gradient is zero up to rounding: see below)
             ("mixtral 3 chunks", case_matches_one_process, dict(arch="mixtral", chunks=3, overlap=False)),
             ("parallelize mixtral 2 chunks, overlap", case_parallelize_trains_as_one_process,
              dict(arch="mixtral", zero=3, ep_chunks=2, ep_overlap=True)),
             ("3 experts over 2 ranks refused", case_experts_that_do_not_split_are_refused, {})]
    check_results(launch(2, cases, _run), cases)
