"""Context parallelism of transformers' own attention modules (moeflow/parallel/hf_context.py) against
transformers' model in one process on the whole batch, four gloo ranks in one launch:

- gpt-oss at cp = 4 (sequences of 16 in 8 chunks of 2): a sliding window of 3 on every other layer, which
  reaches across chunk boundaries, and attention sinks - the written-out masked path;
- Mixtral with a window of 5 at cp = 2 x ep = 2, its experts split over ranks that hold different chunks;
- Mixtral at cp = 4 under bf16 autocast with a window some ranks' queries never reach (two paths, one gather);
- DeepSeek-V3 at cp = 2 x tp = 2 (latent attention, keys wider than values; sequence parallelism inside each
  chunk, the MoE folded over tp), the plain causal path;
each trains two AdamW steps with the one-process losses and gradient norms. The refusals are checked alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from tests.support.dist_harness import check_results, launch  # noqa: E402
from tests.support.hf_models import V, hf_configs, randomize  # noqa: E402

S = 16


def _config(arch: str, window: int = 5):
    if arch == "gpt_oss":
        return transformers.GptOssConfig(
            vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
            max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"])
    if arch == "mixtral":
        cfg = hf_configs()["mixtral"]
        cfg.sliding_window = window
        return cfg
    return hf_configs()[arch]


def case_trains_as_one_process(arch: str, steps: int = 2, window: int = 5, bf16: bool = False, **sizes) -> None:
    import moeflow
    from moeflow.parallel.grads import clip_grad_norm_

    world = dist.get_world_size()
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(arch, window)).float()
    randomize(ref, seed=1)
    dims = moeflow.ParallelDims(world, zero=3, **sizes)
    options = moeflow.ParallelOptions(autocast_dtype=torch.bfloat16 if bf16 else None)
    autocast = options.autocast()
    state = moeflow.parallelize(copy.deepcopy(ref), dims, options)
    rtol = 2e-2 if bf16 else 1e-5  # bf16: each side rounds its own way
    ids = torch.randint(0, V, (2 * dims.dp, S + 1))
    rows = slice(2 * state.dp_rank, 2 * state.dp_rank + 2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt_par = torch.optim.AdamW(state.model.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(steps):
        with autocast():
            logits = ref(ids[:, :-1]).logits.float()
        ref_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        ref_loss.backward()
        # the trainer's scale: (dp x cp) / the targets of the global batch; each rank's loss is then its share
        scale = dims.dp * dims.cp / ids[:, 1:].numel()
        loss = state.runner.train_step(state.local_sequence(ids[rows, :-1]), state.local_sequence(ids[rows, 1:]),
                                       loss_scale=scale)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        # the tp ranks of one (dp, cp) rank hold the same loss
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=rtol, atol=0, msg=f"loss at {step}")
        want = torch.stack([p.grad.pow(2).sum() for p in ref.parameters()]).sum().sqrt()
        torch.testing.assert_close(clip_grad_norm_(state.model, float("inf"), state), want, rtol=rtol, atol=0,
                                   msg=f"grad norm at {step}")
        for opt in (opt_ref, opt_par):
            opt.step()
            opt.zero_grad()


def _run(_, case) -> None:
    name, fn, kwargs = case
    fn(**kwargs)


@pytest.mark.timeout(240)
def test_hf_context_parallel_layouts_equal_one_process():
    cases = [("gpt_oss cp=4 windows and sinks", case_trains_as_one_process, dict(arch="gpt_oss", cp=4)),
             ("mixtral cp=2 x ep=2 window", case_trains_as_one_process, dict(arch="mixtral", cp=2, ep=2)),
             ("deepseek_v3 cp=2 x tp=2", case_trains_as_one_process, dict(arch="deepseek_v3", cp=2, tp=2)),
             # a window of 13 at cp = 4: rank 3's queries (positions 6-9) see plain causal attention (the chunked
             # path), rank 0's (0, 1, 14, 15) a window (the masked path); under bf16 both gather bf16 keys
             ("mixtral cp=4 window 13 bf16", case_trains_as_one_process, dict(arch="mixtral", cp=4, window=13,
                                                                             bf16=True))]
    check_results(launch(4, cases, _run, timeout_s=200), cases)


def test_architectures_whose_attention_cannot_be_split_are_refused_in_one_line():
    from moeflow.parallel.hf_context import hf_context_refusal
    from tests.support.hf_tiny import tiny_model, with_unknown_layer_kind

    assert hf_context_refusal(tiny_model("gpt_oss")) is None
    assert hf_context_refusal(tiny_model("jamba")) is None  # its Mamba mixers run whole on every cp rank
    assert hf_context_refusal(tiny_model("glm_moe_dsa")) is None  # its indexer's attention runs whole
    assert hf_context_refusal(tiny_model("zaya")) is None  # its hybrid layers' mixers run whole
    assert hf_context_refusal(tiny_model("inkling2")) == (
        "Inkling2ForCausalLM: its hybrid_sliding layer 0 has mlp_input, self_attn, post_attention_convolution, "
        "post_mlp_convolution beside its FFN, where context parallelism runs whole one sequence mixer, or several "
        "that each take the hidden states; use cp = 1")  # mlp_input attends over the earlier layers' states
    assert hf_context_refusal(tiny_model("deepseek_v4")) is None  # its compressed attention runs whole
    assert hf_context_refusal(with_unknown_layer_kind()).startswith(
        "Qwen3NextForCausalLM: its sparse_attention layers are neither full, sliding-window or chunked attention, "
        "which context parallelism splits here, nor linear attention, convolutions or indexed attention")
    assert hf_context_refusal(tiny_model("kolibri1_1")) == (
        "Kolibri1_1ForCausalLM: its layers hand each other more than the hidden states, and some run whole on every "
        "cp rank while others split the sequence; use cp = 1")
    model = tiny_model("qwen3_next")
    linear = model.config.layer_types.index("linear_attention")
    model.model.layers[linear].gate = torch.nn.Linear(4, 4)  # a second part beside the mixer: which runs whole?
    assert hf_context_refusal(model) == (f"Qwen3NextForCausalLM: its linear_attention layer {linear} has linear_attn, "
                                         f"gate beside its FFN, where context parallelism runs whole one sequence "
                                         f"mixer, or several that each take the hidden states; use cp = 1")
