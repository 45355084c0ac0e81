"""moeflow's DeepEP / UCCL-EP adapter (moeflow/ep/backends/external.py) against a fake `deep_ep`.

The fake (tests/support/fake_deep_ep) asserts DeepEP V1's Buffer contract on every call and moves tokens with gloo, so
these tests fail if the adapter calls the library wrongly (a dtype, a missing layout tensor, a handle it looks
into, an event it does not wait for) or wraps it wrongly in autograd. References: the single-process MoE and
trainer, and moeflow's own alltoall Buffer (tested elsewhere against moeflow.ep.reference).

One launch of 2 gloo ranks runs every distributed case, the trainer comparison included.
"""

from __future__ import annotations

import copy
import importlib.util
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from tests.ep.ep_worker import seeded_moe
from tests.support import fake_deep_ep as fake_deep_ep_package
from tests.support.model_helpers import metric

TRAIN = [  # tests/parallel/test_layouts.py's BASE model, data and steps
    "--model.name=tiny-moe", "--model.dim=32", "--model.n_layers=4", "--model.n_heads=4",
    "--model.n_kv_heads=2", "--model.ffn_dim=64", "--model.moe.ffn_dim=32", "--model.moe.num_experts=4",
    "--data.seq_len=16", "--data.max_bytes=60000", "--training.global_batch=8", "--training.warmup_steps=1",
    "--training.lr=3e-3", "--metrics.log_every=1", "--metrics.tensorboard=false", "--eval.every=0",
    "--eval.batches=1", "--training.steps=3",
]


@contextmanager
def fake_deep_ep(flavour: str = "deep_ep"):
    """The fake importable as `deep_ep` in this process, for the duration of the block."""
    deep_ep = fake_deep_ep_package.install()
    try:
        deep_ep.use_flavour(flavour)
        yield deep_ep
    finally:
        fake_deep_ep_package.uninstall()


# ---- one process ------------------------------------------------------------------------------------------


def test_world_size_one_is_refused_with_the_fix():
    from moeflow.ep import Buffer

    with fake_deep_ep(), pytest.raises(ValueError) as info:
        Buffer(None, backend="deep_ep")
    msg = str(info.value)
    assert "1 rank" in msg and "parallel.ep >= 2" in msg and "backend='auto'" in msg, msg


def test_uccl_needs_the_uccl_drop_in():
    from moeflow.ep import Buffer

    with fake_deep_ep("deep_ep"), pytest.raises(RuntimeError, match="not UCCL-EP's drop-in"):
        Buffer(None, backend="uccl")
    with fake_deep_ep("uccl"), pytest.raises(ValueError, match="1 rank"):  # recognised, then the size check
        Buffer(None, backend="uccl")


def test_missing_library_says_what_to_install():
    from moeflow.ep import Buffer

    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("a deep_ep package is installed here")
    for name in ("deep_ep", "uccl"):
        with pytest.raises(RuntimeError) as info:
            Buffer(None, backend=name)
        assert "deep_ep" in str(info.value) and "backend='auto'" in str(info.value)


def test_ep_backend_setting_is_checked_before_launch():
    from moeflow.config import load_config, parse_overrides

    def cfg(*extra):
        return load_config(None, parse_overrides([*TRAIN, *extra]))

    with pytest.raises(ValueError, match="parallel.ep_backend"):
        cfg("--parallel.ep_backend=deepep")
    six = ["--model.moe.num_experts=12", "--parallel.ep=6", "--training.global_batch=12"]
    cfg(*six).layout(6)  # moeflow's own backends take any EP size
    with pytest.raises(ValueError, match=r"parallel.ep = 6.*2, 4, 8"):
        cfg(*six, "--parallel.ep_backend=deep_ep").layout(6)
    cfg("--parallel.ep=2", "--parallel.ep_backend=uccl").layout(2)


# ---- two processes ----------------------------------------------------------------------------------------


