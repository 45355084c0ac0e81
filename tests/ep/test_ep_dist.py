"""moeflow.ep over gloo: every backend vs moeflow.ep.reference at world sizes 1, 2, 4 (2x2) and 8 (2x4, 4x2).

One launch per world size runs every case (see tests/ep/ep_worker.py); routings come from hypothesis
(derandomized, drawn here in the parent) plus named edge cases.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tests.ep import ep_worker
from tests.support.dist_harness import check_results


@st.composite
def routing_st(draw, R: int):
    L = draw(st.sampled_from([1, 2]))
    E = R * L
    K = draw(st.integers(1, min(E, 4)))
    idx = []
    for _ in range(R):
        T = draw(st.integers(0, 5))
        idx.append(draw(st.lists(st.integers(-1, E - 1), min_size=T * K, max_size=T * K)))
    return {"E": E, "K": K, "idx": idx}


def drawn_routings(R: int, n: int) -> list[dict]:
    out = []

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate], deadline=None)
    @given(routing_st(R))
    def collect(r):
        out.append(r)

    collect()
    return out[:n]


def edge_routings(R: int) -> dict[str, dict]:
    E = 2 * R
    return {
        "minus_one_and_empty_rank": {"E": E, "K": 2, "idx": [[] if s == 0 else [-1, -1, s, -1, 0, E - 1]
                                                              for s in range(R)]},
        "all_on_one_expert": {"E": E, "K": 1, "idx": [[0, 0, 0] for _ in range(R)]},  # others receive nothing
        "topk_equals_num_experts": {"E": E, "K": E, "idx": [list(range(E))[s:] + list(range(E))[:s]
                                                            for s in range(R)]},
        "duplicates_on_one_rank": {"E": E, "K": 3, "idx": [[0, 1, E - 1, 3 % E, 3 % E, -1] for _ in range(R)]},
    }


def ll_routing(r: dict) -> dict:
    """The same routing with repeated experts of a token replaced by -1 (low-latency needs distinct ones)."""
    K, idx = r["K"], []
    for flat in r["idx"]:
        rows = [flat[i:i + K] for i in range(0, len(flat), K)]
        idx.append([e if e < 0 or e not in row[:k] else -1 for row in rows for k, e in enumerate(row)])
    return {**r, "idx": idx}


def cases_for(R: int, layouts: list[tuple[str, int]], n_drawn: int, moe: bool, timeout: bool):
    routings = {f"drawn{i}": r for i, r in enumerate(drawn_routings(R, n_drawn))}
    routings.update(edge_routings(R))
    cases = []
    for rname, r in routings.items():
        for backend, G in layouts:
            tag = f"{backend}/G{G}/{rname}"
            cases.append((f"reference {tag}", ep_worker.case_reference, dict(routing=r, backend=backend, G=G)))
            cases.append((f"oracle {tag}", ep_worker.case_oracle, dict(routing=r, backend=backend, G=G)))
        cases.append((f"low_latency {rname}", ep_worker.case_low_latency, dict(routing=ll_routing(r), G=layouts[0][1])))
    r = routings["minus_one_and_empty_rank"]
    for backend, G in layouts:
        tag = f"{backend}/G{G}"
        cases.append((f"worst_tokens {tag}", ep_worker.case_reference,
                      dict(routing=r, backend=backend, G=G, W="safe", align=4)))
        cases.append((f"static_overflow {tag}", ep_worker.case_static_overflow, dict(routing=routings["drawn0"], G=G)))
        cases.append((f"layout_only {tag}", ep_worker.case_layout_only,
                      dict(routing=routings["drawn1"], backend=backend, G=G)))
        cases.append((f"fp8 {tag}", ep_worker.case_fp8,
                      dict(routing=routings["topk_equals_num_experts"], backend=backend, G=G)))
        for rname in ("topk_equals_num_experts", "minus_one_and_empty_rank", "drawn0"):
            cases.append((f"bf16 {tag}/{rname}", ep_worker.case_bf16,
                          dict(routing=routings[rname], backend=backend, G=G,
                                                             shows_rounding=rname == "topk_equals_num_experts")))
    cases.append(("low_latency fp8", ep_worker.case_low_latency,
                  dict(routing=ll_routing(routings["drawn2"]), G=1, D=128)))
    cases.append(("bad_inputs", ep_worker.case_bad_inputs, dict(G=layouts[0][1])))
    if moe:
        for backend, G in layouts:
            cases.append((f"moe {backend}/G{G}", ep_worker.case_moe,
                          dict(backend=backend, G=G, E=2 * R if R > 4 else 8)))
            cases.append((f"moe autocast {backend}/G{G}", ep_worker.case_moe_autocast,
                          dict(backend=backend, G=G, E=2 * R if R > 4 else 8)))
        for chunks in (1, 2, 4) if R <= 2 else (2,):
            backend, G = layouts[0]
            cases.append((f"overlap {backend}/G{G} chunks={chunks}", ep_worker.case_overlap,
                          dict(backend=backend, G=G, chunks=chunks, E=2 * R if R > 4 else 8)))
        # more chunks than tokens: some chunks are empty on every rank (dispatch and combine of nothing)
        cases.append(("overlap empty chunks", ep_worker.case_overlap,
                      dict(backend=layouts[0][0], G=layouts[0][1], chunks=4, T=3,
                                                              E=2 * R if R > 4 else 8)))
        cases.append(("host_syncs", ep_worker.case_host_syncs, dict(G=layouts[0][1], E=2 * R if R > 4 else 8)))
    if timeout:
        cases.append(("timeout", ep_worker.case_timeout, {}))  # last: it leaves an unmatched collective behind
    return cases


@pytest.mark.timeout(120)
def test_world1_inline():
    layouts = [("alltoall", 1), ("hierarchical", 1), ("allgather", 1)]
    cases = cases_for(1, layouts, n_drawn=6, moe=True, timeout=False)
    check_results([ep_worker.run_inline(cases)], cases)


@pytest.mark.timeout(120)
def test_world2():
    layouts = [("alltoall", 2), ("hierarchical", 1), ("allgather", 1), ("alltoall", 1)]
    cases = cases_for(2, layouts, n_drawn=6, moe=True, timeout=True)
    check_results(ep_worker.launch(2, cases), cases)


@pytest.mark.slow  # 4 ranks (21 s): make test runs it, CI the 1- and 2-rank cases
@pytest.mark.timeout(150)
def test_world4_two_nodes_of_two():
    layouts = [("hierarchical", 2), ("alltoall", 2), ("allgather", 2), ("alltoall", 4)]
    cases = cases_for(4, layouts, n_drawn=5, moe=True, timeout=False)
    check_results(ep_worker.launch(4, cases), cases)


@pytest.mark.slow  # 8 ranks (25 s): make test runs it, CI the 2- and 4-rank cases
@pytest.mark.timeout(240)
def test_world8_2x4_and_4x2():
    layouts = [("hierarchical", 4), ("hierarchical", 2), ("alltoall", 4), ("alltoall", 2), ("allgather", 4)]
    cases = cases_for(8, layouts, n_drawn=3, moe=True, timeout=False)
    check_results(ep_worker.launch(8, cases), cases)
