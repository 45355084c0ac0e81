"""The fake's events: DeepEP V1's EventHandle / EventOverlap (deep_ep/utils.py there), with streams modelled as
"outputs that are not there yet".

A call with async_finish=True returns placeholders (NaN, or garbage for integer and bool tensors) and an event
holding the real values; waiting on the event (current_stream_wait, `with event:`, or passing it as another
call's previous_event) fills them in. A consumer that forgets to wait reads garbage, and a library call that is
given a placeholder as input fails, as a CUDA stream race would (only less politely).
"""

from __future__ import annotations

import torch

# data_ptr of every placeholder not yet filled -> the call that made it.
PENDING: dict[int, str] = {}


def garbage_like(value: torch.Tensor) -> torch.Tensor:
    """What an uninitialised tensor (torch.empty on a GPU) may hold: NaN, or a large nonsense integer."""
    if value.is_floating_point():
        return torch.full_like(value, float("nan"))
    if value.dtype == torch.bool:
        return torch.ones_like(value)
    return torch.full_like(value, 12345)


def check_ready(what: str, t) -> None:
    if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() in PENDING:
        raise AssertionError(
            f"fake deep_ep: {what} is an output of {PENDING[t.data_ptr()]} with async_finish=True that nobody "
            "waited for: call event.current_stream_wait() (or `with event:`), or pass the event as previous_event"
        )


class EventHandle:
    """An event recorded on a stream; current_stream_wait() makes the current stream wait for it."""

    def __init__(self, _pending=()):
        self._pending = list(_pending)  # (placeholder, value) pairs filled when someone waits
        for out, _ in self._pending:
            if out.numel():
                PENDING[out.data_ptr()] = "an earlier call"

    def current_stream_wait(self) -> None:
        for out, value in self._pending:
            out.data.copy_(value)  # through .data: the "kernel" writes memory, autograd versions do not move
            PENDING.pop(out.data_ptr(), None)
        self._pending = []


class EventOverlap:
    """DeepEP's wrapper: `event` is an EventHandle or None (a synchronous call)."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None
        self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if self.event is not None:
            self.event.current_stream_wait()


def check_nvlink_connections(group) -> None:
    """Nothing to check without GPUs."""
