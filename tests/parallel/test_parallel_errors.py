"""Bad parallel layouts are refused before any process starts: one line naming the setting, the value
and a fix, exit status 2, no traceback (docs/design.md, principle 3)."""

import pytest

from moeflow.cli import main
from tests.support.cli import run_cli

BAD = [
    # (overrides, nproc, words the message must contain)
    (["--parallel.tp=2", "--parallel.pp=2"], 2, ["= 4 does not divide the world size (2)"]),
    (["--parallel.tp=3", "--parallel.ep_over_tp=false"], 3, ["parallel.tp (3) must divide"]),
    (["--parallel.tp=3"], 3, ["parallel.ep x tp = 1 x 3 = 3", "--parallel.ep_over_tp=false"]),
    (["--parallel.ep=3"], 3, ["parallel.ep (3) must divide model.moe.num_experts (8)"]),
    (["--parallel.ep=4"], 2, ["parallel.ep (4) must divide the data-parallel shard size"]),
    (["--parallel.pp=2", "--model.n_layers=1"], 2, ["parallel.pp (2) is larger than model.n_layers (1)"]),
    (["--parallel.pp=2", "--parallel.pp_schedule=Zigzag"], 2, ["Zigzag", "1F1B", "GPipe"]),
    (["--parallel.pp=2", "--parallel.pp_microbatches=3"], 2, ["micro-batches (3) must divide"]),
    (["--parallel.zero=4"], 2, ["parallel.zero = 4", "use 1"]),
    (["--parallel.tp=2", "--model.name=deepseek-v3"], 2, ["not supported with parallel.tp > 1"]),
    (["--parallel.cp=2", "--data.seq_len=18"], 2, ["data.seq_len (18) must be divisible by 2 x parallel.cp (= 4)"]),
    (["--parallel.cp=2", "--parallel.ep=4"], 2, ["parallel.ep (4) must divide", "(dp_shard x cp = 1 x 2 = 2)"]),
]


def _assert_refused(returncode, stderr, words, run_dir):
    assert returncode == 2, stderr[-2000:]
    assert "Traceback" not in stderr and "torch.distributed.run" not in stderr
    for word in words:
        assert word in stderr, (word, stderr)
    assert not (run_dir / "metrics.jsonl").exists()


def _train_args(overrides, nproc, run_dir):
    return ["train", "--nproc-per-node", str(nproc), f"--run-dir={run_dir}", "--training.steps=1", "--no-progress",
            *overrides]


def test_the_command_line_exits_2_with_one_line(tmp_path):
    """Through a real `python -m moeflow` process: its exit status and stderr (the cases below run in-process)."""
    overrides, nproc, words = BAD[0]
    out = run_cli(_train_args(overrides, nproc, tmp_path), timeout=120)
    _assert_refused(out.returncode, out.stderr, words, tmp_path)


@pytest.mark.parametrize("overrides,nproc,words", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_layout_is_one_line_before_launch(overrides, nproc, words, tmp_path, capsys):
    # In this process: the refusal comes before any launch, and each subprocess would cost a torch import (~2 s).
    # A check that let the layout through would launch `nproc` ranks and write metrics.jsonl.
    returncode = main(_train_args(overrides, nproc, tmp_path))
    _assert_refused(returncode, capsys.readouterr().err, words, tmp_path)


def test_what_torch_2_11_cannot_run_is_one_line_before_launch(tmp_path, capsys, monkeypatch):
    """moeflow/parallel/torch_compat.py's refusals (each rank would raise them) are said once, before any process."""
    from moeflow.parallel import torch_compat

    monkeypatch.setattr(torch_compat, "torch_minor", lambda: (2, 11))
    flags = ["--parallel.pp=2", "--parallel.pp_schedule=ZBVZeroBubble", "--training.device=cpu"]
    returncode = main(_train_args(flags, 2, tmp_path))
    _assert_refused(returncode, capsys.readouterr().err, ["'ZBVZeroBubble'", "gloo refuses", "torch 2.13"], tmp_path)
    flags = ["--parallel.pp=2", "--model.mtp_depth=1", "--training.device=cpu"]
    returncode = main(_train_args(flags, 2, tmp_path))
    _assert_refused(returncode, capsys.readouterr().err, ["model.mtp_depth = 1 under parallel.pp > 1"], tmp_path)
