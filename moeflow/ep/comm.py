"""Collectives with a timeout that names the operation, byte accounting per call, and collectives in flight.

Shape legend: n rows, B bytes per row, R members of the group, C counters per member.

A group of size 1 never calls torch.distributed (moeflow runs ep=1 with no process group at all).
`all_to_all(..., async_op=True)` returns an InFlight (moeflow/ep/inflight.py): the collective is in flight (on a
GPU, NCCL runs it on its own stream; on gloo, a worker thread moves the bytes) and `wait()` waits for it and runs
what was chained after it. Waiting on a GPU only makes the current stream wait (no host sync).
"""

from __future__ import annotations

import datetime
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.ep.inflight import InFlight

# torch 2.13 renamed the tensor collectives (`all_gather_into_tensor` -> `all_gather_single`, likewise
# reduce-scatter) and deprecated the old names; 2.11 has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_NEW_GROUP_PARAMS = inspect.signature(dist.new_group).parameters
_NODE_GROUPS: dict[tuple, tuple[list, list]] = {}  # (global ranks, ranks per node) -> node_comms' groups


def new_group_in_order(ranks: list[int]):
    """`dist.new_group` whose group ranks follow `ranks` as given. Older torch (2.11, for one) has no `sort_ranks`
    and sorts them, which only matters when they are out of order; then this says so instead of renumbering."""
    if "sort_ranks" in _NEW_GROUP_PARAMS:
        return dist.new_group(ranks, sort_ranks=False)
    if ranks != sorted(ranks):
        raise RuntimeError(f"torch {torch.__version__} numbers a process group's ranks in ascending order, and this "
                           f"group's ranks {ranks} are not; torch 2.13 or newer keeps the given order")
    return dist.new_group(ranks)


@dataclass
class EPStats:
    """Bytes this rank sent to other ranks (inside / across nodes) and the number of dispatch+combine calls."""

    dispatch_bytes_intra: int = 0
    dispatch_bytes_inter: int = 0
    combine_bytes_intra: int = 0
    combine_bytes_inter: int = 0
    calls: int = 0


class Comm:
    """One process group (or none) plus the node of each member, for timeouts and byte counting.

    `members` are the EP ranks (positions in the Buffer's group) of this group's members, in the
    group's rank order; `node_of` maps an EP rank to its node.
    """

    def __init__(self, group, members: list[int], me: int, node_of: list[int], timeout_s: float,
                 stats: EPStats):
        self.group, self.members, self.me = group, members, me
        self.size = len(members)
        self.index = members.index(me)
        self.node_of, self.timeout_s, self.stats = node_of, timeout_s, stats
        # NCCL's Work.wait orders the current stream after the collective; gloo's blocks the host anyway
        self.on_device = dist.is_initialized() and dist.get_backend(group) != "gloo"

    def _wait(self, work, op: str) -> None:
        try:
            if self.on_device:
                # NCCL: a plain wait only makes the current stream wait; with a timeout it blocks the host until
                # the collective ends (a host sync per call). The process group's own timeout covers hangs.
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:  # gloo raises RuntimeError("... timed out ..."), NCCL DistBackendError
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise TimeoutError(
                    f"moeflow.ep {op} did not complete within timeout_s={self.timeout_s} s on EP rank "
                    f"{self.me}: a peer never joined the call (every rank must call it, in the same "
                    f"order); raise Buffer(timeout_s=...) if the peers are just slow"
                ) from exc
            raise RuntimeError(f"moeflow.ep {op} failed on EP rank {self.me}: {exc}") from exc

    def all_gather(self, vec_C: torch.Tensor, op: str) -> torch.Tensor:
        """[C] int64 from every member -> [R, C]."""
        if self.size == 1:
            return vec_C.unsqueeze(0)
        out = [torch.empty_like(vec_C) for _ in range(self.size)]
        self._wait(dist.all_gather(out, vec_C, group=self.group, async_op=True), op)
        return torch.stack(out)

    def all_to_all(self, rows_nB: torch.Tensor, send_splits: list[int] | None, recv_splits: list[int] | None,
                   op: str, kind: str | None, async_op: bool = False):
        """One all_to_all_single of uint8 rows; records rows * B sent to other members as `kind` bytes.
        Splits None: equal blocks (a static size: no counts needed on the host). Returns the received rows,
        or with async_op an InFlight of them."""
        if kind is not None:
            splits = send_splits or [rows_nB.shape[0] // self.size] * self.size
            self.record(kind, splits, rows_nB.shape[1])
        if self.size == 1:
            return InFlight(rows_nB) if async_op else rows_nB
        n_out = sum(recv_splits) if recv_splits is not None else rows_nB.shape[0]
        out = rows_nB.new_empty((n_out, rows_nB.shape[1]))
        work = dist.all_to_all_single(out, rows_nB.contiguous(), recv_splits, send_splits,
                                      group=self.group, async_op=True)
        in_flight = InFlight(out, until=lambda: self._wait(work, op))
        return in_flight if async_op else in_flight.wait()

    def record(self, kind: str, rows_per_member: list[int], row_bytes: int) -> None:
        """Add rows * row_bytes sent to each other member to the intra or inter counter of `kind`."""
        my_node = self.node_of[self.me]
        for i, n in enumerate(rows_per_member):
            if i != self.index and n:
                where = "intra" if self.node_of[self.members[i]] == my_node else "inter"
                name = f"{kind}_bytes_{where}"
                setattr(self.stats, name, getattr(self.stats, name) + n * row_bytes)


def node_comms(global_ranks: list[int], ranks_per_node: int, me: int, timeout_s: float,
               stats: EPStats) -> tuple[Comm, Comm]:
    """Comms over the ranks sharing EP rank `me`'s local rank (one per node) and over its node.

    dist.new_group is collective over the whole default group, so every rank builds every subgroup
    in the same order (cached per group and ranks_per_node, so later Buffers build none).
    """
    R, G = len(global_ranks), ranks_per_node
    M = R // G
    node_of = [r // G for r in range(R)]
    inter_members = [[n * G + j for n in range(M)] for j in range(G)]
    intra_members = [[n * G + j for j in range(G)] for n in range(M)]
    key = (tuple(global_ranks), G)
    if key not in _NODE_GROUPS and R > 1:
        def build(members_list):
            return [
                new_group_in_order([global_ranks[m] for m in ms]) if len(ms) > 1 else None
                for ms in members_list
            ]
        _NODE_GROUPS[key] = (build(inter_members), build(intra_members))
    inter_groups, intra_groups = _NODE_GROUPS.get(key, ([None] * G, [None] * M))
    node, local = me // G, me % G
    return (
        Comm(inter_groups[local], inter_members[local], me, node_of, timeout_s, stats),
        Comm(intra_groups[node], intra_members[node], me, node_of, timeout_s, stats),
    )