def _setup(rank: int, world: int) -> None:
    from tests.parallel.layout_worker import _trainer_env

    _trainer_env(rank, world)
    fake_deep_ep_package.install()


def _run(_, case) -> None:
    name, fn, kwargs = case
    fn(**kwargs)


def case_moe(flavour: str, tokens: list[int], E: int = 8, K: int = 2, dim: int = 16, shared: bool = True,
             autocast: bool = False) -> None:
    """The EP MoE layer through the fake vs the single-process MoE on all ranks' tokens: output and every
    gradient. `tokens`: tokens per rank (uneven, zero allowed)."""
    import deep_ep

    from moeflow.parallel.expert import apply_expert_parallel

    deep_ep.use_flavour(flavour)
    me, R = dist.get_rank(), dist.get_world_size()
    moe = seeded_moe(E, K, dim, shared, expert_impl="loop")
    ep = copy.deepcopy(moe)
    assert apply_expert_parallel(ep, dist.group.WORLD, backend="uccl" if flavour == "uccl" else "deep_ep") == 1
    g = torch.Generator().manual_seed(5)
    x_all, gy_all = torch.randn(sum(tokens), dim, generator=g), torch.randn(sum(tokens), dim, generator=g)
    lo, hi = sum(tokens[:me]), sum(tokens[:me + 1])
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    deep_ep.strict_bf16_combine(autocast)  # under autocast every combine must be bf16, as DeepEP's kernels want
    try:
        x_ref = x_all.clone().requires_grad_()
        with ctx:
            y_ref = moe(x_ref)
        (y_ref.float() * gy_all).sum().backward()
        x = x_all[lo:hi].clone().requires_grad_()
        del deep_ep.CALLS[:]
        with ctx:
            y = ep(x)
        (y.float() * gy_all[lo:hi]).sum().backward()
    finally:
        deep_ep.strict_bf16_combine(False)
    # DeepEP's README pairing: forward layout, dispatch, combine; backward: the combine's is a cached dispatch,
    # the dispatch's a combine. Under autocast every token crosses in bf16.
    calls = [c for c in deep_ep.CALLS if c["op"] != "Buffer"]
    assert [(c["op"], c.get("cached")) for c in calls] == [
        ("get_dispatch_layout", None), ("dispatch", False), ("combine", None), ("dispatch", True),
        ("combine", None)], calls
    want = torch.bfloat16 if autocast else torch.float32
    assert all(c["x_dtype"] == want for c in calls if "x_dtype" in c), calls
    # bf16 tokens round at 2^-9 and pass through bf16 experts: compare at bf16's resolution then.
    tol = dict(atol=3e-2, rtol=3e-2) if autocast else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y.float(), y_ref[lo:hi].float(), **tol)
    torch.testing.assert_close(x.grad, x_ref.grad[lo:hi], **tol)
    L = E // R
    for name in ("w1", "w3", "w2"):
        torch.testing.assert_close(getattr(ep.experts, name).grad,
                                   getattr(moe.experts, name).grad[me * L:(me + 1) * L], **tol)
    reference = dict(moe.named_parameters())
    for n, p in ep.named_parameters():
        if not n.startswith("experts."):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # data parallelism's job; the layer leaves this rank's tokens' share
            torch.testing.assert_close(grad, reference[n].grad, **tol)


def _routing(me: int, T: int, E: int, K: int, seed: int):
    """topk_idx [T, K] with distinct experts per token and some -1 (dropped) entries; weights [T, K]."""
    g = torch.Generator().manual_seed(seed * 10 + me)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    idx = idx.long()
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    return idx, torch.rand(T, K, generator=g)


