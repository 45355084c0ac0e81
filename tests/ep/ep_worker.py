"""Multi-process harness for the moeflow.ep tests: one launch per world size runs MANY cases.

Process start-up (importing torch) dominates on CPU, so the parent spawns `world` gloo processes once;
each loops over the same list of cases (every rank calls the same collectives in the same order), and
writes {case name: "ok" | traceback} to a file the parent reads. Cases check their own rank's results
against moeflow.ep.reference, which every rank can evaluate because the parent passes every rank's
inputs (routings) to all of them.
"""

from __future__ import annotations

import copy
import math
import os
import time
import traceback

import torch
import torch.distributed as dist

from tests.support.numerics import assert_same_up_to_order

# ---- launching ------------------------------------------------------------------------------------------


def launch(world: int, cases: list[tuple[str, str, dict]], timeout_s: float = 20.0) -> list[dict[str, str]]:
    """Run `cases` ([(name, function name, kwargs)]) on `world` gloo processes; -> per-rank results."""
    from tests.support.dist_harness import launch as harness_launch

    return harness_launch(world, cases, _run_case, setup=_EpSetup(timeout_s))


class _EpSetup:
    """Picklable setup: a rank's Ctx with the EP timeout (moeflow.ep reads LOCAL_WORLD_SIZE; unset it)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def __call__(self, rank: int, world: int):
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        return Ctx(rank, world, self.timeout_s)


def _run_case(ctx, case) -> None:
    _, fn, kwargs = case
    fn(ctx, **kwargs)


class Ctx:
    """A rank's view: its rank, the world, and Buffers reused across cases (subgroups are built once)."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.group = dist.group.WORLD if dist.is_initialized() else None
        self.buffers = {}

    def buf(self, backend: str, G: int):
        from moeflow.ep import Buffer

        key = (backend, G)
        if key not in self.buffers:
            self.buffers[key] = Buffer(self.group, backend=backend, ranks_per_node=G, timeout_s=self.timeout_s)
        return self.buffers[key]


def run_inline(cases) -> dict[str, str]:
    """World size 1 in this process, no process group."""
    ctx = Ctx(0, 1, 10.0)
    ctx.group = None
    out = {}
    for name, fn, kwargs in cases:
        try:
            fn(ctx, **kwargs)
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc()
    return out


# ---- inputs ---------------------------------------------------------------------------------------------


def build(routing: dict, D: int, seed: int = 0):
    """Every rank's (topk_idx, x, topk_weights) from a routing {"E", "K", "idx": [per-rank lists]}."""
    K = routing["K"]
    idxs = [torch.tensor(r, dtype=torch.int64).view(-1, K) for r in routing["idx"]]
    xs, ws = [], []
    for s, idx in enumerate(idxs):
        g = torch.Generator().manual_seed(seed * 1000 + s)
        xs.append(torch.randn(idx.shape[0], D, generator=g))
        ws.append(torch.rand(idx.shape[0], K, generator=g))
    return idxs, xs, ws


