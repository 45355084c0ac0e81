"""Writes tests/data/megatron/: small Megatron indexed datasets written by megatron-core itself, and what
megatron-core's own reader returns for them (expected.json), for tests/data/test_megatron.py.

megatron-core is not a dependency: install it apart and point PYTHONPATH at it, e.g.

    .venv/bin/pip install "megatron-core>=0.16,<0.17" --no-deps --target /tmp/mcore
    PYTHONPATH=/tmp/mcore .venv/bin/python tests/support/make_megatron_fixture.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

OUT = Path(__file__).resolve().parents[1] / "data" / "megatron"


def write(prefix: Path, dtype, documents: list[list[list[int]]]) -> dict:
    """Each document a list of sequences (Megatron's sentence split), each a list of ids."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        for seq in doc:
            builder.add_item(torch.tensor(seq, dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    ds = IndexedDataset(str(prefix))  # megatron-core's own reader
    return {"dtype": np.dtype(ds.index.dtype).name, "sequence_lengths": ds.sequence_lengths.tolist(),
            "document_indices": ds.document_indices.tolist(),
            "sequences": [ds[i].tolist() for i in range(len(ds))]}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    expected = {}
    # 40 documents of 1-3 sequences (lengths 1-30), ids below 96 with 0 as the end of each document
    docs = [[rng.integers(1, 96, rng.integers(1, 30)).tolist() for _ in range(rng.integers(1, 4))] + [[0]]
            for _ in range(40)]
    expected["small_uint16"] = write(OUT / "small_uint16", np.uint16, docs)
    expected["small_int32"] = write(OUT / "small_int32", np.int32, docs[:10])
    (OUT / "expected.json").write_text(json.dumps(expected))
    print(f"wrote {sorted(p.name for p in OUT.iterdir())}")


if __name__ == "__main__":
    main()
