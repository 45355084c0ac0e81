"""Measure this machine so the planner can be checked here: matmul FLOP/s and gloo all-reduce bandwidth.

torch is imported inside the functions only (the rest of moeflow.plan stays torch-free). The result is a
GPU entry named 'cpu-calibrated' whose peak is the measured large-matmul rate (efficiency 1.0) and whose
small-matmul fall-off `half_tokens` is fitted from two sizes: rate(n) = peak * n / (n + half_tokens), and
kept as the roofline's bandwidth (hbm_gbps = peak / half_tokens), which moeflow.plan.compute uses.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

from moeflow.core.hardware import GPU

WIDTH = 512  # K = N of the measured matmuls; M (tokens) varies


def matmul_flops(tokens: int, width: int = WIDTH, repeats: int = 5) -> float:
    """Median FLOP/s of a [tokens, width] @ [width, width] fp32 matmul (2*M*N*K FLOPs)."""
    import torch

    a_MK, b_KN = torch.randn(tokens, width), torch.randn(width, width)
    iters = max(1, int(4e8 // (2 * tokens * width * width)))  # ~0.4 GFLOP per timed repeat
    for _ in range(2):
        a_MK @ b_KN  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            a_MK @ b_KN
        times.append((time.perf_counter() - t0) / iters)
    return 2 * tokens * width * width / sorted(times)[len(times) // 2]


def _allreduce_worker(rank: int, port: int, nbytes: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.ones(nbytes // 4)
    for _ in range(2):
        dist.all_reduce(x)
    times = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out_path, "w") as f:
            f.write(str(sorted(times)[len(times) // 2]))
    dist.destroy_process_group()


def allreduce_gbps(nbytes: int = 4 << 20) -> float:
    """Per-rank bandwidth (GB/s) of a 2-process gloo ring all-reduce: 2(n-1)/n * bytes / time, n = 2."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t")
        mp.spawn(_allreduce_worker, args=(port, nbytes, out), nprocs=2, join=True)
        with open(out) as f:
            t = float(f.read())
    return nbytes / t / 1e9


def calibrate(gpus_per_node: int = 2) -> GPU:
    """A 'cpu-calibrated' GPU entry from measurements on this machine.

    The matmuls run in fp32 on the CPU; the entry files that rate under bf16 so `--precision bf16` (the
    default) plans with what was measured.
    """
    small, large = 32, 1024
    f_small, f_large = matmul_flops(small), matmul_flops(large)
    # rate(n) = P n / (n + h); ratio = s (l + h) / (l (s + h))  =>  h = s l (1 - ratio) / (ratio l - s)
    ratio = f_small / f_large
    h = max(1.0, (large * small * (1 - ratio)) / max(ratio * large - small, 1e-9))
    peak = f_large * (large + h) / large
    bw = allreduce_gbps()
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / gpus_per_node
    # The fitted fall-off is expressed as the roofline's memory bandwidth: a matmul of M rows against a large
    # weight does about M FLOPs per byte, so rate(M) halves at M = peak / bandwidth (GPU.half_tokens).
    return GPU("cpu-calibrated", peak / 1e12, None, mem_gb, bw, bw,
               f"measured here: fp32 matmul {f_small / 1e9:.1f}/{f_large / 1e9:.1f} GFLOP/s at M={small}/{large}, "
               f"gloo all-reduce {bw:.2f} GB/s", hbm_gbps=peak / h / 1e9, matmul_efficiency=1.0, efficiency=1.0)
