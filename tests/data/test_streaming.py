"""data.streaming: the windows are the up-front cache's tokens in stream order (epoch after epoch, the validation
windows held out), tokenizing in worker processes gives the same tokens as in the rank, a resume onto another
data-parallel size continues the rows without reading the records before its position, a streamed run trains
and resumes exactly, and bad settings are one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moeflow.config import load_config
from moeflow.data import streaming
from moeflow.data.records import resolve
from moeflow.data.streaming import StreamingSampler
from moeflow.data.token_cache import TextEncoder, open_cache, write_cache
from moeflow.data.tokenizer import ByteTokenizer
from moeflow.train.trainer import train

SEQ, BATCH, HELD_OUT = 16, 4, 8


def _records(folder, n=700):
    """Records of 1 to 60 characters (several per window, a few spanning two), over two jsonl files."""
    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": "".join(rng.choice(list("abcdefgh "), rng.integers(1, 60)))}) for _ in range(n)]
    folder.mkdir()
    (folder / "a.jsonl").write_text("\n".join(lines[:n // 3]) + "\n")
    (folder / "b.jsonl").write_text("\n".join(lines[n // 3:]) + "\n")
    return folder


def _sampler(src, workers=0, dp_rank=0, dp_size=1, opened=None):
    encoder = TextEncoder(ByteTokenizer())

    def open_documents(first):
        if opened is not None:
            opened.append(first)
        return streaming.documents(src, encoder, first, workers=workers, max_bytes=0)

    return StreamingSampler(open_documents, "k", SEQ, BATCH, dp_rank, dp_size, held_out=HELD_OUT, vocab_size=256)


def test_the_windows_are_the_caches_tokens_in_order_epoch_after_epoch(tmp_path):
    src = resolve(str(_records(tmp_path / "data")))
    tokens = np.asarray(open_cache(write_cache(src, TextEncoder(ByteTokenizer()), tmp_path / "cache")).tokens)
    first = HELD_OUT * SEQ + 1  # the validation windows and the token after them
    per_epoch = (len(tokens) - first - 1) // SEQ
    want = [tokens[first + j * SEQ:first + j * SEQ + SEQ + 1] for j in range(per_epoch)]
    sampler = _sampler(src)
    steps = 2 * per_epoch // BATCH + 3  # past two epoch ends
    got = []
    for _ in range(steps):
        b = sampler.next_batch()
        got += list(torch.cat([b.inputs, b.targets[:, -1:]], dim=1).numpy())
    assert sampler.epoch == 2
    for i, row in enumerate(got):
        np.testing.assert_array_equal(row, want[i % per_epoch], err_msg=f"window {i}")
    np.testing.assert_array_equal(sampler.held_out_tokens(), tokens[:first])


def test_worker_processes_tokenize_the_same_documents(tmp_path):
    for source in (_records(tmp_path / "data"), _text_folder(tmp_path / "texts")):
        src, encoder = resolve(str(source)), TextEncoder(ByteTokenizer())
        here = list(streaming.documents(src, encoder, 0, workers=0, max_bytes=0))
        workers = list(streaming.documents(src, encoder, 0, workers=2, max_bytes=0))
        assert [r for r, _ in here] == [r for r, _ in workers] == list(range(len(here)))
        assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(here, workers))
        later = list(streaming.documents(src, encoder, 5, workers=0, max_bytes=0))  # from record 5 on
        assert [r for r, _ in later] == list(range(5, len(here)))
        assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(here[5:], later))


def _text_folder(folder):
    folder.mkdir()
    for i in range(7):
        (folder / f"{i}.txt").write_text(f"document {i} " * (i + 1))
    return folder


def test_a_resume_onto_two_ranks_continues_the_rows_from_its_record(tmp_path):
    src = resolve(str(_records(tmp_path / "data")))
    straight = _sampler(src)
    want = [straight.next_batch() for _ in range(12)][6:]
    first = _sampler(src)
    for _ in range(6):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps: plain values
    assert state["record"] > 0 and state["offset"] >= 0
    opened = [[], []]
    ranks = [_sampler(src, dp_rank=r, dp_size=2, opened=opened[r]) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    assert opened[0][-1] == state["record"]  # reading resumes at its record: the ones before are skipped
    for w in want:
        halves = [r.next_batch() for r in ranks]
        assert torch.equal(torch.cat([h.inputs for h in halves]), w.inputs)
        assert torch.equal(torch.cat([h.targets for h in halves]), w.targets)
    with pytest.raises(ValueError, match=r"cannot resume the streamed data: data.seq_len was 16 .* but is 8"):
        StreamingSampler(ranks[0].open_documents, "k", 8, BATCH, held_out=HELD_OUT).load_state_dict(state)


def _overrides(run_dir, data, **more) -> dict:
    return {"model.vocab_size": 256, "data.source": str(data), "data.streaming": True, "data.tokenizer": "byte",
            "data.seq_len": SEQ, "training.global_batch": BATCH, "training.steps": 6, "eval.every": 3,
            "eval.batches": 2, "metrics.tensorboard": False, "metrics.log_every": 1, "checkpoint.every": 3,
            "run_dir": str(run_dir), **more}


def test_a_streamed_run_trains_and_resumes_exactly(tmp_path):
    data = _records(tmp_path / "data")
    summary = train(load_config(None, _overrides(tmp_path / "straight", data)), progress=False)
    assert summary["data"]["streaming"] and summary["data"]["epoch"] == 0 and summary["data"]["next_record"] > 0
    train(load_config(None, _overrides(tmp_path / "split", data, **{"training.stop_at": 3})), progress=False)
    train(load_config(None, _overrides(tmp_path / "split", data)), resume=True, progress=False)
    rows = lambda run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows("split")] == [r["loss"] for r in rows("straight")]
    assert [r.get("val_loss") for r in rows("split")] == [r.get("val_loss") for r in rows("straight")]


@pytest.mark.parametrize("more, message", [
    ({"data.packing": True}, r"data.streaming = true with data.packing = true: streaming reads a token stream"),
    ({"data.format": "chat"}, r"data.streaming = true with data.format = 'chat'"),
    ({"data.blend": "1 a 1 b"}, r"data.streaming = true with data.blend is not supported yet"),
    ({"data.source": "tests/data/megatron/small_uint16"}, r"it is tokenized already and read in place"),
    ({"data.source": "nowhere.jsonl"}, r"data.source = 'nowhere.jsonl': no such file or folder"),
])
def test_bad_streaming_settings_are_one_line(tmp_path, more, message):
    data = _records(tmp_path / "data")
    with pytest.raises(ValueError, match=message):
        load_config(None, _overrides(tmp_path / "run", data, **more))


def test_token_ids_over_the_vocabulary_name_the_record(tmp_path):
    src = resolve(str(_records(tmp_path / "data")))
    encoder = TextEncoder(ByteTokenizer())
    with pytest.raises(ValueError, match=r"data.streaming: record 0 holds token id 1\d\d but model.vocab_size is 50"):
        StreamingSampler(lambda first: streaming.documents(src, encoder, first, workers=0, max_bytes=0), "k", SEQ,
                         BATCH, vocab_size=50)
