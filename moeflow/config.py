"""Typed job config: dataclasses with a docstring per field, TOML files, `--section.key=value` overrides.

Every key and value is checked before any process group exists, so a typo ends in a message naming
the key and the closest valid one instead of a traceback (or a hang) minutes into a run.
No torch import here.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from moeflow.errors import check_choice, closest
from moeflow.layout import BatchSplit, ParallelDims
from moeflow.models.config import ModelConfig, MoEConfig
from moeflow.models.presets import get_preset


@dataclass
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (this Python's own standard-library sources: no download), a text file, a folder,
    a .jsonl file with a 'text' field, or a pre-tokenized .bin file."""
    tokenizer: str = "auto"
    """'byte', a path to a Hugging Face tokenizer.json, or 'auto' (tokenizer.json beside the data, else byte)."""
    token_dtype: str = "uint16"
    """Element type of a .bin token file: 'uint16' or 'uint32'."""
    seq_len: int = 128
    """Tokens per training sequence."""
    val_fraction: float = 0.05
    """Share of the token stream (its tail) held out for validation."""
    max_bytes: int = 4_000_000
    """Cap on the text read for the 'stdlib' corpus and folders (keeps start-up short)."""


@dataclass
class TrainingConfig:
    steps: int = 300
    """Optimizer steps to train for."""
    stop_at: int = 0
    """Stop (after a checkpoint) at this step, e.g. to fit a time-limited allocation; the schedule still
    spans training.steps and a later run resumes. 0 = run to training.steps."""
    seed: int = 0
    """Seed for weights, data order and everything random."""
    global_batch: int = 16
    """Sequences per optimizer step, over all ranks (so the layout never changes what a step trains on)."""
    micro_batch: int = 0
    """Sequences per forward on one rank; 0 = the rank's whole share (no gradient accumulation)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int = 20
    """Linear warm-up steps before the cosine decay."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    dtype: str = "fp32"
    """'fp32', or 'bf16' (autocast; weights and optimizer state stay fp32)."""
    activation_checkpointing: str = "none"
    """'none', 'full' (recompute every block), or 'every-N' (every N-th block)."""
    compile: bool = False
    """torch.compile each transformer block (the first steps are slower while it compiles)."""
    fp8: str = "none"
    """FP8 matmuls through torchao: 'none', 'tensorwise', 'rowwise' or 'mxfp8'. Dense and attention Linear layers
    and the routed experts compute in FP8; router, output head, embeddings and norms stay high precision, and so do
    weights, optimizer state and checkpoints. Needs an FP8 GPU; a CPU emulates (tests; refused for an MoE model
    with tensorwise/rowwise, whose FP8 grouped GEMM has no emulation). See moeflow/parallel/fp8.py."""
    on_nonfinite: str = "stop"
    """What a NaN/Inf loss does: 'stop' (error naming the step) or 'skip' (drop that step's update)."""
    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu' or 'cuda'."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate dimension)."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP); -1 = the rest of the world size."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size (borrowed from the data-parallel ranks)."""
    zero: int = 3
    """ZeRO stage: 1 (replicated weights, one gradient all-reduce, ZeroRedundancyOptimizer), 2 or 3 (FSDP2)."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV."""
    pp_microbatches: int = 0
    """Pipeline micro-batches per step; 0 = per-rank batch / training.micro_batch (one sequence each if unset)."""
    ep_backend: str = "auto"
    """moeflow.ep backend: 'auto', 'alltoall', 'hierarchical', 'allgather'."""


@dataclass
class EvalConfig:
    every: int = 50
    """Validate every this many steps (and at the end); 0 = only at the end."""
    batches: int = 4
    """Validation batches (of training.global_batch sequences) per validation."""


@dataclass
class MetricsConfig:
    log_every: int = 10
    """Write a metrics line every this many steps."""
    tensorboard: bool = True
    """Also write TensorBoard event files to RUN_DIR/tb."""


