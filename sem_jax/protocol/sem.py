"""SEM's answer-first protocol: the prompts, the tags, the response grammar, the `<result>`
blocks a search inserts. Every tag literal of the protocol lives here.

Valid responses:
    <think>..</think><answer>A1</answer>
    <think>..</think><answer>A1</answer>(<search>q</search><result>..</result>[<think>..</think>])+<answer>A2</answer>
Only whitespace may stand between blocks; tags do not nest.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sem_jax.protocol import chat

if TYPE_CHECKING:  # annotations only: the protocol loads without the retriever (numpy, scipy)
    from sem_jax.retrieval.bm25 import Passage

TAGS = ("think", "answer", "search", "result")
SEARCH_CLOSE = "</search>"  # decoding pauses here for the retriever
_TAG = re.compile(r"<(/?)(think|answer|search|result)>")

SYSTEM_PROMPT = (
    "Answer the question. First think briefly inside <think> </think>, then give your answer "
    "inside <answer> </answer>. If you are not sure that answer is right, you may then search: "
    "write a query inside <search> </search>; results appear inside <result> </result>. After "
    "reading them, think inside <think> </think> and give your final answer inside "
    "<answer> </answer>. Search only when you need to."
)
# Appended to the system prompt with `config.prompt_example`: both paths, written in the format
# the parser reads (a small instruct model follows an example more readily than a description).
EXAMPLE_RESPONSES = (
    ("What is the capital of France?", "<think>The capital of France is Paris.</think>\n<answer>Paris</answer>"),
    ("Who designed the Harlow Street bridge?",
     "<think>I am not sure who designed it.</think>\n<answer>Isambard Brunel</answer>\n<search>Harlow Street "
     "bridge designer</search>\n<result>\n(1) Harlow Street bridge: The Harlow Street bridge was designed by Edith "
     "Marrow.\n</result>\n<think>The result names Edith Marrow.</think>\n<answer>Edith Marrow</answer>"),
)
EXAMPLE = "".join(f"\n\nExample {label}:\nQuestion: {q}\n{response}" for label, (q, response) in
                  zip(("of answering directly", "of answering, searching and answering again"), EXAMPLE_RESPONSES))
DIRECT_SYSTEM_PROMPT = (
    "Answer the question. Think briefly inside <think> </think>, then give your answer inside "
    "<answer> </answer>. No search is available."
)
LIMIT_NOTE = "\n<result>\nSearch limit reached: answer with what you know.\n</result>\n"
NO_RESULTS = "No results found."
NO_QUERY = "No query: write the query between <search> and </search>."


# -- what a search inserts ------------------------------------------------------------------

def parse_query(text: str) -> str:
    """The query of the last `<search>...</search>` in `text` ('' when there is none)."""
    end = text.rfind(SEARCH_CLOSE)
    if end < 0:
        return ""
    start = text.rfind("<search>", 0, end)
    prev_end = text.rfind(SEARCH_CLOSE, 0, end)
    if start < 0 or start < prev_end:
        return ""
    return text[start + len("<search>"):end].strip()


def format_results(passages: Sequence[Passage], tokenizer, max_tokens_per_passage: int,
                   title_tokens: int | None = None) -> str:
    """`\\n<result>\\n(1) Title: text\\n...\\n</result>\\n`, each passage's text cut to a token budget
    and its title to `title_tokens` (None: whole)."""
    lines = []
    for i, p in enumerate(passages, start=1):
        text = chat.cut_to_tokens(chat.as_data(p.text), tokenizer, max_tokens_per_passage)
        title = chat.cut_title(chat.as_data(p.title), tokenizer, title_tokens)
        lines.append(f"({i}) {title}: {text}" if p.title else f"({i}) {text}")
    return result_text("\n".join(lines) if lines else NO_RESULTS)


def result_text(body: str) -> str:
    """`body` as an inserted `<result>` block."""
    return f"\n<result>\n{body}\n</result>\n"


def result_block(query: str, passages: Sequence[Passage], tokenizer, max_tokens_per_passage: int,
                 title_tokens: int | None = None) -> str:
    """The block inserted after `<search>query</search>`; a blank query is told how to ask."""
    if not query.strip():  # the protocol's own words, not retrieved text: not made inert
        return result_text(f"(1) {chat.cut_to_tokens(NO_QUERY, tokenizer, max_tokens_per_passage)}")
    return format_results(passages, tokenizer, max_tokens_per_passage, title_tokens)


# -- the response grammar ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Parsed:
    valid: bool
    reason: str                      # "" when valid
    thinks: tuple[str, ...] = ()
    first_answer: str | None = None
    searches: tuple[tuple[str, str | None], ...] = ()  # (query, result text or None)
    final_answer: str | None = None  # after searching; None without a search

    @property
    def num_searches(self) -> int:
        return len(self.searches)

    @property
    def answer(self) -> str | None:
        """The answer that counts: the final one after a search, else the first."""
        return self.final_answer if self.final_answer is not None else self.first_answer


def _blocks(text: str) -> tuple[list[tuple[str, str]], str]:
    """[(tag, content)] in order, or an error reason."""
    blocks, pos, open_tag, start = [], 0, None, 0
    for m in _TAG.finditer(text):
        closing, tag = m.group(1) == "/", m.group(2)
        if open_tag is None:
            if closing:
                return blocks, f"</{tag}> without <{tag}>"
            if text[pos:m.start()].strip():
                return blocks, f"text outside tags before <{tag}>"
            open_tag, start = tag, m.end()
        else:
            if not closing:
                return blocks, f"<{tag}> nested inside <{open_tag}>"
            if tag != open_tag:
                return blocks, f"</{tag}> closes <{open_tag}>"
            blocks.append((tag, text[start:m.start()]))
            open_tag, pos = None, m.end()
    if open_tag is not None:
        return blocks, f"<{open_tag}> not closed"
    if text[pos:].strip():
        return blocks, "text after the last tag" if blocks else "no tags"
    return blocks, ""


def parse_response(text: str, finished: bool = True) -> Parsed:
    """Response text -> structure. Never raises. (`finished`, whether the response ended with
    EOS, is not part of this grammar: a cut response rarely closes its last block.)"""
    try:
        return _parse(text)
    except Exception as e:  # noqa: BLE001 - the contract is: never raise
        return Parsed(False, f"parser error: {type(e).__name__}")


def _parse(text: str) -> Parsed:
    blocks, err = _blocks(text)
    thinks = tuple(c.strip() for t, c in blocks if t == "think")
    answers = [c.strip() for t, c in blocks if t == "answer"]
    first = answers[0] if answers else None
    if err:
        return Parsed(False, err, thinks, first)
    tags = [t for t, _ in blocks]
    if tags[:2] != ["think", "answer"]:
        return Parsed(False, "must start with <think> then <answer>", thinks, first)
    rest = blocks[2:]
    searches: list[tuple[str, str | None]] = []
    i = 0
    while i < len(rest) and rest[i][0] == "search":
        if i + 1 >= len(rest) or rest[i + 1][0] != "result":
            return Parsed(False, "<search> not followed by <result>", thinks, first, tuple(searches))
        searches.append((rest[i][1].strip(), rest[i + 1][1].strip()))
        i += 2
        if i < len(rest) and rest[i][0] == "think":
            i += 1
    if not searches:
        if rest:
            return Parsed(False, "blocks after the answer without a search", thinks, first)
        return Parsed(True, "", thinks, first)
    if i != len(rest) - 1 or rest[i][0] != "answer":
        return Parsed(False, "no final <answer> after the search", thinks, first, tuple(searches))
    if any(not q for q, _ in searches):
        return Parsed(False, "empty search query", thinks, first, tuple(searches))
    return Parsed(True, "", thinks, first, tuple(searches), rest[i][1].strip())


# -- traces for a supervised warm start ---------------------------------------------------------

def direct_trace(think: str, answer: str) -> str:
    """A response that answers and stops."""
    return f"<think>{think}</think><answer>{answer}</answer>"


def search_call(query: str) -> str:
    """The text that asks for a search (the rollout pauses at its end)."""
    return f"<search>{query}{SEARCH_CLOSE}"
