"""Backend `hierarchical`: across nodes once per destination node, then inside the node.

Shape legend: T tokens, R ranks, M nodes, G ranks per node, S1 rows sent across nodes, F rows this
rank forwards (received across nodes, plus its own tokens for its own node), S2 rows sent inside the
node, N received rows, B bytes per row, C float columns.

Dispatch, for a token of rank s (node ns, local rank l):
  phase 1 (inter): one copy to the rank with local rank l on every destination node n != ns
                   (over the group of ranks with local rank l; the block for ns is a local copy);
  phase 2 (intra): that forwarding rank p sends one copy to every other destination rank of its node.
Combine runs it backwards: the ranks of a node send their results to p, p sums them (intra-node
reduction first), and one partial sum per node crosses back to s, which sums the nodes.
Received rows are put back in (source rank, token) order so every backend returns the same tensor.
With async_op the first phase is in flight when the call returns; the second starts when the caller waits on
the InFlight (it needs the first phase's rows on this rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.ep import wire
from moeflow.ep.backends.base import Route, Topology, from_f32, offsets, reduce_blocks_by_node


@dataclass
class HierarchicalPlan:
    send1_idx_S1: torch.Tensor  # token index of each inter-node row, grouped by destination node
    send1: list[int]  # rows to each node (inter group order = node order)
    recv1: list[int]  # rows from each node's rank with our local rank
    send2_idx_S2: torch.Tensor  # forwarded-row index of each intra-node row, grouped by local rank
    send2: list[int]
    recv2: list[int]
    order_N: torch.Tensor  # received position of the n-th row in (source rank, token) order
    num_tokens: int
    num_forward: int  # F
    num_recv: int


class HierarchicalBackend:
    name = "hierarchical"

    def __init__(self, topo: Topology):
        self.topo = topo

    def dispatch(self, rows_TB: torch.Tensor, route: Route, op: str, async_op: bool = False):
        topo, cnt, mask_TR = self.topo, route.counts, route.mask_TR
        me, R, M, G = topo.rank, topo.num_ranks, topo.num_nodes, topo.ranks_per_node
        node, local = topo.node, topo.local
        T = rows_TB.shape[0]
        nodes_TM = mask_TR.view(T, M, G).any(dim=2)
        # host sync (nonzero): row indices of each phase; their sizes are already known from the counts
        nz = nodes_TM.t().nonzero()
        send1_idx, send1_node = nz[:, 1], nz[:, 0]
        send1 = [cnt.to_node(me, n) for n in range(M)]
        recv1 = [cnt.to_node(m * G + local, node) for m in range(M)]
        rows1 = rows_TB.index_select(0, send1_idx)
        with_mask = route.mask_from_rows is None
        if with_mask:
            # No topk_idx in the payload: tell the forwarding rank which of its node's ranks need the row
            # (G bytes per inter-node row, counted in the stats).
            node_masks = mask_TR.view(T, M, G)[send1_idx, send1_node].to(torch.uint8)
            rows1 = torch.cat([rows1, node_masks], dim=1)
        got1 = topo.inter.all_to_all(rows1, send1, recv1, f"{op} (inter-node phase)", "dispatch", async_op)

        def phase2(fwd_FB):
            if with_mask:
                fwd_mask_FG = fwd_FB[:, -G:].bool()
                fwd_FB = fwd_FB[:, :-G]
            else:
                fwd_mask_FG = route.mask_from_rows(fwd_FB)[:, node * G:(node + 1) * G]
            send2_idx = fwd_mask_FG.t().nonzero()[:, 1]  # host sync (nonzero), as above
            # From forwarding rank j of our node we get the rows of sources m*G + j for every node m.
            send2 = [sum(cnt.to_rank(m * G + local, node * G + j) for m in range(M)) for j in range(G)]
            recv2 = [sum(cnt.to_rank(m * G + j, me) for m in range(M)) for j in range(G)]
            start2 = offsets(recv2)
            order = []
            for s in range(R):  # canonical order: source rank ascending (s = m*G + j)
                m, j = divmod(s, G)
                start = start2[j] + sum(cnt.to_rank(mm * G + j, me) for mm in range(m))
                order.append(torch.arange(start, start + cnt.to_rank(s, me), device=rows_TB.device))
            plan = HierarchicalPlan(send1_idx, send1, recv1, send2_idx, send2, recv2, torch.cat(order), T,
                                    fwd_FB.shape[0], sum(recv2))
            return self._phase2(fwd_FB, plan, op), plan

        return got1.then(phase2) if async_op else phase2(got1)

    def _phase2(self, fwd_FB: torch.Tensor, plan: HierarchicalPlan, op: str) -> torch.Tensor:
        got = self.topo.intra.all_to_all(
            fwd_FB.index_select(0, plan.send2_idx_S2), plan.send2, plan.recv2, f"{op} (intra-node phase)", "dispatch"
        )
        return got.index_select(0, plan.order_N)

    def dispatch_cached(self, rows_TB: torch.Tensor, plan: HierarchicalPlan, op: str, async_op: bool = False):
        got1 = self.topo.inter.all_to_all(
            rows_TB.index_select(0, plan.send1_idx_S1), plan.send1, plan.recv1, f"{op} (inter-node phase)",
            "dispatch", async_op,
        )
        phase2 = lambda fwd_FB: self._phase2(fwd_FB, plan, op)
        return got1.then(phase2) if async_op else phase2(got1)

    def combine(self, vals: list[torch.Tensor], plan: HierarchicalPlan, op: str, async_op: bool = False):
        topo = self.topo
        specs = [wire.spec_of(v) for v in vals]
        # Back to the order the rows arrived in, then to the forwarding ranks of this node.
        arrived = [torch.empty_like(v).index_copy_(0, plan.order_N, v) for v in vals]
        got2 = topo.intra.all_to_all(
            wire.pack(arrived), plan.recv2, plan.send2, f"{op} (intra-node phase)", "combine", async_op
        )

        def inter_phase(got2):
            got2_C = wire.unpack_f32(got2, specs)
            blocks = [
                (plan.send2_idx_S2[o:o + n], got2_C[o:o + n]) for o, n in zip(offsets(plan.send2), plan.send2)
            ]
            # Intra-node reduction on the forwarding rank: one node, ranks ascending.
            partial_FC = reduce_blocks_by_node(blocks, plan.num_forward, got2_C.shape[1], len(blocks),
                                               got2_C.device)
            # The partial sums cross nodes in the caller's dtypes (bf16 partials are rounded, as in DeepEP).
            got1 = topo.inter.all_to_all(
                wire.pack(from_f32(partial_FC, specs)), plan.recv1, plan.send1, f"{op} (inter-node phase)",
                "combine",
            )
            got1_C = wire.unpack_f32(got1, specs)
            blocks = [
                (plan.send1_idx_S1[o:o + n], got1_C[o:o + n]) for o, n in zip(offsets(plan.send1), plan.send1)
            ]
            # One block per node, so 'ranks per node' = 1 here: the nodes are summed in ascending order.
            return reduce_blocks_by_node(blocks, plan.num_tokens, got1_C.shape[1], 1, got1_C.device)

        return got2.then(inter_phase) if async_op else inter_phase(got2)
