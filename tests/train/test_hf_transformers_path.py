"""`moeflow train --model.hf_path` on transformers' own modules (model.hf_impl = 'transformers'), for a tiny
gpt-oss folder, an architecture moeflow's own model does not map (attention sinks, sliding windows, biased and
interleaved experts, clamped SwiGLU): the first loss is transformers' own; ep=2 and dp=2 (each rank reading its
own part of the folder) train the one-process losses and gradient norms; a run stopped under ep=2 resumes in one
process as the uninterrupted run; the export gives `moeflow eval`'s loss in transformers; and what is not
supported is refused in one line before any rank starts. Every loss comparison relative REL (fp32)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from moeflow.config import load_config  # noqa: E402
from moeflow.train.build import build, parallel_options  # noqa: E402
from moeflow.train.distributed import DistInfo  # noqa: E402
from moeflow.train.trainer import train  # noqa: E402
from tests.support.cli import assert_one_line  # noqa: E402
from tests.support.hf_models import V, randomize  # noqa: E402
from tests.support.model_helpers import steps  # noqa: E402

REL = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = transformers.GptOssConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    randomize(model, seed=1)
    path = tmp_path_factory.mktemp("gpt-oss")
    model.save_pretrained(path)
    data = path / "tokens.bin"
    np.random.default_rng(0).integers(0, V, 20000).astype(np.uint16).tofile(data)
    return path


def _overrides(folder, run_dir, **more) -> dict:
    return {"model.hf_path": str(folder), "data.source": str(folder / "tokens.bin"), "data.seq_len": 16,
            "training.global_batch": 4, "training.steps": 4, "eval.every": 0, "eval.batches": 1,
            "metrics.tensorboard": False, "metrics.log_every": 1, "checkpoint.every": 2, "run_dir": str(run_dir),
            **more}


def _routing(run_dir) -> list[dict[str, list[int]]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{layer: stats["tokens_per_expert"] for layer, stats in r["moe"].items()} for r in rows]


def test_the_run_is_transformers_model_from_its_first_loss(folder, tmp_path):
    cfg = load_config(None, _overrides(folder, tmp_path / "one"))
    assert cfg.model.runs_transformers and cfg.model.moe.num_experts == 4  # auto: gpt-oss is not mapped natively
    s = build(cfg, DistInfo(0, 1, 0, torch.device("cpu")), *cfg.layout(1))
    assert type(s.model).__name__ == "GptOssForCausalLM"
    first = s.sampler.next_batch()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        want = float(F.cross_entropy(hf(first.inputs).logits.flatten(0, 1), first.targets.flatten()))
    summary = train(cfg, fresh=True, progress=False)
    assert steps(tmp_path / "one")[0][0] == pytest.approx(want, rel=REL)
    assert summary["model"].startswith("GptOssForCausalLM (transformers")


def test_layouts_and_a_resharded_resume_train_the_one_process_run(folder, tmp_path):
    """ep=2 (FSDP2 over the same ranks), dp=2 ZeRO-3, ep=2 with every block recomputed, tp=2 (the MoE folded over
    tp, the attention sinks sharded with their heads), pp=2 (a layer per stage), cp=2 (each sequence's halves,
    the sliding window reaching across them), and ep=2 stopped at step 2 then resumed in one process:
    every step's loss and gradient norm equal the one-process run's; then the export loads in transformers with
    `moeflow eval`'s loss, and `moeflow generate` gives transformers' greedy tokens."""
    from moeflow.cli import main as cli_main
    from tests.parallel.layout_worker import launch

    train(load_config(None, _overrides(folder, tmp_path / "one")), fresh=True, progress=False)
    argv = lambda run, **more: [f"--{k}={v}" for k, v in _overrides(folder, tmp_path / run, **more).items()]
    results = launch(2, [("ep2", argv("ep2", **{"parallel.ep": 2}), str(tmp_path / "ep2"), False),
                         ("dp2", argv("dp2", **{"parallel.zero": 3}), str(tmp_path / "dp2"), False),
                         ("ep2-recompute", argv("ep2-recompute", **{"parallel.ep": 2,
                                                                    "training.activation_checkpointing": "full"}),
                          str(tmp_path / "ep2-recompute"), False),
                         ("tp2", argv("tp2", **{"parallel.tp": 2}), str(tmp_path / "tp2"), False),
                         ("pp2", argv("pp2", **{"parallel.pp": 2}), str(tmp_path / "pp2"), False),
                         ("cp2", argv("cp2", **{"parallel.cp": 2}), str(tmp_path / "cp2"), False),
                         ("stop", argv("stop", **{"parallel.ep": 2, "training.stop_at": 2}), str(tmp_path / "stop"),
                          False)])
    assert set(results.values()) == {"ok"}, results
    train(load_config(None, _overrides(folder, tmp_path / "stop")), resume=True, progress=False)  # 1 process
    want = np.array(steps(tmp_path / "one"))
    for run in results:
        np.testing.assert_allclose(np.array(steps(tmp_path / run)), want, rtol=REL, err_msg=run)
    # the routing moeflow reads from transformers' MoE blocks: every logged step's tokens per expert, counted once
    # per token whatever the layout (tp's folded ranks each count their slice, pp's stages their layers)
    for run in results:
        assert _routing(tmp_path / run) == _routing(tmp_path / "one"), run
    assert all(sum(count) == 4 * 16 * 2 for step in _routing(tmp_path / "one") for count in step.values())
    # each rank read its own part of the folder (the runs above start from it): under ep=2 half the experts
    read = json.loads((tmp_path / "ep2" / "summary.json").read_text())["hf_bytes_read_rank0"]
    on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert read < 0.75 * on_disk, (read, on_disk)

    out = tmp_path / "exported"
    assert cli_main(["convert", "moeflow-to-hf", str(tmp_path / "stop"), str(out), "--dtype", "fp32"]) == 0
    from moeflow.generate import generate, load_model

    model, *_ = load_model(str(tmp_path / "stop"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.fromfile(folder / "tokens.bin", dtype=np.uint16)[:33].astype(np.int64))[None]
    with torch.no_grad():
        ours = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[0, 1:])
        theirs = F.cross_entropy(exported(ids[:, :-1]).logits.flatten(0, 1), ids[0, 1:])
    assert float(theirs) == pytest.approx(float(ours), rel=REL)
    prompt = ids[0, :5].tolist()
    assert generate(model, prompt, 8, temperature=0.0) == exported.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)[0, 5:].tolist()


@pytest.mark.parametrize("changes, message", [
    ({"parallel.pp": 2}, None),  # taken: one stage per rank
    ({"parallel.cp": 2}, None),  # taken: through transformers' attention interface
    ({"training.optimizer": "muon"}, None),  # taken
    ({"training.optimizer": "muon", "training.muon_clip": 100.0},
     r"training.muon_clip = 100.0 for this run: transformers' own modules do not record the attention logits"),
    ({"parallel.tp": 2}, None),  # taken: the MoE folded over tp
    ({"parallel.tp": 2, "data.seq_len": 15}, r"data.seq_len \(15\) must be divisible by parallel.tp \(2\)"),
    ({"training.fp8": "tensorwise"}, r"training.fp8 = 'tensorwise' for .* on transformers' own modules"),
    ({"parallel.ep": 2}, None),  # taken
    ({"parallel.ep": 2, "training.compile": True}, None),  # taken: the token mover runs eagerly in the blocks
    ({"parallel.ep": 2, "parallel.ep_overlap_chunks": 2, "parallel.ep_overlap": True}, None),  # taken
    # settings the folder decides: one line, not silently the folder's value
    ({"model.dim": 64}, r"model.dim = 64 with model.hf_path = .*: the folder's config.json decides the "
                        r"architecture, and gives model.dim = 32; drop model.dim"),
    ({"model.max_seq_len": 8192, "data.seq_len": 8192}, r"model.max_seq_len = 8192 with model.hf_path"),  # (first)
    ({"model.moe.capacity_factor": 1.25}, r"model.moe.capacity_factor = 1.25 with model.hf_path = .*: a setting "
                                          r"of moeflow's own MoE layer, .*; drop model.moe.capacity_factor"),
    ({"model.moe.bias_update_rate": 0.01}, None),  # taken: the selection bias's speed, where it has one
    ({"parallel.tp": 2, "parallel.ep_num_worst_tokens": -1},  # the experts split over tp too (ep_over_tp)
     r"parallel.ep_num_worst_tokens = -1 on transformers' own experts modules"),
    ({"parallel.ep": 2, "parallel.ep_num_worst_tokens": -1},
     r"parallel.ep_num_worst_tokens = -1 on transformers' own experts modules: .*; use 0"),
    ({"model.hf_impl": "native"}, r"config.json describes \['GptOssForCausalLM'\], which moeflow cannot load"),
])
def test_what_is_not_supported_is_one_line_before_any_rank(folder, tmp_path, changes, message):
    assert_one_line(lambda: load_config(None, _overrides(folder, tmp_path / "r", **changes)).layout(2), message)


def test_a_fresh_start_may_take_a_folder_whose_architecture_differs(folder, tmp_path):
    """A run directory's config.toml holds every setting: with --fresh and a new model.hf_path its old model's
    values give way to the folder's, and only what the user gives now is checked against the folder."""
    from moeflow.config import load_run_config, to_toml

    run = tmp_path / "r"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(load_config(None, {"model.name": "tiny-moe"})))
    new = {"model.hf_path": str(folder), "data.seq_len": 16}
    cfg = load_run_config(run, new, model_may_change=True)
    assert cfg.model.runs_transformers and cfg.model.dim == 32
    with pytest.raises(ValueError, match=r"model.dim = 64 with model.hf_path"):
        load_run_config(run, {**new, "model.dim": 64}, model_may_change=True)


