"""Records through Hugging Face datasets into the token cache: assistant masks against transformers, every file
format alike, the cache written once and keyed by the tokenizer, first-fit packing against a brute force, packed
rows that reproduce every document, and one line for each kind of bad input (nothing written half)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from moeflow.config import load_config, parse_overrides  # noqa: E402
from moeflow.data.chat import encode_chat, instruction_to_messages  # noqa: E402
from moeflow.data.packing import DocumentRows, first_fit  # noqa: E402
from moeflow.data.token_cache import open_cache  # noqa: E402
from moeflow.train.data_setup import build_data, prepare  # noqa: E402
from tests.support.data_fixtures import conversations, make_chat_tokenizer, sentence, write_jsonl  # noqa: E402

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


def _cfg(tmp_path, source, *extra, tok=None):
    args = [f"--data.source={source}", "--data.seq_len=64", "--model.vocab_size=320",
            f"--data.cache_dir={tmp_path / 'cache'}", *([f"--data.tokenizer={tok}"] if tok else []), *extra]
    return load_config(None, {**parse_overrides(args), "run_dir": str(tmp_path / "run")})


# ---------------------------------------------------------------------------------------------- masks


def test_assistant_masks_equal_transformers(hf_tok):
    records = conversations(40, seed=1)
    records.append({"messages": [{"role": "user", "content": "déjà vu"}, {"role": "assistant", "content": "naïve café"},
                                 {"role": "user", "content": ""}, {"role": "assistant", "content": ""}]})
    for r in records:
        want = hf_tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        ids, mask = encode_chat(hf_tok, r["messages"])
        assert ids == list(want["input_ids"])
        assert mask == list(want["assistant_masks"])
        assert 0 < sum(mask) < len(mask)


def test_instruction_records_map_onto_chat(hf_tok):
    record = {"instruction": "add the numbers", "input": "2 3", "output": "5", "system": "be brief"}
    messages = instruction_to_messages(record)
    assert messages == [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "add the numbers\n\n2 3"}, {"role": "assistant", "content": "5"}]
    want = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert encode_chat(hf_tok, messages) == (list(want["input_ids"]), list(want["assistant_masks"]))
    assert instruction_to_messages({"instruction": "x", "output": "y"})[0] == {"role": "user", "content": "x"}


# ---------------------------------------------------------------------------------------------- sources, cache


def test_every_format_gives_the_same_tokens(tmp_path, tok_dir):
    import datasets

    records = conversations(12, seed=2)
    texts = [{"text": sentence(random.Random(i), 3, 20)} for i in range(12)]
    write_jsonl(tmp_path / "chat.jsonl", records)
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "chat.parquet"))
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "arrow").mkdir()
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    (tmp_path / "arrow" / "part.arrow").write_bytes(arrow.read_bytes())
    (tmp_path / "shards").mkdir()
    write_jsonl(tmp_path / "shards" / "a.jsonl", records[:5])
    write_jsonl(tmp_path / "shards" / "b.jsonl", records[5:])
    write_jsonl(tmp_path / "text.jsonl", texts)
    datasets.Dataset.from_list(texts).to_csv(str(tmp_path / "text.csv"), index=False)

    def tokens(source, fmt):
        cache = open_cache(prepare(_cfg(tmp_path, source, f"--data.format={fmt}", tok=tok_dir)))
        return cache.tokens.tolist(), None if cache.trained is None else cache.trained.tolist(), cache

    want = tokens(tmp_path / "chat.jsonl", "chat")
    for source in ("chat.parquet", "saved", "arrow", "shards"):
        got = tokens(tmp_path / source, "chat")
        assert got[:2] == want[:2], source
    # the reference: each conversation tokenized alone, back to back
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    assert want[0] == [t for r in records for t in encode_chat(hf_tok, r["messages"])[0]]
    assert want[2].locate(7) == f"{tmp_path / 'chat.jsonl'} line 8"
    alpaca = [{"instruction": sentence(random.Random(i)), "input": "" if i % 2 else "2 3", "output": "5"}
              for i in range(6)]
    write_jsonl(tmp_path / "alpaca.jsonl", alpaca)
    assert tokens(tmp_path / "alpaca.jsonl", "instruction")[0] == [
        t for r in alpaca for t in encode_chat(hf_tok, instruction_to_messages(r))[0]]
    text = tokens(tmp_path / "text.jsonl", "text")
    assert tokens(tmp_path / "text.csv", "text")[0] == text[0] and text[1] is None
    eos = hf_tok.convert_tokens_to_ids("<|endoftext|>")  # the first of moeflow's end-of-document names it has
    assert text[0] == [t for r in texts for t in hf_tok(r["text"], add_special_tokens=False)["input_ids"] + [eos]]


def test_cache_written_once_keyed_by_tokenizer_and_memory_mapped(tmp_path, tok_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", conversations(10))
    first = prepare(_cfg(tmp_path, data, "--data.format=chat", tok=tok_dir))
    stamp = (first / "tokens.bin").stat().st_mtime_ns
    assert prepare(_cfg(tmp_path, data, "--data.format=chat", tok=tok_dir)) == first
    assert (first / "tokens.bin").stat().st_mtime_ns == stamp  # not tokenized again
    other_tok = make_chat_tokenizer(tmp_path / "tok2", vocab_size=290)
    second = prepare(_cfg(tmp_path, data, "--data.format=chat", tok=other_tok))
    assert second != first and second.parent == first.parent  # another tokenizer, another cache beside it
    assert first.parent == tmp_path / "cache"
    assert isinstance(open_cache(first).tokens, np.memmap)
    data.write_text(data.read_text() + json.dumps(conversations(1, seed=9)[0]) + "\n")  # the source changed
    assert prepare(_cfg(tmp_path, data, "--data.format=chat", tok=tok_dir)) not in (first, second)
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("fmt", ["chat", "text"])
def test_tokenizing_in_worker_processes_writes_the_same_cache(tmp_path, tok_dir, fmt):
    """1200 records (3 batches of 512) tokenized by 1 and by 3 worker processes: the same files, byte for byte;
    and a bad record deep in a later batch is the same one line from a worker."""
    from moeflow.data.token_cache import _BATCH

    rng = random.Random(0)
    records = conversations(1200) if fmt == "chat" else [{"text": sentence(rng)} for _ in range(1200)]
    assert len(records) > 2 * _BATCH
    data = write_jsonl(tmp_path / "records.jsonl", records)
    folders = [prepare(_cfg(tmp_path / f"w{n}", data, f"--data.format={fmt}", f"--data.tokenize_workers={n}",
                            tok=tok_dir)) for n in (1, 3)]
    for name in ("tokens.bin", "trained.bin", "offsets.bin", "doc_trained.bin"):
        one, three = (folder / name for folder in folders)
        assert one.exists() == three.exists() and (not one.exists() or one.read_bytes() == three.read_bytes())
    bad = records[:1100] + [{"messages": "nope"} if fmt == "chat" else {"text": 7}] + records[1100:]
    broken = write_jsonl(tmp_path / "broken.jsonl", bad)
    messages = []
    for n in (1, 3):
        with pytest.raises(ValueError) as e:
            prepare(_cfg(tmp_path / f"b{n}", broken, f"--data.format={fmt}", f"--data.tokenize_workers={n}",
                         tok=tok_dir))
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "line 1101" in messages[0]


def test_plain_jsonl_read_by_the_workers_is_the_datasets_path_cache(tmp_path, tok_dir, monkeypatch):
    """Text jsonl over two files, blank lines included, read in many small chunks by 1 and 3 workers (no Arrow copy):
    the cache datasets' path writes, byte for byte, and the same meta (records per file too)."""
    from moeflow.data import token_cache

    rng = random.Random(1)
    lines = [json.dumps({"text": sentence(rng), "id": i}) for i in range(900)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text("\n".join(lines[:400]) + "\n\n")
    (tmp_path / "data" / "b.jsonl").write_text("\n".join(lines[400:]))  # no newline at the end
    data = tmp_path / "data"
    monkeypatch.setattr(token_cache, "_CHUNK_BYTES", 3000)  # about 50 records a chunk
    assert len(token_cache._jsonl_chunks([str(p) for p in sorted(data.glob("*.jsonl"))])) > 10
    folders = {n: prepare(_cfg(tmp_path / f"w{n}", data, f"--data.tokenize_workers={n}", tok=tok_dir)) for n in (1, 3)}
    monkeypatch.setattr(token_cache, "_is_plain_jsonl", lambda src, encoder: False)
    folders["datasets"] = prepare(_cfg(tmp_path / "datasets", data, tok=tok_dir))
    names = ("tokens.bin", "offsets.bin", "doc_trained.bin")
    want = {name: (folders["datasets"] / name).read_bytes() for name in names}
    meta = json.loads((folders["datasets"] / "meta.json").read_text())
    assert meta["source"]["counts"] == [400, 500]
    for n in (1, 3):
        assert {name: (folders[n] / name).read_bytes() for name in want} == want, n
        assert json.loads((folders[n] / "meta.json").read_text()) == meta, n


# ---------------------------------------------------------------------------------------------- packing


def _brute_first_fit(sizes, capacity):
    free, rows = [], []
    for s in sizes:
        row = next((i for i, f in enumerate(free) if f >= s), len(free))
        if row == len(free):
            free.append(capacity)
        free[row] -= s
        rows.append(row)
    return rows


def test_first_fit_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        capacity = int(rng.integers(5, 40))
        sizes = rng.integers(1, capacity + 1, int(rng.integers(1, 200))).tolist()
        assert first_fit(sizes, capacity) == _brute_first_fit(sizes, capacity)


@pytest.mark.parametrize("packed", [True, False])
def test_rows_hold_every_document_once(tmp_path, tok_dir, packed):
    S = 96  # most conversations fit, some are cut
    data = write_jsonl(tmp_path / "chat.jsonl", conversations(50, seed=4))
    cfg = _cfg(tmp_path, data, "--data.format=chat", f"--data.seq_len={S}", tok=tok_dir)
    cache = open_cache(prepare(cfg))
    rows = DocumentRows(cache, np.arange(cache.num_documents), S, packed=packed, seed=5)
    batch = rows.gather(np.arange(rows.num_sequences))
    x, y = batch.inputs.numpy(), batch.targets.numpy()
    seen = {}
    for r in range(rows.num_sequences):
        doc_ids = batch.document_ids[r].numpy() if packed else np.zeros(S, dtype=int)
        positions = batch.positions[r].numpy() if packed else np.arange(S)
        for d in np.unique(doc_ids):
            cols = np.flatnonzero(doc_ids == d)
            assert (positions[cols] == np.arange(len(cols))).all()  # positions restart per document
            inputs, targets = x[r, cols].tolist(), y[r, cols].tolist()
            seen[tuple(inputs)] = seen.get(tuple(inputs), []) + [targets]
    # every document (cut at S + 1 tokens) appears exactly once, with its own masked targets
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    truncated = 0
    for rec in conversations(50, seed=4):
        ids, mask = encode_chat(hf_tok, rec["messages"])
        truncated += len(ids) > S + 1
        ids, mask = ids[:S + 1], mask[:S + 1]
        if not any(mask[1:]):  # cut before the assistant spoke: nothing to train, left out
            continue
        want_targets = [t if m else -100 for t, m in zip(ids[1:], mask[1:])]
        key = tuple(ids[:-1]) if packed else tuple(ids[:-1] + [0] * (S + 1 - len(ids)))
        if not packed:
            want_targets += [-100] * (S - len(want_targets))
        assert seen.pop(key) == [want_targets]
    assert not {k: v for k, v in seen.items() if set(k) != {0}}  # only padding rows of packing are left
    assert rows.stats["truncated"] == truncated > 0
    assert rows.trained_tokens(np.arange(rows.num_sequences)) == int((y != -100).sum())
    if packed:
        assert rows.num_sequences < 50 and rows.stats["fill"] > 0.8


def test_resume_mid_epoch_under_another_layout_gives_the_same_batches(tmp_path, tok_dir):
    import torch

    from moeflow.data.stream import BatchSampler

    data = write_jsonl(tmp_path / "chat.jsonl", conversations(60, seed=6))
    cache = open_cache(prepare(_cfg(tmp_path, data, "--data.format=chat", tok=tok_dir)))
    rows = DocumentRows(cache, np.arange(cache.num_documents), 64, packed=True, seed=1)
    whole = BatchSampler(rows, 64, 6, seed=2)
    steps = rows.num_sequences // 6 + 3  # past the end of the first epoch
    expected = [whole.next_batch() for _ in range(steps)]
    first = BatchSampler(rows, 64, 6, seed=2)
    for _ in range(2):  # stop mid-epoch
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    ranks = [BatchSampler(rows, 64, 6, r, 3, seed=2) for r in range(3)]  # resume on 3 data-parallel ranks
    for sampler in ranks:
        sampler.load_state_dict(state)
    for want in expected[2:]:
        parts = [sampler.next_batch() for sampler in ranks]
        for key in ("inputs", "targets", "positions", "document_ids"):
            assert torch.equal(torch.cat([getattr(p, key) for p in parts]), getattr(want, key)), key
        assert {p.global_tokens for p in parts} == {want.global_tokens} == {int((want.targets != -100).sum())}
    other = DocumentRows(cache, np.arange(cache.num_documents), 64, packed=False)
    with pytest.raises(ValueError, match="the checkpoint's data was .*packed.* but this run's is .*rows"):
        BatchSampler(other, 64, 6, seed=2).load_state_dict(state)


# ---------------------------------------------------------------------------------------------- bad input


def _error(cfg, tmp_path) -> str:
    with pytest.raises(ValueError) as info:
        build_data(cfg)
    message = str(info.value)
    assert "\n" not in message
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())  # nothing written half
    return message


