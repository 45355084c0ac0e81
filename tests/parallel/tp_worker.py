"""Multi-process harness for the tensor-parallel tests: one launch per world size runs every case.

Each rank builds the same model twice from one seed: a reference it runs unparallelized on every dp share of
the batch (averaging their losses, as data parallelism does), and a copy it shards with moeflow.parallel.tensor
(and FSDP2 on a dp mesh in the 2-D case) and runs on its own share. Cases compare logits, every gradient
(DTensors gathered with full_tensor), AdamW steps and final parameters, and write {case name: "ok" | traceback}
to a file the parent reads.
"""

from __future__ import annotations

import copy
import logging
import os
import traceback

import torch
import torch.distributed as dist

REL_TOL = 1e-5  # relative norm error of every compared tensor; TP_VERBOSE=1 prints those above 1e-6

# ---- launching ------------------------------------------------------------------------------------------


def launch(world: int, cases: list[tuple[str, str, dict]]) -> list[dict[str, str]]:
    """Run `cases` ([(name, function name, kwargs)]) on `world` gloo processes; -> per-rank results."""
    from tests.support.dist_harness import launch as harness_launch

    return harness_launch(world, cases, _run_case, setup=_quiet_redistribute)


def _quiet_redistribute(rank: int, world: int) -> None:
    # full_tensor() of FSDP's 2-D gradients warns that it takes two all-gathers; that is only the test's cost.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _run_case(_, case) -> None:
    _, fn, kwargs = case
    fn(**kwargs)


def run_inline(cases) -> dict[str, str]:
    """World size 1 in this process, no process group."""
    out = {}
    for name, fn, kwargs in cases:
        try:
            fn(**kwargs)
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc()
    return out


# ---- models ---------------------------------------------------------------------------------------------


def moeflow_model(kind: str, **overrides):
    from moeflow.core.model_config import ModelConfig, MoEConfig
    from moeflow.core.presets import get_preset
    from moeflow.models.transformer import Transformer

    if kind == "dense":
        cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32,
                          qk_norm="per_head", tie_embeddings=True, init_std=0.1)
    else:  # tiny-moe, shrunk: layer 0 dense, layer 1 MoE with a shared expert; aux and z losses on
        cfg = get_preset("tiny-moe")
        cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads = 64, 32, 2, 4, 2
        cfg.ffn_dim, cfg.max_seq_len, cfg.init_std = 48, 32, 0.1
        cfg.moe = MoEConfig(num_experts=4, top_k=2, ffn_dim=16, num_shared_experts=1, first_k_dense=1,
                            aux_loss_coef=0.01, z_loss_coef=0.001, load_balance="none", expert_impl="bmm")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    with torch.no_grad():  # norms away from one, so a wrong norm gradient or a missing broadcast shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


def hf_model(arch: str):
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa",
                  initializer_range=0.1)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=8)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "gpt_oss":  # transformers' own experts modules (interleaved gate/up, biases), attention sinks
        cfg = transformers.GptOssConfig(**{**common, "attn_implementation": "eager"}, head_dim=8, num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"])
        cls = transformers.GptOssForCausalLM
    elif arch.startswith("deepseek_v3"):  # transformers' latent attention and experts; "-no-q-lora": q_proj
        mla = dict(kv_lora_rank=16, q_lora_rank=None if arch.endswith("no-q-lora") else 16, qk_rope_head_dim=4,
                   qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1)
        cfg = transformers.DeepseekV3Config(**{**common, "num_key_value_heads": 4, "attn_implementation": "eager"},
                                            **mla)
        cls = transformers.DeepseekV3ForCausalLM
    else:  # Qwen3-MoE, its sparse blocks replaced by moeflow's MoE
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=16, output_router_logits=False)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(cfg)
    if arch == "qwen3_moe":
        from moeflow.models.hf_live import replace_sparse_moe_blocks

        assert replace_sparse_moe_blocks(model) == cfg.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


def logits_of(model, tokens):
    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


