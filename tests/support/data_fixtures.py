"""Tiny chat data for the data tests: a byte-level BPE tokenizer with a ChatML-style template (written here, with
`{% generation %}` markers so transformers can compute the assistant mask itself), and random conversations whose
lengths and assistant shares differ a lot (uneven loss masks)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the cat sat on a mat while dogs ran far away . how are you today ? fine thanks , and you ! "
         "numbers 1 2 3 4 5 6 7 8 9 10 plus minus equals café déjà vu naïve über").split()

# system/user turns end with <|im_end|> and a newline; an assistant turn's whole text (end marker included) is its
# generation span, which is what it is trained to produce.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def sentence(rng: random.Random, lo: int = 2, hi: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_chat_tokenizer(folder: Path, vocab_size: int = 300, template: str | None = TEMPLATE) -> Path:
    """A byte-level BPE tokenizer saved by transformers (tokenizer.json + tokenizer_config.json + template)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    tok.train_from_iterator([sentence(rng) for _ in range(300)] + ["user assistant system\n"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>",
                                                pad_token="<|endoftext|>")
    if template:
        fast.chat_template = template
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


def conversations(n: int, seed: int = 0) -> list[dict]:
    """n records {'messages': [...]}: some with a system turn, 1-3 exchanges, replies of very different lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(rng, 1, 4)}] if rng.random() < 0.4 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": sentence(rng, 1, 10)})
            messages.append({"role": "assistant", "content": sentence(rng, 1, 14)})
        out.append({"messages": messages})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path
