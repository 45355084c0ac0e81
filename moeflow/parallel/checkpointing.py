"""Activation checkpointing of transformer blocks, keeping parameter names unchanged.

Wrapping a block in another module would rename its parameters (and so its checkpoint keys); instead
the block's own forward is replaced by a recomputing one, so a checkpoint saved with activation
checkpointing loads without it and the other way round.
"""

from __future__ import annotations

import torch.utils.checkpoint
from torch import nn


def apply_activation_checkpointing(blocks: nn.ModuleDict | dict, mode: str) -> int:
    """mode 'none' | 'full' | 'every-N'. Returns how many blocks recompute."""
    if mode == "none":
        return 0
    every = 1 if mode == "full" else int(mode.split("-", 1)[1])
    count = 0
    for position, (key, block) in enumerate(blocks.items()):
        # by global layer index (blocks are keyed by it), so a pipeline stage recomputes the same layers
        i = int(key) if key.isdigit() else position
        if i % every == 0:
            inner = block.forward
            block.forward = _recomputing(inner)
            count += 1
    return count


def _recomputing(inner):
    def forward(*args, **kwargs):
        # Non-reentrant: works with FSDP2's hooks and with inputs that do not require grad.
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    return forward
