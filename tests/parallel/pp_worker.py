"""Multi-process harness for the pipeline-parallel tests: one gloo launch per world size runs every case.

Each case trains the same tiny model twice on every rank: unparallelized on the full global batch (the
reference, in this process) and split into pipeline stages (optionally FSDP2 on a "dp" mesh dimension),
then compares the losses, the summed router loads, and the final parameters (by their full-model names).
A rank writes {case name: "ok" | traceback} to a file the parent reads (see tests/ep/ep_worker.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

RTOL = 1e-5
GLOBAL_BATCH, SEQ = 8, 8


def launch(world: int, cases: list[tuple[str, str, dict]]) -> list[dict[str, str]]:
    from tests.support.dist_harness import launch as harness_launch

    return harness_launch(world, cases, _run_case, setup=Ctx)


def _run_case(ctx, case) -> None:
    _, fn, kwargs = case
    fn(ctx, **kwargs)


class Ctx:
    """A rank's view; meshes are built once per layout (building one is a collective)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.meshes = {}

    def mesh(self, pp: int, dp: int):
        from torch.distributed.device_mesh import init_device_mesh

        if (pp, dp) not in self.meshes:
            self.meshes[pp, dp] = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        return self.meshes[pp, dp]


def tiny_config(kind: str):
    """moeflow's tiny presets, shrunk (dim 32, 4 layers, 4 experts) so a case takes a fraction of a second."""
    from moeflow.core.presets import PRESETS

    cfg = PRESETS["tiny-moe" if kind == "moe" else "tiny-dense"]
    cfg = cfg.replace(vocab_size=64, dim=32, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=SEQ)
    if kind == "moe":
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, num_experts=4, ffn_dim=32))
    return cfg


def _batches(cfg, steps: int):
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, cfg.vocab_size, (steps + 1, GLOBAL_BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= RTOL * abs(want), f"{what}: {got} vs reference {want}"


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reference_backward(model, inputs, targets, routers, chunks: int) -> tuple[float, dict[int, torch.Tensor]]:
    """Mean loss and its gradient, over the batch in `chunks` equal consecutive parts (1: the whole batch)."""
    from moeflow.parallel.pipeline import mean_cross_entropy

    loss_sum, loads = 0.0, {i: 0 for i in routers}
    for inputs_c, targets_c in zip(inputs.chunk(chunks), targets.chunk(chunks)):
        loss = mean_cross_entropy(model(inputs_c), targets_c) / chunks
        loss.backward()
        loss_sum += loss.item()
        loads = {i: loads[i] + r.last_load for i, r in routers.items()}
    return loss_sum, loads


def _adamw(model):
    # eps 1e-6, not the default 1e-8: Adam divides by sqrt(v) + eps, so an element whose gradient is ~0
    # turns fp32 summation-order noise (~1e-11 here) into an update error of up to lr * noise / eps;
    # with 1e-8, micro-batching alone (in one process, no pipeline) moves a few weights by 2e-4 relative.
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)


def case_train(ctx, kind: str, schedule: str, pp: int, dp: int = 1, n_microbatches: int = 4, steps: int = 3,
               boundaries=None, activation_checkpointing: bool = False, eval_before_last: bool = True,
               aux_loss: bool = False, ep: bool = False):
    """`steps` AdamW steps of a pp x dp layout vs the unparallelized model on the full batch.

    aux_loss: turn on the MoE aux and z losses (the custom autograd function _AttachAuxLoss carries
    them); they are nonlinear in the tokens, so the reference then runs the same micro-batches one
    after the other (plain gradient accumulation) instead of the full batch at once.
    ep: expert parallelism over the dp ranks inside the MoE blocks (moeflow.parallel.expert), with
    the data-parallel gradient reduction done by hand instead of FSDP."""
    from moeflow.models.transformer import Transformer
    from moeflow.parallel.pipeline import build_schedule, build_stage_modules
    from moeflow.parallel.recompute import apply_activation_checkpointing
    from moeflow.parallel.runner import router_layers

    assert pp * dp == ctx.world
    cfg = tiny_config(kind)
    if aux_loss:
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, aux_loss_coef=0.1, z_loss_coef=0.01))
    reference = Transformer(cfg)
    reference.init_weights(seed=0)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    ref_routers = router_layers([reference])
    ref_opt = _adamw(reference)
    ref_chunks = dp * n_microbatches if aux_loss else 1
    for router in ref_routers.values():
        # Gradient accumulation scales each micro-batch's aux loss by 1/chunks; under pipelining the
        # schedule divides all gradients by n_microbatches, so the stages' routers keep scale 1.
        router.aux_loss_scale = 1.0 / ref_chunks

    mesh = ctx.mesh(pp, dp)
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    stages = build_stage_modules(model, pp_rank, pp, schedule, boundaries=boundaries)
    if activation_checkpointing:
        for stage in stages:
            apply_activation_checkpointing(stage.layers, "full")
    if ep:
        from moeflow.parallel.expert import apply_expert_parallel

        for stage in stages:
            apply_expert_parallel(stage, mesh["dp"].get_group(), backend="alltoall", ranks_per_node=dp)
    elif dp > 1:
        from torch.distributed.fsdp import fully_shard

        for stage in stages:
            for block in stage.layers.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(stage, mesh=mesh["dp"])
    runner = build_schedule(stages, pp_rank, pp, mesh["pp"].get_group(), torch.device("cpu"), schedule,
                            n_microbatches)
    optimizer = _adamw(model)
    local_routers = router_layers(stages)

    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    batches = _batches(cfg, steps)
    for step, (inputs, targets) in enumerate(batches[:steps]):
        if eval_before_last and step == steps - 1:
            _check_eval(runner, reference, batches[-1], rows, mesh, dp)
        want_loss, want_loads = _reference_backward(reference, inputs, targets, ref_routers, ref_chunks)
        loss = runner.step(inputs[rows], targets[rows])
        if ep:
            _reduce_ep_gradients(model, mesh["dp"].get_group(), dp)
        if step == 0:  # Adam hides a wrongly scaled gradient (its update is scale-free): compare them first
            _check_tensors({n: p.grad for n, p in model.named_parameters()},
                           {n: p.grad for n, p in reference.named_parameters()}, "gradient of ", dp_rank, dp)
        assert (loss is not None) == runner.has_last_stage
        loss = runner.broadcast_loss(loss)
        if dp > 1:
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss /= dp
        _close(float(loss), want_loss, f"loss at step {step}")
        if ref_routers:
            # The trainer's packing: one row per global layer, zeros where this rank holds no router,
            # summed over all ranks (dp ranks saw other tokens, pp ranks hold other layers).
            table = torch.zeros(cfg.n_layers, cfg.moe.num_experts)
            for i, (load, _) in runner.router_loads().items():
                table[i] = load
            dist.all_reduce(table)
            for i, want in want_loads.items():
                assert torch.equal(table[i], want), f"layer {i} load {table[i].tolist()} vs {want.tolist()}"
            for i, router in local_routers.items():
                router.update_bias(table[i])
            for i, router in ref_routers.items():
                router.update_bias(want_loads[i])
        for opt in (optimizer, ref_opt):
            opt.step()
            opt.zero_grad(set_to_none=True)

    _check_parameters(model, reference, dp_rank, dp)


