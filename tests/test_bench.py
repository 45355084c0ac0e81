"""The figures the READMEs show are the committed benchmark output (bench/results/*.json), and the benchmark
scripts take the names the READMEs use."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from tests.support.cli import REPO

BENCH = REPO / "bench"


def _bench_script(name: str):
    """A bench/ script as a module (bench/ is a folder of scripts, not a package). Registered under its name, as the
    scripts import each other by it (`from moe_layer import ...`) when run from bench/."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


readme_figures = _bench_script("readme_figures")


def test_readme_figures_equal_the_committed_benchmark_output():
    assert readme_figures.stale_blocks() == []


def test_a_changed_figure_is_caught():
    texts = {f: (readme_figures.REPO / f).read_text() for f in ("README.md", "bench/README.md")}
    for name, (file, _, _) in readme_figures.BLOCKS.items():
        block = readme_figures._pattern(name).search(texts[file])
        digit = next(i for i, c in enumerate(block.group(2)) if c.isdigit())
        start = block.start(2) + digit
        changed = texts[file][:start] + str((int(texts[file][start]) + 1) % 10) + texts[file][start + 1:]
        assert [s.split()[0] for s in readme_figures.stale_blocks({**texts, file: changed})] == [name]
    removed = texts["bench/README.md"].replace("<!-- bench:train_layouts -->", "")
    assert "no <!-- bench:train_layouts -->" in readme_figures.stale_blocks({**texts, "bench/README.md": removed})[0]


def test_bench_archs_take_the_names_the_readme_uses():
    pytest.importorskip("transformers")
    moe_layer = _bench_script("moe_layer")
    hf_models = _bench_script("hf_models")

    assert moe_layer.parse_args(["--archs", "Qwen3-MoE,mixtral,OLMoE,deepseek-v3,qwen3_moe"]).archs == [
        "qwen3_moe", "mixtral", "olmoe", "deepseek_v3"]
    assert moe_layer.parse_args(["--archs", ""]).archs == []
    assert hf_models.parse_args(["--archs", "Llama 3,Qwen3,DeepSeek-V3"]).archs == ["llama", "qwen3", "deepseek_v3"]
    with pytest.raises(ValueError, match=r"unknown architecture 'Qwen2'; choose from Qwen3-MoE \(qwen3_moe\)"):
        moe_layer.parse_archs("Qwen2", moe_layer.ARCHS)
    import torch

    if not torch.cuda.is_available():  # one line naming the option, not a traceback from the first CUDA call
        with pytest.raises(SystemExit):
            moe_layer.parse_args(["--device", "cuda"])
        with pytest.raises(SystemExit):
            _bench_script("gpu_measure").main(["--device", "cuda"])


@pytest.mark.slow  # 60 s: make test runs it, CI does not
def test_gpu_smoke_script_runs_on_a_cpu():
    """bench/gpu_smoke.py --device cpu (how the GPU smoke script is kept working without a GPU): every check passes
    or skips, one line each, exit 0; the shell wrapper says it skipped on a machine without CUDA."""
    import subprocess

    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, str(BENCH / "gpu_smoke.py"), "--device", "cpu"], capture_output=True,
                         text=True, timeout=300, cwd=BENCH.parent, env=env)
    lines = [ln for ln in run.stdout.splitlines() if ln.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    assert run.returncode == 0 and lines and not any(ln.startswith("FAIL") for ln in lines), run.stdout + run.stderr
    names = {ln.split(" ", 2)[1].split("[")[0].rstrip(":") for ln in lines}
    assert {"info", "moe_block", "ep_world1", "ep_no_host_sync", "fsdp_bf16_world1", "train_bf16", "offload",
            "hf_parity",
            "masked_gqa_attention"} <= names, names
    if not torch.cuda.is_available():
        shell = subprocess.run(["bash", str(BENCH / "gpu_smoke.sh")], capture_output=True, text=True, timeout=120,
                               env={**env, "PYTHON": sys.executable})
        assert shell.returncode == 0 and shell.stdout.strip() == "no CUDA device: skipped", shell.stdout


@pytest.mark.slow  # 25 s: make test runs it, CI does not
def test_gpu_measure_script_runs_on_a_cpu(tmp_path):
    """bench/gpu_measure.py --device cpu: the three parts at toy sizes each run and leave their figures in the JSON
    (the moe block's agreement, the trainer's tokens/s, FP8's loss differences); a part that fails is reported as
    failed with its last line, and the others still run; the shell wrapper skips without CUDA."""
    import json
    import subprocess

    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, str(BENCH / "gpu_measure.py"), "--device", "cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=BENCH.parent, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    parts = json.loads((tmp_path / "gpu_measure.json").read_text())["parts"]
    assert [p["rc"] for p in parts.values()] == [0, 0, 0], parts
    assert parts["moe_layer"]["figures"]["outputs_agree"] is True
    train = parts["train"]["figures"]
    assert train["tokens_per_s"] > 0 and train["timed_steps"] == 2 and "mfu" not in train  # no peak FLOP/s on a CPU
    assert {"tiny-dense tensorwise", "tiny-dense rowwise"} <= set(parts["fp8"]["figures"])
    assert "===== summary" in (tmp_path / "gpu_measure.log").read_text()

    # a part that fails: the train part with a setting the trainer refuses
    gm = _bench_script("gpu_measure")
    part = gm.run_part("train", [sys.executable, "-m", "moeflow", "train", "--training.steps=-1"],
                       tmp_path / "failed.log", 60)
    assert part["rc"] != 0 and "training.steps" in part["error"], part
    assert gm.summary_lines({"train": part})[0].startswith("train: FAILED")
    # a part out of its time: killed, rc 124, its last line kept
    part = gm.run_part("slow", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"],
                       tmp_path / "slow.log", 2)
    assert part["rc"] == 124 and part["error"] == "out of its 2 s (last line: started)" and part["seconds"] < 10
    if not torch.cuda.is_available():
        shell = subprocess.run(["bash", str(BENCH / "gpu_measure.sh")], capture_output=True, text=True, timeout=120,
                               env={**env, "PYTHON": sys.executable})
        assert shell.returncode == 0 and shell.stdout.strip() == "no CUDA device: skipped", shell.stdout
