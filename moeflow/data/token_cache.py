"""Tokenize a record source once, into a cache folder that every later run and every rank memory-maps.

A cache folder (under data.cache_dir, default RUN_DIR/data-cache) is named by a key hashed from the source's
files (sizes and modification times), the tokenizer (its serialised form and chat template) and the settings
that change the tokens (data.format). It holds:

  tokens.bin       uint32, all documents back to back
  trained.bin      uint8 per token, 1 = trained when it is a target (chat / instruction formats only)
  offsets.bin      int64 [documents + 1], where each document starts in tokens.bin
  doc_trained.bin  int64 [documents], each document's trained targets (its tokens after the first)
  meta.json        the key, the source (files, records per file), the tokenizer, counts

Rank 0 (or the launcher, before any rank starts) writes it into a temporary folder and renames it, so a folder
that exists is complete; the others wait and open it (over several nodes the ranks write it together:
moeflow/data/token_share.py). Document i is record i of the source (1:1), so a record
can still be located by file and line when a later step refuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeflow.data.chat import RecordError, check_messages, encode_chat, instruction_to_messages
from moeflow.data.records import RecordSource, load

CACHE_VERSION = 1
META = "meta.json"
FORMATS = ("text", "chat", "instruction")
_BATCH = 512  # records per tokenizer call


# ---- encoders: records -> (ids, trained mask or None) ---------------------------------------------------------


class TextEncoder:
    """The 'text' field of each record, then the tokenizer's end-of-document id (when it has one)."""

    format = "text"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.name = getattr(tokenizer, "name", type(tokenizer).__name__)
        inner = getattr(tokenizer, "_tok", None)  # moeflow.data.tokenizer.HFTokenizer wraps a tokenizers.Tokenizer
        serialised = inner.to_str() if inner is not None else self.name
        self.fingerprint = hashlib.sha256(serialised.encode()).hexdigest()[:16]
        self.vocab_size = tokenizer.vocab_size
        self.columns = ("text",)

    def encode(self, batch: dict, first: int) -> list[tuple[list[int], None]]:
        texts = batch["text"]
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise _at(first + i, RecordError("has no string 'text' field; give every record a 'text' string "
                                                 "(or choose data.format = 'chat' / 'instruction')"))
        eos = self.tokenizer.eos_id
        encoded = self.tokenizer.encode_batch(texts)
        return [(list(ids) + ([eos] if eos is not None else []), None) for ids in encoded]


class ChatEncoder:
    """A 'messages' list (format 'chat') or instruction/input/output fields (format 'instruction') rendered with
    the tokenizer's chat template; only assistant tokens are trained."""

    def __init__(self, tokenizer, fmt: str, template_source: str = ""):
        self.tokenizer, self.format = tokenizer, fmt
        self.name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        serialised = tokenizer.backend_tokenizer.to_str() + "\n" + tokenizer.chat_template
        self.fingerprint = hashlib.sha256(serialised.encode()).hexdigest()[:16]
        self.vocab_size = len(tokenizer)
        self.columns = ("messages",) if fmt == "chat" else ("instruction", "output")

    def encode(self, batch: dict, first: int) -> list[tuple[list[int], list[int]]]:
        n = len(next(iter(batch.values())))
        out = []
        for i in range(n):
            try:
                if self.format == "chat":
                    messages = check_messages(batch["messages"][i])
                else:
                    messages = instruction_to_messages({k: v[i] for k, v in batch.items()})
                out.append(encode_chat(self.tokenizer, messages))
            except RecordError as e:
                raise _at(first + i, e) from None
            except Exception as e:  # the template's own refusals (jinja2's raise_exception) and rendering errors
                raise _at(first + i, RecordError(f"the chat template failed on it ({type(e).__name__}: {e}); fix "
                                                 f"the record, or the template")) from None
        return out


class _Located(ValueError):
    def __init__(self, index: int, what: str):
        super().__init__(what)
        self.index, self.what = index, what


def _at(index: int, error: RecordError) -> _Located:
    return _Located(index, str(error))


# ---- the cache --------------------------------------------------------------------------------------------------