def _reduce_ep_gradients(model, dp_group, dp: int) -> None:
    """What FSDP does in the parallelize()d model: average replicated gradients over the dp ranks; an
    expert's gradient already sums every dp rank's tokens (they came through the EP group), so / dp."""
    for name, param in model.named_parameters():
        if ".experts." not in name:
            dist.all_reduce(param.grad, group=dp_group)
        param.grad /= dp


def _check_eval(runner, reference, batch, rows, mesh, dp):
    from moeflow.parallel.pipeline import mean_cross_entropy

    inputs, targets = batch
    with torch.no_grad():
        want = float(mean_cross_entropy(reference(inputs), targets))
    loss = runner.broadcast_loss(runner.forward_eval(inputs[rows], targets[rows]))
    if dp > 1:
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        loss /= dp
    _close(float(loss), want, "evaluation loss")
    assert all(p.grad is None for p in reference.parameters())


def _check_tensors(got: dict, want: dict, what: str = "", ep_rank: int = 0, ep: int = 1) -> None:
    """Each of this rank's tensors equals the reference's of the same full-model name (rel 1e-5 in norm);
    expert weights sharded by expert parallelism against their slice of the reference's."""
    for name, tensor in got.items():
        assert name in want, f"{name} is not a name of the full model"
        assert tensor is not None and want[name] is not None, f"{what}{name} is missing"
        full, ref = _full(tensor.detach()), want[name].detach()
        if ".experts." in name and full.shape != ref.shape:
            ref = ref.chunk(ep)[ep_rank]
        err = float((full - ref).norm() / ref.norm().clamp(min=1e-12))
        assert err <= RTOL, f"{what}{name}: relative error {err:.3g}"


def _check_parameters(model, reference, ep_rank: int, ep: int):
    """Parameters and router biases equal the reference's, and the names over all ranks cover the model."""
    want = dict(reference.named_parameters()) | dict(reference.named_buffers())
    _check_tensors(dict(model.named_parameters()), want, "", ep_rank, ep)
    _check_tensors({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}, want)
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(n for n, _ in model.named_parameters()))
    assert set().union(*names) == set(dict(reference.named_parameters())), "the stages miss parameters"


def case_bad_batch(ctx):
    """A batch that n_microbatches does not divide is refused before any communication, on every rank."""
    from moeflow.models.transformer import Transformer
    from moeflow.parallel.pipeline import build_schedule, build_stage_modules

    stages = build_stage_modules(Transformer(tiny_config("dense")), ctx.rank, 2, "GPipe")
    runner = build_schedule(stages, ctx.rank, 2, dist.group.WORLD, torch.device("cpu"), "GPipe", 3)
    tokens = torch.zeros(8, SEQ, dtype=torch.long)
    try:
        runner.step(tokens, tokens)
    except ValueError as e:
        assert "micro-batches (3)" in str(e) and "per-rank batch (8)" in str(e), e
    else:
        raise AssertionError("no ValueError for 8 rows in 3 micro-batches")
