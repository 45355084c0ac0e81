"""Multi-process cases for context parallelism (tests/parallel/test_context_parallel.py): one launch of 4 gloo ranks.

References, computed in every process: torch's scaled_dot_product_attention over the whole sequence, and the
unparallelized model on the whole batch. Which positions a cp rank holds is written out here independently of
moeflow.parallel.context: rank r of cp keeps the positions p with p // C in {r, 2cp - 1 - r}, C = S / 2cp.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATOL = 1e-5  # fp32 max abs error of outputs and gradients (measured up to ~2e-6)
REL = 1e-5  # relative norm error of model losses, logits and gradients


def launch(world: int, cases: list[tuple[str, str, dict]]) -> list[dict[str, str]]:
    from tests.support.dist_harness import launch as harness_launch

    return harness_launch(world, cases, _run_case, setup=_groups, timeout_s=120)


def _groups(rank: int, world: int) -> dict:
    """This rank's cp groups: all ranks; pairs of neighbours [[0, 1], [2, 3]]; strided pairs [[0, 2], [1, 3]]
    (group ranks unlike global ranks); itself alone (cp = 1). Every rank creates every group, in one order."""
    layouts = {"world": [list(range(world))], "pairs": [[0, 1], [2, 3]], "strided": [[0, 2], [1, 3]],
               "single": [[r] for r in range(world)]}
    groups = {}
    for name, members in layouts.items():
        made = [dist.new_group(m) for m in members]
        index = next(i for i, m in enumerate(members) if rank in m)
        groups[name] = (made[index], index)  # (this rank's group, which of them: the data differ per group)
    return groups


def _run_case(groups, case) -> None:
    _, fn, kwargs = case
    fn(groups, **kwargs)


def positions(S: int, rank: int, cp: int) -> list[int]:
    C = S // (2 * cp)
    return [p for p in range(S) if p // C in (rank, 2 * cp - 1 - rank)]


def _close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.detach().float() - want.detach().float()).abs().max().item()
    assert err <= atol, f"{name}: max abs error {err:.3g} > {atol:g}"


def _rel(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    from tests.parallel.tp_worker import assert_rel

    assert_rel(name, got, want, REL)  # (gathers a DTensor, checks the shape first)


# ---- the attention function -------------------------------------------------------------------------------


ATTENTION_KINDS = {  # (query heads, key/value heads, query/key width, value width, softmax scale)
    "MHA": (4, 4, 8, 8, None), "GQA": (4, 2, 8, 8, None), "MQA": (4, 1, 8, 8, None),
    "MLA": (4, 4, 12, 8, 0.3),  # multi-head latent attention's core: value width unlike the key width
}


def case_attention(groups, layout: str, kind: str, C: int = 3, dtype: str = "fp32"):
    """context_parallel_attention on this rank's chunks vs SDPA on the whole sequence: output, dq, dk, dv."""
    from moeflow.parallel.context import context_parallel_attention

    group, index = groups[layout]
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    H, Hk, Dk, Dv, scale = ATTENTION_KINDS[kind]
    B, S = 2, 2 * cp * C
    gen = torch.Generator().manual_seed(100 * index + len(kind))  # the groups see different sequences
    q, k, v, g = (torch.randn(B, h, S, d, generator=gen)
                  for h, d in ((H, Dk), (Hk, Dk), (Hk, Dv), (H, Dv)))
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    q, k, v, g = (t.to(dt) for t in (q, k, v, g))
    # "autocast": fp32 inputs under bf16 autocast (as a qk-norm's fp32 weight leaves q and k): the keys and values
    # must be gathered, and attended, in bf16
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast")
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    with amp:
        ref = F.scaled_dot_product_attention(*full, is_causal=True, scale=scale, enable_gqa=H != Hk)
    ref.backward(g.to(ref.dtype))
    pos = torch.tensor(positions(S, rank, cp))
    local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    gathered = []
    with amp, _recording_gather_dtypes(gathered):
        out = context_parallel_attention(*local, group, scale=scale)
    out.backward(g[:, :, pos].to(out.dtype))
    if dtype == "autocast":
        assert out.dtype == torch.bfloat16 and gathered == [torch.bfloat16], (out.dtype, gathered)
    atol = ATOL if dtype == "fp32" else 3e-2  # bf16: a few ulps, against SDPA in bf16
    _close("out", out, ref[:, :, pos], atol)
    for name, mine, whole in zip(("dq", "dk", "dv"), local, full):
        _close(name, mine.grad, whole.grad[:, :, pos], atol)


