"""Typed job config: dataclasses with a docstring per field, TOML files, `--section.key=value` overrides.

Every key and value is checked before any process group exists, so a typo ends in a message naming
the key and the closest valid one instead of a traceback (or a hang) minutes into a run.
No torch import here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import textwrap
import tomllib
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from moeflow.core.blend import parse_blend
from moeflow.core.choices import (
    DEEP_EP_GROUP_SIZES,
    DEEP_EP_NODE_SIZES,
    EP_LIBRARIES,
    SETTINGS,
    recompute_every,
)
from moeflow.core.errors import check_choice, closest
from moeflow.core.model_config import ModelConfig, MoEConfig, grouped_mm_alignment_error
from moeflow.core.parallel_dims import BatchSplit, ParallelDims
from moeflow.core.presets import get_preset
from moeflow.core.schedules import pipeline_layout


@dataclass
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (this Python's own standard-library sources: no download), a text file, a folder of text files,
    a pre-tokenized .bin file, a Megatron indexed dataset (PREFIX, PREFIX.idx or PREFIX.bin with PREFIX.idx
    beside it: read in place, documents under data.packing), a .jsonl/.json/.parquet/.arrow/.csv file or a folder
    of them (read with Hugging Face datasets), hf:NAME[:SPLIT] (the Hub), or a token cache folder written by an
    earlier run."""
    blend: str | list = ""
    """Several sources by weight instead of data.source: "W1 SOURCE1 W2 SOURCE2 ..." (Megatron's --data-path
    syntax; any source data.source takes, with the other data settings), or in a TOML file a list of tables,
    `[[data.blend]]` with `weight`, `source` and that source's own format, overlong, chat_template, tokenizer,
    token_dtype, val_fraction or max_bytes. Each step's sequences follow the weights
    by a fixed schedule (within one sequence of them at every step); each source keeps its own shuffled order and
    epochs and holds out its own validation split; the summary and metrics.jsonl count the tokens trained from
    each."""
    format: str = "text"
    """'text' (a 'text' field, or plain text), 'chat' (a 'messages' list rendered with the tokenizer's chat
    template, loss on the assistant's tokens only) or 'instruction' (Alpaca 'instruction'/'input'/'output',
    rendered as a chat)."""
    packing: bool = False
    """Pack whole documents into each sequence (first-fit); attention never crosses a document and positions
    restart in each. Without it 'text' is one token stream cut into windows and 'chat'/'instruction' put one
    conversation per sequence."""
    overlong: str = "truncate"
    """A document or conversation longer than seq_len + 1 tokens: 'truncate' (keep its start; counted in the
    summary), 'drop' (counted) or 'error'."""
    chat_template: str = ""
    """A Jinja chat template file to use instead of the tokenizer's own ('' = the tokenizer's)."""
    tokenize_workers: int = 0
    """Processes that tokenize records into the cache; 0 = one per core where the launcher (--nproc-per-node) or
    `moeflow train --prepare-data` tokenizes; inside a torchrun job rank 0, or over several nodes one rank per
    node, each its node's share of the records (rank 0 joins them); N > 0 inside a job: rank 0 alone in N
    processes. Any number writes the same cache. Under data.streaming: the processes each rank tokenizes with
    (0 = in the rank itself)."""
    streaming: bool = False
    """Read data.source lazily (record files, a folder, a saved dataset, hf:NAME, text files) and tokenize ahead
    of the step, in a bounded buffer, instead of tokenizing it into a cache first: for corpora too large for that.
    The windows come in the stream's order (unshuffled: shuffle the corpus when writing it), epoch after epoch;
    validation holds out the stream's first eval.batches x training.global_batch windows (not data.val_fraction);
    data.format = 'text' without packing."""
    cache_dir: str = ""
    """Where tokenized datasets are kept, one folder per source, tokenizer and format ('' = RUN_DIR/data-cache)."""
    tokenizer: str = "auto"
    """'byte', a path to a Hugging Face tokenizer.json or tokenizer folder, or 'auto' (model.hf_path's tokenizer,
    else the one beside the data, else byte)."""
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
    """Weight decay, decoupled (not applied to norms and biases)."""
    optimizer: str = "adamw"
    """'adamw', or 'muon': Muon (orthogonalised momentum, torch.optim.Muon's update) on every matrix of the
    blocks - attention and MLP projections, each expert's matrices, MLA's projections - and AdamW (its betas,
    training.muon_adamw_lr) on the embedding, the output head, norms, biases and the routers' gates, as Moonlight's
    recipe. Every layout: each matrix is orthogonalised whole, by one rank. With peft.method = 'lora' the trainable
    matrices are the adapters' factors: Muon takes each of them (an expert's A and B one matrix each)."""
    muon_momentum: float = 0.95
    """Muon's momentum."""
    muon_nesterov: bool = True
    """Muon with Nesterov momentum."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per orthogonalisation (coefficients 3.4445, -4.7750, 2.0315)."""
    muon_adjust_lr: str = "match_rms_adamw"
    """Muon's learning rate per matrix [A, B]: 'match_rms_adamw' lr x 0.2 sqrt(max(A, B)) (the update's RMS
    matches AdamW's, so one lr serves both) or 'original' lr x sqrt(max(1, A / B))."""
    muon_adamw_lr: float = 0.0
    """The AdamW part's peak learning rate under training.optimizer = 'muon'; 0 = training.lr."""
    muon_clip: float = 0.0
    """MuonClip (Kimi K2's qk-clip) with this threshold (K2: 100; 0 = off): after each step, an attention head whose
    largest logit q.k / sqrt(d) in the step exceeded it has its query projection scaled down so that it would not;
    metrics.jsonl logs each layer's largest logit ('max_logit'). Grouped-query attention without q/k norms or MTP
    blocks, under every layout but context parallelism; costs an extra Q K^T per step."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    dtype: str = "fp32"
    """'fp32', or 'bf16' (autocast; weights and optimizer state stay fp32)."""
    activation_checkpointing: str = "none"
    """'full' recomputes every block, 'every-N' every N-th block."""
    compile: bool = False
    """torch.compile each transformer block (the first steps are slower while it compiles)."""
    fp8: str = "none"
    """FP8 matmuls through torchao (the recipe's name). Dense and attention Linear layers
    and the routed experts compute in FP8; router, output head, embeddings and norms stay high precision, and so do
    weights, optimizer state and checkpoints. Needs an FP8 GPU; a CPU emulates (tests; refused for an MoE model
    with tensorwise/rowwise, whose FP8 grouped GEMM has no emulation). See moeflow/parallel/fp8.py."""
    on_nonfinite: str = "stop"
    """What a NaN/Inf loss does: 'stop' (error naming the step) or 'skip' (drop that step's update)."""
    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu' or 'cuda'."""
    step_timeout_s: float = 0.0
    """Hang watchdog: a step (with its end-of-step sync) taking longer than this writes every thread's Python stack
    and the collective it waits in to RUN_DIR/hang-rank{N}.txt and exits with code 124; the first step after a
    start may take 10x as long (compilation, warm-up). 0 = off. Keep it below parallel.timeout_s."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True): deterministic kernels or an error, for bit-identical runs on CUDA
    (slower there). On the CPU runs are bit-identical without it."""


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
    """ZeRO stage, all through FSDP2 (gradients reduce-scattered, AdamW state and fp32 master weights sharded
    over the data-parallel ranks; experts over the expert-data-parallel ones): 1 gathers the parameters once
    per step and keeps them through its micro-batches, 2 from each forward to its backward, 3 per layer."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule (torch.distributed.pipelining's, and DualPipeV)."""
    pp_microbatches: int = 0
    """Pipeline micro-batches per step; 0 = per-rank batch / training.micro_batch (one sequence each if unset)."""
    pp_boundaries: str = ""
    """The first layer of each pipeline stage, comma-separated from 0 (e.g. '0,2' puts layers 0-1 on the first of
    2 stages and the rest on the second; an interleaved schedule has pp x its stages per rank); empty = an even
    split. A model whose layers read another layer's keys and values (Gemma 4's KV sharing) needs a split that keeps
    each reader on its source's stage; its refusal of another names one."""
    ep_over_tp: bool = True
    """With tp > 1, spread the experts over the tp ranks too (EP group ep x tp; each tp rank routes its sequence
    slice: no redundant MoE compute); false computes every MoE layer whole on every tp rank."""
    ep_backend: str = "auto"
    """How EP moves tokens: moeflow.ep's own ('auto' picks 'hierarchical' over several nodes, else 'alltoall'; any
    torch.distributed backend), or the installed `deep_ep` package: 'deep_ep' (DeepEP, or UCCL-EP's drop-in) or
    'uccl' (UCCL-EP's drop-in only). DeepEP needs CUDA GPUs, training.dtype='bf16' (its combine kernels are bf16)
    and an EP size it has kernels for (moeflow/core/choices.py DEEP_EP_GROUP_SIZES). With ep=1 no tokens move and
    it is unused."""
    ep_overlap: bool | None = None
    """Expert parallelism: start each dispatch / combine asynchronously and wait as late as possible (the shared
    experts, and other chunks' experts, compute meanwhile), in forward and backward; results equal off. None
    (default): on for GPUs or ep_overlap_chunks > 1, off for one chunk on a CPU, where gloo's transfers share the
    cores with the experts and asynchrony only costs (about 5% of `make train`'s tokens/s)."""
    ep_overlap_chunks: int = 1
    """Expert parallelism: split each MoE layer's tokens into this many chunks, so one chunk's communication
    is in flight while another's experts compute."""
    ep_num_worst_tokens: int = 0
    """Expert parallelism: 0 = exact receive sizes (one host sync per dispatch for the counts); -1 = static
    sizes that never drop a token (EP ranks x tokens per chunk): no host sync in the MoE layer."""
    timeout_s: float = 120.0
    """Collective timeout in seconds: a rank waiting this long for a peer (dead or hung) fails instead of waiting
    forever. Raise it when a checkpoint save or the first (compiled) step takes longer."""
    max_restarts: int = 0
    """Restart every rank up to this many times after a rank fails (torch.distributed.run's --max-restarts; moeflow
    train then starts its ranks through it, also a single one); each restart resumes from the newest complete
    checkpoint. --max-restarts N overrides it."""
    offload: str = "none"
    """ZeRO-Offload: 'none'; 'optimizer': the optimizer's state (AdamW's with an fp32 master copy, Muon's momentum)
    lives in host memory and its elementwise step runs there (Muon's Newton-Schulz stays on the device), the
    weights and gradients stay on the device (each step copies the gradient shards to the host and the updated
    weights, or Muon's updates, back: 8 bytes per AdamW parameter less on the device, 4 per Muon one); or
    'params': every rank's shards
    of the fp32 weights, their gradients and the optimizer state live in host memory (FSDP2's CPUOffloadPolicy),
    each layer's weights are copied to the device when gathered and its gradient shard back after the
    reduce-scatter, and the optimizer steps on the host. For a model whose state fits no layout on the devices
    (`moeflow plan` recommends it then); it trades PCIe traffic and a host optimizer step for device memory."""
    cp: int = 1
    """Context-parallel size: each sequence is split over cp ranks (rank r keeps chunks r and 2cp-1-r of 2cp,
    which balances causal attention) and attention all-gathers keys and values over them, for sequences longer
    than one rank's memory allows. data.seq_len must be divisible by 2 x cp; parallel.ep may borrow cp ranks."""


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
    straggler_factor: float = 1.5
    """Name in the log and metrics.jsonl ('stragglers') every rank whose busy time per step, over the steps since
    the last metrics line, exceeds this many times the median rank's (the lower median). 0 = off."""
    tensorboard: bool = True
    """Also write TensorBoard event files to RUN_DIR/tb."""
    wandb: bool = False
    """Also log to Weights & Biases (the keys of metrics.jsonl; needs `pip install wandb`; WANDB_MODE=offline
    works without an account)."""
    wandb_project: str = "moeflow"
    """The W&B project runs are logged to."""


@dataclass
class CheckpointConfig:
    every: int = 100
    """Save every this many steps (and at the end); 0 = only at the end."""
    keep_last: int = 2
    """Keep the newest this many complete checkpoints (older ones are deleted once a newer one is complete), so
    checkpoints use at most keep_last + 1 checkpoints' worth of disk. Also accepted as checkpoint.keep."""
    enabled: bool = True
    """Write checkpoints at all."""
    save_hf: bool = False
    """At the end of training (and at training.stop_at), also write RUN_DIR/hf/: the model as a Hugging Face folder
    (the architecture the run started from, in its on-disk format, or the native model's export architecture;
    bf16) with its tokenizer files, each rank writing its share of the tensors from the last checkpoint (no rank
    gathers the model). The same folder `moeflow convert moeflow-to-hf RUN_DIR` writes."""
    async_save: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint.async_save): the step only copies the
    state to host memory (one extra copy of it) and training goes on while it is written; the checkpoint is
    complete (manifest, rename) once the write ends. Also accepted as checkpoint.async."""


@dataclass
class PeftConfig:
    method: str = "none"
    """'none' trains every weight; 'lora' freezes them and trains low-rank adapters beside the layers named by
    peft.modules (and the experts with peft.experts), saved in PEFT's format under RUN_DIR/adapter/."""
    rank: int = 8
    """The adapters' rank r (at most the narrowest adapted layer's width)."""
    alpha: float = 16.0
    """The adapters' scale is alpha / rank (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (peft's lora_dropout); 0 with peft.experts = true (peft's experts adapters
    take none)."""
    modules: str = "auto"
    """The linear layers that get adapters, by name (comma-separated, e.g. 'wq,wv', or 'q_proj,v_proj' on
    transformers' own modules): 'auto' is the attention projections and the SwiGLU MLPs of dense layers and shared
    experts; the routers and the output head stay frozen and unadapted unless named."""
    experts: bool = True
    """Adapt the routed experts too (one adapter per expert on each of their weights, as peft's
    target_parameters)."""


@dataclass
class ProfileConfig:
    enabled: bool = False
    """Profile a window of steps with torch.profiler: each rank writes a Chrome trace (Perfetto,
    chrome://tracing) under RUN_DIR/profile/, and rank 0 prints and writes profile/summary.txt: per phase (the EP
    dispatch, the expert matmuls, the combine, attention, the gradient reduction, the optimizer step, ...) its
    time and share of the step, per rank, the slowest named."""
    start: int = 3
    """The first profiled step (after warm-up: the first steps compile, allocate and fill caches)."""
    steps: int = 2
    """Steps in the window."""
    memory: bool = False
    """Record memory too: on CUDA the allocator's history for the window and a snapshot pickle
    (profile/memory-rank{N}.pickle, also written when a step runs out of memory; open it in
    pytorch.org/memory_viz); on a CPU the resident set size at each phase's end, its peak per phase."""
    ranks: str = ""
    """The ranks that profile, comma-separated (e.g. '0,3'); empty = every rank."""


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
    peft: PeftConfig = field(default_factory=PeftConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def validate(self, given: Iterable[str] = ()) -> JobConfig:
        """Check every setting (one line per refusal), before any process starts. `given`: the keys the user set
        (a config file, the command line), of which a model.* one that model.hf_path's folder decides is refused."""
        if self.model.hf_path:  # the architecture comes from the folder's config.json
            from moeflow.models.hf import training_config

            asked, self.model = self.model, training_config(self.model)
            _check_folder_overrides(asked, self.model, given)
        self.model.validate()
        t = self.training
        for name in ("dtype", "on_nonfinite", "device", "fp8", "optimizer", "muon_adjust_lr"):
            check_choice(f"training.{name}", getattr(t, name), SETTINGS[f"training.{name}"])
        if self.metrics.wandb and importlib.util.find_spec("wandb") is None:  # before any process starts
            raise ValueError("metrics.wandb = true needs the wandb package: pip install -e .[wandb] (or set "
                             "metrics.wandb = false)")
        if self.model.is_moe and self.model.moe.expert_impl == "grouped_mm":  # else a ValueError mid-forward
            itemsize, name = (2, "bf16") if t.dtype == "bf16" else (4, "fp32")
            unaligned = grouped_mm_alignment_error(self.model.dim, self.model.moe.ffn_dim, itemsize, name)
            if unaligned:
                raise ValueError(unaligned)
        p = self.parallel
        if self.model.runs_transformers and p.ep_num_worst_tokens and (p.ep > 1 or (p.tp > 1 and p.ep_over_tp)):
            from moeflow.parallel.parallelize import HF_STATIC_SIZES

            raise ValueError(HF_STATIC_SIZES.format(p.ep_num_worst_tokens))
        if self.model.runs_transformers and p.ep > 1:
            from moeflow.models.hf_transformers import architecture_of, read_config, uses_experts_interface

            if not uses_experts_interface(read_config(self.model.hf_path)):
                raise ValueError(f"parallel.ep = {self.parallel.ep} for {architecture_of(self.model.hf_path)}: its "
                                 f"experts are not transformers' experts interface, which moeflow's expert "
                                 f"parallelism plugs into; use ep = 1 (FSDP2 shards them with the rest)")
        if t.fp8 != "none" and self.model.runs_transformers:
            raise ValueError(f"training.fp8 = {t.fp8!r} for {self.model.hf_path} on transformers' own modules is "
                             f"not supported yet; use training.fp8 = 'none', or model.hf_impl = 'native' where moeflow "
                             f"maps the architecture")
        if t.fp8 != "none":
            self._validate_fp8()
        ac = t.activation_checkpointing
        if recompute_every(ac) is None:
            raise ValueError(f"training.activation_checkpointing = {ac!r}; use one of "
                             f"{list(SETTINGS['training.activation_checkpointing'])} (e.g. 'every-2')")
        for key in ("steps", "global_batch"):
            if getattr(t, key) <= 0:
                raise ValueError(f"training.{key} must be positive, got {getattr(t, key)}")
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len}); "
                f"lower data.seq_len or raise model.max_seq_len"
            )
        if self.data.tokenize_workers < 0:
            raise ValueError(f"data.tokenize_workers = {self.data.tokenize_workers}; use 0 (one per core) or more")
        _check_source_settings(self.data, "data")
        if self.data.streaming:
            self._validate_streaming()
        if self.data.blend:
            blend_sources(self.data)
        check_choice("parallel.ep_backend", p.ep_backend, SETTINGS["parallel.ep_backend"])
        check_choice("parallel.offload", p.offload, SETTINGS["parallel.offload"])
        if p.ep_overlap_chunks < 1:
            raise ValueError(f"parallel.ep_overlap_chunks must be at least 1, got {p.ep_overlap_chunks}")
        if self.pipeline_boundaries() is not None and p.pp == 1:
            raise ValueError(f"parallel.pp_boundaries = {p.pp_boundaries!r} with parallel.pp = 1: there is one stage; "
                             f"set parallel.pp, or leave pp_boundaries empty (--parallel.pp_boundaries=)")
        if p.ep_num_worst_tokens not in (0, -1):
            # moeflow.ep.Buffer takes a row count (DeepEP's num_worst_tokens) and drops what does not fit; training
            # would lose tokens without a word, so the trainer offers only the sizes that never drop one
            raise ValueError(f"parallel.ep_num_worst_tokens = {p.ep_num_worst_tokens}; use 0 (exact sizes) or -1 "
                             f"(static sizes that never drop a token)")
        if self.model.mtp_depth and self.data.packing:
            raise ValueError(f"data.packing = true with model.mtp_depth = {self.model.mtp_depth}: the MTP modules "
                             f"predict across document boundaries (no document masks yet); set data.packing = false")
        if p.cp > 1 and self.data.packing:
            raise ValueError(f"data.packing = true with parallel.cp = {p.cp}: context parallelism computes plain "
                             f"causal attention over whole sequences, not per-document masks; set "
                             f"data.packing = false or parallel.cp = 1")
        self._validate_fault_settings()
        self._validate_peft()
        self._validate_muon()
        self._validate_profile()
        self._validate_save_hf()
        return self

    def _validate_streaming(self) -> None:
        d = self.data
        if d.blend:
            raise ValueError("data.streaming = true with data.blend is not supported yet; blend sources tokenized "
                             "up front (drop data.streaming), or stream a single data.source")
        if d.format != "text" or d.packing:
            what = f"data.format = {d.format!r}" if d.format != "text" else "data.packing = true"
            raise ValueError(f"data.streaming = true with {what}: streaming reads a token stream of 'text' records; "
                             f"use data.format = 'text' without packing, or drop data.streaming")
        from moeflow.data.megatron import megatron_prefix
        from moeflow.data.records import resolve
        from moeflow.data.token_cache import is_cache_folder

        if megatron_prefix(d.source) is not None or d.source.endswith(".bin") or is_cache_folder(d.source):
            raise ValueError(f"data.streaming = true with data.source = {d.source!r}: it is tokenized already and "
                             f"read in place without loading it; drop data.streaming")
        resolve(d.source)  # a missing file or folder: one line now, not in every rank

    def _validate_save_hf(self) -> None:
        if not self.checkpoint.save_hf:
            return
        if not self.checkpoint.enabled:
            raise ValueError("checkpoint.save_hf = true with checkpoint.enabled = false: the folder is written from "
                             "the last checkpoint; enable checkpoints or drop save_hf")
        if self.peft.method != "none":
            raise ValueError("checkpoint.save_hf = true on a LoRA run: RUN_DIR/adapter/ holds the adapter; for "
                             "merged weights run `moeflow convert moeflow-to-hf RUN_DIR OUT`")

    def pipeline_boundaries(self) -> tuple[int, ...] | None:
        """parallel.pp_boundaries as ints (None: an even split)."""
        text = self.parallel.pp_boundaries.strip()
        if not text:
            return None
        try:
            return tuple(int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"parallel.pp_boundaries = {text!r}; use the first layer of each stage, comma-separated "
                             f"from 0 (e.g. '0,3'), or leave it empty (--parallel.pp_boundaries=) for an even "
                             f"split") from None

    def _validate_profile(self) -> None:
        pr = self.profile
        if not pr.enabled:
            return
        if pr.start < 1 or pr.steps < 1:
            raise ValueError(f"profile.start = {pr.start}, profile.steps = {pr.steps}: both must be at least 1 "
                             f"(e.g. start = 3 after warm-up, steps = 2)")
        if pr.start > self.training.steps:
            raise ValueError(f"profile.start = {pr.start} is past training.steps = {self.training.steps}; profile an "
                             f"earlier step or train longer")
        self.profiled_ranks()

    def profiled_ranks(self) -> list[int] | None:
        """profile.ranks as ints (None: every rank)."""
        text = self.profile.ranks.strip()
        if not text:
            return None
        try:
            ranks = [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"profile.ranks = {text!r}; use comma-separated rank numbers such as '0,3', or leave "
                             f"it empty for every rank") from None
        if min(ranks) < 0:
            raise ValueError(f"profile.ranks = {text!r}: ranks are 0 or more")
        return ranks

    def _validate_muon(self) -> None:
        t = self.training
        if t.optimizer != "muon":
            if t.muon_clip:
                raise ValueError(f"training.muon_clip = {t.muon_clip} with training.optimizer = {t.optimizer!r}: the "
                                 f"clip is MuonClip's; add --training.optimizer=muon or drop training.muon_clip")
            return
        if t.muon_ns_steps < 1:
            raise ValueError(f"training.muon_ns_steps = {t.muon_ns_steps}; Muon needs at least 1 Newton-Schulz "
                             f"iteration (5 is the usual)")
        if not 0 <= t.muon_momentum < 1:
            raise ValueError(f"training.muon_momentum = {t.muon_momentum}; use a value in [0, 1), e.g. 0.95")
        if t.fp8 != "none":
            raise ValueError(f"training.optimizer = 'muon' with training.fp8 = {t.fp8!r}: FP8 weights are not "
                             f"orthogonalised yet; use training.fp8 = 'none' or training.optimizer = 'adamw'")
        self._validate_muon_clip()

    def _validate_muon_clip(self) -> None:
        t, m = self.training, self.model
        if t.muon_clip < 0:
            raise ValueError(f"training.muon_clip = {t.muon_clip}; use a positive threshold (Kimi K2: 100) or 0 (off)")
        if not t.muon_clip:
            return
        why = ("transformers' own modules do not record the attention logits" if m.runs_transformers else
               "MLA splits each head in parts a per-head query scale does not bound" if m.attention == "mla" else
               f"model.qk_norm = {m.qk_norm!r} renormalises the queries a clip would scale" if m.qk_norm != "none"
               else "context parallelism splits the keys each head's largest logit needs" if self.parallel.cp > 1
               else "the multi-token-prediction blocks' attention is not clipped yet" if m.mtp_depth
               else "compiled blocks do not record the logits" if t.compile
               else "a LoRA run keeps the query projections it would scale frozen" if self.peft.method != "none"
               else f"parallel.offload = {self.parallel.offload!r} keeps the weights it would scale in host memory"
               if self.parallel.offload != "none"
               else None)
        if why:
            raise ValueError(f"training.muon_clip = {t.muon_clip} for this run: {why}; drop training.muon_clip (Muon "
                             f"runs without the clip)")

    def _validate_peft(self) -> None:
        f = self.peft
        check_choice("peft.method", f.method, SETTINGS["peft.method"])
        if f.method == "none":
            return
        if f.rank < 1:
            raise ValueError(f"peft.rank = {f.rank}; use 1 or more (e.g. 8)")
        if f.alpha <= 0:
            raise ValueError(f"peft.alpha = {f.alpha}; use a positive number (e.g. 2 x peft.rank)")
        if not 0 <= f.dropout < 1:
            raise ValueError(f"peft.dropout = {f.dropout}; use a value in [0, 1)")
        if f.dropout and self.model.is_moe:
            raise ValueError(f"peft.dropout = {f.dropout} for a MoE model: peft adapts its experts (and, where "
                             f"their names collide, its MLPs) as weights, which take no dropout, so peft could not "
                             f"load the adapter; use peft.dropout = 0")
        if importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None:
            raise ValueError("peft.method = 'lora' writes its adapter in PEFT's format with the peft and transformers "
                             "packages: pip install -e .[lora] (or set peft.method = 'none')")
        if self.training.fp8 != "none":
            raise ValueError(f"peft.method = 'lora' with training.fp8 = {self.training.fp8!r}: the FP8 recipes "
                             f"replace the linear layers and experts the adapters sit on; use training.fp8 = 'none'")
        from moeflow.models import peft_format
        from moeflow.models.lora import check_targets

        check_targets(self.model, f.rank, f.modules, f.experts)  # on the meta device, as the next: no memory
        peft_format.check(self.model, f)

    def _validate_fault_settings(self) -> None:
        checks = [("parallel.timeout_s", self.parallel.timeout_s > 0, "a positive number of seconds"),
                  ("parallel.max_restarts", self.parallel.max_restarts >= 0, "0 or more"),
                  ("training.step_timeout_s", self.training.step_timeout_s >= 0, "0 (off) or seconds"),
                  ("metrics.straggler_factor", self.metrics.straggler_factor == 0 or self.metrics.straggler_factor > 1,
                   "0 (off) or more than 1, e.g. 1.5"),
                  ("checkpoint.keep_last", self.checkpoint.keep_last >= 1, "1 or more")]
        for key, ok, expected in checks:
            if not ok:
                section, name = key.split(".")
                raise ValueError(f"{key} = {getattr(getattr(self, section), name)}; use {expected}")

    def _validate_fp8(self) -> None:
        t, m = self.training, self.model
        if self.parallel.tp > 1:
            raise ValueError(f"training.fp8 = {t.fp8!r} with parallel.tp = {self.parallel.tp} is not supported yet "
                             f"(FP8 Linear layers need torchao's float8 tensor-parallel styles); use tp = 1")
        multiple = 32 if t.fp8 == "mxfp8" else 16
        cp = self.parallel.cp  # each cp rank holds seq_len / cp positions of every sequence
        if self.data.seq_len % (multiple * cp):
            raise ValueError(f"training.fp8 = {t.fp8!r} reduces over a micro-batch's tokens in blocks of {multiple}; "
                             f"data.seq_len ({self.data.seq_len}) must be a multiple of {multiple}"
                             + (f" x parallel.cp ({cp}) = {multiple * cp}" if cp > 1 else ""))
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
                            zero=p.zero, pp_schedule=p.pp_schedule, ep_over_tp=p.ep_over_tp, cp=p.cp)
        dims.check_model(self.model)
        if self.pipeline_boundaries() is not None:  # (one entry per stage of the schedule, whatever the model)
            self._check_pipeline_boundaries(dims)
        if self.model.runs_transformers and (dims.tp > 1 or dims.pp > 1 or dims.cp > 1):
            self._check_transformers_layout(dims)
        dims.check_sequence(self.data.seq_len)
        if self.profile.enabled and max(self.profiled_ranks() or [0]) >= world_size:
            raise ValueError(f"profile.ranks = {self.profile.ranks!r} names a rank past the {world_size} ranks of "
                             f"this run; use ranks 0 to {world_size - 1}")

        if p.ep_backend in EP_LIBRARIES and dims.ep > 1 and dims.ep not in DEEP_EP_GROUP_SIZES:
            # The library's own config table decides at start-up (UCCL-EP lacks 48 and 96); this is the part
            # both share, checked before any rank starts: DeepEP V1's get_dispatch_config keys.
            raise ValueError(
                f"parallel.ep = {dims.ep} with parallel.ep_backend = {p.ep_backend!r}: DeepEP runs EP groups of "
                f"{', '.join(map(str, DEEP_EP_NODE_SIZES))} (one node) or "
                f"{', '.join(map(str, DEEP_EP_GROUP_SIZES[len(DEEP_EP_NODE_SIZES):]))} ranks; choose one of those for "
                f"parallel.ep, or parallel.ep_backend = 'auto' (moeflow's own dispatch takes any size)"
            )
        return dims, dims.split_batch(t.global_batch, t.micro_batch, p.pp_microbatches)

    def _check_pipeline_boundaries(self, dims: ParallelDims) -> None:
        """parallel.pp_boundaries against the schedule's stages and model.n_layers, in the setting's own words (the
        split's check in moeflow.parallelize also takes per-stage layer lists and module names), with the even split
        in the same form."""
        starts, n, text = self.pipeline_boundaries(), self.model.n_layers, self.parallel.pp_boundaries
        even = pipeline_layout(n, dims.pp, dims.pp_schedule)  # its own line when the stages outnumber the layers
        if len(starts) != len(even):
            why = (f"has {len(starts)} entries for the {len(even)} stages of parallel.pp = {dims.pp} with "
                   f"parallel.pp_schedule = {dims.pp_schedule!r}")
        elif starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])) or starts[-1] >= n:
            why = f"must start at 0 and strictly increase below model.n_layers = {n} (at least one layer a stage)"
        else:
            return
        raise ValueError(f"parallel.pp_boundaries = {text!r} {why}: it is the first layer of each stage, "
                         f"comma-separated (the even split is '{','.join(str(s.layers[0]) for s in even)}')")

    def _check_transformers_layout(self, dims: ParallelDims) -> None:
        """Tensor, pipeline and context parallelism of transformers' own modules: the built-in plan places every
        module of this architecture, its model splits into stages, its attention takes split sequences (checked on
        the meta device: nothing is read)."""
        from moeflow.models.hf_transformers import architecture_of, load
        from moeflow.parallel.adapter import adapter_for
        from moeflow.parallel.tensor import check_plan_covers, tp_plan

        model = load(self.model.hf_path, "meta")
        sizes = (("tp", dims.tp), ("pp", dims.pp), ("cp", dims.cp))
        setting = " x ".join(f"parallel.{k} = {v}" for k, v in sizes if v > 1)
        boundaries = self.pipeline_boundaries()
        if dims.pp > 1 and boundaries is not None:
            setting += f" (parallel.pp_boundaries = {self.parallel.pp_boundaries!r})"
        try:
            adapter_for(model).check(dims, boundaries)
            if dims.tp > 1:  # the built-in plan places every module (a run passes no plan of its own)
                check_plan_covers(model, tp_plan(model, fold_experts=dims.fold_experts))
        except ValueError as e:
            why = str(e).removeprefix(f"{type(model).__name__}: ")  # the line names the architecture already
            instead = "" if "; use " in why else "; use ep and data parallelism instead"
            raise ValueError(f"{setting} for {architecture_of(self.model.hf_path)} on transformers' own modules: "
                             f"{why}{instead}") from None


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


