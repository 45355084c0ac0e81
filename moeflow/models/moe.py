"""Mixture-of-Experts FFN: Router, GroupedExperts, shared experts, and the MoE module that joins them.

Shape suffixes: T tokens, K top-k, E experts, D model width, F expert width, N routed rows (valid
(token, expert) pairs sorted by expert), G expert groups, B sequences, S tokens per sequence, C capacity.

MoE.forward is route -> dispatch -> experts -> combine. The dispatcher is a TokenDispatcher: `LocalDispatcher` here
(every expert in this process: dispatch sorts the token copies by expert), and expert parallelism swaps in
one that moves tokens between ranks (moeflow.parallel.expert) together with this rank's slice of the experts.
Both hand back what dispatch and combine produce as a Waitable: wait() returns it once it has arrived.
No torch.distributed here.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.core import phases
from moeflow.core.model_config import ModelConfig, MoEConfig, grouped_mm_alignment_error
from moeflow.models.layers import autocast_input, autocast_on
from moeflow.models.phase_range import phase_range

V = TypeVar("V")

# The fastest grouped-matmul path measured by bench/moe_layer.py, per device type (see its README table).
DEFAULT_EXPERT_IMPL = {"cpu": "grouped_mm", "cuda": "grouped_mm"}


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass
class RouterOutput:
    topk_idx: torch.Tensor  # [T, K] int64, -1 where a token was dropped by the capacity limit
    topk_weights: torch.Tensor  # [T, K] float32, 0 where dropped; carries the aux-loss gradient
    tokens_per_expert: torch.Tensor  # [E] int64, after dropping
    aux_loss: torch.Tensor  # scalar, already multiplied by the coefficients (0 when off)
    capacity: int | None = None  # rows each expert may take (None: dropless)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the routing weights whose backward also feeds d(aux)/d(aux) = scale into the aux loss.

    This adds the balance loss to the training objective without threading it through every
    module's return value (and so without the model's forward returning more than logits); the
    same trick Megatron-Core uses (MoEAuxLossAutoScaler).
    """

    @staticmethod
    def forward(ctx, weights_TK, aux_loss, scale: float):
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        return weights_TK.view_as(weights_TK)

    @staticmethod
    def backward(ctx, grad_TK):
        return grad_TK, torch.full(ctx.aux_shape, ctx.scale, device=grad_TK.device), None


class _DeferredGlobalBalance(torch.autograd.Function):
    """coef * E * sum_e f_e * P_e where f (the global batch's selection shares) is only known after every rank's
    forward: its backward reads `router.global_selected`, which the step runner all-reduces between this
    micro-batch's forward and its backward (moeflow.parallel.runner). The forward value uses this forward's own
    selections as a stand-in; the gradient is the global one."""

    @staticmethod
    def forward(ctx, probs_mean_E, local_share_E, router):
        ctx.router = router
        return router.cfg.aux_loss_coef * router.cfg.num_experts * (local_share_E * probs_mean_E).sum()

    @staticmethod
    def backward(ctx, grad):
        share_E = ctx.router.global_selection_share()
        return grad * ctx.router.cfg.aux_loss_coef * ctx.router.cfg.num_experts * share_E, None, None


