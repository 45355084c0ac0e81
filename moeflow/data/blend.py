"""Weighted blends of several sources (`data.blend = "W1 SOURCE1 W2 SOURCE2 ..."`, Megatron's `--data-path`
syntax): which source each sequence of the run comes from is a deterministic schedule, not a draw.

Sequence n of the run (counting every rank's, step after step) comes from the source whose share is furthest
behind its weight after n sequences: argmax_k (w_k (n + 1) - c_k(n)), c_k(n) being how many of the first n came
from source k (ties to the first source) - the rule of Megatron's BlendedDataset, so after any number of
sequences every source is within one sequence of its weight. Inside a source the sequences are shuffled epoch
after epoch from the seed as a single source's are (moeflow.data.stream.BatchSampler), each source wrapping on its
own. The position is the sequences consumed, with how many came from each source (what the schedule gives after
that many, kept so a resume need not replay it), so a blend resumes exactly under any layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeflow.data.stream import Batch, BatchSampler


@dataclass
class BlendSource:
    name: str  # the data.source of this part of the blend
    weight: float  # normalised: the weights sum to 1
    data: object  # its training sequences (a token stream or a sequence source)


def schedule_counts(weights: np.ndarray, start: int, count: int, counts: np.ndarray) -> np.ndarray:
    """Sources of sequences [start, start + count) given `counts` (c_k(start)), updating `counts` in place."""
    out = np.empty(count, dtype=np.int64)
    for i in range(count):
        k = int(np.argmax(weights * (start + i + 1) - counts))
        out[i] = k
        counts[k] += 1
    return out


class BlendSampler:
    """BatchSampler's interface over a blend: each step's `global_batch` sequences in schedule order, rank r taking
    the contiguous slice [r * B / dp_size, (r + 1) * B / dp_size); every source's trained tokens are counted."""

    def __init__(self, sources: list[BlendSource], seq_len: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0):
        self.sources = sources
        self.weights = np.array([s.weight for s in sources], dtype=np.float64)
        # one shuffled stream per source, each from its own seed (its global batch size plays no part here)
        self.streams = [BatchSampler(s.data, seq_len, dp_size, 0, dp_size, seed + 7919 * k)
                        for k, s in enumerate(sources)]
        base = BatchSampler(sources[0].data, seq_len, global_batch, dp_rank, dp_size, seed)  # checks the sizes
        self.seq_len, self.global_batch, self.dp_rank, self.dp_size = seq_len, global_batch, dp_rank, dp_size
        self.local_batch, self.seed = base.local_batch, seed
        self.step, self.consumed = 0, 0
        self.counts = np.zeros(len(sources), dtype=np.int64)  # c_k(consumed)
        self.trained = [0] * len(sources)  # trained tokens per source so far (every rank's)

    def next_batch(self) -> Batch:
        before = self.counts.copy()
        which = schedule_counts(self.weights, self.consumed, self.global_batch, self.counts)
        lo, hi = self.dp_rank * self.local_batch, (self.dp_rank + 1) * self.local_batch
        parts, tokens = [], 0
        for k, stream in enumerate(self.streams):
            slots = np.flatnonzero(which == k)  # this step's sequences from source k: the next ones in its stream
            if not slots.size:
                continue
            ids = stream.window_ids(int(before[k]), slots.size)
            trained = stream.source.trained_tokens(ids)
            self.trained[k] += trained
            tokens += trained
            here = (slots >= lo) & (slots < hi)
            if here.any():
                parts.append((slots[here], stream.source.gather(ids[here])))
        batch = _in_order(parts, self.local_batch, lo)
        batch.global_tokens = tokens
        self.consumed += self.global_batch
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "consumed": self.consumed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "blend": [[s.name, s.weight] for s in self.sources],
                "data": [stream.source.key for stream in self.streams],
                "num_windows": [stream.num_windows for stream in self.streams], "trained": list(self.trained),
                "counts": self.counts.tolist()}  # c_k(consumed): derivable, but replaying the schedule is O(consumed)

    def load_state_dict(self, sd: dict) -> None:
        mine = [[s.name, s.weight] for s in self.sources]
        if sd.get("blend") != mine:
            raise ValueError(f"cannot resume the data sampler: the checkpoint's blend was {sd.get('blend')} but "
                             f"this run's is {mine}; resume with the same data.blend, or start a new run directory")
        for key, now in (("seed", self.seed), ("seq_len", self.seq_len),
                         ("num_windows", [s.num_windows for s in self.streams])):
            if sd[key] != now:
                raise ValueError(f"cannot resume the data sampler: {key} was {sd[key]} in the checkpoint but is "
                                 f"{now} now; resume with the same data and settings, or start a new run directory")
        self.step, self.consumed = int(sd["step"]), int(sd["consumed"])
        self.counts = np.array(sd["counts"], dtype=np.int64)
        self.trained = [int(t) for t in sd["trained"]]


def _in_order(parts: list[tuple[np.ndarray, Batch]], rows: int, first: int) -> Batch:
    """One Batch of `rows` rows from per-source pieces, each row at its place in the schedule."""
    order = np.concatenate([slots for slots, _ in parts]) - first
    fields = ("inputs", "targets", "positions", "document_ids")
    out = {}
    for name in fields:
        pieces = [getattr(b, name) for _, b in parts]
        if pieces[0] is None:
            out[name] = None
            continue
        stacked = torch.cat(pieces)
        placed = torch.empty_like(stacked)
        placed[torch.from_numpy(order)] = stacked
        out[name] = placed
    assert len(order) == rows
    return Batch(**out)