def _tiny_folder(arch: str, path):
    from tests.support.hf_tiny import tiny_model

    tiny_model(arch, seed=0).save_pretrained(path)
    np.random.default_rng(0).integers(0, V, 2000).astype(np.uint16).tofile(path / "tokens.bin")
    return path


@pytest.mark.parametrize("changes, message", [
    ({}, r"parallel.pp = 2 for .*: layer 4 reads .* puts layer 2 on stage 0 and layer 4 on stage 1 "
         r"\(parallel.pp_boundaries = '0,2' keeps each reader"),
    ({"parallel.pp_boundaries": "0,2"}, None),  # layers 0-1 | 2-5: each reader on its source's stage
    ({"parallel.pp_boundaries": "0,5"},  # layers 0-4 | 5
     r"parallel.pp = 2 \(parallel.pp_boundaries = '0,5'\) for .*: layer 5 reads the keys and values layer 3 "),
    ({"parallel.pp_boundaries": "0,1,2,4", "parallel.pp_schedule": "Interleaved1F1B"},  # 4 stages, 2 per rank
     r"transformers' modules run one pipeline stage per rank; parallel.pp_schedule = 'Interleaved1F1B'"),
    ({"parallel.pp_boundaries": "1,3"}, r"parallel.pp_boundaries = '1,3' must start at 0 and strictly increase below "
     r"model.n_layers = 6 \(at least one layer a stage\): it is the first layer of each stage, comma-separated \(the "
     r"even split is '0,3'\)"),
    ({"parallel.pp_boundaries": "0,6"}, r"parallel.pp_boundaries = '0,6' must start at 0 .* is '0,3'"),
    ({"parallel.pp_boundaries": "0,3,1"}, r"parallel.pp_boundaries = '0,3,1' has 3 entries for the 2 stages of "
     r"parallel.pp = 2 with parallel.pp_schedule = '1F1B': .* is '0,3'"),
    ({"parallel.pp_boundaries": "0;2"}, r"parallel.pp_boundaries = '0;2'; use the first layer of each stage"),
    ({"parallel.pp_boundaries": "0,2", "parallel.pp": 1}, r"parallel.pp_boundaries = '0,2' with parallel.pp = 1"),
])
def test_the_pipeline_split_is_a_setting_checked_before_any_rank(tmp_path, changes, message):
    # Gemma 4 with two KV-shared layers: layers 4 and 5 read layer 2's and layer 3's keys and values, so the even
    # split is refused and parallel.pp_boundaries picks one that keeps them together
    from tests.support.hf_tiny import tiny_config

    folder = tmp_path / "gemma4"
    config = tiny_config("gemma4", num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                         num_kv_shared_layers=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    np.random.default_rng(0).integers(0, config.vocab_size, 2000).astype(np.uint16).tofile(folder / "tokens.bin")
    overrides = _overrides(folder, tmp_path / "r", **{"parallel.pp": 2, **changes})
    assert_one_line(lambda: load_config(None, overrides).layout(2), message)
    if message is None:  # and the run's parallelize gets the split
        cfg = load_config(None, overrides)
        dims, batch = cfg.layout(2)
        assert parallel_options(cfg, batch, dims, torch.device("cpu")).pp_boundaries == (0, 2)


def test_tensor_parallelism_refuses_what_its_plan_cannot_place_in_one_line(tmp_path):
    """A layer whose attention would run whole among sharded ones that hand it their indexer's selection (Kolibri):
    refused before any rank, found from the architecture's modules on the meta device."""
    why = ("an attention without q_proj/k_proj/v_proj/o_proj \\(or latent attention's kv_a_proj_with_mqa/kv_b_proj\\) "
           "has no built-in tensor-parallel plan; layer 3's is Kolibri1_1Attention")
    folder = _tiny_folder("kolibri1_1", tmp_path / "kolibri1_1")
    overrides = {**_overrides(folder, tmp_path / "r"), "parallel.tp": 2}
    assert_one_line(lambda: load_config(None, overrides).layout(2),
                    rf"parallel.tp = 2 for Kolibri1_1ForCausalLM on transformers' own modules: .*{why}")


@pytest.mark.parametrize("world, runs", [
    (2, {"tp2": ("qwen3_next", {"parallel.tp": 2}), "cp2": ("qwen3_next", {"parallel.cp": 2}),
         "dsa-cp2": ("glm_moe_dsa", {"parallel.cp": 2}), "gated-tp2": ("ergo", {"parallel.tp": 2}),
         "w123-tp2": ("lfm2_moe", {"parallel.tp": 2}), "hybrid-tp2": ("inkling", {"parallel.tp": 2}),
         "hybrid-cp2": ("inkling", {"parallel.cp": 2})}),
    # (CI checks these architectures' plans: tests/parallel/test_tp.py)
    pytest.param(2, {"lists-tp2": ("longcat_flash", {"parallel.tp": 2}),
                     "scaled-input-tp2": ("zaya", {"parallel.tp": 2}),
                     "hash-routed-tp2": ("deepseek_v4", {"parallel.tp": 2}),
                     "compressed-cp2": ("deepseek_v4", {"parallel.cp": 2})}, marks=pytest.mark.slow),
    pytest.param(4, {"tp2-cp2": ("qwen3_next", {"parallel.tp": 2, "parallel.cp": 2})}, marks=pytest.mark.slow),
], ids=["tp2-and-cp2", "lists-scales-ids-compressed", "tp2-x-cp2"])
def test_a_token_mixer_without_a_plan_runs_whole_under_tensor_and_context_parallelism(tmp_path, capfd, world, runs):
    """Qwen3-Next's linear-attention layers (GatedDeltaNet) have no tensor-parallel plan and are not attention that
    context parallelism splits: they run whole on every tp or cp rank (the sequence gathered into them) while its
    full-attention layers and MoE stay split; so does GLM-5's attention with a sparse-attention indexer under cp
    (its top-k keys made a mask: without them the run is off by 3e-2), and Ergo's attention under tp while its
    residual gates run on the rank's tokens (their gradients summed over tp) and its ReLU^2 MLP is sharded, and
    LFM2's short convolutions and attention under tp with its w1/w2/w3 MLP sharded, and Inkling's attention
    (relative position logits, short convolutions on its keys and values) and the short convolutions beside it
    under tp and cp, with its normed embedding whole on every tp rank, and LongCat-Flash's two latent attentions
    per layer (held in a ModuleList, as are its two MLPs and their norms) sharded by heads, and Zaya's input scale
    and bias, which its model applies outside any module, replicated DTensors on the sharded embedding output
    (its CCA attention whole), and DeepSeek-V4's MoE routed by the token ids, handed the ids of the rank's tokens,
    and its compressed attention run whole under cp (the mask in eager's additive form, which it extends itself).
    tp=2, cp=2 and both
    train the one-process losses and gradient norms, and rank 0 says which mixers run whole."""
    from tests.parallel.layout_worker import launch

    folders = {arch: _tiny_folder(arch, tmp_path / arch) for arch in {arch for arch, _ in runs.values()}}
    for arch, folder in folders.items():
        train(load_config(None, _overrides(folder, tmp_path / arch / "one")), fresh=True, progress=False)
    argv = lambda run, arch, more: [f"--{k}={v}" for k, v in _overrides(folders[arch], tmp_path / run, **more).items()]
    results = launch(world, [(run, argv(run, *case), str(tmp_path / run), False) for run, case in runs.items()])
    assert results == {run: "ok" for run in runs}, results
    for run, (arch, _) in runs.items():
        np.testing.assert_allclose(np.array(steps(tmp_path / run)), np.array(steps(tmp_path / arch / "one")),
                                   rtol=REL, err_msg=run)
    out = capfd.readouterr().out
    if "tp2" not in runs and "tp2-cp2" not in runs:
        return
    assert "token mixer(s) (Qwen3NextGatedDeltaNet) have no tensor-parallel plan" in out
    assert "parallel.cp = 2: 1 sequence mixer(s) (Qwen3NextGatedDeltaNet) are not attention context parallelism " \
           "splits and run whole on every cp rank" in out


def test_pipeline_splits_it_cannot_make_are_named(folder):
    """Several stages per rank, tied embeddings, keys and values a layer reads from a layer on another stage, state
    the layers share other than through their outputs, and a carried selection whose shapes are not known: one
    line each."""
    from moeflow.models.hf_transformers import load
    from moeflow.parallel.hf_pipeline import hf_pipeline_refusal, kv_sources
    from tests.support.hf_tiny import tiny_config, tiny_model

    model = load(folder, "meta")
    assert hf_pipeline_refusal(model, "1F1B") is None
    assert hf_pipeline_refusal(model, "Interleaved1F1B") == (
        "GptOssForCausalLM: transformers' modules run one pipeline stage per rank; parallel.pp_schedule = "
        "'Interleaved1F1B' runs several: use 'GPipe' or '1F1B'")
    tied = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=8, num_experts=2, moe_intermediate_size=8,
                                       tie_word_embeddings=True)
    assert "tied embeddings would sit on two pipeline stages" in hf_pipeline_refusal(
        transformers.AutoModelForCausalLM.from_config(tied), "GPipe")
    glm_dsa = tiny_model("glm_moe_dsa", seed=0)  # its layers hand the next one an indexer's top-k selection
    assert hf_pipeline_refusal(glm_dsa, "GPipe") is None
    assert "hand the next one `topk_indices` beside the hidden states, whose shapes the stages take from the " \
           "micro-batch shape (ParallelOptions.pp_microbatch_shape)" in hf_pipeline_refusal(glm_dsa, "GPipe", None)
    # Kolibri-1.1's layer 3 reads layer 2's keys and values (one stage), but its indexer's selection, which the
    # layers hand on, has shapes only its values decide: refused before any rank starts
    kolibri = tiny_model("kolibri1_1", seed=0)
    assert kv_sources(kolibri) == {3: 2}
    assert hf_pipeline_refusal(kolibri, "GPipe", (), 2).startswith(
        "Kolibri1_1ForCausalLM: the shapes its layers hand each other could not be read from a forward on fake "
        "tensors, whose values are unknown (GuardOnDataDependentSymNode")
    # Gemma 4 passes its layers a key-value sharing dict; only a config whose last layers reuse another's keys and
    # values needs it carried (its MoE release shares none), and per-layer embeddings have no stage
    def gemma4(**changes):
        return transformers.AutoModelForCausalLM.from_config(tiny_config("gemma4", **changes))

    assert tiny_config("gemma4").num_kv_shared_layers == 0 and hf_pipeline_refusal(gemma4(), "GPipe") is None
    six = dict(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3)
    sharing = gemma4(**six, num_kv_shared_layers=2)  # layers 4 and 5 read layer 2's and layer 3's keys and values
    assert sharing.model.layers[5].self_attn.is_kv_shared_layer and kv_sources(sharing) == {4: 2, 5: 3}
    tail = "; a pipeline stage boundary carries only what a layer returns for the next one; use pp = 1"
    assert hf_pipeline_refusal(sharing, "GPipe", (), 2) == (  # an even split: layers 0-2 and 3-5
        "Gemma4ForCausalLM: layer 4 reads the keys and values layer 2 writes into `shared_kv_states`, and the split "
        "puts layer 2 on stage 0 and layer 4 on stage 1 (parallel.pp_boundaries = '0,2' keeps each reader on its "
        "source's stage)" + tail)
    assert hf_pipeline_refusal(sharing, "GPipe", (), 2, (0, 2)) is None  # layers 0-1 and 2-5: readers with sources
    assert hf_pipeline_refusal(sharing, "GPipe", (), 2, [[0, 1], [2, 3, 4, 5]]) is None  # the same, as lists
    assert "puts layer 2 on stage 1 and layer 4 on stage 2 (parallel.pp_boundaries = '0,1,2' keeps" in \
        hf_pipeline_refusal(sharing, "GPipe", (), 3)  # (the only 3 stages that keep layers 2-5 together)
    assert "(no split into 5 stages keeps every reader on its source's stage)" in hf_pipeline_refusal(
        sharing, "GPipe", (), 5)
    assert hf_pipeline_refusal(sharing, "GPipe") == (  # no split named: any reader of another layer is refused
        "Gemma4ForCausalLM: layer 4 reads the keys and values layer 2 writes into `shared_kv_states`" + tail)
    every = gemma4(**six, num_kv_shared_layers=6)  # every layer reuses, none writes: nothing to follow
    assert kv_sources(every) is None
    assert hf_pipeline_refusal(every, "GPipe", (), 2) == (
        "Gemma4ForCausalLM: its layers share `shared_kv_states` (KVSharingDict), which they write into and read "
        "back" + tail)
    assert "model.embed_tokens_per_layer.weight is one" in hf_pipeline_refusal(
        gemma4(hidden_size_per_layer_input=16), "GPipe")
    assert "its loop builds `block_states` from the layers' outputs" in hf_pipeline_refusal(
        tiny_model("inkling2", seed=0), "GPipe")
    assert hf_pipeline_refusal(tiny_model("nemotron_h"), "GPipe") is None  # its embedding is model.embeddings


