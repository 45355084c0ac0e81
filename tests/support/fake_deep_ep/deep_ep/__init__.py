"""A fake `deep_ep` for CPU tests of moeflow's DeepEP / UCCL-EP adapter (moeflow/ep/backends/external.py).

It is not DeepEP: there are no kernels and no GPUs. Its Buffer asserts DeepEP V1's documented contract on
every call (dtypes, shapes and contiguity of every tensor, which arguments a dispatch needs without a handle
and refuses with one, num_worst_tokens, the handle, the events; see buffer.py) and moves the tokens with
torch.distributed, so a wrong call from the adapter fails here instead of on a GPU cluster.

Two flavours, as two packages named `deep_ep` exist: "deep_ep" (DeepEP V1: exports topk_idx_t) and "uccl"
(UCCL-EP's drop-in: exports initialize_uccl / destroy_uccl, a 7-item handle). The environment variable
FAKE_DEEP_EP_FLAVOUR picks one at import; use_flavour() switches in a running process.
"""

from __future__ import annotations

import os

from . import buffer
from .buffer import CALLS, Config, DeepEPBuffer, UcclBuffer
from .utils import EventHandle, EventOverlap, check_nvlink_connections

_FLAVOURS = ("deep_ep", "uccl")
_flavour = os.environ.get("FAKE_DEEP_EP_FLAVOUR", "deep_ep")
assert _flavour in _FLAVOURS, f"FAKE_DEEP_EP_FLAVOUR={_flavour!r}; use one of {_FLAVOURS}"


def use_flavour(name: str) -> None:
    global _flavour
    assert name in _FLAVOURS, name
    _flavour = name


def strict_bf16_combine(on: bool) -> None:
    """Refuse float32 in combine, as DeepEP's kernels do."""
    buffer.STRICT_BF16_COMBINE = on


def initialize_uccl(*args, **kwargs) -> None:
    """UCCL-EP's proxy start-up; nothing to start here."""


def destroy_uccl(*args, **kwargs) -> None:
    pass


def __getattr__(name: str):
    """The attributes that tell the two packages apart."""
    if name == "Buffer":
        return UcclBuffer if _flavour == "uccl" else DeepEPBuffer
    if name == "topk_idx_t" and _flavour == "deep_ep":
        return buffer.TOPK_IDX_DTYPE
    if name in ("initialize_uccl", "destroy_uccl") and _flavour == "uccl":
        return globals()["_" + name]
    raise AttributeError(f"module 'deep_ep' ({_flavour} flavour) has no attribute {name!r}")


_initialize_uccl, _destroy_uccl = initialize_uccl, destroy_uccl
del initialize_uccl, destroy_uccl

__all__ = ["CALLS", "Config", "EventHandle", "EventOverlap", "check_nvlink_connections", "strict_bf16_combine",
           "use_flavour"]
