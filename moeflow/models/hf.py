"""Hugging Face checkpoints in and out: `from_pretrained`, `save_pretrained`, `load_for_training`.

A Hugging Face folder is config.json plus model.safetensors, or shards listed in model.safetensors.index.json.
Loading needs only `safetensors`: the moeflow model is built empty (on the meta device, then allocated once),
and each file is read tensor by tensor straight into its place, so the model is never in memory twice;
per-expert tensors land in their slice of moeflow's 3-D expert weights. Before any data is read, every file's
header is checked against what the architecture needs (missing, extra, wrong shape, truncated file), so bad
input fails fast with the tensor's name. Saving writes the layout transformers' own save_pretrained writes
(one tensor per expert), a shard at a time. The name tables are in moeflow.core.hf_arch; live `transformers`
modules (swapping HF's MoE blocks for moeflow's) are in moeflow.models.hf_live.

Shape suffixes: E experts, D model width, F expert width.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import torch

from moeflow.core.hf_arch import (
    Arch,
    Rule,
    arch_named,
    arch_of,
    config_from_hf,
    config_json,
    config_to_hf,
    ignored_on_load,
    infer_arch,
    mtp_tensor_names,
    tensor_rules,
)
from moeflow.core.model_config import ModelConfig
from moeflow.models.transformer import Transformer

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# Tokenizer and generation files travel with the weights on conversion (moeflow reads only tokenizer.json).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "chat_template.jinja")
# What a moeflow config keeps when model.hf_path replaces its architecture: how to train, not what is trained
# ("" is the model section itself).
TRAINING_KNOBS = {"moe": ("expert_impl", "aux_loss_coef", "aux_loss_type", "z_loss_coef", "capacity_factor",
                          "drop_policy", "pad_to_capacity", "bias_update_rate"),
                  "": ("mtp_loss_coef",)}
# Fields of an original config.json that moeflow does not model but an export back to it keeps: token ids and
# the like (inert settings only; anything that changes the computation is mapped or refused in hf_arch).
KEPT_HF_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "sliding_window", "use_sliding_window",
                  "max_window_layers", "layer_types", "router_aux_loss_coef", "attention_dropout")


# ---- reading ------------------------------------------------------------------------------------------------


def read_hf_config(path: str | Path) -> tuple[dict, ModelConfig]:
    """(config.json as a dict, the moeflow ModelConfig that computes the same model)."""
    folder = Path(path)
    hf = config_json(folder)
    cfg = config_from_hf(hf)
    cfg.hf_path = str(folder)
    if cfg.mtp_depth and not _holds_mtp_layers(folder, hf):
        # transformers' own save_pretrained writes DeepSeek-V3 configs with num_nextn_predict_layers = 1 and no MTP
        # tensors: such a checkpoint is the main model only.
        cfg.mtp_depth = 0
    return hf, cfg


def _holds_mtp_layers(folder: Path, hf: dict) -> bool:
    """Whether the checkpoint's headers name any MTP tensor (reads headers only)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            return bool(mtp_tensor_names(hf, json.loads(index.read_text())["weight_map"]))
        except (ValueError, KeyError):
            return True  # let weight_files report the broken index
    if (folder / SINGLE_FILE).is_file():
        return bool(mtp_tensor_names(hf, read_header(folder / SINGLE_FILE)))
    return True  # no weights: the loader says so


