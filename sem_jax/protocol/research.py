"""ReSearch's protocol, as Agent-RL/ReSearch's code runs it (its `re_search_template_sys`,
`vllm_rollout.py` and `reward_score/re_search.py`): the model reasons first and may search inside
its reasoning; results are inserted as ` <result>\\n...\\n</result>`; the final answer is the
`\\boxed{}` inside the one `<answer>` block; a response that did not end with EOS is invalid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sem_jax.protocol import chat
from sem_jax.protocol.sem import parse_query  # the same tags: the last <search>...</search>

if TYPE_CHECKING:  # annotations only: the protocol loads without the retriever (numpy, scipy)
    from sem_jax.retrieval.bm25 import Passage

SEARCH_CLOSE = "</search>"
SYSTEM_PROMPT = (
    "You are a helpful assistant that can solve the given question step by step with the help of the wikipedia "
    "search tool. Given a question, you need to first think about the reasoning process in the mind and then "
    "provide the answer. During thinking, you can invoke the wikipedia search tool to search for fact information "
    "about specific topics if needed. The reasoning process and answer are enclosed within <think> </think> and "
    "<answer> </answer> tags respectively, and the search query and result are enclosed within <search> </search> "
    "and <result> </result> tags respectively. For example, <think> This is the reasoning process. </think> "
    "<search> search query here </search> <result> search result here </result> <think> This is the reasoning "
    "process. </think> <answer> The final answer is \\[ \\boxed{answer here} \\] </answer>. In the last part of "
    "the answer, the final exact answer is enclosed within \\boxed{} with latex format."
)
# The `direct` and naive-RAG evaluation modes: the same format, no search offered.
DIRECT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Given a question, you need to first think about the reasoning process in the "
    "mind and then provide the answer. The reasoning process and answer are enclosed within <think> </think> and "
    "<answer> </answer> tags respectively. For example, <think> This is the reasoning process. </think> <answer> "
    "The final answer is \\[ \\boxed{answer here} \\] </answer>. In the last part of the answer, the final exact "
    "answer is enclosed within \\boxed{} with latex format."
)
EXAMPLE = ""  # ReSearch's system prompt carries its own inline example
NOTHING_TO_SEARCH = "nothing to search"  # ReSearch's block for a blank query
LIMIT_NOTE = " <result>\nSearch limit reached: answer with what you know.\n</result>"


def result_text(body: str) -> str:
    return f" <result>\n{body}\n</result>"


def format_results(passages: Sequence[Passage], tokenizer, max_tokens_per_passage: int,
                   title_tokens: int | None = None) -> str:
    """Passages as FlashRAG's wiki `contents` ("Title"\\ntext), blank-line separated, each text cut
    to a token budget and its title to `title_tokens` (None: whole)."""
    parts = []
    for p in passages:
        text = chat.cut_to_tokens(chat.as_data(p.text), tokenizer, max_tokens_per_passage)
        title = chat.cut_title(chat.as_data(p.title), tokenizer, title_tokens)
        parts.append(f'"{title}"\n{text}' if p.title else text)
    return result_text("\n\n".join(parts) if parts else "No results found.")


def result_block(query: str, passages: Sequence[Passage], tokenizer, max_tokens_per_passage: int,
                 title_tokens: int | None = None) -> str:
    if not query.strip():
        return result_text(NOTHING_TO_SEARCH)
    return format_results(passages, tokenizer, max_tokens_per_passage, title_tokens)


@dataclasses.dataclass(frozen=True)
class Parsed:
    valid: bool
    reason: str                      # "" when valid
    answer: str | None = None        # the \boxed{} content of the <answer> block
    queries: tuple[str, ...] = ()

    @property
    def num_searches(self) -> int:
        return len(self.queries)


def validate_format(text: str) -> str:
    """ReSearch's format check; '' when the format is right, else the reason."""
    if text.count("<think>") != text.count("</think>"):
        return "<think> </think> not paired"
    if text.count("<think>") == 0:
        return "<think> or </think> not found"
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return "<answer> or </answer> not found"
    pos = 0
    while (search := text.find("<search>", pos)) != -1:
        result, search_end = text.find("<result>", search), text.find("</search>", search)
        result_end = text.find("</result>", result)
        if -1 in (result, search_end, result_end):
            return "search/result tags are incomplete"
        if not search < search_end < result < result_end:
            return "search/result tags are nested in the wrong order"
        pos = result_end
    start, end = text.find("<answer>"), text.find("</answer>")
    if start > end:
        return "<answer> must be before </answer>"
    content = text[start:end]
    if "\\boxed{" not in content or "}" not in content:
        return "answer is missing \\boxed{} format"
    return ""


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced) or `\\boxed x` in `text`."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    i = text.rfind("\\boxed")
    if i < 0:
        return None
    depth, start = 0, text.find("{", i)
    if start < 0:
        return None
    for j in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + 1:j]
    return None


def parse_response(text: str, finished: bool = True) -> Parsed:
    """Response text (inserted results included) -> Parsed. Never raises."""
    try:
        queries, pos = [], 0
        while (q := text.find("<search>", pos)) != -1 and (e := text.find("</search>", q)) != -1:
            queries.append(text[q + len("<search>"):e].strip())
            pos = e
        reason = validate_format(text)
        if reason:
            return Parsed(False, f"bad format: {reason}", queries=tuple(queries))
        if not finished:
            return Parsed(False, "over length: no EOS", queries=tuple(queries))
        block = text[text.find("<answer>") + len("<answer>"):text.find("</answer>")]
        answer = last_boxed(block)
        if answer is None:
            return Parsed(False, "cannot extract the \\boxed{} answer", queries=tuple(queries))
        return Parsed(True, "", answer.strip(), tuple(queries))
    except Exception as e:  # noqa: BLE001 - the contract is: never raise
        return Parsed(False, f"parser error: {type(e).__name__}")


__all__ = ["DIRECT_SYSTEM_PROMPT", "LIMIT_NOTE", "Parsed", "SEARCH_CLOSE", "SYSTEM_PROMPT", "format_results",
           "parse_query", "parse_response", "result_block"]
