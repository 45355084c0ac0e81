"""Packed documents (positions restart, attention inside each document) give every document the logits and loss it
gets alone, for grouped-query and latent attention; the KV cache (MLA's compressed one included) gives the logits of
the full forward, also when a chunk follows cached positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeflow.core.model_config import ModelConfig
from moeflow.models.attention import document_causal_mask
from moeflow.models.kv_cache import KVCache
from moeflow.models.transformer import Transformer
from tests.support.model_helpers import MLA_SMALL, SMALL, small_moe

torch.set_num_threads(1)

CONFIGS = {
    "gqa": lambda: ModelConfig(**SMALL, n_kv_heads=2, qk_norm="per_head", moe=small_moe()),
    "mla": lambda: ModelConfig(**{**SMALL, **MLA_SMALL}, q_lora_rank=12, rope_interleave=True, moe=small_moe()),
}


def _model(name: str) -> Transformer:
    model = Transformer(CONFIGS[name]())
    model.init_weights(seed=3)
    return model.eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_equals_each_document_alone(name):
    model = _model(name)
    gen = torch.Generator().manual_seed(0)
    lengths = [[7, 1, 12, 4], [17, 3]]  # two rows of documents, the second padded to 24 positions
    S = 24
    rows, positions, doc_ids, docs = [], [], [], []
    for row in lengths:
        tokens, pos, ids = [], [], []
        for k, n in enumerate(row):
            doc = torch.randint(0, 64, (n + 1,), generator=gen)  # n inputs + the last target
            docs.append(doc)
            tokens += doc[:-1].tolist()
            pos += list(range(n))
            ids += [k] * n
        pad = S - len(tokens)
        rows.append(tokens + [0] * pad)
        positions.append(pos + list(range(pad)))
        doc_ids.append(ids + [len(row)] * pad)
    with torch.no_grad():
        packed = model(torch.tensor(rows), positions=torch.tensor(positions), document_ids=torch.tensor(doc_ids))
        d = 0
        for r, row in enumerate(lengths):
            start = 0
            for n in row:
                alone = model(docs[d][:-1].unsqueeze(0))[0]
                got = packed[r, start:start + n]
                torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
                loss_alone = F.cross_entropy(alone, docs[d][1:])
                torch.testing.assert_close(F.cross_entropy(got, docs[d][1:]), loss_alone, rtol=1e-6, atol=1e-6)
                start, d = start + n, d + 1
        # without the document mask the later documents see the earlier ones: the mask is what makes them equal
        unmasked = model(torch.tensor(rows), positions=torch.tensor(positions))
        assert (unmasked[0, 7:8] - packed[0, 7:8]).abs().max() > 1e-3


def test_document_mask_by_hand():
    mask = document_causal_mask(torch.tensor([[0, 0, 1, 1, 1]]))[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    # a context-parallel chunk: queries 3-4 against keys 0-4 by their global indices
    chunk = document_causal_mask(torch.tensor([[1, 1]]), torch.tensor([[0, 0, 1, 1, 1]]), torch.tensor([3, 4]),
                                 torch.arange(5))[0, 0].int().tolist()
    assert chunk == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kv_cache_equals_full_forward(name):
    model = _model(name)
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(11)
        pieces = [model(tokens[:, :4], cache=cache), model(tokens[:, 4:7], cache=cache)]  # a chunk after a prefix
        pieces += [model(tokens[:, i:i + 1], cache=cache) for i in range(7, 11)]  # then one token at a time
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 11
    if name == "mla":  # the compressed cache: the latent and the RoPE key only
        buffers = cache.layers["0"].buffers
        assert [b.shape[-1] for b in buffers] == [MLA_SMALL["kv_lora_rank"], MLA_SMALL["qk_rope_head_dim"]]
    with pytest.raises(ValueError, match="the KV cache holds 11 positions"):
        model(tokens[:, :1], cache=cache)