def from_pretrained(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> tuple[Transformer, ModelConfig]:
    """(model, config) from a Hugging Face folder. `dtype` of the parameters (fp32 by default, the training
    precision of moeflow's weights); `max_seq_len` overrides max_position_embeddings (the RoPE table length)."""
    hf, cfg = read_hf_config(path)
    if max_seq_len:
        cfg.max_seq_len = max_seq_len
    return _load(Path(path), hf, cfg, dtype, device), cfg


def training_config(cfg: ModelConfig) -> ModelConfig:
    """The model config a run with model.hf_path trains: the folder's architecture, cfg's training knobs,
    hf_path kept (config.json only; no weights are read). With model.hf_impl resolving to 'transformers'
    (moeflow/models/hf_transformers.py) it describes transformers' model instead."""
    from moeflow.models import hf_transformers

    hf = config_json(cfg.hf_path)
    if hf_transformers.resolve_impl(cfg, hf) == "transformers":
        weight_files(Path(cfg.hf_path))  # a missing shard is named here, before any process starts
        described = hf_transformers.describe(hf, cfg.hf_path)
        # the knobs a transformers model takes: the speed of its selection bias (if it has one)
        described.moe.bias_update_rate = cfg.moe.bias_update_rate
        described.moe.load_balance = cfg.moe.load_balance
        return described.validate()
    _, loaded = read_hf_config(cfg.hf_path)
    loaded.hf_impl = "native"
    _keep_training_knobs(cfg, loaded)
    loaded.hf_path = cfg.hf_path
    return loaded.validate()


def _keep_training_knobs(asked: ModelConfig, loaded: ModelConfig) -> None:
    for section, keys in TRAINING_KNOBS.items():
        src, dst = (getattr(asked, section), getattr(loaded, section)) if section else (asked, loaded)
        for key in keys:
            setattr(dst, key, getattr(src, key))


def load_for_training(cfg: ModelConfig) -> tuple[Transformer, ModelConfig]:
    """What the trainer starts from when model.hf_path is set: the folder's architecture and weights (fp32),
    with cfg's training knobs kept (moe.expert_impl, aux/z-loss coefficients, capacity, bias update rate)."""
    hf, loaded = read_hf_config(cfg.hf_path)
    _keep_training_knobs(cfg, loaded)
    return _load(Path(cfg.hf_path), hf, loaded.validate(), torch.float32, "cpu"), loaded


def build_empty(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu") -> Transformer:
    """A Transformer with allocated but unset parameters (no time spent on a random init that is overwritten)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if dtype != torch.float32:  # on the meta device, so the fp32 model is never allocated (a GPU may fit only bf16)
        model.to(dtype)
        for module in model.modules():  # RoPE tables and router biases stay fp32, as Transformer makes them
            for name, buf in module.named_buffers(recurse=False):
                setattr(module, name, buf.float())
    model.to_empty(device=device)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.reset_rope()
    return model


def _load(folder: Path, hf: dict, cfg: ModelConfig, dtype: torch.dtype, device) -> Transformer:
    arch = arch_of(hf)
    files = weight_files(folder)
    headers = {file: read_header(file) for file in files}
    present = {name: (file, h["shape"]) for file, header in headers.items() for name, h in header.items()}
    fused = any(name.endswith(".experts.gate_up_proj") for name in present)
    rules = tensor_rules(cfg, arch, fused)
    _check_names(folder, hf, rules, present)

    model = build_empty(cfg, dtype, device)
    state = model.state_dict()
    _check_shapes(rules, present, state)
    by_name: dict[str, list[Rule]] = defaultdict(list)
    for r in rules:
        if r.transform != "copy":  # copies are checked against what their own tensor loaded, after the rest
            by_name[r.hf].append(r)
    filled = {r.mf for r in rules} | ({"output.weight"} if cfg.tie_embeddings else set())  # tied: the embedding
    for key, tensor in state.items():  # routers without a selection bias in the checkpoint start unbiased
        if key not in filled and key.endswith("router.expert_bias"):
            tensor.zero_()
            filled.add(key)
    assert filled == set(state), f"no rule fills {sorted(set(state) - filled)}"

    from safetensors import SafetensorError, safe_open

    with torch.no_grad():
        for file in files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        if name in by_name:  # (not the ignored ones: DeepSeek's MTP layers, stale RoPE tables)
                            tensor = f.get_tensor(name)  # one tensor in memory at a time
                            for r in by_name[name]:
                                copy_into(state[r.mf], tensor, r)
            except (OSError, SafetensorError) as e:
                raise ValueError(f"cannot read {file}: {e}; the file may be corrupt - copy it again") from None
        _check_copies(rules, present, state)
    return model


def _check_copies(rules: list[Rule], present: dict, state: dict) -> None:
    """The copies DeepSeek-V3's MTP layers keep of the shared embedding and head must equal them: moeflow shares one
    tensor (DeepSeek-V3 report, sec. 2.2), so a differing copy would be lost silently."""
    from safetensors import safe_open

    for r in rules:
        if r.transform != "copy":
            continue
        file = present[r.hf][0]
        with safe_open(str(file), framework="pt", device="cpu") as f:
            copy = f.get_tensor(r.hf)
        if not torch.equal(copy.to(device=state[r.mf].device, dtype=state[r.mf].dtype), state[r.mf]):
            raise ValueError(
                f"{r.hf} in {file.name} differs from the tensor it copies ({r.mf} in moeflow); moeflow shares the "
                f"embedding and output head between the main model and the MTP layers, as DeepSeek-V3 does: "
                f"re-save the checkpoint with equal copies, or drop its MTP layers (num_nextn_predict_layers = 0)"
            )


def copy_into(dst: torch.Tensor, src: torch.Tensor, rule: Rule) -> None:
    """Copy one Hugging Face tensor into its moeflow place (see hf_arch's transforms); casts to dst's dtype."""
    if rule.transform == "same":
        dst.copy_(src)
    elif rule.transform == "transposed":
        dst[rule.expert].copy_(src.T)
    elif rule.transform in ("gate_half", "up_half"):
        F = dst.shape[-1]
        gate_up_EFD = src[:, :F] if rule.transform == "gate_half" else src[:, F:]
        dst.copy_(gate_up_EFD.transpose(1, 2))
    elif rule.transform == "down_fused":
        dst.copy_(src.transpose(1, 2))
    else:
        raise AssertionError(rule.transform)


def hf_shape(rule: Rule, mf_shape: torch.Size) -> list[int]:
    """The shape the Hugging Face tensor must have for `rule`, from its moeflow tensor's shape."""
    if rule.transform in ("same", "copy"):
        return list(mf_shape)
    if rule.transform == "transposed":  # one expert's [out, in] <- moeflow's [E, in, out]
        return [mf_shape[2], mf_shape[1]]
    if rule.transform == "down_fused":  # [E, D, F] <- w2 [E, F, D]
        E, F, D = mf_shape
        return [E, D, F]
    E, D, F = mf_shape  # gate_up_proj [E, 2F, D] <- w1 or w3 [E, D, F]
    return [E, 2 * F, D]


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index} is not a safetensors index ({e!r}); re-save the checkpoint") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(f"{index.name} lists {file.name}, which is not in {folder}; copy the missing shard")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".safetensors", ".json"))
    raise ValueError(
        f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE} (it has {found}); moeflow reads safetensors "
        f"only: re-save the model with transformers' save_pretrained (safetensors is its default)"
    )


def read_header(file: Path) -> dict:
    """{name: {'dtype', 'shape', 'data_offsets'}} from a safetensors header, checking the file is complete.

    The format is an 8-byte little-endian header length, a JSON header, then the tensor bytes; a file cut
    short (an interrupted download or copy) is caught here, before any tensor is read.
    """
    size = file.stat().st_size
    with open(file, "rb") as fh:
        prefix = fh.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if header_len < 0 or 8 + header_len > size:
            raise ValueError(f"{file} is truncated or not a safetensors file ({size} bytes); copy it again")
        try:
            header = json.loads(fh.read(header_len))
        except ValueError:
            raise ValueError(f"{file} is not a safetensors file (its header is not JSON); copy it again") from None
    header.pop("__metadata__", None)
    needed = 8 + header_len + max((h["data_offsets"][1] for h in header.values()), default=0)
    if size < needed:
        raise ValueError(
            f"{file} is truncated: it has {size} bytes but its header describes {needed}; copy or download it again"
        )
    return header


def _check_names(folder: Path, hf: dict, rules: list[Rule], present: dict) -> None:
    expected = {r.hf for r in rules}
    missing = sorted(expected - set(present))
    extra = sorted(n for n in set(present) - expected if not ignored_on_load(hf, n))
    what = f"config.json in {folder} describes {hf.get('architectures', [hf.get('model_type')])[0]}"
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} tensors that {what} needs: {_names(missing)}; is config.json "
            f"from another model, or a shard missing?"
        )
    if extra:
        raise ValueError(
            f"the checkpoint has {len(extra)} tensors that {what} does not use: {_names(extra)}; is config.json "
            f"from another model (e.g. other num_hidden_layers or experts)?"
        )


