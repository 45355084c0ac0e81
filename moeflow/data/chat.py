"""Chat records -> token ids and a mask of the tokens to train on (the assistant's), with the tokenizer's own
chat template (read by transformers from tokenizer_config.json or chat_template.jinja).

Which characters are the assistant's is found by rendering prefixes of the conversation, so it works with any
template, with or without `{% generation %}` markers: for the i-th message (an assistant turn) the span runs from
the end of `messages[:i]` rendered with the generation prompt (where the model starts writing) to the end of
`messages[:i + 1]` (its turn, end-of-turn marker included), each measured as the common prefix with the full
rendering (templates that rewrite earlier turns, e.g. drop old reasoning, stay correct). A token is trained when
its characters overlap such a span, which is how transformers maps `{% generation %}` spans to tokens for
`apply_chat_template(..., return_assistant_tokens_mask=True)`.

An instruction record (Alpaca: `instruction`, optional `input`, `output`) becomes a user turn and an assistant
turn first.
"""

from __future__ import annotations

import os
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool", "developer")


class RecordError(ValueError):
    """A record that cannot be used; `what` says why and how to fix it, the caller adds where it is."""


def instruction_to_messages(record: dict) -> list[dict]:
    """{'instruction', 'input'?, 'output', 'system'?} -> [system?, user, assistant]."""
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str):
            raise RecordError(f"has no string '{key}' field (data.format = 'instruction' needs 'instruction' and "
                              f"'output', 'input' optional); fix the record or choose another data.format")
    prompt = record["instruction"]
    if record.get("input"):
        prompt = f"{prompt}\n\n{record['input']}"
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    if record.get("system"):
        messages.insert(0, {"role": "system", "content": record["system"]})
    return messages


def check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RecordError("has no 'messages' list (data.format = 'chat' needs 'messages': [{'role': ..., "
                          "'content': ...}, ...]); fix the record, or set data.format = 'text' for plain text")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RecordError(f"message {j} has no 'role'; each message needs 'role' and 'content'")
        if m["role"] not in ROLES:
            raise RecordError(f"message {j} has the unknown role {m['role']!r}; use one of {list(ROLES)} "
                              f"(rename it in the data)")
        if not isinstance(m.get("content"), str):
            raise RecordError(f"message {j} ({m['role']}) has no string 'content'")
    # datasets fills columns a record lacks with None; a template would print them
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def load_chat_tokenizer(folder: str | os.PathLike, template_file: str = ""):
    """The transformers tokenizer of `folder`, with a chat template (its own, or `template_file`'s)."""
    try:
        import transformers
    except ImportError:
        raise ValueError("data.format = 'chat' renders conversations with transformers' chat templates; "
                         "install it (pip install -e .[hf])") from None
    transformers.logging.set_verbosity_error()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises several types for a folder that is not a tokenizer
        raise ValueError(f"data.tokenizer = {str(folder)!r}: transformers cannot load a tokenizer from it ({e}); "
                         f"point data.tokenizer at a Hugging Face model or tokenizer folder") from None
    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise ValueError(f"data.chat_template = {template_file!r}: no such file; give a Jinja template file "
                             f"or leave it empty to use the tokenizer's own")
        tok.chat_template = path.read_text()
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer in {str(folder)!r} has no chat template (none in tokenizer_config.json or "
                         f"chat_template.jinja), which data.format = 'chat' needs; set data.chat_template = "
                         f"PATH.jinja, use a tokenizer that has one, or use data.format = 'text'")
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"the tokenizer in {str(folder)!r} is not a fast (tokenizer.json) tokenizer; assistant "
                         f"masks need character offsets, which only fast tokenizers give")
    return tok


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))  # character-wise on any two strings


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the whole conversation rendered, [(start, end) characters of each assistant turn])."""
    def render(msgs, prompt: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)

    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _common_prefix(render(messages[:i], True), full) if i else 0
        end = _common_prefix(render(messages[:i + 1], False), full)
        if end > start:
            spans.append((start, end))
    return full, spans


def encode_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids of the rendered conversation, 1 for every token of an assistant turn else 0)."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [0] * len(enc["input_ids"])
    k = 0
    for t, (start, end) in enumerate(enc["offset_mapping"]):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return list(enc["input_ids"]), mask
