"""checkpoint.save_hf: under ep=2 each rank writes its share of RUN_DIR/hf/ from the last checkpoint, and the
folder holds exactly the tensors `moeflow convert moeflow-to-hf` writes from the same checkpoint in one process,
which transformers loads with the trained model's loss (bf16 weights: within bf16's resolution); for a native
preset, for a run that started from a Hugging Face folder on moeflow's modules and one on transformers' own modules
(written in the folder's on-disk format: per-expert tensors, as transformers saved it). Bad settings are one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from moeflow.config import load_config  # noqa: E402
from moeflow.convert import export_source, moeflow_to_hf, native_model  # noqa: E402
from tests.parallel.layout_worker import BASE, launch  # noqa: E402
from tests.support.cli import assert_one_line  # noqa: E402

V = 96


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_each_rank_writes_its_share_and_transformers_loads_the_trained_model(tmp_path):
    cfg = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=48, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=64)
    torch.manual_seed(0)
    start = tmp_path / "start"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(start)
    data = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, V, 20000).astype(np.uint16).tofile(data)
    hf_argv = [f"--model.hf_path={start}", f"--data.source={data}", "--data.seq_len=16", "--training.global_batch=4",
               "--training.steps=2", "--eval.every=0", "--metrics.tensorboard=false"]
    runs = {"native": [*BASE], "hf-started": hf_argv, "transformers": [*hf_argv, "--model.hf_impl=transformers"]}
    cases = [(name, [*argv, "--parallel.ep=2", "--checkpoint.save_hf=true", f"--run_dir={tmp_path / name}"],
              str(tmp_path / name), False) for name, argv in runs.items()]
    assert launch(2, cases) == dict.fromkeys(runs, "ok")
    for name in runs:
        run = tmp_path / name
        hf = run / "hf"
        assert not (run / "hf.tmp").exists()
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                             "model-00002-of-00002.safetensors"]
        reference = moeflow_to_hf(run, tmp_path / f"{name}-converted")
        got, want = _tensors(hf), _tensors(reference)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
        assert json.loads((hf / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
        # transformers' model from the folder against the trained model moeflow holds (fp32)
        side = lambda folder: sorted(p.name for p in folder.iterdir() if "safetensors" not in p.name)
        assert side(hf) == side(reference), name  # config.json, the tokenizer and generation files
        if name == "transformers":  # the start folder's on-disk names (transformers saves Qwen3-MoE per expert)
            assert got.keys() == _tensors(start).keys()
        if name != "native":  # the trained weights, not the start's (two steps hardly move the loss)
            began = _tensors(start)
            assert sum(not torch.equal(got[k], began[k].to(got[k].dtype)) for k in got) > len(got) // 2, name
        trained = _trained(run)
        ids = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(0))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        with torch.no_grad():
            want_loss = F.cross_entropy(trained(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            got_loss = F.cross_entropy(loaded(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())
        # bf16 weights: each rounded by at most 2^-9 relative; through a few layers the loss moves by ~1e-3
        assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-2), name


def _trained(run):
    """The trained model in fp32, as the run's last checkpoint holds it: moeflow's, or transformers' own."""
    from moeflow.convert import _load_model_state
    from moeflow.models import hf_transformers

    job = load_config(run / "config.toml")
    checkpoint = max((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    if job.model.runs_transformers:
        model = hf_transformers.load(job.model.hf_path).eval()
        _load_model_state(checkpoint, model)
        return lambda ids: model(ids).logits
    return native_model(job, export_source(job.model, run)[0], checkpoint)  # an HF-started run: the folder's model


@pytest.mark.parametrize("changes, message", [
    ({"checkpoint.enabled": False}, r"checkpoint.save_hf = true with checkpoint.enabled = false"),
    ({"peft.method": "lora"}, r"checkpoint.save_hf = true on a LoRA run"),
])
def test_bad_save_hf_settings_are_one_line(changes, message):
    assert_one_line(lambda: load_config(None, {"checkpoint.save_hf": True, **changes}).layout(1), message)


@pytest.mark.parametrize("original_format", [True, False])
def test_the_conversions_found_from_headers_are_the_ones_from_pretrained_records(tmp_path, original_format):
    """Qwen3-MoE saved per expert (transformers' default) or fused: the folder is written back the same way."""
    from transformers.core_model_loading import revert_weight_conversion

    from moeflow.models import hf_transformers
    from moeflow.train.save_hf import _loaded_conversions

    cfg = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=48, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path, save_original_format=original_format)
    meta = hf_transformers.load(tmp_path, "meta")
    found = _loaded_conversions(meta, tmp_path)
    recorded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)._weight_conversions
    assert [repr(c) for c in found] == [repr(c) for c in recorded]
    meta._weight_conversions = found
    written = revert_weight_conversion(meta, {k: torch.zeros(v.shape) for k, v in meta.state_dict().items()})
    assert written.keys() == _tensors(tmp_path).keys()