# ---- comparing ------------------------------------------------------------------------------------------


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_rel(name: str, got: torch.Tensor, want: torch.Tensor, rel: float = REL_TOL) -> None:
    got, want = full(got).detach().float(), want.detach().float()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).norm() / want.norm().clamp_min(1e-12)
    if os.environ.get("TP_VERBOSE") and err > 1e-6:
        print(name, float(err))
    assert err <= rel, f"{name}: relative error {err:.3g} > {rel:g} (|want| = {want.norm():.3g})"


def compare_training(ref, par, tokens_BS, targets_BS, tp_mesh, dp_rank: int = 0, dp: int = 1, steps: int = 3) -> None:
    """The reference vs the parallel model on its dp share: logits, losses, gradients, grad norm, AdamW steps,
    parameters.

    The reference runs each dp share's batch separately and averages their losses, which is what data
    parallelism computes (the MoE aux loss is not linear in the tokens, so one forward on the whole batch would
    differ); its routers scale their aux-loss gradient by 1/dp as the trainer does for accumulation.
    """
    from moeflow.parallel.grads import grad_norm_sq_local
    from moeflow.parallel.loss import tp_loss

    for router in getattr(ref, "moe_routers", lambda: [])():
        router[1].aux_loss_scale = 1.0 / dp
    share = tokens_BS.shape[0] // dp
    rows = [slice(r * share, (r + 1) * share) for r in range(dp)]
    ref_params, par_params = dict(ref.named_parameters()), dict(par.named_parameters())
    assert ref_params.keys() == par_params.keys(), sorted(set(ref_params) ^ set(par_params))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(steps):
        ref_logits = [logits_of(ref, tokens_BS[r]) for r in rows]
        ref_loss = sum(tp_loss(logits, targets_BS[r]) for logits, r in zip(ref_logits, rows)) / dp
        ref_loss.backward()
        par_logits = logits_of(par, tokens_BS[rows[dp_rank]])
        par_loss = tp_loss(par_logits, targets_BS[rows[dp_rank]])
        par_loss.backward()
        if step == 0:
            assert_rel("logits", par_logits, ref_logits[dp_rank])
        mean_loss = par_loss.detach().clone()
        dist.all_reduce(mean_loss)  # every dp share's loss, once per tp rank
        mean_loss /= dist.get_world_size()
        assert_rel(f"loss at step {step}", mean_loss, ref_loss)
        for name, p in ref_params.items():
            assert_rel(f"grad of {name} at step {step}", par_params[name].grad, p.grad)
        sq = grad_norm_sq_local(par, tp_mesh)
        dist.all_reduce(sq)
        want = torch.stack([p.grad.pow(2).sum() for p in ref_params.values()]).sum()
        assert_rel(f"grad norm^2 at step {step}", sq, want)
        opt_ref.step()
        opt_par.step()
        opt_ref.zero_grad()
        opt_par.zero_grad()
    for name, p in ref_params.items():
        assert_rel(f"{name} after {steps} AdamW steps", par_params[name], p)