def blend_sources(data: DataConfig) -> list[tuple[float, DataConfig]]:
    """data.blend as [(weight, the data settings its source is read with)]: the run's, with what a
    `[[data.blend]]` table sets for its source; ValueError in one line, naming the table, on bad input."""
    hints, out = _hints(DataConfig), []
    for i, (weight, source, settings) in enumerate(parse_blend(data.blend)):
        where = f"data.blend[{i}]" if isinstance(data.blend, list) else "data"
        own = {k: _convert(f"{where}.{k}", hints[k], v) for k, v in settings.items()}
        one = dataclasses.replace(data, source=source, blend="", **own)
        _check_source_settings(one, where)
        out.append((weight, one))
    return out


def _check_source_settings(d: DataConfig, where: str) -> None:
    if not 0 < d.val_fraction < 1:
        raise ValueError(f"{where}.val_fraction must be in (0, 1), got {d.val_fraction}")
    for name in ("token_dtype", "format", "overlong"):
        check_choice(f"{where}.{name}", getattr(d, name), SETTINGS[f"data.{name}"])


def _hints(cls: type) -> dict[str, typing.Any]:
    import moeflow.core.model_config as model_config

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
        if typ is list or isinstance(value, (list, dict)):  # a TOML array is taken as it is, never as a string
            if typ is list and isinstance(value, list):
                return value
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


