"""Backend `allgather`: every rank receives every token, keeps its own (Megatron's all-gather dispatcher).

Shape legend: T tokens, R ranks, A all gathered rows (sum of every rank's T), N kept rows, B bytes per
row, C float columns.

The gather is an all_to_all_single whose blocks are all this rank's rows (gloo's all_gather needs equal
sizes); combine sends each rank's partial results for every token of every other rank back, which is
the reduce-scatter half. Useful for small EP groups and as a simple cross-check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.ep import wire
from moeflow.ep.backends.base import Route, Topology, offsets, reduce_blocks_by_node


@dataclass
class AllgatherPlan:
    keep_N: torch.Tensor  # positions of the kept rows among the A gathered rows
    tokens_per_rank: list[int]
    num_tokens: int
    num_recv: int
    with_mask: bool


class AllgatherBackend:
    name = "allgather"

    def __init__(self, topo: Topology):
        self.topo = topo

    def _gather(self, rows_TB, mask_TR, plan_tokens: list[int], op: str, async_op: bool = False):
        R = self.topo.num_ranks
        rows = rows_TB.repeat(R, 1)
        if mask_TR is not None:
            # One byte per row telling the receiver whether the row is for it (each block differs).
            rows = torch.cat([rows, mask_TR.t().reshape(-1, 1).to(torch.uint8)], dim=1)
        send = [rows_TB.shape[0]] * R
        return self.topo.main.all_to_all(rows, send, plan_tokens, f"{op} (all-gather)", "dispatch", async_op)

    def dispatch(self, rows_TB: torch.Tensor, route: Route, op: str, async_op: bool = False):
        R, me = self.topo.num_ranks, self.topo.rank
        tokens = [route.counts.tokens(s) for s in range(R)]
        with_mask = route.mask_from_rows is None
        got = self._gather(rows_TB, route.mask_TR if with_mask else None, tokens, op, async_op)

        def keep(got_AB):
            if with_mask:
                mine_A = got_AB[:, -1].bool()
                got_AB = got_AB[:, :-1]
            else:
                mine_A = route.mask_from_rows(got_AB)[:, me]
            keep_N = mine_A.nonzero()[:, 0]  # host sync (dynamic size): which gathered rows are ours
            plan = AllgatherPlan(keep_N, tokens, rows_TB.shape[0], keep_N.numel(), with_mask)
            return got_AB.index_select(0, keep_N), plan

        return got.then(keep) if async_op else keep(got)

    def dispatch_cached(self, rows_TB: torch.Tensor, plan: AllgatherPlan, op: str, async_op: bool = False):
        # The mask byte is not needed again: the kept positions are in the plan.
        got = self._gather(rows_TB, None, plan.tokens_per_rank, op, async_op)
        keep = lambda got_AB: got_AB.index_select(0, plan.keep_N)
        return got.then(keep) if async_op else keep(got)

    def combine(self, vals: list[torch.Tensor], plan: AllgatherPlan, op: str, async_op: bool = False):
        specs = [wire.spec_of(v) for v in vals]
        A = sum(plan.tokens_per_rank)
        full = [v.new_zeros((A, *v.shape[1:])).index_copy_(0, plan.keep_N, v) for v in vals]
        R = self.topo.num_ranks
        back = self.topo.main.all_to_all(
            wire.pack(full), plan.tokens_per_rank, [plan.num_tokens] * R, f"{op} (reduce-scatter)", "combine",
            async_op,
        )

        def reduce(back):
            back_C = wire.unpack_f32(back, specs)
            blocks = [(None, back_C[o:o + plan.num_tokens]) for o in offsets([plan.num_tokens] * R)]
            return reduce_blocks_by_node(blocks, plan.num_tokens, back_C.shape[1], self.topo.ranks_per_node,
                                         back_C.device)

        return back.then(reduce) if async_op else reduce(back)
