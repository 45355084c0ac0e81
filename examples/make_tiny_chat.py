"""Write a tiny Hugging Face chat model and a chat dataset to fine-tune it on, for trying `moeflow train` with
configs/sft.toml on a laptop (no download).

    python examples/make_tiny_chat.py data/                   # data/tiny-qwen3-moe/, data/chat.jsonl, chat-val.jsonl
    python examples/make_tiny_chat.py data/ --arch gpt_oss    # data/tiny-gpt-oss/ (transformers' modules train it)
    python examples/make_tiny_chat.py data/ --arch glm4_moe   # data/tiny-glm4-moe/: GLM-4.5's shape

The model is a randomly initialised MoE (4 layers, 8 experts, top-2) saved by transformers, with a byte-level
BPE tokenizer and a ChatML chat template; the conversations ask for sums and products of small numbers and the
assistant answers in one fixed sentence, which a tiny model learns in a few hundred steps.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# --arch -> (config class, its expert settings): 8 experts, top-2, experts of width 128
ARCHS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=256, moe_intermediate_size=128, num_experts=8,
                                         num_experts_per_tok=2)),
    # attention sinks, alternating sliding-window layers, biased experts with clamped SwiGLU
    # (and YaRN's RoPE, its factor of 32 stretching 16 positions to the folder's 512, as gpt-oss's stretches 4,096)
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                                     sliding_window=64, rope_parameters=dict(
                                         rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=16, rope_theta=150000.0))),
    # GLM-4.5: a dense first layer, a shared expert, sigmoid routing, RoPE on half of each head, q/k/v biases
    "glm4_moe": ("Glm4MoeConfig", dict(intermediate_size=256, moe_intermediate_size=128, n_routed_experts=8,
                                       num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                       attention_bias=True, num_mtp_layers=0)),
}


def conversation(rng: random.Random) -> dict:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    op, word, result = rng.choice([("+", "plus", a + b), ("*", "times", a * b)])
    question = rng.choice([f"what is {a} {word} {b} ?", f"compute {a} {op} {b}", f"{a} {word} {b} = ?"])
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": f"{a} {word} {b} is {result} ."}]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen3_moe")
    args = ap.parse_args()
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    train = [conversation(rng) for _ in range(2000)]
    val = [conversation(rng) for _ in range(100)]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, records in (("chat.jsonl", train), ("chat-val.jsonl", val)):
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in records))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for r in train for m in r["messages"]] + ["user\nassistant\nsystem\n"] * 50
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", chat_template=TEMPLATE)
    folder = args.out / f"tiny-{args.arch.replace('_', '-')}"
    shape = dict(vocab_size=320, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, max_position_embeddings=512, eos_token_id=fast.eos_token_id,
                 pad_token_id=fast.pad_token_id, bos_token_id=None, tie_word_embeddings=False)
    config = getattr(transformers, ARCHS[args.arch][0])(**shape, **ARCHS[args.arch][1])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    print(f"wrote {folder} ({sum(1 for _ in folder.iterdir())} files), {args.out / 'chat.jsonl'} ({len(train)} "
          f"conversations), {args.out / 'chat-val.jsonl'} ({len(val)})")


if __name__ == "__main__":
    main()
