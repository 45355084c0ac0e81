"""ParallelDims: sizes resolve as documented and bad layouts are refused with the fix in the message."""

import pytest

from moeflow.core.parallel_dims import ParallelDims
from moeflow.core.presets import get_preset


def test_dp_shard_minus_one_takes_the_rest():
    dims = ParallelDims(world_size=16, dp_replicate=2, tp=2, pp=2, ep=2)
    assert (dims.dp_shard, dims.dp, dims.efsdp) == (2, 4, 1)
    assert ParallelDims(world_size=8, ep=4).efsdp == 2


def test_context_parallel_sizes():
    # world = dp_replicate x dp_shard x cp x tp x pp; cp ranks share the data but hold weight replicas
    dims = ParallelDims(world_size=16, dp_replicate=2, tp=2, cp=2)
    assert (dims.dp_shard, dims.dp, dims.efsdp) == (2, 4, 4)  # without EP experts shard over dp_shard x cp
    assert dims.describe() == "dp_replicate=2 x dp_shard=2 x tp=2 x cp=2"
    # ep borrows from dp_shard x cp: as many ranks as cp, more than dp_shard, or fewer than cp
    assert ParallelDims(world_size=2, cp=2, ep=2).efsdp == 1
    assert ParallelDims(world_size=8, cp=2, ep=8).efsdp == 1
    assert ParallelDims(world_size=8, cp=4, ep=2).efsdp == 4
    assert ParallelDims(world_size=6, cp=2, ep=3).efsdp == 2  # neither a multiple nor a divisor of cp
    ParallelDims(world_size=4, cp=2).check_sequence(12)  # 4 chunks of 3 tokens
    ParallelDims(world_size=4, cp=2, tp=2).check_sequence(8)  # 4 tokens per cp rank, 2 per tp rank


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=8, dp_shard=3), r"= 3 must equal the world size \(8\); set --parallel.dp_shard=-1"),
        (dict(world_size=6, tp=4), r"= 4 does not divide the world size \(6\)"),
        (dict(world_size=8, dp_shard=2, tp=4, ep=4), r"parallel.ep \(4\) must divide the data-parallel shard size"
                                                     r" \(dp_shard = 2\).*choose ep in \[1, 2\]"),
        (dict(world_size=4, ep=0), r"parallel.ep must be at least 1, got 0"),
        (dict(world_size=4, cp=0), r"parallel.cp must be at least 1, got 0"),
        (dict(world_size=6, cp=4), r"parallel.dp_replicate x tp x pp x cp = 1 x 1 x 1 x 4 = 4 does not divide the "
                                   r"world size \(6\)"),
        (dict(world_size=8, dp_shard=2, cp=2), r"dp_replicate x dp_shard x tp x pp x cp = 1 x 2 x 1 x 1 x 2 = 4 must "
                                               r"equal the world size \(8\)"),
        (dict(world_size=4, cp=2, ep=8), r"parallel.ep \(8\) must divide the data-parallel shard size times the "
                                         r"context-parallel size \(dp_shard x cp = 2 x 2 = 4\).*choose ep in "
                                         r"\[1, 2, 4\]"),
    ],
)
def test_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_bad_sizes_for_the_model():
    moe = get_preset("tiny-moe")  # 8 experts, 4 heads, 2 kv heads, 4 layers
    with pytest.raises(ValueError, match=r"parallel.ep \(3\) must divide model.moe.num_experts \(8\); "
                                         r"choose ep in \[1, 2, 4, 8\]"):
        ParallelDims(world_size=3, ep=3).check_model(moe)
    with pytest.raises(ValueError, match=r"parallel.tp \(4\) must divide model.n_kv_heads \(2\)"):
        ParallelDims(world_size=4, tp=4).check_model(moe)
    with pytest.raises(ValueError, match=r"parallel.pp \(8\) is larger than model.n_layers \(4\)"):
        ParallelDims(world_size=8, pp=8).check_model(moe)
    with pytest.raises(ValueError, match="needs an MoE model"):
        ParallelDims(world_size=2, ep=2).check_model(get_preset("tiny-dense"))


def test_objectives_that_need_whole_sequences_are_refused_where_sequences_are_split():
    from dataclasses import replace

    moe = get_preset("tiny-moe")
    sequence = replace(moe, moe=replace(moe.moe, aux_loss_type="sequence", aux_loss_coef=0.01))
    with pytest.raises(ValueError, match=r"aux_loss_type = 'sequence' with parallel.cp = 2 is not supported yet"):
        ParallelDims(world_size=2, cp=2).check_model(sequence)
    with pytest.raises(ValueError, match=r"aux_loss_type = 'sequence' with parallel.tp = 2 .*ep_over_tp = false"):
        ParallelDims(world_size=2, tp=2).check_model(sequence)
    ParallelDims(world_size=2, tp=2, ep_over_tp=False).check_model(sequence)  # tp ranks route every token
    ParallelDims(world_size=2, dp_shard=2).check_model(sequence)  # data parallelism keeps sequences whole
    with pytest.raises(ValueError, match=r"model.mtp_depth = 1 with parallel.cp = 2"):
        ParallelDims(world_size=2, cp=2).check_model(replace(moe, mtp_depth=1))
    padded = replace(moe, moe=replace(moe.moe, capacity_factor=1.25, pad_to_capacity=True))
    with pytest.raises(ValueError, match=r"pad_to_capacity with expert parallelism .* = 2 ranks"):
        ParallelDims(world_size=2, tp=2).check_model(padded)


@pytest.mark.parametrize(
    "kwargs, seq_len, message",
    [
        (dict(world_size=4, cp=4), 20, r"data.seq_len \(20\) must be divisible by 2 x parallel.cp \(= 8\).*"
                                       r"use data.seq_len = 16"),
        (dict(world_size=8, cp=2, tp=4), 12, r"data.seq_len / parallel.cp \(12 / 2 = 6 tokens per rank\) must be "
                                             r"divisible by parallel.tp \(4\).*divisible by 8"),
    ],
)
def test_bad_sequence_for_context_parallel(kwargs, seq_len, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs).check_sequence(seq_len)
