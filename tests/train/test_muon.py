"""training.optimizer = 'muon': moeflow's Muon equals torch.optim.Muon step for step on every 2-D matrix and on
each expert matrix of the 3-D experts, its AdamW part equals torch.optim.AdamW, the parameters split as Moonlight's
recipe, a run resumes exactly (the momentum is in the checkpoint), and what is not supported is one line."""

from __future__ import annotations

import json

import pytest
import torch

from moeflow.config import load_config
from moeflow.core.presets import get_preset
from moeflow.models.transformer import Transformer
from moeflow.train.muon import Muon, muon_parameters
from moeflow.train.trainer import train
from tests.support.cli import assert_one_line


def _model() -> Transformer:
    cfg = get_preset("tiny-moe")
    cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.moe.num_experts, cfg.moe.ffn_dim = 32, 2, 64, 4, 16
    torch.manual_seed(0)
    return Transformer(cfg.validate())


def test_the_split_is_moonlights():
    model = _model()
    muon, adamw = muon_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names, adamw_names = {names[id(p)] for p in muon}, {names[id(p)] for p in adamw}
    assert "tok_embeddings.weight" in adamw_names and "output.weight" in adamw_names
    assert all(p.ndim >= 2 for p in muon)
    assert any(n.endswith("experts.w1") for n in muon_names) and any(n.endswith("attention.wq.weight")
                                                                      for n in muon_names)
    assert all("router" in n or "norm" in n or n in ("tok_embeddings.weight", "output.weight")
               for n in adamw_names), adamw_names
    assert len(muon) + len(adamw) == len(list(model.parameters()))


def _hf_model(arch: str):
    from tests.support.hf_tiny import tiny_model

    return tiny_model(arch)


def test_transformers_modules_split_as_moonlights():
    """On transformers' own modules: routers, a shared expert's scalar gate and per-expert biases stay on AdamW
    (with the embedding, head, norms, attention biases and sinks); every projection, shared expert and 3-D experts
    tensor is Muon's."""
    pytest.importorskip("transformers")
    for arch, adamw_only in (("gpt_oss", ("mlp.router.weight", "mlp.experts.gate_up_proj_bias", "self_attn.sinks")),
                             ("qwen2_moe", ("mlp.gate.weight", "mlp.shared_expert_gate.weight"))):
        model = _hf_model(arch)
        muon, adamw = muon_parameters(model)
        names = {id(p): n for n, p in model.named_parameters()}
        muon_names, adamw_names = {names[id(p)] for p in muon}, {names[id(p)] for p in adamw}
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= adamw_names
        assert all(any(a.endswith(n) for a in adamw_names) for n in adamw_only), arch
        assert all(p.ndim in (2, 3) for p in muon) and all(p.ndim == 3 for n, p in model.named_parameters()
                                                            if n.endswith("experts.down_proj"))
        assert all(any(m.endswith(n) for m in muon_names) for n in ("experts.gate_up_proj", "self_attn.q_proj.weight"))
        assert len(muon) + len(adamw) == len(list(model.parameters()))


@pytest.mark.parametrize("nesterov, adjust, make", [(True, "match_rms_adamw", _model), (False, "original", _model),
                                                    (True, "match_rms_adamw", lambda: _hf_model("gpt_oss"))])
