"""LoRA (`peft.method = 'lora'`) against peft itself: moeflow's adapted forward equals PeftModel's on the same base
and adapter weights for dense, MoE and MLA architectures; a run from a Hugging Face folder trains the adapters
only (the base bit-identical, no gradient or optimizer state for it, checkpoints without it) and writes
RUN_DIR/adapter/ that PeftModel loads with moeflow's loss; ep=2, dp=2 ZeRO-3, pp=2, tp=2, cp=2, ep=2 with
recomputation and a stop under ep=2 resumed in one process train the one-process losses and gradient norms; bad
settings are one line before any rank."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from moeflow.config import load_config  # noqa: E402
from moeflow.models import lora  # noqa: E402
from moeflow.models.hf import from_pretrained  # noqa: E402
from moeflow.models.peft_format import write_adapter  # noqa: E402
from moeflow.train.trainer import train  # noqa: E402
from tests.support.cli import assert_one_line  # noqa: E402
from tests.support.hf_models import V, hf_configs, randomize  # noqa: E402
from tests.support.model_helpers import next_token_loss, random_lora_factors, steps  # noqa: E402

REL = 1e-5


def _folder(path, name: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_configs()[name]).float()
    randomize(model, seed=1)
    model.save_pretrained(path)
    np.random.default_rng(0).integers(0, V, 20000).astype(np.uint16).tofile(path / "tokens.bin")
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # GLM-4.5-shaped: a dense first layer, shared experts, selection biases; two kv heads (tp = 2 divides them)
    return _folder(tmp_path_factory.mktemp("glm4-moe"), "glm4_moe")


def _overrides(folder, run_dir, **more) -> dict:
    return {"model.hf_path": str(folder), "data.source": str(folder / "tokens.bin"), "data.seq_len": 16,
            "training.global_batch": 4, "training.steps": 4, "training.lr": 1e-2, "eval.every": 0,
            "metrics.tensorboard": False, "metrics.log_every": 1, "checkpoint.every": 2, "run_dir": str(run_dir),
            "peft.method": "lora", "peft.rank": 4, "peft.alpha": 8.0, **more}


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe"])
def test_the_adapted_forward_is_peft_model_s(tmp_path, name):
    """Random factors (B nonzero), written in PEFT's format and loaded by PeftModel.from_pretrained on the folder:
    the same logits (the experts' factors in peft's [E * r, in] / [out, r * E] layout, dense MLPs by weight where
    peft reads their names as experts')."""
    folder = _folder(tmp_path / "base", name)
    model, cfg = from_pretrained(folder, dtype=torch.float32)
    job = load_config(None, _overrides(folder, tmp_path / "run"))
    lora.add(model, 4, 8.0, 0.0, "auto", True)
    factors = random_lora_factors(model)
    gen = torch.Generator().manual_seed(4)
    assert any("experts.lora" in n for n in factors) == cfg.is_moe
    out = write_adapter(factors, job.model, job.peft, tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, out).eval()
    ids = torch.randint(0, V, (2, 12), generator=gen)
    with torch.no_grad():
        ours, want = model(ids), theirs(ids).logits
        untouched = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
    assert (want - untouched).abs().max() > 0.1  # the adapter changes the output
    torch.testing.assert_close(ours, want, rtol=REL, atol=REL * want.abs().max().item())


def test_a_run_trains_the_adapters_only_and_peft_loads_them(folder, tmp_path):
    from moeflow.generate import load_model
    from moeflow.train.build import build
    from moeflow.train.distributed import DistInfo
    from moeflow.train.step import train_step

    cfg = load_config(None, _overrides(folder, tmp_path / "one"))
    s = build(cfg, DistInfo(0, 1, 0, torch.device("cpu")), *cfg.layout(1))
    before = {n: p.detach().clone() for n, p in s.model.named_parameters()}
    biases = {n: b.clone() for n, b in s.model.named_buffers() if n.endswith("expert_bias")}
    assert biases
    for _ in range(2):
        train_step(cfg, s, with_moe_stats=False, measure=False, per_rank=lambda: {"peak_memory_mb": 0.0})
    assert all(lora.is_factor(n) == p.requires_grad for n, p in s.model.named_parameters())
    assert {id(p) for p in s.optimizer.state} == {id(p) for n, p in s.model.named_parameters() if lora.is_factor(n)}
    for n, p in s.model.named_parameters():
        changed = not torch.equal(p, before[n])
        assert changed == lora.is_factor(n), n  # the base bit-identical, every factor trained
    for n, b in s.model.named_buffers():
        if n in biases:
            assert torch.equal(b, biases[n]), n  # the routers' selection biases are the base's too

    train(cfg, fresh=True, progress=False)
    run = tmp_path / "one"
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(run / "checkpoints" / "step-4")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)  # the base is not re-saved
    ids = torch.from_numpy(np.fromfile(folder / "tokens.bin", dtype=np.uint16)[:33].astype(np.int64))[None]
    ours, *_ = load_model(str(run))
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    untouched = next_token_loss(base, ids)
    theirs = peft.PeftModel.from_pretrained(base, run / "adapter").eval()
    assert next_token_loss(theirs, ids) == pytest.approx(next_token_loss(ours, ids), rel=REL)
    assert abs(next_token_loss(theirs, ids) - untouched) > 1e-3
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder) and config["r"] == 4

    from moeflow.cli import main as cli_main

    out = tmp_path / "merged"
    assert cli_main(["convert", "moeflow-to-hf", str(run), str(out), "--dtype", "fp32"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert next_token_loss(merged, ids) == pytest.approx(next_token_loss(ours, ids), rel=REL)


def test_bf16_autocast_trains_the_fp32_lora_steps_within_a_tolerance(folder, tmp_path):
    """LoRA under bf16 autocast against the same 4 steps in fp32: the factors and their AdamW state stay fp32, the
    base stays the folder's, the factors move the same way (cosine of the two runs' updates > 0.9; measured 0.97),
    and the losses and gradient norms agree within 2e-2 relative (measured: 5e-3 and 6e-3; bf16 roundings flip a
    few of the sigmoid router's top-k choices, which the full fine-tuning test's tiny model does not have), yet
    are not bit-equal (autocast is on)."""
    from moeflow.train.build import build
    from moeflow.train.distributed import DistInfo
    from moeflow.train.step import train_step

    results, moved = {}, {}
    for dtype in ("fp32", "bf16"):
        cfg = load_config(None, _overrides(folder, tmp_path / dtype, **{"training.dtype": dtype}))
        s = build(cfg, DistInfo(0, 1, 0, torch.device("cpu")), *cfg.layout(1))
        before = {n: p.detach().clone() for n, p in s.model.named_parameters()}
        results[dtype] = [train_step(cfg, s, with_moe_stats=False, measure=False,
                                   per_rank=lambda: {"peak_memory_mb": 0.0}) for _ in range(4)]
        after = dict(s.model.named_parameters())
        assert all(torch.equal(after[n], before[n]) for n in before if not lora.is_factor(n)), dtype
        factors = [p for n, p in after.items() if lora.is_factor(n)]
        assert {p.dtype for p in factors} == {torch.float32}
        assert {t.dtype for p in factors for t in s.optimizer.state[p].values() if t.dim()} == {torch.float32}
        moved[dtype] = torch.cat([(after[n] - before[n]).detach().flatten() for n in before if lora.is_factor(n)])
    assert float(F.cosine_similarity(moved["bf16"], moved["fp32"], dim=0)) > 0.9
    losses = {d: [r.loss for r in rows] for d, rows in results.items()}
    norms = {d: [r.grad_norm for r in rows] for d, rows in results.items()}
    assert losses["bf16"][0] != losses["fp32"][0]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
    assert norms["bf16"] == pytest.approx(norms["fp32"], rel=2e-2)


LAYOUTS = {"ep2": {"parallel.ep": 2}, "tp2": {"parallel.tp": 2}, "stop": {"parallel.ep": 2, "training.stop_at": 2},
           "dp2-zero3": {"parallel.zero": 3}, "dp2-zero1": {"parallel.zero": 1}, "pp2": {"parallel.pp": 2},
           "cp2": {"parallel.cp": 2}, "ep2-recompute": {"parallel.ep": 2, "training.activation_checkpointing": "full"}}


@pytest.mark.parametrize("optimizer, names", [
    pytest.param("adamw", ["stop", "ep2", "tp2", "dp2-zero3", "dp2-zero1", "pp2", "cp2", "ep2-recompute"],
                 marks=pytest.mark.slow),  # 'stop': ep=2 resumed in one process (the expert factors resharded)
    pytest.param("muon", ["stop", "ep2", "tp2", "dp2-zero3", "pp2"], marks=pytest.mark.slow),
], ids=["every-layout", "muon"])
def test_layouts_and_a_resharded_resume_train_the_one_process_run(folder, tmp_path, optimizer, names):
    """Each layout's LoRA run (2 ranks) trains the one-process losses and gradient norms; 'stop' is ep=2 stopped at
    step 2 and resumed in one process; then --fresh on it starts the adapters again on the same base. Under Muon
    each factor matrix is orthogonalised whole wherever its shards lie."""
    from tests.parallel.layout_worker import launch

    def config(run, **more):
        return _overrides(folder, tmp_path / run, **{"training.optimizer": optimizer, **more})

    train(load_config(None, config("one")), fresh=True, progress=False)
    argv = lambda run, **more: [f"--{k}={v}" for k, v in config(run, **more).items()]
    results = launch(2, [(n, argv(n, **LAYOUTS[n]), str(tmp_path / n), False) for n in names])
    assert set(results.values()) == {"ok"}, results
    want = np.array(steps(tmp_path / "one"))
    if "stop" in names:
        train(load_config(None, config("stop")), resume=True, progress=False)  # 1 process
    for run in results:
        np.testing.assert_allclose(np.array(steps(tmp_path / run)), want, rtol=REL, err_msg=run)
    if "stop" in names:
        train(load_config(None, config("stop")), fresh=True, progress=False)
        np.testing.assert_allclose(np.array(steps(tmp_path / "stop")), want, rtol=REL)


def test_muon_orthogonalises_the_adapters_only_and_resumes_exactly(folder, tmp_path):
    """training.optimizer = 'muon' on a LoRA run: every factor (2-D, or 3-D for the experts: a matrix per expert)
    is Muon's and steps as torch.optim.Muon on it, the frozen base gets no state and stays bit-identical; a run
    stopped at step 2 resumes with the straight run's losses (the momentum is in the adapter's checkpoint) and
    writes an adapter PeftModel loads with moeflow's loss."""
    from moeflow.generate import load_model
    from moeflow.train.build import build
    from moeflow.train.distributed import DistInfo
    from moeflow.train.step import train_step

    muon = {"training.optimizer": "muon"}
    cfg = load_config(None, _overrides(folder, tmp_path / "probe", **muon))
    s = build(cfg, DistInfo(0, 1, 0, torch.device("cpu")), *cfg.layout(1))
    named = dict(s.model.named_parameters())
    factors = {n: p for n, p in named.items() if lora.is_factor(n)}
    [group] = [g for g in s.optimizer.param_groups if g["muon"]]
    assert {id(p) for p in group["params"]} == {id(p) for p in factors.values()}
    before = {n: p.detach().clone() for n, p in named.items()}
    seen = []  # each step's (learning rate, gradients), as the optimizer gets them
    step = s.optimizer.step
    s.optimizer.step = lambda: seen.append((group["lr"], {n: p.grad.clone() for n, p in factors.items()})) or step()
    for _ in range(2):
        train_step(cfg, s, with_moe_stats=False, measure=False, per_rank=lambda: {"peak_memory_mb": 0.0})
    assert all(torch.equal(p, before[n]) for n, p in named.items() if n not in factors)
    assert {id(p) for p in s.optimizer.state} == {id(p) for p in factors.values()}
    for n, p in factors.items():  # torch.optim.Muon on each of the factor's matrices, fed the run's gradients
        ref = [torch.nn.Parameter(m.clone()) for m in (before[n].unbind(0) if p.ndim == 3 else [before[n]])]
        opt = torch.optim.Muon(ref, lr=cfg.training.lr, weight_decay=cfg.training.weight_decay,
                               momentum=cfg.training.muon_momentum, adjust_lr_fn="match_rms_adamw")
        for lr, g in seen:
            for q, m in zip(ref, g[n].unbind(0) if p.ndim == 3 else [g[n]]):
                q.grad = m.clone()
            opt.param_groups[0]["lr"] = lr
            opt.step()
        want = torch.stack([q.detach() for q in ref]) if p.ndim == 3 else ref[0].detach()
        moved = (want - before[n]).norm()
        assert moved > 0 and (p.detach() - want).norm() <= 1e-3 * moved, (n, float((p.detach() - want).norm() / moved))

    train(load_config(None, _overrides(folder, tmp_path / "straight", **muon)), progress=False)
    train(load_config(None, _overrides(folder, tmp_path / "split", **muon, **{"training.stop_at": 2})),
          progress=False)
    train(load_config(None, _overrides(folder, tmp_path / "split", **muon)), resume=True, progress=False)
    assert steps(tmp_path / "split") == steps(tmp_path / "straight")
    ids = torch.from_numpy(np.fromfile(folder / "tokens.bin", dtype=np.uint16)[:33].astype(np.int64))[None]
    ours, *_ = load_model(str(tmp_path / "split"))
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "split" / "adapter").eval()
    assert next_token_loss(theirs, ids) == pytest.approx(next_token_loss(ours, ids), rel=REL)


@pytest.mark.parametrize("changes, message", [
    ({"peft.rank": 0}, r"peft.rank = 0; use 1 or more"),
    ({"peft.rank": 17}, r"peft.rank = 17 is above the width of experts \(16\), the narrowest adapted layer; use "
                        r"peft.rank <= 16"),
    ({"peft.rank": 17, "peft.experts": False}, None),  # the narrowest is then wk (24)
    ({"peft.modules": "wq,q_proj"}, r"peft.modules = 'wq,q_proj': this model has no linear layer named 'q_proj'; "
                                    r"it has gate, output, w1, w2, w3, wk, wo, wq, wv"),
    ({"peft.modules": "w1"}, r"peft.modules = 'w1': peft cannot place these adapters on this architecture \(Cannot "
                             r"convert PEFT target\(s\) gate_proj without also targeting up_proj"),  # peft's own rule
    ({"training.fp8": "tensorwise"}, r"peft.method = 'lora' with training.fp8 = 'tensorwise'"),
    ({"peft.dropout": 0.1}, r"peft.dropout = 0.1 for a MoE model"),
    ({"peft.method": "qlora"}, r"peft.method"),
])
def test_bad_settings_are_one_line_before_any_rank(folder, tmp_path, changes, message):
    assert_one_line(lambda: load_config(None, _overrides(folder, tmp_path / "r", **changes)).layout(2), message)


@pytest.mark.parametrize("impl", ["grouped_mm", "bmm", "loop"])
def test_the_experts_adapter_on_the_rows_is_the_adapted_weights(impl):
    """The experts' LoRA path (x A^T B^T on the sorted rows, the frozen weights without a gradient) against the
    grouped matmuls of the weights with B A added, with an empty expert and a static size's unused tail:
    the counted rows' outputs and the factors' gradients."""
    from moeflow.models.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 8, impl=impl)
    for w in (experts.w1, experts.w3, experts.w2):
        torch.nn.init.normal_(w, std=0.3)
    lora.add(experts, 4, 8.0, 0.0, "auto", True)
    factors = [name for name in lora.EXPERT_FACTORS if hasattr(experts, name)]
    for name in factors:
        torch.nn.init.normal_(getattr(experts, name), std=0.3)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(12, 16)  # 10 counted rows and a tail of 2
    y = experts(x, counts)
    y[:10].square().sum().backward()
    assert experts.w1.grad is None  # the base needs no gradient
    got = {n: getattr(experts, n).grad.clone() for n in factors}
    for name in factors:
        getattr(experts, name).grad = None
    from moeflow.models.moe import expert_matmuls

    w1, w3, w2 = (w + d for w, d in zip((experts.w1, experts.w3, experts.w2), experts.lora_deltas()))
    want = expert_matmuls(x, counts, w1, w3, w2, impl)
    want[:10].square().sum().backward()
    torch.testing.assert_close(y[:10], want[:10], rtol=REL, atol=REL)
    if impl != "grouped_mm":  # (grouped_mm leaves the tail unset; the combine never reads it)
        assert float(y[10:].abs().max()) == 0
    for name in factors:
        torch.testing.assert_close(got[name], getattr(experts, name).grad, rtol=1e-4, atol=1e-5)
