"""Pack several per-row tensors into one uint8 [n, B] tensor so every phase is ONE collective.

Shape legend: n rows, B bytes per row.

Collectives move bytes, so fp8, int64 and float32 columns travel together, and the bytes recorded are
exactly rows * B (docs/ep-bytes.md row sizes).
"""

from __future__ import annotations

import math

import torch

Spec = tuple[torch.dtype, tuple[int, ...]]


def spec_of(t: torch.Tensor) -> Spec:
    return t.dtype, tuple(t.shape[1:])


def row_nbytes(specs: list[Spec]) -> int:
    return sum(math.prod(shape) * dt.itemsize for dt, shape in specs)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[n, ...] tensors (any dtypes) -> uint8 [n, B]."""
    n = tensors[0].shape[0]
    cols = []
    for t in tensors:
        width = math.prod(t.shape[1:])
        if t.numel() == 0:  # empty tensors can carry strides a dtype view rejects
            cols.append(torch.empty(n, width * t.element_size(), dtype=torch.uint8, device=t.device))
            continue
        t = t.contiguous().reshape(n, width)
        cols.append(t.view(torch.uint8) if t.dtype != torch.uint8 else t)
    return cols[0] if len(cols) == 1 else torch.cat(cols, dim=1)


def unpack(rows_nB: torch.Tensor, specs: list[Spec]) -> list[torch.Tensor]:
    """Inverse of pack: uint8 [n, B] -> tensors with the given (dtype, trailing shape)."""
    n, out, off = rows_nB.shape[0], [], 0
    for dt, shape in specs:
        width = math.prod(shape) * dt.itemsize
        out.append(column(rows_nB, off, width, dt).contiguous().reshape(n, *shape))
        off += width
    return out


def column(rows_nB: torch.Tensor, offset: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [offset, offset + width) of every row, reinterpreted as dtype: [n, width // itemsize]."""
    itemsize = dtype.itemsize
    n, B = rows_nB.shape
    col = rows_nB[:, offset:offset + width]
    if n > 1 and B % itemsize == 0 and (col.storage_offset() % itemsize) == 0:
        return col.view(dtype)  # aligned: a strided view, no copy
    # A fresh copy: a view to a wider dtype needs an aligned storage offset and row stride.
    flat = col.clone(memory_format=torch.contiguous_format).reshape(-1)
    return flat.view(dtype).reshape(n, width // itemsize)


def unpack_f32(rows_nB: torch.Tensor, specs: list[Spec]) -> torch.Tensor:
    """unpack straight into one float32 [n, C] matrix (C = all columns flattened): one pass per column."""
    n = rows_nB.shape[0]
    widths = [math.prod(shape) for _, shape in specs]
    out = torch.empty(n, sum(widths), dtype=torch.float32, device=rows_nB.device)
    off_b = off_c = 0
    for (dt, _), w in zip(specs, widths):
        nbytes = w * dt.itemsize
        out[:, off_c:off_c + w].copy_(column(rows_nB, off_b, nbytes, dt))
        off_b, off_c = off_b + nbytes, off_c + w
    return out
