"""Pipeline parallelism (moeflow.parallel.pipeline): the split as data, stage modules, and every torch 2.13
schedule trained over gloo against the unparallelized model (tests/parallel/pp_worker.py, one launch per world size).
"""

from __future__ import annotations

import pytest
import torch

from moeflow.core.schedules import (
    SCHEDULES,
    pipeline_layout,
    resolve_schedule,
    split_layers,
    validate_microbatches,
)
from moeflow.models.transformer import Transformer
from moeflow.parallel.pipeline import build_schedule, build_stage_modules
from moeflow.parallel.runner import router_layers
from tests.parallel import pp_worker
from tests.support.cli import old_torch
from tests.support.dist_harness import check_results

ALL_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                 "DualPipeV"]

# ---- the split, by hand ---------------------------------------------------------------------------------


def test_split_layers_even_and_remainder_to_the_first_stages():
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    assert split_layers(4, 4) == [[0], [1], [2], [3]]
    assert split_layers(7, 1) == [list(range(7))]
    # 10 = 3 + 3 + 2 + 2: the two extra layers go to stages 0 and 1, not to the last (output head + loss).
    assert split_layers(10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert split_layers(5, 3) == [[0, 1], [2, 3], [4]]


def test_split_layers_explicit_boundaries():
    assert split_layers(5, 2, [0, 3]) == [[0, 1, 2], [3, 4]]
    assert split_layers(5, 3, [0, 1, 4]) == [[0], [1, 2, 3], [4]]
    assert split_layers(5, 3, [[0], [1, 2, 3], [4]]) == [[0], [1, 2, 3], [4]]
    assert split_layers(4, 2, [["layers.0"], ["layers.1", "layers.2", "layers.3"]]) == [[0], [1, 2, 3]]


@pytest.mark.parametrize("n_layers, stages, boundaries, needles", [
    (4, 5, None, ["5 pipeline stages", "model.n_layers = 4", "at most 4"]),
    (4, 2, [[0, 1], [3]], ["must list layers 0..3 in order", "[0, 1, 3]"]),  # layer 2 on no stage
    (4, 2, [[0, 1, 2], [2, 3]], ["each once"]),
    (4, 2, [[2, 3], [0, 1]], ["in order"]),
    (4, 2, [[0, 1, 2, 3], []], ["at least one layer"]),
    (4, 2, [1, 3], ["start at 0"]),
    (4, 3, [0, 2, 2], ["strictly increase"]),
    (4, 2, [0, 1, 2], ["3 entries", "2 stages"]),
    (4, 2, [0, 7], ["layer 7", "layers 0..3"]),
    (4, 2, [[0, 1], 2], ["mixes"]),
])
def test_split_layers_errors(n_layers, stages, boundaries, needles):
    with pytest.raises(ValueError) as err:
        split_layers(n_layers, stages, boundaries)
    for needle in needles:
        assert needle in str(err.value)


def test_layout_placements():
    def ranks(pp, schedule, n_layers=8):
        return [s.rank for s in pipeline_layout(n_layers, pp, schedule)]

    assert ranks(2, "1F1B") == [0, 1]
    assert ranks(2, "Interleaved1F1B") == [0, 1, 0, 1]
    assert ranks(3, "LoopedBFS", 6) == [0, 1, 2, 0, 1, 2]
    assert ranks(2, "ZBVZeroBubble") == [0, 1, 1, 0]  # V: rank r holds r and 2pp - 1 - r
    assert ranks(3, "DualPipeV", 6) == [0, 1, 2, 2, 1, 0]
    assert [s.rank for s in pipeline_layout(8, 2, "Interleaved1F1B", stages_per_rank=4)] == [0, 1] * 4
    layout = pipeline_layout(8, 2, "zbvzerobubble")
    assert [s.layer_names for s in layout] == [["layers.0", "layers.1"], ["layers.2", "layers.3"],
                                               ["layers.4", "layers.5"], ["layers.6", "layers.7"]]
    assert [(s.embed, s.head) for s in layout] == [(True, False), (False, False), (False, False), (False, True)]
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        pipeline_layout(8, 2, "DualPipeV", stages_per_rank=3)
    with pytest.raises(ValueError, match="one stage per rank"):
        pipeline_layout(8, 2, "GPipe", stages_per_rank=2)


def test_schedule_names():
    assert list(SCHEDULES) == ALL_SCHEDULES
    assert resolve_schedule("gpipe") == "GPipe" and resolve_schedule("ZBVZEROBUBBLE") == "ZBVZeroBubble"
    with pytest.raises(ValueError) as err:
        resolve_schedule("PipeDream")
    for name in ALL_SCHEDULES:
        assert name in str(err.value)
    assert "'PipeDream'" in str(err.value)


def test_microbatch_validation():
    validate_microbatches(8, 4, "1F1B", 2)
    with pytest.raises(ValueError, match=r"micro-batches \(3\) must divide the per-rank batch \(8\).*\[1, 2, 4, 8\]"):
        validate_microbatches(8, 3, "GPipe", 2)
    with pytest.raises(ValueError, match="needs at least 2 micro-batches"):
        validate_microbatches(8, 1, "1F1B", 2)
    with pytest.raises(ValueError, match="4 stages needs at least 4 micro-batches"):
        validate_microbatches(8, 2, "DualPipeV", 2)
    with pytest.raises(ValueError, match="multiple of parallel.pp"):
        validate_microbatches(9, 9, "Interleaved1F1B", 4)  # 9 // 4 = 2 rounds do not divide 9
    # build_schedule checks the schedule's own limits before it creates anything (no process group needed).
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        build_schedule([torch.nn.Linear(1, 1)], 0, 2, None, torch.device("cpu"), "1f1b", 1)


# ---- stage modules, in one process ---------------------------------------------------------------------


def _model(kind="moe", **changes):
    model = Transformer(pp_worker.tiny_config(kind).replace(**changes))
    model.init_weights(seed=0)
    return model


def test_stage_modules_keep_full_model_names_and_share_parameters():
    full = dict(_model().named_parameters())
    model = _model()
    stages = build_stage_modules(model, 1, 2, "Interleaved1F1B")  # rank 1 of 4 stages: layers 1 and 3
    assert [list(s.layers) for s in stages] == [["1"], ["3"]]
    assert stages[0].tok_embeddings is None and stages[0].output is None and stages[1].output is not None
    assert list(model.layers) == ["1", "3"] and model.tok_embeddings is None  # the container: this rank's union
    model_params = {id(p) for p in model.parameters()}
    for stage in stages:
        for name, param in stage.named_parameters():
            assert name in full and param.shape == full[name].shape
            assert id(param) in model_params  # shared, not copied: one optimizer over model.parameters()
    assert set(dict(model.named_parameters())) == {n for s in stages for n, _ in s.named_parameters()}
    assert list(router_layers(stages)) == [1, 3]

    single = _model()
    assert build_stage_modules(single, 0, 2, "GPipe") == [single]  # one stage per rank: the model itself
    assert list(single.layers) == ["0", "1"] and single.output is None
    untouched = _model()
    assert build_stage_modules(untouched, 0, 1, "1F1B") == [untouched] and len(untouched.layers) == 4


@pytest.mark.parametrize("schedule, pp", [("1F1B", 2), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2),
                                          ("GPipe", 4)])
