"""moeflow.ep.Buffer(backend="deep_ep" | "uccl"): the real DeepEP or UCCL-EP library behind moeflow's Buffer.

Shape legend: T tokens on this rank, K top-k, D hidden, N rows received by this rank (num_worst_tokens when
set), R ranks of the group.

Both libraries are a package named `deep_ep` with DeepEP's V1 Buffer API: DeepEP itself
(https://github.com/deepseek-ai/DeepEP), or UCCL-EP's drop-in built from uccl's `ep/deep_ep_wrapper`
(https://github.com/uccl-project/uccl), which adds `deep_ep.initialize_uccl`. (`uccl.ep.Buffer` is UCCL's raw
runtime with another API; it is not what this adapter drives.) The adapter:

- lets the library decide whether it runs here (no CUDA check of its own) and which EP sizes it supports
  (its `get_dispatch_config` table);
- gives `dispatch` everything DeepEP V1 asserts on: the four layout tensors of its own `get_dispatch_layout`,
  topk_idx as `deep_ep.topk_idx_t` (int64 unless built otherwise), topk_weights float32, contiguous x;
- wraps dispatch and combine in autograd the way DeepEP's README pairs them: backward of dispatch is a combine
  of the gradient along the handle, backward of combine a dispatch with the cached handle; the gradient of
  recv_topk_weights is zeroed where recv_topk_idx is -1 (those weights were forwarded as 0);
- never looks inside a handle (DeepEP's intranode handle has 6 items, UCCL's 7);
- under torch.autocast, sends tokens in the autocast dtype (DeepEP's combine kernels take bf16 only); outside
  autocast the caller's dtype travels as is and the library accepts it or not;
- shares one library Buffer per process group, sized from the library's own hints for the hidden size of the
  first call (DeepEP's README recipe), so an MoE layer does not hold a buffer of its own; explicit byte counts
  (or low_latency_mode) build a Buffer of exactly those sizes instead.

With `async_finish=True` the outputs belong to the library's event (DeepEP's semantics): wait on it before using
them. Backward calls are synchronous. moeflow's byte counters are not filled here: use
moeflow.ep.counts.traffic_bytes on the routing for the same numbers.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

_HOMES = {
    "deep_ep": "https://github.com/deepseek-ai/DeepEP (or UCCL-EP's drop-in, which is also a `deep_ep` package)",
    "uccl": "UCCL-EP's DeepEP drop-in: https://github.com/uccl-project/uccl, `ep/deep_ep_wrapper`",
}
_FALLBACK = "use backend='auto' (moeflow's own dispatch over torch.distributed) instead"
# The library Buffer shared by every adapter of one process group: (library Buffer class, group) -> entry.
_SHARED: dict[tuple[int, int], dict] = {}


def make_external(name: str, group, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                  num_qps_per_rank: int) -> ExternalBuffer:
    return ExternalBuffer(name, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank)


def import_library(name: str):
    """The installed `deep_ep` package, checked to be the one `name` asks for."""
    try:
        lib = importlib.import_module("deep_ep")
    except ImportError as exc:
        raise RuntimeError(
            f"Buffer(backend={name!r}) needs the `deep_ep` package built for this machine's CUDA GPUs "
            f"({_HOMES[name]}); importing it failed ({exc}); {_FALLBACK}"
        ) from exc
    if not hasattr(lib, "Buffer"):
        raise RuntimeError(f"Buffer(backend={name!r}): the `deep_ep` module at {lib.__file__} has no Buffer; "
                           f"{_FALLBACK}")
    if name == "uccl" and not hasattr(lib, "initialize_uccl"):
        raise RuntimeError(
            f"Buffer(backend='uccl'): the installed `deep_ep` ({lib.__file__}) is DeepEP itself, not UCCL-EP's "
            f"drop-in (no deep_ep.initialize_uccl); install {_HOMES['uccl']}, or use backend='deep_ep'"
        )
    return lib


def check_num_ranks(lib, name: str, num_ranks: int) -> None:
    """Ask the library whether it has kernels for an EP group of `num_ranks` (its config table)."""
    try:
        lib.Buffer.get_dispatch_config(num_ranks)
        lib.Buffer.get_combine_config(num_ranks)
    except (AssertionError, KeyError, RuntimeError) as exc:
        if num_ranks == 1:
            fix = ("an EP group of 1 rank moves no tokens: use parallel.ep >= 2, or backend='auto' (a local copy "
                   "at world size 1)")
        else:
            fix = (f"DeepEP V1 has kernels for 2, 4 or 8 ranks in one node and 16, 24, 32, 48, 64, 96, 128, 144 or "
                   f"160 across nodes (UCCL-EP: the same without 48 and 96): set parallel.ep to one of those, "
                   f"or {_FALLBACK}")
        raise ValueError(f"Buffer(backend={name!r}) on an EP group of {num_ranks} rank(s): the library refuses "
                         f"this size ({exc or type(exc).__name__}); {fix}") from exc


def _hidden_bytes(x) -> int:
    """DeepEP's README sizing unit: D * max(element size, 2) (an fp8 pair counts as bf16)."""
    x_TD = x[0] if isinstance(x, tuple) else x
    return x_TD.shape[1] * max(x_TD.element_size(), 2)


