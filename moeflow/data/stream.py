"""Training data: corpora -> one token stream -> train/val split -> a resumable, rank-sharded batch sampler.

The stream is a 1-D numpy array of token ids. A *window* is `seq_len + 1` consecutive tokens starting at a
multiple of `seq_len` (neighbouring windows share one token: the last target of one is the first input of the
next). Inputs are a window's first `seq_len` tokens, targets its last `seq_len`. Whole documents (chat, packing)
are the other kind of sequence the sampler draws (moeflow.data.packing); both give the sampler a count of
sequences, a way to gather some, and how many targets a set of them trains.

The sampler's position is a single count of sequences consumed by all ranks together, and the order of sequences
depends only on (seed, epoch). So a batch is a pure function of (seed, consumed, rank): resuming needs only
that count, and the union of the ranks' batches for a step is exactly the batch a single process would see.
Each batch also carries the number of trained targets in the whole global batch, which normalises the loss.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from moeflow.data.tokenizer import ByteTokenizer

TEXT_SUFFIXES = (".txt", ".md", ".py")
IGNORE_INDEX = -100  # a target that is not trained (prompt, padding, across documents): cross-entropy skips it
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SOURCES_HINT = (
    "Give 'stdlib', a text file, a folder of .txt/.md/.py files, a .jsonl file with a 'text' field, "
    "or a .bin file of token ids"
)


# ----------------------------------------------------------------------------------------------------------
# Reading documents
# ----------------------------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    # Tolerate stray non-UTF-8 bytes (some corpora and a few stdlib test files have them) rather than fail.
    return path.read_text(encoding="utf-8", errors="replace")


def stdlib_files() -> list[Path]:
    """The .py files of the running Python's standard library, sorted by path relative to its root.

    Sorting the relative path (not the absolute one) keeps the order the same whatever the install prefix.
    site-packages is excluded: what is installed there differs between machines.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune rather than filter afterwards: site-packages can hold far more files than the stdlib.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        rel_dir = Path(dirpath).relative_to(root)
        rels.extend(rel_dir / name for name in filenames if name.endswith(".py"))
    return [root / rel for rel in sorted(rels, key=lambda p: p.as_posix())]


def _stdlib_documents(max_bytes: int) -> list[str]:
    """Standard-library sources, whole files in order, the last cut so the total is `max_bytes` of UTF-8."""
    docs: list[str] = []
    remaining = max_bytes
    for path in stdlib_files():
        if remaining <= 0:
            break
        try:
            data = path.read_bytes()
        except OSError:  # an unreadable file (permissions, broken link) is skipped, not fatal
            continue
        if not data:
            continue
        data = data[:remaining]
        remaining -= len(data)
        # 'ignore' drops a multi-byte character cut in half by the cap instead of adding a replacement char.
        docs.append(data.decode("utf-8", errors="ignore"))
    return docs


def _folder_documents(folder: Path) -> list[str]:
    files = sorted(
        (p for p in folder.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()),
        key=lambda p: p.relative_to(folder).as_posix(),
    )
    # Hidden folders (.git, .venv, ...) are not part of anyone's corpus.
    files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(folder).parts[:-1])]
    if not files:
        raise ValueError(
            f"data.source = {str(folder)!r}: the folder has no {'/'.join(TEXT_SUFFIXES)} files. "
            f"Add text files to it or point data.source at another corpus. {_SOURCES_HINT}."
        )
    return [_read_text(p) for p in files]


def _jsonl_documents(path: Path) -> list[str]:
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"data.source = {str(path)!r}: line {lineno} is not valid JSON ({exc.msg}). "
                    "Each line must be a JSON object with a 'text' field."
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(
                    f"data.source = {str(path)!r}: line {lineno} has no string 'text' field. "
                    "Each line must be a JSON object like {\"text\": \"...\"}; fix or remove that line."
                )
            docs.append(record["text"])
    return docs


# ----------------------------------------------------------------------------------------------------------
# Tokens
# ----------------------------------------------------------------------------------------------------------


