"""Where training records come from, read through Hugging Face `datasets`.

data.source may be:
  a .jsonl / .json / .parquet / .arrow / .csv file      one record per line / row
  a folder of such files (all of one kind), or a folder written by `Dataset.save_to_disk`
  hf:NAME or hf:NAME:SPLIT                                a dataset on the Hugging Face Hub (needs the network)
  'stdlib', a text file, a folder of .txt/.md/.py files   the plain-text corpora, one 'text' record per file
A record source remembers its files and how many records each holds, so a bad record is reported by file and
line (jsonl, csv) or row (parquet, arrow) long after the records themselves are gone (only their tokens are kept).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

RECORD_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
HUB_PREFIX = "hf:"
_KINDS = "a .jsonl/.json/.parquet/.arrow/.csv file or a folder of them, hf:NAME[:SPLIT], or plain text"


def is_record_source(source: str) -> bool:
    """Records in a table format (or on the Hub), as opposed to the plain-text corpora and .bin token files."""
    if source.startswith(HUB_PREFIX):
        return True
    path = Path(source)
    if path.is_file():
        return path.suffix in RECORD_BUILDERS
    if path.is_dir():
        return (path / "state.json").is_file() or bool(_record_files(path))
    return False


def _record_files(folder: Path) -> list[Path]:
    files = [p for p in folder.rglob("*") if p.is_file() and p.suffix in RECORD_BUILDERS
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


@dataclass
class RecordSource:
    spec: str  # data.source as given
    builder: str  # json | parquet | arrow | csv | saved | hub | text
    files: list[str] = field(default_factory=list)
    hub_name: str = ""
    split: str = "train"
    counts: list[int] = field(default_factory=list)  # records per file, filled by load()

    def fingerprint(self) -> dict:
        """What identifies the records without reading them: each file's size and modification time."""
        if self.builder == "hub":
            return {"hub": self.hub_name, "split": self.split}
        return {"files": [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in self.files]}

    def locate(self, index: int) -> str:
        """'FILE line N' / 'FILE row N' / 'record N of hf:...' for the index-th record (0-based)."""
        return locate({"spec": self.spec, "builder": self.builder, "files": self.files, "counts": self.counts},
                      index)

    def describe(self) -> dict:
        return {"spec": self.spec, "builder": self.builder, "files": self.files, "counts": self.counts}


def resolve(source: str) -> RecordSource:
    """The record source named by data.source, or ValueError saying what it accepts."""
    if source.startswith(HUB_PREFIX):
        name, _, split = source[len(HUB_PREFIX):].partition(":")
        if not name:
            raise ValueError(f"data.source = {source!r}: give a dataset name after 'hf:', e.g. hf:org/name:train")
        return RecordSource(source, "hub", hub_name=name, split=split or "train")
    if source == "stdlib":
        from moeflow.data.stream import stdlib_files

        return RecordSource(source, "text", files=[str(p) for p in stdlib_files()])
    path = Path(source)
    if not path.exists():
        raise ValueError(f"data.source = {source!r}: no such file or folder. Give {_KINDS}.")
    if path.is_file():
        builder = RECORD_BUILDERS.get(path.suffix, "text")
        return RecordSource(source, builder, files=[str(path)])
    if (path / "state.json").is_file():
        return RecordSource(source, "saved", files=[str(path)])
    files = _record_files(path)
    if files:
        builders = {RECORD_BUILDERS[f.suffix] for f in files}
        if len(builders) > 1:
            raise ValueError(f"data.source = {source!r}: the folder mixes {sorted(builders)} files; keep one kind "
                             f"per folder (or point data.source at one file)")
        return RecordSource(source, builders.pop(), files=[str(f) for f in files])
    from moeflow.data.stream import TEXT_SUFFIXES

    texts = sorted((p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()
                    and not any(part.startswith(".") for part in p.relative_to(path).parts[:-1])),
                   key=lambda p: p.relative_to(path).as_posix())
    if not texts:
        raise ValueError(f"data.source = {source!r}: the folder has no record files and no text files. Give {_KINDS}.")
    return RecordSource(source, "text", files=[str(p) for p in texts])


