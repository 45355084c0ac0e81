"""Expert parallelism for a Hugging Face model's own experts modules, through transformers 5's experts interface.

transformers 5 decorates the experts module of its MoE architectures with `use_experts_implementation`: one call,
`experts(hidden_states [T, D], top_k_index [T, K], top_k_weights [T, K])`, dispatched to the function registered
under `config._experts_implementation`. Some architectures subclass the decorated class and do more per expert
around that call (ergo: a learned RMSNorm per expert on each route's output).

moeflow takes the whole experts module's forward as the unit, as transformers' own expert parallelism does (its
`ep_dispatch_experts`): it sends each token once to every rank owning one of its experts (moeflow.ep.Buffer.dispatch),
runs the module's own forward on the (row, slot) pairs that arrived for this rank's E / R experts, one slot per
pair with its local expert id, sums each row's pairs, and sums each token's copies back (Buffer.combine). Inside, the
interface call runs transformers' grouped-matmul experts function on those pairs; so biases, interleaved or
transposed weights, custom gates and per-expert norms stay the architecture's. Every tensor of
an experts module holds one row per expert (FSDP shards the whole module over the expert mesh): each rank keeps its
rows. The router, shared experts and everything else stay transformers' modules, replicated; their gradients are
this rank's tokens' share, which data parallelism sums.

Shape legend: T tokens (this rank's), K top-k, E experts, L local experts (E // R), D hidden, R ranks, N received
rows.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from moeflow.ep.buffer import Buffer
from moeflow.models.hf_transformers import is_hf_experts
from moeflow.models.lora import LORA_EXPERTS_IMPLEMENTATION
from moeflow.parallel.expert import arrived_tensors, overlaps

__all__ = ["is_hf_experts"]  # (defined with transformers' model, used with the rest here)

# the expert tensors transformers' experts functions read; an experts module may hold more, all per expert
# (ergo's post_expert_norm.weight): expert_tensor_names
EXPERT_TENSORS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
# the experts function the module's interface call runs under expert parallelism (on this rank's pairs only)
LOCAL_EXPERTS_IMPLEMENTATION = "grouped_mm"

# experts module -> (its Buffer, E, first global expert held here, chunks, overlap): kept beside the module, which
# gains no attribute
_EXPERT_PARALLEL: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def is_expert_parallel_hf(module: nn.Module) -> bool:
    """An experts module apply_hf_expert_parallel changed."""
    return module in _EXPERT_PARALLEL


def hf_experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_hf_experts(m)]


def expert_tensor_names(module: nn.Module) -> list[str]:
    """The names (relative to `module`) of the tensors an experts module holds one row per expert of: all of its
    parameters, its submodules' too."""
    return [name for name, _ in module.named_parameters()]


def global_num_experts(module: nn.Module) -> int:
    """The experts of a transformers experts module over all ranks (its `num_experts` counts this rank's)."""
    return _EXPERT_PARALLEL[module][1] if module in _EXPERT_PARALLEL else module.num_experts


