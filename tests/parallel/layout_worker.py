"""Train several parallel layouts inside one launch of `world` gloo processes (start-up dominates here).

Each case is (name, argv overrides, run_dir, resume): the worker calls the real trainer, which writes
metrics.jsonl and a checkpoint to run_dir; the test compares both against a single-process run.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

# The model, data and steps every layout trains, and the layouts, by world size (tests/parallel/test_layouts.py;
# test_faults and test_layouts_objective reuse them).
BASE = [
    "--model.name=tiny-moe", "--model.dim=32", "--model.n_layers=4", "--model.n_heads=4",
    "--model.n_kv_heads=2", "--model.ffn_dim=64", "--model.moe.ffn_dim=32", "--model.moe.num_experts=4",
    "--data.seq_len=16", "--data.max_bytes=60000", "--training.global_batch=8", "--training.warmup_steps=1",
    "--training.lr=3e-3", "--metrics.log_every=1", "--metrics.tensorboard=false", "--eval.every=0",
    "--eval.batches=1", "--training.steps=3",
]
LAYOUTS = {
    2: {
        "dp2-zero1": ["--parallel.zero=1"],
        "zero1-accumulate": ["--parallel.zero=1", "--training.micro_batch=1"],
        "zero1-ep2": ["--parallel.zero=1", "--parallel.ep=2"],
        "zero1-tp2": ["--parallel.zero=1", "--parallel.tp=2"],
        "zero1-pp2": ["--parallel.zero=1", "--parallel.pp=2"],
        "dp2-zero2": ["--parallel.zero=2"],
        "dp2-zero3": ["--parallel.zero=3"],
        "ep2": ["--parallel.ep=2"],
        "ep2-chunks2-static": ["--parallel.ep=2", "--parallel.ep_overlap_chunks=2",
                               "--parallel.ep_num_worst_tokens=-1"],
        "ep2-overlap": ["--parallel.ep=2", "--parallel.ep_overlap=true"],  # the CPU default is off
        "tp2": ["--parallel.tp=2"],  # the MoE folded: experts over the 2 tp ranks, each routing its tokens
        "tp2-moe-replicated": ["--parallel.tp=2", "--parallel.ep_over_tp=false"],
        "pp2-gpipe": ["--parallel.pp=2", "--parallel.pp_schedule=GPipe"],
        "pp2-1f1b": ["--parallel.pp=2", "--parallel.pp_schedule=1F1B"],
        "pp2-interleaved": ["--parallel.pp=2", "--parallel.pp_schedule=Interleaved1F1B"],
        "pp2-zbv": ["--parallel.pp=2", "--parallel.pp_schedule=ZBVZeroBubble"],
        "cp2": ["--parallel.cp=2"],
        "cp2-ep2": ["--parallel.cp=2", "--parallel.ep=2"],  # EP borrows the two cp ranks
    },
    4: {
        "hsdp2x2": ["--parallel.dp_replicate=2"],
        "ep4": ["--parallel.ep=4"],
        "ep2-dp4": ["--parallel.ep=2"],
        "tp2-dp2": ["--parallel.tp=2"],
        "pp2-dp2": ["--parallel.pp=2"],
        "ep2-tp2": ["--parallel.ep=2", "--parallel.tp=2"],
        "ep2-pp2": ["--parallel.ep=2", "--parallel.pp=2"],
        "hsdp2x2-ep2": ["--parallel.dp_replicate=2", "--parallel.ep=2"],
        "cp2-tp2": ["--parallel.cp=2", "--parallel.tp=2"],
        "cp2-ep2-dp2": ["--parallel.cp=2", "--parallel.ep=2"],
        "cp2-pp2": ["--parallel.cp=2", "--parallel.pp=2"],
        "zero1-cp2-ep2": ["--parallel.zero=1", "--parallel.cp=2", "--parallel.ep=2"],
    },
    8: {
        "tp2-pp2-dp2": ["--parallel.tp=2", "--parallel.pp=2"],
        "ep2-tp2-pp2": ["--parallel.ep=2", "--parallel.tp=2", "--parallel.pp=2"],
        "zero1-hsdp2x2-ep2": ["--parallel.zero=1", "--parallel.dp_replicate=2", "--parallel.ep=2"],
    },
}


def launch(world: int, cases: list[tuple[str, list[str], str, bool]]) -> dict[str, str]:
    """Run the cases on `world` processes; -> {case name: 'ok' or the first rank's traceback}."""
    from tests.support.dist_harness import launch as harness_launch

    # A short collective timeout: a case that fails on one rank leaves its peers waiting until it expires.
    results = harness_launch(world, cases, _run_case, setup=_trainer_env, timeout_s=180)  # 8 ranks share 2 cores
    merged = {}
    for name, *_ in cases:
        bad = [r.get(name, "not run (an earlier case failed)") for r in results if r.get(name) != "ok"]
        # The rank that failed first explains it; its peers only report the broken connection.
        bad.sort(key=lambda tb: ("Connection closed" in tb or "not run" in tb, len(tb)))
        merged[name] = bad[0] if bad else "ok"
    return merged


def _trainer_env(rank: int, world: int) -> None:
    """The environment torchrun would give the trainer."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world)})


def _run_case(_, case) -> None:
    from moeflow.config import load_config, parse_overrides
    from moeflow.train.trainer import train

    name, argv, run_dir, resume = case
    cfg = load_config(None, {**parse_overrides(argv), "run_dir": run_dir})
    with _Dtypes(Path(run_dir) / f"dtypes.rank{dist.get_rank()}.json", cfg.model.vocab_size):
        train(cfg, resume=resume, fresh=not resume, progress=False)
    dist.barrier()


FSDP_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


class _Dtypes:
    """What ran in which precision during the case (a loss comparison cannot tell: bf16 and fp32 losses of these
    short runs differ less than the layouts' own summation-order noise). Writes to `path`, each a {dtype: count}:
    "Linear" / "GroupedExperts": output dtypes of every call; "Linear weights" / "GroupedExperts weights": the
    weight dtype those modules held when called (under FSDP, the dtype it gathered them in), with the output head's
    (the Linear with `vocab_size` outputs) apart as "head weights"; "fp32 modules": the weights of every RMSNorm
    and moeflow Router's gate when called; and "all-gathered bytes": the bytes each rank sent in FSDP2's
    all-gathers, by dtype."""

    def __init__(self, path: Path, vocab_size: int):
        self.path, self.vocab_size = path, vocab_size
        self.counts = {k: Counter() for k in ("Linear", "GroupedExperts", "Linear weights", "GroupedExperts weights",
                                              "head weights", "fp32 modules", "all-gathered bytes")}

    def _hook(self, module, _inputs, output) -> None:
        from moeflow.models.layers import RMSNorm
        from moeflow.models.moe import GroupedExperts, Router

        kind = "Linear" if isinstance(module, torch.nn.Linear) else (
            "GroupedExperts" if isinstance(module, GroupedExperts) else None)
        if kind is not None and isinstance(output, torch.Tensor):
            self.counts[kind][str(output.dtype)] += 1
            weight = module.weight if kind == "Linear" else module.w1
            head = kind == "Linear" and module.out_features == self.vocab_size
            self.counts["head weights" if head else f"{kind} weights"][str(weight.dtype)] += 1
        if isinstance(module, (RMSNorm, Router)):
            weight = module.weight if isinstance(module, RMSNorm) else module.gate.weight
            self.counts["fp32 modules"][str(weight.dtype)] += 1

    def _all_gather(self, output, input, *args, **kwargs):
        self.counts["all-gathered bytes"][str(input.dtype)] += input.numel() * input.element_size()
        return self.all_gather(output, input, *args, **kwargs)

    def __enter__(self):
        self.handle = torch.nn.modules.module.register_module_forward_hook(self._hook)
        # FSDP2 calls it by name: all_gather_single since torch 2.13, all_gather_into_tensor before
        self.all_gather = getattr(dist, FSDP_ALL_GATHER)
        setattr(dist, FSDP_ALL_GATHER, self._all_gather)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()
        setattr(dist, FSDP_ALL_GATHER, self.all_gather)
        self.path.write_text(json.dumps({k: dict(v) for k, v in self.counts.items()}))