def load(src: RecordSource, work_dir: Path, max_bytes: int = 4_000_000):
    """The records as one `datasets.Dataset` (files concatenated in order); fills src.counts.
    work_dir holds datasets' own Arrow copies of local files (the caller deletes it)."""
    import datasets

    datasets.disable_progress_bars()  # the tokenizer's bar is the one that matters; these are instant
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # its own report of a bad file would come before our one line
    try:
        return _load(src, work_dir, max_bytes)
    finally:
        logger.setLevel(level)


def _load(src: RecordSource, work_dir: Path, max_bytes: int):
    import datasets

    if src.builder == "text":
        from moeflow.data.stream import _read_text, _stdlib_documents

        docs = _stdlib_documents(max_bytes) if src.spec == "stdlib" else [_read_text(Path(f)) for f in src.files]
        src.counts = [len(docs)]
        return datasets.Dataset.from_dict({"text": docs})
    if src.builder == "hub":
        try:
            ds = datasets.load_dataset(src.hub_name, split=src.split)
        except Exception as e:  # offline, unknown name, unknown split: datasets raises many types
            raise ValueError(f"data.source = {src.spec!r}: cannot load {src.hub_name!r} split {src.split!r} from the "
                             f"Hugging Face Hub ({type(e).__name__}: {str(e).splitlines()[0][:200]}); check the name "
                             f"and the network, or download it and point data.source at the files") from None
        src.counts = [len(ds)]
        return ds
    if src.builder == "saved":
        ds = datasets.load_from_disk(src.files[0])
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"data.source = {src.spec!r}: the saved dataset has splits {list(ds)} and no "
                                 f"'train'; point data.source at hf-style folder of one split")
            ds = ds["train"]
        src.counts = [len(ds)]
        return ds
    parts = []
    for f in src.files:
        try:
            parts.append(datasets.load_dataset(src.builder, data_files=[f], split="train",
                                               cache_dir=str(work_dir / "hf")))
        except Exception as e:
            raise ValueError(_unreadable(src.spec, f, src.builder, e)) from None
    src.counts = [len(p) for p in parts]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _unreadable(spec: str, file: str, builder: str, error: Exception) -> str:
    """One line for a file datasets could not read: the first bad jsonl line when that is the reason."""
    if builder == "json" and file.endswith(".jsonl"):
        with open(file, encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as exc:
                    return (f"data.source = {spec!r}: {file} line {lineno} is not valid JSON ({exc.msg} at column "
                            f"{exc.colno}); fix or remove that line")
    cause = error.__cause__ or error
    return (f"data.source = {spec!r}: {file} cannot be read as {builder} ({type(cause).__name__}: "
            f"{str(cause).splitlines()[0][:200] if str(cause) else ''}); check the file's format")


def locate(source: dict, index: int) -> str:
    """Where the index-th record (0-based, over all files in order) is, for messages."""
    builder, files, counts = source["builder"], source["files"], source.get("counts") or []
    if builder in ("hub", "saved") or not files:
        return f"record {index} of {source['spec']}"
    if builder == "text":
        return f"document {index} of {source['spec']}" if len(files) != 1 else files[0]
    for f, n in zip(files, counts):
        if index < n:
            if builder == "csv":
                return f"{f} line {index + 2}"  # line 1 is the header (records without line breaks inside)
            if f.endswith(".jsonl"):
                return f"{f} line {_jsonl_line(f, index)}"
            return f"{f} row {index}"
        index -= n
    return f"record {index} of {source['spec']}"


def _jsonl_line(file: str, index: int) -> int:
    """The line number of the index-th non-blank line (what datasets counts as a record)."""
    seen = -1
    with open(file, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                seen += 1
                if seen == index:
                    return lineno
    return index + 1
