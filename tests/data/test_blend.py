"""data.blend: the trained sequences follow the weights by a fixed schedule (within one sequence at every step, so
within 1% over 200 steps), each source shuffles and wraps on its own, a resume (also onto another data-parallel
size) continues the uninterrupted run's rows, a run reports what it trained from each source, and bad weights are
one line before any rank."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moeflow.config import load_config
from moeflow.data.blend import BlendSampler, BlendSource
from moeflow.train.trainer import train

SEQ = 8


def _sources(weights=(0.5, 0.3, 0.2), sizes=(400, 200, 5)) -> list[BlendSource]:
    """Token streams whose ids say which source and window they came from (source k: ids k * 100,000 + ...)."""
    total = sum(weights)
    return [BlendSource(f"s{k}", w / total, np.arange(n * SEQ + 1, dtype=np.int64) + 100_000 * k)
            for k, (w, n) in enumerate(zip(weights, sizes))]


def _source_of(batch) -> list[int]:
    return (batch.inputs[:, 0] // 100_000).tolist()


def test_the_sequences_follow_the_weights_at_every_step():
    sampler = BlendSampler(_sources(), SEQ, global_batch=8, seed=3)
    counts = np.zeros(3)
    for step in range(1, 201):
        for k in _source_of(sampler.next_batch()):
            counts[k] += 1
        assert np.all(np.abs(counts - sampler.weights * 8 * step) <= 1.0 + 1e-9), (step, counts)
    fractions = counts / counts.sum()
    np.testing.assert_allclose(fractions, sampler.weights, atol=0.01)
    trained = np.array(sampler.trained, dtype=float)
    np.testing.assert_allclose(trained / trained.sum(), sampler.weights, atol=0.01)


def test_each_source_wraps_its_epochs_on_its_own():
    """The 5-window source is drawn 320 times in 200 steps: every 5 consecutive draws are its 5 windows."""
    sampler = BlendSampler(_sources(), SEQ, global_batch=8, seed=3)
    small = []
    for _ in range(200):
        batch = sampler.next_batch()
        small += [int(r[0]) - 200_000 for r in batch.inputs if int(r[0]) // 100_000 == 2]
    windows = [w // SEQ for w in small]
    assert len(windows) == 320
    for e in range(0, 320, 5):
        assert sorted(windows[e:e + 5]) == list(range(5))


def test_a_resume_onto_another_data_parallel_size_continues_the_rows():
    straight = BlendSampler(_sources(), SEQ, global_batch=8, seed=1)
    want = [straight.next_batch() for _ in range(10)][5:]
    first = BlendSampler(_sources(), SEQ, global_batch=8, seed=1)
    for _ in range(5):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps: plain values
    ranks = [BlendSampler(_sources(), SEQ, global_batch=8, dp_rank=r, dp_size=2, seed=1) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    for w in want:
        halves = [r.next_batch() for r in ranks]
        assert torch.equal(torch.cat([h.inputs for h in halves]), w.inputs)
        assert halves[0].global_tokens == w.global_tokens
    assert ranks[0].trained == straight.trained
    with pytest.raises(ValueError, match=r"the checkpoint's blend was .* but this run's is"):
        BlendSampler(_sources(weights=(0.4, 0.4, 0.2)), SEQ, 8, seed=1).load_state_dict(state)


def _overrides(run_dir, **more) -> dict:
    fixtures = Path(__file__).parent / "megatron"
    return {"model.vocab_size": 256, "data.blend": f"3 {fixtures / 'small_uint16'} 1 stdlib", "data.seq_len": 16,
            "data.max_bytes": 100_000, "data.tokenizer": "byte", "training.global_batch": 4, "training.steps": 6,
            "eval.every": 0, "metrics.tensorboard": False, "metrics.log_every": 1, "checkpoint.every": 3,
            "run_dir": str(run_dir), **more}


def test_a_blended_run_counts_each_source_and_resumes_exactly(tmp_path):
    summary = train(load_config(None, _overrides(tmp_path / "straight")), progress=False)
    sources = summary["data"]["sources"]
    assert [s["weight"] for s in sources] == [0.75, 0.25]
    expected = json.loads((Path(__file__).parent / "megatron" / "expected.json").read_text())["small_uint16"]
    assert sources[0]["documents"] == len(expected["document_indices"]) - 1  # what megatron-core's reader counts
    assert sum(s["trained_tokens"] for s in sources) == 6 * 4 * 16
    assert sources[0]["trained_tokens"] == 3 * sources[1]["trained_tokens"]  # 18 and 6 sequences of 16
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert sum(rows[-1]["data_tokens"].values()) == 6 * 4 * 16
    train(load_config(None, _overrides(tmp_path / "split", **{"training.stop_at": 3})), progress=False)
    resumed = train(load_config(None, _overrides(tmp_path / "split")), resume=True, progress=False)
    split = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in split] == [r["loss"] for r in rows]
    assert resumed["data"]["sources"] == sources


@pytest.mark.parametrize("blend, message", [
    ("0.7 a 0 b", r"data.blend = '0.7 a 0 b': the weight of 'b' is 0; every weight must be positive"),
    ("0.7 a -1 b", r"the weight of 'b' is -1"),
    ("0.7 a b", r"give pairs of a weight and a source"),
    ("x a 1 b", r"'x' is not a weight"),
])
def test_bad_weights_are_one_line(tmp_path, blend, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, _overrides(tmp_path, **{"data.blend": blend}))


def test_two_ranks_train_the_one_process_blend_and_skip_a_too_small_validation_batch(tmp_path):
    """ep=2 on 2 ranks: the one-process blended losses; the Megatron source's validation split is one sequence,
    fewer than the 2 data-parallel ranks, so that batch is dropped (a rank without rows would fail) and the
    validation loss is the other source's."""
    from tests.parallel.layout_worker import launch

    more = {"data.seq_len": 64, "eval.every": 3}
    train(load_config(None, _overrides(tmp_path / "one", **more)), progress=False)
    argv = [f"--{k}={v}" for k, v in _overrides(tmp_path / "ep2", **more, **{"parallel.ep": 2}).items()]
    assert launch(2, [("ep2", argv, str(tmp_path / "ep2"), False)]) == {"ep2": "ok"}
    rows = {run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("one", "ep2")}
    np.testing.assert_allclose([r["loss"] for r in rows["ep2"]], [r["loss"] for r in rows["one"]], rtol=1e-5)
    assert rows["ep2"][-1]["val_loss"] > 0 and rows["ep2"][-1]["data_tokens"] == rows["one"][-1]["data_tokens"]


