"""Protocols: what the policy is told, how its responses are read, what a search inserts and
which reward scores it, chosen together by name (`config.protocol`). SEM's answer-first
protocol is `sem` (protocol/sem.py); ReSearch's, as its code runs it, is `research`
(protocol/research.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sem_jax.protocol import chat, research, sem

if TYPE_CHECKING:  # annotations only: the protocol loads without the retriever (numpy, scipy)
    from sem_jax.retrieval.bm25 import Passage


@dataclasses.dataclass(frozen=True)
class Protocol:
    name: str
    reward: str                               # the reward it trains with (sem_jax.rewards.rules.REWARDS)
    system_prompt: str                        # the policy's instructions (config.system_prompt overrides)
    example: str                              # a worked example of the format (config.prompt_example adds it)
    direct_system_prompt: str                 # the `direct` evaluation mode: no search offered
    stop_strings: tuple[str, ...]             # decoding pauses after these for the retriever
    limit_note: str                           # inserted once when a row searches past the limit
    parse: Callable[..., Any]                 # (response text, ended with EOS) -> Parsed; never raises
    parse_query: Callable[[str], str]         # paused text -> its last query
    # (query, passages, tokenizer, text budget, title budget or None), (passages, tokenizer, budgets)
    result_block: Callable[[str, Sequence[Passage], Any, int, int | None], str]
    format_results: Callable[[Sequence[Passage], Any, int, int | None], str]

    def encode_prompt(self, tokenizer, ex, system_prompt: str | None = None) -> list[int]:
        """The chat prompt's ids (Qwen's chat format) with `system_prompt` (default: the protocol's)."""
        text = chat.chat_prompt(ex, self.system_prompt if system_prompt is None else system_prompt)
        return tokenizer.encode(text, add_special_tokens=False)

    def block_ids(self, query: str, passages: Sequence[Passage], tokenizer, max_tokens_per_passage: int,
                  max_block_tokens: int) -> tuple[list[int], bool]:
        """The ids of the block inserted after a search, at most `max_block_tokens` and always
        closed. A block built longer (long titles, text that tokenizes differently in place) has its
        titles cut to `chat.TITLE_TOKENS` (the budget's room for them), then its passages' texts
        cut shorter, then its last passages dropped, then the one left its title cut shorter and
        dropped (a small vocabulary spends more tokens on the marks than the budget allows for);
        never its tags. Returns (ids, whether it was shortened)."""
        enc = lambda text: tokenizer.encode(text, add_special_tokens=False)
        ids = enc(self.result_block(query, passages, tokenizer, max_tokens_per_passage))
        if len(ids) <= max_block_tokens:
            return ids, False
        budget, title_budget, passages = max_tokens_per_passage, chat.TITLE_TOKENS, list(passages)
        ids = enc(self.result_block(query, passages, tokenizer, budget, title_budget))
        while len(ids) > max_block_tokens:
            excess = len(ids) - max_block_tokens
            if budget > 0:  # the excess spread over the passages, at least a token each round
                budget = max(0, budget - max(1, -(-excess // max(1, len(passages)))))
            elif len(passages) > 1:
                passages.pop()
            elif title_budget > 0:
                title_budget = max(0, title_budget - excess)
            elif passages and passages[0].title:
                passages = [dataclasses.replace(passages[0], title="")]
            else:
                raise ValueError(f"max_block_tokens={max_block_tokens} cannot hold a {self.name} result block "
                                 f"with one passage's mark and no title or text ({len(ids)} tokens): raise "
                                 "retrieval.max_tokens_per_passage")
            ids = enc(self.result_block(query, passages, tokenizer, budget, title_budget))
        return ids, True

    def rag_prompt(self, ex, results: str) -> str:
        """Naive RAG: the question's retrieved passages in the prompt, the direct instructions."""
        return chat.rag_chat_prompt(ex, self.direct_system_prompt, results)


def _protocol(name: str, reward: str, module) -> Protocol:
    return Protocol(name=name, reward=reward, system_prompt=module.SYSTEM_PROMPT, example=module.EXAMPLE,
                    direct_system_prompt=module.DIRECT_SYSTEM_PROMPT, stop_strings=(module.SEARCH_CLOSE,),
                    limit_note=module.LIMIT_NOTE, parse=module.parse_response, parse_query=module.parse_query,
                    result_block=module.result_block, format_results=module.format_results)


SEM = _protocol("sem", "sem", sem)
RESEARCH = _protocol("research", "research", research)
PROTOCOLS = {"sem": SEM, "research": RESEARCH}


def get_protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"protocol={name!r}; choose one of {sorted(PROTOCOLS)}")
    return PROTOCOLS[name]


__all__ = ["PROTOCOLS", "Protocol", "RESEARCH", "SEM", "get_protocol"]