def test_bad_input_is_one_line_naming_the_record(tmp_path, tok_dir):
    good = [json.dumps(r) for r in conversations(5)]
    path = tmp_path / "chat.jsonl"
    chat = ("--data.format=chat",)

    path.write_text("\n".join(good[:2] + ['{"messages": [}'] + good[2:]) + "\n")
    msg = _error(_cfg(tmp_path, path, *chat, tok=tok_dir), tmp_path)
    assert f"{path} line 3 is not valid JSON" in msg and "fix or remove that line" in msg

    path.write_text("\n".join(good[:3] + [json.dumps({"text": "hello"})] + good[3:]) + "\n")
    msg = _error(_cfg(tmp_path, path, *chat, tok=tok_dir), tmp_path)
    assert f"{path} line 4 has no 'messages' list" in msg and "data.format = 'text'" in msg

    path.write_text("\n".join(json.dumps({"text": "a b"}) for _ in range(3)) + "\n")
    msg = _error(_cfg(tmp_path, path, *chat, tok=tok_dir), tmp_path)
    assert "has no 'messages' field" in msg and "set data.format = 'text'" in msg

    bad_role = {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}
    path.write_text("\n".join(good[:1] + ["", json.dumps(bad_role)]) + "\n")
    msg = _error(_cfg(tmp_path, path, *chat, tok=tok_dir), tmp_path)
    assert f"{path} line 3 message 1 has the unknown role 'bot'" in msg and "'assistant'" in msg

    path.write_text("\n".join(good) + "\n")
    no_template = make_chat_tokenizer(tmp_path / "plain_tok", template=None)
    msg = _error(_cfg(tmp_path, path, *chat, tok=no_template), tmp_path)
    assert "has no chat template" in msg and "data.chat_template" in msg

    # a template's own refusal (jinja2's raise_exception, as real templates do) names the record, not a traceback
    strict = make_chat_tokenizer(tmp_path / "strict_tok", template="{{ raise_exception('roles must alternate') }}")
    msg = _error(_cfg(tmp_path, path, *chat, tok=strict), tmp_path)
    assert f"{path} line 1" in msg and "the chat template failed on it" in msg and "roles must alternate" in msg

    long = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "the cat " * 80}]}
    path.write_text("\n".join(good[:4] + [json.dumps(long)] + good[4:]) + "\n")
    longer = ("--data.seq_len=200", *chat)  # the other conversations have fewer than 201 tokens
    msg = _error(_cfg(tmp_path, path, *longer, "--data.overlong=error", tok=tok_dir), tmp_path.parent / "none")
    assert f"{path} line 5 has 341 tokens, more than data.seq_len + 1 = 201" in msg and "data.overlong" in msg
    truncating = build_data(_cfg(tmp_path, path, *longer, tok=tok_dir))
    assert truncating.summary["truncated"] == 1

    empty = tmp_path / "empty" / "empty.jsonl"
    empty.parent.mkdir()
    empty.write_text("")
    msg = _error(_cfg(tmp_path / "empty", empty, *chat, tok=tok_dir), tmp_path / "empty")
    assert "holds no records" in msg or "cannot be read" in msg

    cache_folder = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir())
    other_tok = make_chat_tokenizer(tmp_path / "other_tok", vocab_size=280)
    msg = _error(_cfg(tmp_path / "o", cache_folder, *chat, tok=other_tok), tmp_path / "o")
    assert "was written by the tokenizer" in msg and "not the one this run uses" in msg


