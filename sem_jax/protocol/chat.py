"""Qwen's chat format and passage cutting, shared by every protocol."""

from __future__ import annotations

import re

from sem_jax.data.example import LETTERS, Example

# Every protocol's tags: in retrieved text they would be read as the policy's own.
PROTOCOL_TAG = re.compile(r"<(/?)(think|answer|search|result)>", re.IGNORECASE)


def question_text(ex: Example) -> str:
    if ex.kind == "mc" and ex.options:
        opts = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(ex.options))
        return f"{ex.question}\n{opts}\nAnswer with the option letter."
    return ex.question


def response_text(tokenizer, ids) -> str:
    """A response's text for the parsers: every token decoded but the tokenizer's named special ones
    (EOS, padding). A tag that is one added token stays in the text whether or not the tokenizer
    marks it special (Qwen3's `<think>` is not; a fine-tune's may be), where `skip_special_tokens`
    would drop it."""
    drop = set(tokenizer.all_special_ids)
    return tokenizer.decode([int(i) for i in ids if int(i) not in drop], skip_special_tokens=False)


def chat_prompt(ex: Example, system_prompt: str) -> str:
    """The prompt text up to the assistant turn, in Qwen's chat format."""
    return (f"<|im_start|>system\n{system_prompt}<|im_end|>\n"
            f"<|im_start|>user\n{question_text(ex)}<|im_end|>\n<|im_start|>assistant\n")


# A block over its budget has its passages' titles cut to this many tokens first: with its marks
# ("(1) ", ": ", " ...", the line break) a cut title fits the per-passage room the buffers give
# beside the text's budget (config.PASSAGE_EXTRA_TOKENS).
TITLE_TOKENS = 8


def as_data(text: str) -> str:
    """Retrieved text made inert before it is inserted: a protocol tag in a passage would make the
    parsers read the response as something else (a valid search scored as invalid), and a control
    token's text (`<|im_end|>`) would be encoded as that special token inside the response. Tags
    become `‹tag›`, and `<|` becomes `< |`."""
    return PROTOCOL_TAG.sub(lambda m: f"\u2039{m.group(1)}{m.group(2)}\u203a", text).replace("<|", "< |")


def cut_title(title: str, tokenizer, max_tokens: int | None) -> str:
    """`title` cut to `max_tokens` tokens; None: whole."""
    return title if max_tokens is None else cut_to_tokens(title, tokenizer, max_tokens)


def cut_to_tokens(text: str, tokenizer, max_tokens: int) -> str:
    """`text` cut to `max_tokens` tokens (then marked " ..."), as a passage is before it is inserted."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens]).rstrip() + " ..."


def rag_chat_prompt(ex: Example, system_prompt: str, results: str) -> str:
    """Naive RAG: the question's retrieved passages follow it in the user turn."""
    return (f"<|im_start|>system\n{system_prompt}<|im_end|>\n"
            f"<|im_start|>user\n{question_text(ex)}\n{results.strip()}<|im_end|>\n<|im_start|>assistant\n")