def _check_shapes(rules: list[Rule], present: dict, state: dict) -> None:
    for r in rules:
        want, (file, got) = hf_shape(r, state[r.mf].shape), present[r.hf]
        if list(got) != want:
            raise ValueError(
                f"tensor {r.hf} in {file.name} has shape {list(got)} but config.json implies {want}; "
                f"the config and the weights disagree (sizes such as hidden_size or num_experts)"
            )


def _names(names: list[str], show: int = 6) -> str:
    return ", ".join(names[:show]) + (f", ... ({len(names) - show} more)" if len(names) > show else "")


# ---- writing ------------------------------------------------------------------------------------------------


def save_pretrained(
    model: Transformer, config: ModelConfig, path: str | Path, *, architecture: str | None = None,
    dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30, extra_config: dict | None = None,
) -> Path:
    """Write a Hugging Face folder that transformers' AutoModelForCausalLM.from_pretrained loads, from a
    model held on one process (a parallelized model's state is gathered first: convert does it from DCP).

    `architecture` (e.g. 'Qwen3MoeForCausalLM'; default: inferred from what the config computes) must be able
    to express the model, else ValueError naming the settings. `dtype` casts on the way out (default: as held).
    Shards of at most `max_shard_bytes` (plus an index) when the weights are larger. `extra_config` entries
    (token ids and the like from an original config.json) are written into config.json too.
    """
    arch: Arch = arch_named(architecture) if architecture else infer_arch(config)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    _check_biases_fit(arch, state)
    rules = tensor_rules(config, arch)
    out_dtype = dtype or state["tok_embeddings.weight"].dtype

    def dtype_of(r: Rule) -> torch.dtype:
        # Selection biases stay fp32: their learnt steps (1e-3) are below bf16's resolution near 1.
        return torch.float32 if r.mf.endswith("router.expert_bias") else out_dtype

    def nbytes(r: Rule) -> int:
        t = state[r.mf]
        return (t[0] if r.expert is not None else t).numel() * dtype_of(r).itemsize

    shards: list[list[Rule]] = [[]]
    size = 0
    for r in rules:
        if shards[-1] and size + nbytes(r) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(r)
        size += nbytes(r)

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("model*.safetensors"), folder / INDEX_FILE]:  # no stale shards from an older save
        old.unlink(missing_ok=True)
    from safetensors.torch import save_file

    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    weight_map = {}
    for name, shard in zip(names, shards):
        tensors = {r.hf: to_hf(state[r.mf], r).to(dtype_of(r)).contiguous() for r in shard}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes(r) for r in rules)}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))

    hf = config_to_hf(config, arch, str(out_dtype).removeprefix("torch."))
    hf.update({k: v for k, v in (extra_config or {}).items() if k not in hf})
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return folder


