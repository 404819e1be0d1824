"""Response text -> structure, for the answer-first protocol. Never raises.

Valid responses:
    <think>..</think><answer>A1</answer>
    <think>..</think><answer>A1</answer>(<search>q</search><result>..</result>[<think>..</think>])+<answer>A2</answer>
Only whitespace may stand between blocks; tags do not nest.
"""

from __future__ import annotations

import dataclasses
import re

TAGS = ("think", "answer", "search", "result")
_TAG = re.compile(r"<(/?)(think|answer|search|result)>")


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
        return blocks, "text after the last tag"
    return blocks, ""


def parse_response(text: str) -> Parsed:
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
