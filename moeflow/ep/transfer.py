"""Moving one Buffer call's rows: start the communication, fill the outputs when the rows arrive, and say how the
gradients travel back.

Shape legend: T tokens, K top-k, D hidden, N received rows, W num_worst_tokens, C float columns of a combine.

Outputs are allocated when a call starts and filled in place when its InFlight is waited on, as DeepEP's are
(they hold their values once the call's event is waited on). The arrival steps return None: the InFlight, which
autograd keeps until backward, then holds no second reference to the outputs.

Each call's InFlight says how its gradients travel back (InFlight.on_backward, run by moeflow/ep/autograd.py):
backward of a dispatch is a combine along its handle, backward of a combine a cached dispatch, both through the
backend that routed the dispatch.
"""

from __future__ import annotations

import torch

from moeflow.ep import wire
from moeflow.ep.autograd import issue
from moeflow.ep.backends.base import from_f32
from moeflow.ep.comm import EPStats
from moeflow.ep.event import EventOverlap
from moeflow.ep.inflight import InFlight
from moeflow.ep.routing import EPHandle, NewDispatch, Routing, local_ids


def dispatch_new(args: NewDispatch, routing: Routing, buffer_id: int, async_op: bool, stats: EPStats) -> tuple:
    """Buffer.dispatch without a handle -> DeepEP's six results (Buffer.dispatch's Returns)."""
    handle = new_handle(args, routing, buffer_id)

    def start(*inputs):  # the xs, then topk_weights
        return start_new(list(inputs[:-1]), inputs[-1], routing, handle, async_op, stats)

    if len(args.xs) == 2:  # fp8: not differentiable, so no autograd node
        (recv_x, recv_s, recv_w), in_flight = start(*args.xs, args.topk_weights)
        recv_x = (recv_x, recv_s)
    else:
        (recv_x, recv_w), in_flight = issue(start, *args.xs, args.topk_weights)
    return recv_x, handle.recv_topk_idx, recv_w, routing.counts_list, handle, EventOverlap(in_flight=in_flight)


def dispatch_cached(xs: list[torch.Tensor], handle: EPHandle, async_op: bool, stats: EPStats) -> tuple:
    """Buffer.dispatch with a handle -> (recv_x, None, None, None, None, event)."""
    if len(xs) == 2:  # fp8: not differentiable, so no autograd node
        outs, in_flight = start_cached(xs, handle, "Buffer.dispatch", async_op, stats)
        return (outs[0], outs[1]), None, None, None, None, EventOverlap(in_flight=in_flight)
    (recv_x,), in_flight = issue(lambda x_: start_cached([x_], handle, "Buffer.dispatch", async_op, stats), xs[0])
    return recv_x, None, None, None, None, EventOverlap(in_flight=in_flight)


def combine(x_XD: torch.Tensor, topk_weights: torch.Tensor | None, bias, handle: EPHandle, async_op: bool,
            stats: EPStats) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
    """Buffer.combine -> (combined_x [T, D], combined_topk_weights [T, K] | None, event)."""
    (out_x, out_w), in_flight = issue(lambda x_, w_: start_combine(x_, w_, handle, async_op, stats), x_XD,
                                      topk_weights)
    for b in bias if isinstance(bias, tuple | list) else (bias,):
        if b is not None:  # (checks.combine refuses a bias with async_op: out_x is not filled yet)
            out_x = out_x + b.to(out_x.dtype)
    return out_x, out_w, EventOverlap(in_flight=in_flight)


def new_handle(args: NewDispatch, routing: Routing, buffer_id: int) -> EPHandle:
    """The handle of a new dispatch, its recv_topk_idx [N or W, K] allocated (filled on arrival) and no plan yet."""
    x_TD, K, rows = args.xs[0], routing.payload.num_topk, routing.num_rows
    recv_idx = torch.empty((rows, K), dtype=torch.int64, device=x_TD.device) if K else None
    return EPHandle(buffer_id, x_TD.shape[1], x_TD.shape[0], rows, args.num_worst_tokens, args.num_experts or 0, K,
                    args.is_token_in_rank, recv_idx, None, static=routing.static, dtype=x_TD.dtype,
                    backend=routing.backend)


def start_new(xs: list[torch.Tensor], topk_weights: torch.Tensor | None, routing: Routing, handle: EPHandle,
              async_op: bool, stats: EPStats) -> tuple[list, InFlight]:
    """Send a new dispatch's rows along `routing`.

    Returns:
        outputs: [recv x for each of xs ([rows, ...], same dtype), recv_topk_weights [rows, K] float32 | None].
        in_flight: fills them, handle.recv_topk_idx and handle.plan on wait (before returning unless async_op).
    """
    stats.calls += 1
    in_flight = routing.send(routing.payload.pack(xs, topk_weights))
    rows, K, dev = handle.num_rows, handle.num_topk, xs[0].device
    recv_xs = [x.new_empty((rows, *x.shape[1:])) for x in xs]
    recv_w = torch.empty((rows, K), dtype=torch.float32, device=dev) if topk_weights is not None else None
    recv_idx = handle.recv_topk_idx

    def arrived(result):
        recv_rows, plan = result
        recv, n = wire.unpack(recv_rows, routing.payload.specs), recv_rows.shape[0]
        with torch.no_grad():  # filling this call's own outputs
            for out, got in zip(recv_xs, recv):
                out[:n].copy_(got)
                out[n:].zero_()
            if K:
                local_ids(recv[len(xs)], routing.local_experts, recv_idx)
            if recv_w is not None:
                recv_w[:n].copy_(torch.where(recv_idx[:n] >= 0, recv[len(xs) + 1], 0.0))
                recv_w[n:].zero_()
        handle.plan = plan
        return None  # (see the module docstring)

    with_w = recv_w is not None
    in_flight.then(arrived).on_backward(lambda grads: _dispatch_backward(handle, grads, with_w, stats), async_op)
    handle.in_flight = in_flight
    if not async_op:
        handle.ready()
    return [*recv_xs, recv_w], in_flight


