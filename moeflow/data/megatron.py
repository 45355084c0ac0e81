"""Megatron's indexed datasets (`PREFIX.bin` + `PREFIX.idx`, written by Megatron-LM's
`tools/preprocess_data.py` / megatron-core's `IndexedDatasetBuilder`), read from the format itself.

The `.idx` file (little-endian), as megatron-core's `indexed_dataset.py` writes it:

    b"MMIDIDX\\x00\\x00"      9 bytes, the header
    version                 uint64, 1
    dtype code              uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count S        uint64
    document count D + 1    uint64 (the document indices, a leading 0 included)
    sequence lengths        int32 [S], tokens per sequence
    sequence pointers       int64 [S], byte offset of each sequence in the .bin
    document indices        int64 [D + 1], document d is sequences [idx[d], idx[d + 1])
    (sequence modes         int8 [S], multimodal datasets only)

The `.bin` is the sequences' tokens, back to back, memory-mapped here. A run reads it as one token stream (text
mode: Megatron's preprocessing already put an end-of-document token after each document when asked to) or, with
data.packing, as documents; each is refused in one line naming the file when it does not match its index.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeflow.data.token_cache import TokenCache

HEADER = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
INTEGER_CODES = (1, 2, 3, 4, 5, 8)


@dataclass
class MegatronIndex:
    path: Path  # the .idx file
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 [S]
    sequence_pointers: np.ndarray  # int64 [S], bytes
    document_indices: np.ndarray  # int64 [D + 1]

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def document_offsets(self) -> np.ndarray:
        """int64 [D + 1]: the token offset in the .bin where each document starts, then the end."""
        starts = self.sequence_pointers // self.dtype.itemsize
        ends = np.append(starts, self.num_tokens)
        return ends[self.document_indices]


def megatron_prefix(source: str) -> Path | None:
    """The dataset prefix when `source` names a Megatron dataset (PREFIX, PREFIX.idx, or PREFIX.bin with its .idx
    beside it), else None (a .bin without an .idx stays a raw token stream)."""
    path = Path(source)
    named = path.suffix in (".bin", ".idx")
    prefix = Path(source[:-4]) if named else path
    if _with(prefix, ".idx").is_file() and (named or not path.exists()):
        return prefix
    return None


def _with(prefix: Path, suffix: str) -> Path:
    return Path(f"{prefix}{suffix}")  # (not with_suffix: a prefix may hold dots)


def read_index(path: Path) -> MegatronIndex:
    """The .idx at `path`, or ValueError naming the file and what is wrong with it."""
    data = path.read_bytes()
    what = f"data.source: {path}"
    if data[:9] != HEADER:
        raise ValueError(f"{what} does not start with Megatron's index header {HEADER!r}; it is not a "
                         f"megatron-core indexed dataset index (or the file is corrupt)")
    if len(data) < 34:
        raise ValueError(f"{what} is {len(data)} bytes, shorter than an index header; the file was cut short")
    version = int(np.frombuffer(data, np.uint64, 1, 9)[0])
    if version != 1:
        raise ValueError(f"{what} is index version {version}; this reader knows version 1")
    code = data[17]
    if code not in INTEGER_CODES:
        raise ValueError(f"{what} holds dtype code {code} ({DTYPES.get(code, 'unknown')}), not token ids; "
                         f"write the dataset with an integer dtype")
    S, D1 = (int(v) for v in np.frombuffer(data, np.uint64, 2, 18))
    end = 34 + 4 * S + 8 * S + 8 * D1
    if len(data) < end:
        raise ValueError(f"{what} is {len(data)} bytes but its header describes {S} sequences and {D1 - 1} "
                         f"documents ({end} bytes); the file was cut short")
    lengths = np.frombuffer(data, np.int32, S, 34)
    pointers = np.frombuffer(data, np.int64, S, 34 + 4 * S)
    documents = np.frombuffer(data, np.int64, D1, 34 + 12 * S)
    if D1 == 0 or documents[0] != 0 or documents[-1] != S or np.any(np.diff(documents) < 0):
        raise ValueError(f"{what}: its document indices do not cover the {S} sequences in order; the index is "
                         f"corrupt - write it again")
    return MegatronIndex(path, np.dtype(DTYPES[code]), lengths, pointers, documents)


def load(prefix: Path, vocab_size: int) -> tuple[np.ndarray, MegatronIndex]:
    """(the .bin's tokens, memory-mapped in the index's dtype, and the index), checked against each other and
    the vocabulary."""
    index = read_index(_with(prefix, ".idx"))
    bin_path = _with(prefix, ".bin")
    if not bin_path.is_file():
        raise ValueError(f"data.source: {index.path} has no {bin_path.name} beside it; copy the .bin with its .idx")
    size, itemsize = bin_path.stat().st_size, index.dtype.itemsize
    want = index.num_tokens * itemsize
    if size != want:
        raise ValueError(f"data.source: {bin_path} has {size} bytes, but {index.path.name} describes "
                         f"{index.num_tokens} tokens of {index.dtype} ({want} bytes); the .idx was written for "
                         f"another .bin or another dtype - write them again together")
    expected = np.concatenate([[0], np.cumsum(index.sequence_lengths[:-1], dtype=np.int64)]) * itemsize
    if not np.array_equal(index.sequence_pointers, expected):
        raise ValueError(f"data.source: {index.path} has sequence pointers that are not the sequences back to "
                         f"back; this reader takes contiguous datasets (as IndexedDatasetBuilder writes them)")
    tokens = np.memmap(bin_path, dtype=index.dtype, mode="r") if size else np.zeros(0, index.dtype)
    if tokens.size == 0:
        raise ValueError(f"data.source: {bin_path} holds no tokens")
    low, high = int(tokens.min()), int(tokens.max())  # one pass, once: refuse bad ids before any process starts
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"data.source: {bin_path} holds token id {bad}, outside model.vocab_size = {vocab_size}; "
                         f"use the model the dataset was tokenized for (vocab_size > {high})")
    return tokens, index


class MegatronDocuments(TokenCache):
    """A Megatron dataset's documents in the token cache's shape (what data.packing reads; nothing is copied)."""

    def locate(self, doc: int) -> str:
        return f"document {doc} of {self.meta['source']}"


def documents(prefix: Path, vocab_size: int) -> MegatronDocuments:
    tokens, index = load(prefix, vocab_size)
    offsets = index.document_offsets()
    stat = _with(prefix, ".bin").stat()
    meta = {"key": f"megatron:{prefix}:{stat.st_size}:{stat.st_mtime_ns}", "source": str(prefix)}
    return MegatronDocuments(prefix.parent, meta, tokens, None, offsets, np.maximum(np.diff(offsets) - 1, 0))