def _sum_stats(buf) -> list[int]:
    s = buf.stats
    v = torch.tensor([s.dispatch_bytes_intra, s.dispatch_bytes_inter, s.combine_bytes_intra,
                      s.combine_bytes_inter], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(v)
    return v.tolist()


# ---- cases ----------------------------------------------------------------------------------------------


def case_reference(ctx, routing, backend, G, W=0, align=1, D=8, check_bytes=True):
    """dispatch + combine (+ gradients) vs the reference, bit for bit in fp32; bytes vs the bounds."""
    from moeflow.ep import reference
    from moeflow.ep.counts import combine_row_bytes, dispatch_row_bytes, traffic_bytes

    E, K, me, R = routing["E"], routing["K"], ctx.rank, ctx.world
    idxs, xs, ws = build(routing, D)
    buf = ctx.buf(backend, G)
    buf.reset_stats()
    x = xs[me].clone().requires_grad_()
    w = ws[me].clone().requires_grad_()
    n_rank, n_node, n_exp, in_rank, _ = buf.get_dispatch_layout(idxs[me], E)
    if W == "safe":  # static blocks of W // R slots per peer: R x the largest token count never drops a copy
        W = R * max(max(t.shape[0] for t in idxs), 1)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=n_exp, topk_idx=idxs[me], topk_weights=w, expert_alignment=align,
        num_worst_tokens=W)
    ref = reference.dispatch(xs, idxs, E, ws)[me]
    N = ref.x.shape[0]
    assert recv_x.shape[0] == (W or N), (recv_x.shape, W, N)
    assert torch.equal(recv_x[:N], ref.x)
    assert torch.equal(recv_idx[:N], ref.topk_idx)
    assert torch.equal(recv_w[:N], ref.topk_weights)
    if W:
        assert (recv_idx[N:] == -1).all() and (recv_w[N:] == 0).all()
    # With num_worst_tokens the per-expert counts stay on the device (DeepEP returns [] there too).
    assert counts == ([] if W else [math.ceil(c / align) * align for c in ref.num_tokens_per_expert]), (counts, ref)

    def expert(rx, rw, r):  # a stand-in for the experts that depends on x and the weights
        return rx * (1 + rw.sum(1, keepdim=True)) * (r + 1)

    out, out_w, _ = buf.combine(expert(recv_x, recv_w, me), handle, topk_weights=recv_w)
    assert buf.stats.calls == 2
    if check_bytes and not W:  # the static path moves whole blocks (docs in moeflow/ep/backends/static.py)
        strategy = {"alltoall": "rank", "hierarchical": "node", "allgather": "allgather"}[backend]
        want = traffic_bytes(idxs, E, G, strategy, dispatch_row_bytes(D, 4, num_topk=K, with_topk_idx=True,
                             with_topk_weights=True), combine_row_bytes(D, 4, K, with_topk_weights=True))
        got = _sum_stats(buf)
        assert got == [want.dispatch_bytes_intra, want.dispatch_bytes_inter, want.combine_bytes_intra,
                       want.combine_bytes_inter], (got, want)
    xr = [t.clone().requires_grad_() for t in xs]
    wr = [t.clone().requires_grad_() for t in ws]
    rr = reference.dispatch(xr, idxs, E, wr)
    yr = [expert(rr[r].x, rr[r].topk_weights, r) for r in range(R)]
    outr, outwr = reference.combine(yr, idxs, E, G, [rr[r].topk_weights for r in range(R)])
    assert torch.equal(out, outr[me]), (out - outr[me]).abs().max()
    assert torch.equal(out_w, outwr[me])
    gs = [torch.randn(t.shape[0], D, generator=torch.Generator().manual_seed(77 + s)) for s, t in enumerate(idxs)]
    gws = [torch.randn(t.shape[0], K, generator=torch.Generator().manual_seed(99 + s)) for s, t in enumerate(idxs)]
    ((out * gs[me]).sum() + (out_w * gws[me]).sum()).backward()
    sum((o * g).sum() + (ow * gw).sum() for o, g, ow, gw in zip(outr, gs, outwr, gws)).backward()
    # the same expert sums; the combine adds a row's K expert outputs in another order
    assert_same_up_to_order(x.grad, xr[me].grad, 2 * D + K, "x.grad")
    assert_same_up_to_order(w.grad, wr[me].grad, 2 * D + K, "w.grad")


def case_static_overflow(ctx, routing, G, C=1, D=8):
    """num_worst_tokens = R x C: each peer gets C slots of a rank's tokens; the rest of a rank's copies for that
    peer are dropped and counted. Brute force here: which rows arrive, how many copies were dropped."""
    from moeflow.ep.counts import token_rank_mask

    E, me, R = routing["E"], ctx.rank, ctx.world
    idxs, xs, ws = build(routing, D)
    buf = ctx.buf("alltoall", G)
    buf.reset_stats()
    recv_x, recv_idx, _, counts, _, _ = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me],
                                                     num_experts=E, num_worst_tokens=R * C)
    want_rows, dropped = [], 0
    for s in range(R):
        need = token_rank_mask(idxs[s], E, R)
        want_rows += [xs[s][t] for t in need[:, me].nonzero()[:C, 0].tolist()]
        if s == me:
            dropped = sum(max(0, int(need[:, r].sum()) - C) for r in range(R))
    assert recv_x.shape == (R * C, D) and counts == []
    n = len(want_rows)
    if n:
        assert torch.equal(recv_x[:n], torch.stack(want_rows))
    assert (recv_idx[n:] == -1).all() and (recv_x[n:] == 0).all()
    assert int(buf.static_overflow) == dropped, (int(buf.static_overflow), dropped)