@dataclass
class TokenCache:
    folder: Path
    meta: dict
    tokens: np.ndarray  # uint32 memmap
    trained: np.ndarray | None  # uint8 memmap, None = every token trained
    offsets: np.ndarray  # int64 [documents + 1]
    doc_trained: np.ndarray  # int64 [documents]

    @property
    def key(self) -> str:
        return self.meta["key"]

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    def locate(self, doc: int) -> str:
        from moeflow.data.records import locate

        return locate(self.meta["source"], doc)


def cache_key(src: RecordSource, encoder, max_bytes: int) -> str:
    settings = {"version": CACHE_VERSION, "source": src.fingerprint(), "tokenizer": encoder.fingerprint,
                "format": encoder.format, "max_bytes": max_bytes if src.spec == "stdlib" else None}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    stem = Path(src.hub_name or src.spec).stem.replace("/", "_")[:40] or "data"
    return f"{stem}-{encoder.format}-{digest}"


def is_cache_folder(path: str) -> bool:
    return Path(path, META).is_file() and Path(path, "tokens.bin").is_file()


def write_cache(src: RecordSource, encoder, root: Path, *, max_bytes: int = 4_000_000,
                progress: bool | None = None, workers: int = 1) -> Path:
    """The cache folder for (src, encoder), tokenizing the records first if it does not exist yet, in `workers`
    processes (the same bytes for any number: the batches are written in record order). The ranks of a job over
    several nodes write it together instead: moeflow/data/token_share.py."""
    key = cache_key(src, encoder, max_bytes)
    folder = Path(root) / key
    if (folder / META).is_file():
        return folder
    tmp = Path(root) / f".{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        meta = _tokenize(src, encoder, tmp, key, max_bytes, progress, workers)
        commit(tmp, folder, meta, [tmp / "hf"])  # (datasets' Arrow copies of the local files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def commit(tmp: Path, folder: Path, meta: dict, scratch: list[Path]) -> None:
    """The meta into `tmp`, its `scratch` removed, and `tmp` renamed to `folder`: a cache folder that exists is
    complete."""
    (tmp / META).write_text(json.dumps(meta, indent=1))
    for path in scratch:
        shutil.rmtree(path, ignore_errors=True)
    try:
        os.rename(tmp, folder)
    except OSError:  # another process finished the same cache first; theirs is as good
        if not (folder / META).is_file():
            raise


# A forked worker's view of the job: the records and the encoder (inherited, not pickled).
_WORK: dict = {}


def _encode_batch(start: int, ds=None, encoder=None):
    """Records [start, start + _BATCH) of the dataset, encoded (encode_records)."""
    ds, encoder = ds if ds is not None else _WORK["ds"], encoder or _WORK["encoder"]
    return encode_records(ds[start:start + _BATCH], start, encoder)


def encode_records(records: dict, start: int, encoder=None):
    """A batch of records (columns of lists; the first is record `start`) encoded as arrays (what crosses cheaply
    from a worker): ids uint32, lengths and trained targets per document int64, masks uint8 (None for text); or
    (the record index, what is wrong) for a bad record."""
    encoder = encoder or _WORK["encoder"]
    try:
        docs = encoder.encode(records, start)
    except _Located as e:
        return (e.index, e.what)
    ids = np.concatenate([np.asarray(d, dtype=np.uint32) for d, _ in docs]) if docs else np.zeros(0, np.uint32)
    lengths = np.array([len(d) for d, _ in docs], dtype=np.int64)
    if docs and docs[0][1] is not None:  # trained targets: the mask past each document's first token
        masks = np.concatenate([np.asarray(mask, dtype=np.uint8) for _, mask in docs])
        trained = np.array([sum(mask[1:]) for _, mask in docs], dtype=np.int64)
    else:
        masks, trained = None, np.maximum(lengths - 1, 0)
    return ids, lengths, masks, trained


def _encoded_batches(ds, encoder, workers: int):
    """Each batch's encoded documents and its record count (the progress), in record order: in this process, or
    in `workers` forked ones."""
    starts = range(0, len(ds), _BATCH)
    for encoded in _in_workers(_encode_batch, starts, workers, ds=ds, encoder=encoder):
        yield encoded, len(encoded[1]) if len(encoded) == 4 else 0