def _buffer_round_trip(buffer, x, idx, w, bias, y, E: int, W: int, align: int):
    """dispatch (with topk) -> a function of what arrived -> combine (weights, bias); plus a cached dispatch
    of y. -> (recv_idx, counts, valid-row outputs, combined x, combined w, cached y)."""
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=E, num_worst_tokens=W, expert_alignment=align)
    valid = (recv_idx >= 0).any(1, keepdim=True)  # padding rows (num_worst_tokens) are uninitialised
    clean_x = torch.where(valid, recv_x, torch.zeros_like(recv_x))
    out_N = clean_x * (1.0 + recv_w.sum(1, keepdim=True)) + clean_x.pow(2)
    out_x, out_w, _ = buffer.combine(out_N, handle, topk_weights=recv_w * 2.0, bias=bias)
    cached = buffer.dispatch(y, handle=handle)[0]
    n = int(valid.sum())
    return recv_idx[:n], counts, clean_x[:n], recv_w[:n], out_x, out_w, cached[:n]


def case_buffer(flavour: str, tokens: list[int], W: int = 0, align: int = 1, E: int = 8, K: int = 3,
                D: int = 8, seed: int = 0) -> None:
    """moeflow.ep.Buffer(backend="deep_ep") through the fake vs Buffer(backend="alltoall"): every output and the
    gradients of x, topk_weights, bias and the cached dispatch's input. W > 0: num_worst_tokens rows."""
    import deep_ep

    from moeflow.ep import Buffer

    deep_ep.use_flavour(flavour)
    me = dist.get_rank()
    idx, w0 = _routing(me, tokens[me], E, K, seed)
    g = torch.Generator().manual_seed(seed * 10 + me + 100)
    x0, y0 = torch.randn(tokens[me], D, generator=g), torch.randn(tokens[me], D, generator=g)
    bias0 = torch.randn(tokens[me], D, generator=g)
    results = {}
    for backend in ("alltoall", "uccl" if flavour == "uccl" else "deep_ep"):  # the reference first
        x, w, bias, y = (t.clone().requires_grad_() for t in (x0, w0, bias0, y0))
        out = _buffer_round_trip(Buffer(dist.group.WORLD, backend=backend), x, idx, w, bias, y, E, W, align)
        recv_idx, counts, recv_x, recv_w, out_x, out_w, cached = out
        loss = (out_x * torch.arange(D)).sum() + out_w.pow(2).sum() + (cached * recv_x).sum() + recv_w.sum()
        loss.backward()
        results[backend] = [recv_idx, recv_x, recv_w, out_x, out_w, cached, x.grad, w.grad, bias.grad, y.grad]
        results[backend + " counts"] = counts
    name = "uccl" if flavour == "uccl" else "deep_ep"
    ref, got = results["alltoall"], results[name]
    # DeepEP returns no counts with num_worst_tokens (that is the point: no host sync); moeflow still does.
    assert results[name + " counts"] == ([] if W else results["alltoall counts"])
    names = ["recv_idx", "recv_x", "recv_w", "out_x", "out_w", "cached", "x.grad", "w.grad", "bias.grad", "y.grad"]
    for name, a, b in zip(names, ref, got):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def case_fp8(flavour: str, tokens: list[int], E: int = 8, K: int = 2) -> None:
    """An fp8 (x, scales) dispatch and a cached one: the same bytes as moeflow's alltoall delivers."""
    import deep_ep

    from moeflow.ep import Buffer, per_token_cast_to_fp8

    deep_ep.use_flavour(flavour)
    me = dist.get_rank()
    idx, w = _routing(me, tokens[me], E, K, seed=4)
    q = per_token_cast_to_fp8(torch.randn(tokens[me], 128, generator=torch.Generator().manual_seed(me)))
    got = {}
    for backend in ("alltoall", "uccl" if flavour == "uccl" else "deep_ep"):
        buffer = Buffer(dist.group.WORLD, backend=backend)
        (rx, rs), ridx, rw, counts, handle, _ = buffer.dispatch(q, topk_idx=idx, topk_weights=w, num_experts=E)
        cx, cs = buffer.dispatch(q, handle=handle)[0]
        got[backend] = [rx.view(torch.uint8), rs, ridx, rw, cx.view(torch.uint8), cs, torch.tensor(counts)]
    for a, b in zip(*got.values()):
        assert torch.equal(a, b)


