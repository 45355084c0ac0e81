"""Static-size dispatch for `num_worst_tokens = W > 0`: no counts on the host, hence no host sync.

Shape legend: T tokens, R ranks, C slots per peer (W // R), W returned rows, B bytes per row, F float columns.

Every rank sends each peer a block of C slots: the tokens that need that peer, in token order, then empty
slots (a padding row whose topk_idx bytes read -1). One all_to_all_single with equal splits moves the blocks,
so the split sizes are static and nothing is read back to the host. The receiver moves the valid rows to the
front, keeping (source rank, token) order -- the order of the other backends -- and pads to W rows. A peer
that needs more than C of one rank's tokens gets only the first C: the rest are counted on the device in
`overflow` (W >= R x the largest per-rank token count never drops a token). Combine sends the rows back in the
same slots and sums a token's copies over nodes ascending of (that node's ranks ascending), as every backend.
The bytes recorded are the whole blocks (empty slots travel too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.ep import wire
from moeflow.ep.backends.base import Topology


@dataclass
class StaticPlan:
    slot_TR: torch.Tensor  # slot of token t in its block for rank r; C where t is not sent to r (or dropped)
    order_Q: torch.Tensor  # [R * C] received row at each returned position (valid rows first)
    num_tokens: int  # T
    num_rows: int  # W
    slots: int  # C


class StaticBackend:
    name = "static"

    def __init__(self, topo: Topology):
        self.topo = topo
        self.overflow: torch.Tensor | None = None  # device count of (token, rank) pairs beyond the slots

    def plan_slots(self, mask_TR: torch.Tensor, num_rows: int) -> torch.Tensor:
        """slot_TR: each token's position among the tokens that need rank r, or C for none / overflow."""
        C = num_rows // self.topo.num_ranks
        pos_TR = torch.cumsum(mask_TR.to(torch.int64), 0) - 1
        fits = mask_TR & (pos_TR < C)
        dropped = (mask_TR & ~fits).sum()
        self.overflow = dropped if self.overflow is None else self.overflow + dropped
        return torch.where(fits, pos_TR, torch.full_like(pos_TR, C))

    def _send_blocks(self, rows_TB: torch.Tensor, slot_TR: torch.Tensor, pad_B: torch.Tensor, C: int):
        T, R = slot_TR.shape
        blocks = pad_B.expand(R * (C + 1), -1).clone()  # slot C of each block is a dump for unsent tokens
        dest = (torch.arange(R, device=rows_TB.device) * (C + 1)).view(1, R) + slot_TR
        blocks.index_copy_(0, dest.t().reshape(-1), rows_TB.repeat(R, 1))
        return blocks.view(R, C + 1, -1)[:, :C].reshape(R * C, -1)

    def dispatch(self, rows_TB: torch.Tensor, slot_TR: torch.Tensor, pad_B: torch.Tensor, valid_of, num_rows: int,
                 op: str, async_op: bool = False):
        """-> (rows [W, B], plan); `valid_of(rows)` reads which received rows hold a token (from topk_idx)."""
        C = num_rows // self.topo.num_ranks
        got = self.topo.main.all_to_all(self._send_blocks(rows_TB, slot_TR, pad_B, C), None, None,
                                        f"{op} (static all_to_all)", "dispatch", async_op)

        def compact(got_QB):
            # Valid rows first, each group in arrival order: (source rank, token) for the valid ones.
            order_Q = torch.argsort((~valid_of(got_QB)).to(torch.int8), stable=True)
            plan = StaticPlan(slot_TR, order_Q, rows_TB.shape[0], num_rows, C)
            return self._pad(got_QB.index_select(0, order_Q), pad_B, num_rows), plan

        return got.then(compact) if async_op else compact(got)

    @staticmethod
    def _pad(rows_QB: torch.Tensor, pad_B: torch.Tensor, num_rows: int) -> torch.Tensor:
        extra = num_rows - rows_QB.shape[0]
        return torch.cat([rows_QB, pad_B.expand(extra, -1)]) if extra else rows_QB

    def dispatch_cached(self, rows_TB: torch.Tensor, plan: StaticPlan, op: str, async_op: bool = False):
        pad_B = rows_TB.new_zeros(rows_TB.shape[1])
        got = self.topo.main.all_to_all(self._send_blocks(rows_TB, plan.slot_TR, pad_B, plan.slots), None, None,
                                        f"{op} (static all_to_all)", "dispatch", async_op)
        compact = lambda got_QB: self._pad(got_QB.index_select(0, plan.order_Q), pad_B, plan.num_rows)
        return got.then(compact) if async_op else compact(got)

    def combine(self, vals: list[torch.Tensor], plan: StaticPlan, op: str, async_op: bool = False):
        """vals: [W, ...] per returned row -> float32 [T, F], each token's copies summed."""
        R, C, G = self.topo.num_ranks, plan.slots, self.topo.ranks_per_node
        specs = [wire.spec_of(v) for v in vals]
        rows_WB = wire.pack(vals)
        arrived_QB = torch.empty_like(rows_WB[:R * C]).index_copy_(0, plan.order_Q, rows_WB[:R * C])
        back = self.topo.main.all_to_all(arrived_QB, None, None, f"{op} (static all_to_all)", "combine", async_op)

        def reduce(back_QB):
            back_QF = wire.unpack_f32(back_QB, specs)
            back_QF = torch.cat([back_QF, back_QF.new_zeros(1, back_QF.shape[1])])  # row R * C: "not sent"
            T = plan.num_tokens
            sent_TR = plan.slot_TR < C
            row_TR = torch.where(sent_TR, torch.arange(R, device=back_QB.device).view(1, R) * C + plan.slot_TR,
                                 torch.full_like(plan.slot_TR, R * C))
            out = back_QF.new_zeros(T, back_QF.shape[1])
            for first in range(0, R, G):  # the canonical order: nodes ascending of (node's ranks ascending)
                partial = out if G == 1 else torch.zeros_like(out)
                for r in range(first, first + G):
                    partial += back_QF.index_select(0, row_TR[:, r])
                if G > 1:
                    out += partial
            return out

        return back.then(reduce) if async_op else reduce(back)
