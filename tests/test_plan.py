"""moeflow.plan: memory formulas against hand-worked numbers, published parameter counts and layouts,
the chart's regimes, HF config.json mapping, bad input, and the `plan` CLI."""

from __future__ import annotations

import json

import pytest

from moeflow.hardware import get_gpu
from moeflow.models.config import ModelConfig, MoEConfig
from moeflow.models.hf_arch import config_from_hf
from moeflow.models.presets import PUBLISHED, get_preset
from moeflow.plan.advice import advise
from moeflow.plan.cli import load_model, plan
from moeflow.plan.cli import main as plan_main
from moeflow.plan.layout import Job, Layout
from moeflow.plan.memory import layer_activation_bytes, memory_per_gpu
from moeflow.plan.search import Constraints, evaluate, search
from moeflow.plan.time import ring_time, step_time

# vocab 100, dim 8, 2 layers, 2 heads, ffn 16. By hand: embeddings + head 2*100*8 = 1600, final norm 8,
# per layer: norms 2*8 + attention q,k,v,o 4*8*8 = 256 + SwiGLU 3*8*16 = 384 -> 656; total 2920.
HAND = ModelConfig(vocab_size=100, dim=8, n_layers=2, n_heads=2, ffn_dim=16, max_seq_len=64)
HAND_PARAMS = 2920


def job_for(cfg, gpu="H100-80GB", nodes=1, gpn=8, seq=64, batch=64 * 64, **kw):
    return Job(cfg, get_gpu(gpu), nodes, gpn, seq, batch, **kw)


def lay(dp_shard=1, tp=1, pp=1, ep=1, zero=1, mb=1, ac="selective", dp_replicate=1):
    return Layout(dp_replicate, dp_shard, tp, pp, ep, zero, mb, ac)


def test_hand_model_param_count():
    assert HAND.num_params() == HAND_PARAMS


@pytest.mark.parametrize("zero,params,grads,opt", [
    # ZeRO (Rajbhandari et al. 2020, Fig. 1): 2Ψ + 2Ψ + 12Ψ, sharding 12Ψ / 2Ψ grads / 2Ψ params over N_d=4
    (1, 2 * HAND_PARAMS, 2 * HAND_PARAMS, 12 * HAND_PARAMS / 4),
    (2, 2 * HAND_PARAMS, 2 * HAND_PARAMS / 4, 12 * HAND_PARAMS / 4),
    (3, 2 * HAND_PARAMS / 4, 2 * HAND_PARAMS / 4, 12 * HAND_PARAMS / 4),
])
def test_zero_stages_hand_worked(zero, params, grads, opt):
    mem = memory_per_gpu(job_for(HAND, gpn=4), lay(dp_shard=4, zero=zero))
    assert mem["params"] * 1e9 == pytest.approx(params)
    assert mem["grads"] * 1e9 == pytest.approx(grads)
    assert mem["optimizer"] * 1e9 == pytest.approx(opt)


def test_moe_experts_split_over_ep_and_hsdp_replicates():
    # 1 MoE layer, E=4 experts of width 8: routed 4*3*8*8 = 768 params; rest as HAND's layer minus its FFN
    cfg = ModelConfig(vocab_size=100, dim=8, n_layers=1, n_heads=2, ffn_dim=16, max_seq_len=64,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=8))
    routed = 4 * 3 * 8 * 8
    dense = cfg.num_params() - routed  # 1600 + 8 + 16 + 256 + router 8*4 = 1912
    assert dense == 1912
    mem = memory_per_gpu(job_for(cfg, gpn=4), lay(dp_shard=4, ep=2, zero=1))
    assert mem["params"] * 1e9 == pytest.approx(2 * (dense + routed / 2))
    # optimizer: dense sharded over 4, each expert's state over the 4/2 = 2 ranks holding that expert
    assert mem["optimizer"] * 1e9 == pytest.approx(12 * (dense / 4 + routed / 2 / 2))
    # HSDP: dp_replicate copies do not shard further
    mem2 = memory_per_gpu(job_for(cfg, gpn=8), lay(dp_shard=4, ep=2, zero=1, dp_replicate=2))
    assert mem2["optimizer"] == pytest.approx(mem["optimizer"])


def test_activation_formula_korthikanti():
    # Korthikanti et al. 2022 Table 2 for a GPT layer (FFN 4h): sbh(34 + 5as/h)/t, 34 sbh/t, 2 sbh/t
    h, a, s, b, t = 1024, 16, 2048, 2, 2
    cfg = ModelConfig(vocab_size=100, dim=h, n_layers=1, n_heads=a, ffn_dim=4 * h)
    assert layer_activation_bytes(cfg, 4 * h, s, b, t, "none") == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    assert layer_activation_bytes(cfg, 4 * h, s, b, t, "selective") == pytest.approx(34 * s * b * h / t)
    assert layer_activation_bytes(cfg, 4 * h, s, b, t, "full") == pytest.approx(2 * s * b * h / t)