def test_every_matrix_steps_as_torch_optim_muon_and_the_rest_as_adamw(nesterov, adjust, make):
    """Three steps with the same random gradients: each 2-D matrix against torch.optim.Muon on it, each expert
    matrix against torch.optim.Muon on that slice as its own parameter, the rest against torch.optim.AdamW
    (moeflow's model, and transformers' gpt-oss with its transposed experts)."""
    model = make()
    muon, adamw = muon_parameters(model)
    ours = Muon(muon, adamw, lr=0.02, adamw_lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), momentum=0.9,
                nesterov=nesterov, ns_steps=5, adjust_lr=adjust)
    ref_matrices = [torch.nn.Parameter(m.detach().clone()) for p in muon
                    for m in (p.unbind(0) if p.ndim == 3 else [p])]
    start = [m.detach().clone() for m in ref_matrices]
    ref_rest = [torch.nn.Parameter(p.detach().clone()) for p in adamw]
    ref_muon = torch.optim.Muon(ref_matrices, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                                ns_steps=5, adjust_lr_fn=adjust)
    decay = [q for q, p in zip(ref_rest, adamw) if p.ndim >= 2]
    no_decay = [q for q, p in zip(ref_rest, adamw) if p.ndim < 2]
    ref_adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in muon + adamw:
            p.grad = torch.randn(p.shape, generator=gen)
        grads = [g for p in muon for g in (p.grad.unbind(0) if p.ndim == 3 else [p.grad])]
        for q, g in zip(ref_matrices, grads):
            q.grad = g.clone()
        for q, p in zip(ref_rest, adamw):
            q.grad = p.grad.clone()
        ours.step()
        ref_muon.step()
        ref_adamw.step()
    got = [m for p in muon for m in (p.unbind(0) if p.ndim == 3 else [p])]
    # moeflow stacks same-shaped matrices into one batched bf16 matmul chain, torch.optim.Muon multiplies each on
    # its own: the kernels may round differently on another CPU, so each matrix's distance from the reference is
    # held to 1% of how far it moved (one Newton-Schulz iteration fewer is 30%, a wrong matrix or scale more)
    for a, b, a0 in zip(got, ref_matrices, start):
        assert (a - b).norm() <= 0.01 * (b - a0).norm(), (a - b).norm() / (b - a0).norm()
    for a, b in zip(adamw, ref_rest):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def _overrides(run_dir, **more) -> dict:
    return {"training.optimizer": "muon", "model.dim": 32, "model.n_layers": 2, "model.moe.num_experts": 4,
            "model.n_heads": 2, "model.n_kv_heads": 2,
            "model.moe.ffn_dim": 16, "data.seq_len": 16, "data.max_bytes": 50_000, "training.global_batch": 4,
            "training.steps": 6, "eval.every": 0, "metrics.tensorboard": False, "metrics.log_every": 1,
            "checkpoint.every": 3, "run_dir": str(run_dir), **more}


