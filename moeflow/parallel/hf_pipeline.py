"""Pipeline stages of a transformers causal LM (model.hf_impl = 'transformers'), for torch.distributed.pipelining.

moeflow's own model is split by dropping what a rank does not hold (moeflow.parallel.pipeline). A transformers
model's forward is the architecture's own code (masks, rotary tables, per-layer types, embedding scales), so each
stage still runs that whole forward and only changes what flows through it:

  - the layers of other stages become `SkippedLayer` placeholders: no parameters, they hand on the hidden states
    (and whatever else a layer returns for the next one) and keep the plain attributes the model's loop reads of a
    layer (its attention type, its index), so layer indices and parameter names stay the full model's;
  - a stage after the first receives what the previous stage's last layer returned: the model runs on placeholder
    token ids (its embedding is a parameterless `NoEmbedding` of zeros; the real ids where the layers take them, as
    hash routing does) and the received tensors replace what enters this stage's first layer (a forward pre-hook
    on it, registered for the call: under activation checkpointing the layer saves the replaced input, so its
    recomputation sees it too);
  - a stage before the last returns what its last layer produced, and holds no final norm or output head;
  - what the forward runs of the base model before its layers (an input scale) lives on the first stage, what it
    runs after them (a hyper-connection head) on the last (moeflow.parallel.hf_loop reads which from its source).

What a layer hands the next (the hidden states, an indexer's top-k selection beside them, hyper-connection streams)
has the shapes a forward on fake tensors gives (`_layer_outputs`), so the stages skip torch's shape inference.
The last stage returns the causal LM's own logits (its head, and any logit scale or cap the architecture applies).
One stage per rank (GPipe, 1F1B). Refused before anything changes: tied embeddings (the embedding and the head
would live on different stages), parameters the forward reads inside its loop or beside the layers' inputs
(per-layer embeddings computed from the token ids), state the layers share other than through their outputs
(blocks of earlier layers' outputs; keys and values a layer reads from a layer of another stage through
transformers' key-value sharing dict: `kv_sources`), and what the layers hand on where the forward on fake tensors
cannot read its shapes (a selection its values decide).

    stages = build_hf_stage_modules(model, pp_rank, pp_size, schedule_name, boundaries, microbatch_shape)  # [model]
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from moeflow.core.schedules import SCHEDULES, pipeline_layout, resolve_schedule
from moeflow.parallel.hf_loop import LayerLoop, layer_loop
from moeflow.parallel.module_names import embedding_name, is_norm


def _final_norms(model: nn.Module) -> list[str]:
    """The names of the base model's own norms (children of `model.model` whose class is a norm: `norm`, or
    `final_layernorm` in some architectures), which run after the last layer."""
    return [n for n, child in model.model.named_children() if is_norm(child)]


def _placed(model: nn.Module) -> tuple[str, ...]:
    """The parameter name prefixes a stage split places with the layers, embedding, final norm or head."""
    return (f"model.{embedding_name(model)}.", "model.layers.", "lm_head.",
            *(f"model.{n}." for n in _final_norms(model)))


def _outside(model: nn.Module) -> dict[str, str]:
    """{attribute of model.model: 'first' or 'last' stage, or '' where no stage can hold it} for the parameters
    outside the layers, embedding, final norm and head (module docstring)."""
    loop, placed, out = _loop(model), _placed(model), {}
    for name, _ in model.named_parameters():
        if not name.startswith(placed):
            attribute = name.split(".")[1] if name.startswith("model.") else name
            holder = "first" if attribute in loop.before else "last" if attribute in loop.after else ""
            out.setdefault(attribute, holder if name.startswith("model.") else "")
    return out


def _loop(model: nn.Module) -> LayerLoop:
    return layer_loop(type(model.model)) or LayerLoop("")


@dataclass(frozen=True)
class _Role:
    first: bool
    last: bool
    first_layer: int  # global index of this stage's first and last layers
    last_layer: int
    slots: tuple[int | str, ...]  # where what a layer hands the next goes into its call (hf_loop.LayerLoop)
    reads_ids: bool  # the layers take the token ids: every stage runs on the real ones
    known: bool  # the shapes at its boundaries are known (else torch infers them on its first step)
    received: tuple | None  # ((shape, dtype), ...) of what enters / leaves the stage (None: the hidden states)
    sent: tuple | None


# stage module -> its role; kept beside the module, which gains no attribute
_ROLES: weakref.WeakKeyDictionary[nn.Module, _Role] = weakref.WeakKeyDictionary()


def _slot(args: tuple, kwargs: dict, slot: int | str):
    if isinstance(slot, str):
        return kwargs.get(slot)
    return args[slot] if slot < len(args) else None


class SkippedLayer(nn.Module):
    """Stands for a layer of another stage: returns the hidden states it is given (and, where the layers hand each
    other more, what it was handed of that)."""

    def __init__(self, layer: nn.Module, slots: tuple[int | str, ...] = ()):
        super().__init__()
        for key, value in vars(layer).items():  # plain attributes (modules and parameters live in _modules, ...)
            if not key.startswith("_") and key != "training":
                setattr(self, key, value)
        self.slots = slots

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if not self.slots:
            return hidden
        return (hidden, *(_slot(args, kwargs, slot) for slot in self.slots))


class NoEmbedding(nn.Module):
    """A later stage's embedding: zeros of the hidden width (the received hidden states replace them)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, device=ids.device)