def test_folders_transformers_cannot_train_are_named(folder, tmp_path):
    t5 = tmp_path / "t5"
    transformers.T5Config(vocab_size=V, d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=16).save_pretrained(t5)
    with pytest.raises(ValueError, match=r"\(model_type 't5'\), an encoder-decoder model in transformers .*; "
                                         r"moeflow trains decoder LMs"):
        load_config(None, _overrides(t5, tmp_path / "r"))
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ValueError, match=rf"lists {shards[-1].name}, which is not in .*; copy the missing shard"):
        load_config(None, _overrides(sharded, tmp_path / "r"))


@pytest.mark.slow
def test_compiled_blocks_under_expert_parallelism_train_the_one_process_run(folder, tmp_path):
    """training.compile with ep=2 on transformers' modules: each block compiled, the experts' token mover eager
    inside it (a graph break), the one-process eager run's losses and gradient norms."""
    from tests.parallel.layout_worker import launch

    train(load_config(None, _overrides(folder, tmp_path / "one")), fresh=True, progress=False)
    argv = [f"--{k}={v}" for k, v in _overrides(folder, tmp_path / "ep2c", **{"parallel.ep": 2,
                                                                              "training.compile": True}).items()]
    assert launch(2, [("ep2c", argv, str(tmp_path / "ep2c"), False)]) == {"ep2c": "ok"}
    np.testing.assert_allclose(np.array(steps(tmp_path / "ep2c")), np.array(steps(tmp_path / "one")), rtol=REL)