def _in_workers(fn, items, workers: int, **work):
    """fn(item) for each item, in order: here, or in `workers` forked processes that inherit `work`."""
    if workers <= 1 or len(items) < 2:
        _WORK.update(work)
        try:
            yield from map(fn, items)
        finally:
            _WORK.clear()
        return
    import multiprocessing

    _WORK.update(work)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # each worker one thread: the processes are the split
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            yield from pool.imap(fn, items)
    finally:
        _WORK.clear()


# ---- plain text jsonl: read by the workers themselves -----------------------------------------------------------
# `datasets` copies a json file into Arrow before a record can be read (about a tenth of the tokenizing time); the
# common case - jsonl files whose every line is an object with a string 'text' - needs none of it: the workers read
# byte ranges of the files, cut at line ends. The records and so the cache are the same; anything else (a bad line,
# a record without its text) makes the general path below read the files again and name what is wrong.
_CHUNK_BYTES = 8 << 20


class _NotPlain(Exception):
    pass


def _is_plain_jsonl(src: RecordSource, encoder) -> bool:
    return encoder.format == "text" and src.builder == "json" and all(f.endswith(".jsonl") for f in src.files)


def _jsonl_chunks(files: list[str]) -> list[tuple[int, int, int]]:
    """(file index, first byte, end byte) of about _CHUNK_BYTES each, ending at a line end."""
    chunks = []
    for i, f in enumerate(files):
        size, start = os.path.getsize(f), 0
        with open(f, "rb") as fh:
            while start < size:
                fh.seek(min(start + _CHUNK_BYTES, size))
                fh.readline()
                end = min(fh.tell(), size)
                chunks.append((i, start, end))
                start = end
    return chunks


def _encode_jsonl_chunk(chunk: tuple[int, int, int]):
    """The chunk's records encoded (as _encode_batch) with its record count, or None if a line is not plain."""
    i, start, end = chunk
    with open(_WORK["files"][i], "rb") as fh:
        fh.seek(start)
        lines = fh.read(end - start).split(b"\n")
    texts = []
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            return None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            return None
        texts.append(text)
    return encode_records({"text": texts}, 0), len(texts)


def _jsonl_batches(src: RecordSource, encoder, workers: int, counts: list[int]):
    chunks = _jsonl_chunks(src.files)
    for chunk, result in zip(chunks, _in_workers(_encode_jsonl_chunk, chunks, workers, files=src.files,
                                                 encoder=encoder)):
        if result is None:
            raise _NotPlain
        counts[chunk[0]] += result[1]
        yield result[0], chunk[2] - chunk[1]


def _tokenize(src: RecordSource, encoder, out: Path, key: str, max_bytes: int, progress, workers: int = 1) -> dict:
    if _is_plain_jsonl(src, encoder):
        counts = [0] * len(src.files)
        total = sum(os.path.getsize(f) for f in src.files)
        try:
            meta = _write_tokens(src, encoder, out, key, _jsonl_batches(src, encoder, workers, counts), total, "B",
                                 progress)
        except _NotPlain:
            pass  # the general path reads the records again and says which is not a plain text record
        else:
            src.counts = counts
            meta["source"] = src.describe()
            return meta
    ds = _load_checked(src, encoder, out, max_bytes)
    return _write_tokens(src, encoder, out, key, _encoded_batches(ds, encoder, workers), len(ds), "rec", progress)


def _load_checked(src: RecordSource, encoder, work_dir: Path, max_bytes: int):
    """The records (records.load), with the columns the encoder reads; ValueError naming what is missing."""
    spec = src.spec
    ds = load(src, work_dir, max_bytes)
    if len(ds) == 0:
        raise ValueError(f"data.source = {spec!r} holds no records; point it at a non-empty dataset")
    missing = [c for c in encoder.columns if c not in ds.column_names]
    if missing:
        hint = {"text": "data.format = 'text' reads 'text'", "chat": "data.format = 'chat' reads 'messages'",
                "instruction": "data.format = 'instruction' reads 'instruction', 'input' and 'output'"}
        other = next((f for f, cols in (("chat", ["messages"]), ("instruction", ["instruction", "output"]),
                                        ("text", ["text"])) if all(c in ds.column_names for c in cols)), None)
        fix = f"set data.format = '{other}'" if other else "rename the field in the data"
        raise ValueError(f"data.source = {spec!r}: {src.locate(0)} has no {missing[0]!r} field (the records have "
                         f"{ds.column_names}); {hint[encoder.format]}: {fix}")
    return ds.select_columns([c for c in ds.column_names if c in (*encoder.columns, "input", "system")])