def test_time_formulas():
    assert ring_time(1e9, 4, 2.0, 100, 0.0) == pytest.approx(2 * 3 / 4 * 1e9 / 100e9)  # ring all-reduce
    assert ring_time(1e9, 1, 2.0, 100, 1.0) == 0.0
    job = job_for(HAND, gpn=8, seq=64, batch=64 * 16)
    t = step_time(job, lay(dp_shard=2, pp=2, zero=1, mb=1, ac="none"))  # dp=2 -> m = 16/2 = 8
    assert t["bubble_fraction"] == pytest.approx((2 - 1) / (8 + 2 - 1))  # (p-1)/(m+p-1)
    full = step_time(job, lay(dp_shard=2, pp=2, mb=1, ac="full"))
    assert full["compute_s"] == pytest.approx(t["compute_s"] * 4 / 3)  # one extra forward: 8N vs 6N


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_counts(name):
    total, active = PUBLISHED[name]
    cfg = get_preset(name)
    assert cfg.num_params() == pytest.approx(total, rel=0.02)
    assert cfg.num_active_params() == pytest.approx(active, rel=0.02)


def test_deepseek_v3_published_layout_fits():
    # DeepSeek-V3 Technical Report (arXiv:2412.19437) sec. 3.2: 16-way PP, 64-way EP across 8 nodes,
    # ZeRO-1 data parallelism, no TP, on 2048 H800 (80 GB); seq 4096, batch 15360 sequences (sec. 4.2).
    job = job_for(get_preset("deepseek-v3"), "H800", 256, 8, 4096, 15360 * 4096)
    r = evaluate(job, lay(dp_shard=128, pp=16, ep=64, zero=1, mb=1, ac="selective"))
    assert r.feasible, r.reason
    assert r.memory_gb["total"] <= 80
    # ... and it is among the layouts the full search finds feasible; the search picks an MoE-aware tool
    out = plan(job, Constraints(pp=16, tp=1), top=3)
    assert out["recommendation"]["family"] == "megatron"
    assert any(row["ep"] > 1 for row in out["layouts"] if row["feasible"])


def test_llama3_70b_needs_sharding_on_64_a100_40gb():
    # Llama 3 70B in bf16 with AdamW: 16 bytes/param x 70.6B = 1.1 TB of model state; without sharding
    # weights and optimizer state (ZeRO-1 keeps 2Ψ+2Ψ = 282 GB of weights+grads per GPU) nothing fits in 40 GB.
    job = job_for(get_preset("llama3-70b"), "A100-40GB", 8, 8, 4096, 4096 * 512)
    r1 = search(job, Constraints(tp=1, pp=1, zero=1))
    assert not any(r.feasible for r in r1)
    assert all(r.memory_gb["params"] > 100 for r in r1)
    r3 = search(job, Constraints(tp=1, pp=1, zero=3))
    assert any(r.feasible for r in r3)


@pytest.mark.parametrize("name,gpu,nodes,family", [
    ("llama3-8b", "H100-80GB", 1, "fsdp"),          # <32 GPUs, <13B: HF Trainer + ZeRO-3 / FSDP
    ("llama3-8b", "H100-80GB", 8, "fsdp_or_megatron"),  # 64 GPUs: FSDP/DeepSpeed or Megatron
    ("llama3-70b", "H100-80GB", 128, "megatron"),   # 1024 GPUs, 70B: Megatron
    ("olmoe-1b-7b", "H100-80GB", 1, "megatron"),    # MoE: Megatron family
])
def test_chart_regimes(name, gpu, nodes, family):
    job = job_for(get_preset(name), gpu, nodes, 8, 4096, 4096 * 8 * nodes * 4)
    out = plan(job, top=1)
    assert out["recommendation"]["family"] == family
    if family == "fsdp":
        best = out["layouts"][0]
        assert best["tp"] == best["pp"] == 1 and best["dp_shard"] > 1  # sharded data parallel


# Published Hugging Face config.json fields (the model repos' config.json files).
HF_CONFIGS = {
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_group=4, n_group=8,
        num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid",
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen3-moe-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2),
    "llama3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_hf_config_mapping(name, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS[name]))
    cfg = load_model(str(path))
    preset = get_preset(name)
    assert cfg.num_params() == preset.num_params()
    assert cfg.num_active_params() == preset.num_active_params()


