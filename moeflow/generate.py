"""`moeflow generate`: text from a trained run or a Hugging Face folder, streamed to the terminal.

  moeflow generate --run-dir runs/sft --chat "How are you?"
  moeflow generate --hf-path ~/models/Qwen3-0.6B --prompt "The capital of France is" --temperature 0

A KV cache (moeflow.models.kv_cache; for DeepSeek-V3's latent attention the compressed latent) makes each new
token one forward of one position; --no-cache recomputes the whole sequence every step (the reference). Sampling:
temperature 0 is greedy; otherwise softmax(logits / temperature) restricted to the smallest set of tokens whose
probability reaches --top-p (nucleus sampling, Holtzman et al. 2020), drawn with a generator seeded by --seed.
Generation stops at --max-new-tokens or at an end-of-sequence id (generation_config.json, else config.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# ---- loading ----------------------------------------------------------------------------------------------------


def load_model(run_dir: str | None = None, hf_path: str | None = None, dtype: str = "fp32", device: str = "cpu",
               hf_impl: str = "auto"):
    """(model in eval mode, ModelConfig, folder of the tokenizer files or None, eos ids) from a run directory
    (its newest complete checkpoint, or a checkpoints/step-N folder) or a Hugging Face folder (run by the code
    `hf_impl` chooses: model.hf_impl)."""
    import torch

    torch_dtype = getattr(torch, DTYPES[dtype])
    if bool(run_dir) == bool(hf_path):
        raise ValueError("give exactly one of --run-dir (a moeflow run) or --hf-path (a Hugging Face folder)")
    from moeflow.models import hf_transformers

    if hf_path:
        from moeflow.core.model_config import ModelConfig
        from moeflow.models.hf import from_pretrained, training_config

        cfg = training_config(ModelConfig(hf_path=str(hf_path), hf_impl=hf_impl))
        if cfg.runs_transformers:
            model = hf_transformers.load(hf_path, device).to(torch_dtype)
            return hf_transformers.GenerationModel(model, cfg).eval(), cfg, Path(hf_path), eos_ids(Path(hf_path))
        model, cfg = from_pretrained(hf_path, dtype=torch_dtype, device=device)
        return model.eval(), cfg, Path(hf_path), eos_ids(Path(hf_path))
    from moeflow.config import load_config
    from moeflow.convert import _find_checkpoint, native_model, transformers_model
    from moeflow.models.hf import read_hf_config

    checkpoint, run = _find_checkpoint(Path(run_dir))
    if not (run / "config.toml").is_file():
        raise ValueError(f"{run} has no config.toml; pass a run directory written by moeflow train or convert")
    job = load_config(run / "config.toml", given=())
    cfg, origin = job.model, run
    if cfg.runs_transformers:  # transformers' own model, with the run's weights
        origin = Path(cfg.hf_path)
        model = hf_transformers.GenerationModel(transformers_model(job, checkpoint, device).to(torch_dtype), cfg)
        return model.eval(), cfg, tokenizer_folder(job, run, origin), eos_ids(origin) or eos_ids(run)
    if cfg.hf_path:  # a run that started from a Hugging Face folder trained that folder's architecture
        _, cfg = read_hf_config(cfg.hf_path)
        origin = Path(cfg.hf_path)
    model = native_model(job, cfg, checkpoint, torch_dtype, device)
    return model.eval(), cfg, tokenizer_folder(job, run, origin), eos_ids(origin) or eos_ids(run)


def tokenizer_folder(job, run: Path, origin: Path) -> Path | None:
    """Where the run's tokenizer files are: data.tokenizer's folder (for 'auto', the tokenizer.json beside the
    training data, as training found it), the Hugging Face folder it started from, or the run directory itself
    (moeflow convert hf-to-moeflow copies them there)."""
    from moeflow.data.tokenizer import tokenizer_json_near

    spec = job.data.tokenizer
    if spec == "auto":
        near = tokenizer_json_near(job.data.source)
        candidates = [Path(near).parent] if near else []
    else:
        candidates = [] if spec == "byte" else [Path(spec).parent if Path(spec).is_file() else Path(spec)]
    candidates += [origin, run]
    for folder in candidates:
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            return folder
    return None


def eos_ids(folder: Path) -> list[int]:
    """End-of-sequence ids from generation_config.json, else config.json / hf_config.json."""
    for name in ("generation_config.json", "config.json", "hf_config.json"):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return [int(v) for v in (value if isinstance(value, list) else [value])]
    return []


class TextCodec:
    """encode / decode / chat prompt over whichever tokenizer the model has: transformers' (with its chat template),
    a bare tokenizer.json, or bytes."""

    def __init__(self, folder: Path | None):
        self.hf = None
        self.plain = None
        if folder is not None and (folder / "tokenizer_config.json").is_file():
            import transformers

            transformers.logging.set_verbosity_error()
            self.hf = transformers.AutoTokenizer.from_pretrained(str(folder))
        else:
            from moeflow.data.tokenizer import ByteTokenizer, HFTokenizer

            tok_json = folder / "tokenizer.json" if folder is not None else None
            self.plain = HFTokenizer(tok_json) if tok_json is not None and tok_json.is_file() else ByteTokenizer()

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text)["input_ids"]) if self.hf is not None else self.plain.encode(text)

    def chat(self, user: str, system: str = "") -> list[int]:
        if self.hf is None or not getattr(self.hf, "chat_template", None):
            raise ValueError("--chat needs a tokenizer with a chat template (tokenizer_config.json or "
                             "chat_template.jinja beside the model); use --prompt for plain text")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(ids, skip_special_tokens=True)
        return self.plain.decode(ids)


# ---- generation ---------------------------------------------------------------------------------------------------


def pick(logits_V, temperature: float, top_p: float, generator) -> int:
    """The next token: greedy at temperature 0, else a nucleus sample."""
    import torch

    if temperature <= 0:
        return int(logits_V.argmax())
    probs_V = torch.softmax(logits_V.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs_V.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # probability of the tokens ranked above each one
        sorted_p[before >= top_p] = 0.0  # the first token is always kept (nothing ranks above it)
        probs_V = torch.zeros_like(probs_V).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs_V.cpu(), 1, generator=generator))


def generate(model, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, use_cache: bool = True, eos: list[int] | tuple = (),
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """The new token ids (at most max_new_tokens; the eos id that ended them included)."""
    import torch

    from moeflow.models.kv_cache import KVCache

    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token")
    limit = model.cfg.max_seq_len
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens ({max_new_tokens}) exceed the "
                         f"model's max_seq_len ({limit}); shorten the prompt or generate fewer tokens")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(len(prompt_ids) + max_new_tokens) if use_cache else None
    ids = list(prompt_ids)
    new: list[int] = []
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=device), cache=cache)[0, -1]
        for _ in range(max_new_tokens):
            token = pick(logits, temperature, top_p, generator)
            new.append(token)
            ids.append(token)
            if on_token is not None:
                on_token(token)
            if token in eos or len(new) == max_new_tokens:
                break
            step_in = [[token]] if cache is not None else [ids]  # without a cache: the whole sequence again
            logits = model(torch.tensor(step_in, device=device), cache=cache)[0, -1]
    return new


class Streamer:
    """Prints decoded text as tokens arrive: decodes the prompt and everything so far and writes what is new (so
    word-level tokenizers get their spaces), holding back an incomplete character (a multi-byte character split
    over tokens decodes to U+FFFD until it is whole). `echo` prints the prompt first."""

    def __init__(self, codec: TextCodec, prompt_ids: list[int], echo: bool, out=None):
        self.codec, self.out, self.ids = codec, out or sys.stdout, list(prompt_ids)
        prompt = codec.decode(self.ids)
        self.shown = 0 if echo else len(prompt)
        self._write(prompt)

    def _write(self, text: str) -> None:
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        self._write(self.codec.decode(self.ids))


# ---- command line -------------------------------------------------------------------------------------------------


def add_model_source(p: argparse.ArgumentParser) -> None:
    """--run-dir or --hf-path: where `load_model` finds the model (moeflow generate and moeflow eval)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="a moeflow run directory (its newest complete checkpoint) or a step-N folder")
    src.add_argument("--hf-path", help="a Hugging Face model folder (config.json + safetensors)")
    from moeflow.core.choices import HF_IMPLS

    p.add_argument("--hf-impl", choices=HF_IMPLS, default="auto",
                   help="with --hf-path: moeflow's model ('native', where it maps the architecture), transformers' "
                        "own modules, or 'auto' (native where it maps)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeflow generate", description="Generate text with a moeflow run or a Hugging "
                                "Face folder, streaming it to the terminal.")
    add_model_source(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="plain text to continue")
    what.add_argument("--chat", help="a user message, wrapped in the tokenizer's chat template")
    p.add_argument("--system", default="", help="with --chat: a system message")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95; 1 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (no KV cache)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto (CUDA when present)")
    p.add_argument("--ids", action="store_true", help="also print the generated token ids (one JSON line)")
    return p


def main(argv: list[str]) -> int:
    from moeflow.train.distributed import choose_device

    args = _parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens = {args.max_new_tokens}; give at least 1")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p = {args.top_p}; give a probability mass in (0, 1]")
    device = choose_device(args.device, 1, "--device")
    model, _, folder, eos = load_model(args.run_dir, args.hf_path, args.dtype, device, args.hf_impl)
    codec = TextCodec(folder)
    prompt = codec.chat(args.chat, args.system) if args.chat is not None else codec.encode(args.prompt)
    streamer = Streamer(codec, prompt, echo=args.prompt is not None)
    t0 = time.perf_counter()
    new = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   seed=args.seed, use_cache=not args.no_cache, eos=eos, on_token=streamer)
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n")
    if args.ids:
        print(json.dumps({"prompt_ids": prompt, "new_ids": new}))
    print(f"[{len(new)} tokens in {elapsed:.2f} s, {len(new) / elapsed:,.1f} tokens/s, "
          f"{'KV cache' if not args.no_cache else 'no cache'}]", file=sys.stderr)
    return 0
