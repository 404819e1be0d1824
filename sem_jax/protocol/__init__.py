"""Protocols: what the policy is told, how its responses are read, and what a search inserts,
chosen together by name. SEM's answer-first protocol is `sem` (sem_jax/protocol/sem.py); a
second one (ReSearch's, say) is another module beside it and another entry in PROTOCOLS."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from sem_jax.protocol import sem
from sem_jax.retrieval.bm25 import Passage


@dataclasses.dataclass(frozen=True)
class Protocol:
    name: str
    system_prompt: str                        # the policy's instructions (config.system_prompt overrides)
    direct_system_prompt: str                 # the `direct` evaluation mode: no search offered
    stop_strings: tuple[str, ...]             # decoding pauses after these for the retriever
    limit_note: str                           # inserted once when a row searches past the limit
    chat_prompt: Callable[..., str]           # (example, system_prompt) -> prompt text
    rag_prompt: Callable[..., str]            # (example, results text) -> naive-RAG prompt text
    parse: Callable[[str], Any]               # response text -> Parsed (never raises)
    parse_query: Callable[[str], str]         # paused text -> its last query
    result_block: Callable[[str, Sequence[Passage], Any, int], str]  # (query, passages, tokenizer, budget)
    format_results: Callable[[Sequence[Passage], Any, int], str]     # (passages, tokenizer, budget)

    def encode_prompt(self, tokenizer, ex, system_prompt: str | None = None) -> list[int]:
        text = self.chat_prompt(ex, self.system_prompt if system_prompt is None else system_prompt)
        return tokenizer.encode(text, add_special_tokens=False)


SEM = Protocol(name="sem", system_prompt=sem.SYSTEM_PROMPT, direct_system_prompt=sem.DIRECT_SYSTEM_PROMPT,
               stop_strings=(sem.SEARCH_CLOSE,), limit_note=sem.LIMIT_NOTE, chat_prompt=sem.chat_prompt,
               rag_prompt=sem.rag_prompt, parse=sem.parse_response, parse_query=sem.parse_query,
               result_block=sem.result_block, format_results=sem.format_results)
PROTOCOLS = {"sem": SEM}


def get_protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"protocol={name!r}; choose one of {sorted(PROTOCOLS)}")
    return PROTOCOLS[name]


__all__ = ["PROTOCOLS", "Protocol", "SEM", "get_protocol"]