def batch(vocab: int, B: int = 4, S: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, S + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ---- cases ----------------------------------------------------------------------------------------------


def case_moeflow(kind: str, dp: int = 1, checkpointing: str = "none", **overrides):
    """tp = world / dp on the tp mesh; FSDP2 on the dp mesh when dp > 1; optional activation checkpointing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from moeflow.parallel.recompute import apply_activation_checkpointing
    from moeflow.parallel.tensor import apply_tensor_parallel

    world = dist.get_world_size()
    tp = world // dp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    ref = moeflow_model(kind, **overrides)
    par = apply_tensor_parallel(copy.deepcopy(ref), mesh["tp"])
    apply_activation_checkpointing(par.layers, checkpointing)
    if dp > 1:
        for block in par.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(par, mesh=mesh["dp"])
    tokens, targets = batch(ref.cfg.vocab_size)
    compare_training(ref, par, tokens, targets, mesh["tp"], dp_rank=mesh["dp"].get_local_rank(), dp=dp)


def case_moe_grads_equal_over_tp():
    """The replicated MoE's parameter gradients are bit-identical on every tp rank (no tp reduction needed),
    including the router's aux/z-loss path; and the router sees the whole sequence on each rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from moeflow.parallel.loss import tp_loss
    from moeflow.parallel.tensor import apply_tensor_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = moeflow_model("moe")
    with torch.no_grad():  # replicas that start different: apply_tensor_parallel must copy tp rank 0's
        for p in model.parameters():
            p.add_(0.01 * rank)
    model = apply_tensor_parallel(model, mesh)
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "placements") and p.placements[0].is_replicate() else p
        if not hasattr(local, "placements"):
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local.detach())
            assert all(torch.equal(g, gathered[0]) for g in gathered), f"{name} differs over tp ranks"
    tokens, targets = batch(64)
    tp_loss(model(tokens), targets).backward()
    moe = model.layers["1"].feed_forward
    assert moe.router.last_load.sum() == tokens.numel() * moe.top_k  # all B*S tokens, on every tp rank
    for name, p in moe.named_parameters():
        assert not hasattr(p, "placements"), f"{name} should stay a plain tensor"
        gathered = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, p.grad)
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"grad of {name} differs over tp ranks"


