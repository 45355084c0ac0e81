"""Metrics: RUN_DIR/metrics.jsonl (one JSON object per logged step), TensorBoard events, MFU, memory."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch


def peak_flops_per_device(device: torch.device, dtype: str) -> float | None:
    """Dense peak FLOP/s of this device from moeflow.plan's hardware table; None ("unknown") when the
    device is not in the table, e.g. any CPU. Never a guess."""
    if device.type != "cuda":
        return None
    from moeflow.core.hardware import GPUS

    name = torch.cuda.get_device_name(device).upper()
    memory_gb = torch.cuda.get_device_properties(device).total_memory / 2**30
    for gpu in GPUS.values():
        family = gpu.name.split("-")[0].upper()
        if family in name and family.startswith("H") and ("PCIE" in name or "NVL" in name):
            return None  # Hopper's PCIe / NVL boards peak below the SXM part the table lists (H100 PCIe: 756)
        if family in name and (not gpu.name.endswith("GB") or abs(gpu.memory_gb - memory_gb) < 8):
            # bf16 tensor-core peak, for fp32 training too (its matmuls run at TF32 only where the user has set
            # torch.backends.cuda.matmul.allow_tf32; either way below the bf16 peak).
            return gpu.bf16_tflops * 1e12
    return None


def peak_memory_mb(device: torch.device) -> float:
    """The CUDA memory the caching allocator held at its peak (what an out-of-memory error compares with, beyond the
    tensors allocated), or this process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


class MetricsLogger:
    """Writes on rank 0 only; other ranks get a logger that does nothing."""

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool, wandb=None):
        """wandb: a moeflow.train.run_outputs.WandbSink (rank 0), or None."""
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        self.wandb = wandb if enabled else None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(step, values)
        if self.tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(key, value, step)
                elif isinstance(value, dict):
                    for sub, v in value.items():
                        if isinstance(v, (int, float)):
                            self.tb.add_scalar(f"{key}/{sub}", v, step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.close()
