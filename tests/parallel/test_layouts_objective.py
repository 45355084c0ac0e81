"""DeepSeek-V3's and Qwen3's training objective under parallel layouts: with the sequence-wise or the global-batch
balance loss and multi-token prediction, every layout trains the same three steps as one process (losses, MTP
losses and gradient norms to 1e-5 relative), in one launch of 4 gloo ranks. The micro-batch balance loss, by
contrast, changes with the layout (each rank balances its own tokens), which is why these two exist.
"""

from __future__ import annotations

import pytest

from moeflow.config import load_config, parse_overrides
from moeflow.train.trainer import train
from tests.parallel.layout_worker import BASE, launch
from tests.support.cli import refused_on_old_torch
from tests.support.model_helpers import metric

MTP = ["--model.mtp_depth=1", "--model.mtp_loss_coef=0.3"]
OBJECTIVES = {
    "global-mtp": ["--model.moe.aux_loss_coef=0.1", "--model.moe.aux_loss_type=global_batch", *MTP],
    "sequence-mtp": ["--model.moe.aux_loss_coef=0.1", "--model.moe.aux_loss_type=sequence", *MTP],
    "global": ["--model.moe.aux_loss_coef=0.1", "--model.moe.aux_loss_type=global_batch"],  # tp takes no MTP
    # the first pipeline stage (layers 0-1 of 4) holds no MoE layer, yet runs the counting pass its peer runs
    "global-dense-first": ["--model.moe.aux_loss_coef=0.1", "--model.moe.aux_loss_type=global_batch",
                           "--model.moe.first_k_dense=2"],
}
# (objective, layout): ep=2 x dp=2 (ep borrows 2 of the 4 data-parallel ranks), pp=2 x dp=2, ep=2 x pp=2 (the
# MTP block's experts under EP on the last stage), tp=2 x dp=2, cp=2 x dp=2 with ep=2
CASES = {
    "global-mtp ep2": ("global-mtp", ["--parallel.ep=2"]),
    "global-mtp pp2-dp2": ("global-mtp", ["--parallel.pp=2"]),
    "sequence-mtp ep2": ("sequence-mtp", ["--parallel.ep=2"]),
    "sequence-mtp ep2-pp2": ("sequence-mtp", ["--parallel.ep=2", "--parallel.pp=2"]),
    "global tp2-dp2": ("global", ["--parallel.tp=2"]),  # the MoE folded over tp: tp ranks route their own tokens
    "global cp2-ep2-dp2": ("global", ["--parallel.cp=2", "--parallel.ep=2"]),  # cp ranks route their chunks
    "global-dense-first pp2-dp2": ("global-dense-first", ["--parallel.pp=2"]),
}


def _cfg(run_dir, *extra):
    return load_config(None, {**parse_overrides([*BASE, *extra]), "run_dir": str(run_dir)})


KEYS = {"global-mtp": ("loss", "grad_norm", "mtp_loss"), "sequence-mtp": ("loss", "grad_norm", "mtp_loss"),
        "global": ("loss", "grad_norm"), "global-dense-first": ("loss", "grad_norm")}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    out = {}
    for name, extra in OBJECTIVES.items():
        train(_cfg(root / name, *extra), fresh=True, progress=False)
        out[name] = {key: metric(root / name, key) for key in KEYS[name]}
    # gradient accumulation in one process: the global-batch loss takes its counting pass
    train(_cfg(root / "accumulated", *OBJECTIVES["global-mtp"], "--training.micro_batch=2"), fresh=True,
          progress=False)
    out["accumulated"] = {key: metric(root / "accumulated", key) for key in KEYS["global-mtp"]}
    return out


def _assert_same(got: dict, want: dict, what: str) -> None:
    for key, by_step in want.items():
        assert sorted(got[key]) == sorted(by_step) == [1, 2, 3], (what, key)
        for step, value in by_step.items():
            assert got[key][step] == pytest.approx(value, rel=1e-5), (what, key, step)


@pytest.mark.slow  # 32 s: make test runs it, CI does not
def test_objective_layouts_match_one_process(one_process, tmp_path):
    _assert_same(one_process["accumulated"], one_process["global-mtp"], "micro_batch=2")
    picked = {name: case for name, case in CASES.items()
              if not refused_on_old_torch([*BASE, *OBJECTIVES[case[0]], *case[1]])}
    cases = [(name, [*BASE, *OBJECTIVES[objective], *layout], str(tmp_path / name.replace(" ", "_")), False)
             for name, (objective, layout) in picked.items()]
    results = launch(4, cases)
    for name, (objective, _) in picked.items():
        assert results[name] == "ok", f"{name}:\n{results[name]}"
        run = tmp_path / name.replace(" ", "_")
        _assert_same({key: metric(run, key) for key in KEYS[objective]}, one_process[objective], name)