def _write_tokens(src: RecordSource, encoder, out: Path, key: str, batches, total: int, unit: str, progress) -> dict:
    """tokens.bin, trained.bin, offsets.bin and doc_trained.bin from (encoded batch, progress in `unit`) pairs;
    the meta."""
    from tqdm import tqdm

    spec = src.spec
    counts = {"max_id": 0}
    offsets, doc_trained = [0], []
    with_mask = encoder.format != "text"
    with open(out / "tokens.bin", "wb") as f_tok, open(out / "trained.bin", "wb") as f_mask, \
            tqdm(total=total, desc=f"tokenizing {Path(spec).name or spec}", unit=unit, unit_scale=unit == "B",
                 dynamic_ncols=True, disable=None if progress is None else not progress, mininterval=0.5) as bar:
        for encoded, done in batches:
            if len(encoded) == 2:  # (record index, what is wrong with it)
                raise ValueError(f"data.source = {spec!r}: {src.locate(encoded[0])} {encoded[1]}")
            ids_N, lengths_D, masks_N, trained_D = encoded
            f_tok.write(ids_N.tobytes())
            if with_mask:
                f_mask.write(masks_N.tobytes())
            offsets.extend((offsets[-1] + np.cumsum(lengths_D)).tolist())
            doc_trained.extend(trained_D.tolist())
            if len(ids_N):
                counts["max_id"] = max(counts["max_id"], int(ids_N.max()))
            bar.update(done)
    records = len(offsets) - 1
    if records == 0:
        raise ValueError(f"data.source = {spec!r} holds no records; point it at a non-empty dataset")
    if offsets[-1] == 0 or sum(doc_trained) == 0:
        what = "no tokens" if offsets[-1] == 0 else "no trained token (no assistant turn with content)"
        raise ValueError(f"data.source = {spec!r}: its {records} records give {what}; check the data and "
                         f"data.format = {encoder.format!r}")
    if not with_mask:
        (out / "trained.bin").unlink()
    np.asarray(offsets, dtype=np.int64).tofile(out / "offsets.bin")
    np.asarray(doc_trained, dtype=np.int64).tofile(out / "doc_trained.bin")
    return {"version": CACHE_VERSION, "key": key, "source": src.describe(), "format": encoder.format,
            "tokenizer": {"name": encoder.name, "fingerprint": encoder.fingerprint,
                          "vocab_size": encoder.vocab_size},
            "documents": records, "tokens": offsets[-1], "trained_tokens": int(sum(doc_trained)),
            "max_token_id": counts["max_id"]}


def open_cache(folder: str | Path, tokenizer_fingerprint: str | None = None, what: str = "") -> TokenCache:
    """Memory-map a cache folder. With `tokenizer_fingerprint`, refuse one written by another tokenizer."""
    folder = Path(folder)
    meta = json.loads((folder / META).read_text())
    if meta.get("version") != CACHE_VERSION:
        raise ValueError(f"{folder}: token cache version {meta.get('version')} (this moeflow writes "
                         f"{CACHE_VERSION}); delete the folder so it is rebuilt")
    if tokenizer_fingerprint is not None and meta["tokenizer"]["fingerprint"] != tokenizer_fingerprint:
        raise ValueError(f"{what or 'data.source'} = {str(folder)!r}: this token cache was written by the tokenizer "
                         f"{meta['tokenizer']['name']!r} (fingerprint {meta['tokenizer']['fingerprint']}), not the "
                         f"one this run uses (fingerprint {tokenizer_fingerprint}); point data.source at the "
                         f"original records so they are tokenized again, or use the tokenizer it was written with")
    tokens = np.memmap(folder / "tokens.bin", dtype=np.uint32, mode="r")
    trained = np.memmap(folder / "trained.bin", dtype=np.uint8, mode="r") if (folder / "trained.bin").exists() else None
    offsets = np.fromfile(folder / "offsets.bin", dtype=np.int64)
    doc_trained = np.fromfile(folder / "doc_trained.bin", dtype=np.int64)
    return TokenCache(folder, meta, tokens, trained, offsets, doc_trained)
