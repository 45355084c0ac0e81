"""Routing distributions: which experts each token picks.

Shape legend: T tokens, K top-k, E experts, R ranks. `topk_idx_TK` is int64, -1 = no expert.

A distribution is named by a string:
- 'uniform'      each token picks K distinct experts uniformly at random;
- 'zipf:A'       expert e has popularity ~ 1 / rank(e)^A (Zipf, exponent A); ranks are a seeded random
                 permutation of the experts, so hot experts land on random EP ranks;
- 'group'        group-limited routing (DeepSeek-V3, arXiv:2412.19437 sec. 2.1.2): experts split into
                 n_group groups, a token picks topk_group groups, then K experts inside them;
- a path         a routing log: .npy (numpy array), .pt (torch tensor, loaded lazily) or .jsonl
                 (one JSON list of K ids per line, or {"topk_idx": [[...], ...]} per line).
Sampling K distinct experts by weight uses the Gumbel-top-k trick (Kool et al. 2019, "Stochastic Beams
and Where to Find Them", sec. 3): top-K of log(p) + Gumbel noise is a draw without replacement.
"""

from __future__ import annotations

import json
import os

import numpy as np

BUILTIN = ("uniform", "zipf:A", "group")


def _topk_by_score(score_TE: np.ndarray, k: int) -> np.ndarray:
    # argpartition is O(E) per token; the order inside the top-k does not matter for byte counts
    return np.argpartition(-score_TE, k - 1, axis=1)[:, :k].astype(np.int64)


CHUNK = 8192  # tokens sampled at a time, so a [chunk, E] score matrix stays a few tens of MB


def sample_topk(dist: str, num_tokens: int, num_experts: int, top_k: int, seed: int = 0,
                n_group: int = 1, topk_group: int = 1) -> np.ndarray:
    """Draw topk_idx_TK for `num_tokens` tokens from a named distribution (see module doc)."""
    rng = np.random.default_rng(seed)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be between 1 and num_experts ({num_experts}); lower top_k")
    logp_E = np.zeros(num_experts, dtype=np.float32)
    if dist.startswith("zipf"):
        exponent = parse_zipf(dist)
        rank_E = rng.permutation(num_experts) + 1
        logp_E = (-exponent * np.log(rank_E)).astype(np.float32)
    elif dist == "group":
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(
                f"routing 'group' needs n_group ({n_group}) dividing num_experts ({num_experts}) and "
                f"1 <= topk_group ({topk_group}) <= n_group; use --routing uniform for this model"
            )
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"top_k ({top_k}) exceeds topk_group*experts_per_group; use --routing uniform")
    elif dist != "uniform":
        raise ValueError(
            f"--routing = {dist!r} is not one of {list(BUILTIN)} and not an existing .npy/.pt/.jsonl file; "
            "pass e.g. 'uniform', 'zipf:1.2', 'group' or a routing log path"
        )
    out_TK = np.empty((num_tokens, top_k), dtype=np.int64)
    for start in range(0, num_tokens, CHUNK):
        n = min(CHUNK, num_tokens - start)
        u_TE = rng.random((n, num_experts), dtype=np.float32)
        # Gumbel noise -log(-log u); for 'uniform' any iid noise would do, the transform keeps one path
        score_TE = -np.log(-np.log(np.clip(u_TE, 1e-12, 1 - 1e-7))) + logp_E
        if dist == "group":
            per_group = num_experts // n_group
            chosen_TG = _topk_by_score(rng.random((n, n_group), dtype=np.float32), topk_group)
            allowed_TG = np.zeros((n, n_group), dtype=bool)
            np.put_along_axis(allowed_TG, chosen_TG, True, axis=1)
            score_TE = np.where(np.repeat(allowed_TG, per_group, axis=1), score_TE, -np.inf)
        out_TK[start:start + n] = _topk_by_score(score_TE, top_k)
    return out_TK


def parse_zipf(dist: str) -> float:
    try:
        exponent = float(dist.split(":", 1)[1])
    except (IndexError, ValueError):
        raise ValueError(f"--routing = {dist!r}: write the Zipf exponent as 'zipf:1.2'") from None
    if exponent < 0:
        raise ValueError(f"--routing = {dist!r}: the Zipf exponent must be >= 0")
    return exponent


def load_routing_log(path: str) -> np.ndarray:
    """Read a routing log into topk_idx_TK (int64). Extra leading dims (layers, ranks) are flattened."""
    if not os.path.exists(path):
        raise ValueError(
            f"--routing = {path!r} is not one of {list(BUILTIN)} and no such routing log exists; pass "
            "'uniform', 'zipf:1.2', 'group' or an existing .npy/.pt/.jsonl file"
        )
    if path.endswith(".npy"):
        arr = np.load(path)
    elif path.endswith(".pt"):
        import torch  # only for .pt logs written by a moeflow training run

        arr = torch.load(path, map_location="cpu").numpy()
    elif path.endswith(".jsonl"):
        rows = []
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                item = json.loads(line)
                item = item["topk_idx"] if isinstance(item, dict) else item
                rows.extend(item if item and isinstance(item[0], list) else [item])
        arr = np.asarray(rows)
    else:
        raise ValueError(f"routing log {path!r}: unknown file type; use .npy, .pt or .jsonl")
    arr = np.asarray(arr, dtype=np.int64)
    if arr.ndim < 2:
        raise ValueError(f"routing log {path!r} has shape {arr.shape}; expected [..., T, K] top-k ids")
    return arr.reshape(-1, arr.shape[-1])


def get_routing(dist: str, num_tokens: int, num_experts: int, top_k: int, seed: int = 0,
                n_group: int = 1, topk_group: int = 1) -> np.ndarray:
    """topk_idx_TK from a named distribution or a log file (a log is tiled/truncated to num_tokens)."""
    if dist in ("uniform", "group") or dist.startswith("zipf"):
        return sample_topk(dist, num_tokens, num_experts, top_k, seed, n_group, topk_group)
    log_TK = load_routing_log(dist)
    if log_TK.max() >= num_experts:
        raise ValueError(
            f"routing log {dist!r} names expert {int(log_TK.max())} but the model has {num_experts} "
            "experts; pass the log of this model"
        )
    reps = -(-num_tokens // len(log_TK))
    return np.tile(log_TK, (reps, 1))[:num_tokens]