@dataclass
class CheckpointConfig:
    every: int = 100
    """Save every this many steps (and at the end); 0 = only at the end."""
    keep: int = 2
    """Keep the newest this many complete checkpoints."""
    enabled: bool = True
    """Write checkpoints at all."""


@dataclass
class JobConfig:
    run_dir: str = "runs/default"
    """Where metrics, TensorBoard files and checkpoints go."""
    model: ModelConfig = field(default_factory=lambda: get_preset("tiny-moe"))
    """The model: model.name picks a preset; any other model.* key overrides it."""
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> JobConfig:
        if self.model.hf_path:  # the architecture comes from the folder's config.json
            from moeflow.models.hf import training_config

            self.model = training_config(self.model)
        self.model.validate()
        t = self.training
        check_choice("training.dtype", t.dtype, ("fp32", "bf16"))
        check_choice("training.on_nonfinite", t.on_nonfinite, ("stop", "skip"))
        check_choice("training.device", t.device, ("auto", "cpu", "cuda"))
        check_choice("training.fp8", t.fp8, ("none", "tensorwise", "rowwise", "mxfp8"))
        if t.fp8 != "none":
            self._validate_fp8()
        ac = t.activation_checkpointing
        if ac not in ("none", "full") and not (ac.startswith("every-") and ac[6:].isdigit() and int(ac[6:]) > 0):
            raise ValueError(
                f"training.activation_checkpointing = {ac!r}; use 'none', 'full' or 'every-N' (e.g. 'every-2')"
            )
        for key in ("steps", "global_batch"):
            if getattr(t, key) <= 0:
                raise ValueError(f"training.{key} must be positive, got {getattr(t, key)}")
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len}); "
                f"lower data.seq_len or raise model.max_seq_len"
            )
        if not 0 < self.data.val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.data.val_fraction}")
        check_choice("data.token_dtype", self.data.token_dtype, ("uint16", "uint32"))
        return self

    def _validate_fp8(self) -> None:
        t, m = self.training, self.model
        if self.parallel.tp > 1:
            raise ValueError(f"training.fp8 = {t.fp8!r} with parallel.tp = {self.parallel.tp} is not supported yet "
                             f"(FP8 Linear layers need torchao's float8 tensor-parallel styles); use tp = 1")
        multiple = 32 if t.fp8 == "mxfp8" else 16
        if self.data.seq_len % multiple:
            raise ValueError(f"training.fp8 = {t.fp8!r} reduces over a micro-batch's tokens in blocks of {multiple}; "
                             f"data.seq_len ({self.data.seq_len}) must be a multiple of {multiple}")
        if t.fp8 == "mxfp8" and t.dtype == "bf16":
            raise ValueError("training.fp8 = 'mxfp8' with training.dtype = 'bf16': torchao 0.18's MXFP8 ops do not run "
                             "under autocast (its matmuls meet bf16 and fp32 operands); use training.dtype = 'fp32' "
                             "(the MXFP8 matmuls replace the bf16 ones, the rest stays fp32)")
        if t.compile and t.fp8 == "mxfp8":
            raise ValueError("training.fp8 = 'mxfp8' with training.compile = true: inductor fails on torchao 0.18's "
                             "MXFP8 grouped experts; turn one of them off")
        if t.fp8 == "mxfp8" and m.is_moe and (m.dim % 32 or m.moe.ffn_dim % 32):
            raise ValueError(f"training.fp8 = 'mxfp8' scales blocks of 32 along each expert matmul's inner width: "
                             f"model.dim ({m.dim}) and model.moe.ffn_dim ({m.moe.ffn_dim}) must be multiples of 32")

    def layout(self, world_size: int) -> tuple[ParallelDims, BatchSplit]:
        """The run's parallel sizes and batch split on `world_size` ranks, every rule checked (the one place a
        job's layout is validated; the launcher calls it before starting ranks, each rank once at start)."""
        p, t = self.parallel, self.training
        dims = ParallelDims(world_size, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, ep=p.ep,
                            zero=p.zero, pp_schedule=p.pp_schedule)
        dims.check_model(self.model)
        return dims, dims.split_batch(t.global_batch, t.micro_batch, p.pp_microbatches)