# Other spellings of a key: an older name, and the name the docs use where the field cannot have it (a keyword).
ALIASES = {"checkpoint.keep": "checkpoint.keep_last", "checkpoint.async": "checkpoint.async_save"}


def _set(cfg: JobConfig, key: str, value) -> None:
    key = ALIASES.get(key, key)
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


def load_config(path: str | Path | None = None, overrides: dict[str, typing.Any] | None = None,
                given: Iterable[str] | None = None) -> JobConfig:
    """Defaults <- TOML file <- overrides; model.name (if given) first selects the preset. `given`: the keys the
    user set (JobConfig.validate); None: every key of the file and the overrides (a run directory's config.toml,
    which holds every setting, passes the overrides alone or nothing)."""
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
    return cfg.validate(values if given is None else given)


def _check_folder_overrides(asked: ModelConfig, described: ModelConfig, given: Iterable[str]) -> None:
    """A model setting the user gave beside model.hf_path that the folder decides (its architecture; on
    transformers' own modules the knobs of moeflow's MoE layer too) is one line, not silently another value."""
    from moeflow.models.hf import TRAINING_KNOBS

    knobs = {f"model.{section}.{k}" if section else f"model.{k}" for section, keys in TRAINING_KNOBS.items()
             for k in keys}
    for key in (ALIASES.get(k, k) for k in given):
        if not key.startswith("model.") or key in ("model.name", "model.hf_path", "model.hf_impl"):
            continue
        want, got = asked, described
        for part in key.split(".")[1:]:
            want, got = getattr(want, part), getattr(got, part)
        if want == got:
            continue
        if described.runs_transformers and key in knobs:
            raise ValueError(f"{key} = {want!r} with model.hf_path = {asked.hf_path!r}: a setting of moeflow's own "
                             f"MoE layer, and this folder trains on transformers' own modules, which route and "
                             f"compute as the architecture's code does; drop {key}")
        raise ValueError(f"{key} = {want!r} with model.hf_path = {asked.hf_path!r}: the folder's config.json decides "
                         f"the architecture, and gives {key} = {got!r}; drop {key}")