def test_stages_chained_in_stage_order_equal_the_full_model(schedule, pp):
    tokens = torch.randint(0, 64, (2, pp_worker.SEQ), generator=torch.Generator().manual_seed(0))
    want = _model()(tokens)
    by_index = {}
    for rank in range(pp):
        specs = [s for s in pipeline_layout(4, pp, schedule) if s.rank == rank]
        for spec, module in zip(specs, build_stage_modules(_model(), rank, pp, schedule)):
            by_index[spec.index] = module
    h = tokens
    for index in sorted(by_index):
        h = by_index[index](h)
    torch.testing.assert_close(h, want, rtol=0, atol=0)


def test_stage_module_errors():
    with pytest.raises(ValueError, match="5 pipeline stages for model.n_layers = 4"):
        build_stage_modules(_model(), 0, 5, "1F1B")
    model = _model()
    with pytest.raises(ValueError, match="6 pipeline stages"):
        build_stage_modules(model, 0, 3, "Interleaved1F1B")
    assert len(model.layers) == 4 and model.output is not None  # a refused split leaves the model whole
    with pytest.raises(ValueError, match="'Pipedream'.*GPipe"):
        build_stage_modules(model, 0, 2, "Pipedream")
    with pytest.raises(ValueError, match="tie_embeddings"):
        build_stage_modules(_model(tie_embeddings=True), 0, 2, "1F1B")


