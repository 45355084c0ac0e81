"""What every backend shares: the topology, the gathered counts, and the node-ordered reduction.

Shape legend: T tokens, R ranks, M nodes, G ranks per node, N received rows, B bytes per row,
C float columns of a combine.

Bit-for-bit agreement between backends: every backend sums the copies of a token in the same order,
sum over nodes (ascending) of [sum over that node's ranks (ascending)], each sum starting from zero
in float32. That is the order the hierarchical backend needs (it reduces inside a node first), so
alltoall, allgather and moeflow.ep.reference follow it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeflow.ep import wire
from moeflow.ep.comm import Comm


@dataclass
class Topology:
    num_ranks: int  # R
    ranks_per_node: int  # G
    rank: int  # this process's position in the EP group
    main: Comm  # the whole EP group
    inter: Comm | None = None  # the ranks with this rank's local rank, one per node (hierarchical)
    intra: Comm | None = None  # the ranks of this node (hierarchical)

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local(self) -> int:
        return self.rank % self.ranks_per_node


class Counts:
    """The counts every rank published in the one count exchange of a dispatch (host ints).

    Row s: [T_s, tokens of s per destination rank (R), tokens of s per destination node (M), ...].
    """

    def __init__(self, rows: list[list[int]], num_ranks: int, num_nodes: int):
        self.rows, self.R, self.M = rows, num_ranks, num_nodes

    def tokens(self, s: int) -> int:
        return self.rows[s][0]

    def to_rank(self, s: int, r: int) -> int:
        return self.rows[s][1 + r]

    def to_node(self, s: int, n: int) -> int:
        return self.rows[s][1 + self.R + n]

    def extra(self, s: int) -> list[int]:
        return self.rows[s][1 + self.R + self.M:]


@dataclass
class Route:
    """Where this rank's tokens go, plus a way to read the destination ranks back off received rows."""

    mask_TR: torch.Tensor  # is_token_in_rank
    counts: Counts
    # Decodes [n, R] destination masks from received payload rows (from their topk_idx), or None
    # when the payload carries no topk_idx; backends that forward rows then append a mask (counted).
    mask_from_rows: Callable[[torch.Tensor], torch.Tensor] | None


def offsets(splits: list[int]) -> list[int]:
    out, acc = [], 0
    for n in splits:
        out.append(acc)
        acc += n
    return out


def to_f32(vals: list[torch.Tensor]) -> torch.Tensor:
    """List of [n, ...] tensors -> one float32 [n, C] matrix (the accumulation type)."""
    n = vals[0].shape[0]
    widths = [math.prod(v.shape[1:]) for v in vals]
    out = torch.empty(n, sum(widths), dtype=torch.float32, device=vals[0].device)
    off = 0
    for v, w in zip(vals, widths):
        out[:, off:off + w].copy_(v.reshape(n, w))  # converts while copying: one pass
        off += w
    return out


def from_f32(mat_nC: torch.Tensor, specs: list[wire.Spec]) -> list[torch.Tensor]:
    """Inverse of to_f32, casting each column group back to its dtype."""
    out, off = [], 0
    for dt, shape in specs:
        width = 1
        for s in shape:
            width *= s
        out.append(mat_nC[:, off:off + width].to(dt).reshape(mat_nC.shape[0], *shape))
        off += width
    return out


def reduce_blocks_by_node(
    blocks: list[tuple[torch.Tensor | None, torch.Tensor]], num_rows: int, C: int, ranks_per_node: int,
    device: torch.device,
) -> torch.Tensor:
    """sum over nodes of (sum over the node's ranks) of the blocks, in the canonical order.

    blocks[r] = (row indices or None for all rows, float32 values) returned by EP rank r.
    """
    out = torch.zeros(num_rows, C, dtype=torch.float32, device=device)
    if ranks_per_node == 1:
        # out + (0 + b) == out + b exactly, and untouched rows add nothing: skip the partial sums.
        for idx, vals in blocks:
            if idx is None:
                out += vals
            elif idx.numel():
                out.index_add_(0, idx, vals)
        return out
    for first in range(0, len(blocks), ranks_per_node):
        partial = torch.zeros_like(out)
        for idx, vals in blocks[first:first + ranks_per_node]:
            if idx is None:
                partial += vals
            elif idx.numel():
                partial.index_add_(0, idx, vals)  # indices are unique inside a block: deterministic
        out += partial
    return out