class Dropped(nn.Module):
    """A part of the base model another stage runs (before or after the layers, the final norm, the head): hands
    on its first input. Keeps a scalar `weight` of the part's dtype where it had one (forwards read its dtype)."""

    def __init__(self, part: nn.Module | None = None):
        super().__init__()
        weight = getattr(part, "weight", None)
        if isinstance(weight, torch.Tensor):
            self.weight = torch.zeros((), dtype=weight.dtype, device="cpu")  # (a 0-dim CPU tensor: any device's)

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


def kv_sources(model: nn.Module) -> dict[int, int] | None:
    """{layer: the layer whose keys and values it reads} where the config says so, through the dict transformers'
    key-value sharing passes every layer: `kv_source_layers`, one per layer (Kolibri-1.1's; Mistral Large 4's, whose
    dict is keyed by the kind of rotary embedding, so a reader gets the last of its kind written before it: the
    layer named here wherever no other writer of that kind sits between them, which a split keeping the two on
    one stage does not change); Gemma 3n's and 4's last `num_kv_shared_layers` layers, each reading the last
    earlier layer of its attention type (`kv_sharing_modes`: 'store', 'reuse'; Gemma 4's MoE release shares none,
    and a layer that only stores keeps a copy for an assistant model, which training does not read). None where
    the config does not say, or says what this cannot follow (a reader with no earlier writer of its type)."""
    config = model.config.get_text_config()
    sources = getattr(config, "kv_source_layers", None)
    if isinstance(sources, list | tuple):
        return {j: i for j, i in enumerate(sources) if i != j}
    modes, types = getattr(config, "kv_sharing_modes", None), getattr(config, "layer_types", None)
    if not (isinstance(modes, list | tuple) and isinstance(types, list | tuple) and len(types) == len(modes)):
        return None
    out = {}
    for j, mode in enumerate(modes):
        if mode == "reuse":
            writers = [i for i in range(j) if modes[i] == "store" and types[i] == types[j]]
            if not writers:
                return None
            out[j] = writers[-1]
    return out


def _split_sharing(model: nn.Module, loop: LayerLoop, pp_size: int | None, schedule: str, boundaries) -> str:
    """Why the dict the layers share stops this split ('' when every layer that reads another's keys and values
    sits on that layer's stage, so nothing of it crosses a boundary). pp_size None: any such reader stops it."""
    sources = kv_sources(model)
    if sources is None:
        return loop.sharing
    if pp_size is None:
        apart = sorted(sources.items())
    else:
        stage_of = {k: spec.index for spec in pipeline_layout(len(model.model.layers), pp_size, schedule, boundaries)
                    for k in spec.layers}
        apart = [(j, i) for j, i in sorted(sources.items()) if stage_of[j] != stage_of[i]]
    if not apart:
        return ""
    j, i = apart[0]
    why = f"layer {j} reads the keys and values layer {i} writes into `{loop.shared}`"
    if pp_size is None:
        return why
    starts = _starts_keeping(len(model.model.layers), sources, [spec.layers[0] for spec in pipeline_layout(
        len(model.model.layers), pp_size, schedule)])
    fix = (f"parallel.pp_boundaries = '{','.join(map(str, starts))}' keeps each reader on its source's stage"
           if starts else f"no split into {pp_size} stages keeps every reader on its source's stage")
    return f"{why}, and the split puts layer {i} on stage {stage_of[i]} and layer {j} on stage {stage_of[j]} ({fix})"


