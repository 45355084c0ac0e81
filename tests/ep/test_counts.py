"""moeflow.ep pure parts: layout, byte bounds (docs/ep-bytes.md), fp8 helpers, the wire format, size 1."""

from __future__ import annotations

import pytest
import torch

from moeflow.ep import Buffer, per_token_cast_back, per_token_cast_to_fp8, reference, wire
from moeflow.ep import counts as L

pytestmark = pytest.mark.timeout(60)


def test_layout_counts_with_rank_and_node_dedup():
    # 4 ranks as 2 nodes x 2, 8 experts (2 per rank).
    idx = torch.tensor([[0, 1], [0, 7], [-1, -1], [2, 5], [6, 6]])
    lay = L.get_dispatch_layout(idx, 8, 4, ranks_per_node=2)
    assert lay.is_token_in_rank.tolist() == [
        [True, False, False, False], [True, False, False, True], [False] * 4,
        [False, True, True, False], [False, False, False, True]]
    assert lay.num_tokens_per_rank.tolist() == [2, 1, 1, 2]
    assert lay.num_tokens_per_rdma_rank.tolist() == [3, 3]
    assert lay.num_tokens_per_expert.tolist() == [2, 1, 1, 0, 0, 1, 2, 1]
    assert L.get_dispatch_layout(idx, 8, 4, ranks_per_node=4).num_tokens_per_rdma_rank is None


def test_bytes_by_hand_match_the_doc():
    # Rank 0 of 4 (2 nodes x 2), one token to experts on ranks 1, 2, 3 (E = 4): rows of 10 bytes.
    idx = [torch.tensor([[1, 2, 3]]), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long),
           torch.zeros(0, 3, dtype=torch.long)]
    t = lambda s: L.traffic_bytes(idx, 4, 2, s, 10, 1)  # noqa: E731
    assert (t("pair").dispatch_bytes_intra, t("pair").dispatch_bytes_inter) == (10, 20)
    assert (t("rank").dispatch_bytes_intra, t("rank").dispatch_bytes_inter) == (10, 20)
    # node: one copy to rank 2 (node 1, local rank 0), which forwards to rank 3; plus rank 1 in node 0.
    assert (t("node").dispatch_bytes_intra, t("node").dispatch_bytes_inter) == (20, 10)
    assert (t("node").combine_bytes_intra, t("node").combine_bytes_inter) == (2, 1)
    assert (t("allgather").dispatch_bytes_intra, t("allgather").dispatch_bytes_inter) == (10, 20)
    # Duplicate experts on one rank: pair counts both, rank counts one.
    idx[0] = torch.tensor([[4, 5, -1]])  # E = 8: experts 4 and 5 both live on rank 2 (node 1)
    assert L.traffic_bytes(idx, 8, 2, "pair", 1, 1).dispatch_bytes_inter == 2
    assert L.traffic_bytes(idx, 8, 2, "rank", 1, 1).dispatch_bytes_inter == 1


