"""Bad parallel layouts are refused before any process starts: one line naming the setting, the value
and a fix, exit status 2, no traceback (docs/design.md, principle 3)."""

import pytest

from tests.conftest import run_cli

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


@pytest.mark.parametrize("overrides,nproc,words", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_layout_is_one_line_before_launch(overrides, nproc, words, tmp_path):
    out = run_cli(["train", "--nproc-per-node", str(nproc), f"--run-dir={tmp_path}", "--training.steps=1",
                   "--no-progress", *overrides], timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "torch.distributed.run" not in out.stderr
    for word in words:
        assert word in out.stderr, (word, out.stderr)
    assert not (tmp_path / "metrics.jsonl").exists()