def _encode_documents(docs: Sequence[str], tokenizer) -> np.ndarray:
    """Encode documents and join them with the tokenizer's eos id between them (nothing if it has none)."""
    eos = getattr(tokenizer, "eos_id", None)
    if isinstance(tokenizer, ByteTokenizer):
        # Fast path: the encoding is the UTF-8 bytes themselves, so skip building Python int lists.
        sep = b"" if eos is None else bytes([eos])
        return np.frombuffer(sep.join(d.encode("utf-8") for d in docs), dtype=np.uint8).astype(np.int64)
    if hasattr(tokenizer, "encode_batch"):
        encoded = tokenizer.encode_batch(list(docs))
    else:
        encoded = [tokenizer.encode(d) for d in docs]
    pieces = []
    for i, ids in enumerate(encoded):
        if i > 0 and eos is not None:
            pieces.append(np.array([eos], dtype=np.int64))
        pieces.append(np.asarray(ids, dtype=np.int64))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def _load_bin(path: Path, token_dtype: str, vocab_size: int) -> np.ndarray:
    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(
            f"data.token_dtype = {token_dtype!r} is not one of {list(TOKEN_DTYPES)}. "
            "Use the integer type the .bin file was written with."
        )
    dtype = np.dtype(TOKEN_DTYPES[token_dtype])
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"data.source = {str(path)!r}: the file is empty. Point data.source at token data.")
    if size % dtype.itemsize:
        raise ValueError(
            f"data.source = {str(path)!r}: its size ({size} bytes) is not a multiple of {dtype.itemsize}, "
            f"the size of data.token_dtype = {token_dtype!r}. Check data.token_dtype (uint16 = 2 bytes, "
            "uint32 = 4 bytes) or whether the file was cut short."
        )
    # memmap: a large pre-tokenized corpus is paged in as windows are read, not loaded whole.
    tokens = np.memmap(path, dtype=dtype, mode="r")
    max_id = int(tokens.max())  # one pass over the file, once, to refuse out-of-vocabulary ids up front
    if max_id >= vocab_size:
        other = "uint16" if token_dtype == "uint32" else "uint32"
        raise ValueError(
            f"data.source = {str(path)!r}: read as data.token_dtype = {token_dtype!r} it holds token id "
            f"{max_id}, but model.vocab_size = {vocab_size}. If the file was written as {other}, set "
            f"data.token_dtype = '{other}'; otherwise use a model with model.vocab_size > {max_id}."
        )
    return tokens


def load_tokens(
    source: str,
    tokenizer,
    *,
    token_dtype: str = "uint16",
    vocab_size: int,
    max_bytes: int = 4_000_000,
) -> np.ndarray:
    """Load the corpus named by `source` (the `data.source` setting) as one 1-D array of token ids.

    source:
      'stdlib'        the running Python's standard-library .py files, sorted, at most `max_bytes` of text
      a .bin file     pre-tokenized ids (`token_dtype` 'uint16' or 'uint32'), memory-mapped; no tokenizer
      a .jsonl file   one JSON object per line with a 'text' field; each is a document
      a folder        all .txt/.md/.py files below it (hidden folders skipped), sorted; each is a document
      any other file  read as one UTF-8 text document
    Documents are joined with `tokenizer.eos_id` between them (nothing, if the tokenizer has no eos).
    `max_bytes` caps only the stdlib corpus; a user's own corpus is used whole.
    Returns int64 ids for text sources, the file's dtype for .bin. Raises ValueError on bad input.
    """
    if source == "stdlib":
        docs = _stdlib_documents(max_bytes)
        what = "the standard-library corpus"
    else:
        path = Path(source)
        if not path.exists():
            raise ValueError(f"data.source = {source!r}: no such file or folder. {_SOURCES_HINT}.")
        if path.is_file() and path.suffix == ".bin":
            return _load_bin(path, token_dtype, vocab_size)
        if path.is_dir():
            docs = _folder_documents(path)
        elif path.suffix == ".jsonl":
            docs = _jsonl_documents(path)
        else:
            docs = [_read_text(path)]
        what = repr(source)
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"data.source = {source!r}: {what} contains no text. {_SOURCES_HINT}.")
    if tokenizer is None:
        raise ValueError(f"data.source = {source!r} is text and needs a tokenizer; set data.tokenizer.")
    tokens = _encode_documents(docs, tokenizer)
    if tokens.size == 0:
        raise ValueError(f"data.source = {source!r}: the tokenizer produced no tokens from {what}.")
    max_id = int(tokens.max())
    if max_id >= vocab_size:
        raise ValueError(
            f"data.tokenizer produced token id {max_id} (its vocab_size is {tokenizer.vocab_size}) but "
            f"model.vocab_size = {vocab_size}. Set model.vocab_size to at least {tokenizer.vocab_size}."
        )
    return tokens


