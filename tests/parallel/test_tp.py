"""Tensor + sequence parallelism over gloo: every layout against the same model unparallelized, in fp32.

One launch per world size runs every case (tests/parallel/tp_worker.py). World 2, tp=2: moeflow dense (GQA, qk_norm
per_head and full, tied embeddings), the tiny MoE (aux and z losses), pipeline stages, Hugging Face Llama, Qwen3
and Qwen3-MoE with moeflow MoE blocks, the vocab-parallel loss, bad input. World 4: tp=2 x dp=2 with FSDP2, and
tp=2 x ep=2."""

from __future__ import annotations

import pytest

from tests.parallel import tp_worker
from tests.support.dist_harness import check_results


def test_world1_tp1_is_a_noop_and_loss_is_cross_entropy():
    cases = [("tp=1 no-op", tp_worker.case_tp1_noop,
        {}), ("plain loss and grad norm", tp_worker.case_plain_loss_and_norm, {}),
             ("parallelize adds no attributes, world 1", tp_worker.case_parallelize_adds_no_attributes, {})]
    check_results([tp_worker.run_inline(cases)], cases)


@pytest.mark.timeout(180)
def test_world2_tp2():
    cases = [
        ("vocab-parallel loss", tp_worker.case_loss, {}),
        ("bad input", tp_worker.case_bad_inputs, {}),
        ("dense, GQA, qk_norm per_head, tied", tp_worker.case_moeflow, dict(kind="dense")),
        ("dense, qk_norm full", tp_worker.case_moeflow, dict(kind="dense", qk_norm="full", tie_embeddings=False)),
        ("tiny MoE", tp_worker.case_moeflow, dict(kind="moe")),
        ("MoE grads equal over tp", tp_worker.case_moe_grads_equal_over_tp, {}),
        ("pipeline stages", tp_worker.case_pipeline_stages, {}),
        ("HF Llama", tp_worker.case_hf, dict(arch="llama")),
        ("HF Qwen3", tp_worker.case_hf, dict(arch="qwen3")),
        ("HF Qwen3-MoE, moeflow MoE blocks", tp_worker.case_hf, dict(arch="qwen3_moe")),
        ("tp=1 dim of a mesh", tp_worker.case_tp1_noop, {}),
        ("HF Llama through moeflow.parallelize, tp=2", tp_worker.case_hf_parallelize, dict(arch="llama", tp=2)),
        ("HF Qwen3-MoE through moeflow.parallelize, ep=2", tp_worker.case_hf_parallelize, dict(arch="qwen3_moe", ep=2)),
        ("HF gpt-oss (its own experts, sinks) through moeflow.parallelize, tp=2, MoE folded over tp",
         tp_worker.case_hf_parallelize, dict(arch="gpt_oss", tp=2)),
        ("HF gpt-oss through moeflow.parallelize, tp=2, MoE whole on each tp rank", tp_worker.case_hf_parallelize,
         dict(arch="gpt_oss", tp=2, ep_over_tp=False)),
        ("HF DeepSeek-V3 (latent attention: q and kv latents whole per rank, heads sharded), tp=2",
         tp_worker.case_hf_parallelize, dict(arch="deepseek_v3", tp=2)),
        ("HF DeepSeek-V3 without a q latent (q_proj column-sharded), tp=2", tp_worker.case_hf_parallelize,
         dict(arch="deepseek_v3-no-q-lora", tp=2)),
        ("parallelize adds no attributes, world 2", tp_worker.case_parallelize_adds_no_attributes, {}),
        ("HF Qwen3-Next: its linear attention whole on each tp rank, gradients averaged over tp",
         tp_worker.case_whole_mixer_grads_averaged, {}),
    ]
    check_results(tp_worker.launch(2, cases), cases)


@pytest.mark.slow  # 23 s: make test runs it, CI does not (test_world2_tp2 does)
@pytest.mark.timeout(240)
def test_world4_tp2_with_fsdp2_and_ep():
    cases = [
        ("tiny MoE, tp=2 x dp=2, FSDP2, activation checkpointing", tp_worker.case_moeflow,
         dict(kind="moe", dp=2, checkpointing="full")),
        ("dense, tied, tp=2 x dp=2, FSDP2", tp_worker.case_moeflow, dict(kind="dense", dp=2)),
        ("tiny MoE, tp=2 x ep=2", tp_worker.case_tp_with_ep, {}),
        ("HF Qwen3-MoE through moeflow.parallelize, tp=2 x ep=2", tp_worker.case_hf_parallelize,
         dict(arch="qwen3_moe", tp=2, ep=2)),
        ("HF gpt-oss (its own experts) through moeflow.parallelize, tp=2 x ep=2", tp_worker.case_hf_parallelize,
         dict(arch="gpt_oss", tp=2, ep=2)),
        ("HF gpt-oss through moeflow.parallelize, tp=2 x ep=2, MoE whole on each tp rank",
         tp_worker.case_hf_parallelize, dict(arch="gpt_oss", tp=2, ep=2, ep_over_tp=False)),
    ]
    check_results(tp_worker.launch(4, cases), cases)


