"""Megatron indexed datasets (`data.source = PREFIX`): the files in tests/data/megatron/ were written by
megatron-core's IndexedDatasetBuilder and expected.json holds what megatron-core's own IndexedDataset reads from
them (tests/support/make_megatron_fixture.py); moeflow's reader gives the same tokens and document boundaries, a
run on the prefix trains as on the same tokens given as a raw .bin, packing reads whole documents, and every broken
file is one line naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moeflow.config import load_config
from moeflow.data import megatron
from moeflow.train.data_setup import build_data
from moeflow.train.trainer import train

FIXTURES = Path(__file__).parent / "megatron"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


@pytest.mark.parametrize("name", ["small_uint16", "small_int32"])
def test_the_reader_sees_what_megatron_core_reads(name):
    want = EXPECTED[name]
    tokens, index = megatron.load(FIXTURES / name, vocab_size=96)
    assert index.dtype.name == want["dtype"] and tokens.dtype.name == want["dtype"]
    assert index.sequence_lengths.tolist() == want["sequence_lengths"]
    assert index.document_indices.tolist() == want["document_indices"]
    assert tokens.tolist() == [t for seq in want["sequences"] for t in seq]
    offsets = index.document_offsets()
    docs = want["document_indices"]
    for d in range(len(docs) - 1):  # each document is its sequences, in order
        doc = [t for seq in want["sequences"][docs[d]:docs[d + 1]] for t in seq]
        assert tokens[offsets[d]:offsets[d + 1]].tolist() == doc


@pytest.mark.parametrize("spelling", ["{p}", "{p}.idx", "{p}.bin"])
def test_every_spelling_of_the_prefix_names_the_dataset(spelling, tmp_path):
    prefix = FIXTURES / "small_uint16"
    assert megatron.megatron_prefix(spelling.format(p=prefix)) == prefix
    raw = tmp_path / "tokens.bin"  # a .bin without an .idx beside it stays a raw token stream
    shutil.copy(FIXTURES / "small_uint16.bin", raw)
    assert megatron.megatron_prefix(str(raw)) is None


def _overrides(source, run_dir, **more) -> dict:
    return {"model.vocab_size": 96, "data.source": str(source), "data.seq_len": 16, "training.global_batch": 4,
            "training.steps": 4, "eval.every": 0, "metrics.tensorboard": False, "metrics.log_every": 1,
            "checkpoint.enabled": False, "run_dir": str(run_dir), "data.val_fraction": 0.1, **more}


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_on_the_prefix_trains_as_on_the_same_tokens_raw(tmp_path):
    raw = tmp_path / "raw.bin"
    shutil.copy(FIXTURES / "small_uint16.bin", raw)
    train(load_config(None, _overrides(FIXTURES / "small_uint16", tmp_path / "megatron")), progress=False)
    train(load_config(None, _overrides(raw, tmp_path / "raw", **{"data.token_dtype": "uint16"})), progress=False)
    assert _losses(tmp_path / "megatron") == _losses(tmp_path / "raw")


def test_packing_reads_whole_documents(tmp_path):
    cfg = load_config(None, _overrides(FIXTURES / "small_uint16", tmp_path, **{"data.packing": True}))
    data = build_data(cfg)
    assert data.summary["format"] == "megatron" and data.summary["records"] == 40
    batch = data.sampler(cfg, 0, 1).next_batch()
    docs = EXPECTED["small_uint16"]["document_indices"]
    seqs = EXPECTED["small_uint16"]["sequences"]
    whole = [[t for s in seqs[docs[d]:docs[d + 1]] for t in s] for d in range(len(docs) - 1)]
    row, ids = batch.inputs[0].tolist(), batch.document_ids[0].tolist()
    for doc_id in sorted(set(ids) - {-1}):  # every document in the row is one of Megatron's, whole or truncated
        piece = [t for t, i in zip(row, ids) if i == doc_id]
        assert any(d[:len(piece)] == piece for d in whole)


def _broken(tmp_path, name="d") -> Path:
    for suffix in (".bin", ".idx"):
        shutil.copy(FIXTURES / f"small_uint16{suffix}", tmp_path / f"{name}{suffix}")
    return tmp_path / name


@pytest.mark.parametrize("damage, message", [
    (lambda p: Path(f"{p}.bin").unlink(), r"d.idx has no d.bin beside it"),
    (lambda p: shutil.copy(FIXTURES / "small_int32.idx", f"{p}.idx"),
     r"d.bin has 2942 bytes, but d.idx describes .* tokens of int32 .* written for another .bin or another dtype"),
    (lambda p: Path(f"{p}.idx").write_bytes(Path(f"{p}.idx").read_bytes()[:100]), r"the file was cut short"),
    (lambda p: Path(f"{p}.idx").write_bytes(b"NOTANIDX" + Path(f"{p}.idx").read_bytes()[8:]),
     r"does not start with Megatron's index header"),
])
def test_broken_datasets_are_one_line_naming_the_file(tmp_path, damage, message):
    prefix = _broken(tmp_path)
    damage(prefix)
    with pytest.raises(ValueError, match=message) as e:
        build_data(load_config(None, _overrides(prefix, tmp_path / "run")))
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def test_ids_over_the_vocabulary_and_a_chat_format_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"small_uint16.bin holds token id 95, outside model.vocab_size = 64"):
        build_data(load_config(None, _overrides(FIXTURES / "small_uint16", tmp_path, **{"model.vocab_size": 64})))
    with pytest.raises(ValueError, match=r"data.format = 'chat' with the Megatron dataset .*: its documents are "
                                         r"token ids already"):
        build_data(load_config(None, _overrides(FIXTURES / "small_uint16", tmp_path, **{"data.format": "chat"})))