def _counted_copy_by_copy(idx, E: int, G: int, level: str, dispatch_row: int, combine_row: int) -> L.TrafficBytes:
    """docs/ep-bytes.md's 'rank' and 'node' strategies, token by token with Python sets (no moeflow code)."""
    R = len(idx)
    intra = inter = 0
    for s, idx_TK in enumerate(idx):
        for experts in idx_TK.tolist():
            ranks = {e // (E // R) for e in experts if e >= 0}
            if level == "rank":
                intra += sum(1 for r in ranks if r != s and r // G == s // G)
                inter += sum(1 for r in ranks if r // G != s // G)
                continue
            for node in {r // G for r in ranks}:
                peer = node * G + s % G  # the forwarding rank: our local rank on that node (s on our own node)
                inter += node != s // G
                intra += sum(1 for r in ranks if r // G == node and r != peer)
    return L.TrafficBytes(intra * dispatch_row, inter * dispatch_row, intra * combine_row, inter * combine_row)


def test_bounds_order_on_random_routings():
    g = torch.Generator().manual_seed(0)
    idx = [torch.randint(-1, 32, (20, 4), generator=g) for _ in range(8)]
    pair, rank, node = (L.traffic_bytes(idx, 32, 4, s, 1, 1) for s in ("pair", "rank", "node"))
    assert rank.dispatch_bytes_inter <= pair.dispatch_bytes_inter
    assert node.dispatch_bytes_inter <= rank.dispatch_bytes_inter
    with pytest.raises(ValueError, match="ranks_per_node"):
        L.traffic_bytes(idx, 32, 3, "rank", 1, 1)


@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_lower_bounds_equal_a_copy_by_copy_count(G):
    # 8 ranks, 32 experts; -1 entries, repeated experts, a rank without tokens; rows of 10 and 3 bytes.
    g = torch.Generator().manual_seed(G)
    idx = [torch.randint(-1, 32, (0 if s == 5 else 24, 4), generator=g) for s in range(8)]
    idx[2][:, 1] = idx[2][:, 0]
    for level in ("rank", "node"):
        assert L.lower_bound_bytes(idx, 32, G, 10, 3, level=level) == _counted_copy_by_copy(idx, 32, G, level, 10, 3)


def test_row_bytes():
    assert L.dispatch_row_bytes(256, 2) == 512
    assert L.dispatch_row_bytes(256, 1, fp8=True, num_topk=8, with_topk_idx=True, with_topk_weights=True) == (
        256 + 8 + 64 + 32)
    assert L.combine_row_bytes(256, 2, 8, with_topk_weights=True) == 512 + 32


def test_check_topk_idx_messages():
    with pytest.raises(ValueError, match=r"expert id 9, outside \[-1, num_experts=8\)"):
        L.check_topk_idx(torch.tensor([[9]]), 8)
    with pytest.raises(ValueError, match=r"expert id -2, outside \[-1, num_experts=8\)"):
        L.check_topk_idx(torch.tensor([[3, -2], [-1, 7]]), 8)
    L.check_topk_idx(torch.tensor([[3, -1], [-1, 7]]), 8)  # -1 and the last id are fine
    with pytest.raises(ValueError, match="int64"):
        L.check_topk_idx(torch.tensor([[1]], dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="2-D"):
        L.check_topk_idx(torch.tensor([1]), 8)


def test_fp8_roundtrip_and_format():
    x = torch.randn(4, 256) * torch.tensor([1.0, 100.0, 1e-3, 0.0]).unsqueeze(1)
    q, s = per_token_cast_to_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (4, 2)
    back = per_token_cast_back(q, s)
    assert torch.allclose(back, x, rtol=0.07, atol=1e-6)
    assert (back[3] == 0).all()
    with pytest.raises(ValueError, match="multiple of 128"):
        per_token_cast_to_fp8(torch.randn(2, 130))


def test_wire_roundtrip_mixed_dtypes_and_empty():
    a, b, c = torch.randn(3, 5).bfloat16(), torch.arange(6).view(3, 2), torch.rand(3, 2)
    specs = [wire.spec_of(t) for t in (a, b, c)]
    rows = wire.pack([a, b, c])
    assert rows.shape == (3, 5 * 2 + 2 * 8 + 2 * 4) == (3, wire.row_nbytes(specs))
    for got, want in zip(wire.unpack(rows, specs), (a, b, c)):
        assert torch.equal(got, want)
    assert [t.shape for t in wire.unpack(wire.pack([a[:0], b[:0]]), specs[:2])] == [(0, 5), (0, 2)]


def test_size_one_group_has_no_collectives():
    # No process group at all: Buffer(None) runs the same code with the collectives short-circuited.
    buf = Buffer(None)
    assert buf.group_size == 1 and buf.backend_name == "alltoall"
    idx = torch.tensor([[0, 3], [-1, 2], [1, 1]])
    x = torch.randn(3, 16, requires_grad=True)
    recv_x, recv_idx, _, counts, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=4, expert_alignment=4)
    assert torch.equal(recv_x, x) and torch.equal(recv_idx, idx) and counts == [4, 4, 4, 4]
    out, _, _ = buf.combine(recv_x * 3, handle)
    out.sum().backward()
    assert torch.equal(out, x * 3) and torch.equal(x.grad, torch.full_like(x, 3.0))
    # dispatch + combine, and the backward of each (a combine and a dispatch)
    assert buf.stats.dispatch_bytes_intra == buf.stats.dispatch_bytes_inter == 0 and buf.stats.calls == 4
    buf.reset_stats()
    assert buf.stats.calls == 0


def test_reference_dispatch_order_and_combine():
    idx = [torch.tensor([[0, 3], [2, -1]]), torch.tensor([[1, 2]])]  # 2 ranks, 4 experts
    xs = [torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0]])]
    got = reference.dispatch(xs, idx, 4)
    assert got[0].x.flatten().tolist() == [1.0, 3.0] and got[0].src_rank.tolist() == [0, 1]
    assert got[1].x.flatten().tolist() == [1.0, 2.0, 3.0] and got[1].topk_idx.tolist() == [[-1, 1], [0, -1],
                                                                                            [-1, 0]]
    out = reference.combine([r.x for r in got], idx, 4, ranks_per_node=2)
    assert out[0].flatten().tolist() == [2.0, 2.0] and out[1].flatten().tolist() == [6.0]


def test_external_backends_explain_themselves():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the adapters may really work here")
    for name in ("deep_ep", "uccl"):
        with pytest.raises(RuntimeError, match="CUDA"):
            Buffer(None, backend=name)


def test_ranks_per_node_defaults_to_local_world_size(monkeypatch):
    from moeflow.ep.checks import resolve_ranks_per_node

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_ranks_per_node(None, [0, 1, 2, 3]) == 2
    assert resolve_ranks_per_node(None, [4, 5]) == 2
    with pytest.raises(ValueError, match="ranks_per_node"):
        resolve_ranks_per_node(None, [0, 1, 2])
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert resolve_ranks_per_node(None, [0, 1, 2, 3]) == 4
    with pytest.raises(ValueError, match=r"ranks_per_node = 3 must divide the EP group size 4; choose one of"):
        resolve_ranks_per_node(3, [0, 1, 2, 3])
