"""The Hugging Face coverage matrix (tests/e2e/hf_coverage.py) on two gloo ranks: every capability of every
architecture found is "ok" or a one-line refusal, never a failure, and agrees with the committed results file
that README.md's table is rendered from (bench/results/hf_coverage.json).

CI runs two of the architectures the README names (the families users bring most), three whose pipeline stages
hand on more than the hidden states and Gemma 4, whose layers compute their MoE themselves; the slow test runs all and
also checks that the committed file lists exactly the architectures the installed transformers has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.e2e.hf_coverage import CAPABILITIES, matrix  # noqa: E402
from tests.support.hf_tiny import moe_architectures  # noqa: E402

COMMITTED = Path(__file__).resolve().parents[2] / "bench" / "results" / "hf_coverage.json"
# the README's named families; CI runs the first two (the slow test runs every architecture)
NAMED = ["gpt_oss", "deepseek_v2", "glm4_moe", "qwen2_moe", "glm4_moe_lite", "granitemoeshared", "phimoe",
         "qwen3_next", "jamba", "minimax"]
IN_CI = NAMED[:2]


def _check(cells: dict) -> None:
    committed = json.loads(COMMITTED.read_text())["cells"]
    failed = {arch: row["error"] for arch, row in cells.items() if "error" in row}
    assert not failed, f"architectures that failed a check: {failed}"
    for arch, row in cells.items():
        assert set(row) == set(CAPABILITIES), arch
        for capability, value in row.items():
            assert value == "ok" or "\n" not in value, f"{arch} {capability}: a refusal is one line: {value!r}"
        was = {c: v == "ok" for c, v in committed.get(arch, {}).items()}
        assert was == {c: v == "ok" for c, v in row.items()}, (
            f"{arch}: the matrix says {row}, bench/results/hf_coverage.json says {committed.get(arch)}; rerun "
            f"`python -m tests.e2e.hf_coverage --out bench/results` and `python bench/readme_figures.py`")


@pytest.mark.timeout(400)
def test_named_architectures_train_export_and_generate():
    cells = matrix(IN_CI)
    _check(cells)
    for arch in IN_CI:  # what the README promises of each
        assert all(cells[arch][c] == "ok" for c in ("ep=2", "read", "dp=2", "export", "generate")), arch


@pytest.mark.timeout(400)
def test_pipeline_stages_hand_on_more_than_the_hidden_states():
    """pp=2 (against one process, with every other capability) where a stage boundary carries more than [B, S, D]:
    GLM-MoE-DSA's indexer selection (integers, no gradient), Zaya's router states (with a gradient) beside its input
    scale on the first stage, DeepSeek-V4's hyper-connection streams [B, S, hc, D] with its head on the last stage
    and its hash routing handed the token ids on every stage."""
    cells = matrix(["glm_moe_dsa", "zaya", "deepseek_v4"])
    _check(cells)
    assert {arch: row["pp=2"] for arch, row in cells.items()} == dict.fromkeys(cells, "ok")


@pytest.mark.timeout(200)
def test_a_layer_that_computes_its_moe_itself_takes_every_layout():
    """Gemma 4 (its MoE release's shape): each layer runs its router and experts on `residual.reshape(-1, D)` in
    its own forward, beside a dense MLP, so under tp=2 the layer runs on its tp rank's sequence slice with its
    attention and MLP gathering the sequence; its layers pass a key-value sharing dict that this config never fills,
    so pp=2 splits it. Each against one process (losses, gradient norms)."""
    cells = matrix(["gemma4"])
    _check(cells)
    assert cells["gemma4"] | {"native": "ok"} == dict.fromkeys(CAPABILITIES, "ok")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_architecture_of_the_installed_transformers():
    found = sorted(a for a, cls in moe_architectures().items() if cls)
    assert found == sorted(json.loads(COMMITTED.read_text())["cells"]), (
        "the installed transformers has other MoE architectures than bench/results/hf_coverage.json; rerun "
        "`python -m tests.e2e.hf_coverage --out bench/results`")
    _check(matrix(found))
