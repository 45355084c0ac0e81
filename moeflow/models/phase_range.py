"""The profiler range of one of a step's phases (moeflow.core.phases): torch.profiler.record_function, and while
a CPU memory profile is open (`[profile] memory`, moeflow/train/profile.py) the peak resident set size inside it.

A CPU has no allocator history to replay, and the profiler's memory events count tensors only (not the
allocator's caches, the communication buffers or the interpreter), so the peak that matters - what the
operating system sees - is read from the kernel: Linux keeps the process's high-water mark of resident memory
(VmHWM in /proc/self/status) and resets it to the current size when "5" is written to /proc/self/clear_refs.
Reading and resetting it where a range begins and ends gives each range's own peak exactly, however short; a
range inside another passes its peak up to it. Only the thread that opened the profile is traced (autograd on a
CPU runs the backward on the caller's thread)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import torch
from torch.profiler import record_function

_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


class RssTracer:
    """{range name: peak resident bytes} of the ranges run on this thread between start() and stop()."""

    def __init__(self):
        self.peaks: dict[str, int] = {}
        self._open: list[list] = []  # [name, peak so far] of the ranges entered and not yet left
        self._thread = threading.get_ident()

    @staticmethod
    def available() -> bool:
        return _STATUS.is_file() and _CLEAR_REFS.is_file()

    def start(self) -> None:
        global _tracer
        _read_and_reset_peak()
        _tracer = self

    def stop(self) -> None:
        global _tracer
        _tracer = None

    def enter(self, name: str) -> None:
        peak = _read_and_reset_peak()  # the enclosing range's peak up to here
        if self._open:
            self._open[-1][1] = max(self._open[-1][1], peak)
        self._open.append([name, 0])

    def leave(self) -> None:
        name, peak = self._open.pop()
        peak = max(peak, _read_and_reset_peak())
        self.peaks[name] = max(self.peaks.get(name, 0), peak)
        if self._open:
            self._open[-1][1] = max(self._open[-1][1], peak)


_tracer: RssTracer | None = None


def phase_range(name: str):
    """`with phase_range(phases.ATTENTION): ...` (a plain record_function unless an RssTracer is on; nothing in
    compiled code)."""
    if torch.compiler.is_compiling():  # dynamo drops record_function from its graphs (with a warning each time)
        return contextlib.nullcontext()
    tracer = _tracer
    if tracer is None or threading.get_ident() != tracer._thread:
        return record_function(name)
    return _traced(tracer, name)


@contextlib.contextmanager
def _traced(tracer: RssTracer, name: str):
    tracer.enter(name)
    try:
        with record_function(name):
            yield
    finally:
        tracer.leave()


def _read_and_reset_peak() -> int:
    """The resident high-water mark in bytes since the last reset, then reset to the current size."""
    peak = next(int(line.split()[1]) * 1024 for line in _STATUS.read_text().splitlines()
                if line.startswith("VmHWM:"))
    _CLEAR_REFS.write_text("5")
    return peak
