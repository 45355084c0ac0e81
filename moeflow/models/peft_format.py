"""A LoRA run's adapter in PEFT's own format: `adapter_config.json` + `adapter_model.safetensors`, such that
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), ADAPTER)` is the trained model.

BASE is the run's model as a Hugging Face folder: model.hf_path, or what `moeflow convert moeflow-to-hf` writes
of the untrained base. A run on transformers' own modules trains that base itself, so its layers' names are
peft's as they are. Names and nesting come from peft itself: the base architecture is built on the meta device
(no memory), peft adds its adapters to it, and each of peft's tensors is filled from moeflow's factor of the same
layer. peft keeps a 3-D expert weight's factors as lora_A [E * r, in] (expert-major) and lora_B [out, r * E]
(expert-minor) and applies them to the weight in the layout the module holds ([E, out, in] unless the module is
`is_transposed`); moeflow keeps A [E, r, in] and B [E, out, r] (moeflow/models/lora.py).

The trainer reads the factors from a committed checkpoint in one process (moeflow/train/checkpoint.py), so
writing needs no collective under any layout; the job config checks, before any process starts, that peft places
every adapter the run will train (`check`, on the meta device).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

from moeflow.core.model_config import ModelConfig
from moeflow.models import lora

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # (peft's LoraConfig.save_pretrained writes adapter_config.json)
ADAPTER_DIR = "adapter"  # under RUN_DIR


def base_architecture(model: ModelConfig):
    """(model config, Arch) of the run's base as a Hugging Face folder: the folder it started from, else the
    architecture `moeflow convert moeflow-to-hf` exports the native model as."""
    from moeflow.core.hf_arch import arch_named, infer_arch
    from moeflow.models.hf import read_hf_config

    if model.hf_path:
        original, cfg = read_hf_config(model.hf_path)
        return cfg, arch_named(original["architectures"][0])
    return model, infer_arch(model)


def _module_map(cfg, arch) -> tuple[dict[str, str], dict[str, str]]:
    """({moeflow linear: HF module}, {moeflow experts module: HF experts module}) at run time (fused experts)."""
    from moeflow.core.hf_arch import tensor_rules

    linears, experts = {}, {}
    for r in tensor_rules(cfg, arch, fused=True):
        if r.transform == "same" and r.mf.endswith(".weight"):
            linears[r.mf.removesuffix(".weight")] = r.hf.removesuffix(".weight")
        elif r.transform == "gate_half":
            experts[r.mf.removesuffix(".w1")] = r.hf.removesuffix(".gate_up_proj")
    return linears, experts


def check(model: ModelConfig, peft_cfg) -> None:
    """ValueError unless peft places every adapter a run with these settings trains (the meta device: no memory)."""
    meta = lora.meta_model(model)
    lora.add(meta, peft_cfg.rank, peft_cfg.alpha, peft_cfg.dropout, peft_cfg.modules, peft_cfg.experts)
    write_adapter({n: p for n, p in meta.named_parameters() if lora.is_factor(n)}, model, peft_cfg, None)


def _placement(factors: dict, model: ModelConfig):
    """(architecture name, a builder of the base on the meta device, {HF linear: moeflow linear}, {HF experts
    module: moeflow experts module}) of the adapted layers. transformers' own modules are the base's: the names
    are the same."""
    import transformers

    from moeflow.core.hf_arch import config_to_hf

    adapted = {fqn.rsplit(".", 1)[0] for fqn in factors}
    expert_owners = {fqn.rsplit(".", 1)[0] for fqn in factors if fqn.rsplit(".", 1)[1] in lora.EXPERT_FACTORS}
    if model.runs_transformers:
        from moeflow.models import hf_transformers

        return (hf_transformers.architecture_of(model.hf_path), lambda: hf_transformers.load(model.hf_path, "meta"),
                {m: m for m in adapted - expert_owners}, {m: m for m in expert_owners})
    cfg, arch = base_architecture(model)
    linears, experts = _module_map(cfg, arch)
    unmapped = sorted(m for m in adapted if m not in linears and m not in experts)
    if unmapped:
        raise ValueError(f"adapters on {unmapped[:3]} have no place in {arch.class_name}'s modules; leave them out of "
                         f"peft.modules")
    hf_config = transformers.AutoConfig.for_model(**config_to_hf(cfg, arch, "float32"))

    def build():
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(hf_config)

    return (arch.class_name, build, {linears[m]: m for m in adapted if m in linears},
            {experts[m]: m for m in adapted if m in experts})


def write_adapter(factors: dict[str, torch.Tensor], model: ModelConfig, peft_cfg, out: Path | None) -> Path | None:
    """Write `out` (replaced atomically) in PEFT's format from moeflow's factors ({fqn: whole tensor});
    `out` None checks the names and shapes only. `peft_cfg`: the job's [peft] settings."""
    import peft
    from safetensors.torch import save_file

    arch_name, build, hf_linears, hf_experts = _placement(factors, model)
    names = sorted({m.rsplit(".", 1)[-1] for m in hf_linears})
    # peft's target_parameters: '<experts module's leaf name>.<weight>' of each adapted experts weight
    weight_of = {kind: weight for weight, kind in lora.HF_EXPERT_WEIGHTS.items()}
    hf_experts_of = {m: h for h, m in hf_experts.items()}
    experts_params = sorted({f"{hf_experts_of[owner].rsplit('.', 1)[-1]}.{weight_of[leaf[5:-2]]}"
                             for owner, _, leaf in (fqn.rpartition(".") for fqn in factors)
                             if owner in hf_experts_of and leaf.endswith("_A")})
    config, wrapped = _peft_model(build, model, peft_cfg, names, experts_params)
    missed = {m.rsplit(".", 1)[-1] for m in set(hf_linears) - _adapted_linears(wrapped)}
    if missed:
        # peft reads the MoE architectures whose experts transformers 5 fused (Qwen2/3-MoE, Mixtral, ...) with
        # target_modules gate_proj / up_proj / down_proj as the experts of a transformers 4 checkpoint, so a dense
        # MLP's or shared expert's layers of those names are targeted by their weight instead: the same W + B A.
        names = sorted(set(names) - missed)
        config, wrapped = _peft_model(build, model, peft_cfg, names,
                                      experts_params + [f"{n}.weight" for n in sorted(missed)])
    tensors = {}
    for path, module in wrapped.base_model.model.named_modules():
        if not isinstance(module, peft.tuners.lora.LoraLayer):
            continue
        owner = path
        while owner.endswith(".base_layer"):
            owner = owner.removesuffix(".base_layer")
        parameter = getattr(module, "parameter_name", "weight")
        if owner in hf_experts:
            if getattr(module.get_base_layer(), "is_transposed", False) and not model.runs_transformers:
                raise ValueError(f"{arch_name}'s experts hold transposed weights, which moeflow's model does not map")
            A, B = _expert_factors(factors, hf_experts[owner], parameter)
            E, r = A.shape[0], A.shape[1]
            A, B = A.reshape(E * r, A.shape[2]), B.permute(1, 2, 0).reshape(B.shape[1], r * E)
        elif owner in hf_linears and parameter == "weight":
            mf = hf_linears[owner]
            A, B = factors[f"{mf}.lora_A"], factors[f"{mf}.lora_B"]
        else:
            raise ValueError(f"peft adapted {owner}.{parameter}, which moeflow did not: the adapted layers' names "
                             f"are ambiguous in {arch_name}; name fewer layers in peft.modules")
        tensors[f"base_model.model.{path}.lora_A.weight"] = A.detach().contiguous()
        tensors[f"base_model.model.{path}.lora_B.weight"] = B.detach().contiguous()
    if set(hf_linears) - _adapted_linears(wrapped):
        raise ValueError(f"peft did not adapt {sorted(set(hf_linears) - _adapted_linears(wrapped))[:3]}, which "
                         f"moeflow did")
    # (the adapters only: peft would also save an adapted output head's base weight, which the folder has)
    ours = peft.get_peft_model_state_dict(wrapped, save_embedding_layers=False)
    expected = {k: tuple(v.shape) for k, v in ours.items()}
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert shapes == expected, sorted(set(expected.items()) ^ set(shapes.items()))[:4]
    if out is None:
        return None

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(str(tmp))
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def _peft_model(build, model_cfg: ModelConfig, peft_cfg, modules: list[str], parameters: list[str]):
    """(LoraConfig, PeftModel) of the base architecture on the meta device (`build()`) with adapters on `modules`
    (leaf names) and `parameters` (name suffixes)."""
    import peft

    base = build()
    config = peft.LoraConfig(r=peft_cfg.rank, lora_alpha=peft_cfg.alpha, lora_dropout=peft_cfg.dropout,
                             target_modules=modules or None, target_parameters=parameters or None,
                             inference_mode=True)
    with warnings.catch_warnings():  # on the first try, what peft says of the names it reads as experts' (above)
        warnings.simplefilter("ignore")
        try:
            model = peft.get_peft_model(base, config)
        except ValueError as e:  # e.g. gate_proj without up_proj where transformers fused them
            raise ValueError(f"peft.modules = {peft_cfg.modules!r}: peft cannot place these adapters on this "
                             f"architecture ({str(e).splitlines()[0].rstrip('.')}); name what it asks for too, or "
                             f"use 'auto'") from None
    config.base_model_name_or_path = model_cfg.hf_path or None  # (get_peft_model sets the meta model's: none)
    return config, model


def _adapted_linears(model) -> set[str]:
    """HF module paths whose own weight peft adapted (as a layer or as a 2-D parameter)."""
    import peft

    out = set()
    for path, module in model.base_model.model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer) and getattr(module, "parameter_name", "weight") == "weight":
            while path.endswith(".base_layer"):
                path = path.removesuffix(".base_layer")
            out.add(path)
    return out


def _expert_factors(factors: dict, mf_experts: str, parameter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """moeflow's (A [E, r, in], B [E, out, r]) for an HF experts parameter (gate_up_proj, up_proj or down_proj)."""
    kind = lora.HF_EXPERT_WEIGHTS[parameter]
    return factors[f"{mf_experts}.lora_{kind}_A"], factors[f"{mf_experts}.lora_{kind}_B"]

