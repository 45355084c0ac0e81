"""Context parallelism: the load-balanced layout (against the hand-worked example in moeflow.parallel.context),
and over gloo (tests/parallel/cp_worker.py, one launch of 4 ranks) the attention against SDPA on the whole sequence for
cp = 1, 2 (neighbouring and strided pairs) and 4 with MHA, GQA, MQA and MLA shapes, and a GQA and an MLA model
through moeflow.parallelize against the unparallelized model (logits, loss, every gradient)."""

from __future__ import annotations

import pytest
import torch

from moeflow.parallel.context import local_positions, shard_sequence
from tests.parallel import cp_worker
from tests.support.dist_harness import check_results


def test_layout_is_the_documented_example():
    # cp = 4, S = 16: chunks of 2; rank r keeps chunks r and 7 - r
    want = [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [local_positions(16, r, 4).tolist() for r in range(4)] == want
    x_BS = torch.arange(32).view(2, 16)
    assert shard_sequence(x_BS, 1, 4).tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]
    assert local_positions(6, 0, 1).tolist() == list(range(6))  # cp = 1: the whole sequence
    with pytest.raises(ValueError, match=r"sequence of 12 tokens .* divisible by 2 x cp = 8"):
        shard_sequence(torch.zeros(1, 12), 0, 4)


@pytest.mark.slow  # 4 ranks (16 s): make test runs it; CI trains cp2 and cp2-ep2 in tests/parallel/test_layouts.py
@pytest.mark.timeout(240)
def test_world4_attention_and_models():
    cases = [(f"attention cp={cp} ({layout}) {kind}", cp_worker.case_attention, dict(layout=layout, kind=kind))
             for layout, cp in (("single", 1), ("pairs", 2), ("world", 4))
             for kind in cp_worker.ATTENTION_KINDS]
    cases += [
        ("attention cp=2 (strided pairs) GQA", cp_worker.case_attention, dict(layout="strided", kind="GQA")),
        ("attention cp=4 GQA bf16", cp_worker.case_attention, dict(layout="world", kind="GQA", dtype="bf16")),
        ("attention cp=4 GQA fp32 under bf16 autocast", cp_worker.case_attention,
         dict(layout="world", kind="GQA", dtype="autocast")),
        ("attention: odd local length refused", cp_worker.case_odd_local_length_refused, {}),
        ("GQA model, cp=2 x dp=2", cp_worker.case_model, dict(kind="gqa", cp=2)),
        ("MLA model, cp=4", cp_worker.case_model, dict(kind="mla", cp=4)),
        ("MLA model, cp=2 x dp=2", cp_worker.case_model, dict(kind="mla", cp=2)),
        ("GQA model, cp=4, no valid target on cp rank 0", cp_worker.case_model,
            dict(kind="gqa", cp=4, ignore_rank0=True)),
    ]
    check_results(cp_worker.launch(4, cases), cases)
