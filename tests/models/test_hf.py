"""Hugging Face interop, with transformers as the independent reference (no downloads).

For each supported architecture a tiny random transformers model is saved by transformers itself; moeflow loads
it and must give the same logits, write it back so that transformers loads identical tensors, and train the same
first steps. Then: sharded and fused-expert checkpoints, moeflow's MoE swapped into a live transformers model,
the convert CLI round trip, and every bad-input message.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from moeflow.cli import main as cli_main  # noqa: E402
from moeflow.config import JobConfig, load_config, to_toml  # noqa: E402
from moeflow.core.model_config import ModelConfig, MoEConfig  # noqa: E402
from moeflow.models.hf import from_pretrained, load_for_training, save_pretrained  # noqa: E402
from moeflow.models.hf_live import replace_sparse_moe_blocks  # noqa: E402
from moeflow.models.moe import MoE  # noqa: E402
from tests.support.hf_models import V, hf_configs, randomize  # noqa: E402

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
TOL = 1e-5


MOE_ARCHS = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v3_plain", "glm4_moe"]


@dataclass
class Saved:
    name: str
    folder: Path
    hf: torch.nn.Module  # the transformers model that wrote `folder` (eval mode; do not train it)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    configs, built = hf_configs(), {}

    def get(name: str) -> Saved:
        if name not in built:
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(configs[name])
            randomize(hf, seed=len(built))
            folder = tmp_path_factory.mktemp(name)
            hf.save_pretrained(folder)
            built[name] = Saved(name, folder, hf.eval())
        return built[name]

    return get


@pytest.fixture(params=list(hf_configs()))
def case(request, store) -> Saved:
    return store(request.param)


@pytest.fixture(params=MOE_ARCHS)
def moe_case(request, store) -> Saved:
    return store(request.param)


def tokens(batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]), k


# ---- logits, both directions --------------------------------------------------------------------------------


@torch.no_grad()
def test_logits_match_transformers(case):
    model, cfg = from_pretrained(case.folder)
    x = tokens()
    ref = case.hf(x).logits
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero numbers
    assert max_diff(model(x), ref) <= TOL
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params() == case.hf.num_parameters()


@torch.no_grad()
def test_save_pretrained_loads_in_transformers_with_identical_tensors(case, tmp_path):
    model, cfg = from_pretrained(case.folder)
    save_pretrained(model, cfg, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is type(case.hf)
    assert_same_state(back, case.hf)
    x = tokens()
    assert max_diff(back(x).logits, case.hf(x).logits) <= TOL


def test_first_training_steps_match(case):
    """Same loss (HF shifts labels inside; moeflow's caller does), and the same loss after one AdamW step."""
    model, _ = from_pretrained(case.folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(case.folder)  # a fresh copy to train
    hf.train()
    model.train()
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.1)
    opt_mf = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    x = tokens(batch=4, seq=16, seed=2)
    for _ in range(2):
        loss_hf = hf(input_ids=x, labels=x).loss
        logits = model(x)
        loss_mf = F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
        assert abs(loss_hf.item() - loss_mf.item()) <= TOL
        for loss, opt in ((loss_hf, opt_hf), (loss_mf, opt_mf)):
            loss.backward()
            opt.step()
            opt.zero_grad()


def test_config_round_trips_through_toml(case, tmp_path):
    _, cfg = from_pretrained(case.folder)
    job = JobConfig(model=cfg.replace(hf_path=""))
    job.data.seq_len = 32
    (tmp_path / "c.toml").write_text(to_toml(job))
    assert load_config(tmp_path / "c.toml").model == cfg.replace(hf_path="")


# ---- checkpoint layouts -------------------------------------------------------------------------------------


@torch.no_grad()
def test_sharded_round_trip(store, tmp_path):
    saved = store("deepseek_v3")
    model, cfg = from_pretrained(saved.folder)
    out = save_pretrained(model, cfg, tmp_path / "ours", max_shard_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3 and not (out / "model.safetensors").exists()
    assert all((out / s).is_file() for s in shards)
    x = tokens()
    again, _ = from_pretrained(out)
    assert torch.equal(again(x), model(x))
    assert_same_state(transformers.AutoModelForCausalLM.from_pretrained(out), saved.hf)
    # ... and transformers' own sharded save loads in moeflow
    saved.hf.save_pretrained(tmp_path / "theirs", max_shard_size="30KB")
    assert (tmp_path / "theirs" / "model.safetensors.index.json").is_file()
    theirs, _ = from_pretrained(tmp_path / "theirs")
    assert torch.equal(theirs(x), model(x))


@torch.no_grad()
def test_fused_expert_checkpoint_loads(moe_case, tmp_path):
    """transformers 5 can also save its in-memory layout (gate_up_proj [E, 2F, D], down_proj [E, D, F])."""
    moe_case.hf.save_pretrained(tmp_path, save_original_format=False)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert any(k.endswith("experts.gate_up_proj") for k in f.keys())
    model, _ = from_pretrained(tmp_path)
    x = tokens()
    assert max_diff(model(x), moe_case.hf(x).logits) <= TOL


# ---- moeflow's MoE inside a live transformers model ---------------------------------------------------------


def test_replace_sparse_moe_blocks_keeps_logits_and_trains(moe_case):
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_case.folder).eval()
    x = tokens()
    with torch.no_grad():
        before = hf(x).logits
    dense_layers = len(getattr(hf.config, "mlp_only_layers", None) or []) or getattr(hf.config,
                                                                                   "first_k_dense_replace", 0)
    assert replace_sparse_moe_blocks(hf) == hf.config.num_hidden_layers - dense_layers
    assert isinstance(hf.model.layers[-1].mlp, MoE)
    with torch.no_grad():
        assert max_diff(hf(x).logits, before) <= TOL
    hf(input_ids=x, labels=x).loss.backward()
    assert hf.model.layers[-1].mlp.experts.w2.grad.abs().sum() > 0
    assert replace_sparse_moe_blocks(hf) == 0  # nothing left to replace


def test_replace_refuses_router_logits_output(store):
    hf = transformers.AutoModelForCausalLM.from_pretrained(store("mixtral").folder, output_router_logits=True)
    with pytest.raises(ValueError, match="output_router_logits = True"):
        replace_sparse_moe_blocks(hf)


# ---- training from a Hugging Face folder, and the convert CLI -----------------------------------------------


def test_load_for_training_keeps_training_knobs(store):
    saved = store("qwen3_moe")
    asked = ModelConfig(hf_path=str(saved.folder), moe=MoEConfig(expert_impl="bmm", aux_loss_coef=0.01))
    model, cfg = load_for_training(asked)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.dim, cfg.hf_path) == (6, 1, 48, str(saved.folder))
    assert (cfg.moe.expert_impl, cfg.moe.aux_loss_coef) == ("bmm", 0.01)
    assert model.layers["2"].feed_forward.experts.impl == "bmm"


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3"])
def test_convert_cli_round_trip(store, tmp_path, name):
    saved = store(name)
    src = tmp_path / "src"
    shutil.copytree(saved.folder, src)
    (src / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    run, back = tmp_path / "run", tmp_path / "back"
    assert cli_main(["convert", "hf-to-moeflow", str(src), str(run)]) == 0
    assert (run / "checkpoints" / "step-0" / "COMPLETE.json").is_file()
    assert (run / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    assert load_config(run / "config.toml").model.n_layers == saved.hf.config.num_hidden_layers
    # from the run directory, and from the checkpoint folder itself
    assert cli_main(["convert", "moeflow-to-hf", str(run), str(back), "--dtype", "fp32"]) == 0
    assert cli_main(["convert", "moeflow-to-hf", str(run / "checkpoints" / "step-0"), str(tmp_path / "b2"),
                     "--dtype", "fp32", "--max-shard-size", "40KB"]) == 0
    from safetensors.torch import load_file

    original, converted = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert original.keys() == converted.keys()
    assert all(torch.equal(original[k], converted[k]) for k in original)
    assert (back / "tokenizer.json").is_file()
    hf_back = json.loads((back / "config.json").read_text())
    assert hf_back["eos_token_id"] == saved.hf.config.eos_token_id
    assert_same_state(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b2"), saved.hf)


def test_convert_help_explains(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["convert", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "hf-to-moeflow" in out and "moeflow-to-hf" in out and "config.toml" in out


# ---- bad input ----------------------------------------------------------------------------------------------


def _copy(saved: Saved, dst: Path) -> Path:
    shutil.copytree(saved.folder, dst)
    return dst


def _rewrite(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    hf = json.loads((folder / "config.json").read_text())
    hf.update(changes)
    (folder / "config.json").write_text(json.dumps(hf))


def test_bad_folders_are_named(store, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json; pass a Hugging Face model folder"):
        from_pretrained(tmp_path / "empty")
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    shutil.copy(store("llama").folder / "config.json", only_config)
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        from_pretrained(only_config)


def test_unsupported_architecture_lists_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported architectures: LlamaForCausalLM, "
                                         r"Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "RoPE scaling of type 'linear'"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config \\(fp8\\).*dequantize"),
    (dict(hidden_act="gelu"), "hidden_act = 'gelu'.*SwiGLU"),
    (dict(mlp_bias=True), "mlp_bias = True.*no biases"),
])
def test_unsupported_config_features_are_named(store, tmp_path, changes, message):
    folder = _copy(store("llama"), tmp_path / "m")
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message):
        from_pretrained(folder)


def test_missing_extra_and_misshapen_tensors_are_named(store, tmp_path):
    missing = _copy(store("mixtral"), tmp_path / "missing")
    _rewrite(missing, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors .*: model\.layers\.1\.block_sparse_moe\.experts\.3\.w2"):
        from_pretrained(missing)

    extra = _copy(store("mixtral"), tmp_path / "extra")
    _rewrite(extra, lambda t: t.update({"model.layers.1.mlp.surprise.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"has 1 tensors that .* does not use: model\.layers\.1\.mlp\.surprise"):
        from_pretrained(extra)

    shape = _copy(store("mixtral"), tmp_path / "shape")
    _rewrite(shape, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(48, 48)}))
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.self_attn\.k_proj\.weight in model\.safetensors "
                                         r"has shape \[48, 48\] but config\.json implies \[24, 48\]"):
        from_pretrained(shape)


def test_truncated_and_incomplete_files_are_named(store, tmp_path):
    cut = _copy(store("olmoe"), tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated: it has \d+ bytes but its header describes"):
        from_pretrained(cut)
    (cut / "model.safetensors").write_bytes(data[:4])
    with pytest.raises(ValueError, match="truncated or not a safetensors file"):
        from_pretrained(cut)

    model, cfg = from_pretrained(store("olmoe").folder)
    sharded = save_pretrained(model, cfg, tmp_path / "sharded", max_shard_bytes=20_000)
    second = sorted(sharded.glob("model-*.safetensors"))[1]
    second.unlink()
    with pytest.raises(ValueError, match=f"lists {second.name}, which is not in"):
        from_pretrained(sharded)


def test_export_refuses_what_the_architecture_cannot_express(tmp_path):
    from moeflow.models.transformer import Transformer

    cfg = ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, ffn_dim=32, max_seq_len=32,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=16, num_shared_experts=1, load_balance="none"))
    with pytest.raises(ValueError, match=r"cannot be written as MixtralForCausalLM: moe\.num_shared_experts = 1"):
        save_pretrained(Transformer(cfg), cfg, tmp_path, architecture="MixtralForCausalLM")
    cfg = cfg.replace(moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=16, load_balance="aux_free"))
    model = Transformer(cfg)
    model.layers["1"].feed_forward.router.update_bias(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match=r"router\.expert_bias is nonzero .* MixtralForCausalLM has no expert bias"):
        save_pretrained(model, cfg, tmp_path)


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    assert cli_main(["convert", "hf-to-moeflow", str(tmp_path / "nowhere"), str(tmp_path / "run")]) == 2
    assert "moeflow convert: error: Hugging Face folder" in capsys.readouterr().err
    assert cli_main(["convert", "moeflow-to-hf", str(tmp_path), str(tmp_path / "hf")]) == 2
    assert "is not a complete moeflow checkpoint: COMPLETE.json is missing" in capsys.readouterr().err


def test_an_empty_low_precision_model_is_never_allocated_in_fp32(monkeypatch):
    """build_empty (generate / eval --dtype bf16) casts on the meta device: the parameters are allocated in bf16 (a
    GPU may hold the bf16 model and not the fp32 one), the RoPE tables and router biases in fp32, the tables equal
    a normally built model's."""
    from moeflow.models.hf import build_empty
    from moeflow.models.transformer import Transformer

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=16))
    allocated = []
    to_empty = torch.nn.Module.to_empty

    def record(module, **kwargs):
        allocated.extend(p.dtype for p in module.parameters())
        return to_empty(module, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to_empty", record)
    model = build_empty(cfg, torch.bfloat16)
    assert set(allocated) == {torch.bfloat16}
    want = dict(Transformer(cfg).named_buffers())
    for name, buf in model.named_buffers():
        assert buf.dtype == torch.float32, name
        if name.startswith("rope_"):
            assert torch.equal(buf, want[name]), name
