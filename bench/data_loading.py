"""Is data loading ever the bottleneck? Training tokens/s with the real loader against the same steps fed
synthetic tokens.

    .venv/bin/python bench/data_loading.py            # tiny-moe, seq 256, batch 8; packed docs and the token stream
    .venv/bin/python bench/data_loading.py --quick

For each data path (documents read through Hugging Face datasets, tokenized into the cache, memory-mapped and packed
first-fit with document masks; and the same cache read as a token stream of windows), the trainer's own step
(moeflow.train.step.train_step) runs interleaved blocks of steps twice: with the sampler (reading the memory map,
building inputs, targets, positions and document ids every step) and with one precomputed batch of the same kind
(the synthetic baseline, in the same run). The target: real >= 95% of synthetic tokens/s. Also reported: the
loader's own time per step, and how many times faster it is than a step. Writes bench/out/data_loading.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ["--model.name=tiny-moe", "--data.seq_len=256", "--training.global_batch=8", "--data.max_bytes=3000000",
         "--metrics.tensorboard=false", "--eval.every=0", "--data.tokenizer=byte"]
PATHS = {"packed documents": ["--data.packing=true"], "token stream (cache)": ["--data.packing=false"]}


def _stdlib_jsonl(folder: str, max_bytes: int) -> str:
    """The standard-library corpus as a jsonl of documents, so that the stream path also goes through the cache."""
    from moeflow.data.stream import _stdlib_documents

    path = os.path.join(folder, "stdlib.jsonl")
    with open(path, "w") as fh:
        for doc in _stdlib_documents(max_bytes):
            fh.write(json.dumps({"text": doc}) + "\n")
    return path


def measure(cfg, blocks: int, steps_per_block: int) -> dict:
    from moeflow.train.build import build
    from moeflow.train.distributed import DistInfo
    from moeflow.train.step import train_step

    s = build(cfg, DistInfo(0, 1, 0, torch.device("cpu")), *cfg.layout(1))
    real_next = s.sampler.next_batch
    fixed = real_next()

    loader_ms = []

    def timed_next():
        t0 = time.perf_counter()
        batch = real_next()
        loader_ms.append((time.perf_counter() - t0) * 1e3)
        return batch

    times = {"real loader": [], "synthetic": []}
    for i in range(blocks + 1):  # block 0 warms up
        for kind in ("real loader", "synthetic"):
            s.sampler.next_batch = timed_next if kind == "real loader" else (lambda: fixed)
            t0 = time.perf_counter()
            for _ in range(steps_per_block):
                train_step(cfg, s, with_moe_stats=False)
            if i:
                times[kind].append((time.perf_counter() - t0) / steps_per_block)
    tokens = cfg.training.global_batch * cfg.data.seq_len
    out = {kind: tokens / statistics.median(t) for kind, t in times.items()}
    step_ms = statistics.median(times["real loader"]) * 1e3
    loader = statistics.median(loader_ms)
    return {"real_tokens_per_s": out["real loader"], "synthetic_tokens_per_s": out["synthetic"],
            "ratio": out["real loader"] / out["synthetic"], "loader_ms": loader, "step_ms": step_ms,
            "loader_headroom": step_ms / loader, "packed_rows": s.data_summary.get("rows"),
            "fill": s.data_summary.get("fill")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 blocks of 2 steps instead of 7 of 4")
    args = ap.parse_args()
    blocks, per_block = (3, 2) if args.quick else (7, 4)
    from moeflow.config import load_config, parse_overrides

    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        source = _stdlib_jsonl(tmp, 3_000_000)
        for name, extra in PATHS.items():
            argv = [*MODEL, *extra, f"--data.source={source}", f"--data.cache_dir={tmp}/cache"]
            cfg = load_config(None, {**parse_overrides(argv), "run_dir": f"{tmp}/{len(rows)}"})
            rows.append({"path": name, **measure(cfg, blocks, per_block)})
    meta = dict(platform=platform.platform(), cpu_count=os.cpu_count(), python=platform.python_version(),
                torch=torch.__version__, threads=torch.get_num_threads(), model=MODEL, blocks=blocks,
                steps_per_block=per_block)
    print(f"# {meta['platform']}, {meta['cpu_count']} CPUs ({meta['threads']} torch threads), python "
          f"{meta['python']}, torch {meta['torch']}")
    print(f"# {' '.join(MODEL)}; median of {blocks} interleaved blocks of {per_block} steps")
    print(f"{'data path':<22} {'real tok/s':>10} {'synthetic':>10} {'ratio':>6} {'loader ms':>10} {'step ms':>8} "
          f"{'headroom':>9}")
    for r in rows:
        print(f"{r['path']:<22} {r['real_tokens_per_s']:>10,.0f} {r['synthetic_tokens_per_s']:>10,.0f} "
              f"{r['ratio']:>6.3f} {r['loader_ms']:>10.2f} {r['step_ms']:>8.1f} {r['loader_headroom']:>8.0f}x")
    ok = all(r["ratio"] >= 0.95 for r in rows)
    print(f"target (real >= 95% of synthetic tokens/s): {'met' if ok else 'NOT met'}")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "data_loading.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows, "target_met": ok}, fh, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["real_tokens_per_s"] for r in rows], 0.4, label="real loader")
    ax.bar([i + 0.2 for i in x], [r["synthetic_tokens_per_s"] for r in rows], 0.4, label="synthetic tokens")
    ax.set_xticks(list(x), [r["path"] for r in rows])
    ax.set_ylabel("training tokens/s")
    ax.legend()
    save_figure(fig, os.path.join(OUT, "data_loading.png"))
    print(f"wrote {OUT}/data_loading.json and data_loading.png")


if __name__ == "__main__":
    main()
