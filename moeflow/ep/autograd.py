"""Autograd for communication that may be in flight: an issue node and a wait node per dispatch or combine.

A dispatch (or combine) started with async_finish returns its outputs before the bytes arrive; they are
filled when the Flight's `pending` finishes (EventOverlap.current_stream_wait()). Two autograd nodes carry it:

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

from moeflow.ep.comm import Pending


class Flight:
    """One dispatch or combine: its forward communication and how to run the reverse one for gradients.

    `reverse(grads, async_op)` returns the input gradients (a list), or with async_op a Pending of them."""

    def __init__(self, pending: Pending, reverse: Callable, overlap: bool = True):
        self.pending, self.reverse, self.overlap = pending, reverse, overlap
        self.reverse_pending: Pending | None = None

    def wait(self) -> None:
        self.pending.finish()


class _Issue(torch.autograd.Function):
    """outputs = start(*inputs): the communication may still be in flight (box['flight'] says)."""

    @staticmethod
    def forward(ctx, start, box: dict, *inputs):
        outputs, flight = start(*inputs)
        box["flight"] = ctx.flight = flight
        ctx.num_inputs = len(inputs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        flight = ctx.flight
        if flight.reverse_pending is not None:  # started by the wait node's backward
            result, flight.reverse_pending = flight.reverse_pending.finish(), None
        else:
            result = flight.reverse(list(grads), False)
        return (None, None, *result)


class _Wait(torch.autograd.Function):
    """Finish the flight; return its outputs unchanged. Backward: start the reverse communication."""

    @staticmethod
    def forward(ctx, flight: Flight, *tensors):
        flight.wait()
        ctx.flight = flight
        return tuple(t.view_as(t) if t is not None else None for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.flight.overlap:
            ctx.flight.reverse_pending = ctx.flight.reverse(list(grads), True)
        return (None, *grads)


def issue(start, *inputs) -> tuple[tuple, Flight]:
    """(outputs, flight) of start(*inputs) -> (outputs, flight), through the issue node."""
    box: dict = {}
    outputs = _Issue.apply(start, box, *inputs)
    return outputs, box["flight"]


def wait(flight: Flight, *tensors) -> tuple:
    """Finish `flight` and return `tensors` through the wait node (so backward overlaps)."""
    return _Wait.apply(flight, *tensors)
