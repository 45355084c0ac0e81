"""Which attention implementation packed documents should use here: a block-diagonal causal mask through
scaled_dot_product_attention, one SDPA call per document, or flex attention's block masks.

    .venv/bin/python bench/doc_attention.py            # B=4 rows of S=512, H=8 heads of 64, ~12 documents per row
    .venv/bin/python bench/doc_attention.py --quick

Per implementation: median forward + backward ms over interleaved repeats after warm-up (forward only where the
backward is not supported on this device, as flex attention's on CPU), against plain causal attention over the
same rows (what the rows cost unpacked: the baseline, measured in the same run). Every implementation's output is
first checked against the masked SDPA's. Writes bench/out/doc_attention.{json,png} and prints a table plus the
machine and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moeflow.models.attention import document_causal_mask  # noqa: E402


def rows_of_documents(B: int, S: int, docs_per_row: int, seed: int = 0) -> torch.Tensor:
    """document ids [B, S]: random document lengths summing to S in each row."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(B):
        cuts = torch.randperm(S - 1, generator=gen)[: docs_per_row - 1].sort().values + 1
        lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([S])]))
        out.append(torch.repeat_interleave(torch.arange(docs_per_row), lengths))
    return torch.stack(out)


def implementations(doc_BS: torch.Tensor) -> dict:
    mask = document_causal_mask(doc_BS)
    spans = [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in doc_BS]

    def masked(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def per_document(q, k, v):
        rows = []
        for b, lengths in enumerate(spans):
            parts, start = [], 0
            for n in lengths:
                s = slice(start, start + n)
                parts.append(F.scaled_dot_product_attention(q[b:b + 1, :, s], k[b:b + 1, :, s], v[b:b + 1, :, s],
                                                            is_causal=True))
                start += n
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows)

    def causal(q, k, v):  # the baseline: what the same rows cost without a document mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    impls = {"sdpa causal (baseline)": causal, "sdpa + block-diagonal mask": masked,
             "sdpa per document": per_document}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, qi, ki):
            return (doc_BS[b, qi] == doc_BS[b, ki]) & (ki <= qi)

        B, S = doc_BS.shape
        block = create_block_mask(mask_mod, B, None, S, S, device=str(doc_BS.device))
        compiled = torch.compile(flex_attention)
        impls["flex attention (compiled)"] = lambda q, k, v: compiled(q, k, v, block_mask=block)
    except Exception as e:  # flex attention needs a recent torch and a working compiler
        print(f"# flex attention unavailable: {type(e).__name__}: {e}")
    return impls


def time_one(fn, q, k, v, backward: bool) -> float:
    if not backward:
        q, k, v = q.detach(), k.detach(), v.detach()
    t0 = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out = fn(q, k, v)
        if backward:
            out.sum().backward()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--docs", type=int, default=12, help="documents per row")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats = 3 if args.quick else args.repeats
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    B, S, H, D = args.batch, args.seq, args.heads, args.head_dim
    doc_BS = rows_of_documents(B, S, args.docs).to(device)
    q, k, v = (torch.randn(B, H, S, D, device=device, requires_grad=True) for _ in range(3))
    impls = implementations(doc_BS)
    reference = impls["sdpa + block-diagonal mask"](q, k, v).detach()
    backward, checks = {}, {}
    for name, fn in impls.items():
        try:
            out = fn(q, k, v)
            out.sum().backward()
            backward[name] = True
        except Exception as e:  # flex attention has no backward on CPU
            print(f"# {name}: forward only ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
            backward[name] = False
            with torch.no_grad():
                out = fn(q.detach(), k.detach(), v.detach())
        checks[name] = None if "baseline" in name else float((out.detach() - reference).abs().max())
    times = {name: [] for name in impls}
    for _ in range(2):  # warm-up (compilation, allocator)
        for name, fn in impls.items():
            time_one(fn, q, k, v, backward[name])
    for _ in range(repeats):  # interleaved, so load changes hit all alike
        for name, fn in impls.items():
            times[name].append(time_one(fn, q, k, v, backward[name]))
    base = statistics.median(times["sdpa causal (baseline)"])
    rows = [{"impl": name, "backward": backward[name], "median_ms": statistics.median(t), "min_ms": min(t),
             "vs_causal": statistics.median(t) / base, "max_abs_diff": checks[name]} for name, t in times.items()]
    meta = dict(platform=platform.platform(), cpu_count=os.cpu_count(), python=platform.python_version(),
                torch=torch.__version__, device=device, threads=torch.get_num_threads(), B=B, S=S, H=H, D=D,
                docs_per_row=args.docs, repeats=repeats)
    print(f"# {meta['platform']}, {meta['cpu_count']} CPUs ({meta['threads']} torch threads), python "
          f"{meta['python']}, torch {meta['torch']}, device {device}")
    print(f"# B={B} rows x S={S}, H={H} heads x {D}, {args.docs} documents per row, median of {repeats}")
    print(f"{'implementation':<28} {'pass':>9} {'median ms':>10} {'min ms':>8} {'vs causal':>10} {'max |diff|':>11}")
    for r in rows:
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        print(f"{r['impl']:<28} {'fwd+bwd' if r['backward'] else 'fwd only':>9} {r['median_ms']:>10.2f} "
              f"{r['min_ms']:>8.2f} {r['vs_causal']:>10.2f} {diff:>11}")
    fastest = min((r for r in rows if r["backward"] and "baseline" not in r["impl"]), key=lambda r: r["median_ms"])
    print(f"fastest with a backward here: {fastest['impl']}")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "doc_attention.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows, "fastest": fastest["impl"]}, fh, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([f"{r['impl']} ({'fwd+bwd' if r['backward'] else 'fwd'})" for r in rows],
            [r["median_ms"] for r in rows])
    ax.set_xlabel(f"median ms, B={B} x S={S}, {args.docs} documents per row ({device})")
    save_figure(fig, os.path.join(OUT, "doc_attention.png"))
    print(f"wrote {OUT}/doc_attention.json and doc_attention.png")


if __name__ == "__main__":
    main()