def test_an_embedding_that_norms_its_rows_runs_whole():
    """The tp plan of an embedding that norms each looked-up row (Inkling's, with a weight; one without a weight, as
    MuseSpark's) is WholeEmbedding: a vocab-sharded lookup would norm partial rows before they are summed; a plain
    embedding stays vocab-sharded (RowwiseParallel)."""
    import torch
    from torch.distributed.tensor.parallel import RowwiseParallel

    from moeflow.parallel.tensor import WholeEmbedding, tp_plan
    from tests.support.hf_tiny import tiny_model

    model = tiny_model("inkling")
    assert isinstance(tp_plan(model)["model.embed_tokens"], WholeEmbedding)
    model.model.embed_tokens.embed_norm = torch.nn.RMSNorm(model.config.hidden_size, elementwise_affine=False)
    assert isinstance(tp_plan(model)["model.embed_tokens"], WholeEmbedding)
    assert type(tp_plan(tiny_model("gpt_oss"))["model.embed_tokens"]) is RowwiseParallel


def test_a_layer_holding_its_parts_in_lists_is_planned_item_by_item():
    """LongCat-Flash's layer holds two latent attentions, two dense MLPs and their norms in ModuleLists beside its
    MoE: the plan shards each attention by heads and each MLP as a dense FFN (none left whole or replicated), runs
    each norm sequence-parallel, and folds the MoE; a model applying its own parameters outside its modules (Zaya)
    gets them replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from moeflow.parallel.tensor import LocalTokens, PartialGradColwise, ReplicatedParameters, tp_plan
    from tests.support.hf_tiny import tiny_model

    plan = tp_plan(tiny_model("longcat_flash"), fold_experts=True)
    for i in (0, 1):
        assert isinstance(plan[f"model.layers.*.self_attn.{i}.kv_b_proj"], PartialGradColwise)
        assert isinstance(plan[f"model.layers.*.self_attn.{i}.o_proj"], RowwiseParallel)
        assert isinstance(plan[f"model.layers.*.mlps.{i}.gate_proj"], ColwiseParallel)
        assert isinstance(plan[f"model.layers.*.mlps.{i}.down_proj"], RowwiseParallel)
        assert isinstance(plan[f"model.layers.*.input_layernorm.{i}"], SequenceParallel)
    assert isinstance(plan["model.layers.*.mlp"], LocalTokens)
    assert isinstance(tp_plan(tiny_model("zaya"))["model"], ReplicatedParameters)


def test_a_layer_that_computes_its_moe_itself_runs_on_its_sequence_slice():
    """Gemma 4's layer calls its router and experts on `residual.reshape(-1, D)` in its own forward: the plan runs
    the layer on the tp rank's tokens, its attention and dense MLP gather the sequence and hand back local rows, its
    norms and router are per-token parts (gradients summed over tp), its experts take no style (expert parallelism
    spreads them). Unfolded (every tp rank running the whole MoE), it has no built-in plan: one line naming the fix."""
    import pytest
    from torch.distributed.tensor.parallel import RowwiseParallel

    from moeflow.parallel.tensor import LocalTokens, PerTokenPart, tp_plan
    from tests.support.hf_tiny import tiny_model

    model = tiny_model("gemma4")
    plan = tp_plan(model, fold_experts=True)
    assert type(plan["model.layers.*"]) is LocalTokens
    for down in ("self_attn.o_proj", "mlp.down_proj"):
        style = plan[f"model.layers.*.{down}"]
        assert isinstance(style, RowwiseParallel) and style.use_local_output
    assert isinstance(plan["model.layers.*.pre_feedforward_layernorm_2"], PerTokenPart)
    assert isinstance(plan["model.layers.0.router"], PerTokenPart)
    assert not any(pattern.endswith("experts") for pattern in plan)
    with pytest.raises(ValueError, match=r"^Gemma4ForCausalLM: its layers compute their MoE in their own forward "
                                         r"\(no MoE block to hand the sequence slice\), which runs on each tp "
                                         r"rank's tokens only with the MoE folded over tp; set "
                                         r"parallel.ep_over_tp = true$"):
        tp_plan(model, fold_experts=False)
    del model.model.layers[1].experts  # one layer computes an MoE, the other not: no built-in plan
    with pytest.raises(ValueError, match=r"^Gemma4ForCausalLM: its layers compute their MoE in their own forward "
                                         r"\(no MoE block to hand the sequence slice\), and only some of them do; "
                                         r"pass a plan"):
        tp_plan(model, fold_experts=True)
