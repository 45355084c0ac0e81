"""Benchmark context parallelism: activation bytes per rank and step time for cp = 1, 2, 4 on one long sequence.

    .venv/bin/python bench/context_parallel.py              # tiny-moe (4 layers), one sequence of 4096 tokens
    .venv/bin/python bench/context_parallel.py --seq 2048 --quick

Per cp size, on cp local gloo processes: the bytes autograd saves for backward on one rank during a forward
(every saved tensor's storage counted once, parameters excluded: the activations), the median forward + backward
time, and the loss, which must equal the single-process loss on the whole sequence (checked). Baseline: cp = 1,
measured in the same run; also the ideal 1/cp of it and what moeflow's planner predicts for the ratio
(plan.memory: activations / cp plus the gathered keys and values). The model is plain (no FSDP), so only what
context parallelism changes is measured. On this 2-core machine several ranks share two cores, so the times show
overheads, not the speed-up of a GPU cluster; the bytes are what they are anywhere. Writes
bench/out/context_parallel.{json,png} and prints a table plus the machine and versions.
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
import torch.distributed as dist
from gloo_workers import init_gloo, report, run_workers

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(seq: int):
    from moeflow.core.presets import get_preset
    from moeflow.models.transformer import Transformer

    cfg = get_preset("tiny-moe")
    cfg.max_seq_len = max(cfg.max_seq_len, seq)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model


def _saved_activation_bytes(model, run) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves for backward while `run()` executes, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def _worker(rank: int, cp: int, seq: int, repeats: int, tmp: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from moeflow.parallel.loss import tp_loss

    model = _model(seq)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    reference = None
    if rank == 0:
        with torch.no_grad():
            reference = float(tp_loss(model(inputs), targets))
    loss_fn = tp_loss
    if cp > 1:
        init_gloo(rank, cp, tmp)
        from torch.distributed.device_mesh import init_device_mesh

        from moeflow.parallel.context import apply_context_parallel, shard_sequence

        token_scale = apply_context_parallel([model], init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)))
        inputs, targets = shard_sequence(inputs, rank, cp), shard_sequence(targets, rank, cp)

        def loss_fn(logits, targets):  # this rank's share of the whole sequence's mean, times cp
            return tp_loss(logits, targets, reduction="sum") * token_scale(targets)

    def step():
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss.detach()

    saved, _ = _saved_activation_bytes(model, lambda: loss_fn(model(inputs), targets))
    model.zero_grad(set_to_none=True)
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        if cp > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        if i:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    if cp > 1:
        dist.all_reduce(loss)  # each rank's loss is its share of the whole sequence's mean, times cp
        loss /= cp
        peak = torch.tensor([float(saved)])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        saved = int(peak.item())
    report(rank, tmp, {"saved_bytes": saved, "step_s": statistics.median(times), "loss": float(loss),
                       "reference_loss": reference})
    os._exit(0)  # no destroy_process_group (as the test harness)


def run(cp: int, seq: int, repeats: int) -> dict:
    return run_workers(_worker, cp, seq, repeats)


def planned_ratio(seq: int, cp: int) -> float:
    """The planner's activations(cp) / activations(1) for the same model, one layer stack, no checkpointing."""
    from moeflow.core.hardware import get_gpu
    from moeflow.core.parallel_dims import ParallelDims
    from moeflow.plan.layout import Job, Layout
    from moeflow.plan.memory import memory_per_gpu

    cfg = _model(seq).cfg
    job = Job(cfg, get_gpu("H100-80GB"), 1, 8, seq, seq * 8)
    act = lambda c: memory_per_gpu(job, Layout(ParallelDims(8, zero=3, cp=c), 1, "none"))["activations"]
    return act(cp) / act(1)


def write_png(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [f"cp={r['cp']}" for r in rows]
    ax1.bar(names, [r["saved_bytes"] / 1e6 for r in rows], label="measured (largest rank)")
    ax1.plot(names, [r["ideal_bytes"] / 1e6 for r in rows], "k_", markersize=20, label="ideal: cp=1 / cp")
    ax1.set_ylabel("activations saved for backward per rank (MB)")
    ax1.legend()
    ax2.bar(names, [r["step_s"] * 1e3 for r in rows])
    ax2.set_ylabel("forward + backward ms (2 shared CPU cores)")
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (divisible by 8; default 4096)")
    ap.add_argument("--quick", action="store_true", help="2 timed repeats instead of 5")
    args = ap.parse_args()
    repeats = 2 if args.quick else 5
    rows = []
    for cp in (1, 2, 4):
        r = run(cp, args.seq, repeats)
        rows.append({"cp": cp, **r})
    base = rows[0]
    for r in rows:
        r["ideal_bytes"] = base["saved_bytes"] / r["cp"]
        r["saved_over_cp1"] = r["saved_bytes"] / base["saved_bytes"]
        r["planned_over_cp1"] = planned_ratio(args.seq, r["cp"])
        r["time_over_cp1"] = r["step_s"] / base["step_s"]
        if abs(r["loss"] - base["reference_loss"]) > 1e-4 * abs(base["reference_loss"]):
            raise SystemExit(f"cp={r['cp']}: loss {r['loss']} differs from the single-process loss "
                             f"{base['reference_loss']}")
    meta = dict(machine=platform.machine(), cpu_count=os.cpu_count(), python=platform.python_version(),
                torch=torch.__version__, platform=platform.platform(), model="tiny-moe", seq=args.seq,
                repeats=repeats)
    print(f"# {meta['platform']}, {meta['cpu_count']} CPUs, python {meta['python']}, torch {meta['torch']}")
    print(f"# tiny-moe, one sequence of {args.seq} tokens, fp32; losses equal the single-process loss")
    print(f"{'cp':>3} {'saved MB':>9} {'vs cp=1':>8} {'ideal':>6} {'planner':>8} {'fwd+bwd ms':>11} {'vs cp=1':>8}")
    for r in rows:
        print(f"{r['cp']:>3} {r['saved_bytes'] / 1e6:>9.1f} {r['saved_over_cp1']:>8.3f} {1 / r['cp']:>6.3f} "
              f"{r['planned_over_cp1']:>8.3f} {r['step_s'] * 1e3:>11.0f} {r['time_over_cp1']:>8.2f}")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "context_parallel.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    write_png(rows, os.path.join(OUT, "context_parallel.png"))
    print(f"wrote {OUT}/context_parallel.json and context_parallel.png")


if __name__ == "__main__":
    main()