def to_hf(t: torch.Tensor, rule: Rule) -> torch.Tensor:
    """A moeflow tensor (or its expert slice) in the Hugging Face on-disk layout."""
    if rule.transform == "same":
        return t
    if rule.transform == "copy":  # its own storage: safetensors refuses tensors that share memory
        return t.clone()
    assert rule.transform == "transposed", f"{rule.transform} is a load-only transform"
    return t[rule.expert].T


def _check_biases_fit(arch: Arch, state: dict) -> None:
    """Refuse to drop a learnt expert-selection bias that the architecture has no tensor for."""
    if arch.router_bias:
        return
    for key, t in state.items():
        if key.endswith("router.expert_bias") and bool(t.any()):
            raise ValueError(
                f"{key} is nonzero (aux-loss-free balancing learnt it), but {arch.class_name} has no expert bias, "
                f"so the exported model would route differently; train with model.moe.load_balance='none' or "
                f"export as Glm4MoeForCausalLM (grouped-query attention) or DeepseekV3ForCausalLM (MLA)"
            )


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer and generation files that exist in src to dst; returns their names."""
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file() and src.resolve() != dst.resolve():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def kept_fields(hf: dict) -> dict:
    """The entries of an original config.json worth carrying into an exported one (see KEPT_HF_FIELDS)."""
    return {k: hf[k] for k in KEPT_HF_FIELDS if k in hf}