@pytest.mark.slow
def test_four_rank_layouts_train_the_one_process_run(folder, tmp_path):
    """On transformers' modules: ep=2 inside dp_shard=4 (each expert FSDP-sharded over the 2 ranks that hold it),
    pp=2 x ep=2 (each stage's experts over its 2 ranks), tp=2 x ep=2 (the MoE folded over ep x tp = 4 ranks),
    tp=2 x pp=2 (each stage's heads and folded experts over its tp pair), cp=2 x ep=2 (EP over the ranks that
    hold a sequence's halves) and cp=2 x pp=2."""
    from tests.parallel.layout_worker import launch

    train(load_config(None, _overrides(folder, tmp_path / "one")), fresh=True, progress=False)
    runs = {"ep2dp4": {"parallel.ep": 2}, "pp2ep2": {"parallel.pp": 2, "parallel.ep": 2},
            "tp2ep2": {"parallel.tp": 2, "parallel.ep": 2}, "tp2pp2": {"parallel.tp": 2, "parallel.pp": 2},
            "cp2ep2": {"parallel.cp": 2, "parallel.ep": 2}, "cp2pp2": {"parallel.cp": 2, "parallel.pp": 2}}
    cases = [(run, [f"--{k}={v}" for k, v in _overrides(folder, tmp_path / run, **more).items()], str(tmp_path / run),
              False) for run, more in runs.items()]
    assert launch(4, cases) == {run: "ok" for run in runs}
    for run in runs:
        np.testing.assert_allclose(np.array(steps(tmp_path / run)), np.array(steps(tmp_path / "one")), rtol=REL,
                                   err_msg=run)