def test_hub_name_offline_is_one_line(tmp_path, tok_dir, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    # read at import time, so set where they were read too: no network attempt, no timeout
    for module in (datasets.config, huggingface_hub.constants):
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    msg = _error(_cfg(tmp_path, "hf:someone/no-such-dataset:test", "--data.format=chat", tok=tok_dir), tmp_path)
    assert msg.startswith("data.source = 'hf:someone/no-such-dataset:test': cannot load 'someone/no-such-dataset' "
                          "split 'test' from the Hugging Face Hub")


def test_cli_prepare_data_reports_one_line(tmp_path, tok_dir, capsys):
    from moeflow.cli import main as cli_main

    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": []}\n{oops\n')
    code = cli_main(["train", "--prepare-data", f"--data.source={path}", "--data.format=chat",
                     f"--data.tokenizer={tok_dir}", "--model.vocab_size=320", f"--run-dir={tmp_path / 'run'}"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"moeflow train: error: data.source = '{path}': {path} line 2 is not valid JSON "
        "(Expecting property name enclosed in double quotes at column 2); fix or remove that line"]


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    from moeflow.train.data_setup import make_encoder

    cfg = load_config(None, parse_overrides(["--data.tokenizer=byte", "--model.vocab_size=100",
                                             f"--run-dir={tmp_path}"]))
    with pytest.raises(ValueError, match=r"the tokenizer has 256 tokens but model.vocab_size is 100; set "
                                         r"--model.vocab_size=256 or more"):
        make_encoder(cfg)
