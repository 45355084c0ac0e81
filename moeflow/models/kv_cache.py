"""A key/value cache for generation: each attention layer appends what it needs of the new positions.

Grouped-query attention keeps its keys and values after RoPE ([B, Hk, T, Dh] each); multi-head latent attention
keeps only its compressed latent and the shared RoPE key ([B, T, L] and [B, T, Dr]), which is what makes MLA's
cache small (DeepSeek-V2 report, arXiv:2405.04434, sec. 2.1.4). Buffers are allocated once, at the first append,
for `max_len` positions. The transformer advances `length` after all its layers have appended.

Shape suffixes: B batch, T cached positions, S new positions.
"""

from __future__ import annotations

import torch


class LayerCache:
    def __init__(self, owner: KVCache):
        self.owner = owner
        self.buffers: list[torch.Tensor] | None = None

    def append(self, *new: torch.Tensor) -> list[torch.Tensor]:
        """Write the new positions (sequence on dim -2 of each tensor) after the cached ones; return every
        position so far, cached and new."""
        start, S = self.owner.length, new[0].shape[-2]
        if start + S > self.owner.max_len:
            raise ValueError(f"the KV cache holds {self.owner.max_len} positions; {start} + {S} do not fit "
                             f"(generate fewer tokens or use a shorter prompt)")
        if self.buffers is None:
            self.buffers = [t.new_empty(*t.shape[:-2], self.owner.max_len, t.shape[-1]) for t in new]
        for buffer, t in zip(self.buffers, new):
            buffer[..., start:start + S, :] = t
        return [buffer[..., :start + S, :] for buffer in self.buffers]


class KVCache:
    """Per-layer caches keyed by layer index; `length` positions are cached in every layer."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.layers: dict[str, LayerCache] = {}

    def layer(self, key: str) -> LayerCache:
        if key not in self.layers:
            self.layers[key] = LayerCache(self)
        return self.layers[key]