def hf_expert_slices(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{fqn of an expert tensor: (first global expert id held here, experts held here)} of every transformers
    experts module (the checkpoint stores experts one per key, so that it reshards over ep)."""
    out = {}
    for name, module in model.named_modules():
        if is_hf_experts(module):
            first = _EXPERT_PARALLEL[module][2] if module in _EXPERT_PARALLEL else 0
            for tensor in expert_tensor_names(module):
                out[f"{name}.{tensor}"] = (first, module.num_experts)
    return out


def apply_hf_expert_parallel(model: nn.Module, group=None, backend: str = "auto", chunks: int = 1,
                             overlap: bool | None = None) -> int:
    """Keep this rank's E / R experts of every transformers experts module of `model` and route its tokens through
    moeflow.ep over `group` (None: the default group); `chunks` and `overlap` as moeflow's own MoE takes them
    (moeflow.parallel.expert.ExpertParallelDispatcher). Returns how many experts modules it changed.

    Each module keeps its parameter names; its class becomes a subclass whose forward moves the tokens around the
    module's own (no attribute is added). Its tensors become this rank's rows [r * L, (r+1) * L), `num_experts`
    becomes L; no slot of another rank's expert reaches the module's own forward, so transformers' sentinel
    handling (`_is_expert_parallel`) stays off. ValueError, before anything changes, when E does not split over
    the ranks or a tensor is not one row per expert."""
    modules = hf_experts_modules(model)
    if not modules:
        return 0
    buffer = Buffer(group, backend=backend)
    R, r = buffer.group_size, buffer.rank
    for module in modules:
        if module.num_experts % R:
            raise ValueError(f"parallel.ep = {R} does not divide the {module.num_experts} experts of "
                             f"{type(module).__name__}; choose an ep that divides {module.num_experts}")
        for name, p in module.named_parameters():
            if p.ndim == 0 or p.shape[0] != module.num_experts:  # FSDP would treat it as expert-sharded
                raise ValueError(f"parallel.ep = {R}: {type(module).__name__}.{name} {tuple(p.shape)} is not one "
                                 f"row per expert of its {module.num_experts}, so it cannot be split by expert; "
                                 f"use ep = 1")
    for module in modules:
        E = module.num_experts
        L = E // R
        for holder in module.modules():
            for name, full in list(holder.named_parameters(recurse=False)):
                setattr(holder, name, nn.Parameter(full.detach()[r * L:(r + 1) * L].clone(),
                                                   requires_grad=full.requires_grad))
        module.num_experts = L
        if module.config._experts_implementation != LORA_EXPERTS_IMPLEMENTATION:  # (that one runs grouped_mm too)
            module.config._experts_implementation = LOCAL_EXPERTS_IMPLEMENTATION
        module.__class__ = _expert_parallel_class(type(module))
        _EXPERT_PARALLEL[module] = (buffer, E, r * L, chunks, overlap)
    return len(modules)


class _ExpertParallel:
    """Mixed in before a transformers experts class by apply_hf_expert_parallel: the module's own forward runs on
    the rows moeflow.ep brings this rank."""

    # communication and data-dependent sizes: eager inside a compiled block (a graph break), as moeflow's own
    # token mover (moeflow.parallel.expert)
    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """[T, D] in, [T, D] out, as the module's own forward in one process (sum over k of top_k_weights[:, k] *
        expert_k(token), and whatever the architecture does per expert around it). The tokens travel in
        `chunks` chunks, as moeflow's own MoE moves them (MoE.forward): under overlap, chunk i+1's dispatch and
        chunk i-1's combine are in flight while chunk i's experts compute."""
        buffer, E, _, chunks, overlap = _EXPERT_PARALLEL[self]
        asynchronous = overlaps(buffer, overlap, chunks, hidden_states.device)
        T = hidden_states.shape[0]
        bounds = [T * i // chunks for i in range(chunks + 1)]

        def send(i: int):
            rows = slice(bounds[i], bounds[i + 1])
            x_TD, idx_TK, w_TK = hidden_states[rows], top_k_index[rows], top_k_weights[rows]
            per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx_TK, E)
            # Buffer takes float32 weights (DeepEP's format); back to the router's dtype on arrival
            return buffer.dispatch(x_TD, topk_idx=idx_TK, topk_weights=w_TK.float(), num_tokens_per_rank=per_rank,
                                   num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert, async_finish=asynchronous)

        in_flight, combining = send(0), []
        for i in range(chunks):
            nxt = send(i + 1) if i + 1 < chunks else None
            recv_x_ND, recv_idx_NK, recv_w_NK, recv_per_expert, handle, event = in_flight
            recv_x_ND, recv_w_NK = arrived_tensors(event, recv_x_ND, recv_w_NK)
            # A received row carries all K slots of its token, -1 where the expert is on another rank (about
            # (R - 1) / R of them). The module's own forward runs on the P (row, slot) pairs of this rank's
            # experts alone, one slot each, so that its gathers, activation and weighting skip the other ranks'
            # slots (the sentinel slots transformers' function would carry through all of them); each row sums
            # its pairs after.
            P = sum(recv_per_expert)  # known on the host from the dispatch: no device sync to size the pairs
            row_P, slot_P = torch.nonzero_static(recv_idx_NK >= 0, size=P).unbind(1)
            y_PD = super().forward(recv_x_ND[row_P], recv_idx_NK[row_P, slot_P, None],
                                   recv_w_NK[row_P, slot_P, None].to(top_k_weights.dtype))
            y_ND = y_PD.new_zeros(recv_x_ND.shape).index_add_(0, row_P, y_PD)
            y_TD, _, combined = buffer.combine(y_ND.to(hidden_states.dtype), handle, async_finish=asynchronous)
            combining.append((combined, y_TD))
            in_flight = nxt
        outs = [arrived_tensors(combined, y_TD)[0] for combined, y_TD in combining]
        return torch.cat(outs) if len(outs) > 1 else outs[0]


_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    """`cls` with _ExpertParallel's forward around its own (one class per experts class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (_ExpertParallel, cls), {})
    return _CLASSES[cls]


