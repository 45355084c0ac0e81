"""moeflow.plan: memory formulas against hand-worked numbers, published parameter counts and layouts,
the chart's regimes, HF config.json mapping, bad input, and the `plan` CLI."""

from __future__ import annotations

import json

import pytest

from moeflow.core.hardware import get_gpu
from moeflow.core.hf_arch import config_from_hf
from moeflow.core.model_config import ModelConfig, MoEConfig
from moeflow.core.parallel_dims import ParallelDims
from moeflow.core.presets import PUBLISHED, get_preset
from moeflow.core.schedules import SCHEDULES
from moeflow.plan.advice import advise
from moeflow.plan.cli import load_model, plan
from moeflow.plan.cli import main as plan_main
from moeflow.plan.compute import FBW, Rates, layer_cost, matmul_seconds, scores_cost
from moeflow.plan.layout import Job, Layout
from moeflow.plan.memory import layer_activation_bytes, memory_per_gpu
from moeflow.plan.schedule import bubble_seconds
from moeflow.plan.search import Constraints, evaluate, search
from moeflow.plan.time import rates, ring_time, step_time

# vocab 100, dim 8, 2 layers, 2 heads, ffn 16. By hand: embeddings + head 2*100*8 = 1600, final norm 8,
# per layer: norms 2*8 + attention q,k,v,o 4*8*8 = 256 + SwiGLU 3*8*16 = 384 -> 656; total 2920.
HAND = ModelConfig(vocab_size=100, dim=8, n_layers=2, n_heads=2, ffn_dim=16, max_seq_len=64)
HAND_PARAMS = 2920


def job_for(cfg, gpu="H100-80GB", nodes=1, gpn=8, seq=64, batch=64 * 64, **kw):
    return Job(cfg, get_gpu(gpu), nodes, gpn, seq, batch, **kw)


def lay(dp_shard=1, tp=1, pp=1, ep=1, zero=1, mb=1, ac="selective", dp_replicate=1, pp_schedule="1F1B", cp=1):
    dims = ParallelDims(dp_replicate * dp_shard * tp * pp * cp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
                        pp=pp, ep=ep, zero=zero, pp_schedule=pp_schedule, cp=cp)
    return Layout(dims, mb, ac)


def test_hand_model_param_count():
    assert HAND.num_params() == HAND_PARAMS


