"""Fine-tuning on chat data through the real trainer: the loss is the mean over the trained tokens of the whole
global batch, so with uneven loss masks gradient accumulation 4 x 1 equals 1 x 4 and dp=2 equals one process
(losses and gradient norms, 1e-5); packed rows train the same under tp, pp and ep; a run resumed mid-epoch under
another layout continues on the uninterrupted run's batches; W&B (offline) gets metrics.jsonl's keys and a loss
curve lands beside summary.json.
"""

from __future__ import annotations

import json

import pytest

from moeflow.config import load_config, parse_overrides
from moeflow.train.trainer import train
from tests.parallel.layout_worker import launch
from tests.support.data_fixtures import conversations, make_chat_tokenizer, write_jsonl
from tests.support.model_helpers import metric

BASE = [
    "--model.name=tiny-moe", "--model.vocab_size=320", "--model.dim=32", "--model.n_layers=4", "--model.n_heads=4",
    "--model.n_kv_heads=2", "--model.ffn_dim=64", "--model.moe.ffn_dim=32", "--model.moe.num_experts=4",
    "--data.format=chat", "--data.seq_len=48", "--data.val_fraction=0.1", "--training.global_batch=4",
    "--training.warmup_steps=1", "--training.lr=3e-3", "--metrics.log_every=1", "--metrics.tensorboard=false",
    "--eval.every=2", "--eval.batches=1", "--checkpoint.every=2",
]
STEPS = 4


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tok = make_chat_tokenizer(root / "tok")
    data = write_jsonl(root / "chat.jsonl", conversations(80, seed=3))
    return [f"--data.source={data}", f"--data.tokenizer={tok}", f"--data.cache_dir={root / 'cache'}"]


def _cfg(run_dir, *extra):
    return load_config(None, {**parse_overrides([*BASE, *extra]), "run_dir": str(run_dir)})


def _same(run_dir, ref_dir, steps, what):
    for key in ("loss", "grad_norm"):
        got, want = metric(run_dir, key), metric(ref_dir, key)
        assert sorted(got) == list(steps), (what, key, sorted(got))
        for step in steps:
            assert got[step] == pytest.approx(want[step], rel=1e-5), (what, key, step, got[step], want[step])


@pytest.fixture(scope="module")
def reference(chat, tmp_path_factory):
    """One process, one micro-batch per step: packed and unpacked runs of STEPS steps, and a packed run that stops
    after step 2 (resumed by the layouts test)."""
    root = tmp_path_factory.mktemp("ref")
    for name, extra in (("rows", []), ("packed", ["--data.packing=true"]),
                        ("stopped", ["--data.packing=true", "--training.stop_at=2"])):
        train(_cfg(root / name, *chat, f"--training.steps={STEPS}", *extra), fresh=True, progress=False)
    return root


def test_uneven_masks_really_are_uneven(reference, chat):
    from moeflow.train.data_setup import build_data

    data = build_data(_cfg(reference / "x", *chat))
    counts = [int((data.train.gather([i]).targets != -100).sum()) for i in range(8)]
    assert len(set(counts)) > 4, counts  # rows train very different numbers of tokens
    assert (reference / "rows" / "loss.png").stat().st_size > 1000
    summary = json.loads((reference / "rows" / "summary.json").read_text())
    assert summary["loss_curve"].endswith("loss.png") and summary["data"]["records"] == 80


def test_accumulation_4x1_equals_1x4(reference, chat, tmp_path):
    train(_cfg(tmp_path / "acc", *chat, f"--training.steps={STEPS}", "--training.micro_batch=1"), fresh=True,
          progress=False)
    _same(tmp_path / "acc", reference / "rows", range(1, STEPS + 1), "4 x 1 micro-batches")
    assert metric(tmp_path / "acc", "val_loss") == pytest.approx(metric(reference / "rows", "val_loss"), rel=1e-5)


LAYOUTS = {  # name: (extra settings, reference run)
    "dp2-rows": (["--training.micro_batch=1"], "rows"),  # two ranks x two micro-batches, uneven everywhere
    "dp2-packed": (["--data.packing=true"], "packed"),
    "tp2-packed": (["--data.packing=true", "--parallel.tp=2"], "packed"),
    "pp2-packed": (["--data.packing=true", "--parallel.pp=2", "--parallel.pp_microbatches=2"], "packed"),
    "ep2-packed": (["--data.packing=true", "--parallel.ep=2"], "packed"),
}


@pytest.mark.parametrize("names", [["dp2-rows", "ep2-packed"],
                                   pytest.param(["dp2-packed", "tp2-packed", "pp2-packed"], marks=pytest.mark.slow)],
                         ids=["ci", "more"])
def test_layouts_and_resume_match_one_process(reference, chat, tmp_path, names):
    """dp=2 (unpacked and packed), tp=2, pp=2 and ep=2 on packed rows equal one process; and the run one process
    stopped after step 2 resumes under dp=2 on the uninterrupted run's batches (steps 3 and 4)."""
    import shutil

    resumed = tmp_path / "resumed"
    shutil.copytree(reference / "stopped", resumed)
    cases = [(name, [*BASE, *chat, f"--training.steps={STEPS}", *LAYOUTS[name][0]], str(tmp_path / name), False)
             for name in names]
    cases.append(("resume-dp2", [*BASE, *chat, f"--training.steps={STEPS}", "--data.packing=true"], str(resumed),
                  True))
    results = launch(2, cases)
    for name in names:
        assert results[name] == "ok", f"{name}:\n{results[name]}"
        _same(tmp_path / name, reference / LAYOUTS[name][1], range(1, STEPS + 1), name)
    assert results["resume-dp2"] == "ok", results["resume-dp2"]
    _same(resumed, reference / "packed", range(1, STEPS + 1), "resumed under dp=2")


def test_wandb_offline_gets_the_metrics_keys(chat, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged: list[dict] = []
    real_log = wandb.Run.log
    monkeypatch.setattr(wandb.Run, "log", lambda self, data, *a, **k: (logged.append(data), real_log(self, data,
                                                                                                       *a, **k))[1])
    run = tmp_path / "wb"
    train(_cfg(run, *chat, "--training.steps=2", "--metrics.wandb=true", "--checkpoint.enabled=false"), fresh=True,
          progress=False)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == len(lines) == 2
    for line, sent in zip(lines, logged):
        flat = {k for k, v in line.items() if k not in ("step", "moe") and not isinstance(v, dict)}
        flat |= {f"{k}/{sub}" for k, v in line.items() if k != "moe" and isinstance(v, dict) for sub in v}
        flat |= {f"moe/{layer}/{k}" for layer, stats in line.get("moe", {}).items() for k in stats
                 if not isinstance(stats[k], list)}
        assert flat <= set(sent), flat - set(sent)
        assert sent["loss"] == line["loss"]
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    blob = files[0].read_bytes()
    assert all(key.encode() in blob for key in ("loss", "grad_norm", "tokens_per_s", "moe/1/max_over_mean"))
