"""Preparing pretraining data: tokenizing one corpus with moeflow against Hugging Face datasets and datatrove, and
what a blend of three sources costs a training step.

    .venv/bin/python bench/data_prep.py                      # a 200 MB corpus; writes bench/out/data_prep.*
    .venv/bin/python bench/data_prep.py --out bench/results  # the committed figures
    .venv/bin/python bench/data_prep.py --quick              # 20 MB, datatrove skipped unless its venv exists

The corpus is this Python's standard-library sources as jsonl documents, repeated to the size asked for, in four
shard files; the tokenizer a byte-level BPE (8,192 tokens, `tokenizers`) trained on it. Each tool reads the
shards and writes every document's token ids and an end-of-document token to disk:
- moeflow's token cache (`write_cache`, the path `moeflow train` takes) at 1 and 2 worker processes, and its
  streaming reader (`data.streaming`: records read lazily, 2 workers) draining the whole corpus;
- `datasets.load_dataset("json") + Dataset.map(batched, num_proc=2)` with the same tokenizer;
- datatrove's `JsonlReader -> DocumentTokenizer` on a LocalPipelineExecutor of 2 tasks, in a venv of its own
  (bench/.venv-datatrove, made on first use: datatrove is never a dependency of moeflow).
Reported: tokens/s (each tool's own token count, which agree), and the ratio to the fastest peer; the target is
moeflow >= the fastest peer. Then the blend: tiny-moe training steps (the trainer's own train_step) fed by one
token stream and by a blend of three (`data.blend`, the same tokens cut in three sources), interleaved blocks in
one process: tokens/s of each, and the sampler's own time per step; the target is a blend overhead <= 2%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
VENV = REPO / "bench" / ".venv-datatrove"
SHARDS = 4
VOCAB = 8192
EOS = "<|endoftext|>"


def make_corpus(folder: Path, megabytes: int) -> tuple[Path, Path]:
    """(a folder of SHARDS jsonl files of about `megabytes` MB in all, a tokenizer.json trained on one copy)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from moeflow.data.stream import _stdlib_documents

    docs = _stdlib_documents(8_000_000)
    lines = [json.dumps({"text": d}) + "\n" for d in docs]
    once = sum(map(len, lines))
    data = folder / "corpus"
    data.mkdir()
    files = [open(data / f"shard-{i}.jsonl", "w") for i in range(SHARDS)]
    written, i = 0, 0
    while written < megabytes * 1e6:
        for line in lines:
            files[i % SHARDS].write(line)
            i += 1
        written += once
    for f in files:
        f.close()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    return data, folder / "tokenizer.json"


def moeflow_cache(data: Path, tokenizer: Path, work: Path, workers: int) -> dict:
    from moeflow.data.records import resolve
    from moeflow.data.token_cache import TextEncoder, open_cache, write_cache
    from moeflow.data.tokenizer import HFTokenizer

    encoder = TextEncoder(HFTokenizer(tokenizer))
    t0 = time.perf_counter()
    folder = write_cache(resolve(str(data)), encoder, work / f"cache-{workers}", progress=False, workers=workers)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": int(open_cache(folder).meta["tokens"])}


def moeflow_stream(data: Path, tokenizer: Path, workers: int) -> dict:
    from moeflow.data import streaming
    from moeflow.data.records import resolve
    from moeflow.data.token_cache import TextEncoder
    from moeflow.data.tokenizer import HFTokenizer

    encoder = TextEncoder(HFTokenizer(tokenizer))
    t0, tokens = time.perf_counter(), 0
    for _, ids in streaming.documents(resolve(str(data)), encoder, 0, workers=workers, max_bytes=0):
        tokens += len(ids)
    return {"seconds": time.perf_counter() - t0, "tokens": tokens}


def datasets_map(data: Path, tokenizer: Path, work: Path, num_proc: int) -> dict:
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id(EOS)

    def encode(batch):
        return {"ids": [e.ids + [eos] for e in tok.encode_batch(batch["text"])]}

    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=sorted(str(p) for p in data.glob("*.jsonl")), split="train",
                               cache_dir=str(work / "hf-datasets"))
    out = ds.map(encode, batched=True, batch_size=512, num_proc=num_proc, remove_columns=["text"])
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": int(sum(len(ids) for ids in out.with_format("numpy")["ids"]))}


