"""Data layer: tokenizers, corpus loading, the train/val split, the resumable rank-sharded sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moeflow.data.stream import BatchSampler, load_tokens, split_tokens, stdlib_files, val_batches
from moeflow.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

SENTENCES = ["the cat sat on the mat", "a dog ate the bone", "the bird sang a song"]


def make_tokenizer_json(folder) -> str:
    """A tiny WordLevel tokenizer trained on SENTENCES, saved as folder/tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return str(path)


# ---------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id) == (256, 0)
    assert tok.encode("hé") == [104, 0xC3, 0xA9]
    assert tok.decode(tok.encode("héllo ✓")) == "héllo ✓"


def test_hf_tokenizer(tmp_path):
    tok = HFTokenizer(make_tokenizer_json(tmp_path))
    assert tok.eos_id == 1  # '</s>', the second special token
    assert tok.vocab_size == 2 + len({w for s in SENTENCES for w in s.split()})
    ids = tok.encode("the cat sat")
    assert len(ids) == 3 and len(set(ids)) == 3
    assert tok.decode(ids) == "the cat sat"
    assert tok.encode("zebra") == [0]  # unknown word -> <unk>
    # the batch path (tokenizers' encode_batch_fast, no offsets) gives each text's own encode
    assert tok.encode_batch(SENTENCES + ["zebra", ""]) == [tok.encode(t) for t in SENTENCES + ["zebra", ""]]


def test_hf_tokenizer_without_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    tok.save(str(tmp_path / "t.json"))
    assert HFTokenizer(tmp_path / "t.json").eos_id is None


def test_load_tokenizer_specs(tmp_path):
    assert isinstance(load_tokenizer("byte", None), ByteTokenizer)
    assert isinstance(load_tokenizer("auto", "stdlib"), ByteTokenizer)
    (tmp_path / "a.txt").write_text("the cat")
    assert isinstance(load_tokenizer("auto", str(tmp_path / "a.txt")), ByteTokenizer)  # no tokenizer.json yet
    path = make_tokenizer_json(tmp_path)
    assert isinstance(load_tokenizer("auto", str(tmp_path)), HFTokenizer)  # folder source
    assert isinstance(load_tokenizer("auto", str(tmp_path / "a.txt")), HFTokenizer)  # file beside it
    assert isinstance(load_tokenizer(path, None), HFTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path), None), HFTokenizer)
    with pytest.raises(ValueError, match=r"data.tokenizer = '.*nope.json': no such tokenizer file.*'byte'"):
        load_tokenizer(str(tmp_path / "nope.json"), None)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not load it as a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"), None)


# ---------------------------------------------------------------------------------------------- sources


def test_text_file(tmp_path):
    (tmp_path / "a.txt").write_text("hi é")
    tokens = load_tokens(str(tmp_path / "a.txt"), ByteTokenizer(), vocab_size=256)
    assert tokens.dtype == np.int64
    assert tokens.tolist() == list("hi é".encode())


def test_folder_sorted_with_eos_separators(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("B")
    (tmp_path / "a.txt").write_text("A")
    (tmp_path / "sub" / "c.py").write_text("C")
    (tmp_path / "skip.csv").write_text("X")  # not a text suffix
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "h.txt").write_text("H")  # hidden folder
    tokens = load_tokens(str(tmp_path), ByteTokenizer(), vocab_size=256)
    assert tokens.tolist() == [ord("A"), 0, ord("B"), 0, ord("C")]


def test_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "ab", "id": 1}) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    assert load_tokens(str(path), ByteTokenizer(), vocab_size=256).tolist() == [97, 98, 0, 99]


