"""ParallelOptions: how `parallelize` applies a layout, everything but the sizes (those are a ParallelDims).

Built once from the job config (moeflow.train.build.parallel_options) or by hand; the defaults are a plain fp32
run with one forward per step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelOptions:
    # How the MoE layers move tokens under expert parallelism (moeflow.parallel.expert.ExpertParallelDispatcher):
    ep_backend: str = "auto"  # a moeflow.ep backend
    ep_overlap: bool | None = None  # dispatch the next chunk while this one computes (None: where it pays)
    ep_chunks: int = 1  # chunks each micro-batch's tokens are moved in
    ep_num_worst_tokens: int = 0  # receive buffers sized for the worst case (no host sync); -1: every token
    # What the blocks run as:
    activation_checkpointing: str = "none"  # 'none', 'full' or 'every-N' (moeflow.parallel.recompute)
    compile: bool = False  # torch.compile each block
    fp8: str = "none"  # 'none', 'tensorwise', 'rowwise' or 'mxfp8' (moeflow.parallel.fp8)
    autocast_dtype: torch.dtype | None = None  # torch.bfloat16: bf16 autocast, fp32 weights and optimizer state
    # The step:
    microbatches: int = 1  # forwards per step (pipeline micro-batches, or gradient accumulation)
    # loss_fn(logits, targets, reduction='sum') -> the summed loss over targets that are not -100 (the runner
    # scales it); None: moeflow.parallel.loss.tp_loss. With multi-token prediction parallelize adds the MTP loss.
    loss_fn: Callable | None = None
    # Pipeline parallelism:
    pp_boundaries: tuple[int, ...] | None = None  # the first layer of each stage (None: an even split)
    pp_microbatch_shape: tuple | None = None  # (rows, seq, logits dtype) of a micro-batch: skips shape inference
    # Tensor parallelism: {module-name pattern: ParallelStyle}; None: moeflow.parallel.tensor.tp_plan(model)
    tp_plan: dict | None = None
    device_type: str | None = None  # None: 'cuda' where available, else 'cpu'
    # ZeRO-Offload: 'params' keeps the FSDP shards (weights, gradients, optimizer state) in host memory
    offload: str = "none"

    def resolved_device_type(self) -> str:
        return self.device_type or ("cuda" if torch.cuda.is_available() else "cpu")

    def autocast(self) -> Callable[[], contextlib.AbstractContextManager]:
        """A factory of the context every forward runs under (autocast in `autocast_dtype`, or nothing)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext
        return functools.partial(torch.autocast, self.resolved_device_type(), dtype=self.autocast_dtype)
