"""The README walkthrough's starting point, `examples/make_tiny_chat.py`: each --arch writes a folder that
transformers loads without a warning and that `moeflow train` takes (the config checked, as before a launch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from moeflow.config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARCHS = {"qwen3_moe": "tiny-qwen3-moe", "gpt_oss": "tiny-gpt-oss", "glm4_moe": "tiny-glm4-moe"}


def test_each_tiny_chat_folder_loads_without_a_warning_and_trains(tmp_path):
    # one interpreter for the three (start-up dominates); each folder then loaded by transformers in it
    script = "; ".join([
        "import runpy, sys, transformers",
        *(f"sys.argv = ['make_tiny_chat.py', {str(tmp_path)!r}, '--arch', {arch!r}]; "
          f"runpy.run_path({str(REPO / 'examples' / 'make_tiny_chat.py')!r}, run_name='__main__')" for arch in ARCHS),
        *(f"transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / name)!r})" for name in ARCHS.values()),
    ])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "transformers" in line.lower() or "warn" in line.lower()]
    assert not [line for line in said if "torchao" not in line and "Enum" not in line], said
    assert len((tmp_path / "chat.jsonl").read_text().splitlines()) == 2000
    assert "messages" in json.loads((tmp_path / "chat-val.jsonl").read_text().splitlines()[0])
    for arch, name in ARCHS.items():
        overrides = {"model.hf_path": str(tmp_path / name), "data.source": str(tmp_path / "chat.jsonl"),
                     "data.format": "chat", "parallel.ep": 2}
        cfg = load_config(REPO / "configs" / "sft.toml", overrides)
        dims, _ = cfg.layout(2)
        assert dims.ep == 2 and cfg.model.runs_transformers == (arch != "qwen3_moe")
