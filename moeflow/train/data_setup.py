"""A job's data: which path it takes, its tokenizer, the token cache, and the sampler and validation batches.

Two paths:
  token stream  'stdlib', text files and folders, .bin token files, with data.format = 'text' and no packing:
                one stream of token ids cut into windows (moeflow.data.stream), as before datasets existed here;
  token cache   record files, hf: names, data.format = 'chat' / 'instruction', or data.packing = true: records
                read through Hugging Face `datasets` and tokenized once into a cache (moeflow.data.token_cache);
                'text' without packing is then a token stream again (the cache's tokens), anything else is rows
                of whole documents (moeflow.data.packing).
The validation split of the cache path is the last data.val_fraction of the documents (a tail, like the stream's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np

from moeflow.config import JobConfig, blend_sources
from moeflow.data import megatron, streaming
from moeflow.data.blend import BlendSampler, BlendSource
from moeflow.data.megatron import megatron_prefix
from moeflow.data.records import is_record_source, resolve
from moeflow.data.stream import BatchSampler, TokenWindows, load_tokens, split_tokens, val_batches
from moeflow.data.streaming import StreamingSampler
from moeflow.data.token_cache import ChatEncoder, TextEncoder, cache_key, is_cache_folder, open_cache, write_cache
from moeflow.data.token_share import Share, write_together
from moeflow.data.tokenizer import load_tokenizer


@dataclass
class Data:
    train: object  # a token stream (np.ndarray) or a sequence source (TokenWindows, DocumentRows)
    val: list
    summary: dict = field(default_factory=dict)  # what the run's summary reports about the data
    blend: list[BlendSource] | None = None  # data.blend's sources (train is then unused)
    streamed: StreamingSampler | None = None  # data.streaming's settings, as a closed one-process sampler

    def sampler(self, cfg: JobConfig, dp_rank: int, dp_size: int) -> BatchSampler | BlendSampler | StreamingSampler:
        t = cfg.training
        if self.streamed:
            s = self.streamed
            return StreamingSampler(s.open_documents, s.key, s.seq_len, s.global_batch, dp_rank, dp_size,
                                    s.held_out, s.vocab_size)
        if self.blend:
            return BlendSampler(self.blend, cfg.data.seq_len, t.global_batch, dp_rank, dp_size, t.seed)
        return BatchSampler(self.train, cfg.data.seq_len, t.global_batch, dp_rank, dp_size, t.seed)


def uses_cache(cfg: JobConfig) -> bool:
    d = cfg.data
    if d.streaming:  # tokenized as it is read (moeflow.data.streaming)
        return False
    if megatron_prefix(d.source) is not None:  # already tokenized: read in place (moeflow.data.megatron)
        return False
    if d.source.endswith(".bin") and Path(d.source).is_file():
        return False
    return d.format != "text" or d.packing or is_record_source(d.source) or is_cache_folder(d.source)


def _tokenizer_spec(cfg: JobConfig) -> str:
    spec = cfg.data.tokenizer
    hf = cfg.model.hf_path
    if spec == "auto" and hf and ((Path(hf) / "tokenizer.json").is_file() or cfg.data.format != "text"):
        return hf  # the checkpoint's own tokenizer
    return spec


def _chat_folder(cfg: JobConfig) -> str:
    spec = _tokenizer_spec(cfg)
    if spec == "byte":
        raise ValueError(f"data.format = {cfg.data.format!r} renders conversations with a Hugging Face tokenizer's "
                         f"chat template, but data.tokenizer = 'byte'; set data.tokenizer to a tokenizer folder")
    if spec == "auto":
        source = Path(cfg.data.source)
        folder = source if source.is_dir() else source.parent
        if not any((folder / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json")):
            raise ValueError(f"data.format = {cfg.data.format!r} needs a Hugging Face tokenizer with a chat template; "
                             f"none beside data.source = {cfg.data.source!r}: set data.tokenizer = FOLDER (a model "
                             f"or tokenizer folder) or model.hf_path")
        return str(folder)
    return str(Path(spec).parent if Path(spec).is_file() else Path(spec))


def make_encoder(cfg: JobConfig):
    """The tokenizer of the job wrapped for the cache: text, or chat with its template."""
    d = cfg.data
    if d.format == "text":
        tokenizer = load_tokenizer(_tokenizer_spec(cfg), None if d.source == "stdlib" else d.source)
        encoder = TextEncoder(tokenizer)
    else:
        from moeflow.data.chat import load_chat_tokenizer

        encoder = ChatEncoder(load_chat_tokenizer(_chat_folder(cfg), d.chat_template), d.format)
    _check_vocab(encoder.vocab_size, cfg)
    return encoder


def _check_vocab(tokens: int, cfg: JobConfig) -> None:
    if tokens > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer has {tokens} tokens but model.vocab_size is {cfg.model.vocab_size}; set "
                         f"--model.vocab_size={tokens} or more")


def cache_root(cfg: JobConfig) -> Path:
    return Path(cfg.data.cache_dir or Path(cfg.run_dir) / "data-cache")


def prepare(cfg: JobConfig, progress: bool | None = None, share: Share | None = None) -> Path:
    """The token cache folder of the job, tokenizing first if needed: in one process (the launcher or rank 0), or
    with `share` by the ranks of the job together (moeflow.data.token_cache.write_cache)."""
    encoder = make_encoder(cfg)
    if is_cache_folder(cfg.data.source):
        open_cache(cfg.data.source, encoder.fingerprint)  # refuses one written by another tokenizer
        return Path(cfg.data.source)
    if share is not None:
        return write_together(resolve(cfg.data.source), encoder, cache_root(cfg), share, max_bytes=cfg.data.max_bytes,
                              progress=progress)
    return write_cache(resolve(cfg.data.source), encoder, cache_root(cfg), max_bytes=cfg.data.max_bytes,
                       progress=progress, workers=cfg.data.tokenize_workers or _default_workers())


def _default_workers() -> int:
    """Every core where nothing else runs yet (the launcher, one process); inside a rank, whose process group
    already has threads that a fork would copy mid-flight, the rank alone unless data.tokenize_workers says."""
    import torch.distributed as dist

    return 1 if dist.is_initialized() else os.cpu_count() or 1


def _share() -> Share | None:
    """How this job's ranks tokenize together: one rank per node (its local rank 0, with the node's cores: the
    tokenizer's threads), each a node's part; None on one node (rank 0 tokenizes alone) or outside a job."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world // local < 2 or world % local:  # (nodes of different sizes: rank 0 alone)
        return None

    def gather(obj) -> list:
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    return Share(rank // local if rank % local == 0 else None, world // local, rank == 0, gather)


def _prepare_on_rank0(cfg: JobConfig, is_main: bool) -> tuple[Path, str]:
    """(cache folder, tokenizer fingerprint) on every rank: rank 0 prepares (over several nodes one rank per node
    takes its node's part, unless data.tokenize_workers asks rank 0 to fork that many processes), the others
    receive rank 0's folder or its error (so a bad record stops every rank with the same line instead of leaving
    them in a barrier)."""
    from moeflow.train.distributed import broadcast_object

    folder, error, failure = None, None, None
    share = None if cfg.data.tokenize_workers else _share()
    if is_main or share:
        try:
            folder = str(prepare(cfg, share=share))
        except Exception as e:  # every error, or the other ranks would wait in the broadcast until the timeout
            failure, error = e, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    folder, error = broadcast_object((folder, error))
    if failure is not None:
        raise failure
    if error is not None:
        raise ValueError(f"rank 0 could not prepare the data: {error}")
    return Path(folder), make_encoder(cfg).fingerprint


def build_data(cfg: JobConfig, is_main: bool = True) -> Data:
    """The job's training sequences, validation batches and data summary (every rank the same)."""
    if cfg.data.blend:
        return _blend(cfg, is_main)
    if cfg.data.streaming:
        return _streamed(cfg)
    d, t = cfg.data, cfg.training
    prefix = megatron_prefix(d.source)
    if prefix is not None and d.format != "text":
        raise ValueError(f"data.format = {d.format!r} with the Megatron dataset {prefix}: its documents are token "
                         f"ids already; use data.format = 'text' (and data.packing = true for whole documents)")
    if prefix is not None and d.packing:
        docs = megatron.documents(prefix, cfg.model.vocab_size)
        summary = {"format": "megatron", "packing": True, "cache": str(prefix), "records": docs.num_documents,
                   "tokens": int(docs.offsets[-1])}
        return _document_rows(cfg, docs, summary)
    if not uses_cache(cfg):
        tokens, index = _stream_tokens(cfg)
        summary = {}
        if index is not None:  # it counts the documents, also where the run reads one token stream
            summary = {"format": "megatron", "packing": False, "cache": str(prefix),
                       "records": len(index.document_indices) - 1, "tokens": int(len(tokens))}
        train, val = split_tokens(tokens, d.val_fraction, d.seq_len)
        return Data(train, val_batches(val, d.seq_len, t.global_batch, cfg.eval.batches), summary)
    folder, fingerprint = _prepare_on_rank0(cfg, is_main)
    cache = open_cache(folder, fingerprint, "the token cache")
    if cache.meta["max_token_id"] >= cfg.model.vocab_size:
        raise ValueError(f"the token cache {folder} holds token id {cache.meta['max_token_id']} but model.vocab_size "
                         f"is {cfg.model.vocab_size}; raise model.vocab_size")
    summary = {"format": d.format, "packing": d.packing, "cache": str(folder), "records": cache.num_documents,
               "tokens": int(cache.meta["tokens"]), "trained_tokens": int(cache.meta["trained_tokens"])}
    if d.format == "text" and not d.packing:  # a token stream, as from a text file, but tokenized once
        train, val = split_tokens(cache.tokens, d.val_fraction, d.seq_len)
        return Data(TokenWindows(train, d.seq_len, key=cache.key),
                    val_batches(val, d.seq_len, t.global_batch, cfg.eval.batches), summary)
    return _document_rows(cfg, cache, summary)


def _document_rows(cfg: JobConfig, cache, summary: dict) -> Data:
    """Rows of whole documents of a token cache (or a Megatron dataset's documents), the last val_fraction of
    them held out."""
    from moeflow.data.packing import DocumentRows

    d, t = cfg.data, cfg.training
    n = cache.num_documents
    n_val = max(1, int(n * d.val_fraction)) if n >= 2 else 0
    docs = np.arange(n)
    rows = dict(packed=d.packing, overlong=d.overlong, seed=t.seed, what=f"data.source = {d.source!r}")
    train = DocumentRows(cache, docs[:n - n_val], d.seq_len, **rows)
    val = DocumentRows(cache, docs[n - n_val:], d.seq_len, **rows)
    summary.update({k: v for k, v in train.stats.items()},
                   truncated=train.stats["truncated"] + val.stats["truncated"],
                   dropped=train.stats["dropped"] + val.stats["dropped"])
    return Data(train, val_batches(val, d.seq_len, t.global_batch, cfg.eval.batches), summary)


def _streamed(cfg: JobConfig) -> Data:
    """data.streaming: the sampler reads and tokenizes the source as the steps need it; every rank the same."""
    d, t = cfg.data, cfg.training
    src, encoder = resolve(d.source), make_encoder(cfg)
    key = f"stream-{cache_key(src, encoder, d.max_bytes)}"
    open_documents = partial(streaming.documents, src, encoder, workers=d.tokenize_workers, max_bytes=d.max_bytes)
    one = StreamingSampler(open_documents, key, d.seq_len, t.global_batch, held_out=cfg.eval.batches * t.global_batch,
                           vocab_size=cfg.model.vocab_size)
    val = val_batches(one.held_out_tokens(), d.seq_len, t.global_batch, cfg.eval.batches)
    one.close()  # it checked the stream holds a training window; each rank's sampler reads its own
    return Data(None, val, {"format": "text", "streaming": True, "source": d.source}, streamed=one)


def _blend(cfg: JobConfig, is_main: bool) -> Data:
    """Each source of data.blend built as data.source would be, then blended (moeflow.data.blend)."""
    pairs = blend_sources(cfg.data)
    total = sum(w for w, _ in pairs)
    sources, val, summaries = [], [], []
    for weight, data in pairs:
        source = data.source
        try:
            part = build_data(replace(cfg, data=data), is_main)
        except ValueError as e:
            raise ValueError(f"data.blend = {cfg.data.blend!r}, source {source!r}: {e}") from None
        sources.append(BlendSource(source, weight / total, part.train))
        val += part.val  # each source's held-out tail
        stream = part.train if isinstance(part.train, np.ndarray) else None
        summaries.append({"name": source, "weight": weight / total,
                          "documents": part.summary.get("records"),
                          "tokens": part.summary.get("tokens", len(stream) if stream is not None else None),
                          "trained_tokens": 0})
    return Data(None, val, {"format": cfg.data.format, "packing": cfg.data.packing, "sources": summaries}, sources)


def _stream_tokens(cfg: JobConfig) -> tuple[np.ndarray, megatron.MegatronIndex | None]:
    """(the source's tokens as one stream, the Megatron index where the source is a Megatron dataset)."""
    d = cfg.data
    prefix = megatron_prefix(d.source)
    if prefix is not None:
        return megatron.load(prefix, cfg.model.vocab_size)
    pretokenized = d.source.endswith(".bin")  # ids already; load_tokens checks them against the vocabulary
    tokenizer = None
    if not pretokenized:
        tokenizer = load_tokenizer(_tokenizer_spec(cfg), None if d.source == "stdlib" else d.source)
        _check_vocab(tokenizer.vocab_size, cfg)
    return load_tokens(d.source, tokenizer, token_dtype=d.token_dtype, vocab_size=cfg.model.vocab_size,
                       max_bytes=d.max_bytes), None
