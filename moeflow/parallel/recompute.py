"""Activation checkpointing of transformer blocks, keeping parameter names and module attributes unchanged.

Wrapping a block in another module would rename its parameters (and so its checkpoint keys), and assigning
`block.forward` would hang a new attribute on it; instead the block's class is swapped for a subclass whose
forward recomputes (the way FSDP2 swaps classes), so a checkpoint saved with activation checkpointing loads
without it and the other way round.
"""

from __future__ import annotations

import torch.utils.checkpoint
from torch import nn

from moeflow.core.choices import recompute_every

_RECOMPUTING: dict[type, type] = {}


def apply_activation_checkpointing(blocks: nn.ModuleDict | dict, mode: str) -> int:
    """mode: one of moeflow.core.choices.ACTIVATION_CHECKPOINTING. Returns how many blocks recompute."""
    every = recompute_every(mode)
    if not every:
        return 0
    count = 0
    for position, (key, block) in enumerate(blocks.items()):
        # by global layer index (blocks are keyed by it), so a pipeline stage recomputes the same layers
        i = int(key) if key.isdigit() else position
        if i % every == 0:
            block.__class__ = recomputing_class(type(block))
            count += 1
    return count


def recomputing_class(cls: type) -> type:
    """`cls` with a forward that saves only its inputs and recomputes the rest in backward."""
    if getattr(cls, "_moeflow_recomputes", False):
        return cls
    if cls not in _RECOMPUTING:
        def forward(self, *args, **kwargs):
            # Non-reentrant: works with FSDP2's hooks and with inputs that do not require grad.
            return torch.utils.checkpoint.checkpoint(super(sub, self).forward, *args, use_reentrant=False, **kwargs)

        sub = type(f"Recomputing{cls.__name__}", (cls,), {"forward": forward, "_moeflow_recomputes": True})
        _RECOMPUTING[cls] = sub
    return _RECOMPUTING[cls]
