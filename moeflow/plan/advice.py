"""A recommendation in words, mapped onto the common rule-of-thumb chart:

  < 32 GPUs and < 13B params            -> HF Trainer + ZeRO-3, or FSDP              (family 'fsdp')
  32 - 512 GPUs                          -> FSDP / DeepSpeed, or Megatron             (family 'fsdp_or_megatron')
  > 512 GPUs, or > 70B params, or MoE    -> Megatron-Core / NeMo, or Megatron-DeepSpeed (family 'megatron')

The chart picks the tool family; the planner's best layout says which knobs, and whether the chart's
choice is forced (e.g. TP/PP needed to fit) or only customary.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.plan.layout import Job
from moeflow.plan.search import Result

FAMILIES = {
    "fsdp": "Hugging Face Trainer with DeepSpeed ZeRO-3, or PyTorch FSDP",
    "fsdp_or_megatron": "PyTorch FSDP / DeepSpeed, or Megatron-LM",
    "megatron": "Megatron-Core / NeMo, or Megatron-DeepSpeed",
}


@dataclass
class Advice:
    family: str
    tools: str
    text: str


def advise(job: Job, best: Result) -> Advice:
    cfg, n = job.model, job.world
    params = cfg.num_params()
    lay = best.layout
    reasons = []
    if cfg.is_moe or n > 512 or params > 70e9:
        family = "megatron"
        if cfg.is_moe:
            reasons.append(f"it is an MoE ({cfg.moe.num_experts} experts, top-{cfg.moe.top_k}), which needs "
                           "expert parallelism and a token dispatcher")
        if n > 512:
            reasons.append(f"{n} GPUs is past the ~512 where plain data parallelism stops scaling")
        if params > 70e9:
            reasons.append(f"{params / 1e9:.0f}B parameters is past ~70B")
    elif n < 32 and params < 13e9:
        family = "fsdp"
        reasons.append(f"{n} GPUs and {params / 1e9:.1f}B parameters: sharded data parallelism is enough")
    else:
        family = "fsdp_or_megatron"
        reasons.append(f"{n} GPUs and {params / 1e9:.1f}B parameters sit in the middle of the chart")
    needs_model_split = lay.tp > 1 or lay.pp > 1 or lay.ep > 1
    if family == "fsdp_or_megatron":
        reasons.append("the best layout " + ("splits the model (TP/PP/EP), which favours Megatron"
                                             if needs_model_split else "is pure sharded data parallel, so "
                                             "FSDP / DeepSpeed is the simpler choice"))
    layout = (f"dp_replicate={lay.dp_replicate} dp_shard={lay.dp_shard} tp={lay.tp} pp={lay.pp} ep={lay.ep} "
              f"{f'cp={lay.cp} ' if lay.cp > 1 else ''}"
              f"ZeRO-{lay.zero}{'' if lay.offload == 'none' else ' with offload'}, micro-batch {lay.micro_batch}, "
              f"activation checkpointing {lay.activation_checkpointing}")
    if lay.offload != "none":
        reasons.append(f"nothing fits in {job.gpu.memory_gb:.0f} GB per GPU without ZeRO-Offload: "
                       f"parallel.offload = '{lay.offload}' keeps {best.memory_gb['host']:.1f} GB per GPU in host "
                       f"memory, "
                       f"at {best.time.get('offload_s', 0.0):.2f} s of PCIe copies and host optimizer step per step")
    text = (f"Use {FAMILIES[family]} (or moeflow with the same layout): {'; '.join(reasons)}. "
            f"Best predicted layout: {layout}, {best.time['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
            f"MFU {best.time['mfu']:.0%}, {best.memory_gb['total']:.1f} of {job.gpu.memory_gb:.0f} GB.")
    return Advice(family, FAMILIES[family], text)