def case_pipeline_stages():
    """Two pipeline stages of the dense model, each tensor-parallel: the first hands plain [B, S/tp, D] hidden
    states on, the second takes them; logits and gradients equal the whole model's. Also the head without loss
    parallelism gives plain full logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from moeflow.models.transformer import Transformer
    from moeflow.parallel.loss import tp_loss
    from moeflow.parallel.tensor import apply_tensor_parallel

    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    ref = moeflow_model("dense", tie_embeddings=False)
    stages = [Transformer(ref.cfg, head=False, layers=[0]), Transformer(ref.cfg, embed=False, layers=[1])]
    for stage, loss_parallel in zip(stages, (True, False)):
        stage.load_state_dict(ref.state_dict(), strict=False)
        apply_tensor_parallel(stage, mesh, loss_parallel=loss_parallel)
    tokens, targets = batch(64)
    ref_logits = ref(tokens)
    tp_loss(ref_logits, targets).backward()
    hidden = stages[0](tokens)
    assert not isinstance(hidden, DTensor) and hidden.shape == (tokens.shape[0], tokens.shape[1] // tp, 32)
    logits = stages[1](hidden)
    assert not isinstance(logits, DTensor)
    assert_rel("stage logits", logits, ref_logits)
    tp_loss(logits, targets).backward()
    ref_params = dict(ref.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            assert_rel(f"grad of {name}", p.grad, ref_params[name].grad)


def case_tp_with_ep():
    """Expert parallelism (experts split over the ep ranks, tokens through moeflow.ep) inside tensor-parallel
    blocks: one step vs the reference on each ep rank's batch share, gradients reduced as data parallelism
    would (mean over ep ranks for replicated parameters; experts already sum every rank's tokens)."""
    from torch.distributed.device_mesh import init_device_mesh

    from moeflow.parallel.expert import apply_expert_parallel
    from moeflow.parallel.loss import tp_loss
    from moeflow.parallel.tensor import apply_tensor_parallel

    ep = 2
    mesh = init_device_mesh("cpu", (ep, dist.get_world_size() // ep), mesh_dim_names=("ep", "tp"))
    ep_rank, ep_group = mesh["ep"].get_local_rank(), mesh["ep"].get_group()
    ref = moeflow_model("moe")
    par = copy.deepcopy(ref)
    apply_expert_parallel(par, ep_group, backend="alltoall")
    apply_tensor_parallel(par, mesh["tp"])
    for _, router in ref.moe_routers():
        router.aux_loss_scale = 1.0 / ep
    tokens, targets = batch(64)
    share = tokens.shape[0] // ep
    rows = [slice(r * share, (r + 1) * share) for r in range(ep)]
    ref_logits = [ref(tokens[r]) for r in rows]
    ref_loss = sum(tp_loss(logits, targets[r]) for logits, r in zip(ref_logits, rows)) / ep
    ref_loss.backward()
    logits = par(tokens[rows[ep_rank]])
    tp_loss(logits, targets[rows[ep_rank]]).backward()
    assert_rel("logits", logits, ref_logits[ep_rank])
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        grad = full(p.grad).clone()
        want = ref_params[name].grad
        if ".experts." in name:
            local = grad.shape[0]
            want = want[ep_rank * local:(ep_rank + 1) * local]
        else:
            dist.all_reduce(grad, group=ep_group)
        assert_rel(f"grad of {name}", grad / ep, want)


def case_hf(arch: str):
    from torch.distributed.device_mesh import init_device_mesh

    from moeflow.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    ref = hf_model(arch)
    par = apply_tensor_parallel(copy.deepcopy(ref), mesh)
    tokens, targets = batch(64)
    compare_training(ref, par, tokens, targets, mesh)


def case_hf_parallelize(arch: str, tp: int = 1, ep: int = 1, ep_over_tp: bool = True, steps: int = 3):
    """moeflow.parallelize on a Hugging Face model object (Qwen3-MoE with moeflow MoE blocks, or gpt-oss with
    transformers' own experts modules) vs the same model unparallelized: losses, global gradient norm and
    parameters after AdamW steps. With experts spread (ep > 1, or tp > 1 with the MoE folded over tp) each rank
    holds a slice of them, compared with the reference's slice."""
    import moeflow
    from moeflow.parallel.grads import clip_grad_norm_
    from moeflow.parallel.hf_experts import hf_expert_slices
    from moeflow.parallel.loss import tp_loss

    ref = hf_model(arch)
    state = moeflow.parallelize(copy.deepcopy(ref), moeflow.ParallelDims(dist.get_world_size(), tp=tp, ep=ep,
                                                                         ep_over_tp=ep_over_tp))
    par = state.model
    hf_slices = hf_expert_slices(par)  # {fqn: (first expert here, experts here)} of transformers' experts
    dp, dp_rank = state.dims.dp, dist.get_rank() // tp  # mesh order (..., ep, tp): tp is innermost
    tokens, targets = batch(64, B=4)
    share = tokens.shape[0] // dp
    rows = [slice(r * share, (r + 1) * share) for r in range(dp)]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(steps):
        ref_loss = sum(tp_loss(logits_of(ref, tokens[r]), targets[r]) for r in rows) / dp
        ref_loss.backward()
        par_loss = tp_loss(logits_of(par, tokens[rows[dp_rank]]), targets[rows[dp_rank]])
        par_loss.backward()
        mean_loss = par_loss.detach().clone()
        dist.all_reduce(mean_loss)
        assert_rel(f"loss at step {step}", mean_loss / dist.get_world_size(), ref_loss)
        want = torch.stack([p.grad.pow(2).sum() for p in ref.parameters()]).sum().sqrt()
        assert_rel(f"grad norm at step {step}", clip_grad_norm_(par, float("inf"), state), want)
        for opt in (opt_ref, opt_par):
            opt.step()
            opt.zero_grad()
    experts = {n: m for n, m in par.named_modules() if hasattr(m, "expert_offset")}
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        owner = name.rsplit(".", 1)[0]
        want = ref_params[name]
        if owner in experts:
            first = experts[owner].expert_offset
            want = want[first:first + experts[owner].num_experts]
        if name in hf_slices:
            first, count = hf_slices[name]
            want = want[first:first + count]
        assert_rel(f"{name} after {steps} AdamW steps", p, want)


def case_whole_mixer_grads_averaged():
    """Qwen3-Next's linear attention has no tensor-parallel plan: it runs whole on each tp rank (state.tp_whole),
    its parameters plain (not sharded over tp), and after backward its gradients are averaged over the tp ranks,
    so copies that a GPU kernel's summation order set apart are made one (here: set apart by hand)."""
    from torch.distributed.tensor import DTensor

    import moeflow
    from moeflow.parallel.grads import reduce_tp_partial_grads
    from moeflow.parallel.loss import tp_loss
    from tests.support.hf_tiny import tiny_model

    model = tiny_model("qwen3_next", seed=0)
    state = moeflow.parallelize(model, moeflow.ParallelDims(dist.get_world_size(), tp=2))
    assert list(state.tp_whole) == ["model.layers.0.linear_attn"], list(state.tp_whole)
    mixer = state.tp_whole["model.layers.0.linear_attn"]
    tokens, targets = batch(model.config.vocab_size, B=2, S=8)
    tp_loss(logits_of(state.model, tokens), targets).backward()
    p = next(mixer.parameters())
    assert not isinstance(p, DTensor) or all(d != "tp" for d in p.device_mesh.mesh_dim_names), p.device_mesh
    local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
    same = local.clone()
    local.add_(float(dist.get_rank()))  # rank 0: g, rank 1: g + 1
    reduce_tp_partial_grads(state)
    torch.testing.assert_close(local, same + 0.5)
    reduce_tp_partial_grads(state)  # once per step: a second call changes nothing
    torch.testing.assert_close(local, same + 0.5)


def case_loss():
    """tp_loss on vocab-sharded logits (uneven shards, ignore_index, every reduction) vs F.cross_entropy."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from moeflow.parallel.loss import tp_loss

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 7, generator=g) * 3  # V = 7: shards of 4 and 3
    targets = torch.randint(0, 7, (2, 5), generator=g)
    targets[0, 1] = -100
    for reduction in ("mean", "sum", "none"):
        ref = logits.clone().requires_grad_()
        want = F.cross_entropy(ref.flatten(0, 1), targets.flatten(), reduction=reduction)
        want = want.view(2, 5) if reduction == "none" else want
        (want * torch.arange(want.numel()).view(want.shape)).sum().backward()
        sharded = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
        got = tp_loss(sharded, targets, reduction=reduction)
        assert not hasattr(got, "placements")
        (got * torch.arange(got.numel()).view(got.shape)).sum().backward()
        assert_rel(f"loss ({reduction})", got, want, 1e-6)
        assert_rel(f"logit grad ({reduction})", sharded.grad, ref.grad, 1e-6)


def _expect(fn, *needles):
    try:
        fn()
    except ValueError as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in {str(exc)!r}"
        return
    raise AssertionError(f"no ValueError (expected one mentioning {needles})")


def case_bad_inputs():
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel

    import moeflow
    from moeflow.core.parallel_dims import ParallelDims
    from moeflow.parallel.adapter import adapter_for
    from moeflow.parallel.tensor import apply_tensor_parallel, tp_plan

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    # tp = 2 does not divide 3 kv heads: parallelize refuses before touching the model
    _expect(lambda: moeflow.parallelize(moeflow_model("dense", n_heads=6, n_kv_heads=3, head_dim=8),
                                        ParallelDims(world, tp=2)),
            "parallel.tp (2) must divide model.n_kv_heads (3)", "[1, 3]")
    _expect(lambda: ParallelDims(8, tp=8).check_model(moeflow_model("dense").cfg),
            "parallel.tp (8) must divide model.n_heads (4)")
    _expect(lambda: adapter_for(hf_model("llama")).check_tp_widths(3),
            "num_attention_heads (4) in the Hugging Face config")
    # context parallelism of layers it can neither split nor run whole (a layer kind it does not know): refused
    # before any group or swap
    from tests.support.hf_tiny import with_unknown_layer_kind

    _expect(lambda: moeflow.parallelize(with_unknown_layer_kind(), ParallelDims(world, cp=2)),
            "Qwen3NextForCausalLM: its sparse_attention layers are neither full, sliding-window or chunked")
    # a Linear no pattern covers, in a block or in its attention
    model = moeflow_model("dense")
    model.layers["1"].gate = nn.Linear(32, 4)
    _expect(lambda: apply_tensor_parallel(model, mesh), "['layers.1.gate']", "tp_plan=", "does not place")
    model = moeflow_model("dense")
    model.layers["1"].attention.gate = nn.Linear(32, 4)
    _expect(lambda: apply_tensor_parallel(model, mesh), "layer 1's attention.gate (Linear)", "tp_plan=",
            "an attention submodule the built-in tensor-parallel plan does not place")
    # a pattern that matches nothing (typo)
    model = moeflow_model("dense")
    plan = {**tp_plan(model), "layers.*.atention.wq": ColwiseParallel()}
    _expect(lambda: apply_tensor_parallel(model, mesh, plan), "layers.*.atention.wq", "match no module")
    _expect(lambda: tp_plan(nn.Linear(2, 2)), "no built-in tensor-parallel plan", "tp_plan=")
    _expect(lambda: tp_plan(moeflow_model("dense", attention="mla", q_lora_rank=0, kv_lora_rank=16,
                                          qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, qk_norm="none")),
            "not supported with parallel.tp > 1 yet")
    # sequence length not divisible by tp
    model = apply_tensor_parallel(moeflow_model("dense"), mesh)
    _expect(lambda: model(torch.zeros(1, 2 * world + 1, dtype=torch.long)), "must be divisible by parallel.tp")


def case_tp1_noop():
    """tp = 1 (a size-1 tp dim of a bigger mesh, or no mesh): the model is untouched."""
    from torch.distributed.device_mesh import init_device_mesh

    from moeflow.parallel.tensor import apply_tensor_parallel

    model = moeflow_model("moe")
    before = {n: p for n, p in model.named_parameters()}
    meshes = [None]
    if dist.is_initialized():
        meshes.append(init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))["tp"])
    for mesh in meshes:
        assert apply_tensor_parallel(model, mesh) is model
        assert {n: p for n, p in model.named_parameters()} == before
        assert not model._forward_pre_hooks


def case_plain_loss_and_norm():
    """Without tensor parallelism tp_loss is F.cross_entropy and grad_norm_sq_local the plain sum of squares."""
    import torch.nn.functional as F

    from moeflow.parallel.grads import grad_norm_sq_local
    from moeflow.parallel.loss import tp_loss

    model = moeflow_model("moe")
    tokens, targets = batch(64)
    logits = model(tokens)
    loss = tp_loss(logits, targets)
    assert torch.equal(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    loss.backward()
    want = sum(p.grad.pow(2).sum() for p in model.parameters())
    assert torch.allclose(grad_norm_sq_local(model), want)


# What torch's own wrappers record on the modules they wrap (fully_shard's composable-API state, DTensor's
# distribute_module flag). Anything else new on a module after parallelize would be moeflow's.
TORCH_WRAPPER_ATTRIBUTES = ("_fsdp_use_orig_params", "_is_fsdp_managed_module", "__composable_api_state_key_",
                            "_distribute_module_applied")


def case_parallelize_adds_no_attributes():
    """moeflow.parallelize under several layouts: every module still present afterwards has exactly the attributes
    it had before (torch's wrapper bookkeeping aside); what the run needs comes back in the ParallelState."""
    import moeflow

    world = dist.get_world_size() if dist.is_initialized() else 1
    full = moeflow.ParallelOptions(activation_checkpointing="full")
    layouts = [(dict(), None), (dict(), full)]
    if world == 2:
        layouts += [(dict(ep=2), None), (dict(tp=2), None),
                    (dict(pp=2, pp_schedule="GPipe"), moeflow.ParallelOptions(microbatches=2)), (dict(zero=1), None),
                    (dict(ep=2), full), (dict(cp=2), None), (dict(cp=2, ep=2), None)]
    for layout, options in layouts:
        model = moeflow_model("moe", tie_embeddings=False)
        before = {name: set(vars(m)) for name, m in model.named_modules()}
        state = moeflow.parallelize(model, moeflow.ParallelDims(world, **layout), options)
        assert state.model is model and state.runner is not None, layout
        for name, module in model.named_modules():
            added = {a for a in set(vars(module)) - before.get(name, set())
                     if not a.startswith(TORCH_WRAPPER_ATTRIBUTES)}
            assert not added, f"parallelize({layout}) added {sorted(added)} to module {name!r}"
