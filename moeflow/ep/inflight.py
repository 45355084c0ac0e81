"""InFlight: a communication that may still be in flight, and the values it will produce.

Every asynchronous step of moeflow.ep hands one back, at every level:
- a collective: Comm.all_to_all(..., async_op=True), whose value is the received rows;
- a backend's dispatch or combine: that collective with the steps chained after it (a second phase, a reduction);
- a Buffer call: the outputs it returned before their bytes arrived, inside the call's EventOverlap (DeepEP's
  event object, moeflow/ep/event.py);
- the EP dispatcher's tokens (moeflow/parallel/expert.py): a dispatch in flight, then sorted by expert; it is the
  Waitable of moeflow/models/moe.py's TokenDispatcher protocol.

wait() returns the values: it waits for the collective (on a GPU only the current stream waits for NCCL's, no host
sync; on gloo the host waits for the worker thread), then runs the steps chained with then(), in order, once.
Waiting again returns the same values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# reverse(grads of a call's outputs) -> InFlight of the grads of its inputs (moeflow/ep/autograd.py)
Reverse = Callable[[list], "InFlight"]


class InFlight:
    """A communication that may still be in flight, and the values it will produce (see the module docstring).

    Arguments:
        value: what the communication fills (the received rows), or the values themselves when nothing travels.
        until: blocks until the communication has completed (Comm's wait, with its timeout); None: nothing to wait
            for.
    """

    def __init__(self, value: object = None, until: Callable[[], None] | None = None):
        self._value, self._until = value, until
        self._steps: list[Callable[[object], object]] = []
        # How the gradients of the call's outputs travel back, for moeflow/ep/autograd.py's two nodes: reverse starts
        # that communication; with overlap the wait node's backward starts it early and parks it in
        # reverse_in_flight until the issue node's backward waits for it.
        self.reverse: Reverse | None = None
        self.overlap = False
        self.reverse_in_flight: InFlight | None = None

    def then(self, step: Callable[[object], object]) -> InFlight:
        """Chain step(value) -> the new value after what is already chained (a step that returns an InFlight, such
        as a second phase of collectives, is waited for in turn). Returns self."""
        self._steps.append(step)
        return self

    def on_backward(self, reverse: Reverse, overlap: bool) -> InFlight:
        """Say how the gradients travel back: reverse(grads) -> InFlight of the input gradients; overlap: the wait
        node's backward may start it before the gradients are needed. Returns self."""
        self.reverse, self.overlap = reverse, overlap
        return self

    @torch.compiler.disable  # communication: a graph break under torch.compile, as the token mover's other calls
    def wait(self) -> object:
        """-> the values, once the communication has completed and the chained steps have run."""
        if self._until is not None:
            self._until()
            self._until = None
        while self._steps:
            value = self._steps.pop(0)(self._value)
            self._value = value.wait() if isinstance(value, InFlight) else value
        return self._value
