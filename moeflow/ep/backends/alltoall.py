"""Backend `alltoall`: counts exchange, then one all_to_all_single; a token goes to a rank once.

Shape legend: T tokens, R ranks, N received rows, S sent rows, B bytes per row, C float columns.
Received rows are ordered by source rank, then by token index at the source (DeepEP's order).
Every method takes async_op: then the result comes back as a moeflow.ep.inflight.InFlight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.ep import wire
from moeflow.ep.backends.base import Route, Topology, offsets, reduce_blocks_by_node


@dataclass
class AlltoallPlan:
    send_idx_S: torch.Tensor  # token index of each sent row, grouped by destination rank
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    num_recv: int


class AlltoallBackend:
    name = "alltoall"

    def __init__(self, topo: Topology):
        self.topo = topo

    def dispatch(self, rows_TB: torch.Tensor, route: Route, op: str, async_op: bool = False):
        topo, cnt = self.topo, route.counts
        me, R = topo.rank, topo.num_ranks
        # (r, t) pairs in row-major order: grouped by destination rank, tokens ascending.
        # host sync (nonzero, dynamic size): the row indices; their count is already known from the counts
        send_idx_S = route.mask_TR.t().nonzero()[:, 1]
        send = [cnt.to_rank(me, r) for r in range(R)]
        recv = [cnt.to_rank(s, me) for s in range(R)]
        plan = AlltoallPlan(send_idx_S, send, recv, rows_TB.shape[0], sum(recv))
        got = self.dispatch_cached(rows_TB, plan, op, async_op)
        return got.then(lambda recv: (recv, plan)) if async_op else (got, plan)

    def dispatch_cached(self, rows_TB: torch.Tensor, plan: AlltoallPlan, op: str, async_op: bool = False):
        rows_SB = rows_TB.index_select(0, plan.send_idx_S)
        return self.topo.main.all_to_all(rows_SB, plan.send_splits, plan.recv_splits, f"{op} (all_to_all)",
                                         "dispatch", async_op)

    def combine(self, vals: list[torch.Tensor], plan: AlltoallPlan, op: str, async_op: bool = False):
        specs = [wire.spec_of(v) for v in vals]
        back = self.topo.main.all_to_all(
            wire.pack(vals), plan.recv_splits, plan.send_splits, f"{op} (all_to_all)", "combine", async_op
        )

        def reduce(back):
            back_SC = wire.unpack_f32(back, specs)
            blocks = [
                (plan.send_idx_S[o:o + n], back_SC[o:o + n])
                for o, n in zip(offsets(plan.send_splits), plan.send_splits)
            ]
            return reduce_blocks_by_node(blocks, plan.num_tokens, back_SC.shape[1], self.topo.ranks_per_node,
                                         back_SC.device)

        return back.then(reduce) if async_op else reduce(back)
