"""The SEM system prompt and chat formatting (Qwen chat template)."""

from __future__ import annotations

from sem_jax.data.example import Example

SYSTEM_PROMPT = (
    "Answer the question. First think briefly inside <think> </think>, then give your answer "
    "inside <answer> </answer>. If you are not sure that answer is right, you may then search: "
    "write a query inside <search> </search>; results appear inside <result> </result>. After "
    "reading them, think inside <think> </think> and give your final answer inside "
    "<answer> </answer>. Search only when you need to."
)


def question_text(ex: Example) -> str:
    if ex.kind == "mc" and ex.options:
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        opts = "\n".join(f"{letters[i]}. {o}" for i, o in enumerate(ex.options))
        return f"{ex.question}\n{opts}\nAnswer with the option letter."
    return ex.question


def chat_prompt(ex: Example, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The prompt text up to the assistant turn, in Qwen's chat format."""
    return (f"<|im_start|>system\n{system_prompt}<|im_end|>\n"
            f"<|im_start|>user\n{question_text(ex)}<|im_end|>\n<|im_start|>assistant\n")


def encode_prompt(tokenizer, ex: Example, system_prompt: str = SYSTEM_PROMPT) -> list[int]:
    return tokenizer.encode(chat_prompt(ex, system_prompt), add_special_tokens=False)


DIRECT_SYSTEM_PROMPT = (
    "Answer the question. Think briefly inside <think> </think>, then give your answer inside "
    "<answer> </answer>. No search is available."
)


def rag_prompt(ex: Example, results: str) -> str:
    """Naive RAG: the question's retrieved passages are given up front; no search offered."""
    return (f"<|im_start|>system\n{DIRECT_SYSTEM_PROMPT}<|im_end|>\n"
            f"<|im_start|>user\n{question_text(ex)}\n{results.strip()}<|im_end|>\n<|im_start|>assistant\n")