def case_oracle(ctx, routing, backend, G, D=8):
    """DeepEP's test: x filled with the rank id; rows come from the ranks the layout says;
    combine(dispatch(x)) / (ranks each token went to) == x. Also a cached dispatch."""
    from moeflow.ep import reference

    E, me = routing["E"], ctx.rank
    idxs, _, _ = build(routing, D)
    buf = ctx.buf(backend, G)
    x = torch.full((idxs[me].shape[0], D), float(me))
    n_rank, n_node, n_exp, in_rank, _ = buf.get_dispatch_layout(idxs[me], E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=n_exp, topk_idx=idxs[me])
    src = reference.dispatch([torch.zeros(t.shape[0], 1) for t in idxs], idxs, E)[me].src_rank
    assert torch.equal(recv_x, src.float().unsqueeze(1).expand(-1, D)), (recv_x, src)
    out, _, _ = buf.combine(recv_x, handle)
    fanout = in_rank.sum(1, keepdim=True).float()
    routed = fanout[:, 0] > 0
    assert torch.equal(out[routed] / fanout[routed], x[routed])
    assert (out[~routed] == 0).all()
    again = buf.dispatch(x * 2, handle=handle)[0]
    assert torch.equal(again, recv_x * 2)


def _dest_ranks(topk_idx_TK: torch.Tensor, t: int, L: int) -> list[int]:
    return sorted({int(e) // L for e in topk_idx_TK[t] if e >= 0})


def _bf16_combine_oracle(vals_by_rank: dict[int, torch.Tensor], G: int, round_node_partials: bool) -> torch.Tensor:
    """One token's combine, written out: float32 sums over each node's ranks (ascending), nodes ascending, one
    rounding to bf16 at the end; with `round_node_partials` each node's partial sum is rounded to bf16 before
    the nodes are summed (what crosses nodes in bf16: the hierarchical backend, as DeepEP's internode combine)."""
    total = torch.zeros_like(next(iter(vals_by_rank.values())), dtype=torch.float32)
    for node in sorted({r // G for r in vals_by_rank}):
        partial = torch.zeros_like(total)
        for r in sorted(r for r in vals_by_rank if r // G == node):
            partial = partial + vals_by_rank[r].float()
        total = total + (partial.bfloat16().float() if round_node_partials else partial)
    return total.bfloat16()


def case_bf16(ctx, routing, backend, G, D=32, shows_rounding=False):
    """bf16 x through dispatch, stand-in experts and combine (and backward) against an oracle written here, not
    moeflow.ep.reference: every received row bit for bit, every combined token as _bf16_combine_oracle sums its
    copies (hierarchical: the per-node partial sums rounded to bf16), and within two bf16 roundings of the exact
    sum. With `shows_rounding`, a hierarchical layout with nodes of several ranks must make the partial rounding
    visible in the data (so the comparison can tell it from none)."""
    E, K, me, R = routing["E"], routing["K"], ctx.rank, ctx.world
    L = E // R
    idxs, xs, ws = build(routing, D)
    xb = [x.bfloat16() for x in xs]
    scale = [torch.tensor(0.75 + 0.375 * r, dtype=torch.bfloat16) for r in range(R)]  # rank r's expert: x * c_r
    g = [torch.randn(t.shape[0], D, generator=torch.Generator().manual_seed(31 + s)).bfloat16()
         for s, t in enumerate(idxs)]
    buf = ctx.buf(backend, G)
    x = xb[me].clone().requires_grad_()
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idxs[me], topk_weights=ws[me], num_experts=E)
    # rows: (source rank, token) order, the bf16 payload untouched, weights of this rank's experts only
    sent = [(s, t) for s in range(R) for t in range(idxs[s].shape[0]) if me in _dest_ranks(idxs[s], t, L)]
    want_x = torch.stack([xb[s][t] for s, t in sent]) if sent else torch.zeros(0, D, dtype=torch.bfloat16)
    assert recv_x.dtype == torch.bfloat16 and torch.equal(recv_x, want_x), (recv_x, want_x)
    for row, (s, t) in enumerate(sent):
        mine = (idxs[s][t] // L == me) & (idxs[s][t] >= 0)
        assert torch.equal(recv_w[row], torch.where(mine, ws[s][t], torch.zeros(K))), (s, t)
    out, _, _ = buf.combine(recv_x * scale[me], handle)
    (out.float() * g[me].float()).sum().backward()

    hierarchical = backend == "hierarchical"
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    for t in range(idxs[me].shape[0]):
        dest = _dest_ranks(idxs[me], t, L)
        if not dest:
            assert (out[t] == 0).all() and (x.grad[t] == 0).all()
            continue
        vals = {r: xb[me][t] * scale[r] for r in dest}  # bf16 products, as each rank computes them
        want = _bf16_combine_oracle(vals, G, hierarchical)
        assert torch.equal(out[t], want), (t, out[t], want)
        exact = sum(v.double() for v in vals.values())
        bound = 2 * 2.0 ** -8 * sum(v.double().abs() for v in vals.values())  # two roundings of unit 2^-8
        assert ((out[t].double() - exact).abs() <= bound).all()
        # backward: dispatch of g (exact), times c_r in bf16, then a combine of those rows
        grads = {r: g[me][t] * scale[r] for r in dest}
        assert torch.equal(x.grad[t], _bf16_combine_oracle(grads, G, hierarchical)), t
    if shows_rounding and hierarchical and 1 < G < R:  # all ranks' tokens: some element must differ
        assert any(not torch.equal(_bf16_combine_oracle(v, G, True), _bf16_combine_oracle(v, G, False))
                   for s in range(R) for t in range(idxs[s].shape[0])
                   for v in [{r: xb[s][t] * scale[r] for r in _dest_ranks(idxs[s], t, L)}] if v)


def case_layout_only(ctx, routing, backend, G, D=8):
    """dispatch from is_token_in_rank alone (no topk_idx): the same rows as the reference."""
    from moeflow.ep import reference

    E, me = routing["E"], ctx.rank
    idxs, xs, _ = build(routing, D)
    buf = ctx.buf(backend, G)
    _, _, _, in_rank, _ = buf.get_dispatch_layout(idxs[me], E)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(xs[me], is_token_in_rank=in_rank)
    assert recv_idx is None and recv_w is None and counts == []
    refs = reference.dispatch(xs, idxs, E)
    assert torch.equal(recv_x, refs[me].x)
    out, _, _ = buf.combine(recv_x * (me + 1), handle)
    outr = reference.combine([refs[r].x * (r + 1) for r in range(ctx.world)], idxs, E, G)
    assert torch.equal(out, outr[me])


def case_fp8(ctx, routing, backend, G):
    """fp8 tuple input: the received values and scales are the sent bytes; bytes recorded per the doc."""
    from moeflow.ep import per_token_cast_back, per_token_cast_to_fp8, reference
    from moeflow.ep.counts import dispatch_row_bytes, traffic_bytes

    E, K, me, D = routing["E"], routing["K"], ctx.rank, 128
    idxs, xs, _ = build(routing, D)
    buf = ctx.buf(backend, G)
    buf.reset_stats()
    q = [per_token_cast_to_fp8(t) for t in xs]
    (rx, rs), ridx, _, _, handle, _ = buf.dispatch(q[me], topk_idx=idxs[me], num_experts=E)
    ref_x = reference.dispatch([a.view(torch.uint8) for a, _ in q], idxs, E)[me].x
    ref_s = reference.dispatch([s for _, s in q], idxs, E)[me].x
    assert rx.dtype == torch.float8_e4m3fn and torch.equal(rx.view(torch.uint8), ref_x)
    assert torch.equal(rs, ref_s)
    back = per_token_cast_back(rx, rs)
    assert back.shape == (rx.shape[0], D)
    strategy = {"alltoall": "rank", "hierarchical": "node", "allgather": "allgather"}[backend]
    want = traffic_bytes(idxs, E, G, strategy, dispatch_row_bytes(D, 1, fp8=True, num_topk=K,
                         with_topk_idx=True), 0)
    got = _sum_stats(buf)
    assert got[:2] == [want.dispatch_bytes_intra, want.dispatch_bytes_inter], (got, want)
    cached = buf.dispatch(q[me], handle=handle)[0]
    assert torch.equal(cached[0].view(torch.uint8), rx.view(torch.uint8))


def case_low_latency(ctx, routing, G, D=8):
    """low_latency_dispatch / combine vs the reference (per-expert slots, weighted combine)."""
    from moeflow.ep import reference

    E, me = routing["E"], ctx.rank
    idxs, xs, ws = build(routing, D)
    Tm = max(max(t.shape[0] for t in idxs), 1)
    buf = ctx.buf("alltoall", G)
    recv_x, count, handle, _, hook = buf.low_latency_dispatch(xs[me], idxs[me], Tm, E, use_fp8=False)
    ref = reference.low_latency_dispatch(xs, idxs, Tm, E)
    assert torch.equal(recv_x, ref[me][0]) and torch.equal(count, ref[me][1]), (count, ref[me][1])
    out, _, _ = buf.low_latency_combine(recv_x * (me + 1), idxs[me], ws[me], handle)
    outr = reference.low_latency_combine([ref[r][0] * (r + 1) for r in range(ctx.world)], idxs, ws, E)
    assert torch.equal(out, outr[me]), (out - outr[me]).abs().max()
    if D % 128 == 0:
        (fx, fs), count8, _, _, _ = buf.low_latency_dispatch(xs[me], idxs[me], Tm, E, use_fp8=True)
        assert torch.equal(count8, count) and fx.dtype == torch.float8_e4m3fn and fs.dtype == torch.float32
        slots = (E // ctx.world, ctx.world * Tm)
        assert fx.shape == (*slots, D) and fs.shape == (*slots, D // 128)
        _check_ll_fp8_slots(fx, fs, xs, idxs, E, me)


def _fp8_oracle(x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's per-token fp8 format, written out: per 128 columns, scale = max(amax, 1e-4) / 448 and the values
    x / scale in float8_e4m3fn."""
    T, D = x_TD.shape
    blocks = x_TD.float().view(T, D // 128, 128)
    scale = blocks.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    return (blocks / scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(T, D), scale


def _check_ll_fp8_slots(fx, fs, xs, idxs, E, me):
    """Local expert l's slots hold, in (source rank, token) order, the fp8 bytes and scales of every token that
    chose it, and dequantize to within e4m3's precision of x (3 mantissa bits: relative 2^-4, plus the subnormal
    step 2^-9 of the scale)."""
    R = len(xs)
    L = E // R
    for l_ in range(L):
        rows = [(s, t) for s in range(R) for t in range(idxs[s].shape[0]) if bool((idxs[s][t] == me * L + l_).any())]
        for slot, (s, t) in enumerate(rows):
            q, scale = _fp8_oracle(xs[s][t:t + 1])
            assert torch.equal(fx[l_, slot].view(torch.uint8), q[0].view(torch.uint8)), (l_, slot, s, t)
            assert torch.equal(fs[l_, slot], scale[0]), (l_, slot, s, t)
            back = (fx[l_, slot].float().view(-1, 128) * fs[l_, slot].unsqueeze(1)).view(-1)
            err = (back - xs[s][t]).abs()
            assert (err <= 2.0 ** -4 * xs[s][t].abs() + scale[0].repeat_interleave(128) * 2.0 ** -9 + 1e-12).all()


def _expect(fn, *needles):
    try:
        fn()
    except ValueError as exc:
        msg = str(exc)
        for n in needles:
            assert n in msg, f"{n!r} not in {msg!r}"
        return
    raise AssertionError(f"no ValueError (expected one mentioning {needles})")


def case_bad_inputs(ctx, G):
    """Every rank makes the same mistake at once, so each raises before any collective."""
    from moeflow.ep import Buffer, per_token_cast_to_fp8

    R = ctx.world
    E = 2 * R
    buf = ctx.buf("alltoall", G)
    x = torch.randn(3, 8)
    idx = torch.tensor([[0, 1], [1, -1], [E - 1, 0]])
    _expect(lambda: buf.get_dispatch_layout(idx.clone().fill_(E), E), "topk_idx", str(E), "-1")
    _expect(lambda: buf.dispatch(x, topk_idx=idx.clone().fill_(-2), num_experts=E), "-2")
    _expect(lambda: buf.dispatch(x, topk_idx=idx.int(), num_experts=E), "int64")
    _expect(lambda: buf.dispatch(x, topk_idx=idx[:, 0], num_experts=E), "2-D")
    _expect(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=torch.rand(3, 2).double(), num_experts=E),
            "topk_weights", "float32")
    _expect(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=torch.rand(3), num_experts=E), "topk_weights")
    _expect(lambda: buf.dispatch(x.int(), topk_idx=idx, num_experts=E), "x must be")
    _expect(lambda: buf.dispatch(x[0], topk_idx=idx, num_experts=E), "x must be")
    if R > 1:
        _expect(lambda: buf.dispatch(x, topk_idx=idx, num_experts=E + 1), "num_experts", str(E + 1), str(R))
    _expect(lambda: buf.dispatch(x, topk_idx=idx), "num_tokens_per_expert")
    # get_dispatch_layout's counts are sent as given (no recount), so a wrong shape is refused first
    wrong_R1 = torch.zeros(R + 1, dtype=torch.int32)
    _expect(lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, num_tokens_per_rank=wrong_R1),
            "num_tokens_per_rank", f"({R},)")
    _expect(lambda: buf.dispatch(x, topk_idx=idx, num_tokens_per_expert=torch.zeros(E, dtype=torch.float32)),
            "num_tokens_per_expert", "integer")
    q = per_token_cast_to_fp8(torch.randn(3, 128))
    _expect(lambda: buf.dispatch((q[0][:, :100], q[1]), topk_idx=idx, num_experts=E), "128", "100")
    _expect(lambda: per_token_cast_to_fp8(torch.randn(3, 100)), "128")
    _expect(lambda: Buffer(ctx.group, ranks_per_node=3 if R != 3 else 2), "ranks_per_node", str(R))
    _expect(lambda: Buffer(ctx.group, backend="alltoal"), "backend", "alltoall")
    # auto: hierarchical when the group spans several nodes, else alltoall
    assert Buffer(ctx.group, ranks_per_node=1).backend_name == ("hierarchical" if R > 1 else "alltoall")
    assert Buffer(ctx.group, ranks_per_node=R).backend_name == "alltoall"
    _expect(lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, num_worst_tokens=-1), "num_worst_tokens")
    _expect(lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, expert_alignment=0), "expert_alignment")
    # Handles: another buffer, another hidden size (one real dispatch, done by every rank).
    other = Buffer(ctx.group, backend="alltoall", ranks_per_node=G, timeout_s=ctx.timeout_s)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=E)
    _expect(lambda: other.combine(recv_x, handle), "another Buffer")
    _expect(lambda: buf.combine(torch.zeros(recv_x.shape[0], 16), handle), "hidden size", "16", "8")
    _expect(lambda: buf.dispatch(torch.zeros(3, 16), handle=handle), "hidden size")
    _expect(lambda: buf.dispatch(x, handle=handle, topk_idx=idx), "cached dispatch")
    buf.combine(recv_x, handle)
    # num_worst_tokens below one slot per peer: refused on every rank alike (it depends on R only, no hang).
    if R > 1:
        _expect(lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, num_worst_tokens=R - 1),
                f"num_worst_tokens = {R - 1}", "EP group size")
    # Low-latency: too many tokens, duplicate experts.
    _expect(lambda: buf.low_latency_dispatch(x, idx, 2, E, use_fp8=False), "num_max_dispatch_tokens_per_rank")
    _expect(lambda: buf.low_latency_dispatch(x, torch.tensor([[0, 0], [1, -1], [0, 1]]), 4, E, use_fp8=False),
            "same expert twice")
    if torch.cuda.is_available() is False:
        try:
            Buffer(ctx.group, backend="deep_ep")
        except RuntimeError as exc:
            assert "CUDA" in str(exc) and "backend='auto'" in str(exc)
        else:
            raise AssertionError("deep_ep on CPU should raise")


def case_timeout(ctx, backend="alltoall"):
    """Rank 1 never calls dispatch: rank 0 gets a TimeoutError naming the operation, not a hang."""
    from moeflow.ep import Buffer

    buf = Buffer(ctx.group, backend=backend, ranks_per_node=1, timeout_s=1.0)
    if ctx.rank == 1:
        time.sleep(4.0)
        return
    t0 = time.time()
    try:
        buf.dispatch(torch.randn(2, 8), topk_idx=torch.tensor([[0], [1]]), num_experts=ctx.world * 2)
    except TimeoutError as exc:
        assert "Buffer.dispatch" in str(exc) and "timeout_s" in str(exc), str(exc)
        assert time.time() - t0 < 3.5
        return
    raise AssertionError("no TimeoutError")


def case_moe(ctx, backend, G, shared=True, T=5, E=8, K=2, dim=16):
    """An MoE with expert parallelism vs the single-process MoE on all ranks' tokens: output and every gradient."""
    from moeflow.parallel.expert import apply_expert_parallel

    R, me = ctx.world, ctx.rank
    moe = seeded_moe(E, K, dim, shared, expert_impl="loop")
    ep = copy.deepcopy(moe)
    assert apply_expert_parallel(ep, ctx.group, backend=backend, ranks_per_node=G) == 1
    g = torch.Generator().manual_seed(5)
    x_all = torch.randn(R * T, dim, generator=g)
    gy_all = torch.randn(R * T, dim, generator=g)
    x_ref = x_all.clone().requires_grad_()
    y_ref = moe(x_ref)
    (y_ref * gy_all).sum().backward()
    x = x_all[me * T:(me + 1) * T].clone().requires_grad_()
    y = ep(x)
    (y * gy_all[me * T:(me + 1) * T]).sum().backward()
    tol = dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y, y_ref[me * T:(me + 1) * T], **tol)
    torch.testing.assert_close(x.grad, x_ref.grad[me * T:(me + 1) * T], **tol)
    L = E // R
    for name in ("w1", "w3", "w2"):
        torch.testing.assert_close(getattr(ep.experts, name).grad,
                                   getattr(moe.experts, name).grad[me * L:(me + 1) * L], **tol)
    replicated = {n: p for n, p in ep.named_parameters() if not n.startswith("experts.")}
    for n, p in replicated.items():
        grad = p.grad.clone()
        if dist.is_initialized():
            dist.all_reduce(grad)  # data parallelism's job; the layer leaves local-token gradients
        torch.testing.assert_close(grad, dict(moe.named_parameters())[n].grad, **tol)


def case_moe_autocast(ctx, backend, G, T=6, E=8, K=2, dim=16):
    """Under bf16 autocast the EP MoE layer sends bf16 both ways (DeepEP's format: dim * 2 bytes a row), its
    output keeps x's dtype, and it stays within bf16 rounding of the single-process MoE under autocast."""
    from moeflow.parallel.expert import apply_expert_parallel

    R, me = ctx.world, ctx.rank
    moe = seeded_moe(E, K, dim, shared=True, expert_impl="auto")  # FFN width 12: 24 bf16 bytes, so bmm
    ep = copy.deepcopy(moe)
    apply_expert_parallel(ep, ctx.group, backend=backend, ranks_per_node=G)
    x_all = torch.randn(R * T, dim, generator=torch.Generator().manual_seed(7))
    x = x_all[me * T:(me + 1) * T].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = moe(x_all)[me * T:(me + 1) * T]
        ep.dispatcher.buffer.reset_stats()
        y = ep(x)
    from moeflow.ep.counts import combine_row_bytes, dispatch_row_bytes

    s = copy.copy(ep.dispatcher.buffer.stats)  # the forward's (backward moves gradients too)
    y.sum().backward()
    assert y.dtype == x.dtype == torch.float32 and x.grad.dtype == torch.float32
    rel = float((y - y_ref).norm().detach() / y_ref.norm().detach())
    assert rel < 1e-2, rel
    # summed over the ranks: a rank sends back the copies it received, not the ones it sent
    sent = torch.tensor([s.dispatch_bytes_intra + s.dispatch_bytes_inter,
                         s.combine_bytes_intra + s.combine_bytes_inter])
    if dist.is_initialized():
        dist.all_reduce(sent)
    dispatched, combined = sent.tolist()
    if backend == "alltoall":  # each (token, other rank) copy goes there and back: as many rows each way
        rows, rest = divmod(dispatched,
                            dispatch_row_bytes(dim, 2, num_topk=K, with_topk_idx=True, with_topk_weights=True))
        assert rest == 0 and combined == rows * combine_row_bytes(dim, 2) and (R == 1 or rows > 0), (combined, rows)


def seeded_moe(E: int, K: int, dim: int, shared: bool = True, expert_impl: str = "grouped_mm"):
    """A bare MoE layer (FFN width 12) with seeded N(0, 0.3) weights: a bare module's are uninitialised memory."""
    from moeflow.core.model_config import ModelConfig, MoEConfig
    from moeflow.models.moe import MoE

    cfg = ModelConfig(dim=dim, moe=MoEConfig(num_experts=E, top_k=K, ffn_dim=12,
                                             num_shared_experts=1 if shared else 0, expert_impl=expert_impl))
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def _ep_step(ctx, moe, x_all, gy_all, T: int, **ep_options):
    """Forward + backward of this rank's T tokens through an EP copy of `moe` -> (y, x grad, param grads)."""
    from moeflow.parallel.expert import apply_expert_parallel

    ep = copy.deepcopy(moe)
    apply_expert_parallel(ep, ctx.group, **ep_options)
    me = ctx.rank
    x = x_all[me * T:(me + 1) * T].clone().requires_grad_()
    y = ep(x)
    (y * gy_all[me * T:(me + 1) * T]).sum().backward()
    return ep, y, x.grad, {n: p.grad for n, p in ep.named_parameters()}


def case_overlap(ctx, backend, G, chunks, T=7, E=8, K=2, dim=16):
    """The EP MoE layer with overlapped, chunked communication: overlap on == off bit for bit (outputs, input and
    parameter gradients), for exact and for static receive sizes; static == exact and both == the single-process
    MoE on every rank's tokens to float rounding (static sizes change the tensors' lengths, and the CPU's
    vectorised silu rounds an element differently in the vector body and in the scalar tail)."""
    moe = seeded_moe(E, K, dim)
    R, me = ctx.world, ctx.rank
    g = torch.Generator().manual_seed(5)
    x_all, gy_all = torch.randn(R * T, dim, generator=g), torch.randn(R * T, dim, generator=g)
    runs = {}
    for static in (False, True):
        for overlap in (False, True):
            runs[static, overlap] = _ep_step(ctx, moe, x_all, gy_all, T, backend=backend, ranks_per_node=G,
                                             chunks=chunks, overlap=overlap, num_worst_tokens=-1 if static else 0)
    tol = dict(atol=1e-5, rtol=1e-5)
    for static in (False, True):
        _, y0, gx0, grads0 = runs[static, False]
        _, y, gx, grads = runs[static, True]
        assert torch.equal(y, y0), (static, (y - y0).abs().max())
        assert torch.equal(gx, gx0), (static, (gx - gx0).abs().max())
        for n, gr in grads.items():
            assert torch.equal(gr, grads0[n]), (static, n, (gr - grads0[n]).abs().max())
    _, y0, gx0, grads0 = runs[False, False]
    _, y, gx, grads = runs[True, False]
    torch.testing.assert_close(y, y0, **tol)
    torch.testing.assert_close(gx, gx0, **tol)
    for n, gr in grads.items():
        torch.testing.assert_close(gr, grads0[n], **tol)
    x_ref = x_all.clone().requires_grad_()
    (moe(x_ref) * gy_all).sum().backward()
    ep = runs[False, False][0]
    torch.testing.assert_close(y0, moe(x_all)[me * T:(me + 1) * T], **tol)
    torch.testing.assert_close(gx0, x_ref.grad[me * T:(me + 1) * T], **tol)
    L = E // R
    for name in ("w1", "w3", "w2"):
        torch.testing.assert_close(grads0[f"experts.{name}"], getattr(moe.experts, name).grad[me * L:(me + 1) * L],
                                   **tol)
    for n, _ in ep.named_parameters():
        if not n.startswith("experts."):
            grad = grads0[n].clone()
            if dist.is_initialized():
                dist.all_reduce(grad)
            torch.testing.assert_close(grad, dict(moe.named_parameters())[n].grad, **tol)


def case_host_syncs(ctx, G, T=6, E=8, K=2, dim=16):
    """With static receive sizes a forward and backward of the EP MoE layer reads nothing back to the host
    (tests/support/host_syncs.py lists what counts); with exact sizes the same step does (so the counter can fail)."""
    from tests.support.host_syncs import count_host_syncs

    moe = seeded_moe(E, K, dim)
    R = ctx.world
    g = torch.Generator().manual_seed(3)
    x_all, gy_all = torch.randn(R * T, dim, generator=g), torch.randn(R * T, dim, generator=g)
    opts = dict(backend="alltoall", ranks_per_node=G, chunks=2, overlap=True)
    _ep_step(ctx, moe, x_all, gy_all, T, num_worst_tokens=-1, **opts)  # warm-up: lazy imports, first calls
    with count_host_syncs() as static_counts:
        _ep_step(ctx, moe, x_all, gy_all, T, num_worst_tokens=-1, **opts)
    with count_host_syncs() as exact_counts:
        _ep_step(ctx, moe, x_all, gy_all, T, num_worst_tokens=0, **opts)
    assert sum(static_counts.values()) == 0, dict(static_counts)
    assert sum(exact_counts.values()) > 0, "the counter saw no host sync on the exact path"


def case_sim_bytes(ctx, routing, backend, G, dtype, layout_only, want, D=8):
    """One dispatch + combine; this rank's buffer.stats must equal `want[rank]` (computed by the parent,
    e.g. from moeflow.sim): [dispatch intra, dispatch inter, combine intra, combine inter] bytes."""
    from moeflow.ep import per_token_cast_back, per_token_cast_to_fp8

    E, me = routing["E"], ctx.rank
    idxs, xs, ws = build(routing, D)
    buf = ctx.buf(backend, G)
    buf.reset_stats()
    wire_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}[dtype]
    x = per_token_cast_to_fp8(xs[me]) if dtype == "fp8" else xs[me].to(wire_dtype)
    with torch.no_grad():
        n_rank, n_node, n_exp, in_rank, _ = buf.get_dispatch_layout(idxs[me], E)
        if layout_only:
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank)
        else:
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_node, is_token_in_rank=in_rank,
                num_tokens_per_expert=n_exp, topk_idx=idxs[me], topk_weights=ws[me])
        if dtype == "fp8":  # fp8 in, bf16 out (DeepEP's combine dtype)
            recv_x = per_token_cast_back(*recv_x).to(torch.bfloat16)
        buf.combine(recv_x, handle, topk_weights=recv_w)
    s = buf.stats
    got = [s.dispatch_bytes_intra, s.dispatch_bytes_inter, s.combine_bytes_intra, s.combine_bytes_inter]
    assert got == list(want[me]) and s.calls == 2, f"rank {me}: stats {got} ({s.calls} calls), want {want[me]}"