# ---- field docs, keys, types ------------------------------------------------------------------


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (its docstring)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _hints(cls: type) -> dict[str, typing.Any]:
    import moeflow.models.config as model_config

    return typing.get_type_hints(cls, vars(model_config) | globals())


def all_keys(cls: type = JobConfig, prefix: str = "") -> dict[str, tuple[type, str]]:
    """{'training.steps': (int, doc), ...} for every leaf setting."""
    out: dict[str, tuple[type, str]] = {}
    docs, hints = field_docs(cls), _hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(all_keys(hint, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (hint, docs.get(f.name, ""))
    return out


def _convert(key: str, hint, value):
    """Coerce a TOML or command-line value to the field's type, or say what was expected."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) else (hint,)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        if type(None) in allowed:
            return None
    for typ in allowed:
        if typ is type(None):
            continue
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            continue
        if (typ is int and isinstance(value, float)) or (isinstance(value, bool) and typ is not str):
            continue
        try:
            return typ(value)
        except (TypeError, ValueError):
            continue
    names = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise ValueError(f"{key} expects {names}, got {value!r}")


def _set(cfg: JobConfig, key: str, value) -> None:
    keys = all_keys()
    if key not in keys:
        raise ValueError(f"unknown config key '{key}'.{closest(key, keys)} See `moeflow train --help-config`.")
    *path, leaf = key.split(".")
    target = cfg
    for part in path:
        target = getattr(target, part)
    setattr(target, leaf, _convert(key, keys[key][0], value))


def _flatten(table: dict, prefix: str = "") -> dict[str, typing.Any]:
    out = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_overrides(args: list[str]) -> dict[str, str]:
    """['--training.steps=5', '--model.name', 'tiny-dense'] -> {'training.steps': '5', ...}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; settings look like --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ValueError(f"{arg} needs a value: {arg}=VALUE")
        out[key.replace("-", "_")] = value
        i += 1
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, typing.Any] | None = None) -> JobConfig:
    """Defaults <- TOML file <- overrides; model.name (if given) first selects the preset."""
    values: dict[str, typing.Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist; pass --config PATH to a TOML file")
        try:
            values.update(_flatten(tomllib.loads(path.read_text())))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    values.update(overrides or {})
    cfg = JobConfig()
    if "model.name" in values:
        name = str(values["model.name"])
        # 'custom' (what to_toml writes for a model that is no preset) starts from the plain defaults.
        cfg.model = ModelConfig(name="custom") if name == "custom" else get_preset(name)
    for key, value in values.items():
        if key != "model.name":
            _set(cfg, key, value)
    return cfg.validate()


def to_toml(cfg) -> str:
    """The config as TOML (what --print-config shows), one section per dataclass."""
    lines: list[str] = []

    def emit(obj, section: str):
        scalars = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
        plain = [(k, v) for k, v in scalars if not dataclasses.is_dataclass(v)]
        if section:
            lines.append(f"\n[{section}]")
        for k, v in plain:
            if v is None:
                lines.append(f"# {k} = (unset)")
            else:
                lines.append(f"{k} = {_toml_value(v)}")
        for k, v in scalars:
            if dataclasses.is_dataclass(v):
                emit(v, f"{section}.{k}" if section else k)

    emit(cfg, "")
    return "\n".join(lines).strip() + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


__all__ = [
    "JobConfig", "DataConfig", "TrainingConfig", "ParallelConfig", "EvalConfig", "MetricsConfig",
    "CheckpointConfig", "ModelConfig", "MoEConfig", "load_config", "parse_overrides", "to_toml", "all_keys",
]
