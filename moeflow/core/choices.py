"""Every setting that takes one of a fixed set of values, written once.

The config checks (moeflow/config.py, moeflow/core/model_config.py), `moeflow train --help-config`, the code that
acts on a value (moeflow.ep.Buffer, parallel/fp8.py, parallel/recompute.py) and the planner read these tuples; a new
choice is added here and nowhere else. The pipeline schedules are moeflow/core/schedules.py's SCHEDULES (each
carries what the trainer needs to know about it); SETTINGS lists them with the rest.
"""

from __future__ import annotations

from moeflow.core.schedules import SCHEDULES

FP8_RECIPES = ("none", "tensorwise", "rowwise", "mxfp8")  # torchao's Float8 recipes, and MXFP8
EP_TRANSPORTS = ("alltoall", "hierarchical", "allgather")  # moeflow.ep's own token movers, any torch backend
EP_LIBRARIES = ("deep_ep", "uccl")  # the installed `deep_ep` package behind moeflow.ep.Buffer
EP_BACKENDS = ("auto", *EP_TRANSPORTS, *EP_LIBRARIES)
# The EP group sizes DeepEP V1 has tuned kernels for (the keys of its Buffer.get_dispatch_config): one node, then
# several.
DEEP_EP_NODE_SIZES = (2, 4, 8)
DEEP_EP_GROUP_SIZES = (*DEEP_EP_NODE_SIZES, 16, 24, 32, 48, 64, 96, 128, 144, 160)
# 'every-N' stands for every-1, every-2, ...: recompute every N-th block.
ACTIVATION_CHECKPOINTING = ("none", "full", "every-N")
# What the planner models: 'selective' (attention scores recomputed) is what 'none' already keeps under flash
# attention, which the trainer uses, so the planner lists 'none' and 'full' for runs and 'selective' for reference.
PLANNED_ACTIVATION_CHECKPOINTING = ("none", "selective", "full")
AUX_LOSS_TYPES = ("micro_batch", "sequence", "global_batch")
SCORE_FUNCS = ("softmax", "sigmoid")
ATTENTIONS = ("gqa", "mla")
QK_NORMS = ("none", "per_head", "full")
DROP_POLICIES = ("position", "probs")
ROPE_SCALINGS = ("none", "llama3", "yarn")
LOAD_BALANCE = ("aux_free", "none")
EXPERT_IMPLS = ("auto", "grouped_mm", "bmm", "loop")
# model.hf_impl: which code runs a Hugging Face folder (moeflow/models/hf_transformers.py)
HF_IMPLS = ("auto", "native", "transformers")
TRAINING_DTYPES = ("fp32", "bf16")
ON_NONFINITE = ("stop", "skip")
DEVICES = ("auto", "cpu", "cuda")
TOKEN_DTYPES = ("uint16", "uint32")
DATA_FORMATS = ("text", "chat", "instruction")
OVERLONG = ("truncate", "drop", "error")
PEFT_METHODS = ("none", "lora")
OPTIMIZERS = ("adamw", "muon")
MUON_LR_ADJUSTMENTS = ("match_rms_adamw", "original")
OFFLOADS = ("none", "optimizer", "params")

# setting -> its choices, for the checks and --help-config
SETTINGS: dict[str, tuple[str, ...]] = {
    "model.attention": ATTENTIONS,
    "model.qk_norm": QK_NORMS,
    "model.rope_scaling.type": ROPE_SCALINGS,
    "model.moe.score_func": SCORE_FUNCS,
    "model.moe.load_balance": LOAD_BALANCE,
    "model.moe.expert_impl": EXPERT_IMPLS,
    "model.hf_impl": HF_IMPLS,
    "model.moe.aux_loss_type": AUX_LOSS_TYPES,
    "model.moe.drop_policy": DROP_POLICIES,
    "training.dtype": TRAINING_DTYPES,
    "training.on_nonfinite": ON_NONFINITE,
    "training.device": DEVICES,
    "training.fp8": FP8_RECIPES,
    "training.activation_checkpointing": ACTIVATION_CHECKPOINTING,
    "data.token_dtype": TOKEN_DTYPES,
    "data.format": DATA_FORMATS,
    "data.overlong": OVERLONG,
    "parallel.ep_backend": EP_BACKENDS,
    "parallel.pp_schedule": tuple(SCHEDULES),
    "parallel.offload": OFFLOADS,
    "peft.method": PEFT_METHODS,
    "training.optimizer": OPTIMIZERS,
    "training.muon_adjust_lr": MUON_LR_ADJUSTMENTS,
}


def recompute_every(mode: str) -> int | None:
    """training.activation_checkpointing -> recompute every N-th block (1 for 'full'), 0 for 'none', None when the
    value is not one of ACTIVATION_CHECKPOINTING."""
    if mode == "none":
        return 0
    if mode == "full":
        return 1
    if mode.startswith("every-") and mode[6:].isdigit() and int(mode[6:]) > 0:
        return int(mode[6:])
    return None