class Router(nn.Module):
    """Top-k router with group-limited selection, aux-loss-free bias, aux/z losses and capacity."""

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(dim, cfg.num_experts, bias=False)
        # Used only to choose experts, never to weight them (DeepSeek-V3 report, sec. 2.1.2).
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        # The load of the last forward, read by the trainer right after it (for logging and bias
        # updates). Overwritten, never accumulated, so activation recomputation cannot count twice.
        self.last_load: torch.Tensor | None = None  # [E] float32 tokens per expert
        self.last_dropped: torch.Tensor | None = None  # scalar float32, assignments dropped
        self.last_selected: torch.Tensor | None = None  # [E] float32 top-k selections per expert, before drops
        self.aux_loss_scale = 1.0  # the trainer sets 1 / gradient-accumulation steps
        # aux_loss_type 'global_batch': top-k selections per expert summed over every token of the optimizer step
        # on all ranks, handed in by the step runner (model code never communicates; docs/design.md, principle 1).
        self.global_selected: torch.Tensor | None = None  # [E] float32

    @property
    def num_experts(self) -> int:
        return self.cfg.num_experts

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        if self.cfg.score_func == "softmax":
            return logits_TE.softmax(dim=-1)
        return logits_TE.sigmoid()

    def select(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """topk_idx [T, K] from scores (+ the balancing bias), limited to the best topk_group groups."""
        cfg = self.cfg
        choice_TE = scores_TE + self.expert_bias if cfg.load_balance == "aux_free" else scores_TE
        if cfg.n_group > 1:
            T, E = choice_TE.shape
            per_group = E // cfg.n_group
            grouped_TGe = choice_TE.view(T, cfg.n_group, per_group)
            # A group's score is the sum of its best two experts (DeepSeek-V3's HF reference code).
            group_score_TG = grouped_TGe.topk(min(2, per_group), dim=-1).values.sum(-1)
            keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
            keep_TG.scatter_(1, group_score_TG.topk(cfg.topk_group, dim=-1).indices, True)
            keep_TE = keep_TG.unsqueeze(-1).expand(T, cfg.n_group, per_group).reshape(T, E)
            choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
        return choice_TE.topk(cfg.top_k, dim=-1).indices

    def capacity(self, num_tokens: int) -> int:
        """ceil(cf * T * K / E): the assignments one expert may take from T tokens."""
        return math.ceil(self.cfg.capacity_factor * num_tokens * self.cfg.top_k / self.cfg.num_experts)

    def apply_capacity(self, topk_idx_TK: torch.Tensor, weights_TK: torch.Tensor | None = None) -> torch.Tensor:
        """Drop assignments beyond the capacity per expert: the latest tokens (drop_policy 'position', GShard) or
        the lowest routing weights (drop_policy 'probs', ties to the earlier token). -1 marks a dropped one."""
        T, K = topk_idx_TK.shape
        E = self.cfg.num_experts
        capacity = self.capacity(T)
        flat = topk_idx_TK.reshape(-1)
        if self.cfg.drop_policy == "probs":
            # heaviest first (a stable sort keeps (t, k) order among equal weights), then grouped by expert
            by_weight = torch.argsort(-weights_TK.detach().reshape(-1), stable=True)
            order = by_weight[torch.argsort(flat[by_weight], stable=True)]
        else:
            order = torch.argsort(flat, stable=True)  # (t, k) order is kept inside each expert
        pos = position_in_group(flat, order, E)
        return torch.where(pos < capacity, flat, torch.full_like(flat, -1)).view(T, K)

    def forward(self, x_TD: torch.Tensor, num_sequences: int = 1) -> RouterOutput:
        """Route T tokens; `num_sequences` equal consecutive sequences make them up (for the sequence-wise loss)."""
        cfg = self.cfg
        # Routing in fp32 whatever the activations are: top-k ties and softmax saturate in bf16.
        logits_TE = fp32_linear(x_TD, self.gate.weight)
        scores_TE = self.scores(logits_TE)
        with torch.no_grad():
            selected_TK = self.select(scores_TE)
        weights_TK = scores_TE.gather(1, selected_TK)
        if cfg.norm_topk_prob and (cfg.top_k > 1 or cfg.norm_top1):
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        weights_TK = weights_TK * cfg.route_scale
        topk_idx_TK, capacity = selected_TK, None
        if cfg.capacity_factor is not None:
            capacity = self.capacity(x_TD.shape[0])
            topk_idx_TK = self.apply_capacity(selected_TK, weights_TK)
            weights_TK = weights_TK.masked_fill(topk_idx_TK < 0, 0.0)

        valid = topk_idx_TK >= 0
        tokens_per_expert_E = expert_counts(topk_idx_TK, cfg.num_experts)
        self.last_selected = count_keys(selected_TK.reshape(-1), cfg.num_experts).float()
        aux_loss = self.balance_losses(logits_TE, scores_TE, topk_idx_TK, selected_TK, num_sequences)
        if aux_loss.requires_grad and torch.is_grad_enabled():
            weights_TK = _AttachAuxLoss.apply(weights_TK, aux_loss, self.aux_loss_scale)
        self.last_load = tokens_per_expert_E.detach().float()
        self.last_dropped = (~valid).sum().float()
        return RouterOutput(topk_idx_TK, weights_TK, tokens_per_expert_E, aux_loss.detach(), capacity)

    def balance_losses(self, logits_TE, scores_TE, topk_idx_TK, selected_TK=None, num_sequences: int = 1):
        """aux_coef * E * sum_e f_e P_e  +  z_coef * mean(logsumexp(logits)^2).

        f_e: share of the top-k assignments that chose e (1/E each when balanced, so the loss is 1 then);
        P_e: mean routing probability of e, the scores renormalised to sum to one per token (Switch Transformers,
        Fedus et al. 2021, eq. 4; ST-MoE, Zoph et al. 2022, eq. 5 for the z-loss). Over which tokens:
        micro_batch  this forward's T tokens, f from the assignments kept after capacity drops;
        sequence     each sequence's S tokens, f from its top-k selections, averaged over the B sequences:
                     (aux_coef / B) * sum_b sum_e (E / (K S)) count_be * P_be (DeepSeek-V3 report, eqs. 17-20);
        global_batch f from the selections of every token of the optimizer step on every rank
                     (`global_selected`), P over this forward's tokens: averaging over micro-batches and
                     data-parallel ranks, as the gradients are, gives P over the global batch too
                     (Qiu et al. 2025, "Demons in the Detail", arXiv:2501.11873, sec. 3).
        """
        cfg = self.cfg
        total = logits_TE.new_zeros(())
        if cfg.aux_loss_coef > 0:
            T, K = topk_idx_TK.shape
            E = cfg.num_experts
            probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
            if cfg.aux_loss_type == "sequence":
                B = num_sequences
                picks_BM = selected_TK.view(B, -1)  # M = S * K selections per sequence
                counts_BE = logits_TE.new_zeros(B, E).scatter_add_(1, picks_BM, logits_TE.new_ones(picks_BM.shape))
                f_BE = counts_BE * E / (K * (T // B))
                total = total + cfg.aux_loss_coef * (f_BE * probs_TE.view(B, -1, E).mean(1)).sum(-1).mean()
            elif cfg.aux_loss_type == "global_batch":
                P_E = probs_TE.mean(0)
                if self.global_selected is not None:  # known before the forward (the runner's counting pass)
                    total = total + cfg.aux_loss_coef * E * (self.global_selection_share() * P_E).sum()
                else:
                    local_share_E = self.last_selected / self.last_selected.sum()
                    total = total + _DeferredGlobalBalance.apply(P_E, local_share_E, self)
            else:
                f_E = expert_counts(topk_idx_TK, E).float() / (T * K)
                total = total + cfg.aux_loss_coef * E * (f_E * probs_TE.mean(0)).sum()
        if cfg.z_loss_coef > 0:
            total = total + cfg.z_loss_coef * torch.logsumexp(logits_TE, dim=-1).square().mean()
        return total

    def global_selection_share(self) -> torch.Tensor:
        """f_e of the global-batch loss: expert e's share of all top-k selections of the step."""
        if self.global_selected is None:
            raise RuntimeError(
                "model.moe.aux_loss_type = 'global_batch' needs the expert loads of the whole step, which the step "
                "runner (moeflow.parallel.runner) supplies before backward; this forward ran outside one. Run the "
                "step through parallelize(...).runner, or use aux_loss_type = 'micro_batch' or 'sequence'"
            )
        return self.global_selected / self.global_selected.sum()

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
        if self.cfg.load_balance == "aux_free":
            self.expert_bias += self.cfg.bias_update_rate * torch.sign(load_E.mean() - load_E)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in float32, also under autocast (which would run it in bf16 whatever the operands' dtype)."""
    with torch.autocast(x.device.type, enabled=False) if autocast_on(x) else contextlib.nullcontext():
        return F.linear(x.float(), weight.float())


def count_keys(key_N: torch.Tensor, num_bins: int) -> torch.Tensor:
    """[num_bins] int64 occurrences of each key in [0, num_bins). A scatter-add, not torch.bincount, whose
    output size depends on the largest key: reading it is a host sync on a GPU."""
    return torch.zeros(num_bins, dtype=torch.int64, device=key_N.device).scatter_add_(
        0, key_N, torch.ones_like(key_N))


def position_in_group(key_N: torch.Tensor, order_N: torch.Tensor, num_bins: int) -> torch.Tensor:
    """[N] for each entry, how many entries with the same key come before it in `order_N` (a sort by key)."""
    counts = count_keys(key_N, num_bins)
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(key_N.numel(), device=key_N.device) - starts[key_N[order_N]]
    return torch.empty_like(pos_sorted).scatter_(0, order_N, pos_sorted)


def expert_counts(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 valid entries per expert; -1 entries go to a last bin that is dropped (no boolean indexing,
    which would read the mask back to the host)."""
    key = torch.where(topk_idx_TK >= 0, topk_idx_TK, num_experts).reshape(-1)
    return count_keys(key, num_experts + 1)[:num_experts]


def permute_by_expert(topk_idx_TK: torch.Tensor, num_experts: int,
                      dropless: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_N, counts_E): flat (t*K + k) positions of the valid pairs, sorted by expert; per-expert counts.

    With capacity drops the number of valid pairs N is data dependent, so slicing to it is a host sync (one per
    layer, and a graph break under torch.compile); `dropless` (no pair is -1) knows N = T*K without reading it.
    """
    flat = topk_idx_TK.reshape(-1)
    key = torch.where(flat < 0, torch.full_like(flat, num_experts), flat)  # dropped pairs sort last
    order = torch.argsort(key, stable=True)
    counts_E = expert_counts(topk_idx_TK, num_experts)
    if dropless:
        return order, counts_E
    n_valid = int(counts_E.sum())  # host sync: the output size of the expert matmuls
    return order[:n_valid], counts_E


@dataclass
class Dispatched:
    """Rows for this process's experts, sorted by expert, and what combine needs to put them back."""

    x_ND: torch.Tensor  # one row per (token, local expert) pair, sorted by expert
    counts_E: torch.Tensor  # rows per local expert
    row_N: torch.Tensor  # the source row (token, or received row under EP) of each expert row
    weight_N: torch.Tensor  # its routing weight (float32)
    num_rows: int  # rows of the tensor the expert rows are summed back into
    handle: object = None  # the token mover's own state (an EP handle), if any
    valid_N: torch.Tensor | None = None  # static sizes: which rows are real pairs (the rest sort last)


def sort_by_expert(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                   num_experts: int, static: bool = False, dropless: bool = False) -> Dispatched:
    """Gather one row per valid (row, expert) pair, grouped by expert (-1 pairs are skipped).

    static: keep all T*K pairs, the -1 ones last (masked to zero), so no size is read back to the host; the
    experts' grouped matmul covers only the pairs its offsets count. dropless: there are no -1 pairs (routing
    without a capacity), so every size is known without reading one back and nothing needs masking."""
    if static:
        K = topk_idx_TK.shape[1]
        key_N = torch.where(topk_idx_TK >= 0, topk_idx_TK, num_experts).reshape(-1)
        order_N = torch.argsort(key_N, stable=True)
        counts_E = count_keys(key_N, num_experts + 1)[:num_experts]
        valid_N = key_N.index_select(0, order_N) < num_experts
        row_N = order_N // K
        x_ND = torch.where(valid_N.unsqueeze(-1), x_TD.index_select(0, row_N), 0.0)
        weight_N = topk_weights_TK.reshape(-1).index_select(0, order_N)
        return Dispatched(x_ND, counts_E, row_N, weight_N, x_TD.shape[0], valid_N=valid_N)
    order_N, counts_E = permute_by_expert(topk_idx_TK, num_experts, dropless)
    row_N = order_N // topk_idx_TK.shape[1]
    # index_select, not x_TD[row_N]: its backward is an index_add, where advanced indexing's is an
    # accumulating index_put, ~10x slower on the CPU (~1.7 ms of a 40 ms step in bench/moe_layer.py).
    weight_N = topk_weights_TK.reshape(-1).index_select(0, order_N)
    return Dispatched(x_TD.index_select(0, row_N), counts_E, row_N, weight_N, x_TD.shape[0])


def sort_into_capacity(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                       num_experts: int, capacity: int) -> Dispatched:
    """Exactly `capacity` rows per expert (model.moe.pad_to_capacity): expert e's kept pairs fill slots
    [e * C, e * C + count_e) in (token, k) order, the other slots hold zero rows of weight 0. Every size is known
    before the data, so there is no host sync and the expert matmuls always see [E * C, D]."""
    E, C = num_experts, capacity
    T, K = topk_idx_TK.shape
    flat = topk_idx_TK.reshape(-1)
    key = torch.where(flat < 0, torch.full_like(flat, E), flat)  # dropped pairs sort last, into key E
    pos = position_in_group(key, torch.argsort(key, stable=True), E + 1)
    # slot of each (t, k) pair; dropped pairs all go to one spare slot E * C that is cut off below
    slot = torch.where(key < E, key * C + pos, torch.full_like(key, E * C))
    token = torch.arange(T * K, device=flat.device) // K
    x_slots = x_TD.new_zeros(E * C + 1, x_TD.shape[1]).index_copy(0, slot, x_TD.index_select(0, token))
    weight_slots = topk_weights_TK.new_zeros(E * C + 1).index_copy(0, slot, topk_weights_TK.reshape(-1))
    row_slots = torch.zeros(E * C + 1, dtype=torch.long, device=flat.device).index_copy(0, slot, token)
    counts_E = torch.full((E,), C, dtype=torch.long, device=flat.device)
    return Dispatched(x_slots[:E * C], counts_E, row_slots[:E * C], weight_slots[:E * C], T)


def weighted_sum_back(y_ND: torch.Tensor, d: Dispatched, like_TD: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over t's expert rows of weight * y, shaped and typed like `like_TD`."""
    if d.valid_N is not None:  # rows past the last group hold whatever the matmul left there
        y_ND = torch.where(d.valid_N.unsqueeze(-1), y_ND, 0.0)
    y_ND = y_ND * d.weight_N.unsqueeze(-1).to(y_ND.dtype)
    return like_TD.new_zeros(d.num_rows, like_TD.shape[-1]).index_add_(0, d.row_N, y_ND.to(like_TD.dtype))


class Waitable(Protocol[V]):
    """A value that may still be travelling: wait() returns it once it is there. An expert-parallel dispatcher hands
    back moeflow.ep's InFlight (moeflow/ep/inflight.py); the models layer names only the method it calls."""

    def wait(self) -> V: ...


class Ready(Generic[V]):
    """A value that is already there (nothing travels in one process)."""

    def __init__(self, value: V):
        self.value = value

    def wait(self) -> V:
        return self.value


class TokenDispatcher(Protocol):
    """What MoE.forward moves its tokens with: LocalDispatcher in one process, ExpertParallelDispatcher
    (moeflow/parallel/expert.py) under expert parallelism. Both return the same types."""

    def chunks(self, num_tokens: int) -> list[slice]:
        """The chunks of the layer's T tokens that travel one after another (one chunk: [0, T))."""
        ...

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor) -> Waitable[Dispatched]:
        """One chunk's rows for this process's experts, sorted by expert."""
        ...

    def combine(self, y_ND: torch.Tensor, d: Dispatched, x_TD: torch.Tensor) -> Waitable[torch.Tensor]:
        """The chunk's output [T, D] in x's dtype: each token's expert rows, weighted and summed."""
        ...


class LocalDispatcher:
    """Every expert lives in this process: dispatch sorts the token copies by expert, combine sums them back.
    One chunk, and nothing is ever in flight."""

    def __init__(self, routing: MoEConfig):
        self.routing = routing  # the router's settings, read at each dispatch as the router reads them

    @property
    def dropless(self) -> bool:
        """The router drops no pair (no capacity): no size to read back, no graph break."""
        return self.routing.capacity_factor is None

    def chunks(self, num_tokens: int) -> list[slice]:
        return [slice(0, num_tokens)]

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor) -> Ready[Dispatched]:
        return Ready(sort_by_expert(x_TD, topk_idx_TK, topk_weights_TK, self.routing.num_experts,
                                    dropless=self.dropless))

    def combine(self, y_ND: torch.Tensor, d: Dispatched, x_TD: torch.Tensor) -> Ready[torch.Tensor]:
        return Ready(weighted_sum_back(y_ND, d, x_TD))


class _SwiGLU(torch.autograd.Function):
    """silu(h1) * h3 with the ops autograd would run (so the same bits), saving only h1 and h3 for backward:
    autograd's composition also keeps silu(h1), one more [N, F] activation per MoE layer; backward recomputes it,
    one elementwise op."""

    @staticmethod
    def forward(ctx, h1, h3):
        ctx.save_for_backward(h1, h3)
        return F.silu(h1).mul_(h3)

    @staticmethod
    def backward(ctx, grad):
        h1, h3 = ctx.saved_tensors
        grad_h1 = grad_h3 = None
        if ctx.needs_input_grad[1]:
            grad_h3 = F.silu(h1).mul_(grad)
        if ctx.needs_input_grad[0]:
            grad_h1 = grad * h3
            torch.ops.aten.silu_backward.grad_input(grad_h1, h1, grad_input=grad_h1)
        return grad_h1, grad_h3


def _swiglu(h1, h3):
    return _SwiGLU.apply(h1, h3)


class GroupedExperts(nn.Module):
    """E SwiGLU experts with 3-D weights; rows arrive sorted by expert with per-expert counts."""

    IMPLS = ("grouped_mm", "bmm", "loop")

    def __init__(self, num_experts: int, dim: int, hidden: int, impl: str = "auto", expert_offset: int = 0):
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        # Global id of expert 0 here: nonzero when expert parallelism keeps a slice (checkpoints use global ids).
        self.expert_offset = expert_offset
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))  # gate, [E, D, F]
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))  # up,   [E, D, F]
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # down, [E, F, D]
        self.impl = impl
        # Rows per expert are padded to a multiple of this (low-precision grouped GEMMs need aligned groups:
        # 16 for FP8, 32 for MXFP8); moeflow.parallel.fp8 sets it together with the weights' FP8 wrapper.
        self.group_alignment = 1
        # torchao's FP8/MXFP8 grouped GEMMs want the right operand column-major (they assert it); also set there.
        self.column_major_weights = False
        # alpha / r of a LoRA adapter on these experts (moeflow/models/lora.py adds its factors); 0: none.
        self.lora_scale = 0.0

    def resolve_impl(self, x: torch.Tensor) -> str:
        misaligned = grouped_mm_alignment_error(self.dim, self.hidden, x.element_size(), str(x.dtype))
        if self.lora_scale and not misaligned:  # a LoRA adapter's rank is a matmul width too
            misaligned = grouped_mm_alignment_error(self.dim, self.lora_down_A.shape[1], x.element_size(),
                                                    str(x.dtype))
        if self.impl != "auto":
            if self.impl == "grouped_mm" and misaligned:
                raise ValueError(misaligned)
            return self.impl
        impl = DEFAULT_EXPERT_IMPL.get(x.device.type, "loop")
        # On CUDA torch's fast grouped GEMM is bf16 only (other dtypes take a per-group fallback after reading the
        # offsets back to the host): bf16 comes in under autocast (MoE.forward casts), fp32 training takes bmm.
        if impl == "grouped_mm" and x.device.type == "cuda" and x.dtype != torch.bfloat16:
            return "bmm"
        if impl == "grouped_mm" and misaligned:
            return "bmm"
        return impl

    def lora_deltas(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The LoRA adapter's change to (w1, w3, w2): factors of gate_up [E, 2F, D] and down [E, D, F], the
        layouts of a Hugging Face experts module, in which peft adapts them (moeflow/models/lora.py)."""
        gate_up_E2FD = self.lora_scale * self.lora_gate_up_B @ self.lora_gate_up_A
        down_EDF = self.lora_scale * self.lora_down_B @ self.lora_down_A
        return gate_up_E2FD[:, :self.hidden].mT, gate_up_E2FD[:, self.hidden:].mT, down_EDF.mT

    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = self.w1, self.w3, self.w2
        lora = (self.lora_scale, self.lora_gate_up_A, self.lora_gate_up_B, self.lora_down_A,
                self.lora_down_B) if self.lora_scale else None
        if self.column_major_weights:
            w1, w3, w2 = (w.mT.contiguous().mT for w in (w1, w3, w2))
        if self.group_alignment > 1:
            x_ND, counts_E, rows_N = pad_groups(x_ND, counts_E, self.group_alignment)
            return expert_matmuls(x_ND, counts_E, w1, w3, w2, self.resolve_impl(x_ND), lora).index_select(0, rows_N)
        return expert_matmuls(x_ND, counts_E, w1, w3, w2, self.resolve_impl(x_ND), lora)


def pad_groups(x_ND: torch.Tensor, counts_E: torch.Tensor, alignment: int):
    """(x_PD, counts_E, rows_N): every expert's rows padded with zero rows to a multiple of `alignment`, and where
    each of the N rows went. P = N + E * (alignment - 1) rounded up to the alignment, a size known without a host
    sync: the slack beyond the rounded groups goes to the last expert (still a multiple of the alignment), and so
    do the rows past the counted ones (a static receive size's tail, masked out by the combine)."""
    N, E = x_ND.shape[0], counts_E.numel()
    counts_E = torch.cat([counts_E[:-1], counts_E[-1:] + (N - counts_E.sum())])  # static tail rows: last expert
    P = -(-(N + E * (alignment - 1)) // alignment) * alignment
    padded_E = (counts_E + alignment - 1) // alignment * alignment
    padded_E = torch.cat([padded_E[:-1], (P - padded_E[:-1].sum()).view(1)])
    src_start_E = torch.cumsum(counts_E, 0) - counts_E
    dst_start_E = torch.cumsum(padded_E, 0) - padded_E
    expert_N = torch.repeat_interleave(torch.arange(E, device=x_ND.device), counts_E, output_size=N)
    rows_N = dst_start_E[expert_N] + torch.arange(N, device=x_ND.device) - src_start_E[expert_N]
    return x_ND.new_zeros(P, x_ND.shape[1]).index_copy(0, rows_N, x_ND), padded_E, rows_N


def expert_matmuls(x_ND, counts_E, w1_EDF, w3_EDF, w2_EFD, impl: str, lora: tuple | None = None) -> torch.Tensor:
    """The three expert matmuls for rows sorted by expert, by one of the grouped paths (all agree).

    `lora`: (scale, gate_up_A [E, r, D], gate_up_B [E, 2F, r], down_A [E, r, F], down_B [E, D, r]), a LoRA
    adapter computed on the rows (x A^T B^T): the frozen weights then need no gradient of their own, and no
    [E, D, F] delta is built (moeflow/models/lora.py)."""
    weights = (w1_EDF, w3_EDF, w2_EFD) + (tuple(lora[1:]) if lora else ())
    if x_ND.shape[0] == 0:
        # No rows: still touch the weights so every rank's backward produces (zero) expert gradients.
        return x_ND.new_zeros((0, w2_EFD.shape[-1])) + 0.0 * sum(w.sum() for w in weights)
    dtype = x_ND.dtype
    mm = _grouped_matmul(x_ND, counts_E, impl)
    w1_EDF, w3_EDF, w2_EFD = w1_EDF.to(dtype), w3_EDF.to(dtype), w2_EFD.to(dtype)
    h1_NF, h3_NF = mm(x_ND, w1_EDF), mm(x_ND, w3_EDF)
    if lora:
        # alpha / r scales the [N, r] rows, not the [N, F] outputs; B's gate and up halves each add to their own
        # output (slicing one [N, 2F] product would cost its backward a zero-filled [N, 2F] per half), in place:
        # a grouped matmul's backward does not read its output, and a fresh [N, F] per sum is a page-faulting copy
        scale, gate_up_A, gate_up_B, down_A, down_B = (lora[0], *(w.to(dtype) for w in lora[1:]))
        # factors are small: each made contiguous as [E, in, out] once (a strided operand slows the grouped matmul)
        width = h1_NF.shape[1]
        xA_Nr = scale * mm(x_ND, gate_up_A.mT.contiguous())
        h1_NF.add_(mm(xA_Nr, gate_up_B[:, :width].mT.contiguous()))
        h3_NF.add_(mm(xA_Nr, gate_up_B[:, width:].mT.contiguous()))
    h_NF = _swiglu(h1_NF, h3_NF)
    y_ND = mm(h_NF, w2_EFD)
    if lora:
        y_ND.add_(mm(scale * mm(h_NF, down_A.mT.contiguous()), down_B.mT.contiguous()))
    if impl == "grouped_mm" and y_ND.requires_grad:  # grouped_mm's backward rejects a stride-0 gradient (y.sum())
        y_ND.register_hook(lambda g: g.contiguous())
    return y_ND


def _grouped_matmul(x_ND, counts_E, impl: str):
    """rows, w [E, I, O] -> each expert's rows times its matrix, for rows sorted by expert (`impl`'s way); the
    bookkeeping (offsets, padded slots, segment lengths) is done once for all the layer's matmuls."""
    if impl == "grouped_mm":
        offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
        # torch._grouped_mm rather than F.grouped_mm: torchao's FP8/MXFP8 weight wrappers intercept this op by name
        return lambda x, w: torch._grouped_mm(x, w, offs=offs_E)
    if impl == "bmm":
        return _padded_bmm(x_ND, counts_E)
    if impl == "loop":
        # host sync: segment lengths to slice each expert's rows (and the uncounted tail of a static size)
        sizes = _with_tail(counts_E, x_ND.shape[0]).tolist()

        def loop(x, w):
            *groups, tail = torch.split(x, sizes)
            return torch.cat([*(x_nI @ w[e] for e, x_nI in enumerate(groups)), tail.new_zeros(tail.shape[0],
                                                                                           w.shape[-1])])
        return loop
    raise ValueError(f"model.moe.expert_impl = {impl!r}; choose one of {GroupedExperts.IMPLS} or 'auto'")


def _with_tail(counts_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[E + 1]: the counts, then the rows past them (under a static receive size, the unused tail; else 0)."""
    return torch.cat([counts_E, (num_rows - counts_E.sum()).view(1)])


def _padded_bmm(x_ND, counts_E):
    """A matmul that scatters rows into [E, C, I] (C = the largest count), runs one bmm and gathers back; rows past
    the counted ones (a static size's tail) go to one spare slot and come back as zeros."""
    E, N = counts_E.numel(), x_ND.shape[0]
    C = int(counts_E.max())  # host sync: the padded size
    counts_E1 = _with_tail(counts_E, N)
    starts_E1 = torch.cumsum(counts_E1, 0) - counts_E1
    expert_N = torch.repeat_interleave(torch.arange(E + 1, device=x_ND.device), counts_E1, output_size=N)
    slot_N = torch.arange(N, device=x_ND.device) - starts_E1[expert_N]
    flat_slot_N = torch.where(expert_N < E, expert_N * C + slot_N, E * C)

    def bmm(x_NI, w_EIO):
        x_ECI = x_NI.new_zeros(E * C + 1, x_NI.shape[1]).index_copy(0, flat_slot_N, x_NI)[:E * C].view(E, C, -1)
        y_ECO = torch.bmm(x_ECI, w_EIO)
        spare = y_ECO.new_zeros(1, y_ECO.shape[-1])
        return torch.cat([y_ECO.reshape(E * C, -1), spare]).index_select(0, flat_slot_N)
    return bmm


class MoE(nn.Module):
    """Routed experts (+ optional shared experts): y = sum_k w_k * expert_k(x) + shared(x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.num_experts, self.top_k = m.num_experts, m.top_k
        self.pad_to_capacity = m.pad_to_capacity
        self.router = Router(cfg.dim, m)
        self.experts = GroupedExperts(m.num_experts, cfg.dim, m.ffn_dim, impl=m.expert_impl)
        self.shared_experts = FeedForward(cfg.dim, m.shared_width) if m.num_shared_experts else None
        self.dispatcher: TokenDispatcher = LocalDispatcher(m)  # expert parallelism swaps in its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = x.reshape(-1, x.shape[-1])
        with phase_range(phases.ROUTER):
            routed = self.router(x_TD, num_sequences=x.shape[0] if x.dim() == 3 else 1)
        x_in_TD = autocast_input(x_TD)  # the experts' input (the output keeps x's dtype)
        if self.pad_to_capacity:  # static shapes: every expert computes exactly its capacity (one process only)
            tokens = sort_into_capacity(x_in_TD, routed.topk_idx, routed.topk_weights, self.num_experts,
                                        routed.capacity)
            out_TD = weighted_sum_back(self.experts(tokens.x_ND, tokens.counts_E), tokens, x_TD)
            if self.shared_experts is not None:
                out_TD = out_TD + self.shared_experts(x_TD)
            return out_TD.view_as(x)
        # route -> dispatch -> experts -> combine, per chunk of tokens. In one process there is one chunk and
        # every call completes at once. An expert-parallel dispatcher may split the tokens in several and keep
        # communication in flight: chunk i+1's dispatch and chunk i-1's combine travel while chunk i's experts
        # compute, and the first dispatch while the shared experts compute.
        # (profiler ranges, moeflow.core.phases: a dispatch's time is its start plus its wait, a combine's likewise)
        chunks = self.dispatcher.chunks(x_TD.shape[0])

        def send(rows):
            with phase_range(phases.DISPATCH):
                return self.dispatcher.dispatch(x_in_TD[rows], routed.topk_idx[rows], routed.topk_weights[rows])

        in_flight = send(chunks[0])
        with phase_range(phases.SHARED_EXPERTS):
            shared_TD = self.shared_experts(x_TD) if self.shared_experts is not None else None
        outs = []
        for i, rows in enumerate(chunks):
            nxt = send(chunks[i + 1]) if i + 1 < len(chunks) else None
            with phase_range(phases.DISPATCH):
                tokens = in_flight.wait()
            with phase_range(phases.EXPERTS):
                y_ND = self.experts(tokens.x_ND, tokens.counts_E)
            with phase_range(phases.COMBINE):
                outs.append(self.dispatcher.combine(y_ND, tokens, x_TD[rows]))
            in_flight = nxt
        with phase_range(phases.COMBINE):
            out_TD = torch.cat([out.wait() for out in outs]) if len(outs) > 1 else outs[0].wait()
        if shared_TD is not None:
            out_TD = out_TD + shared_TD
        return out_TD.view_as(x)