@pytest.mark.slow
def test_pipeline_stages_of_a_hash_routed_hyper_connection_model_under_ep(tmp_path):
    """A DeepSeek-V4-shaped folder under pp=2 x ep=2 from `moeflow train`: its stages hand on the hyper-connection
    streams [B, S, hc, D], the second stage's hash-routed layers get the token ids, the hc head sits on the last
    stage; the one-process losses."""
    from tests.parallel.layout_worker import launch
    from tests.support.hf_tiny import causal_lm_class, randomize, tiny_config

    folder = tmp_path / "dsv4"
    config = tiny_config("deepseek_v4")
    config.mlp_layer_types = ["hash_moe", "hash_moe"]  # the second stage's layer routes by the token ids too
    model = causal_lm_class("deepseek_v4")(config)
    randomize(model, seed=0)
    for layer in model.model.layers:  # each token's experts (a table the folder holds; zeros as constructed)
        table = layer.mlp.gate.tid2eid
        table.copy_(torch.randint(0, config.n_routed_experts, table.shape, generator=torch.Generator().manual_seed(0)))
    model.save_pretrained(folder)
    np.random.default_rng(0).integers(0, model.config.vocab_size, 20000).astype(np.uint16).tofile(
        folder / "tokens.bin")
    train(load_config(None, _overrides(folder, tmp_path / "one")), fresh=True, progress=False)
    argv = [f"--{k}={v}" for k, v in _overrides(folder, tmp_path / "pp2ep2", **{"parallel.pp": 2,
                                                                                "parallel.ep": 2}).items()]
    assert launch(4, [("pp2ep2", argv, str(tmp_path / "pp2ep2"), False)]) == {"pp2ep2": "ok"}
    np.testing.assert_allclose(np.array(steps(tmp_path / "pp2ep2")), np.array(steps(tmp_path / "one")), rtol=REL)


