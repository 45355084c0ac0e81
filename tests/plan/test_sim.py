"""moeflow.sim: exact EP byte counts vs an independent brute-force count of docs/ep-bytes.md, closed-form
expectations vs sampling, routing distributions, and the `simulate ep` CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeflow.sim.cli import main as sim_main
from moeflow.sim.ep import count_copies, expected_uniform_copies, row_bytes, sample_copies
from moeflow.sim.routing import get_routing, load_routing_log, sample_topk


def brute_force(topk_idx_RTK, E, G, strategy):
    """docs/ep-bytes.md read literally: loop over source ranks and tokens, return per-rank sent copies."""
    R, T, K = topk_idx_RTK.shape
    per = E // R
    sent_intra, sent_inter = [0] * R, [0] * R
    for s in range(R):
        for t in range(T):
            experts = [int(e) for e in topk_idx_RTK[s, t] if e >= 0]
            ranks = {e // per for e in experts}
            if strategy == "pair":
                for e in experts:
                    r = e // per
                    if r != s:
                        if r // G == s // G:
                            sent_intra[s] += 1
                        else:
                            sent_inter[s] += 1
            elif strategy == "rank":
                for r in ranks - {s}:
                    if r // G == s // G:
                        sent_intra[s] += 1
                    else:
                        sent_inter[s] += 1
            elif strategy == "node":
                for n in {r // G for r in ranks}:
                    p = n * G + s % G
                    if n != s // G:
                        sent_inter[s] += 1
                    for r in ranks:
                        if r // G == n and r != p:
                            sent_intra[p] += 1  # phase 2 is sent by the forwarding peer
            elif strategy == "allgather":
                for r in range(R):
                    if r != s:
                        if r // G == s // G:
                            sent_intra[s] += 1
                        else:
                            sent_inter[s] += 1
    return sent_intra, sent_inter


def random_routing(R, T, K, E, seed, drop=0.1):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).reshape(R, T, K)
    idx[rng.random(idx.shape) < drop] = -1  # some slots route nowhere
    return idx


@pytest.mark.parametrize("strategy", ["pair", "rank", "node", "allgather"])
@pytest.mark.parametrize("R,G,E,K", [(8, 4, 16, 4), (8, 2, 32, 6), (4, 4, 8, 2), (16, 4, 16, 3)])
def test_exact_counts_match_brute_force(strategy, R, G, E, K):
    idx = random_routing(R, 7, K, E, seed=R * E + K)
    got = count_copies(idx, E, G, strategy)
    want_intra, want_inter = brute_force(idx, E, G, strategy)
    assert got.send_intra_R.tolist() == want_intra
    assert got.send_inter_R.tolist() == want_inter


def test_hand_worked_example():
    # 4 ranks, 2 per node, one expert per rank. Rank 0 sends token a -> experts {1, 2}, token b -> {2, 3}.
    idx = np.full((4, 2, 2), -1)
    idx[0, 0] = [1, 2]
    idx[0, 1] = [2, 3]
    pair = count_copies(idx, 4, 2, "pair")
    assert (pair.intra, pair.inter) == (1, 3)  # a: 1 intra + 1 inter; b: 2 inter
    node = count_copies(idx, 4, 2, "node")
    # a: inter 0->2 (peer 2 is the destination); b: inter 0->2 once, then intra 2->3
    assert (node.intra, node.inter) == (2, 2)
    assert node.send_intra_R.tolist() == [1, 0, 1, 0]
    assert node.recv_inter_R.tolist() == [0, 0, 2, 0]
    # combine row and dispatch row sizes from docs/ep-bytes.md
    assert row_bytes(256, 2, "bf16") == (256 * 2 + 2 * 8 + 2 * 4, 256 * 2 + 2 * 4)
    assert row_bytes(256, 2, "fp8") == (256 + 2 * 4 + 2 * 8 + 2 * 4, 256 * 2 + 2 * 4)


@pytest.mark.parametrize("strategy", ["pair", "rank", "node"])
def test_uniform_closed_form_matches_sampling(strategy):
    E, K, R, G = 64, 6, 16, 4
    idx = sample_topk("uniform", R * 2000, E, K, seed=1).reshape(R, 2000, K)
    c = count_copies(idx, E, G, strategy)
    intra, inter = expected_uniform_copies(E, K, R, G, strategy)
    assert c.intra / (R * 2000) == pytest.approx(intra, rel=0.02)
    assert c.inter / (R * 2000) == pytest.approx(inter, rel=0.02)


def test_sampled_mode_is_exact_when_small_and_scales_when_large():
    exact, is_exact = sample_copies("uniform", 32, 4, 8, 4, 64, budget=1 << 20, seed=3)
    assert is_exact
    idx = get_routing("uniform", 8 * 64, 32, 4, seed=3).reshape(8, 64, 4)
    assert exact["rank"].inter == count_copies(idx, 32, 4, "rank").inter
    est, is_exact = sample_copies("uniform", 32, 4, 8, 4, 4096, budget=8 * 4 * 512, seed=3)
    assert not is_exact
    want = expected_uniform_copies(32, 4, 8, 4, "rank")[1] * 8 * 4096
    assert est["rank"].inter == pytest.approx(want, rel=0.05)


def test_routing_distributions():
    u = sample_topk("uniform", 500, 32, 4, seed=0)
    assert all(len(set(row)) == 4 for row in u.tolist())
    assert np.array_equal(u, sample_topk("uniform", 500, 32, 4, seed=0))
    z = sample_topk("zipf:1.5", 4000, 32, 2, seed=0)
    counts = np.bincount(z.ravel(), minlength=32)
    assert counts.max() > 3 * counts.mean()  # skewed; uniform would be near the mean
    g = sample_topk("group", 500, 64, 8, seed=0, n_group=8, topk_group=2)
    assert all(len({e // 8 for e in row}) <= 2 for row in g.tolist())
    with pytest.raises(ValueError, match="zipf:1.2"):
        sample_topk("zipf:x", 10, 8, 2)
    with pytest.raises(ValueError, match="uniform"):
        get_routing("poisson", 10, 8, 2)


def test_routing_logs(tmp_path):
    log = np.array([[0, 3], [1, -1], [7, 2]])
    np.save(tmp_path / "r.npy", log)
    assert np.array_equal(load_routing_log(str(tmp_path / "r.npy")), log)
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in log.tolist()))
    assert np.array_equal(load_routing_log(str(tmp_path / "r.jsonl")), log)
    assert get_routing(str(tmp_path / "r.npy"), 5, 8, 2).shape == (5, 2)
    with pytest.raises(ValueError, match="experts"):
        get_routing(str(tmp_path / "r.npy"), 5, 4, 2)


def test_cli_json(capsys):
    rc = sim_main(["ep", "--model", "deepseek-v3", "--nodes", "4", "--tokens-per-gpu", "128", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert {r["ep"] for r in rows} == {8, 16, 32}
    for r in rows:
        assert {"ep", "strategy", "bytes_intra", "bytes_inter", "ep_time_s", "comm_share"} <= set(r)
        assert 0 < r["comm_share"] < 1
    by = {(r["ep"], r["strategy"]): r for r in rows}
    # dedup can only remove cross-node copies: node <= rank <= pair on total inter bytes
    assert by[32, "node"]["total_bytes_inter"] < by[32, "rank"]["total_bytes_inter"] <= by[32, "pair"][
        "total_bytes_inter"]
    assert by[8, "node"]["bytes_inter"] == 0  # one node: nothing crosses


def test_cli_table_and_png(capsys, tmp_path):
    rc = sim_main(["ep", "--model", "olmoe-1b-7b", "--nodes", "2", "--tokens-per-gpu", "64",
                   "--routing", "zipf:1.2", "--png", str(tmp_path / "ep.png")])
    assert rc == 0
    assert "strategy" in capsys.readouterr().out
    assert (tmp_path / "ep.png").stat().st_size > 1000


@pytest.mark.parametrize("argv,msg", [
    (["--model", "deepseek-v4", "--nodes", "1"], "Did you mean 'deepseek-v3'"),
    (["--model", "llama3-8b", "--nodes", "1"], "dense"),
    (["--model", "deepseek-v3", "--nodes", "4", "--ep-sizes", "24"], "must divide"),
    (["--model", "deepseek-v3", "--nodes", "1", "--ep-sizes", "16"], "> the 8 GPUs"),
    (["--model", "deepseek-v3", "--nodes", "1", "--gpu", "H1000"], "H100"),
    (["--model", "deepseek-v3", "--nodes", "1", "--efficiency", "2"], "--efficiency (2.0) must be in (0, 1]"),
    (["--model", "deepseek-v3", "--nodes", "1", "--seq-len", "0"], "--seq-len must be positive, got 0"),
    (["--model", "deepseek-v3", "--nodes", "1", "--nvlink-gbps", "0"], "--nvlink-gbps must be a positive number"),
    (["--model", "deepseek-v3", "--nodes", "1", "--ep-sizes", "8,a"], "--ep-sizes '8,a': give comma-separated"),
    (["--model", "deepseek-v3", "--nodes", "1", "--ep-sizes", "8", "--png", "/proc/no/x.png"], "--png /proc/no/x"),
])
def test_cli_bad_input(capsys, argv, msg):
    assert sim_main(["ep", *argv]) == 2
    assert msg in capsys.readouterr().err