def test_toml_model(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('[model]\nvocab_size = 100\ndim = 8\nn_layers = 2\nn_heads = 2\nffn_dim = 16\n')
    assert load_model(str(path)).num_params() == HAND_PARAMS


def run_cli(capsys, *argv):
    rc = plan_main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_json_and_table(capsys, tmp_path):
    base = ["--model", "llama3-8b", "--gpu", "H100-80GB", "--nodes", "1", "--gpus-per-node", "8",
            "--seq-len", "4096", "--global-batch-tokens", str(4096 * 64)]
    rc, out, _ = run_cli(capsys, *base, "--json")
    assert rc == 0
    data = json.loads(out)
    for row in data["layouts"]:
        assert {"dp_replicate", "dp_shard", "tp", "pp", "ep", "zero", "feasible", "memory_gb",
                "tokens_per_s_per_gpu", "mfu", "micro_batch", "activation_checkpointing"} <= set(row)
        assert "total" in row["memory_gb"]
        assert row["dp_replicate"] * row["dp_shard"] * row["tp"] * row["pp"] == 8
    feas = [r["tokens_per_s_per_gpu"] for r in data["layouts"] if r["feasible"]]
    assert feas == sorted(feas, reverse=True) and 0 < data["layouts"][0]["mfu"] < 1
    assert any(not r["feasible"] and r["reason"] for r in data["layouts"])
    rc, out, _ = run_cli(capsys, *base, "--png", str(tmp_path / "plan.png"))
    assert rc == 0 and "Recommendation" in out and "infeasible:" in out
    assert (tmp_path / "plan.png").stat().st_size > 1000


def test_cli_help_explains_every_option():
    from moeflow.plan.cli import build_parser

    for action in build_parser()._actions:
        assert action.help, action.dest


@pytest.mark.parametrize("argv,msg", [
    (["--model", "llama3-8b", "--gpu", "H10"], "Did you mean 'H100-80GB'?"),
    (["--model", "llama3-8b", "--gpu", "A100"], "Did you mean 'A100-40GB' or 'A100-80GB'?"),
    (["--model", "llama3-8b", "--gpu", "H2000"], "Did you mean 'H200'?"),
    (["--model", "lama3-8b", "--gpu", "H100-80GB"], "Did you mean 'llama3-8b'"),
    (["--model", "llama3-70b", "--gpu", "A100-40GB", "--gpus-per-node", "1", "--global-batch-tokens", "4096"],
     "short by"),
    (["--model", "llama3-8b", "--gpu", "H100-80GB", "--tp", "16"], "--tp (16) must divide --gpus-per-node (8)"),
    (["--model", "llama3-8b", "--gpu", "H100-80GB", "--seq-len", "4096", "--global-batch-tokens", "5000"],
     "multiple of --seq-len"),
    (["--model", "llama3-8b", "--gpu", "A100-80GB", "--precision", "fp8"], "no fp8"),
    (["--model", "llama3-8b", "--gpu", "H100-80GB", "--ep", "8"], "parallel.ep = 8 needs an MoE model"),
    (["--model", "llama3-8b"], "--gpu is required"),
])
def test_cli_bad_input(capsys, argv, msg):
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2
    assert msg in err


def test_unsupported_hf_architecture():
    with pytest.raises(ValueError, match="'gpt2', which moeflow cannot load; supported architectures"):
        config_from_hf({"model_type": "gpt2", "n_embd": 768})


def test_advice_text_names_layout():
    job = job_for(get_preset("llama3-8b"), "H100-80GB", 1, 8, 4096, 4096 * 64)
    res = search(job)
    adv = advise(job, res[0])
    assert "FSDP" in adv.tools and "dp_shard=" in adv.text


@pytest.mark.slow
def test_calibrate_smoke():
    from moeflow.plan.calibrate import calibrate

    gpu = calibrate(2)
    assert gpu.bf16_tflops > 0 and gpu.intra_gbps > 0 and gpu.half_tokens >= 1


def test_fp8_times_exactly_what_training_converts():
    """--precision fp8 runs at the fp8 peak (2x bf16 on an H100) only the matmuls training.fp8 converts: for
    llama3-8b (D 4096, 32 layers, 32 heads of 128, 8 kv heads, FFN 14336, vocab 128256, seq 4096), by hand:
    attention 2*4096*4096 + 2*4096*1024 and SwiGLU 3*4096*14336 per layer in FP8; the head 4096*128256 and the
    attention scores 6*32*4096*(4096+4096)/2 per token in bf16."""
    D, L, F, V, S = 4096, 32, 14336, 128256, 4096
    fp8 = 6 * L * (2 * D * D + 2 * D * 1024 + 3 * D * F)
    bf16 = 6 * (V * D + 2 * L * D) + 6 * L * S * (D + D) / 2  # head and the norms' weights; attention scores
    job = lambda precision: job_for(get_preset("llama3-8b"), seq=S, batch=S * 64, precision=precision)  # noqa: E731
    layout = lay(dp_shard=8, zero=3, ac="none")
    ratio = step_time(job("fp8"), layout)["compute_s"] / step_time(job("bf16"), layout)["compute_s"]
    assert ratio == pytest.approx((bf16 + fp8 / 2) / (bf16 + fp8), rel=2e-3)
    with pytest.raises(ValueError, match="no MXFP8 tensor cores"):
        job("mxfp8").validate()
    assert step_time(job_for(get_preset("llama3-8b"), "B200", precision="mxfp8"), layout)["compute_s"] > 0
