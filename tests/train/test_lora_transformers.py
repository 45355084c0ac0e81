"""LoRA on transformers' own modules (model.hf_impl = 'transformers') against peft itself: the adapted forward
equals PeftModel's on the same base and adapter (experts in the standard [E, out, in] layout, gpt-oss's transposed
and interleaved one with biases, MLA, a dense model); a run trains the adapters only, writes RUN_DIR/adapter/ that
PeftModel loads with `moeflow generate`'s loss, and exports merged weights transformers loads with that loss; (slow)
ep=2, dp=2 ZeRO-3, tp=2, pp=2, cp=2, ep=2 with recomputation and a stop under ep=2 resumed in one process train the
one-process run; bad settings are one line before any rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from moeflow.config import load_config  # noqa: E402
from moeflow.models import hf_transformers, lora  # noqa: E402
from moeflow.models.peft_format import write_adapter  # noqa: E402
from moeflow.train.trainer import train  # noqa: E402
from tests.support.cli import assert_one_line  # noqa: E402
from tests.support.hf_tiny import V, tiny_model  # noqa: E402
from tests.support.model_helpers import next_token_loss, random_lora_factors, steps  # noqa: E402

REL = 1e-5


def _folder(path, name: str):
    if name == "llama":  # a dense model on transformers' modules
        config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    else:
        model = tiny_model(name)
    model.save_pretrained(path)
    np.random.default_rng(0).integers(0, V, 20000).astype(np.uint16).tofile(path / "tokens.bin")
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # gpt-oss: experts stored transposed with gate and up interleaved, biases, attention sinks
    return _folder(tmp_path_factory.mktemp("gpt-oss"), "gpt_oss")


def _overrides(folder, run_dir, **more) -> dict:
    return {"model.hf_path": str(folder), "model.hf_impl": "transformers", "data.source": str(folder / "tokens.bin"),
            "data.seq_len": 16, "training.global_batch": 4, "training.steps": 4, "training.lr": 1e-2,
            "eval.every": 0, "metrics.tensorboard": False, "metrics.log_every": 1, "checkpoint.every": 2,
            "run_dir": str(run_dir), "peft.method": "lora", "peft.rank": 4, "peft.alpha": 8.0, **more}


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe", "mixtral", "deepseek_v2", "granitemoeshared", "llama"])
def test_the_adapted_forward_is_peft_model_s(tmp_path, name):
    """Random factors (B nonzero) on transformers' model, written in PEFT's format and loaded by
    PeftModel.from_pretrained on the folder: the same logits, and the same after merging them into the weights."""
    folder = _folder(tmp_path / "base", name)
    model = hf_transformers.load(folder).eval()
    job = load_config(None, _overrides(folder, tmp_path / "run"))
    lora.add(model, 4, 8.0, 0.0, "auto", True)
    factors = random_lora_factors(model)
    gen = torch.Generator().manual_seed(4)
    assert any(".experts.lora_" in n for n in factors) == (name != "llama")
    out = write_adapter(factors, job.model, job.peft, tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, out).eval()
    ids = torch.randint(0, V, (2, 12), generator=gen)
    with torch.no_grad():
        ours, want = model(ids).logits, theirs(ids).logits
        untouched = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
        assert (want - untouched).abs().max() > 0.1  # the adapter changes the output
        torch.testing.assert_close(ours, want, rtol=REL, atol=REL * want.abs().max().item())
        merged = lora.merge(model)(ids).logits
    torch.testing.assert_close(merged, want, rtol=REL, atol=REL * want.abs().max().item())


def test_a_run_trains_the_adapters_only_and_peft_loads_them(folder, tmp_path):
    from moeflow.cli import main as cli_main
    from moeflow.generate import load_model
    from moeflow.train.build import build
    from moeflow.train.distributed import DistInfo
    from moeflow.train.step import train_step

    cfg = load_config(None, _overrides(folder, tmp_path / "one"))
    s = build(cfg, DistInfo(0, 1, 0, torch.device("cpu")), *cfg.layout(1))
    before = {n: p.detach().clone() for n, p in s.model.named_parameters()}
    assert any(".experts.lora_gate_up_A" in n for n in before)
    for _ in range(2):
        train_step(cfg, s, with_moe_stats=False, measure=False, per_rank=lambda: {"peak_memory_mb": 0.0})
    assert all(lora.is_factor(n) == p.requires_grad for n, p in s.model.named_parameters())
    assert {id(p) for p in s.optimizer.state} == {id(p) for n, p in s.model.named_parameters() if lora.is_factor(n)}
    for n, p in s.model.named_parameters():
        assert (not torch.equal(p, before[n])) == lora.is_factor(n), n  # the base bit-identical, every factor moved

    train(cfg, fresh=True, progress=False)
    run = tmp_path / "one"
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(run / "checkpoints" / "step-4")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)  # the base is not re-saved
    ids = torch.from_numpy(np.fromfile(folder / "tokens.bin", dtype=np.uint16)[:33].astype(np.int64))[None]
    ours, *_ = load_model(str(run))  # what moeflow generate / eval run
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    untouched = next_token_loss(base, ids)
    theirs = peft.PeftModel.from_pretrained(base, run / "adapter").eval()
    assert next_token_loss(theirs, ids) == pytest.approx(next_token_loss(ours, ids), rel=REL)
    assert abs(next_token_loss(theirs, ids) - untouched) > 1e-3

    out = tmp_path / "merged"
    assert cli_main(["convert", "moeflow-to-hf", str(run), str(out), "--dtype", "fp32"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert next_token_loss(merged, ids) == pytest.approx(next_token_loss(ours, ids), rel=REL)


LAYOUTS = {"ep2": {"parallel.ep": 2}, "stop": {"parallel.ep": 2, "training.stop_at": 2},
           "dp2-zero3": {"parallel.zero": 3}, "tp2": {"parallel.tp": 2}, "pp2": {"parallel.pp": 2},
           "cp2": {"parallel.cp": 2}, "ep2-recompute": {"parallel.ep": 2, "training.activation_checkpointing": "full"}}


@pytest.mark.slow  # 40 s; CI checks the forward against peft's and a one-process run (the tests above)
@pytest.mark.parametrize("names", [["ep2", "stop", "dp2-zero3", "tp2", "pp2", "cp2", "ep2-recompute"]],
                         ids=["every-layout"])
def test_layouts_train_the_one_process_run(folder, tmp_path, names):
    """Each layout's LoRA run (2 ranks) trains the one-process losses and gradient norms, and writes its adapter;
    'stop' is ep=2 stopped at step 2 and resumed in one process (the experts' factors resharded)."""
    from safetensors.torch import load_file

    from tests.parallel.layout_worker import launch

    train(load_config(None, _overrides(folder, tmp_path / "one")), fresh=True, progress=False)
    argv = lambda run, **more: [f"--{k}={v}" for k, v in _overrides(folder, tmp_path / run, **more).items()]
    results = launch(2, [(n, argv(n, **LAYOUTS[n]), str(tmp_path / n), False) for n in names])
    assert set(results.values()) == {"ok"}, results
    if "stop" in names:
        train(load_config(None, _overrides(folder, tmp_path / "stop")), resume=True, progress=False)  # 1 process
    want = np.array(steps(tmp_path / "one"))
    adapter = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    for run in results:
        np.testing.assert_allclose(np.array(steps(tmp_path / run)), want, rtol=REL, err_msg=run)
        theirs = load_file(tmp_path / run / "adapter" / "adapter_model.safetensors")
        assert theirs.keys() == adapter.keys()
        for k, v in adapter.items():  # 4 AdamW steps at lr 1e-2 from the same start (measured: 6e-5 at most)
            torch.testing.assert_close(theirs[k], v, rtol=0, atol=1e-3 * float(v.abs().max()), msg=f"{run} {k}")


@pytest.mark.parametrize("changes, message", [
    ({"peft.rank": 33, "peft.modules": "q_proj"}, r"peft.rank = 33 is above the width of experts \(32\), the "
                                                  r"narrowest adapted layer; use peft.rank <= 32"),
    ({"peft.rank": 33, "peft.modules": "q_proj", "peft.experts": False}, None),  # q_proj is 64 wide
    ({"peft.modules": "q_proj,wq"}, r"peft.modules = 'q_proj,wq': this model has no linear layer named 'wq'; it "
                                    r"has k_proj, lm_head, o_proj, q_proj, v_proj \(or use 'auto'\)"),
    ({"peft.modules": "lm_head", "peft.experts": False}, None),  # the output head when named
])
def test_bad_settings_are_one_line_before_any_rank(folder, tmp_path, changes, message):
    assert_one_line(lambda: load_config(None, _overrides(folder, tmp_path / "r", **changes)).layout(2), message)
