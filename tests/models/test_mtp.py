"""Multi-token prediction: logits and loss against a naive reference written from the DeepSeek-V3 report (sec. 2.2),
training-only output, and Hugging Face DeepSeek-V3 checkpoints with MTP layers in and out, against transformers'
own MTP module. pp = 2 with MTP equals one process in tests/parallel/test_layouts_objective.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moeflow.core.model_config import ModelConfig, MoEConfig
from moeflow.models.mtp import split_mtp_logits
from moeflow.models.transformer import Transformer
from moeflow.parallel.runner import MTPObjective
from tests.support.cli import REPO
from tests.support.model_helpers import MLA_SMALL, SMALL

torch.set_num_threads(1)


def _model(depth: int, **changes) -> Transformer:
    cfg = ModelConfig(**{**SMALL, **MLA_SMALL, **changes}, mtp_depth=depth, mtp_loss_coef=0.3,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=24, num_shared_experts=1, score_func="sigmoid"))
    model = Transformer(cfg)
    model.init_weights(seed=11)
    with torch.no_grad():  # norms away from 1 so that a skipped or swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


@torch.no_grad()
def _naive(model: Transformer, tokens: torch.Tensor):
    """Per depth k: h'_i = eh_proj([enorm(emb(t_{i+k})); hnorm(h^{k-1}_i)]) for i = 0 .. S-1-k, one block, its
    norm, the shared head; L^k = -1/S sum_i log p^k_i(t_{i+k+1}) (eq. 24); loss = CE + lambda/D sum_k L^k (eq. 25).
    Written with loops over positions, from the model's parts."""
    x, S = tokens[:, :-1], tokens.shape[1] - 1
    cos, sin = model.rope_cos, model.rope_sin
    h = model.tok_embeddings(x)
    for block in model.layers.values():
        h = block(h, cos[:S], sin[:S])
    prev = model.norm(h)
    main = model.output(prev)
    logp = main.log_softmax(-1)
    ce = -sum(logp[b, i, tokens[b, i + 1]] for b in range(x.shape[0]) for i in range(S)) / (x.shape[0] * S)
    logits, terms = [main], []
    for k, module in enumerate(model.mtp.values(), start=1):
        rows = []
        for i in range(S - k):
            e = module.enorm(model.tok_embeddings(x[:, i + k]))
            rows.append(module.eh_proj(torch.cat([e, module.hnorm(prev[:, i])], dim=-1)))
        prev = module.norm(module.block(torch.stack(rows, dim=1), cos[:S - k], sin[:S - k]))
        logits.append(model.output(prev))
        logp = logits[-1].log_softmax(-1)
        nll = -sum(logp[b, i, tokens[b, i + k + 1]] for b in range(x.shape[0]) for i in range(S - k))
        terms.append(nll / (x.shape[0] * S))
    depth = len(terms)
    return logits, ce, sum(terms) / depth, ce + model.cfg.mtp_loss_coef / depth * sum(terms)


def test_mtp_logits_and_loss_equal_the_naive_reference():
    model = _model(depth=2)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    want_logits, want_ce, want_mtp, want_total = _naive(model, tokens)

    model.train()
    out = model(x)
    assert out.shape == (2, 12 + 11 + 10, SMALL["vocab_size"])
    for got, want in zip(split_mtp_logits(out, 12, 2), want_logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    objective = MTPObjective(lambda logits, t, reduction="mean": F.cross_entropy(logits.flatten(0, 1), t.flatten(),
                                                                                 reduction=reduction), 2, 0.3)
    scale = 1 / y.numel()  # the runner's scale: 1 / the trained main targets
    total = objective(out, y) * scale
    main, extra = objective.scaled(scale)
    assert total.item() == pytest.approx(want_total.item(), rel=1e-5)
    assert main.item() == pytest.approx(want_ce.item(), rel=1e-5)
    assert extra["mtp_loss"].item() == pytest.approx(want_mtp.item(), rel=1e-5)

    # its gradient reaches the MTP modules, and the embedding through both paths
    total.backward()
    assert model.mtp["1"].eh_proj.weight.grad.abs().sum() > 0
    assert model.mtp["0"].block.feed_forward.router.gate.weight.grad is not None

    # eval mode (and so generation) drops the MTP modules: the main logits only, the main loss
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), want_logits[0], rtol=1e-5, atol=1e-5)
        assert (objective(model(x), y) * scale).item() == pytest.approx(want_ce.item(), rel=1e-5)


def test_mtp_parameters_are_counted():
    model = _model(depth=2)
    assert sum(p.numel() for p in model.parameters()) == model.cfg.num_params()
    # the formula for the MTP modules alone, against the modules built (num_params adds mtp_params itself)
    assert sum(p.numel() for p in model.mtp.parameters()) == model.cfg.mtp_params()
    from moeflow.core.parallel_dims import ParallelDims

    with pytest.raises(ValueError, match="mtp_depth = 1 with parallel.tp = 2"):
        ParallelDims(2, tp=2).check_model(ModelConfig(mtp_depth=1))


# ------------------------------------------------------------------------- Hugging Face DeepSeek-V3 with MTP

transformers = pytest.importorskip("transformers")