@contextlib.contextmanager
def _recording_gather_dtypes(seen: list):
    """Record the dtype of what context_parallel_attention all-gathers (its keys and values)."""
    from moeflow.parallel import context

    original = context._GatherSequence.apply
    context._GatherSequence.apply = lambda t, *rest: (seen.append(t.dtype), original(t, *rest))[1]
    try:
        yield
    finally:
        context._GatherSequence.apply = original


def case_odd_local_length_refused(groups):
    from moeflow.parallel.context import context_parallel_attention

    group, _ = groups["world"]
    q = torch.randn(1, 2, 3, 4)  # 3 local tokens cannot be two equal chunks
    try:
        context_parallel_attention(q, q, q, group)
    except ValueError as e:
        assert "divisible by 2 x cp = 8" in str(e), e
    else:
        raise AssertionError("an odd local length was accepted")


# ---- a model through moeflow.parallelize ------------------------------------------------------------------


def _model(kind: str):
    from moeflow.core.model_config import ModelConfig
    from moeflow.models.transformer import Transformer

    common = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=64, init_std=0.1)
    if kind == "mla":
        cfg = ModelConfig(**common, attention="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=12)
    else:
        cfg = ModelConfig(**common, n_kv_heads=2, qk_norm="per_head")
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model


def case_model(groups, kind: str, cp: int, ignore_rank0: bool = False):
    """moeflow.parallelize(model, cp=cp) on world 4 (the rest data-parallel, FSDP over dp x cp): this rank's
    logits, the mean loss over all targets, and every parameter's gradient equal the unparallelized model's on the
    whole batch. ignore_rank0: every target that cp rank 0 holds is ignored (-100), so that rank has none."""
    import moeflow

    world, B, S = dist.get_world_size(), 4, 32
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (B, S + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()  # shifted on the whole sequence
    ref = _model(kind)
    model = copy.deepcopy(ref)
    state = moeflow.parallelize(model, moeflow.ParallelDims(world, cp=cp))
    dp, dp_rank, cp_rank = world // cp, state.dp_rank, state.cp_mesh.get_local_rank()
    assert dist.get_process_group_ranks(state.cp_mesh.get_group()) == [dp_rank * cp + r for r in range(cp)]
    pos = torch.tensor(positions(S, cp_rank, cp))
    if ignore_rank0:
        targets[:, torch.tensor(positions(S, 0, cp))] = -100
    rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)

    ref_logits = ref(inputs)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref_loss.backward()

    x, y = state.local_sequence(inputs[rows]), state.local_sequence(targets[rows])
    assert torch.equal(x, inputs[rows][:, pos]) and torch.equal(y, targets[rows][:, pos])
    with torch.no_grad():
        _rel("logits", model(x), ref_logits[rows][:, pos])
    loss = state.runner.train_step(x, y)
    # Each rank's loss is its cp group's mean over valid targets; the dp groups' rows are equal in number but
    # not in valid targets when some are ignored, so the whole-batch mean is checked only without ignoring.
    group_mean = loss.clone()
    dist.all_reduce(group_mean, group=state.cp_mesh.get_group())
    rows_ref = F.cross_entropy(ref_logits[rows].flatten(0, 1), targets[rows].flatten(), ignore_index=-100)
    _rel("loss of this dp rank's rows", group_mean / cp, rows_ref)
    if not ignore_rank0:
        everyone = loss.clone()
        dist.all_reduce(everyone)
        _rel("loss", everyone / world, ref_loss)
        for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
            _rel(f"grad {name}", p.grad, p_ref.grad)
    else:  # one dp group (cp = world): its gradient is the whole batch's
        assert dp == 1
        for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
            _rel(f"grad {name}", p.grad, p_ref.grad)
