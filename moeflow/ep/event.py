"""EventOverlap: DeepEP's event object, what an asynchronous moeflow.ep.Buffer call returns (an InFlight inside)."""

from __future__ import annotations

import torch

from moeflow.ep.autograd import wait as wait_node
from moeflow.ep.inflight import InFlight


class EventOverlap:
    """DeepEP's event object: what an asynchronous Buffer call returns, to wait on before using its outputs.

    Waiting finishes the call's communication: on a GPU the current stream waits for NCCL's (no host sync); on gloo
    the host waits for the worker thread. A call that finished before returning gives an empty one.

    Arguments:
        event: a `torch.cuda.Event` to make the current stream wait for (DeepEP's argument), or None.
        in_flight: the call's communication and the steps that fill its outputs, or None.
    """

    def __init__(self, event: torch.cuda.Event | None = None, in_flight: InFlight | None = None):
        self.event, self.in_flight = event, in_flight

    def current_stream_wait(self) -> None:
        """Finish the communication: the call's outputs hold their values after this (DeepEP's call)."""
        if self.in_flight is not None:
            self.in_flight.wait()
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        """current_stream_wait(), then wait for the device too (a host sync)."""
        self.current_stream_wait()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()

    def wait(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """current_stream_wait(), returning the call's outputs through an autograd node (moeflow's extension).

        Arguments:
            tensors: outputs of the call that made this event (any shape and dtype; None passes through).

        Returns:
            the same tensors, holding their values; in backward the node starts the gradients' communication without
            waiting for it (moeflow/ep/autograd.py), so backward overlaps as forward does.
        """
        if self.in_flight is None:
            return tensors
        return wait_node(self.in_flight, *tensors)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        """`with event:` waits on leaving the block (current_stream_wait())."""
        self.current_stream_wait()
