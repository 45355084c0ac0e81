"""Count the operations that would make a GPU wait for the host (a device-to-host read) inside a block.

On a CPU nothing waits, so the test counts the calls that would: Python-level reads of a tensor's values
(.item(), .tolist(), .cpu(), .numpy(), bool/int/float of a tensor), tensors made from host data (torch.tensor of
Python numbers: a host-to-device copy from pageable memory, which syncs a GPU's stream) and the aten ops whose
output size depends on the data (nonzero, masked_select, boolean indexing, bincount, unique, repeat_interleave
without output_size) or that read a scalar back (_local_scalar_dense). Both layers are watched: Python patches
catch the methods, a TorchDispatchMode catches the ops (also inside autograd's backward, which runs on the
calling thread here).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNCING_OPS = {
    aten.nonzero.default, aten.masked_select.default, aten._local_scalar_dense.default, aten.bincount.default,
    aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
}
METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING_OPS:
            self.counts[str(func)] += 1
        elif func is aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None):
            self.counts["boolean indexing"] += 1
        elif func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and \
                kwargs.get("output_size") is None:
            self.counts[str(func)] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs():
    """with count_host_syncs() as counts: ...  -> counts: Counter of what would sync, by name."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in METHODS}

    def watched(name, original):
        def method(self, *args, **kwargs):
            counts[f"Tensor.{name}"] += 1  # on a GPU each of these reads the device from the host
            return original(self, *args, **kwargs)
        return method

    original_tensor = torch.tensor

    def tensor(data, *args, **kwargs):
        if not isinstance(data, torch.Tensor):  # on a GPU: a copy from pageable host memory, which syncs
            counts["torch.tensor(host data)"] += 1
        return original_tensor(data, *args, **kwargs)

    for name, original in originals.items():
        setattr(torch.Tensor, name, watched(name, original))
    torch.tensor = tensor
    try:
        with _Ops(counts):
            yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.tensor = original_tensor
