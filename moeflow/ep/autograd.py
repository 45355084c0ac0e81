"""Autograd for communication that may be in flight: an issue node and a wait node per dispatch or combine.

A dispatch (or combine) started with async_finish returns its outputs before the bytes arrive; they are filled
when its InFlight is waited on (EventOverlap.current_stream_wait()). Two autograd nodes carry it:

    x --[_Issue: start sending]--> outputs (filled later) --[_Wait: finish]--> the same outputs, ready

In backward the roles swap, so backward overlaps too: the wait node's backward *starts* the reverse
communication of the gradients (a combine for a dispatch, a cached dispatch for a combine) without waiting, and
passes the gradients through unchanged; the issue node's backward, which autograd reaches later (after the
compute that sits between the two in the graph), waits for it. With `overlap` off the wait node starts nothing
and the issue node runs the reverse communication itself: the same operations in the same order, so the
results are equal bit for bit. Without a wait node (DeepEP-style callers that only call
current_stream_wait()), backward is the plain synchronous reverse communication.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeflow.ep.inflight import InFlight


class _Issue(torch.autograd.Function):
    """outputs = start(*inputs), whose communication may still be in flight. The InFlight comes back as the last
    output: a Function passes a non-tensor output through as it is."""

    @staticmethod
    def forward(ctx, start, *inputs):
        outputs, ctx.in_flight = start(*inputs)
        return (*outputs, ctx.in_flight)

    @staticmethod
    def backward(ctx, *grads):
        in_flight = ctx.in_flight
        started, in_flight.reverse_in_flight = in_flight.reverse_in_flight, None
        if started is None:  # no wait node started it (overlap off, or the caller never called event.wait)
            started = in_flight.reverse(list(grads[:-1]))  # the last grad is the InFlight output's (None)
        return (None, *started.wait())


class _Wait(torch.autograd.Function):
    """Finish the communication; return its outputs unchanged. Backward: start the reverse communication."""

    @staticmethod
    def forward(ctx, in_flight: InFlight, *tensors):
        in_flight.wait()
        ctx.in_flight = in_flight
        return tuple(t.view_as(t) if t is not None else None for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.in_flight.overlap:
            ctx.in_flight.reverse_in_flight = ctx.in_flight.reverse(list(grads))
        return (None, *grads)


def issue(start: Callable[..., tuple[list, InFlight]], *inputs: torch.Tensor | None) -> tuple[tuple, InFlight]:
    """start(*inputs) -> (outputs, in_flight), run through the issue node: the outputs' gradients reach the inputs
    through in_flight.reverse."""
    *outputs, in_flight = _Issue.apply(start, *inputs)
    return tuple(outputs), in_flight


def wait(in_flight: InFlight, *tensors: torch.Tensor | None) -> tuple:
    """Finish `in_flight` and return `tensors` through the wait node (so backward overlaps)."""
    return _Wait.apply(in_flight, *tensors)