def test_hf_tokenizer_source(tmp_path):
    make_tokenizer_json(tmp_path)
    (tmp_path / "a.txt").write_text("the cat")
    (tmp_path / "b.txt").write_text("the dog")
    tok = load_tokenizer("auto", str(tmp_path))
    tokens = load_tokens(str(tmp_path), tok, vocab_size=tok.vocab_size)
    expected = tok.encode("the cat") + [tok.eos_id] + tok.encode("the dog")
    assert tokens.tolist() == expected
    with pytest.raises(ValueError, match=r"token id \d+ .*model.vocab_size = 3\. Set model.vocab_size to at"):
        load_tokens(str(tmp_path), tok, vocab_size=3)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin(tmp_path, dtype):
    ids = np.array([5, 1000, 65535 if dtype == "uint16" else 70000, 0], dtype=dtype)
    path = tmp_path / "t.bin"
    ids.tofile(path)
    tokens = load_tokens(str(path), None, token_dtype=dtype, vocab_size=100_000)
    assert tokens.dtype == np.dtype(dtype)
    assert tokens.tolist() == ids.tolist()


def test_stdlib_corpus_capped_and_deterministic():
    files = stdlib_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert [f.as_posix() for f in files] == sorted(f.as_posix() for f in files)
    tokens = load_tokens("stdlib", ByteTokenizer(), vocab_size=256, max_bytes=50_000)
    separators = int((tokens == 0).sum())
    assert 0 < len(tokens) - separators <= 50_000
    assert len(tokens) > 40_000
    # The stream starts with the first file's text, then eos (the first file is under the cap).
    first = files[0].read_bytes()
    assert len(first) < 50_000
    assert bytes(tokens[: len(first)].astype(np.uint8)) == first and tokens[len(first)] == 0
    again = load_tokens("stdlib", ByteTokenizer(), vocab_size=256, max_bytes=50_000)
    assert np.array_equal(tokens, again)


