"""The `<result>` block the policy reads after a search."""

from __future__ import annotations

from collections.abc import Sequence

from sem_jax.retrieval.bm25 import Passage

NO_RESULTS = "No results found."


def format_results(passages: Sequence[Passage], tokenizer, max_tokens_per_passage: int = 96) -> str:
    """`\\n<result>\\n(1) Title: text\\n...\\n</result>\\n`, each passage's text cut to a token budget."""
    lines = []
    for i, p in enumerate(passages, start=1):
        text = p.text
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > max_tokens_per_passage:
            text = tokenizer.decode(ids[:max_tokens_per_passage]).rstrip() + " ..."
        lines.append(f"({i}) {p.title}: {text}" if p.title else f"({i}) {text}")
    body = "\n".join(lines) if lines else NO_RESULTS
    return f"\n<result>\n{body}\n</result>\n"
