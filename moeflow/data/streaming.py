"""`data.streaming`: a record source read lazily and tokenized ahead of the step, never tokenized up front.

For corpora too large to tokenize into one cache before training. The records are read in order (datasets'
streaming mode for record files, saved datasets and the Hub; text files one at a time), tokenized by
`data.tokenize_workers` processes per rank at most BATCHES_AHEAD record batches per worker ahead of the step
(the bounded buffer), and cut into the windows the up-front path cuts from the same tokens - in the stream's
order: a streamed corpus is not shuffled (shuffle it when it is written, as Megatron-style and datatrove shards
are). Every rank reads the whole stream and keeps its slice of each step's windows (tokenizing costs far less
than a step), so the ranks' rows together are one process's batch under any layout, and so are epochs: the
stream starts again when it ends, its tail shorter than a window left out.

Validation holds out the stream's first `held_out` windows (eval.batches x training.global_batch) and the token
after them, in every epoch: no validation token is ever trained. The position is the training windows
consumed, the epoch, and the record and token where the next window starts, so a resume skips the records
before it unread and untokenized, and continues the same rows under any data-parallel size.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from moeflow.data.records import RecordSource
from moeflow.data.stream import Batch, check_batch_split
from moeflow.data.token_cache import encode_records

RECORDS_PER_BATCH = 512  # records per tokenizer call, as the up-front cache's
BATCHES_AHEAD = 4  # record batches in flight per worker: how far tokenizing runs ahead of the step


def record_batches(src: RecordSource, first: int, max_bytes: int) -> Iterator[dict]:
    """{'text': [...]} batches of the records from record `first` on, read as they are needed."""
    if src.builder == "text":
        from moeflow.data.stream import _read_text, _stdlib_documents

        if src.spec == "stdlib":  # small by construction (data.max_bytes)
            texts: Iterator[str] = iter(_stdlib_documents(max_bytes)[first:])
        else:
            texts = (_read_text(Path(f)) for f in src.files[first:])
        while batch := [t for _, t in zip(range(RECORDS_PER_BATCH), texts)]:
            yield {"text": batch}
        return
    ds = _iterable(src)
    if first:
        ds = ds.skip(first)
    try:
        for batch in ds.iter(batch_size=RECORDS_PER_BATCH):
            if "text" not in batch:
                raise ValueError(f"data.source = {src.spec!r}: record {first} has no 'text' field (the records have "
                                 f"{sorted(batch)}); data.streaming reads data.format = 'text'")
            yield {"text": batch["text"]}
            first += len(batch["text"])
    except ValueError:
        raise
    except Exception as e:  # datasets' many kinds of unreadable input, met mid-stream
        raise ValueError(f"data.source = {src.spec!r}: cannot read record {first} on "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); check the files"
                         ) from None


def _iterable(src: RecordSource):
    import datasets

    datasets.disable_progress_bars()
    if src.builder == "hub":
        try:
            return datasets.load_dataset(src.hub_name, split=src.split, streaming=True)
        except Exception as e:
            raise ValueError(f"data.source = {src.spec!r}: cannot stream {src.hub_name!r} split {src.split!r} from "
                             f"the Hugging Face Hub ({type(e).__name__}); check the name and the network") from None
    if src.builder == "saved":
        ds = datasets.load_from_disk(src.files[0])
        return (ds["train"] if isinstance(ds, datasets.DatasetDict) else ds).to_iterable_dataset()
    return datasets.load_dataset(src.builder, data_files=src.files, split="train", streaming=True)


def documents(src: RecordSource, encoder, first: int, workers: int, max_bytes: int
              ) -> Iterator[tuple[int, np.ndarray]]:
    """(record index, its token ids) from record `first` on, in order: encoded here (workers = 0) or by
    `workers` processes, at most BATCHES_AHEAD batches each ahead of what was taken."""
    batches = record_batches(src, first, max_bytes)
    if workers <= 0:
        encoded = ((start, encode_records(b, start, encoder)) for start, b in _numbered(batches, first))
        yield from _split(src, encoded)
        return
    # spawned, not forked: a rank's process group has threads that a fork would copy mid-flight
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # each worker one thread: the processes are the split
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_hold, initargs=(encoder,)) as pool:
        numbered, pending = _numbered(batches, first), deque()

        def submit() -> None:
            for start, b in numbered:
                pending.append((start, pool.apply_async(encode_records, (b, start))))
                if len(pending) >= workers * BATCHES_AHEAD:
                    return

        submit()
        while pending:
            start, result = pending.popleft()
            submit()
            yield from _split(src, [(start, result.get())])


def _hold(encoder) -> None:
    from moeflow.data import token_cache

    token_cache._WORK["encoder"] = encoder


def _numbered(batches: Iterator[dict], first: int) -> Iterator[tuple[int, dict]]:
    for b in batches:
        yield first, b
        first += len(b["text"])


def _split(src: RecordSource, encoded) -> Iterator[tuple[int, np.ndarray]]:
    for start, result in encoded:
        if len(result) == 2:  # (record index, what is wrong with it)
            raise ValueError(f"data.source = {src.spec!r}: {src.locate(result[0])} {result[1]}")
        ids_N, lengths_D = result[0], result[1]
        for i, doc in enumerate(np.split(ids_N, np.cumsum(lengths_D)[:-1])):
            yield start + i, doc


class StreamingSampler:
    """BatchSampler's interface over `open_documents(first record)` (moeflow.data.streaming.documents): each
    step's `global_batch` windows in stream order, rank r taking the contiguous slice [r * B / dp_size,
    (r + 1) * B / dp_size)."""

    def __init__(self, open_documents: Callable[[int], Iterator[tuple[int, np.ndarray]]], key: str, seq_len: int,
                 global_batch: int, dp_rank: int = 0, dp_size: int = 1, held_out: int = 0, vocab_size: int = 0):
        check_batch_split(seq_len, global_batch, dp_rank, dp_size)
        self.open_documents, self.key, self.seq_len, self.global_batch = open_documents, key, seq_len, global_batch
        self.dp_rank, self.local_batch = dp_rank, global_batch // dp_size
        self.held_out, self.vocab_size = held_out, vocab_size
        self.first_token = held_out * seq_len + 1 if held_out else 0  # of every epoch's training windows
        self.step, self.consumed, self.epoch = 0, 0, 0
        self._open(0, self.first_token)
        if not self._fill(self._pos + seq_len + 1):
            raise ValueError(f"data.streaming: the stream holds {self._end} tokens, fewer than the "
                             f"{self._pos + seq_len + 1} of the {held_out} held-out validation windows and one "
                             f"training window of data.seq_len + 1; use more data, a shorter sequence or fewer "
                             f"eval.batches")

    def held_out_tokens(self) -> np.ndarray:
        """The validation windows' tokens: the stream's first held_out * seq_len + 1 (read again from the start)."""
        parts, have = [], 0
        documents = self.open_documents(0)
        try:
            for _, ids in documents:
                if have >= self.first_token:
                    break
                parts.append(ids[:self.first_token - have])
                have += len(parts[-1])
        finally:
            documents.close()  # its worker processes end here, not when it is collected
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)

    def close(self) -> None:
        """End the reader (and its worker processes) of a sampler that will not be stepped."""
        self._documents.close()

    def _open(self, record: int, skip: int) -> None:
        """Read from the start of `record` on; the next window starts `skip` tokens into it."""
        self._documents = self.open_documents(record)
        self._tokens, self._base, self._end = np.zeros(0, dtype=np.uint32), 0, 0  # tokens [base, end) held
        self._starts: list[tuple[int, int]] = []  # (record, where its tokens start) of the records held
        self._pos = skip
        self._trained_this_epoch = 0

    def _fill(self, need: int) -> bool:
        """Read records until the tokens before `need` are held; False when the stream ends first."""
        new = []
        while self._end < need:
            doc = next(self._documents, None)
            if doc is None:
                break
            record, ids = doc
            if self.vocab_size and len(ids) and int(ids.max()) >= self.vocab_size:
                raise ValueError(f"data.streaming: record {record} holds token id {int(ids.max())} but "
                                 f"model.vocab_size is {self.vocab_size}; raise model.vocab_size")
            self._starts.append((record, self._end))
            new.append(ids)
            self._end += len(ids)
        if new:
            self._tokens = np.concatenate([self._tokens, *new])
        return self._end >= need

    def _window(self) -> np.ndarray:
        need = self._pos + self.seq_len + 1
        if not self._fill(need):  # the epoch ends: the stream again from its start
            if not self._trained_this_epoch:
                raise ValueError("data.streaming: the stream gave no training window; use more data")
            self.epoch += 1
            self._open(0, self.first_token)
            need = self._pos + self.seq_len + 1
            self._fill(need)
        window = self._tokens[self._pos - self._base:need - self._base]
        self._pos += self.seq_len
        self._trained_this_epoch += 1
        return window

    def _drop_read(self) -> None:
        """Forget the tokens and records before the next window's start."""
        self._tokens = self._tokens[self._pos - self._base:].copy()
        self._base = self._pos
        keep = max(i for i, (_, start) in enumerate(self._starts) if start <= self._pos)
        self._starts = self._starts[keep:]

    def next_batch(self) -> Batch:
        windows = [self._window() for _ in range(self.global_batch)]
        lo = self.dp_rank * self.local_batch
        rows = np.stack(windows[lo:lo + self.local_batch]).astype(np.int64)
        self._drop_read()
        self.consumed += self.global_batch
        self.step += 1
        return Batch(torch.from_numpy(np.ascontiguousarray(rows[:, :-1])),
                     torch.from_numpy(np.ascontiguousarray(rows[:, 1:])),
                     global_tokens=self.global_batch * self.seq_len)

    def state_dict(self) -> dict:
        """Plain ints: the position (the record and token the next window starts at) and what must match."""
        self._fill(self._pos + 1)
        record, start = next((r, s) for r, s in reversed(self._starts) if s <= self._pos)
        return {"step": self.step, "consumed": self.consumed, "epoch": self.epoch, "record": record,
                "offset": self._pos - start, "trained_this_epoch": self._trained_this_epoch,
                "seq_len": self.seq_len, "held_out": self.held_out, "data": self.key}

    def load_state_dict(self, sd: dict) -> None:
        mine = {"data": self.key, "seq_len": self.seq_len, "held_out": self.held_out}
        for key, name in (("data", "the data (source and tokenizer)"), ("seq_len", "data.seq_len"),
                          ("held_out", "the held-out validation windows (eval.batches x training.global_batch)")):
            if sd.get(key) != mine[key]:
                raise ValueError(f"cannot resume the streamed data: {name} was {sd.get(key)!r} in the checkpoint but "
                                 f"is {mine[key]!r} now; resume with the same settings, or start a new run directory")
        self.step, self.consumed, self.epoch = int(sd["step"]), int(sd["consumed"]), int(sd["epoch"])
        self._open(int(sd["record"]), int(sd["offset"]))
        self._trained_this_epoch = int(sd["trained_this_epoch"])
