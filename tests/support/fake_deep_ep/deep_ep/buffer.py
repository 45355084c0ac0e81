"""The fake's Buffer: DeepEP V1's intranode normal-mode contract, asserted, over torch.distributed.

Shape legend: T tokens on this rank, K top-k, H hidden, E experts, L local experts (E // R), R ranks,
C channels (num_sms // 2), N received rows (num_worst_tokens when set).

Every assert below is one DeepEP V1 (deepseek-ai/DeepEP @ 567632d) makes in deep_ep/buffer.py (PY) or
csrc/deep_ep.cpp (CPP) on the same call, unless marked "fake:" (a check DeepEP leaves to undefined behaviour,
such as a layout that disagrees with topk_idx). Tokens move with all_to_all_single on the Buffer's group, in
DeepEP's receive order: by source rank, then by token index on the source.

Deliberate differences: combine also takes float32 x unless STRICT_BF16_COMBINE (DeepEP's kernels are bf16
only, launch.cuh SWITCH_TYPES), so fp32 runs compare exactly; internode (R > 8), fp8 combine, the
low-latency kernels and mpi4py groups are not modelled. UcclBuffer is UCCL-EP's drop-in
(uccl ep/bench/buffer.py): its intranode handle has 7 items (the int N inserted at index 3) and its config
table lacks 48 and 96 ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .utils import EventHandle, EventOverlap, check_ready, garbage_like

STRICT_BF16_COMBINE = False
NUM_MAX_NVL_PEERS = 8
TOPK_IDX_DTYPE = torch.int64
CALLS: list[dict] = []  # one entry per call, for tests that ask what the adapter did

# num_ranks -> (nvl send, nvl recv, rdma send, rdma recv) chunk sizes, PY get_dispatch_config / get_combine_config
_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
             24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
             96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
            24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
            96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


class Config:
    """Chunk sizes of the normal kernels (csrc/config.hpp), with the constructor's asserts."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        nvl_send, nvl_recv = num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens
        rdma_send, rdma_recv = num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens
        assert num_sms >= 0
        assert nvl_send > 0 and nvl_recv > 0 and nvl_send < nvl_recv
        assert rdma_send > 0 and rdma_recv > 0
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send
        assert rdma_send < rdma_recv and rdma_send <= rdma_recv // 2
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens = nvl_send, nvl_recv
        self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens = rdma_send, rdma_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes for every channel's receive queue of every NVLink peer, room for 128 top-k entries and 128
        scales per token (the formula of config.hpp, without NVSHMEM's source-meta term)."""
        assert num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0
        rdma_ranks, nvl_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1), min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * nvl_ranks
        per_token = hidden_bytes + 128 * 8 + 128 * 4 + 128 * 4
        total = slots * (2 * rdma_ranks + 3) * 4 + slots * self.num_max_nvl_chunked_recv_tokens * per_token
        return -(-total // 128) * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        raise NotImplementedError("fake deep_ep: internode (more than 8 ranks) is not modelled")


def _exchange(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """all_to_all_single of rows of any dtype (as bytes): rows are ordered by destination."""
    tail = rows.shape[1:]
    width = 1
    for s in tail:
        width *= s
    bytes_nB = rows.contiguous().reshape(rows.shape[0], width).view(torch.uint8)
    out = bytes_nB.new_empty((sum(recv_counts), bytes_nB.shape[1]))
    dist.all_to_all_single(out, bytes_nB, recv_counts, send_counts, group=group)
    return out.view(rows.dtype).reshape(-1, *tail)


def _int32_vector(name, t, size=None):
    assert t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous(), \
        f"{name} must be a contiguous 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}"
    assert size is None or t.size(0) == size, f"{name} has {t.size(0)} entries, expected {size}"


def _int32_matrix(name, t, rows, cols):
    assert t.dtype == torch.int32 and t.dim() == 2 and t.is_contiguous() and tuple(t.shape) == (rows, cols), \
        f"{name} must be a contiguous int32 [{rows}, {cols}], got {t.dtype} {tuple(t.shape)}"


class DeepEPBuffer:
    """deep_ep.Buffer, normal mode, one node (R in 2, 4, 8)."""

    num_sms = 20
    _EXCLUDED_RANKS: tuple[int, ...] = ()

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None):
        if group is None:
            assert comm is not None, "Buffer needs a torch.distributed group (or an mpi4py comm)"
            raise NotImplementedError("fake deep_ep: mpi4py comm groups are not modelled")
        self._init(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy)

    def _init(self, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy):
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        R = self.group_size
        # CPP:151-161
        assert num_nvl_bytes % 128 == 0 and num_rdma_bytes % 128 == 0, "byte counts must be multiples of 128"
        assert R <= NUM_MAX_NVL_PEERS * 20 or low_latency_mode
        assert R < NUM_MAX_NVL_PEERS or R % NUM_MAX_NVL_PEERS == 0
        if num_rdma_bytes > 0:
            assert R > NUM_MAX_NVL_PEERS or low_latency_mode, \
                "num_rdma_bytes > 0 needs more than 8 ranks or low_latency_mode (one node: pass 0)"
        if R > NUM_MAX_NVL_PEERS or low_latency_mode:
            raise NotImplementedError("fake deep_ep: internode and low-latency buffers are not modelled")
        # The real constructor all-gathers device ids and IPC handles: it is collective, so is this one.
        mine = (num_nvl_bytes, num_rdma_bytes, low_latency_mode)
        every = [None] * R
        dist.all_gather_object(every, mine, group=group)
        assert all(e == mine for e in every), f"fake: ranks built Buffers of different sizes: {every}"
        CALLS.append({"op": "Buffer", "num_nvl_bytes": num_nvl_bytes, "num_rdma_bytes": num_rdma_bytes})

    # ---- statics (PY:153-290) -------------------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "the SM count must be even"
        DeepEPBuffer.num_sms = new_num_sms

    @classmethod
    def _config(cls, table, num_ranks: int) -> Config:
        assert num_ranks in table and num_ranks not in cls._EXCLUDED_RANKS, \
            f"Unsupported number of EP ranks: {num_ranks}"
        return Config(cls.num_sms, *table[num_ranks])

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        return cls._config(_DISPATCH, num_ranks)

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        return cls._config(_COMBINE, num_ranks)

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"

    def low_latency_dispatch(self, *args, **kwargs):
        raise NotImplementedError("fake deep_ep: the low-latency kernels are not modelled")

    low_latency_combine = low_latency_dispatch

    # ---- handles --------------------------------------------------------------------------------------
    def _pack_handle(self, rpm, cpm, recv_cpm, recv_src_idx, in_rank, send_head):
        return (rpm, cpm, recv_cpm, recv_src_idx, in_rank, send_head)

    def _unpack_handle(self, handle):
        assert isinstance(handle, tuple) and len(handle) == 6, \
            f"not a DeepEP intranode handle (a 6-tuple): {type(handle).__name__} of {len(handle)}"
        return handle

    # ---- helpers --------------------------------------------------------------------------------------
    def _start(self, previous_event, async_finish, allocate_on_comm_stream, inputs: dict):
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish, \
                "allocate_on_comm_stream needs previous_event and async_finish"
        event = getattr(previous_event, "event", None)  # what DeepEP hands its C++ side
        if event is not None:
            assert isinstance(event, EventHandle), f"previous_event.event is a {type(event).__name__}"
            event.current_stream_wait()  # the comm stream waits for it
        for name, t in inputs.items():
            for i, item in enumerate(t if isinstance(t, tuple) else (t,)):
                check_ready(f"{name}[{i}]" if isinstance(t, tuple) else name, item)

    @staticmethod
    def _finish(values: list, async_finish: bool) -> tuple[list, EventOverlap]:
        """Sync: the values and an empty event. Async: placeholders, filled when the event is waited on."""
        if not async_finish:
            return values, EventOverlap(None)
        outs, pending = [], []
        for v in values:
            if isinstance(v, torch.Tensor):
                out = garbage_like(v)
                pending.append((out, v))
                outs.append(out)
            elif isinstance(v, tuple):
                items = [garbage_like(i) if isinstance(i, torch.Tensor) else i for i in v]
                pending += [(o, i) for o, i in zip(items, v) if isinstance(i, torch.Tensor)]
                outs.append(tuple(items))
            else:
                outs.append(v)
        return outs, EventOverlap(EventHandle(_pending=pending))

    def _check_fits(self, what: str, need: int) -> None:
        assert need <= self.num_nvl_bytes, \
            f"{what} needs {need} NVL buffer bytes, the Buffer has {self.num_nvl_bytes}"

    # ---- layout (PY:293-319, CPP:393-457) -----------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        self._start(previous_event, async_finish, allocate_on_comm_stream, {"topk_idx": topk_idx})
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx must be 2-D and contiguous"
        assert num_experts > 0
        assert topk_idx.dtype == TOPK_IDX_DTYPE, f"expected scalar type Long but found {topk_idx.dtype}"
        R = self.group_size
        assert topk_idx.numel() == 0 or (topk_idx.min() >= -1 and topk_idx.max() < num_experts), \
            f"fake: topk_idx outside -1..{num_experts - 1}"
        per_rank = num_experts // R
        valid = topk_idx >= 0
        rank_TK = torch.where(valid, topk_idx // per_rank, R)
        in_rank_TR = torch.zeros(topk_idx.shape[0], R + 1, dtype=torch.bool).scatter_(1, rank_TK, True)[:, :R]
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        per_rank_tokens = in_rank_TR.sum(0).to(torch.int32)
        CALLS.append({"op": "get_dispatch_layout", "async": async_finish})
        (a, c, d), event = self._finish([per_rank_tokens, per_expert, in_rank_TR.contiguous()], async_finish)
        return a, None, c, d, event

    # ---- dispatch (PY:322-402, CPP:459-770) -----------------------------------------------------------------
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        config = self.get_dispatch_config(self.group_size) if config is None else config
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        R, me = self.group_size, self.rank
        cached = handle is not None
        if cached:
            assert topk_idx is None and topk_weights is None, "a cached dispatch takes no topk_idx / topk_weights"
            rpm, cpm, _, recv_src_idx, is_token_in_rank, _ = self._unpack_handle(handle)
        else:
            assert num_tokens_per_rank is not None and is_token_in_rank is not None \
                and num_tokens_per_expert is not None, "a dispatch without a handle needs the layout tensors"
        self._start(previous_event, async_finish, allocate_on_comm_stream, {
            "x": x, "x_scales": x_scales, "handle": handle, "num_tokens_per_rank": num_tokens_per_rank,
            "is_token_in_rank": is_token_in_rank, "num_tokens_per_expert": num_tokens_per_expert,
            "topk_idx": topk_idx, "topk_weights": topk_weights})
        assert config.num_sms % 2 == 0
        C = config.num_sms // 2
        assert x.dim() == 2 and x.is_contiguous(), "x must be 2-D and contiguous"
        T, H = x.shape
        assert (H * x.element_size()) % 16 == 0, f"hidden bytes {H * x.element_size()} are not a multiple of 16"
        if cached:
            _int32_matrix("rank_prefix_matrix", rpm, R, R)
            _int32_matrix("channel_prefix_matrix", cpm, R, C)
        else:
            _int32_vector("num_tokens_per_rank", num_tokens_per_rank, R)
            _int32_vector("num_tokens_per_expert", num_tokens_per_expert)
            E = num_tokens_per_expert.size(0)
            assert E % R == 0 and E // R <= 1024
        assert is_token_in_rank.dtype == torch.bool and is_token_in_rank.dim() == 2 \
            and is_token_in_rank.is_contiguous(), "is_token_in_rank must be a contiguous 2-D bool tensor"
        assert tuple(is_token_in_rank.shape) == (T, R), f"is_token_in_rank is {tuple(is_token_in_rank.shape)}, " \
            f"x has {T} rows and the group {R} ranks"
        assert (topk_idx is None) == (topk_weights is None), "topk_idx and topk_weights go together"
        K = 0
        if topk_idx is not None:
            assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_weights.dim() == 2 \
                and topk_weights.is_contiguous(), "topk_idx and topk_weights must be 2-D and contiguous"
            assert topk_idx.shape == topk_weights.shape and topk_idx.size(0) == T
            assert topk_idx.dtype == TOPK_IDX_DTYPE, f"expected scalar type Long but found {topk_idx.dtype}"
            assert topk_weights.dtype == torch.float32, f"topk_weights must be float32, got {topk_weights.dtype}"
            K = topk_idx.size(1)
        num_scales = 0
        if x_scales is not None:
            assert x.element_size() == 1, "scales come with fp8 x"
            assert x_scales.dtype in (torch.float32, torch.int32) and x_scales.dim() in (1, 2) \
                and x_scales.size(0) == T
            num_scales = 1 if x_scales.dim() == 1 else x_scales.size(1)
        if num_worst_tokens > 0 and not cached:
            assert topk_idx is not None and topk_weights is not None, "num_worst_tokens needs topk_idx and weights"
        if not cached:
            L = E // R
            self._check_fits("notify", R * (R + L) * 4)
            self._check_layout(is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, topk_idx)
        nvl_recv = config.num_max_nvl_chunked_recv_tokens
        self._check_fits("dispatch", R * R * 4 + 4 * C * R * 4 + C * R * nvl_recv * (
            H * x.element_size() + 4 + K * 8 + K * 4 + num_scales * 4))
        CALLS.append({"op": "dispatch", "cached": cached, "x_dtype": x.dtype, "async": async_finish,
                      "num_worst_tokens": num_worst_tokens})

        # Who sends what: counts[s][r] = tokens rank s sends to rank r.
        send_counts = is_token_in_rank.sum(0).tolist()
        if cached:
            prefix = torch.cat([torch.zeros(1, R, dtype=torch.int32), rpm]).diff(dim=0)
            recv_counts = prefix[:, me].tolist()
            N = recv_src_idx.size(0)
        else:
            counts_RR = torch.stack(self._all_gather(num_tokens_per_rank))
            recv_counts = counts_RR[:, me].tolist()
            rpm = counts_RR.cumsum(0).to(torch.int32)
            actual = sum(recv_counts)
            assert not num_worst_tokens or actual <= num_worst_tokens, \
                f"fake: {actual} rows arrive but num_worst_tokens is {num_worst_tokens} (DeepEP would overrun)"
            N = num_worst_tokens or actual
        order = torch.cat([is_token_in_rank[:, r].nonzero().flatten() for r in range(R)])
        actual = sum(recv_counts)

        def move(rows, pad_value=None):
            got = _exchange(rows.index_select(0, order), send_counts, recv_counts, self.group)
            pad = garbage_like(got.new_empty((N - actual, *got.shape[1:])))
            if pad_value is not None:
                pad.fill_(pad_value)
            return torch.cat([got, pad])

        recv_x = move(x)
        recv_scales = move(x_scales) if x_scales is not None else None
        recv_x_out = (recv_x, recv_scales) if x_scales is not None else recv_x
        if cached:
            outs, event = self._finish([recv_x_out], async_finish)
            return outs[0], None, None, None, None, event

        recv_src_idx = move(torch.arange(T, dtype=torch.int32), pad_value=-1)
        recv_idx = recv_w = None
        if topk_idx is not None:
            got_idx = move(topk_idx, pad_value=-1)
            local = got_idx - me * L
            mine = (got_idx >= 0) & (local >= 0) & (local < L)
            recv_idx = torch.where(mine, local, torch.full_like(local, -1))
            got_w = move(topk_weights)
            recv_w = torch.cat([torch.where(mine[:actual], got_w[:actual], torch.zeros_like(got_w[:actual])),
                                got_w[actual:]])  # padding rows stay uninitialised, as in DeepEP
        per_expert_RE = torch.stack(self._all_gather(num_tokens_per_expert))
        a = expert_alignment
        counts_list = [] if num_worst_tokens else [
            -(-int(c) // a) * a for c in per_expert_RE[:, me * L:(me + 1) * L].sum(0).tolist()]
        # Channel c of C carries a contiguous slice of the tokens; cpm[r][c] = tokens to r in channels <= c.
        bounds = [(T * (c + 1)) // C for c in range(C)]
        cum_TR = is_token_in_rank.to(torch.int32).cumsum(0, dtype=torch.int32)
        cpm = torch.stack([cum_TR[b - 1] if b else torch.zeros(R, dtype=torch.int32) for b in bounds], 1)
        recv_cpm = _exchange(cpm.contiguous(), [1] * R, [1] * R, self.group)
        send_head = torch.where(is_token_in_rank, cum_TR - 1, torch.full_like(cum_TR, -1))
        handle = self._pack_handle(rpm, cpm.contiguous(), recv_cpm, recv_src_idx, is_token_in_rank,
                                   send_head.contiguous())
        outs, event = self._finish([recv_x_out, recv_idx, recv_w, counts_list, handle], async_finish)
        return (*outs, event)

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.group_size)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out

    def _check_layout(self, in_rank, per_rank, per_expert, topk_idx) -> None:
        """fake: DeepEP trusts the layout; a wrong one corrupts its buffers or hangs. Here it is refused."""
        assert torch.equal(per_rank, in_rank.sum(0).to(torch.int32)), \
            "fake: num_tokens_per_rank disagrees with is_token_in_rank"
        if topk_idx is None:
            return
        E, R = per_expert.size(0), self.group_size
        valid = topk_idx >= 0
        want_expert = torch.bincount(topk_idx[valid], minlength=E).to(torch.int32)
        assert torch.equal(per_expert, want_expert), "fake: num_tokens_per_expert disagrees with topk_idx"
        rank_TK = torch.where(valid, topk_idx // (E // R), R)
        want_in = torch.zeros(topk_idx.shape[0], R + 1, dtype=torch.bool).scatter_(1, rank_TK, True)[:, :R]
        assert torch.equal(in_rank, want_in), "fake: is_token_in_rank disagrees with topk_idx"

    # ---- combine (PY:405-450, CPP:772-911) ------------------------------------------------------------------
    @staticmethod
    def _unpack_bias(bias):
        if bias is None or isinstance(bias, torch.Tensor):
            return bias, None
        assert isinstance(bias, tuple) and len(bias) == 2
        return bias

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        config = self.get_combine_config(self.group_size) if config is None else config
        rpm, _, cpm, src_idx, in_rank, send_head = self._unpack_handle(handle)  # cpm: the receiving side's
        bias_0, bias_1 = self._unpack_bias(bias)
        self._start(previous_event, async_finish, allocate_on_comm_stream, {
            "x": x, "handle": handle, "topk_weights": topk_weights, "bias_0": bias_0, "bias_1": bias_1})
        R, me = self.group_size, self.rank
        assert config.num_sms % 2 == 0
        C = config.num_sms // 2
        assert x.dim() == 2 and x.is_contiguous(), "x must be 2-D and contiguous"
        N, H = x.shape
        assert (H * x.element_size()) % 16 == 0, f"hidden bytes {H * x.element_size()} are not a multiple of 16"
        allowed = (torch.bfloat16,) if STRICT_BF16_COMBINE else (torch.bfloat16, torch.float32)
        assert x.dtype in allowed, f"Unsupported type {x.dtype} (combine kernels: {allowed})"
        _int32_matrix("rank_prefix_matrix", rpm, R, R)
        _int32_matrix("channel_prefix_matrix", cpm, R, C)
        _int32_vector("src_idx", src_idx, N)
        T = send_head.size(0)
        _int32_matrix("send_head", send_head, T, R)
        assert in_rank.dtype == torch.bool and tuple(in_rank.shape) == (T, R), "fake: a corrupt handle"
        K = 0
        if topk_weights is not None:
            assert topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.size(0) == N \
                and topk_weights.dtype == torch.float32, "topk_weights must be contiguous float32 [N, K]"
            K = topk_weights.size(1)
        for b in (bias_0, bias_1):
            if b is not None:
                assert b.dim() == 2 and b.is_contiguous() and b.dtype == x.dtype and tuple(b.shape) == (T, H), \
                    f"bias must be contiguous {x.dtype} [{T}, {H}]"
        nvl_recv = config.num_max_nvl_chunked_recv_tokens
        self._check_fits("combine", C * R * 8 + C * R * nvl_recv * (H * x.element_size() + 4 + K * 4))
        CALLS.append({"op": "combine", "x_dtype": x.dtype, "async": async_finish})

        held = torch.cat([torch.zeros(1, R, dtype=torch.int32), rpm]).diff(dim=0)[:, me].tolist()
        actual = sum(held)
        back = send_head.ge(0).sum(0).tolist()
        tokens = torch.cat([in_rank[:, r].nonzero().flatten() for r in range(R)])

        def reduce(rows):  # each held row goes home; a token's copies are summed in float32
            got = _exchange(rows[:actual], held, back, self.group)
            return torch.zeros(T, rows.shape[1]).index_add_(0, tokens, got.float())

        out_x = reduce(x)
        for b in (bias_0, bias_1):
            if b is not None:
                out_x += b.float()
        out_w = reduce(topk_weights) if topk_weights is not None else None
        (out_x, out_w), event = self._finish([out_x.to(x.dtype), out_w], async_finish)
        return out_x, out_w, event


class UcclBuffer(DeepEPBuffer):
    """UCCL-EP's drop-in deep_ep.Buffer: same calls, a 7-item handle, no 48- or 96-rank configs."""

    _EXCLUDED_RANKS = (48, 96)

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, is_intranode: bool | None = None):
        self._init(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy)

    def _pack_handle(self, rpm, cpm, recv_cpm, recv_src_idx, in_rank, send_head):
        return (rpm, cpm, recv_cpm, int(recv_src_idx.size(0)), recv_src_idx, in_rank, send_head)

    def _unpack_handle(self, handle):
        assert isinstance(handle, tuple) and len(handle) == 7 and isinstance(handle[3], int), \
            f"not a UCCL-EP intranode handle (a 7-tuple with an int at 3): {type(handle).__name__}"
        rpm, cpm, recv_cpm, num_recv, recv_src_idx, in_rank, send_head = handle
        assert num_recv == recv_src_idx.size(0)
        return rpm, cpm, recv_cpm, recv_src_idx, in_rank, send_head
