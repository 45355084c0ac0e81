"""Pipeline stages of a transformers model whose later layers read earlier layers' keys and values through the
dict transformers' key-value sharing passes every layer (Gemma 4's last `num_kv_shared_layers` layers): a split
that keeps each reader on its source's stage trains the one-process run on two gloo ranks; one that parts them is
refused in one line before anything is built (tests/train/test_hf_transformers_path.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.support.dist_harness import check_results, launch  # noqa: E402


def _sharing_gemma4():
    import transformers

    from tests.support.hf_tiny import randomize, tiny_config

    # six layers, sliding and full in turn; 4 and 5 read the keys and values of 2 and 3 (the last of each type)
    config = tiny_config("gemma4", num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                         num_kv_shared_layers=2)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    randomize(model, 0)
    return model


def run_case(_, case):
    import torch

    import moeflow
    from tests.e2e import hf_coverage as hc

    model = _sharing_gemma4()
    assert model.model.layers[4].self_attn.is_kv_shared_layer
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (2, hc.S + 1), generator=gen) for _ in range(hc.STEPS)]
    hc._train_pipeline(model, moeflow.ParallelDims(2, pp=2, pp_schedule="GPipe"), batches, boundaries=case[1])


@pytest.mark.timeout(120)
def test_a_split_that_keeps_readers_with_their_sources_trains_the_one_process_run():
    cases = [("layers 0-1 | 2-5", (0, 2))]
    check_results(launch(2, cases, run_case, timeout_s=90), cases)