def _starts_keeping(n_layers: int, sources: dict[int, int], even: list[int]) -> list[int] | None:
    """The first layer of each stage, each as near to the even split's (`even`) as leaves room for the stages after
    it, such that no stage starts between a source and a layer reading it (None: no such split)."""
    allowed = [b for b in range(1, n_layers) if not any(i < b <= j for j, i in sources.items())]
    if len(allowed) < len(even) - 1:
        return None
    starts = [0]
    for k, target in enumerate(even[1:]):
        after = len(even) - 2 - k  # stage starts still to place after this one
        later = [b for b in allowed if b > starts[-1]]
        starts.append(min(later[:len(later) - after], key=lambda b: abs(b - target)))
    return starts


def hf_pipeline_refusal(model: nn.Module, pp_schedule: str, microbatch_shape: tuple | None = (),
                        pp_size: int | None = None, boundaries=None) -> str | None:
    """Why this transformers model cannot be split into `pp_size` pipeline stages (None when it can; pp_size None:
    into any, so a layer reading another's keys and values is refused wherever it sits). `microbatch_shape`: the
    (rows, seq, ...) the stages will be built for; () where it is not known yet (the run's check before launch, or
    parallelize without ParallelOptions.pp_microbatch_shape: a model whose layers hand each other more than the
    hidden states then gets the forward on fake tensors the stage split runs, on a PROBE_SHAPE micro-batch); None
    where it is not known (tensor parallelism). `boundaries`: ParallelOptions.pp_boundaries (None: an even split);
    a split pipeline_layout cannot make raises its ValueError."""
    name = type(model).__name__
    if SCHEDULES[resolve_schedule(pp_schedule)].placement != "single":
        return (f"{name}: transformers' modules run one pipeline stage per rank; parallel.pp_schedule = "
                f"{pp_schedule!r} runs several: use 'GPipe' or '1F1B'")
    where = embedding_name(model)
    if where is None:
        return (f"{name}: a model whose token embedding is not a child of model.model has no pipeline split; use "
                f"pp = 1")
    head, embedding = getattr(model, "lm_head", None), getattr(model.model, where)
    if getattr(head, "weight", None) is embedding.weight:  # (the config's flag has no one name in every family)
        return (f"{name}: tied embeddings would sit on two pipeline stages (the embedding on the first, the output "
                f"head on the last); use pp = 1")
    loop = _loop(model)
    why = loop.unsupported or (_split_sharing(model, loop, pp_size, pp_schedule, boundaries) if loop.shared else "")
    if why:
        return (f"{name}: {why}; a pipeline stage boundary carries only what a layer returns for the next one; use "
                f"pp = 1")
    unplaced = [a for a, holder in _outside(model).items() if not holder]
    if unplaced:
        first = next(n for n, _ in model.named_parameters() if n.split(".")[:2] in (["model", unplaced[0]],
                                                                                   [unplaced[0]]))
        if layer_loop(type(model.model)) is None:  # (Inkling2-Loop runs a span of its layers several times)
            return (f"{name}: its forward does not run its layers in one loop over `self.layers`, which a pipeline "
                    f"split reads to place what runs before and after them ({first}); use pp = 1")
        return (f"{name}: parameters its forward reads among the layers or beside their inputs have no pipeline "
                f"stage; {first} is one; use pp = 1")
    if loop.carried and microbatch_shape is None:
        return (f"{name}: its layers hand the next one `{', '.join(loop.carried)}` beside the hidden states, whose "
                f"shapes the stages take from the micro-batch shape (ParallelOptions.pp_microbatch_shape), which "
                f"tensor parallelism leaves unset (torch infers the shapes of its DTensor logits); use pp or tp, "
                f"not both")
    if loop.carried and microbatch_shape == ():  # the shape not known yet: whether the stage split can read them
        try:
            _layer_outputs(model, PROBE_SHAPE)
        except ValueError as e:
            return str(e)
    return None


