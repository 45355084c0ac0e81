"""The nodes of a job tokenize the cache together (a torchrun job, which no launcher prepares for): on 4 gloo ranks
as 2 nodes of 2, each node's first rank encodes its share of the records (plain text jsonl by byte ranges, chat
records through `datasets`) and rank 0 joins the parts - the files and meta one process writes, byte for byte; a
bad record in the second node's share is rank 0's one line (and every rank's); a cache that exists is opened, not
written again."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.support.data_fixtures import conversations, make_chat_tokenizer, sentence, write_jsonl  # noqa: E402
from tests.support.dist_harness import check_results, launch  # noqa: E402

FILES = ("tokens.bin", "trained.bin", "offsets.bin", "doc_trained.bin", "meta.json")


def _cfg(tmp: Path, source, fmt: str, tok: Path):
    from moeflow.config import load_config, parse_overrides

    args = [f"--data.source={source}", "--data.seq_len=64", "--model.vocab_size=320", f"--data.format={fmt}",
            f"--data.cache_dir={tmp / 'cache'}", f"--data.tokenizer={tok}"]
    return load_config(None, {**parse_overrides(args), "run_dir": str(tmp / "run")})


def _case(_, case) -> None:
    import os

    import torch.distributed as dist

    from moeflow.data import token_cache
    from moeflow.train.data_setup import _prepare_on_rank0

    name, source, fmt, tok, work, broken = case
    token_cache._CHUNK_BYTES = 3000  # many chunks, so that both ranks have a share of the jsonl
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 nodes of 2 ranks
    rank = dist.get_rank()
    if broken:
        with pytest.raises(ValueError) as e:
            _prepare_on_rank0(_cfg(Path(work), source, fmt, Path(tok)), rank == 0)
        Path(work, f"error{rank}.txt").write_text(str(e.value))
        return
    folder, _ = _prepare_on_rank0(_cfg(Path(work), source, fmt, Path(tok)), rank == 0)
    stamp = (folder / "tokens.bin").stat().st_mtime_ns
    again, _ = _prepare_on_rank0(_cfg(Path(work), source, fmt, Path(tok)), rank == 0)
    assert again == folder and (folder / "tokens.bin").stat().st_mtime_ns == stamp  # opened, not written again
    Path(work, f"folder{rank}.txt").write_text(str(folder))


@pytest.mark.timeout(300)
def test_ranks_tokenize_their_shares_into_one_processs_cache(tmp_path):
    from moeflow.data import token_cache
    from moeflow.train.data_setup import prepare

    tok = make_chat_tokenizer(tmp_path / "tok")
    rng = random.Random(0)
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": sentence(rng)} for _ in range(700)])
    chat_records = conversations(1200)
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_records)
    # record 700: in the second batch of 512, the second node's share
    broken = write_jsonl(tmp_path / "broken.jsonl", chat_records[:700] + [{"messages": "nope"}] + chat_records[700:])
    cases = [(name, str(source), fmt, str(tok), str(tmp_path / name), bad) for name, source, fmt, bad in (
        ("text", text, "text", False), ("chat", chat, "chat", False), ("broken", broken, "chat", True))]
    check_results(launch(4, cases, _case), cases)

    for name, source, fmt, *_ in cases[:2]:
        folders = {Path(tmp_path / name / f"folder{r}.txt").read_text() for r in range(4)}
        assert len(folders) == 1, folders
        together = Path(folders.pop())
        token_cache._CHUNK_BYTES = 3000
        one = prepare(_cfg(tmp_path / f"{name}-one", source, fmt, tok))  # one process, one worker
        assert together.name == one.name
        for file in FILES:
            assert (together / file).exists() == (one / file).exists(), (name, file)
            if file == "meta.json":
                assert json.loads((together / file).read_text()) == json.loads((one / file).read_text()), name
            elif (one / file).exists():
                assert (together / file).read_bytes() == (one / file).read_bytes(), (name, file)
        assert not [p for p in together.parent.iterdir() if ".tmp" in p.name]  # the parts are gone
    errors = [Path(tmp_path / "broken" / f"error{r}.txt").read_text() for r in range(4)]
    assert "line 701" in errors[0] and set(errors[1:]) == {f"rank 0 could not prepare the data: {errors[0]}"}