def start_cached(xs: list[torch.Tensor], handle: EPHandle, op: str, async_op: bool,
                 stats: EPStats) -> tuple[list, InFlight]:
    """Send per-token tensors ([T, ...] each) along a handle's routing.

    Returns:
        outputs: one [handle.num_rows, ...] tensor per x, same dtype.
        in_flight: fills them on wait (before returning unless async_op).
    """
    handle.ready()
    stats.calls += 1
    specs = [wire.spec_of(t) for t in xs]
    in_flight = handle.backend.dispatch_cached(wire.pack(xs), handle.plan, op, async_op=True)
    outs = [x.new_empty((handle.num_rows, *x.shape[1:])) for x in xs]

    def arrived(recv_rows):
        with torch.no_grad():
            for out, got in zip(outs, wire.unpack(recv_rows, specs)):
                out[:got.shape[0]].copy_(got)
                out[got.shape[0]:].zero_()
        return None  # (see the module docstring)

    in_flight.then(arrived).on_backward(lambda grads: _cached_backward(handle, grads, stats), async_op)
    if not async_op:
        in_flight.wait()
    return outs, in_flight


def start_combine(x_XD: torch.Tensor, topk_weights: torch.Tensor | None, handle: EPHandle, async_op: bool,
                  stats: EPStats) -> tuple[list, InFlight]:
    """Sum each token's copies back on its source rank.

    Returns:
        outputs: [combined_x [T, D] in x's dtype, combined_topk_weights [T, K] float32 | None].
        in_flight: fills them on wait (before returning unless async_op).
    """
    with_w = topk_weights is not None
    outs, in_flight = start_reduce([x_XD, topk_weights] if with_w else [x_XD], handle, "Buffer.combine", stats)
    in_flight.on_backward(lambda grads: _combine_backward(handle, grads, with_w, stats), async_op)
    if not async_op:
        in_flight.wait()
    return [outs[0], outs[1] if with_w else None], in_flight


def start_reduce(vals: list[torch.Tensor], handle: EPHandle, op: str, stats: EPStats) -> tuple[list, InFlight]:
    """Sum the copies of each token back on its source rank (float32 accumulation, the callers' dtypes).

    Returns:
        outputs: one [T, ...] tensor per value, same dtype.
        in_flight: fills them on wait.
    """
    handle.ready()
    stats.calls += 1
    if not handle.static:
        vals = [v[:handle.num_recv] for v in vals]
    specs = [wire.spec_of(v) for v in vals]
    in_flight = handle.backend.combine(vals, handle.plan, op, async_op=True)
    outs = [v.new_empty((handle.num_tokens, *v.shape[1:])) for v in vals]

    def arrived(mat_TC):
        with torch.no_grad():
            for out, got in zip(outs, from_f32(mat_TC, specs)):
                out.copy_(got)
        return None  # (see the module docstring)

    return outs, in_flight.then(arrived)


def _dispatch_backward(handle: EPHandle, grads: list, with_w: bool, stats: EPStats) -> InFlight:
    """Gradients of (recv_x, recv_topk_weights) -> InFlight of those of (x, topk_weights): a combine."""
    g_x, g_w = grads[0], grads[1] if len(grads) > 1 else None
    if g_x is None:
        g_x = torch.zeros(handle.num_rows, handle.hidden, dtype=handle.dtype, device=handle.is_token_in_rank.device)
    vals = [g_x]
    if with_w:
        g = g_w if g_w is not None else torch.zeros_like(handle.recv_topk_idx, dtype=torch.float32)
        # Entries of experts elsewhere were forwarded as 0, so they carry no gradient.
        vals.append(g.masked_fill(handle.recv_topk_idx < 0, 0.0))
    outs, in_flight = start_reduce(vals, handle, "Buffer.dispatch backward (combine)", stats)
    return in_flight.then(lambda _: [outs[0], outs[1] if with_w else None])


def _cached_backward(handle: EPHandle, grads: list, stats: EPStats) -> InFlight:
    """Gradient of a cached dispatch's recv_x -> InFlight of x's: a combine."""
    outs, in_flight = start_reduce([grads[0]], handle, "Buffer.dispatch backward (combine)", stats)
    return in_flight.then(lambda _: [outs[0]])


def _combine_backward(handle: EPHandle, grads: list, with_w: bool, stats: EPStats) -> InFlight:
    """Gradients of (combined_x, combined_topk_weights) -> InFlight of those of (x, topk_weights): a cached
    dispatch."""
    g_x, g_w = grads[0], grads[1] if len(grads) > 1 else None
    vals = [g_x]
    if with_w:
        vals.append(g_w if g_w is not None else g_x.new_zeros(g_x.shape[0], handle.num_topk))
    outs, in_flight = start_cached(vals, handle, "Buffer.combine backward (dispatch)", True, stats)
    return in_flight.then(lambda _: [outs[0], outs[1] if with_w else None])