def case_async(flavour: str) -> None:
    """README's overlapped calls: layout async -> dispatch(previous_event=, async_finish, allocate_on_comm_stream)
    -> `with event:`; combine async -> current_stream_wait(). Same results as the synchronous calls; the
    outputs are not there before the wait (the fake's model of a stream)."""
    import deep_ep

    from moeflow.ep import Buffer

    deep_ep.use_flavour(flavour)
    me, E = dist.get_rank(), 8
    buffer = Buffer(dist.group.WORLD, backend="uccl" if flavour == "uccl" else "deep_ep")
    idx, w = _routing(me, 6, E, 2, seed=3)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(me))
    sync = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    sync_y = buffer.combine(sync[0] * 3.0, sync[4])[0]

    *layout, layout_event = buffer.get_dispatch_layout(idx, E, async_finish=True)
    assert layout_event.event is not None
    n_rank, n_node, n_expert, in_rank = layout
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=n_expert, topk_idx=idx, topk_weights=w, previous_event=layout_event,
        async_finish=True, allocate_on_comm_stream=True)
    assert recv_x.numel() == 0 or recv_x.isnan().all(), "the fake's async outputs should not be ready yet"
    with event:
        pass
    for a, b in zip((recv_x, recv_idx, recv_w), sync[:3]):
        torch.testing.assert_close(a, b)
    assert counts == sync[3]
    y, _, event = buffer.combine(recv_x * 3.0, handle, async_finish=True)
    event.current_stream_wait()
    torch.testing.assert_close(y, sync_y)


def _refused(fn, needle: str) -> None:
    try:
        fn()
    except (AssertionError, TypeError) as exc:
        assert needle in str(exc), f"refused, but not for {needle!r}: {exc}"
        return
    raise AssertionError(f"the fake accepted a call that breaks DeepEP's contract ({needle})")