def split_tokens(tokens: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Hold out the last `val_fraction` of the stream (a contiguous tail) for validation.

    A tail, not random windows, so no validation token ever appears in a training window.
    val_fraction = 0 gives an empty validation set (validation off). Both non-empty sides must hold at least
    one window (`seq_len + 1` tokens).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction = {val_fraction!r} must be in [0, 1); 0.05 is a common choice.")
    n = len(tokens)
    n_val = int(n * val_fraction)
    train, val = tokens[: n - n_val], tokens[n - n_val :]
    need = seq_len + 1
    if len(train) < need:
        raise ValueError(
            f"the training split has {len(train)} tokens, fewer than seq_len + 1 = {need} "
            f"(corpus {n} tokens, data.val_fraction = {val_fraction}). Use a larger corpus, a smaller "
            "data.val_fraction or a shorter sequence length."
        )
    if val_fraction > 0 and len(val) < need:
        raise ValueError(
            f"the validation split has {len(val)} tokens, fewer than seq_len + 1 = {need} "
            f"(corpus {n} tokens, data.val_fraction = {val_fraction}). Raise data.val_fraction, use a "
            "larger corpus or a shorter sequence length, or set data.val_fraction = 0 to skip validation."
        )
    return train, val


# ----------------------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """One rank's rows of a step. inputs / targets [B, S] (targets IGNORE_INDEX where nothing is trained);
    positions / document_ids [B, S] only for packed documents (RoPE positions restart, attention stays inside a
    document); global_tokens: trained targets in the whole global batch (every rank's rows)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    global_tokens: int = 0

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """What the model takes besides the tokens (nothing for plain causal rows)."""
        return {k: v for k, v in (("positions", self.positions), ("document_ids", self.document_ids))
                if v is not None}

    def to(self, device) -> Batch:
        # To a GPU from pinned memory, asynchronously: a copy from pageable memory waits for the GPU's queued work
        # (the previous step's optimizer), so the host could not prepare this step meanwhile.
        cuda = torch.device(device).type == "cuda"
        move = (lambda t: t.pin_memory().to(device, non_blocking=True)) if cuda else (lambda t: t.to(device))
        return replace(self, **{k: move(getattr(self, k)) for k in ("inputs", "targets", *self.model_kwargs())})

    def map(self, fn) -> Batch:
        """`fn` applied to every [B, S] tensor (e.g. ParallelState.local_sequence: a rank's part of each row)."""
        return replace(self, **{k: fn(getattr(self, k)) for k in ("inputs", "targets", *self.model_kwargs())})

    def rows(self, lo: int, hi: int) -> Batch:
        cut = {k: getattr(self, k)[lo:hi] for k in ("inputs", "targets", *self.model_kwargs())}
        return replace(self, **cut)


class TokenWindows:
    """The token stream's windows as sequences: every target is trained."""

    def __init__(self, tokens: np.ndarray, seq_len: int, key: str | None = None):
        self.tokens, self.seq_len = tokens, seq_len
        self.num_sequences = num_windows(len(tokens), seq_len)
        self.key = key  # the token cache's key; None for a stream read directly (its window count identifies it)

    def gather(self, ids: np.ndarray) -> Batch:
        return Batch(*_gather_windows(self.tokens, ids, self.seq_len))

    def trained_tokens(self, ids: np.ndarray) -> int:
        return len(ids) * self.seq_len


def _gather_windows(tokens: np.ndarray, window_ids: np.ndarray, seq_len: int) -> tuple[torch.Tensor, ...]:
    """(inputs, targets) LongTensors [len(window_ids), seq_len] for the given window indices."""
    rows = np.stack([tokens[w * seq_len : w * seq_len + seq_len + 1] for w in window_ids.tolist()])
    rows = rows.astype(np.int64)
    inputs, targets = np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many windows of seq_len + 1 tokens, starting at multiples of seq_len, fit in num_tokens."""
    return max(0, (num_tokens - 1) // seq_len)


def check_batch_split(seq_len: int, global_batch: int, dp_rank: int, dp_size: int) -> None:
    """A sequence length and a global batch every data-parallel rank can take its equal share of."""
    if seq_len < 1:
        raise ValueError(f"seq_len = {seq_len} must be at least 1.")
    if global_batch < 1:
        raise ValueError(f"training.global_batch = {global_batch} must be at least 1.")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} is outside [0, {dp_size}); this is a launch bug.")
    if global_batch % dp_size:
        lower = global_batch // dp_size * dp_size
        fits = " or ".join(str(b) for b in (lower, lower + dp_size) if b > 0)
        raise ValueError(
            f"training.global_batch = {global_batch} is not divisible by the data-parallel size "
            f"(parallel data size = {dp_size}); every rank needs the same number of sequences. "
            f"Choose training.global_batch = {fits} (a multiple of {dp_size}), or change the "
            "data-parallel size."
        )


class BatchSampler:
    """Shuffled training sequences, epoch after epoch, each step's `global_batch` split across DP ranks.

    `data` is a token stream (its windows are the sequences) or a sequence source (moeflow.data.packing).
    Epoch e visits every sequence once in the order `default_rng(seed + e).permutation(num_windows)`; steps
    take `global_batch` sequences at a time from the concatenation of the epochs (a step may straddle two).
    Rank r takes the contiguous slice [r * B / dp_size, (r + 1) * B / dp_size) of its step's sequences.
    """

    def __init__(self, data, seq_len: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0):
        check_batch_split(seq_len, global_batch, dp_rank, dp_size)
        self.source = TokenWindows(data, seq_len) if isinstance(data, np.ndarray) else data
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = int(seed)
        self.local_batch = global_batch // dp_size
        self.num_windows = self.source.num_sequences  # (the name predates document sequences)
        if self.num_windows < 1:
            if isinstance(data, np.ndarray):
                raise ValueError(
                    f"the training data has {len(data)} tokens, fewer than seq_len + 1 = {seq_len + 1}. "
                    "Use a larger corpus or a shorter sequence length."
                )
            raise ValueError("the training split holds no sequence with a trained token; add data or lower "
                             "data.val_fraction")
        self.step = 0  # next_batch calls so far
        self.consumed = 0  # windows consumed by all ranks together: the sampler's whole position
        self._perms: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self.consumed // self.num_windows

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a step touches at most a few epochs; keep memory bounded
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng(self.seed + epoch).permutation(self.num_windows)
        return self._perms[epoch]

    def window_ids(self, start: int, count: int) -> np.ndarray:
        """Window indices at global stream positions [start, start + count)."""
        pos = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = pos // self.num_windows, pos % self.num_windows
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs).tolist():
            mask = epochs == e
            out[mask] = self._perm(e)[offsets[mask]]
        return out

    def next_batch(self) -> Batch:
        """This rank's rows, [global_batch // dp_size, seq_len] each, and the global batch's trained-token count
        (computed here from the sequence ids, so it costs no communication)."""
        start = self.consumed + self.dp_rank * self.local_batch
        batch = self.source.gather(self.window_ids(start, self.local_batch))
        batch.global_tokens = self.source.trained_tokens(self.window_ids(self.consumed, self.global_batch))
        self.consumed += self.global_batch
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        """Plain ints: the position plus what must match for a resume to continue the same stream."""
        return {
            "step": self.step,
            "seed": self.seed,
            "consumed": self.consumed,
            "num_windows": self.num_windows,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "data": self.source.key,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Continue from a saved position. The seed and the data (window count, seq_len) must be unchanged;
        global_batch and the data-parallel size may change, the stream continues where it stopped."""
        if sd.get("data") != self.source.key:  # first: it names what changed (source, tokenizer, format, packing)
            raise ValueError(
                f"cannot resume the data sampler: the checkpoint's data was {sd.get('data')!r} but this run's is "
                f"{self.source.key!r} (another source, tokenizer, format or packing). Resume with the same data "
                "settings, or start a new run directory."
            )
        checks = (("seed", "training.seed", self.seed), ("seq_len", "the sequence length", self.seq_len),
                  ("num_windows", "the number of training windows", self.num_windows))
        for key, name, mine in checks:
            if int(sd[key]) != mine:
                raise ValueError(
                    f"cannot resume the data sampler: {name} was {int(sd[key])} in the checkpoint but is "
                    f"{mine} now. Resume with the same data and settings, or start a new run directory."
                )
        self.step = int(sd["step"])
        self.consumed = int(sd["consumed"])


def val_batches(
    val_data, seq_len: int, batch: int, max_batches: int | None = None
) -> list[Batch]:
    """Validation batches: the windows in stream order (or the sequences of a sequence source in order), `batch`
    per batch, at most `max_batches` batches.

    No shuffling and no rank dependence, so every rank and every evaluation sees the same list. Only full
    batches are returned; when the set holds fewer than `batch` sequences, one batch of all of them. Empty
    validation data give an empty list.
    """
    source = TokenWindows(val_data, seq_len) if isinstance(val_data, np.ndarray) else val_data
    n = source.num_sequences
    if n == 0:
        return []
    batch = min(batch, n)
    count = n // batch
    if max_batches is not None:
        count = min(count, max_batches)
    ids = np.arange(count * batch, dtype=np.int64)
    out = []
    for i in range(count):
        part = ids[i * batch : (i + 1) * batch]
        out.append(replace(source.gather(part), global_tokens=source.trained_tokens(part)))
    return out
