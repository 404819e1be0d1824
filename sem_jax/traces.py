"""SEM traces from training questions, for the supervised format warm start (`sem_jax.sft`).

A question that needs no search (MMLU) is answered directly; one that does (MuSiQue) gets a
first answer, a search with the question as its query, the retriever's real passages, and the
gold answer after them:

    <think>I know this.</think>\\n<answer>B</answer>
    <think>I am not sure.</think>\\n<answer>GUESS</answer>\\n<search>QUESTION</search>
    \\n<result>\\n(1) Title: ...\\n</result>\\n<think>The results answer it.</think>\\n<answer>GOLD</answer>

in the layout of the protocol's worked example. The first answer is a confident guess: the
gold answer of another question from the same source that scores F1 0 here (an answer of the
right kind, and wrong). Result blocks are tokenized apart from the model's text, as the rollout inserts
them, and carry no loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from sem_jax.data.example import Example
from sem_jax.protocol import Protocol
from sem_jax.protocol import sem
from sem_jax.rewards.answers import normalize_answer, score_answer

THINK_KNOWN = "I know this."
THINK_UNSURE = "I am not sure."
THINK_AFTER = "The results answer it."

# (prompt ids, [(segment ids, trained)]): what `sft.pack` takes.
Pair = tuple[list[int], list[tuple[list[int], bool]]]


@dataclasses.dataclass(frozen=True)
class TraceStats:
    direct: int
    search: int
    questions: int                   # distinct questions used
    answer_in_results: int           # search traces whose passages contain a gold answer
    search_known: float = 0.0        # share of the traces of questions that need no search that search
    search_unknown: float = 0.0      # share of the traces of questions that need search that search

    def summary(self) -> str:
        n = self.direct + self.search
        return (f"{n} traces from {self.questions} questions: {self.direct} direct, {self.search} with a search "
                f"({100 * self.search / max(n, 1):.0f}%; {100 * self.search_known:.0f}% of the known questions' "
                f"traces, {100 * self.search_unknown:.0f}% of the unknown ones'); the passages hold a gold answer in "
                f"{self.answer_in_results} of {self.search} searches")


def sem_response(first: str, search: tuple[str, str, str] | None = None) -> list[tuple[str, bool]]:
    """A SEM response as (text, trained) segments: `first` answered directly, or (query, result
    block, final answer) after it."""
    if search is None:
        return [(f"<think>{THINK_KNOWN}</think>\n<answer>{first}</answer>", True)]
    query, block, final = search
    return [(f"<think>{THINK_UNSURE}</think>\n<answer>{first}</answer>\n{sem.search_call(query)}", True),
            (block, False), (f"<think>{THINK_AFTER}</think>\n<answer>{final}</answer>", True)]


def _guess(ex: Example, pool: Sequence[Example], rng: np.random.RandomState) -> str:
    others = sorted({e.answers[0] for e in pool if score_answer(e.answers[0], ex)[1] == 0.0})
    return others[rng.randint(len(others))] if others else "I don't know"


def build_traces(examples: Sequence[Example], tokenizer, retriever, protocol: Protocol, *, count: int,
                 search_share: float, top_k: int, max_tokens_per_passage: int, system_prompt: str,
                 seed: int = 0, decision: str = "label") -> tuple[list[Pair], TraceStats]:
    """`count` traces, `round(count * search_share)` of them searching and the rest direct.
    `decision="label"`: the searching ones drawn from the questions that need search, the direct
    ones from those that do not (the traces teach the decision); `"random"`: every trace drawn from
    all questions and `round(count * search_share)` of them, chosen at random, searching whatever
    the question (the traces teach the format alone). Pools are walked in seeded shuffled order,
    and again when used up."""
    if protocol.name != "sem":
        raise ValueError(f"sem_jax.sft writes SEM's answer-first traces; protocol={protocol.name!r} has another "
                         "format")
    if not 0.0 <= search_share <= 1.0:
        raise ValueError(f"sft.search_share={search_share} must be in [0, 1]")
    if decision not in ("label", "random"):
        raise ValueError(f"sft.decision={decision!r}; choose label or random")
    rng = np.random.RandomState(seed)
    n_search = round(count * search_share)
    pools = {True: [e for e in examples if e.needs_search], False: [e for e in examples if not e.needs_search]}
    for needs, n in ((True, n_search), (False, count - n_search)):
        if decision == "label" and n and not pools[needs]:  # random draws every trace from all questions
            raise ValueError(f"{n} {'search' if needs else 'direct'} traces asked (sft.search_share={search_share}) "
                             f"but no training question has needs_search={needs}")
    by_source: dict[str, list[Example]] = {}
    for e in examples:
        by_source.setdefault(e.source, []).append(e)
    eos = tokenizer.eos_token or "<|im_end|>"
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
    picks: list[tuple[Example, bool]] = []  # (question, whether its trace searches)
    if decision == "random":
        order = []
        searches = rng.permutation(count) < n_search
        for search in searches:
            if not order:
                order = list(rng.permutation(len(examples)))
            picks.append((examples[order.pop()], bool(search)))
    else:
        for needs, n in ((True, n_search), (False, count - n_search)):
            order = []
            for _ in range(n):
                if not order:
                    order = list(rng.permutation(len(pools[needs])))
                picks.append((pools[needs][order.pop()], needs))
    queries = [e.question for e, search in picks if search]
    hits = iter(retriever.search(queries, top_k) if queries else [])
    pairs, found = [], 0
    for ex, search in picks:
        if search:
            passages = next(hits)
            block = protocol.format_results(passages, tokenizer, max_tokens_per_passage)
            gold = {normalize_answer(a) for a in ex.answers}
            found += any(g and g in normalize_answer(p.text) for p in passages for g in gold)
            segments = sem_response(_guess(ex, by_source[ex.source], rng), (ex.question, block, ex.answers[0]))
        else:
            segments = sem_response(ex.answers[0])
        segments[-1] = (segments[-1][0] + eos, True)  # the response ends as the rollout's does
        pairs.append((protocol.encode_prompt(tokenizer, ex, system_prompt), [(enc(t), k) for t, k in segments]))
    order = rng.permutation(len(pairs))
    known = [search for e, search in picks if not e.needs_search]
    unknown = [search for e, search in picks if e.needs_search]
    return [pairs[i] for i in order], TraceStats(
        direct=count - n_search, search=n_search, questions=len({e.id for e, _ in picks}), answer_in_results=found,
        search_known=float(np.mean(known)) if known else 0.0, search_unknown=float(np.mean(unknown)) if unknown else 0.0)