def case_contract() -> None:
    """The fake refuses what DeepEP V1 asserts against (so the adapter's passing calls mean something)."""
    import deep_ep

    from moeflow.ep import get_dispatch_layout

    deep_ep.use_flavour("deep_ep")
    group, me, E = dist.group.WORLD, dist.get_rank(), 8
    _refused(lambda: deep_ep.Buffer.get_dispatch_config(1), "Unsupported number of EP ranks")
    _refused(lambda: deep_ep.Buffer(group, 0, 1280), "num_rdma_bytes > 0")
    _refused(lambda: deep_ep.Buffer(group, 100), "multiples of 128")
    buf = deep_ep.Buffer(group, 1 << 24)
    small = deep_ep.Buffer(group, 1280)
    idx, w = _routing(me, 5, E, 2, seed=1)
    x = torch.randn(5, 8)
    _refused(lambda: buf.get_dispatch_layout(idx.int(), E), "Long")
    _refused(lambda: buf.get_dispatch_layout(idx.t().contiguous().t(), E), "contiguous")
    n_rank, n_node, n_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    lay = dict(num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_node, is_token_in_rank=in_rank,
               num_tokens_per_expert=n_expert)
    want = get_dispatch_layout(idx, E, dist.get_world_size())  # moeflow's, an independent implementation
    for a, b in zip((n_rank, n_node, n_expert, in_rank), want):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), (a, b)
    _refused(lambda: buf.dispatch(x, **{**lay, "is_token_in_rank": None}, topk_idx=idx, topk_weights=w),
             "layout tensors")
    _refused(lambda: buf.dispatch(x, **{**lay, "num_tokens_per_rank": n_rank.long()}, topk_idx=idx,
                                  topk_weights=w), "int32")
    _refused(lambda: buf.dispatch(x, **{**lay, "is_token_in_rank": in_rank.int()}, topk_idx=idx,
                                  topk_weights=w), "bool")
    _refused(lambda: buf.dispatch(x, **lay, topk_idx=idx, topk_weights=w.double()), "float32")
    _refused(lambda: buf.dispatch(x, **lay, topk_idx=idx.int(), topk_weights=w), "Long")
    _refused(lambda: buf.dispatch(x, **lay, topk_idx=idx), "go together")
    _refused(lambda: buf.dispatch(torch.randn(8, 5).t(), **lay, topk_idx=idx, topk_weights=w), "contiguous")
    _refused(lambda: buf.dispatch(torch.randn(5, 6), **lay, topk_idx=idx, topk_weights=w), "multiple of 16")
    _refused(lambda: buf.dispatch(x, **lay, num_worst_tokens=20), "num_worst_tokens")
    _refused(lambda: buf.dispatch(x, **{**lay, "num_tokens_per_expert": n_expert.roll(1)}, topk_idx=idx,
                                  topk_weights=w), "disagrees")
    _refused(lambda: buf.dispatch(x, **lay, topk_idx=idx, topk_weights=w, allocate_on_comm_stream=True),
             "previous_event")
    _refused(lambda: small.dispatch(x, **lay, topk_idx=idx, topk_weights=w), "NVL buffer bytes")
    recv_x, _, _, _, handle, event = buf.dispatch(x, **lay, topk_idx=idx, topk_weights=w)
    _refused(lambda: event.current_stream_wait(), "")  # a synchronous call's event is empty
    _refused(lambda: buf.dispatch(x, handle=handle, topk_idx=idx, topk_weights=w), "cached dispatch")
    _refused(lambda: buf.combine(recv_x[1:].contiguous(), handle), "src_idx")
    _refused(lambda: buf.combine(recv_x.half(), handle), "Unsupported type")
    uccl_handle = handle[:3] + (int(handle[3].size(0)),) + handle[3:]
    _refused(lambda: buf.combine(recv_x, uccl_handle), "6-tuple")
    deep_ep.use_flavour("uccl")
    _refused(lambda: deep_ep.Buffer(group).combine(recv_x, handle), "7-tuple")
    deep_ep.use_flavour("deep_ep")
    recv_async, *_, handle2, ev = buf.dispatch(x, **lay, topk_idx=idx, topk_weights=w, async_finish=True)
    _refused(lambda: buf.combine(recv_async, handle2), "nobody waited")
    ev.current_stream_wait()
    buf.combine(recv_async, handle2)


def case_adapter_mutations() -> None:
    """What the fake would catch if the adapter were wrong: each mutation makes a case above fail."""
    from moeflow.ep.backends import external

    def detected(mutate, restore, case, needle, **kwargs) -> bool:
        mutate()
        try:
            case(**kwargs)
            failed = 0
        except AssertionError as exc:
            assert needle in str(exc), f"failed for another reason than {needle!r}: {exc}"
            failed = 1
        finally:
            restore()
        flag = torch.tensor([failed])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a wrong number may show on one rank only
        return bool(flag.item())

    original_apply, original_topk = external._Dispatch.apply, external.ExternalBuffer._topk_idx

    def patch_kwargs(**changes):
        def apply(lib_buffer, kwargs, x, w):
            kwargs = {**kwargs, **{k: f(kwargs[k]) for k, f in changes.items()}}
            return original_apply(lib_buffer, kwargs, x, w)
        return lambda: setattr(external._Dispatch, "apply", apply)

    def restore():
        external._Dispatch.apply = original_apply
        external.ExternalBuffer._topk_idx = original_topk

    moe = dict(flavour="deep_ep", tokens=[5, 3])
    mutations = {  # name: (mutation, case, what the failure says, case arguments)
        "topk_idx left int32": (lambda: setattr(external.ExternalBuffer, "_topk_idx",
                                                lambda self, t: None if t is None else t.int()),
                                case_moe, "Long", moe),
        "is_token_in_rank dropped": (patch_kwargs(is_token_in_rank=lambda t: None), case_moe, "layout tensors", moe),
        "num_tokens_per_rank as int64": (patch_kwargs(num_tokens_per_rank=lambda t: t.long()), case_moe,
                                         "num_tokens_per_rank must be a contiguous 1-D int32", moe),
        "foreign weight gradients kept": (lambda: setattr(external, "_zero_foreign", lambda g, idx: g),
                                          case_buffer, "w.grad", dict(flavour="deep_ep", tokens=[6, 4])),
    }
    zero_foreign = external._zero_foreign
    for name, (mutate, case, needle, kwargs) in mutations.items():
        assert detected(mutate, restore, case, needle, **kwargs), f"mutation not detected: {name}"
        external._zero_foreign = zero_foreign