def load_run_config(run_dir: str | Path, overrides: dict[str, typing.Any] | None = None,
                    model_may_change: bool = False) -> JobConfig | None:
    """The config a run directory holds (its config.toml) with `overrides` applied, or None when it has none.

    Overrides of how to train apply; one that changes the model's shape (or its name or Hugging Face source) is
    refused, naming it, since the directory's checkpoints hold the model of its config.toml. training.stop_at
    belongs to the invocation that set it (a time-limited allocation), so it starts at 0 again. With
    `model_may_change` (a fresh start, which ignores the checkpoints) the model may change too."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        return None
    overrides = {"training.stop_at": 0, **(overrides or {})}
    saved = load_config(path, {"run_dir": str(run_dir)}, given=()).model
    cfg = load_config(path, overrides, given=overrides)
    before = {"model.name": saved.name, "model.hf_path": saved.hf_path, **saved.shape_settings()}
    after = {"model.name": cfg.model.name, "model.hf_path": cfg.model.hf_path, **cfg.model.shape_settings()}
    changed = [k for k in {**before, **after} if before.get(k) != after.get(k)]
    if changed and not model_may_change:
        key = changed[0]
        flags = [k for k in overrides if k == key] or [k for k in overrides if k.startswith("model.")]
        named = " ".join(f"--{k}={overrides[k]}" for k in flags) or "the run's settings now"
        raise ValueError(
            f"{named} changes the model of the run in {run_dir} ({key} = {before.get(key)!r} in {path}, "
            f"{after.get(key)!r} with the override), whose checkpoints hold the model of its config.toml; drop "
            f"the override to continue this run, add --fresh to start it over, or train the changed model in another "
            f"--run-dir"
        )
    return cfg


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
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table: `[[data.blend]]` tables written back on one line each
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


__all__ = [
    "JobConfig", "DataConfig", "TrainingConfig", "ParallelConfig", "EvalConfig", "MetricsConfig",
    "CheckpointConfig", "ModelConfig", "MoEConfig", "load_config", "load_run_config", "parse_overrides", "to_toml",
    "all_keys",
]
