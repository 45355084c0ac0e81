"""Bytes a rank sends in the collectives it runs, as ring algorithms move them, counted from the ops themselves:
a TorchDispatchMode sees every c10d op (torch.distributed's calls) and functional collective (DTensor's), with
their tensors and group sizes, so a count does not trust the code that issued them.

Ring volumes per rank (Patarasuk & Yuan 2009; Thakur et al. 2005): an all-gather of an n-byte shard over g ranks
sends (g - 1) n; an all-reduce of n bytes 2 (g - 1) / g n; a reduce-scatter of an n-byte input (g - 1) / g n; an
all-to-all what its input holds for the other ranks."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CollectiveBytes(TorchDispatchMode):
    """`with CollectiveBytes() as c: ...` then c.sent (bytes), c.ops ({op name: calls})."""

    def __init__(self):
        super().__init__()
        self.sent, self.ops = 0.0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("_c10d_functional::all_gather_into_tensor"):
            self._count(name, (args[1] - 1) * _bytes(args[0]))
        elif name.startswith("c10d::allreduce_"):
            g = torch.distributed.ProcessGroup.unbox(args[1]).size()
            self._count(name, sum(2 * (g - 1) / g * _bytes(t) for t in args[0]))
        elif name.startswith("_c10d_functional::reduce_scatter_tensor"):
            self._count(name, (args[2] - 1) / args[2] * _bytes(args[0]))
        elif name.startswith("c10d::alltoall_base_"):  # what the input sends to the other ranks
            output, input_, group, _, splits = args[:5]
            me = torch.distributed.ProcessGroup.unbox(group).rank()
            if not splits:  # equal splits
                splits = [input_.numel() // torch.distributed.ProcessGroup.unbox(group).size()] * (me + 1)
            self._count(name, _bytes(input_) - splits[me] * input_.element_size())
        elif ("c10d" in name and "wait" not in name and "wrap" not in name):
            raise NotImplementedError(f"CollectiveBytes has no ring volume for {name}")
        return func(*args, **(kwargs or {}))

    def _count(self, name: str, sent: float) -> None:
        self.sent += sent
        self.ops[name] = self.ops.get(name, 0) + 1