@pytest.mark.parametrize("zero,params,grads,opt", [
    # ZeRO (Rajbhandari et al. 2020, Fig. 1): 2Ψ + 2Ψ + 12Ψ, sharding 12Ψ / 2Ψ grads / 2Ψ params over N_d=4.
    # moeflow's ZeRO-1 reduce-scatters gradients as backward produces them (FSDP2): its gradients are sharded.
    (1, 2 * HAND_PARAMS, 2 * HAND_PARAMS / 4, 12 * HAND_PARAMS / 4),
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
    # full recomputation adds exactly one more forward of the layer to its backward (Korthikanti et al. sec. 5)
    r = rates(job)
    none, full = (layer_cost(HAND, False, 64, 1, 1, 1, ac, r) for ac in ("none", "full"))
    assert full.b - none.b == pytest.approx(none.f) and (full.f, full.w) == (none.f, none.w)


# A GPU with round numbers for hand-worked costs: 100 TFLOP/s matmuls, 50 TFLOP/s attention, 1 TB/s memory.
ROUND = Rates(matmul_flops=100e12, attention_flops=50e12, hbm_bytes=1e12, matmul_elt=2)


def test_matmul_roofline_hand_worked():
    # [8192, 4096] @ [4096, 4096]: 2*8192*4096*4096 = 2.749e11 FLOPs -> 2.749 ms; bytes 2*(33.5M + 16.8M + 33.5M)
    # = 167.8 MB -> 0.168 ms: compute-bound.
    assert matmul_seconds(8192, 4096, 4096, ROUND) == pytest.approx(2 * 8192 * 4096 * 4096 / 100e12)
    # [16, 4096] @ [4096, 4096]: 5.4e8 FLOPs -> 5.4 us, but the weight alone is 33.6 MB -> 33.8 us: memory-bound.
    assert matmul_seconds(16, 4096, 4096, ROUND) == pytest.approx(2 * (16 * 4096 * 2 + 4096 * 4096) / 1e12)
    # 8 experts' matmuls of 64 rows each cost 8 times one
    assert matmul_seconds(64, 512, 256, ROUND, 8) == pytest.approx(8 * matmul_seconds(64, 512, 256, ROUND))


def test_attention_scores_hand_worked():
    # 2 layers' worth: seq 1024, mb 2, 8 heads of 64 (qk = v = 512): forward FLOPs s * b * s * (qk + v) (causal)
    cfg = ModelConfig(vocab_size=100, dim=512, n_layers=1, n_heads=8, ffn_dim=1024)
    flops = 1024 * 2 * 1024 * (512 + 512)
    f, b = scores_cost(cfg, 1024, 2, 1, ROUND, flash=True)
    assert f == pytest.approx(flops / 50e12) and b == pytest.approx(2.5 * f)  # flash backward: 5 matmuls vs 2
    f2, b2 = scores_cost(cfg, 1024, 2, 2, ROUND, flash=True)
    assert f2 == pytest.approx(f / 2)  # tp splits the heads
    # Without flash attention: the whole square at the matmul rate, plus 5as bytes per token written and read.
    f3, b3 = scores_cost(cfg, 1024, 2, 1, ROUND, flash=False)
    assert f3 == pytest.approx(2 * flops / 100e12 + 2 * 5 * 8 * 1024 * 1024 * 2 / 1e12) and b3 == pytest.approx(2 * f3)


def test_tensor_parallelism_splits_flops_not_matmul_rows():
    # With sequence parallelism each tp rank multiplies all s*b rows by 1/tp of the weight, so trading dp = 8 for
    # dp = 4 x tp = 2 leaves each GPU's compute per step unchanged for compute-bound matmuls (1/8 of the FLOPs
    # either way). The old model sized matmuls by the s*b/tp tokens of a rank and charged tp 6% more compute.
    job = job_for(get_preset("llama3-70b"), "H100-80GB", 1, 8, 4096, 4096 * 64)
    t1 = step_time(job, lay(dp_shard=8, tp=1, zero=3, mb=1, ac="none"))["compute_s"]
    t2 = step_time(job, lay(dp_shard=4, tp=2, zero=3, mb=1, ac="none"))["compute_s"]
    assert t2 == pytest.approx(t1, rel=0.005)



def test_context_parallel_memory_and_time_hand_worked():
    # HAND: 2 layers, 2 heads of width 4 (no GQA): keys and values 2 x 2 x 4 = 16 elements per token per layer.
    # cp=4 on 4 GPUs against dp_shard=4: the same 4 ranks shard the weights; a rank holds 16 of each 64-token
    # sequence, so a quarter of the activations, plus 3/4 of each layer's bf16 keys and values, gathered.
    job = job_for(HAND, gpn=4, seq=64, batch=64 * 4)
    dp4 = memory_per_gpu(job, lay(dp_shard=4, zero=3, ac="none"))
    cp4 = memory_per_gpu(job, lay(zero=3, ac="none", cp=4))
    for part in ("params", "grads", "optimizer"):
        assert cp4[part] == pytest.approx(dp4[part]), part
    gathered_kv = 2 * (2 * 64 * 16 * 3 / 4)  # 2 layers x bf16 x 64 tokens x 16 elements x 3/4 from the others
    assert cp4["activations"] * 1e9 == pytest.approx(dp4["activations"] * 1e9 / 4 + gathered_kv)
    # time: per layer an all-gather and a reduce-scatter of the 64 x 16 x 2 bytes over 4 ranks, for each of the
    # 4 micro-batches (one sequence each), inside the node
    t = step_time(job, lay(zero=3, ac="none", cp=4))
    alpha, beta = 5e-6, get_gpu("H100-80GB").intra_gbps * 1e9
    assert t["cp_s"] == pytest.approx(4 * 2 * 2 * (3 * alpha + 3 / 4 * 64 * 16 * 2 / beta))
    assert step_time(job, lay(dp_shard=4, zero=3, ac="none"))["cp_s"] == 0.0


def test_context_parallel_is_planned_when_pinned_and_by_the_trainer_rules():
    job = job_for(HAND, gpn=8, seq=64, batch=64 * 8)
    results = search(job, Constraints(cp=2))
    assert results and all(r.layout.cp == 2 and r.layout.world == 8 for r in results)
    assert all(r.layout.cp == 1 for r in search(job))  # not searched unless pinned
    with pytest.raises(ValueError, match=r"data.seq_len \(64\) must be divisible by 2 x parallel.cp \(= 6\)"):
        Constraints(cp=3).check(job_for(HAND, gpn=6, seq=64, batch=64 * 6))


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


def _timed_matmul_flops(tokens: int, width: int = 512) -> float:
    """FLOP/s of [tokens, width] @ [width, width] in fp32, timed here: best of 5 runs of ~0.2 GFLOP each."""
    import time

    import torch

    a, b = torch.randn(tokens, width), torch.randn(width, width)
    iters = max(1, int(2e8 // (2 * tokens * width * width)))
    a @ b
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        best = min(best, (time.perf_counter() - t0) / iters)
    return 2 * tokens * width * width / best


def _timed_copy_gbps(nbytes: int = 4 << 20) -> float:
    import time

    import torch

    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


@pytest.mark.slow
def test_calibrate_predicts_a_matmul_timed_here():
    """The calibrated device's rate(n) = peak * n / (n + half_tokens) against matmuls timed in this test, at the
    two sizes it was fitted on and one between them (a factor of 2: two measurements on a shared machine); its
    all-reduce bandwidth is positive and below 4x what one process copies in memory."""
    from moeflow.plan.calibrate import calibrate

    gpu = calibrate(2)
    for tokens in (32, 256, 1024):
        predicted = gpu.peak_flops("bf16") * gpu.efficiency * tokens / (tokens + gpu.half_tokens)
        measured = _timed_matmul_flops(tokens)
        assert 0.5 < predicted / measured < 2, (tokens, predicted, measured, gpu)
    assert 0 < gpu.intra_gbps < 4 * _timed_copy_gbps(), gpu



# ---- pipeline schedules ----------------------------------------------------------------------------------


def simulate_1f1b(p: int, m: int, f: float, b: float, gpipe: bool = False) -> float:
    """Makespan of a 1F1B (or GPipe) pipeline by event simulation: an independent oracle for the bubble formula.
    Stage s runs p - s - 1 warm-up forwards, then alternates one forward and one backward (GPipe: all forwards,
    then all backwards); a forward needs the previous stage's, a backward the next stage's and its own forward."""
    order = []
    for s in range(p):
        if gpipe:
            ops = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        else:
            warm = min(p - s - 1, m)
            ops = [("F", i) for i in range(warm)]
            for i in range(m - warm):
                ops += [("F", warm + i), ("B", i)]
            ops += [("B", i) for i in range(m - warm, m)]
        order.append(ops)
    done, clock, pos = {}, [0.0] * p, [0] * p
    while any(pos[s] < len(order[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(order[s]):
                continue
            kind, i = order[s][pos[s]]
            deps = [("F", s - 1, i)] if kind == "F" and s else []
            if kind == "B":
                deps = [("F", s, i)] + ([("B", s + 1, i)] if s < p - 1 else [])
            if all(d in done for d in deps):
                start = max([clock[s]] + [done[d] for d in deps])
                clock[s] = done[(kind, s, i)] = start + (f if kind == "F" else b)
                pos[s] += 1
                progressed = True
        assert progressed
    return max(clock)


@pytest.mark.parametrize("p,m,gpipe", [(4, 8, False), (8, 8, False), (4, 16, True), (2, 1, False)])
def test_1f1b_bubble_matches_event_simulation(p, m, gpipe):
    f, b, w = 1.0, 1.5, 0.5  # the rank's forward, input-gradient and weight-gradient seconds
    bubble = bubble_seconds("GPipe" if gpipe else "1F1B", p, 1, FBW(f, b, w))
    assert m * (f + b + w) + bubble == pytest.approx(simulate_1f1b(p, m, f, b + w, gpipe))


def test_schedule_bubbles_against_published_tables():
    # With T_F = T_B = T_W = 1 (sail-sg/zero-bubble-pipeline-parallelism README table): 1F1B bubble rate (p-1)/m,
    # i.e. (p-1) * 3 seconds; ZB-H1 (p-1)/3m, i.e. (p-1); ZB-V 0. Interleaving v stages: (p-1)/(v m)
    # (Narayanan et al. 2021 sec. 2.2.2).
    p, one = 4, FBW(1.0, 1.0, 1.0)
    assert bubble_seconds("1F1B", p, 1, one) == 9.0
    assert bubble_seconds("InterleavedZeroBubble", p, 1, one) == 3.0
    assert bubble_seconds("InterleavedZeroBubble", p, 2, one) == 1.5
    assert bubble_seconds("ZBVZeroBubble", p, 2, one) == 0.0
    assert bubble_seconds("Interleaved1F1B", p, 2, one) == 4.5
    # DualPipeV (deepseek-ai/DualPipe README): (PP/2 - 1)(F&B + B - 3W) over PP = 2p stages, each stage half a
    # rank: F = B = W = 0.5 per stage, F&B = F + B + W = 1.5 without overlap, B ("full backward") = 1.0
    assert bubble_seconds("DualPipeV", p, 2, one) == pytest.approx((2 * p / 2 - 1) * (1.5 + 1.0 - 3 * 0.5))
    assert bubble_seconds("1F1B", 1, 1, one) == 0.0


def test_schedule_changes_activation_memory():
    cfg = ModelConfig(vocab_size=100, dim=256, n_layers=8, n_heads=4, ffn_dim=512)
    job = job_for(cfg, gpn=4, seq=64, batch=64 * 16)
    act = {name: memory_per_gpu(job, lay(pp=4, pp_schedule=name))["activations"]
           for name in ("1F1B", "Interleaved1F1B", "GPipe", "ZBVZeroBubble")}
    # 1F1B's fullest stage is the first, holding p = 4 micro-batches; GPipe's every stage holds all 16, the last
    # one also the fp32 logits (4 * 64 tokens * 100 vocab bytes); the V placement puts the last stage, and its
    # logits, on the first rank
    logits = 4 * 64 * 100 / 1e9
    assert act["ZBVZeroBubble"] == pytest.approx(act["1F1B"] + logits)
    assert act["GPipe"] == pytest.approx(act["1F1B"] * 16 / 4 + logits)
    # Korthikanti et al. sec. 4.2.3: interleaving holds (1 + (p-1)/(p v)) times 1F1B's activations
    assert act["Interleaved1F1B"] == pytest.approx(act["1F1B"] * (1 + 3 / (4 * 2)))


def test_search_picks_a_schedule_the_trainer_runs():
    from moeflow.core.parallel_dims import ParallelDims

    cfg = get_preset("llama3-70b")
    job = job_for(cfg, "H100-80GB", 8, 8, 4096, 4096 * 256)
    out = plan(job, Constraints(pp=8), top=10, infeasible=0)
    rows = [r for r in out["layouts"] if r["feasible"]]
    assert rows and all(r["pp_schedule"] in SCHEDULES for r in rows)
    for r in rows:  # the trainer's own checks: sizes, schedule against the model, micro-batches
        dims = ParallelDims(64, dp_replicate=r["dp_replicate"], dp_shard=r["dp_shard"], tp=r["tp"], pp=r["pp"],
                            ep=r["ep"], zero=r["zero"], pp_schedule=r["pp_schedule"])
        dims.check_model(cfg)
        dims.split_batch(256, r["micro_batch"])
    # a zero-bubble schedule beats 1F1B here, and pinning 1F1B shows its larger bubble
    best = rows[0]
    assert best["pp_schedule"] != "1F1B"
    pinned = plan(job, Constraints(pp=8, pp_schedule="1f1b"), top=1, infeasible=0)["layouts"][0]
    assert pinned["pp_schedule"] == "1F1B" and pinned["time_s"]["bubble_fraction"] > best["time_s"]["bubble_fraction"]


def test_ep_overlap_hides_communication_up_to_compute():
    job = job_for(get_preset("deepseek-v3"), "H800", 32, 8, 4096, 4096 * 1024)
    layout = lay(dp_shard=256, ep=64, zero=3, ac="none")
    job.ep_chunks = 0
    off = step_time(job, layout)
    job.ep_overlap = True
    on = step_time(job, layout)
    # while the communication kernels hold 20 of 132 SMs (DeepSeek-V3 sec. 3.2.2), compute runs slower ...
    assert on["compute_s"] == pytest.approx(off["compute_s"] / (1 - 20 / 132))
    # ... and only the all-to-all time beyond that compute is exposed
    assert on["ep_s"] == pytest.approx(max(0.0, off["ep_s"] - on["compute_s"]))
    assert on["step_s"] < off["step_s"]


def test_in_layer_overlap_schedule_by_hand():
    from moeflow.plan.overlap import exposed_ep_seconds, moe_layer_seconds

    # no overlap: dispatch, shared experts, experts, combine back to back
    assert moe_layer_seconds(1.0, 4.0, 2.0, 3.0, 0) == 10.0
    # one chunk: the dispatch runs beside the shared experts, the experts wait for both, then the combine
    assert moe_layer_seconds(1.0, 4.0, 2.0, 3.0, 1) == 3.0 + 4.0 + 2.0
    assert moe_layer_seconds(5.0, 4.0, 2.0, 3.0, 1) == 5.0 + 4.0 + 2.0
    # two compute-bound chunks (d = m = 1, c = 4 each): D0 [0,1] D1 [1,2]; C0 [1,5]; M0 [5,6]; C1 [5,9]; M1 [9,10]
    assert moe_layer_seconds(1.0, 4.0, 1.0, 0.0, 2) == 10.0
    # two communication-bound chunks (d = m = 4, c = 1): the communication engine never idles: 4 x 4
    assert moe_layer_seconds(4.0, 1.0, 4.0, 0.0, 2) == 16.0
    # exact sizes: each dispatch's counts (0.5) reach the host first, queued behind the engine's work.
    # 2 chunks: n0 [0,.5] D0 [.5,1.5]; n1 [1.5,2] D1 [2,3]; C0 [2,6]; M0 [6,7]; C1 [6,10]; M1 [10,11]
    assert moe_layer_seconds(1.0, 4.0, 1.0, 0.0, 2, counts_s=0.5) == 11.0
    # 3 chunks: the third count exchange waits behind M0, so the host cannot issue C1 until 7.5:
    # ... C0 [2,6]; M0 [6,7]; n2 [7,7.5] D2 [7.5,8.5]; C1 [7.5,11.5]; M1 [11.5,12.5]; C2 [11.5,15.5]; M2 [15.5,16.5]
    assert moe_layer_seconds(1.0, 4.0, 1.0, 0.0, 3, counts_s=0.5) == 16.5
    assert moe_layer_seconds(1.0, 4.0, 1.0, 0.0, 3) == 14.0  # static sizes: only D0 and M2 are exposed
    # exposed: the wall time less the unchunked compute. Chunks of 4.5 s against 8 s unchunked (weights read
    # twice): forward D0 [0,1] C0 [1,5.5] C1 [5.5,10] M1 [10,11] -> 11 - 8 = 3; backward (no counts, compute x2)
    # M-direction first [0,1] C0 [1,10] C1 [10,19] last [19,20] -> 20 - 16 = 4
    # with counts (0.5): n0 [0,.5] D0 [.5,1.5] n1 [1.5,2] D1 [2,3]; the host issues C0 at 2: C0 [2,6.5]
    # C1 [6.5,11] M1 [11,12] -> 12 - 8 = 4
    assert exposed_ep_seconds(1.0, 4.5, 1.0, 0.0, 2, 8.0, counts_s=0.5) == (4.0, 4.0)
    assert exposed_ep_seconds(1.0, 4.5, 1.0, 0.0, 2, 8.0) == (3.0, 4.0)
    # a zero-bubble schedule's backward hides behind the input gradients only
    assert exposed_ep_seconds(1.0, 4.5, 1.0, 0.0, 2, 8.0, backward_factor=1.0)[1] == 11.0 - 8.0
    assert exposed_ep_seconds(1.0, 8.0, 2.0, 0.0, 0, 8.0) == (3.0, 3.0)


def test_planner_costs_the_trainers_ep_chunks():
    job = job_for(get_preset("deepseek-v3"), "H800", 32, 8, 4096, 4096 * 1024)
    layout = lay(dp_shard=256, ep=64, zero=3, ac="none")
    ep = {}
    for chunks in (0, 1, 2, 4):
        job.ep_chunks = chunks
        job.stats.cache.clear()
        ep[chunks] = step_time(job, layout)["ep_s"]
    # the shared experts hide part of the first dispatch; chunks hide more, up to the latency and weight reads
    # they add
    assert ep[0] > ep[1] > ep[2] > 0 and ep[4] < ep[0]
    job.ep_chunks, job.ep_static_sizes = 4, True  # no host sync per dispatch: less exposed
    assert step_time(job, layout)["ep_s"] < ep[4]
    job.ep_static_sizes = False
    # full recomputation runs the forward's dispatch and combine again in backward
    job.ep_chunks, job.ep_static_sizes = 0, True  # (no count exchange, which only the forward has)
    plain, full = (step_time(job, lay(dp_shard=256, ep=64, zero=3, ac=ac))["ep_s"] for ac in ("none", "full"))
    assert full == pytest.approx(1.5 * plain)
    job.ep_static_sizes = False
    for chunks in (-1, 4097):
        job.ep_chunks = chunks
        with pytest.raises(ValueError, match="--ep-chunks must be 0"):
            job.validate()
    job.ep_chunks = 1
    for bad in (0.0, -5.0, float("nan")):
        with pytest.raises(ValueError, match="--inter-gbps must be a positive number of GB/s"):
            job_for(get_preset("deepseek-v3"), "H800", 32, 8, 4096, 4096 * 1024, inter_gbps=bad).validate()


def test_fp8_speeds_up_matmuls_only():
    cfg = get_preset("llama3-8b")
    bf16, fp8 = (rates(job_for(cfg, "H100-80GB", precision=p)) for p in ("bf16", "fp8"))
    assert fp8.attention_flops == bf16.attention_flops and fp8.hbm_bytes == bf16.hbm_bytes
    # H100 SXM large-matmul rates measured by MAMF: bf16 794.5 of 989, fp8 1402.6 of 1979 TFLOP/s
    assert fp8.matmul_flops / bf16.matmul_flops == pytest.approx(1402.6 / 794.5, rel=0.005)
    assert scores_cost(cfg, 4096, 1, 1, fp8, True) == scores_cost(cfg, 4096, 1, 1, bf16, True)
    # training.fp8 keeps the output head in bf16: its cost does not change, a layer's falls
    from moeflow.plan.time import _layer_costs

    dp8 = lay(dp_shard=8, zero=3, ac="none")
    (dense8, _, head8), (dense16, _, head16) = (_layer_costs(job_for(cfg, "H100-80GB", precision=p), dp8)
                                                for p in ("fp8", "bf16"))
    assert head8 == head16 and dense8.total < dense16.total
    # MXFP8 (training.fp8 = 'mxfp8') needs Blackwell's block-scaled tensor cores
    with pytest.raises(ValueError, match="no MXFP8 tensor cores"):
        job_for(cfg, "H100-80GB", precision="mxfp8").validate()
    assert rates(job_for(cfg, "B200", precision="mxfp8")).matmul_elt == 1


def test_cli_schedule_column_and_flags(capsys):
    base = ["--model", "llama3-70b", "--gpu", "H100-80GB", "--nodes", "4", "--seq-len", "4096",
            "--global-batch-tokens", str(4096 * 128), "--pp", "4"]
    rc, out, _ = run_cli(capsys, *base)
    assert rc == 0 and "schedule" in out.splitlines()[2]
    rc, out, _ = run_cli(capsys, *base, "--pp-schedule", "DualPipeV", "--json")
    assert rc == 0 and {r["pp_schedule"] for r in json.loads(out)["layouts"]} == {"DualPipeV"}
    rc, _, err = run_cli(capsys, *base, "--pp-schedule", "Zigzag")
    assert rc == 2 and "--pp-schedule = 'Zigzag' is not a pipeline schedule" in err
    rc, out, _ = run_cli(capsys, "--model", "deepseek-v3", "--gpu", "H800", "--nodes", "32", "--seq-len", "4096",
                         "--global-batch-tokens", str(4096 * 1024), "--ep-overlap", "--json")
    assert rc == 0 and json.loads(out)["hardware"]["ep_overlap"] is True


def test_cli_unwritable_png_is_an_error_not_a_traceback(capsys):
    rc, _, err = run_cli(capsys, "--model", "tiny-moe", "--gpu", "H100-80GB", "--png", "/proc/no/such/plan.png")
    assert rc == 2 and "--png /proc/no/such/plan.png" in err and "pass a writable file path" in err