# ---- training over gloo ---------------------------------------------------------------------------------


def _runnable_here(cases):
    """The cases this torch runs: before 2.13 it refuses V-shaped schedules on gloo (parallel/torch_compat.py)."""
    def v_shaped(case):
        schedule = case[2].get("schedule")
        return schedule is not None and SCHEDULES[schedule].placement == "v"

    return [c for c in cases if not (old_torch() and v_shaped(c))]


def _train(kind, schedule, **kwargs):
    tag = " ".join([kind, schedule] + [f"{k}={v}" for k, v in kwargs.items()])
    return (tag, pp_worker.case_train, dict(kind=kind, schedule=schedule, **kwargs))


@pytest.mark.timeout(180)
def test_pp2_every_schedule_matches_the_single_device_model():
    """pp=2, 4 layers (the interleaved and V schedules hold 2 stages per rank), 4 micro-batches: 3 AdamW
    steps, an evaluation before the last; dense and MoE, the MoE aux/z losses, activation checkpointing."""
    cases = [_train(kind, schedule, pp=2) for kind in ("dense", "moe") for schedule in ALL_SCHEDULES]
    cases += [_train("moe", schedule, pp=2, aux_loss=True)
              for schedule in ("1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")]
    cases += [_train("moe", "1F1B", pp=2, activation_checkpointing=True),
              _train("moe", "ZBVZeroBubble", pp=2, activation_checkpointing=True),
              _train("dense", "GPipe", pp=2, boundaries=[[0], [1, 2, 3]]),
              _train("moe", "GPipe", pp=2, n_microbatches=8, eval_before_last=False),
              ("bad batch", pp_worker.case_bad_batch, {})]
    cases = _runnable_here(cases)
    check_results(pp_worker.launch(2, cases), cases)


@pytest.mark.slow  # 17 s: make test runs it, CI does not
@pytest.mark.timeout(180)
def test_pp2_x_dp2_fsdp_and_expert_parallel():
    """pp=2 x dp=2: FSDP2 on the dp mesh dimension (each dp rank its half of the batch), and expert
    parallelism over the dp ranks inside the MoE blocks."""
    cases = [_train("dense", "1F1B", pp=2, dp=2, n_microbatches=2),
             _train("moe", "Interleaved1F1B", pp=2, dp=2),
             _train("moe", "ZBVZeroBubble", pp=2, dp=2),
             _train("moe", "InterleavedZeroBubble", pp=2, dp=2, aux_loss=True),
             _train("moe", "DualPipeV", pp=2, dp=2),
             _train("moe", "1F1B", pp=2, dp=2, ep=True, n_microbatches=2),
             _train("moe", "ZBVZeroBubble", pp=2, dp=2, ep=True)]
    cases = _runnable_here(cases)
    check_results(pp_worker.launch(4, cases), cases)


def test_torch_before_2_13_refuses_the_pipelines_it_cannot_run(monkeypatch):
    """moeflow/parallel/torch_compat.py: on torch 2.11 these fail inside torch mid-step (seen there); 2.13 runs them."""
    from moeflow.parallel import torch_compat

    monkeypatch.setattr(torch_compat, "torch_minor", lambda: (2, 11))
    refusal = torch_compat.pipeline_refusal
    assert "send to itself that gloo refuses" in refusal("ZBVZeroBubble", True, "gloo", 0, False)
    assert refusal("ZBVZeroBubble", True, "nccl", 0, False) is None  # only gloo was seen failing
    assert "aux_loss_type = 'global_batch'" in refusal("1F1B", False, "gloo", 0, True)
    assert "model.mtp_depth = 1" in refusal("Interleaved1F1B", False, "nccl", 1, False)
    assert refusal("1F1B", False, "gloo", 0, False) is None
    monkeypatch.setattr(torch_compat, "torch_minor", lambda: (2, 13))
    assert refusal("ZBVZeroBubble", True, "gloo", 1, True) is None
