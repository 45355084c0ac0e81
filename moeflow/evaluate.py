"""`moeflow eval`: the loss and perplexity of a run or a Hugging Face folder on a file or dataset, with tokens/s.

  moeflow eval --run-dir runs/sft --data held_out.jsonl --format chat
  moeflow eval --hf-path ~/models/Qwen3-0.6B --data notes.txt --seq-len 512

The data go through the trainer's own path (moeflow.train.data_setup): every document of the source is scored
(no train/validation split), in order, `--batch-size` rows at a time. The loss is the mean over trained targets
(the assistant's tokens for chat data), perplexity its exponential; tokens/s counts the positions the model ran.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeflow eval", description="Loss and perplexity of a model on a file or "
                                "dataset (the trainer's data settings), with throughput.")
    from moeflow.generate import add_model_source

    add_model_source(p)
    p.add_argument("--data", required=True, help="what data.source takes: a file, a folder, hf:NAME[:SPLIT], ...")
    p.add_argument("--format", choices=("text", "chat", "instruction"), default="text")
    p.add_argument("--packing", action="store_true", help="pack documents into rows (as data.packing)")
    p.add_argument("--seq-len", type=int, default=0, help="positions per row (default: the run's data.seq_len, "
                   "or min(1024, the model's max_seq_len))")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward (default 8)")
    p.add_argument("--max-batches", type=int, default=0, help="score at most this many batches (0 = all)")
    p.add_argument("--tokenizer", default="", help="data.tokenizer (default: the model's own)")
    p.add_argument("--cache-dir", default="", help="where the tokenized data are kept (default: RUN_DIR/data-cache, "
                   "or a temporary folder for --hf-path)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto (CUDA when present)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def evaluate(model, batches, device) -> dict:
    """Summed loss and counts over `batches` (moeflow.data.stream.Batch)."""
    import torch

    from moeflow.data.stream import IGNORE_INDEX
    from moeflow.parallel.loss import tp_loss

    total, trained, positions = 0.0, 0, 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            batch = batch.to(device)
            logits = model(batch.inputs, **batch.model_kwargs())
            total += float(tp_loss(logits, batch.targets, reduction="sum"))
            trained += int((batch.targets != IGNORE_INDEX).sum())
            positions += batch.inputs.numel()
    elapsed = time.perf_counter() - t0
    loss = total / max(1, trained)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700)), "trained_tokens": trained, "positions": positions,
            "seconds": elapsed, "tokens_per_s": positions / elapsed if elapsed else 0.0}


def eval_batches(job, batch_size: int, max_batches: int):
    """Every document of job.data.source as Batches, in order."""
    import numpy as np

    from moeflow.data.packing import DocumentRows
    from moeflow.data.stream import TokenWindows
    from moeflow.data.token_cache import open_cache
    from moeflow.train.data_setup import _stream_tokens, prepare, uses_cache

    d = job.data
    if not uses_cache(job):
        source = TokenWindows(_stream_tokens(job)[0], d.seq_len)
    else:
        cache = open_cache(prepare(job))
        if d.format == "text" and not d.packing:
            source = TokenWindows(cache.tokens, d.seq_len)
        else:
            source = DocumentRows(cache, np.arange(cache.num_documents), d.seq_len, packed=d.packing,
                                  what=f"--data {d.source!r}")
    n = source.num_sequences
    if n == 0:
        raise ValueError(f"--data {d.source!r} gives no sequence of --seq-len {d.seq_len} to score")
    starts = range(0, n, batch_size)  # every sequence, the last batch possibly smaller
    if max_batches:
        starts = starts[:max_batches]
    return [source.gather(np.arange(i, min(i + batch_size, n))) for i in starts]


def main(argv: list[str]) -> int:
    from moeflow.config import JobConfig
    from moeflow.generate import load_model
    from moeflow.train.distributed import choose_device

    args = _parser().parse_args(argv)
    if args.batch_size < 1 or args.max_batches < 0 or args.seq_len < 0:
        raise ValueError(f"--batch-size must be at least 1 (got {args.batch_size}), --max-batches and --seq-len "
                         f"0 or more (got {args.max_batches}, {args.seq_len}); 0 means all batches / the run's length")
    device = choose_device(args.device, 1, "--device")
    model, cfg, folder, _ = load_model(args.run_dir, args.hf_path, args.dtype, device, args.hf_impl)
    job = JobConfig(model=cfg)
    if args.run_dir and (Path(args.run_dir) / "config.toml").is_file():
        from moeflow.config import load_config

        job = load_config(Path(args.run_dir) / "config.toml", given=())
        job.model = cfg
    d = job.data
    d.source, d.format, d.packing = args.data, args.format, args.packing
    d.seq_len = args.seq_len or (d.seq_len if args.run_dir else min(1024, cfg.max_seq_len))
    if d.seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len {d.seq_len} exceeds the model's max_seq_len ({cfg.max_seq_len})")
    if args.tokenizer:
        d.tokenizer = args.tokenizer
    elif folder is not None:
        d.tokenizer = str(folder)
    with tempfile.TemporaryDirectory(prefix="moeflow-eval-") as tmp:
        d.cache_dir = args.cache_dir or (str(Path(args.run_dir) / "data-cache") if args.run_dir else tmp)
        batches = eval_batches(job, args.batch_size, args.max_batches)
        result = evaluate(model, batches, device)
    result.update(data=args.data, format=args.format, seq_len=d.seq_len, sequences=sum(len(b.inputs) for b in batches))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}  on {result['trained_tokens']:,} "
              f"trained tokens ({result['sequences']} sequences of {d.seq_len}) in {result['seconds']:.2f} s, "
              f"{result['tokens_per_s']:,.0f} tokens/s", file=sys.stdout)
    return 0