def _randomize(*modules):
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in modules:
            for name, p in module.named_parameters():
                noise = torch.randn(p.shape, generator=gen)
                scale = 1.0 if "embed" in name else p.shape[-1] ** -0.5
                p.copy_(1 + 0.2 * noise if "norm" in name else noise * scale)
            for name, b in module.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def _released_layout(mtp, hf, layer: int) -> dict[str, torch.Tensor]:
    """transformers' MtpModel weights under the names DeepSeek-V3's released checkpoints use for layer
    num_hidden_layers (one tensor per expert, and copies of the embedding and head), as written by hand here."""
    out = {}
    for name, value in mtp.state_dict().items():
        if name in ("embed_tokens.weight", "shared_head.weight"):  # the main model's, tied
            continue
        rest = name.removeprefix("layers.0.").replace("post_norm.", "shared_head.norm.").removeprefix("mtp_block.")
        prefix = f"model.layers.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # [E, 2F, D]: gate rows, then up rows
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = value[e, :half].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = value[e, half:].clone()
        elif rest == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e].clone()
        else:
            out[prefix + rest] = value.clone()
    out[f"model.layers.{layer}.embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
    out[f"model.layers.{layer}.shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_hf_deepseek_v3_with_mtp_loads_and_saves_back(tmp_path):
    """A tiny transformers DeepSeek-V3 (num_nextn_predict_layers = 1) saved by transformers, plus its MTP layer in the
    released layout: transformers' MtpModel reads that layer back (so the layout is right), moeflow loads every
    tensor (none skipped) with main and MTP logits equal to transformers', and saves the same tensors back."""
    from safetensors.torch import save_file
    from transformers.modeling_layers import MtpModel

    from moeflow.models.hf import from_pretrained, save_pretrained

    if not hasattr(MtpModel, "forward_layer"):  # the reference call below; transformers 5.17 lacks it, 5.24 has it
        pytest.skip(f"transformers {transformers.__version__}'s MtpModel has no forward_layer")

    transformers.logging.set_verbosity_error()
    cfg = transformers.DeepseekV3Config(
        vocab_size=96, max_position_embeddings=64, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=2,
        routed_scaling_factor=2.5, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, num_nextn_predict_layers=1,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    mtp = MtpModel(hf, 1)
    _randomize(hf, mtp)
    hf.save_pretrained(tmp_path)
    main_file = tmp_path / "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors").rename(main_file)
    mtp_tensors = _released_layout(mtp, hf, layer=3)
    save_file(mtp_tensors, str(tmp_path / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(_tensors(tmp_path).keys() - mtp_tensors.keys(), main_file.name),
                  **dict.fromkeys(mtp_tensors, "model-00002-of-00002.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    hf_main = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    # transformers' class names layer 61 (the real model's); point its own MTP loader at this model's layer 3
    hf_main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
    hf_mtp = MtpModel.from_pretrained(hf_main).eval()
    for (name, want), (name2, got) in zip(sorted(mtp.state_dict().items()), sorted(hf_mtp.state_dict().items())):
        assert name == name2 and torch.equal(got, want), name

    model, mcfg = from_pretrained(tmp_path)
    assert mcfg.mtp_depth == 1
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # transformers' MTP input: the main model's last hidden state (after its final norm) at positions
        # 0..S-2 with the tokens one ahead (their position ids, 1..S-1; RoPE is relative, so the shift is invisible)
        last = hf_main.model(tokens).last_hidden_state
        positions = torch.arange(1, 12).expand(2, -1)
        want_mtp = hf_mtp._project_to_logits(hf_mtp.forward_layer(0, last[:, :-1], positions, None,
                                                                  input_ids=tokens[:, 1:]))
        want_main = hf_main(tokens).logits
        model.train()
        got_main, got_mtp = split_mtp_logits(model(tokens), 12, 1)
    torch.testing.assert_close(got_main, want_main, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_mtp, want_mtp, rtol=0, atol=1e-5)

    save_pretrained(model, mcfg, tmp_path / "back")
    written, original = _tensors(tmp_path / "back"), _tensors(tmp_path)
    assert written.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    # a copy of the embedding that differs from the embedding cannot be shared: refused, naming the tensor
    mtp_tensors["model.layers.3.embed_tokens.weight"] += 1.0
    save_file(mtp_tensors, str(tmp_path / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.3.embed_tokens.weight .* differs"):
        from_pretrained(tmp_path)


def test_deepseek_v3_tiny_recipe_trains(tmp_path):
    """configs/deepseek-v3-tiny.toml: the objective is what its comments say, and two steps log an MTP loss."""
    from moeflow.config import load_config
    from moeflow.train.trainer import train

    root = REPO
    cfg = load_config(root / "configs" / "deepseek-v3-tiny.toml", {
        "run_dir": str(tmp_path), "training.steps": 2, "training.global_batch": 2, "data.seq_len": 32,
        "data.max_bytes": 50000, "metrics.log_every": 1, "metrics.tensorboard": False, "eval.every": 0,
        "checkpoint.enabled": False, "parallel.ep": 1})  # one process here
    m = cfg.model
    assert (m.attention, m.mtp_depth, m.mtp_loss_coef) == ("mla", 1, 0.3)
    assert (m.moe.aux_loss_type, m.moe.aux_loss_coef, m.moe.load_balance, m.moe.score_func) == (
        "sequence", 1e-4, "aux_free", "sigmoid")
    train(cfg, fresh=True, progress=False)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and all(r["mtp_loss"] > 0 for r in lines)
    assert str(m.n_layers) in lines[-1]["moe"]  # the MTP block's router (layer n_layers) is logged too