def _datatrove_child(data: str, tokenizer: str, out: str) -> None:
    """Run inside bench/.venv-datatrove: one JSON line with seconds and tokens."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    pipeline = [JsonlReader(data, glob_pattern="*.jsonl", text_key="text"),
                DocumentTokenizer(output_folder=f"{out}/tokens", tokenizer_name_or_path=tokenizer, eos_token=EOS,
                                  shuffle_documents=False, batch_size=512)]
    t0 = time.perf_counter()
    LocalPipelineExecutor(pipeline, tasks=2, workers=2, logging_dir=f"{out}/logs", skip_completed=False).run()
    seconds = time.perf_counter() - t0
    # each task writes uint16 token ids (.ds) beside their document ends (.ds.index)
    tokens = sum(os.path.getsize(p) // 2 for p in Path(f"{out}/tokens").rglob("*.ds"))
    print(json.dumps({"seconds": seconds, "tokens": tokens}))


def ensure_datatrove(make: bool) -> Path | None:
    py = VENV / "bin" / "python"
    if not py.exists():
        if not make:
            return None
        print(f"making {VENV} (python3.11 -m venv; pip install datatrove)", flush=True)
        subprocess.run(["python3.11", "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", "datatrove", "tokenizers", "orjson"], check=True)
    return py


def datatrove(py: Path, data: Path, tokenizer: Path, work: Path) -> dict:
    done = subprocess.run([str(py), __file__, "--datatrove-child", str(data), str(tokenizer), str(work / "dt")],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def blend_overhead(work: Path, blocks: int, steps_per_block: int) -> dict:
    """Training tokens/s fed by one token stream and by a blend of three sources of the same tokens."""
    import numpy as np
    import torch

    from moeflow.config import load_config, parse_overrides
    from moeflow.train.build import build
    from moeflow.train.distributed import DistInfo
    from moeflow.train.step import train_step

    tokens = np.random.default_rng(0).integers(0, 256, 600_000).astype(np.uint16)
    tokens.tofile(work / "all.bin")
    for i, part in enumerate(np.array_split(tokens, 3)):
        part.tofile(work / f"part{i}.bin")
    base = ["--model.name=tiny-moe", "--model.vocab_size=256", "--data.seq_len=256", "--training.global_batch=8",
            "--metrics.tensorboard=false", "--eval.every=0"]
    feeds = {"one source": [f"--data.source={work / 'all.bin'}"],
             "blend of three": [f"--data.blend=1 {work / 'part0.bin'} 1 {work / 'part1.bin'} 1 {work / 'part2.bin'}"]}
    setups = {}
    for name, extra in feeds.items():
        torch.manual_seed(0)
        cfg = load_config(None, {**parse_overrides([*base, *extra]), "run_dir": str(work / name.replace(" ", "-"))})
        setups[name] = (cfg, build(cfg, DistInfo(0, 1, 0, torch.device("cpu")), *cfg.layout(1)))
    step_s = {name: [] for name in feeds}
    loader_ms = {name: [] for name in feeds}
    for name, (_, s) in setups.items():
        real = s.sampler.next_batch

        def timed(real=real, name=name):
            t0 = time.perf_counter()
            batch = real()
            loader_ms[name].append((time.perf_counter() - t0) * 1e3)
            return batch

        s.sampler.next_batch = timed
    for block in range(blocks + 1):  # block 0 warms up; the order alternates, so neither always runs first
        for name, (cfg, s) in (list(setups.items())[::-1] if block % 2 else setups.items()):
            t0 = time.perf_counter()
            for _ in range(steps_per_block):
                train_step(cfg, s, with_moe_stats=False)
            if block:
                step_s[name].append((time.perf_counter() - t0) / steps_per_block)
    per_step = 8 * 256
    rows = {name: {"tokens_per_s": per_step / statistics.median(step_s[name]),
                   "loader_ms": statistics.median(loader_ms[name]),
                   "step_ms": statistics.median(step_s[name]) * 1e3} for name in feeds}
    one, blend = rows["one source"], rows["blend of three"]
    return {"rows": rows, "tokens_per_s_ratio": blend["tokens_per_s"] / one["tokens_per_s"],
            "loader_overhead": (blend["loader_ms"] - one["loader_ms"]) / one["step_ms"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=200, help="corpus size in MB (default 200)")
    ap.add_argument("--quick", action="store_true", help="20 MB, 3 blocks of 2 steps; no datatrove venv made")
    ap.add_argument("--out", default=str(REPO / "bench" / "out"), help="where the JSON and PNG go")
    ap.add_argument("--datatrove-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.datatrove_child:
        _datatrove_child(*args.datatrove_child)
        return 0
    megabytes = 20 if args.quick else args.mb
    blocks, per_block = (3, 2) if args.quick else (9, 4)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, tokenizer = make_corpus(work, megabytes)
        size = sum(p.stat().st_size for p in data.glob("*.jsonl"))
        tools = {"moeflow cache, 1 worker": lambda: moeflow_cache(data, tokenizer, work, 1),
                 "moeflow cache, 2 workers": lambda: moeflow_cache(data, tokenizer, work, 2),
                 "moeflow streaming, 2 workers": lambda: moeflow_stream(data, tokenizer, 2),
                 "datasets map, num_proc=2": lambda: datasets_map(data, tokenizer, work, 2)}
        py = ensure_datatrove(make=not args.quick)
        if py is not None:
            tools["datatrove, 2 tasks"] = lambda: datatrove(py, data, tokenizer, work)
        prep = []
        for name, run in tools.items():
            print(f"tokenizing with {name} ...", flush=True)
            r = run()
            prep.append({"tool": name, **r, "tokens_per_s": r["tokens"] / r["seconds"],
                         "mb_per_s": size / 1e6 / r["seconds"]})
        blend = blend_overhead(work, blocks, per_block)
    peers = [r["tokens_per_s"] for r in prep if not r["tool"].startswith("moeflow")]
    fastest = max(peers) if peers else None
    for r in prep:
        r["vs_fastest_peer"] = r["tokens_per_s"] / fastest if fastest else None
    best = max(r["tokens_per_s"] for r in prep if r["tool"].startswith("moeflow cache"))
    import torch

    meta = dict(platform=platform.platform(), cpu_count=os.cpu_count(), python=platform.python_version(),
                torch=torch.__version__, corpus_mb=round(size / 1e6, 1), shards=SHARDS, vocab=VOCAB,
                blocks=blocks, steps_per_block=per_block)
    result = {"meta": meta, "prep": prep, "blend": blend,
              "prep_target_met": bool(fastest) and best >= fastest,
              "blend_target_met": blend["tokens_per_s_ratio"] >= 0.98}
    print(f"# {meta['platform']}, {meta['cpu_count']} CPUs, python {meta['python']}, torch {meta['torch']}; "
          f"corpus {meta['corpus_mb']} MB in {SHARDS} jsonl shards, BPE {VOCAB}")
    print(f"{'tokenizer run':<30} {'seconds':>8} {'tokens':>13} {'tokens/s':>11} {'MB/s':>6} {'vs fastest peer':>15}")
    for r in prep:
        vs = f"{r['vs_fastest_peer']:.2f}x" if r["vs_fastest_peer"] else "-"
        print(f"{r['tool']:<30} {r['seconds']:>8.1f} {r['tokens']:>13,} {r['tokens_per_s']:>11,.0f} "
              f"{r['mb_per_s']:>6.1f} {vs:>15}")
    print(f"target (moeflow's cache >= the fastest peer): {'met' if result['prep_target_met'] else 'NOT met'}")
    print(f"{'training fed by':<30} {'tokens/s':>9} {'sampler ms':>11} {'step ms':>8}")
    for name, r in blend["rows"].items():
        print(f"{name:<30} {r['tokens_per_s']:>9,.0f} {r['loader_ms']:>11.3f} {r['step_ms']:>8.1f}")
    print(f"blend / one source: {blend['tokens_per_s_ratio']:.3f} tokens/s; the blend's sampler adds "
          f"{blend['loader_overhead']:.2%} of a step (target: overhead <= 2%: "
          f"{'met' if result['blend_target_met'] else 'NOT met'})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_prep.json").write_text(json.dumps(result, indent=1))
    _plot(prep, out / "data_prep.png")
    print(f"wrote {out}/data_prep.json and data_prep.png")
    return 0


def _plot(prep: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["tool"] for r in prep]
    ax.barh(names, [r["tokens_per_s"] / 1e6 for r in prep],
            color=["tab:blue" if n.startswith("moeflow") else "tab:gray" for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("million tokens/s (higher is better)")
    save_figure(fig, str(path))


if __name__ == "__main__":
    sys.exit(main())