def build_hf_stage_modules(model: nn.Module, pp_rank: int, pp_size: int, schedule_name: str,
                           boundaries=None, microbatch_shape: tuple | None = None) -> list[nn.Module]:
    """This rank's stage of `model` (trimmed in place to what it holds; its class gains the stage's forward):
    [model]. ValueError (hf_pipeline_refusal) before anything changes. `microbatch_shape` (rows, seq[, dtype]):
    the stages' boundaries get their shapes from it where they carry more than the hidden states."""
    why = hf_pipeline_refusal(model, schedule_name, microbatch_shape, pp_size, boundaries)
    if why:
        raise ValueError(why)
    loop, outside = _loop(model), _outside(model)
    layers = model.model.layers
    (spec,) = [s for s in pipeline_layout(len(layers), pp_size, schedule_name, boundaries) if s.rank == pp_rank]
    outputs = None
    if outside or loop.carried:
        try:
            outputs = _layer_outputs(model, microbatch_shape)
        except ValueError:
            if loop.carried:  # torch's own shape inference would hand the next stage uninitialised indices
                raise
    for i, layer in enumerate(layers):
        if i not in spec.layers:
            layers[i] = SkippedLayer(layer, loop.slots)
    if not spec.embed:
        setattr(model.model, embedding_name(model), NoEmbedding(model.config.get_text_config().hidden_size))
    if not spec.head:
        for name in _final_norms(model):
            setattr(model.model, name, Dropped(getattr(model.model, name)))
        model.lm_head = Dropped()
    for attribute, holder in outside.items():
        if not (spec.embed if holder == "first" else spec.head):
            _drop(model.model, attribute)
    model.__class__ = _stage_class(type(model))
    first, last = spec.layers[0], spec.layers[-1]
    _ROLES[model] = _Role(spec.embed, spec.head, first, last, loop.slots, loop.reads_ids,
                          outputs is not None or not (outside or loop.carried),
                          outputs[first - 1] if outputs and not spec.embed else None,
                          outputs[last] if outputs and not spec.head else None)
    return [model]


def _drop(base: nn.Module, attribute: str) -> None:
    """Another stage runs `base.<attribute>`: a module becomes `Dropped`, a parameter a zero (a scalar, which
    broadcasts whatever the parameter's shape: what it computes is replaced by the received hidden states)."""
    if attribute in base._modules:
        setattr(base, attribute, Dropped(getattr(base, attribute)))
    else:
        del base._parameters[attribute]
        setattr(base, attribute, torch.zeros((), device="cpu"))  # a 0-dim CPU tensor combines with any device's


PROBE_SHAPE = (1, 16)  # (rows, seq) of the micro-batch the check before launch reads the boundary shapes with