def _shared_buffer(lib, group, num_ranks: int, hidden_bytes: int):
    """The group's library Buffer, (re)built when this call needs more room than it has.

    Building one is collective over the group, so every rank must reach it at the same call: they do, since
    every rank of an EP group runs the same layers with the same hidden size (a larger one replaces the buffer
    on all ranks at once, as Megatron-LM's DeepEP wrapper does)."""
    key = (id(lib.Buffer), id(group))
    entry = _SHARED.get(key)
    if entry is not None and entry["hidden_bytes"] >= hidden_bytes:
        return entry["buffer"]
    hidden_bytes = max(hidden_bytes, entry["hidden_bytes"] if entry else 0)
    num_nvl_bytes = num_rdma_bytes = 0
    if hidden_bytes:
        for config in (lib.Buffer.get_dispatch_config(num_ranks), lib.Buffer.get_combine_config(num_ranks)):
            num_nvl_bytes = max(num_nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
            num_rdma_bytes = max(num_rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks))
    if entry is not None:
        entry["buffer"] = None  # drop ours before building the next (autograd contexts keep theirs alive)
    buffer = lib.Buffer(group, num_nvl_bytes, num_rdma_bytes)
    _SHARED[key] = {"group": group, "buffer": buffer, "hidden_bytes": hidden_bytes}
    return buffer


def _transport(t):
    """A float32 tensor in the autocast dtype while autocast is on (DeepEP moves bf16); anything else as is."""
    if (isinstance(t, torch.Tensor) and t.dtype == torch.float32
            and torch.is_autocast_enabled(t.device.type)):
        return t.to(torch.get_autocast_dtype(t.device.type))
    return t


class ExternalBuffer:
    """DeepEP's V1 Buffer calls on the installed library, differentiable w.r.t. x, topk_weights and bias."""

    def __init__(self, name: str, group, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                 num_qps_per_rank: int):
        self.name, self.group = name, group
        self.lib = import_library(name)
        self.num_ranks = dist.get_world_size(group) if group is not None else 1
        check_num_ranks(self.lib, name, self.num_ranks)
        self.topk_idx_dtype = getattr(self.lib, "topk_idx_t", torch.int64)  # v1.2.1 and UCCL: int64, unexported
        self._own = None
        if num_nvl_bytes or num_rdma_bytes or low_latency_mode:
            self._own = self.lib.Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=low_latency_mode,
                                        num_qps_per_rank=num_qps_per_rank)

    def library_buffer(self, hidden_bytes: int = 0):
        if self._own is not None:
            return self._own
        return _shared_buffer(self.lib, self.group, self.num_ranks, hidden_bytes)

    def _topk_idx(self, topk_idx):
        return None if topk_idx is None else topk_idx.to(self.topk_idx_dtype).contiguous()

    # ---- the V1 calls ---------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        return self.library_buffer().get_dispatch_layout(
            self._topk_idx(topk_idx), num_experts, previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, num_experts: int | None = None):
        """-> recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event (the
        library's); with `handle`: (recv_x, None, None, None, None, event). `num_experts` (moeflow's extension)
        lets a caller without a layout have the library compute it first."""
        if (handle is None and num_tokens_per_rank is None and topk_idx is not None and num_experts is not None):
            num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = (
                self.get_dispatch_layout(topk_idx, num_experts))
        kwargs = dict(handle=handle, num_tokens_per_rank=num_tokens_per_rank,
                      num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                      num_tokens_per_expert=num_tokens_per_expert, topk_idx=self._topk_idx(topk_idx),
                      expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens, config=config,
                      previous_event=previous_event, async_finish=async_finish,
                      allocate_on_comm_stream=allocate_on_comm_stream)
        if topk_weights is not None:
            topk_weights = topk_weights.float().contiguous()
        if isinstance(x, tuple):  # fp8 (x, scales): not differentiable, as in DeepEP
            if torch.is_grad_enabled() and topk_weights is not None and topk_weights.requires_grad:
                raise ValueError("fp8 dispatch is not differentiable; dispatch bf16/fp32 x for training")
            lib_buffer = self.library_buffer(_hidden_bytes(x))
            return lib_buffer.dispatch((x[0].contiguous(), x[1]), topk_weights=topk_weights, **kwargs)
        x = _transport(x).contiguous()
        lib_buffer = self.library_buffer(_hidden_bytes(x))
        return _Dispatch.apply(lib_buffer, kwargs, x, topk_weights)

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """-> combined_x [T, D] (the plain sum of a token's copies, plus bias), combined_topk_weights | None,
        event (the library's)."""
        x = _transport(x).contiguous()
        biases = bias if isinstance(bias, tuple | list) else (bias,)
        biases = [None if b is None else b.to(x.dtype).contiguous() for b in biases]
        if topk_weights is not None:
            topk_weights = topk_weights.float().contiguous()
        kwargs = dict(config=config, previous_event=previous_event, async_finish=async_finish,
                      allocate_on_comm_stream=allocate_on_comm_stream)
        lib_buffer = self.library_buffer(_hidden_bytes(x))
        return _Combine.apply(lib_buffer, handle, kwargs, isinstance(bias, tuple | list), x, topk_weights, *biases)

    # ---- low latency (inference): the library's calls as they are ---------------------------------------
    def low_latency_dispatch(self, x, topk_idx, *args, **kwargs):
        return self.library_buffer(_hidden_bytes(x)).low_latency_dispatch(x, self._topk_idx(topk_idx), *args,
                                                                          **kwargs)

    def low_latency_combine(self, x, topk_idx, *args, **kwargs):
        return self.library_buffer().low_latency_combine(x, self._topk_idx(topk_idx), *args, **kwargs)


