"""DeepSpeed's AutoEP, the expert-parallel peer of bench/hf_ep.py, in a venv of its own (never a moeflow dependency).

AutoEP (DeepSpeed >= 0.19.2; `"expert_parallel": {"enabled": true, "autoep_size": N, "preset_model": ...}` in the
DeepSpeed config, applied by `deepspeed.initialize`) replaces each MoE block of a transformers model of a family it
has a preset for (mixtral, qwen3_moe / qwen2_moe, qwen3_5_moe, deepseek_v2, deepseek_v3; not gpt-oss) by its own
expert-parallel layer: all-to-all token dispatch over gloo, grouped matmuls (`torch._grouped_mm`) on the local
experts. Its venv, bench/.venv-autoep: torch==2.13.0 (CPU), deepspeed==0.19.8 and transformers==5.22.2 (DeepSpeed
0.19.8's presets call transformers' output-capturing registry as it was before 5.23).

    bench/.venv-autoep/bin/python bench/hf_ep_autoep.py FOLDER OUT_DIR REPEATS   # what bench/hf_ep.py runs

Each of 2 gloo ranks loads FOLDER, trains with ZeRO stage 0 (AutoEP's experts split over the 2 ranks, the rest
replicated, gradients all-reduced) and torch's fused AdamW (bench/hf_ep.py's other cases take the same), on the
batch bench/hf_ep.py gives the same rank, and writes OUT_DIR/autoep_rank{r}.json: its first loss, its median step
and its peak resident memory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "bench" / ".venv-autoep"
PY = VENV / "bin" / "python"
PINS = ["deepspeed==0.19.8", "transformers==5.22.2", "numpy"]
ENV = {"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}


def ensure_venv() -> None:
    """bench/.venv-autoep, made once (torch pinned first: an unpinned one would pull a CUDA build)."""
    env = dict(os.environ, **ENV)
    if not PY.exists():
        py = shutil.which("python3.11") or sys.executable
        print(f"making {VENV} (torch==2.13.0, {', '.join(PINS)})", flush=True)
        subprocess.run([py, "-m", "venv", str(VENV)], check=True)
        pip = [str(PY), "-m", "pip", "install", "--quiet"]
        subprocess.run(pip + ["torch==2.13.0"], check=True, env=env)
        subprocess.run(pip + PINS, check=True, env=env)


def run(folder: Path, out: Path, repeats: int, batch: int, seq: int) -> None:
    """Train `folder` under AutoEP on 2 ranks from the main venv: the results land in `out`."""
    ensure_venv()
    subprocess.run([str(PY), __file__, str(folder), str(out), str(repeats), str(batch), str(seq)], check=True,
                   env=dict(os.environ, **ENV, OMP_NUM_THREADS="1"))


def _worker(rank: int, folder: str, out: str, repeats: int, batch: int, seq: int) -> None:
    import json
    import resource
    import statistics
    import time

    import deepspeed
    import torch
    import torch.nn.functional as F
    import transformers

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=f"file://{out}/autoep_store",
                               rank=rank, world_size=2, verbose=False)
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    vocab = model.config.vocab_size
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0},
              "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": model.config.model_type,
                                  "use_grouped_mm": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True))
    gen = torch.Generator().manual_seed(100 + rank)  # bench/hf_ep.py's batch of this rank
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        logits = engine(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t0, float(loss)

    first = step()[1]
    step()  # a second warm-up step, as bench/hf_ep.py's cases take
    times = [step()[0] for _ in range(repeats)]
    Path(out, f"autoep_rank{rank}.json").write_text(json.dumps(
        {"first_loss": first, "median_s": statistics.median(times),
         "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    import torch.multiprocessing as mp

    folder, out, repeats, batch, seq = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    mp.spawn(_worker, args=(folder, out, repeats, batch, seq), nprocs=2, join=True)