@pytest.mark.slow  # 2 then 4 ranks (~35 s): make test runs it, CI the 2-rank run above and the sampler's resume
def test_a_blend_stopped_on_two_ranks_resumes_on_four_under_ep2(tmp_path):
    """Steps 1-3 under dp=2 on 2 ranks, 4-6 under ep=2 x dp=4 on 4 ranks: the one-process run's losses."""
    from tests.parallel.layout_worker import launch

    train(load_config(None, _overrides(tmp_path / "one")), progress=False)
    split = str(tmp_path / "split")
    argv = lambda **more: [f"--{k}={v}" for k, v in _overrides(split, **more).items()]
    assert launch(2, [("dp2", argv(**{"training.stop_at": 3}), split, False)]) == {"dp2": "ok"}
    assert launch(4, [("ep2-dp4", argv(**{"parallel.ep": 2}), split, True)]) == {"ep2-dp4": "ok"}
    rows = {run: [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("one", "split")}
    assert [r["step"] for r in rows["split"]] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in rows["split"]], [r["loss"] for r in rows["one"]], rtol=1e-5)
    assert rows["split"][-1]["data_tokens"] == rows["one"][-1]["data_tokens"]


def test_a_toml_list_of_tables_gives_each_source_its_own_settings(tmp_path):
    """[[data.blend]] tables: the uint32 file read with its own token_dtype trains exactly what the string form
    trains from the same tokens stored as uint16 (the run's token_dtype); the tables survive config.toml."""
    fixtures = Path(__file__).parent / "megatron"
    tokens = np.random.default_rng(0).integers(0, 256, 3000)
    tokens.astype(np.uint16).tofile(tmp_path / "narrow.bin")
    tokens.astype(np.uint32).tofile(tmp_path / "wide.bin")
    (tmp_path / "job.toml").write_text(f"""
[[data.blend]]
weight = 3
source = "{fixtures / 'small_uint16'}"

[[data.blend]]
weight = 1
source = "{tmp_path / 'wide.bin'}"
token_dtype = "uint32"
""")
    more = _overrides(tmp_path / "tables")
    del more["data.blend"]
    cfg = load_config(tmp_path / "job.toml", more)
    assert load_config(None, {"data.blend": "1 a"}).data.blend == "1 a"
    tables = train(cfg, progress=False)
    assert load_config(tmp_path / "tables" / "config.toml").data.blend == cfg.data.blend  # written back, reread
    string = train(load_config(None, _overrides(tmp_path / "string", **{
        "data.blend": f"3 {fixtures / 'small_uint16'} 1 {tmp_path / 'narrow.bin'}"})), progress=False)
    losses = lambda run: [json.loads(r)["loss"] for r in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert losses("tables") == losses("string")
    assert [s["trained_tokens"] for s in tables["data"]["sources"]] == [
        s["trained_tokens"] for s in string["data"]["sources"]]


@pytest.mark.parametrize("table, message", [
    ({"weight": 1}, r"data.blend\[0\] = .*: each \[\[data.blend\]\] table needs weight = NUMBER and source"),
    ({"weight": "x", "source": "a"}, r"data.blend\[0\]: weight = 'x' is not a number"),
    ({"weight": 0, "source": "a"}, r"data.blend\[0\]: the weight of 'a' is 0; every weight must be positive"),
    ({"weight": 1, "source": "a", "fromat": "chat"}, r"'fromat' is not a setting a source of a blend takes. "
                                                    r"Did you mean 'format'\?"),
    ({"weight": 1, "source": "a", "format": "chatt"}, r"data.blend\[0\].format"),
    ({"weight": 1, "source": "a", "val_fraction": 2}, r"data.blend\[0\].val_fraction must be in \(0, 1\), got 2"),
])
def test_bad_tables_are_one_line(tmp_path, table, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, _overrides(tmp_path, **{"data.blend": [table]}))