def case_train(argv: list[str], run_dir: str) -> None:
    """The real trainer through the fake; also: one library Buffer (sized once) serves every MoE layer."""
    import deep_ep

    from tests.parallel.layout_worker import _run_case

    deep_ep.use_flavour("deep_ep")
    del deep_ep.CALLS[:]
    _run_case(None, ("train", argv, run_dir, False))
    ops = [c["op"] for c in deep_ep.CALLS]
    # 3 steps x 3 MoE layers (tiny-moe's first is dense), each: a dispatch and a combine forward, a cached
    # dispatch and a combine backward
    assert ops.count("dispatch") >= 18 and ops.count("combine") >= 18, ops
    # One library Buffer serves every layer: at most a zero-byte one for the first layout (when this group has
    # none yet) and one sized for the hidden size, not one per layer.
    assert ops.count("Buffer") <= 2, ops


CASES = [
    ("contract", case_contract, {}),
    ("moe deep_ep", case_moe, dict(flavour="deep_ep", tokens=[5, 3])),
    ("moe uccl, zero tokens on rank 1", case_moe, dict(flavour="uccl", tokens=[6, 0], E=4, K=3, shared=False)),
    ("moe bf16 autocast", case_moe, dict(flavour="deep_ep", tokens=[4, 7], autocast=True)),
    ("buffer deep_ep", case_buffer, dict(flavour="deep_ep", tokens=[6, 4], align=4)),
    ("buffer uccl, zero tokens on rank 0", case_buffer, dict(flavour="uccl", tokens=[0, 5], seed=1)),
    ("buffer num_worst_tokens", case_buffer, dict(flavour="deep_ep", tokens=[6, 4], W=12, seed=2)),
    ("fp8 deep_ep", case_fp8, dict(flavour="deep_ep", tokens=[5, 2])),
    ("fp8 uccl", case_fp8, dict(flavour="uccl", tokens=[3, 6])),
    ("async deep_ep", case_async, dict(flavour="deep_ep")),
    ("async uccl", case_async, dict(flavour="uccl")),
    ("mutations", case_adapter_mutations, {}),
]


def test_adapter_on_two_ranks(tmp_path):
    from moeflow.config import load_config, parse_overrides
    from moeflow.train.trainer import train
    from tests.support.dist_harness import launch

    one = tmp_path / "one"
    train(load_config(None, {**parse_overrides(TRAIN), "run_dir": str(one)}), fresh=True, progress=False)
    ep = tmp_path / "ep2"
    train_case = ("train ep=2 deep_ep", case_train,
                  dict(argv=[*TRAIN, "--parallel.ep=2", "--parallel.ep_backend=deep_ep"], run_dir=str(ep)))
    cases = [*CASES, train_case]
    results = launch(2, cases, _run, setup=_setup, timeout_s=60)
    for name, *_ in cases:
        bad = [r.get(name, "not run (an earlier case failed)") for r in results if r.get(name) != "ok"]
        assert not bad, f"{name}:\n{bad[0]}"
    for key in ("loss", "grad_norm"):
        want, got = metric(one, key), metric(ep, key)
        assert sorted(got) == [1, 2, 3]
        for step, value in want.items():
            assert got[step] == pytest.approx(value, rel=1e-5), (key, step, got[step], value)