def test_a_selection_bias_moves_as_moeflows_aux_free_routers(tmp_path):
    """A GLM-4.5-shaped folder on transformers' modules: its routers' e_score_correction_bias moves by
    model.moe.bias_update_rate against each step's global loads (hand-worked from the logged counts: rate x
    sign(mean - load)), the same in one process and under ep=2, which train the same losses."""
    from tests.parallel.layout_worker import launch
    from tests.support.hf_tiny import tiny_model

    folder = tmp_path / "glm"
    model = tiny_model("glm4_moe", seed=0)
    model.save_pretrained(folder)
    bias = {str(i): layer.mlp.gate.e_score_correction_bias.double().numpy() for i, layer in
            enumerate(model.model.layers) if hasattr(layer.mlp, "gate")}
    np.random.default_rng(0).integers(0, V, 20000).astype(np.uint16).tofile(folder / "tokens.bin")
    overrides = lambda run, **more: {**_overrides(folder, tmp_path / run), "model.hf_impl": "transformers",
                                     "model.moe.bias_update_rate": 0.01, **more}
    train(load_config(None, overrides("one")), fresh=True, progress=False)
    argv = [f"--{k}={v}" for k, v in overrides("ep2", **{"parallel.ep": 2}).items()]
    assert launch(2, [("ep2", argv, str(tmp_path / "ep2"), False)]) == {"ep2": "ok"}
    np.testing.assert_allclose(np.array(steps(tmp_path / "ep2")), np.array(steps(tmp_path / "one")), rtol=REL)
    rows = {run: [json.loads(x)["moe"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("one", "ep2")}
    assert rows["ep2"] == rows["one"]
    start = dict(bias)
    assert rows["one"][0].keys() == bias.keys()
    for step in rows["one"]:
        for layer, stats in step.items():
            load = np.array(stats["tokens_per_expert"], dtype=np.float64)
            bias[layer] = bias[layer] + 0.01 * np.sign(load.mean() - load)
            np.testing.assert_allclose(stats["router_bias"], bias[layer], atol=1e-5)
    assert any(np.abs(bias[k] - start[k]).max() > 0 for k in bias)


def test_muon_on_transformers_modules_trains_the_one_process_run(folder, tmp_path):
    """training.optimizer = 'muon' on gpt-oss's own modules (its experts tensors as E matrices each, the router,
    biases and sinks on AdamW): ep=2 (the router kept on AdamW though each rank holds half the experts), tp=2 and
    dp=2 ZeRO-3 train the one-process run's losses and gradient norms. Newton-Schulz runs in bf16, so updates whose
    fp32 gradients differ in summation order (tp sums partial products) can round apart there: tp=2 is held to
    the first 3 of 4 steps (at the 4th its gradient norm is 1.4e-3 off, the losses 1e-7)."""
    from tests.parallel.layout_worker import launch

    muon = {"training.optimizer": "muon"}
    train(load_config(None, _overrides(folder, tmp_path / "one", **muon)), fresh=True, progress=False)
    runs = {"ep2": {"parallel.ep": 2}, "tp2": {"parallel.tp": 2}, "dp2": {"parallel.zero": 3}}
    cases = [(run, [f"--{k}={v}" for k, v in _overrides(folder, tmp_path / run, **muon, **more).items()],
              str(tmp_path / run), False) for run, more in runs.items()]
    assert launch(2, cases) == {run: "ok" for run in runs}
    for run in runs:
        held = 3 if run == "tp2" else 4
        np.testing.assert_allclose(np.array(steps(tmp_path / run))[:held], np.array(steps(tmp_path / "one"))[:held],
                                   rtol=REL, err_msg=run)
