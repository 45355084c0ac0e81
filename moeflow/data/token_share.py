"""A token cache written by the ranks of a job over several nodes together (a torchrun job, which no launcher
prepares for): one rank per node tokenizes that node's share of the records with the node's cores (the
tokenizer's threads), each item (a jsonl byte range or a batch of records, as moeflow/data/token_cache.py cuts
them) saved as a part beside the cache, and rank 0 joins the parts in record order into the cache folder - the
same bytes and meta one process writes. The folder then sits on storage every node reads, as it must for the
other ranks to open it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeflow.data.records import RecordSource
from moeflow.data.token_cache import (
    _BATCH,
    META,
    _encode_batch,
    _encode_jsonl_chunk,
    _in_workers,
    _is_plain_jsonl,
    _jsonl_chunks,
    _load_checked,
    _write_tokens,
    cache_key,
    commit,
)


@dataclass
class Share:
    """How the ranks of a job write a cache together: this rank tokenizes part `part` of `parts` (None: it only
    waits), rank 0 (`joins`) joins them; gather(obj) is every rank's obj in rank order (a collective every rank
    of the job calls alike)."""

    part: int | None
    parts: int
    joins: bool
    gather: Callable[[object], list]


def write_together(src: RecordSource, encoder, root: Path, share: Share, *, max_bytes: int = 4_000_000,
                   progress: bool | None = None) -> Path:
    """token_cache.write_cache by every rank of a job: part p of n encodes items p, p + n, ... of the records
    (jsonl chunks or batches) into `parts/`, and rank 0 joins the parts in order into the cache folder."""
    key = cache_key(src, encoder, max_bytes)
    root = Path(root)
    folder = root / key
    if share.gather((folder / META).is_file())[0]:  # (rank 0's view decides: every rank takes the same branch)
        return folder
    tmp = root / f".{key}.tmp-ranks"
    if share.joins:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "parts").mkdir(parents=True)
    share.gather(None)
    try:
        meta = _tokenize_together(src, encoder, tmp, key, max_bytes, progress, share)
        if share.joins:
            commit(tmp, folder, meta, [tmp / "parts", *tmp.glob("hf-*")])
    finally:
        if share.joins:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _tokenize_together(src: RecordSource, encoder, out: Path, key: str, max_bytes: int, progress,
                       share: Share) -> dict | None:
    """This rank's part of the items encoded into out/parts/<item>.npz, then (rank 0) the cache files from all of
    them in order and the meta; None on the other ranks. As _tokenize: plain text jsonl read by byte ranges, else
    the records through `datasets` (each tokenizing rank its own Arrow copy)."""
    parts = out / "parts"
    if _is_plain_jsonl(src, encoder):
        chunks = _jsonl_chunks(src.files)
        plain = _encode_share(parts, chunks, share, _encode_jsonl_chunk, files=src.files, encoder=encoder)
        if all(share.gather(plain)):
            if not share.joins:
                return None
            counts = [0] * len(src.files)

            def joined():
                for i, (file, start, end) in enumerate(chunks):
                    encoded, records = _read_part(parts / f"{i}.npz")
                    counts[file] += records
                    yield encoded, end - start

            meta = _write_tokens(src, encoder, out, key, joined(), sum(os.path.getsize(f) for f in src.files), "B",
                                 progress)
            src.counts = counts
            meta["source"] = src.describe()
            return meta
    ds, error = None, None
    if share.part is not None:  # (a rank that waits learns of bad records from the others)
        try:
            ds = _load_checked(src, encoder, out / f"hf-{share.part}", max_bytes)
            _encode_share(parts, range(0, len(ds), _BATCH), share, _encode_batch, ds=ds, encoder=encoder)
        except ValueError as e:
            error = str(e)
    errors = [e for e in share.gather(error) if e]  # every part written, or why not
    if errors:
        raise ValueError(errors[0])
    if not share.joins:
        return None
    starts = range(0, len(ds), _BATCH)
    joined = ((_read_part(parts / f"{i}.npz")[0], min(_BATCH, len(ds) - start)) for i, start in enumerate(starts))
    return _write_tokens(src, encoder, out, key, joined, len(ds), "rec", progress)


def _encode_share(parts: Path, items: list, share: Share, fn, **work) -> bool:
    """fn(item) for this rank's items (every share.parts-th from share.part), each saved as parts/<index>.npz;
    False as soon as one is None (a jsonl chunk that is not plain text records)."""
    mine = [] if share.part is None else list(range(share.part, len(items), share.parts))
    for i, result in zip(mine, _in_workers(fn, [items[i] for i in mine], 1, **work)):
        if result is None:
            return False
        encoded, records = result if fn is _encode_jsonl_chunk else (result, 0)
        if len(encoded) == 2:  # (record index, what is wrong with it): the join raises it in order
            np.savez(parts / f"{i}.npz", bad_record=np.int64(encoded[0]), what=np.str_(encoded[1]))
            continue
        ids, lengths, masks, trained = encoded
        np.savez(parts / f"{i}.npz", ids=ids, lengths=lengths, trained=trained, records=np.int64(records),
                 **({} if masks is None else {"masks": masks}))
    return True


def _read_part(path: Path) -> tuple[tuple, int]:
    """(encoded batch, records) of a part _encode_share saved."""
    with np.load(path) as part:
        if "bad_record" in part:
            return (int(part["bad_record"]), str(part["what"])), 0
        masks = part["masks"] if "masks" in part else None
        return (part["ids"], part["lengths"], masks, part["trained"]), int(part["records"])