def _layer_outputs(model: nn.Module, microbatch_shape: tuple | None) -> list[tuple | None] | None:
    """((shape, dtype), ...) of what each layer returns for a micro-batch of `microbatch_shape` (rows, seq[, dtype
    of autocast]): a forward on fake tensors (no memory, no compute), the experts as transformers' batched matmuls
    (whose shapes do not depend on the routing). None where the shape is not known."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from transformers import PretrainedConfig

    if microbatch_shape is None:
        return None
    rows, seq, *rest = microbatch_shape
    dtype = rest[0] if rest else torch.float32
    device = next((t.device for t in model.buffers() if t.device.type != "meta"), torch.device("cpu"))
    outputs: dict[int, tuple] = {}

    def keep(index):
        def hook(module, args, output):
            found = output if isinstance(output, tuple) else (output,)
            outputs[index] = tuple((tuple(t.shape), t.dtype) for t in found if isinstance(t, torch.Tensor))
        return hook

    configs = {id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None), PretrainedConfig)}
    kept = {key: getattr(c, "_experts_implementation", None) for key, c in configs.items()}
    hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    try:
        for key, config in configs.items():
            if kept[key] is not None:
                config._experts_implementation = "batched_mm"
        with FakeTensorMode(shape_env=ShapeEnv()), autocast:
            state = {n: torch.empty(t.shape, dtype=t.dtype, device=device)
                     for n, t in (*model.named_parameters(), *model.named_buffers())}
            ids = torch.zeros(rows, seq, dtype=torch.long, device=device)
            torch.func.functional_call(model, state, (), {"input_ids": ids, "use_cache": False}, strict=False)
    except Exception as e:  # (noqa: the architectures' own code raises anything) # noqa: BLE001
        detail = (str(e).splitlines() or [""])[0]
        if "data-dependent" in detail:  # (torch's guard errors go on with hints about its tracing)
            detail = detail.split(" (")[0]
        raise ValueError(f"{type(model).__name__}: the shapes its layers hand each other could not be read from a "
                         f"forward on fake tensors, whose values are unknown ({type(e).__name__}: {detail}); use "
                         f"pp = 1") from e
    finally:
        for hook in hooks:
            hook.remove()
        for key, config in configs.items():
            if kept[key] is not None:
                config._experts_implementation = kept[key]
    # (a layer the forward does not run, past config.num_hidden_layers, hands on nothing)
    return [outputs.get(i) for i in range(len(model.model.layers))]


def stage_boundary(module: nn.Module) -> tuple[tuple | None, tuple | None] | None:
    """((shape, dtype), ...) of what a stage receives and sends (each None where it is the hidden states [B, S,
    hidden] or there is no neighbour); None where they are not known (torch's shape inference finds them)."""
    role = _ROLES.get(module)
    if role is None:
        return None, None
    return (role.received, role.sent) if role.known else None


def stage_reads_ids(module: nn.Module) -> bool:
    """Whether a transformers stage's layers take the token ids (every stage then receives them as `ids`)."""
    role = _ROLES.get(module)
    return role is not None and role.reads_ids and not role.first


def is_placeholder(module: nn.Module | None) -> bool:
    """A part a pipeline stage does not hold (another stage's embedding, final norm, head or other parts)."""
    return isinstance(module, NoEmbedding | Dropped)


def is_skipped(layer: nn.Module) -> bool:
    return isinstance(layer, SkippedLayer)


class _Stage:
    """Mixed in before a transformers causal-LM class by build_hf_stage_modules: the stage's forward."""

    def forward(self, x: torch.Tensor, *carried: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, ids: torch.Tensor | None = None):
        """Token ids [B, S] (first stage), or what the previous stage's last layer returned (the hidden states
        [B, S, ...], and what the layers hand each other beside them) -> what this stage's last layer returns, or
        logits [B, S, V] on the last stage. Packed rows need no document ids (models.hf_transformers.logits)."""
        del document_ids
        role = _ROLES[self]
        layers = self.model.layers
        if role.first:
            ids = x
        elif ids is None:
            ids = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
        hooks, produced = [], []
        if not role.first:
            def received(module, args, kwargs):
                args, kwargs = list(args), dict(kwargs)
                for slot, value in zip((0, *role.slots), (x, *carried)):
                    if isinstance(slot, str):
                        kwargs[slot] = value
                    elif slot < len(args):
                        args[slot] = value
                    else:  # the first slot is the hidden states, passed by keyword
                        kwargs["hidden_states"] = value
                return tuple(args), kwargs

            hooks.append(layers[role.first_layer].register_forward_pre_hook(received, with_kwargs=True))
        if not role.last:
            def keep(module, args, output):
                found = output if isinstance(output, tuple) else (output,)
                produced.append(found[: 1 + len(role.slots)])

            hooks.append(layers[role.last_layer].register_forward_hook(keep))
        try:
            if role.last:
                return super().forward(input_ids=ids, position_ids=positions, use_cache=False).logits
            self.model(input_ids=ids, position_ids=positions, use_cache=False)
            return produced[-1] if role.slots else produced[-1][0]
        finally:
            for hook in hooks:
                hook.remove()


_CLASSES: dict[type, type] = {}


def _stage_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"PipelineStage{cls.__name__}", (_Stage, cls), {})
    return _CLASSES[cls]
