"""Training rows made of whole documents of a token cache: one document per row (right-padded), or several packed
first-fit into each row, with attention kept inside each document and positions restarting at 0.

A document of n tokens gives n - 1 (input, target) pairs, so it fills n - 1 positions of a row of seq_len (the
last token is only a target, as the window loader's seq_len + 1 tokens give seq_len targets). Targets that are
not trained (prompt tokens, padding) are IGNORE_INDEX. A document longer than the row is truncated to its first
seq_len + 1 tokens, dropped, or refused, by data.overlong.

Packing is done once, before training: the documents in a seeded random order, each into the first row with room
(first-fit, with a max-tree over the rows' free space: O(log rows) per document). The rows are then what the
sampler shuffles per epoch, so the data position is still one count of rows, whatever the layout. Which documents
share a row never matters to the loss: they cannot see each other.

Shape suffixes: B rows, S positions per row, P positions of several documents back to back, E documents (entries).
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow.data.stream import IGNORE_INDEX, Batch
from moeflow.data.token_cache import TokenCache

OVERLONG = ("truncate", "drop", "error")


def first_fit(sizes: list[int], capacity: int) -> list[int]:
    """The row each item goes to: the first (lowest-index) row whose free space holds it. Sizes <= capacity."""
    n = max(1, len(sizes))
    leaves = 1 << (n - 1).bit_length()
    free = [capacity] * (2 * leaves)  # free[node] = the most free space of any row below node
    rows = []
    for size in sizes:
        node = 1
        while node < leaves:  # descend to the leftmost row with room
            node = 2 * node if free[2 * node] >= size else 2 * node + 1
        rows.append(node - leaves)
        free[node] -= size
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


class DocumentRows:
    """Rows of `seq_len` positions built from the documents `docs` (indices into `cache`) of one split.

    For the sampler: `num_sequences`, `gather(ids)` -> Batch, `trained_tokens(ids)`, `key` (what a checkpoint's
    data position refers to), and `stats` for the run's summary.
    """

    def __init__(self, cache: TokenCache, docs: np.ndarray, seq_len: int, *, packed: bool, overlong: str = "truncate",
                 seed: int = 0, what: str = "data.source"):
        if overlong not in OVERLONG:
            raise ValueError(f"data.overlong = {overlong!r}; choose one of {list(OVERLONG)}")
        self.cache, self.seq_len, self.packed = cache, seq_len, packed
        docs = np.asarray(docs, dtype=np.int64)
        positions_E = cache.offsets[docs + 1] - cache.offsets[docs] - 1
        trained_E = cache.doc_trained[docs].copy()
        empty = trained_E <= 0  # nothing to learn from (no assistant turn, or a one-token document)
        too_long = (positions_E > seq_len) & ~empty
        if overlong == "error" and too_long.any():
            first = int(docs[np.argmax(too_long)])
            raise ValueError(
                f"{what}: {cache.locate(first)} has {int(positions_E[np.argmax(too_long)]) + 1} tokens, more than "
                f"data.seq_len + 1 = {seq_len + 1} ({int(too_long.sum())} such records); raise data.seq_len, or set "
                f"data.overlong = 'truncate' (keep the first seq_len + 1 tokens) or 'drop'")
        keep = ~empty & ~(too_long & (overlong == "drop"))
        docs, positions_E, trained_E, cut = docs[keep], positions_E[keep], trained_E[keep], too_long[keep]
        for i in np.flatnonzero(cut).tolist():  # rare: count what the truncated part still trains
            positions_E[i] = seq_len
            trained_E[i] = self._trained_in(int(docs[i]), seq_len)
        trains = trained_E > 0  # truncation can leave nothing trained (the assistant's turn came after the cut)
        docs, positions_E, trained_E, cut = docs[trains], positions_E[trains], trained_E[trains], cut[trains]
        self.stats = {"documents": int(len(docs)), "truncated": int(cut.sum()),
                      "dropped": int((too_long & ~keep).sum()), "untrained": int(empty.sum() + (~trains).sum())}
        if packed:
            order = np.random.default_rng(seed).permutation(len(docs))
            row_of = np.asarray(first_fit(positions_E[order].tolist(), seq_len), dtype=np.int64)
            by_row = order[np.argsort(row_of, kind="stable")]  # each row's documents in the order they arrived
            counts = np.bincount(row_of, minlength=int(row_of.max()) + 1 if len(row_of) else 0)
        else:
            by_row, counts = np.arange(len(docs)), np.ones(len(docs), dtype=np.int64)
        self.entry_doc_E, self.entry_len_E = docs[by_row], positions_E[by_row]
        self.row_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.row_trained = np.add.reduceat(trained_E[by_row], self.row_start[:-1]) if len(by_row) else np.zeros(0)
        self.num_sequences = len(counts)
        used = int(positions_E.sum())
        self.stats.update(rows=self.num_sequences, fill=used / max(1, self.num_sequences * seq_len))
        self.key = (f"{cache.key}:{'packed' if packed else 'rows'}:{seq_len}:{overlong}:"
                    f"{seed if packed else '-'}:{len(docs)}")

    def _trained_in(self, doc: int, positions: int) -> int:
        start = int(self.cache.offsets[doc])
        if self.cache.trained is None:
            return positions
        return int(self.cache.trained[start + 1:start + 1 + positions].sum())

    def trained_tokens(self, ids: np.ndarray) -> int:
        return int(self.row_trained[np.asarray(ids, dtype=np.int64)].sum())

    def gather(self, ids: np.ndarray) -> Batch:
        """Rows `ids` as a Batch; positions and document ids only when packed (one document per row needs
        neither: right padding after it is invisible to causal attention)."""
        ids = np.asarray(ids, dtype=np.int64)
        B, S = len(ids), self.seq_len
        firsts, lasts = self.row_start[ids], self.row_start[ids + 1]
        per_row = lasts - firsts
        entries_E = np.concatenate([np.arange(a, b) for a, b in zip(firsts.tolist(), lasts.tolist())]) \
            if B else np.zeros(0, dtype=np.int64)
        row_E = np.repeat(np.arange(B), per_row)
        slot_E = entries_E - np.repeat(firsts, per_row)  # the document's number inside its row
        len_E = self.entry_len_E[entries_E]
        start_E = self.cache.offsets[self.entry_doc_E[entries_E]]
        # each entry's first column in its row: the lengths of the row's earlier entries
        before_E = np.cumsum(len_E) - len_E  # positions of all earlier entries of the batch
        col_E = before_E - np.repeat(before_E[np.cumsum(per_row) - per_row], per_row)
        pos_P = np.arange(int(len_E.sum())) - np.repeat(before_E, len_E)  # 0.. inside each document
        token_P = np.repeat(start_E, len_E) + pos_P
        flat_P = np.repeat(row_E * S + col_E, len_E) + pos_P
        inputs = np.zeros(B * S, dtype=np.int64)
        targets = np.full(B * S, IGNORE_INDEX, dtype=np.int64)
        inputs[flat_P] = self.cache.tokens[token_P]
        next_P = self.cache.tokens[token_P + 1].astype(np.int64)
        if self.cache.trained is not None:
            next_P = np.where(self.cache.trained[token_P + 1] > 0, next_P, IGNORE_INDEX)
        targets[flat_P] = next_P
        batch = Batch(torch.from_numpy(inputs.reshape(B, S)), torch.from_numpy(targets.reshape(B, S)))
        if self.packed:
            used_B = np.bincount(row_E, weights=len_E, minlength=B).astype(np.int64)
            positions = np.tile(np.arange(S), B) - np.repeat(used_B, S)  # padding: its own document from 0
            doc_ids = np.repeat(per_row, S)  # padding's id: one past the row's last document
            positions[flat_P] = pos_P
            doc_ids[flat_P] = np.repeat(slot_E, len_E)
            batch.positions = torch.from_numpy(positions.reshape(B, S))
            batch.document_ids = torch.from_numpy(doc_ids.reshape(B, S))
        return batch
