"""ParallelDims: sizes resolve as documented and bad layouts are refused with the fix in the message."""

import pytest

from moeflow.layout import ParallelDims
from moeflow.models.presets import get_preset


def test_dp_shard_minus_one_takes_the_rest():
    dims = ParallelDims(world_size=16, dp_replicate=2, tp=2, pp=2, ep=2)
    assert (dims.dp_shard, dims.dp, dims.efsdp) == (2, 4, 1)
    assert ParallelDims(world_size=8, ep=4).efsdp == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=8, dp_shard=3), r"= 3 must equal the world size \(8\); set --parallel.dp_shard=-1"),
        (dict(world_size=6, tp=4), r"= 4 does not divide the world size \(6\)"),
        (dict(world_size=8, dp_shard=2, tp=4, ep=4), r"parallel.ep \(4\) must divide the data-parallel shard size"
                                                     r" \(dp_shard = 2\).*choose ep in \[1, 2\]"),
        (dict(world_size=4, ep=0), r"parallel.ep must be at least 1, got 0"),
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