def test_a_muon_run_resumes_exactly(tmp_path):
    first = train(load_config(None, _overrides(tmp_path / "straight")), progress=False)
    assert first["final_loss"] < first["first_loss"]
    train(load_config(None, _overrides(tmp_path / "split", **{"training.stop_at": 3})), progress=False)
    train(load_config(None, _overrides(tmp_path / "split")), resume=True, progress=False)
    losses = {run: [json.loads(x)["loss"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("straight", "split")}
    assert losses["split"] == losses["straight"]


LAYOUTS = {"dp2-zero3": {"parallel.zero": 3}, "ep2": {"parallel.ep": 2}, "tp2": {"parallel.tp": 2},
           "dp2-zero1": {"parallel.zero": 1}, "pp2": {"parallel.pp": 2}, "cp2": {"parallel.cp": 2},
           "stop": {"parallel.ep": 2, "training.stop_at": 3},
           # 4 ranks: pairs (FSDP over TP: matrices cut over two mesh dims, gathered whole and summed)
           "tp2-dp2": {"parallel.tp": 2}, "ep2-tp2": {"parallel.ep": 2, "parallel.tp": 2},
           "pp2-dp2": {"parallel.pp": 2}, "hsdp2x2-ep2": {"parallel.dp_replicate": 2, "parallel.ep": 2},
           "cp2-tp2": {"parallel.cp": 2, "parallel.tp": 2}}


@pytest.mark.parametrize("world, names", [
    (2, ["dp2-zero3"]),
    pytest.param(2, ["ep2", "tp2", "dp2-zero1", "pp2", "cp2", "stop"], marks=pytest.mark.slow),
    pytest.param(4, ["tp2-dp2", "ep2-tp2", "pp2-dp2", "hsdp2x2-ep2", "cp2-tp2"], marks=pytest.mark.slow),
], ids=["fsdp2", "every-layout", "pairs"])
def test_layouts_train_the_one_process_muon_run(tmp_path, world, names):
    """2 and 4 ranks: each matrix gathered whole, orthogonalised by one rank, cut back to the shards - the
    one-process losses and gradient norms (rtol 1e-5); 'stop' is ep=2 stopped at step 3 and resumed in one
    process."""
    import numpy as np

    from tests.parallel.layout_worker import launch

    train(load_config(None, _overrides(tmp_path / "one")), fresh=True, progress=False)
    argv = lambda run, **more: [f"--{k}={v}" for k, v in _overrides(tmp_path / run, **more).items()]
    results = launch(world, [(n, argv(n, **LAYOUTS[n]), str(tmp_path / n), False) for n in names])
    assert set(results.values()) == {"ok"}, results
    if "stop" in names:
        train(load_config(None, _overrides(tmp_path / "stop")), resume=True, progress=False)

    def steps(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return np.array([(r["loss"], r["grad_norm"]) for r in rows])

    for run in names:
        np.testing.assert_allclose(steps(run), steps("one"), rtol=1e-5, err_msg=run)


@pytest.mark.parametrize("changes, world, message", [
    ({"training.muon_ns_steps": 0}, 1, r"training.muon_ns_steps = 0; Muon needs at least 1 Newton-Schulz"),
    ({"training.fp8": "tensorwise"}, 1, r"training.optimizer = 'muon' with training.fp8 = 'tensorwise'"),
    ({"training.muon_momentum": 1.0}, 1, r"training.muon_momentum = 1.0; use a value in \[0, 1\)"),
    ({"training.muon_adjust_lr": "rms"}, 1, r"training.muon_adjust_lr"),
    ({"peft.method": "lora", "training.muon_clip": 100.0}, 1,
     r"training.muon_clip = 100.0 for this run: a LoRA run keeps the query projections it would scale frozen"),
    ({"parallel.offload": "optimizer", "training.muon_clip": 100.0}, 1,
     r"training.muon_clip = 100.0 for this run: parallel.offload = 'optimizer' keeps the weights it would scale"),
])
def test_what_is_not_supported_is_one_line(tmp_path, changes, world, message):
    assert_one_line(lambda: load_config(None, _overrides(tmp_path, **changes)).layout(world), message)


def _sharded_case(_, case) -> None:
    """Matrices of awkward shapes sharded over the ranks (uneven rows, an empty shard, a column cut, a 3-D experts
    tensor) on two meshes in turn (as expert slices over efsdp and the rest over dp_shard interleave; on 4 ranks
    the second is HSDP's: 2 replicas of a 2-way cut), stepped by moeflow's Muon with a tiny flush bound (several
    flushes a step) or the default one (one flush per mesh and step): each equals torch.optim.Muon on the whole
    matrix in one process, within 1% of its movement."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from moeflow.train import muon as muon_module

    _, bound = case
    if bound:
        muon_module._ShardedMatrices.PENDING_BYTES = bound
    flushes = []
    flush = muon_module._ShardedMatrices._flush
    muon_module._ShardedMatrices._flush = lambda self, key: flushes.append(key) or flush(self, key)
    world = torch.distributed.get_world_size()
    one_dim = init_device_mesh("cpu", (world,))
    two_dims = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("a", "b"))
    gen = torch.Generator().manual_seed(0)
    shapes = [((5, 4), Shard(0)), ((1, 3), Shard(0)), ((4, 3), Shard(1)), ((3, 4, 5), Shard(0))]
    whole = [torch.randn(shape, generator=gen) for shape, _ in shapes]
    grads = [[torch.randn(shape, generator=gen) for shape, _ in shapes] for _ in range(2)]
    ours = [torch.nn.Parameter(distribute_tensor(w.clone(), one_dim, [cut]) if i % 2 == 0 else
                               distribute_tensor(w.clone(), two_dims, [Replicate(), cut]))
            for i, (w, (_, cut)) in enumerate(zip(whole, shapes))]
    opt = Muon(ours, [], lr=0.02, adamw_lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), momentum=0.9)
    ref = [torch.nn.Parameter(m.clone()) for w in whole for m in (w.unbind(0) if w.ndim == 3 else [w])]
    ref_opt = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    for step in grads:
        for p, g in zip(ours, step):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        for q, m in zip(ref, [m for g in step for m in (g.unbind(0) if g.ndim == 3 else [g])]):
            q.grad = m.clone()
        opt.step()
        ref_opt.step()
    got = [m for p in ours for m in (p.full_tensor().unbind(0) if p.ndim == 3 else [p.full_tensor()])]
    start = [m for w in whole for m in (w.unbind(0) if w.ndim == 3 else [w])]
    for a, b, a0 in zip(got, ref, start):
        assert (a - b).norm() <= 0.01 * (b - a0).norm(), (a - b).norm() / (b - a0).norm()
    if not bound and world == 2:  # the meshes alternate parameter by parameter; each bucket still fills one collective
        assert len(flushes) == 2 * len(grads), flushes
    muon_module._ShardedMatrices._flush = flush


def test_sharded_matrices_of_awkward_shapes_step_as_torch_optim_muon():
    from tests.support.dist_harness import check_results, launch

    cases = [("awkward shards, tiny bound", 256), ("awkward shards, one flush per mesh", 0)]
    check_results(launch(2, cases, _sharded_case), cases)


def test_sharded_matrices_on_four_ranks_and_hsdp_step_as_torch_optim_muon():
    from tests.support.dist_harness import check_results, launch

    cases = [("awkward shards on 4 ranks, HSDP", 0)]
    check_results(launch(4, cases, _sharded_case), cases)