# ---------------------------------------------------------------------------------------------- errors


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(ValueError, match=r"data.source = '.*nowhere': no such file or folder\. Give 'std"):
        load_tokens(str(tmp_path / "nowhere"), ByteTokenizer(), vocab_size=256)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"data.source = '.*empty.txt': .* contains no text"):
        load_tokens(str(tmp_path / "empty.txt"), ByteTokenizer(), vocab_size=256)
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match=r"data.source = '.*d': the folder has no .txt/.md/.py files"):
        load_tokens(str(tmp_path / "d"), ByteTokenizer(), vocab_size=256)
    (tmp_path / "d" / "x.txt").write_text("")
    with pytest.raises(ValueError, match="contains no text"):
        load_tokens(str(tmp_path / "d"), ByteTokenizer(), vocab_size=256)
    (tmp_path / "e.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"data.source = '.*e.bin': the file is empty"):
        load_tokens(str(tmp_path / "e.bin"), None, vocab_size=256)


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl': line 2 has no string 'text' field"):
        load_tokens(str(path), ByteTokenizer(), vocab_size=256)
    path.write_text('{"text": "ok"}\n{"text": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"line 3 is not valid JSON"):
        load_tokens(str(path), ByteTokenizer(), vocab_size=256)


def test_bin_errors(tmp_path):
    path = tmp_path / "t.bin"
    np.array([1, 2, 300], dtype=np.uint16).tofile(path)
    with pytest.raises(
        ValueError,
        match=r"read as data.token_dtype = 'uint16' it holds token id 300, but model.vocab_size = 256\. "
        r"If the file was written as uint32, set data.token_dtype = 'uint32'; otherwise use a model with "
        r"model.vocab_size > 300",
    ):
        load_tokens(str(path), None, token_dtype="uint16", vocab_size=256)
    # uint16 data read as uint32 pairs tokens into huge ids: the message points back at uint16.
    np.array([1, 2, 3, 4], dtype=np.uint16).tofile(path)
    # little-endian pairs (1, 2) and (3, 4) read as 1 + 2 * 65536 and 3 + 4 * 65536 = 262147
    with pytest.raises(ValueError, match=r"token id 262147, .*set data.token_dtype = 'uint16'"):
        load_tokens(str(path), None, token_dtype="uint32", vocab_size=256)
    np.array([1, 2, 3], dtype=np.uint16).tofile(path)  # 6 bytes: not whole uint32s
    with pytest.raises(ValueError, match=r"size \(6 bytes\) is not a multiple of 4.*token_dtype = 'uint32'"):
        load_tokens(str(path), None, token_dtype="uint32", vocab_size=256)
    with pytest.raises(ValueError, match=r"data.token_dtype = 'int8' is not one of \['uint16', 'uint32'\]"):
        load_tokens(str(path), None, token_dtype="int8", vocab_size=256)


# ---------------------------------------------------------------------------------------------- split


def test_split_is_contiguous_tail():
    tokens = np.arange(100)
    train, val = split_tokens(tokens, 0.1, seq_len=4)
    assert train.tolist() == list(range(90)) and val.tolist() == list(range(90, 100))
    train, val = split_tokens(tokens, 0.0, seq_len=4)
    assert len(train) == 100 and len(val) == 0
    with pytest.raises(ValueError, match=r"validation split has 10 tokens, fewer than seq_len \+ 1 = 17"):
        split_tokens(tokens, 0.1, seq_len=16)
    with pytest.raises(ValueError, match=r"training split has 10 tokens, fewer than seq_len \+ 1 = 17"):
        split_tokens(tokens, 0.9, seq_len=16)
    with pytest.raises(ValueError, match=r"data.val_fraction = 1.0 must be in \[0, 1\)"):
        split_tokens(tokens, 1.0, seq_len=4)


# ---------------------------------------------------------------------------------------------- sampler


def window(tokens, w, seq_len):
    """Independent reference: window w is tokens[w*seq_len : w*seq_len + seq_len + 1]."""
    return list(tokens[w * seq_len : w * seq_len + seq_len + 1])


def test_windows_hand_computed():
    # 20 tokens, seq_len 4 -> windows start at 0, 4, 8, 12 (16 would need token 20): 4 windows.
    tokens = np.arange(20)
    s = BatchSampler(tokens, seq_len=4, global_batch=4, dp_rank=0, dp_size=1, seed=7)
    assert s.num_windows == 4
    b = s.next_batch()
    x, y = b.inputs, b.targets
    assert x.dtype == torch.long and x.shape == (4, 4) and y.shape == (4, 4)
    assert b.global_tokens == 16 and b.positions is None and b.document_ids is None
    rows = sorted(x.tolist())
    assert rows == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]  # one epoch = each once
    assert torch.equal(y, x + 1)  # targets are inputs shifted by one on an arange
    order = np.random.default_rng(7).permutation(4)
    assert x[:, 0].tolist() == [4 * int(w) for w in order]


def test_epoch_wrap_mid_step():
    tokens = np.arange(20)  # 4 windows; batches of 3 straddle epochs
    s = BatchSampler(tokens, seq_len=4, global_batch=3, seed=1)
    p0, p1 = np.random.default_rng(1).permutation(4), np.random.default_rng(2).permutation(4)
    stream = list(p0) + list(p1)
    got = [s.next_batch().inputs[:, 0].tolist() for _ in range(2)]
    assert got == [[4 * int(w) for w in stream[0:3]], [4 * int(w) for w in stream[3:6]]]
    assert s.epoch == 1


def test_deterministic_and_seed_dependent():
    tokens = np.arange(1000)
    a = BatchSampler(tokens, 8, 4, seed=3)
    b = BatchSampler(tokens, 8, 4, seed=3)
    c = BatchSampler(tokens, 8, 4, seed=4)
    xa, xb, xc = ([s.next_batch().inputs for _ in range(5)] for s in (a, b, c))
    assert all(torch.equal(p, q) for p, q in zip(xa, xb))
    assert not all(torch.equal(p, q) for p, q in zip(xa, xc))


@pytest.mark.parametrize("dp_size", [2, 3, 6])
def test_rank_union_equals_single_process(dp_size):
    tokens = np.arange(5 * 37 + 1)  # 37 windows: steps of 6 wrap epochs at odd places
    single = BatchSampler(tokens, 5, 6, 0, 1, seed=11)
    ranks = [BatchSampler(tokens, 5, 6, r, dp_size, seed=11) for r in range(dp_size)]
    for _ in range(15):
        one = single.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert all(p.inputs.shape == (6 // dp_size, 5) for p in parts)
        assert torch.equal(torch.cat([p.inputs for p in parts]), one.inputs)
        assert torch.equal(torch.cat([p.targets for p in parts]), one.targets)
        assert all(p.global_tokens == one.global_tokens == 6 * 5 for p in parts)


@pytest.mark.parametrize("k", [0, 3, 10])
def test_resume_matches_uninterrupted(k):
    tokens = np.arange(3 * 11 + 2)
    full = BatchSampler(tokens, 3, 4, 1, 2, seed=5)
    expected = [full.next_batch() for _ in range(k + 6)][k:]
    first = BatchSampler(tokens, 3, 4, 1, 2, seed=5)
    for _ in range(k):
        first.next_batch()
    sd = json.loads(json.dumps(first.state_dict()))  # survives a plain serialisation
    assert sd["step"] == k and sd["seed"] == 5
    resumed = BatchSampler(tokens, 3, 4, 1, 2, seed=5)
    resumed.load_state_dict(sd)
    for want in expected:
        got = resumed.next_batch()
        assert torch.equal(got.inputs, want.inputs) and torch.equal(got.targets, want.targets)


def test_resume_refuses_other_seed_or_data():
    tokens = np.arange(50)
    sd = BatchSampler(tokens, 4, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"training.seed was 1 in the checkpoint but is 2 now"):
        BatchSampler(tokens, 4, 2, seed=2).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"number of training windows was 12 in the checkpoint but is 7"):
        BatchSampler(np.arange(30), 4, 2, seed=1).load_state_dict(sd)


def test_sampler_errors():
    with pytest.raises(
        ValueError,
        match=r"training.global_batch = 6 is not divisible by the data-parallel size "
        r"\(parallel data size = 4\).*Choose training.global_batch = 4 or 8",
    ):
        BatchSampler(np.arange(100), 4, 6, 0, 4, seed=0)
    with pytest.raises(ValueError, match=r"has 4 tokens, fewer than seq_len \+ 1 = 5"):
        BatchSampler(np.arange(4), 4, 1, seed=0)


def test_bin_memmap_through_sampler(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(41, dtype=np.uint32).tofile(path)
    tokens = load_tokens(str(path), None, token_dtype="uint32", vocab_size=64)
    b = BatchSampler(tokens, 8, 5, seed=0).next_batch()
    x, y = b.inputs, b.targets
    assert x.dtype == torch.long and sorted(x[:, 0].tolist()) == [0, 8, 16, 24, 32]
    assert torch.equal(y, x + 1)


def test_val_batches_fixed_order():
    tokens = np.arange(20)  # 4 windows of seq_len 4
    batches = val_batches(tokens, 4, batch=3, max_batches=None)
    assert len(batches) == 1  # only full batches
    x, y = batches[0].inputs, batches[0].targets
    assert batches[0].global_tokens == 3 * 4
    assert x.tolist() == [window(tokens, w, 4)[:-1] for w in range(3)]
    assert y.tolist() == [window(tokens, w, 4)[1:] for w in range(3)]
    two = val_batches(np.arange(41), 4, batch=2, max_batches=None)
    assert [b.inputs[:, 0].tolist() for b in two] == [[0, 4], [8, 12], [16, 20], [24, 28], [32, 36]]
    assert len(val_batches(np.arange(41), 4, batch=2, max_batches=2)) == 2
    small = val_batches(np.arange(9), 4, batch=8, max_batches=None)  # 2 windows < batch: one batch of both
    assert len(small) == 1 and small[0].inputs.shape == (2, 4)
    assert val_batches(np.arange(0), 4, batch=2, max_batches=3) == []
    again = val_batches(np.arange(41), 4, batch=2, max_batches=None)
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(two, again))