# ---- routing statistics ----------------------------------------------------------------------------------------


class HFRouting:
    """What moeflow reads and updates of a transformers MoE block's routing, in the shape of its own Router: the
    tokens each (global) expert was sent in the block's last forward (`last_load`, counted from the experts
    module's own call, before any dispatch), and the architecture's selection bias where it keeps one as a
    buffer of E values (`expert_bias`: DeepSeek-V3's, GLM-4.5's ... `e_score_correction_bias`; replicated on
    every rank, FSDP2 shards parameters only), which `update_bias` moves as moeflow's aux-loss-free routers move
    theirs, at `bias_update_rate`. That rate is 0 for a library caller (transformers' own training leaves the bias
    fixed); `moeflow train` sets model.moe.bias_update_rate under model.moe.load_balance = 'aux_free' (the
    default; 0 keeps it fixed). A bias kept as a frozen parameter (Laguna's, ERNIE-4.5's) is left as it is."""

    last_dropped = 0.0  # dropless

    def __init__(self, experts: nn.Module, block: nn.Module):
        self.num_experts = _EXPERT_PARALLEL[experts][1] if experts in _EXPERT_PARALLEL else experts.num_experts
        # the bias by name: its tensor is replaced when a rank-local read gives the model storage (to_empty)
        names = [name for name, t in block.named_buffers()
                 if name.endswith("e_score_correction_bias") and t.numel() == self.num_experts]
        # (weakly: the block holds the experts module this is kept beside)
        self._block, self._bias_name = weakref.ref(block), names[0] if names else None
        self.bias_update_rate = 0.0
        device = next((p.device for p in experts.parameters() if p.device.type != "meta"), torch.device("cpu"))
        self.last_load = self.last_selected = torch.zeros(self.num_experts, device=device)
        experts.register_forward_pre_hook(self._count, with_kwargs=True)

    @property
    def expert_bias(self) -> torch.Tensor | None:
        if self._bias_name is None:
            return None
        owner, _, name = self._bias_name.rpartition(".")
        block = self._block()
        return getattr(block.get_submodule(owner) if owner else block, name).view(-1)  # ([1, E] in some)

    @torch.compiler.disable
    def _count(self, module, args, kwargs) -> None:
        from moeflow.models.moe import count_keys

        if len(args) == 1 and hasattr(args[0], "args"):  # its inputs hidden from FSDP2 (moeflow.parallel.expert)
            args = args[0].args
        top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        self.last_load = count_keys(top_k_index.reshape(-1).long(), self.num_experts).float()
        self.last_selected = self.last_load  # dropless: every selection is routed

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        bias = self.expert_bias
        if bias is not None and self.bias_update_rate:
            bias += self.bias_update_rate * torch.sign(load_E.mean() - load_E).to(bias.dtype)


_ROUTING: weakref.WeakKeyDictionary[nn.Module, HFRouting] = weakref.WeakKeyDictionary()


def _experts_by_layer(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """{decoder layer index: (name, experts module)} by the index in its name ('model.layers.<i>.mlp.experts')."""
    import re

    out = {}
    for name, module in model.named_modules():
        found = re.search(r"layers\.(\d+)\.", name) if is_hf_experts(module) else None
        if found:
            out[int(found.group(1))] = (name, module)
    return dict(sorted(out.items()))


def hf_moe_layers(model: nn.Module) -> list[int]:
    """The decoder layers of a transformers model whose FFN is an MoE block with an experts module."""
    return list(_experts_by_layer(model))


def hf_routing(model: nn.Module) -> dict[int, HFRouting]:
    """{decoder layer index: HFRouting} of every transformers experts module of `model` (made once per module)."""
    by_layer = _experts_by_layer(model)
    for name, module in by_layer.values():
        if module not in _ROUTING:
            _ROUTING[module] = HFRouting(module, model.get_submodule(name.rsplit(".", 1)[0]))
    return {layer: _ROUTING[module] for layer, (_, module) in by_layer.items()}