def _zero_foreign(g_NK: torch.Tensor, recv_idx_NK: torch.Tensor) -> torch.Tensor:
    """The gradient of recv_topk_weights without the entries whose id is -1: those weights were forwarded as 0
    (their expert lives on another rank, or the row is padding), and combine would add them to the token's."""
    return g_NK.masked_fill(recv_idx_NK < 0, 0.0)


class _Dispatch(torch.autograd.Function):
    """library dispatch(x, topk_weights), differentiable w.r.t. x and topk_weights; backward = library combine along
    the handle. Returns the library's six results in its order; recv_topk_idx (a tensor) is marked
    non-differentiable, the counts, handle and event pass through as the non-tensor outputs they are."""

    @staticmethod
    def forward(ctx, lib_buffer, kwargs: dict, x_TD, topk_weights_TK):
        recv_x, recv_idx, recv_w, counts, handle, event = lib_buffer.dispatch(x_TD, topk_weights=topk_weights_TK,
                                                                              **kwargs)
        if recv_w is not None and not kwargs["async_finish"]:
            # Rows past the real ones (num_worst_tokens) are uninitialised in DeepEP; their ids are -1. With
            # async_finish the outputs are not ready yet, so they stay as the library left them.
            recv_w = torch.where(recv_idx >= 0, recv_w, torch.zeros_like(recv_w))
        if recv_idx is not None:
            ctx.mark_non_differentiable(recv_idx)
        ctx.lib_buffer = lib_buffer
        ctx.handle = kwargs["handle"] if kwargs["handle"] is not None else handle
        ctx.recv_idx, ctx.recv_shape, ctx.x_dtype, ctx.device = recv_idx, recv_x.shape, x_TD.dtype, x_TD.device
        ctx.has_w = recv_w is not None
        return recv_x, recv_idx, recv_w, counts, handle, event

    @staticmethod
    def backward(ctx, g_recv_x, _g_recv_idx, g_recv_w, *_):
        if g_recv_x is None:
            g_recv_x = torch.zeros(ctx.recv_shape, dtype=ctx.x_dtype, device=ctx.device)
        g_w = None
        if ctx.has_w:
            g_w = g_recv_w if g_recv_w is not None else torch.zeros(ctx.recv_idx.shape, device=ctx.device)
            g_w = _zero_foreign(g_w.float(), ctx.recv_idx).contiguous()
        grad_x, grad_w, _ = ctx.lib_buffer.combine(g_recv_x.contiguous(), ctx.handle, topk_weights=g_w)
        return None, None, grad_x, grad_w


class _Combine(torch.autograd.Function):
    """combined_x, combined_w, event = library combine(x, topk_weights, bias); backward = cached dispatches. The
    event passes through as a non-tensor output."""

    @staticmethod
    def forward(ctx, lib_buffer, handle, kwargs: dict, bias_is_tuple: bool, x_ND, w_NK, *biases):
        bias = tuple(biases) if bias_is_tuple else biases[0]
        out_x, out_w, event = lib_buffer.combine(x_ND, handle, topk_weights=w_NK, bias=bias, **kwargs)
        ctx.lib_buffer, ctx.handle = lib_buffer, handle
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        return out_x, out_w, event

    @staticmethod
    def backward(ctx, g_x_TD, g_w_TK, _):
        grad_x = grad_w = None
        if ctx.needs_input_grad[4] and g_x_TD is not None:
            grad_x = ctx.lib_buffer.dispatch(g_x_TD.contiguous(), handle=ctx.handle)[0]
        if ctx.needs_input_grad[5] and g_w_TK is not None:
            # The combined weights are a plain sum over copies, so each copy's gradient is its token's: a cached
            # dispatch of [T, K] float32, padded to K % 4 == 0 (DeepEP moves rows of a multiple of 16 bytes).
            K = g_w_TK.shape[1]
            g_pad = F.pad(g_w_TK.float(), (0, -K % 4)).contiguous()
            grad_w = ctx.lib_buffer.dispatch(g_pad, handle=ctx.handle)[0][:, :K]
        grad_biases = [None if dt is None or g_x_TD is None else g_x_TD.to(dt) for dt in ctx.bias_dtypes]
        return None, None, None, None, grad_x, grad_w, *grad_biases
