"""Answer scoring as in HotpotQA / FlashRAG: normalise, EM, token F1, max over gold answers;
multiple choice by option letter or text; numeric answers for GSM8K-style questions."""

from __future__ import annotations

import re
import string
from collections import Counter

from sem_jax.data.example import Example

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(pred: str, gold: str) -> float:
    return float(normalize_answer(pred) == normalize_answer(gold))


def token_f1(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    # As HotpotQA: yes/no/noanswer only match exactly.
    special = {"yes", "no", "noanswer"}
    if (" ".join(p) in special or " ".join(g) in special) and p != g:
        return 0.0
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


_LETTER_ONLY = re.compile(r"\(?([A-Za-z])\)?[.:]?")         # "B", "(B)", "B.", "B)"
_LETTER_THEN_TEXT = re.compile(r"\(?([A-Za-z])(?:\)|[.:])\s")  # "B. Paris", "(B) Paris"


def choice_letter(pred: str, options: tuple[str, ...]) -> str | None:
    """The option a prediction picks: by its letter ("B", "(B)", "B. text") or its text."""
    letters = string.ascii_uppercase[:len(options)]
    s = pred.strip()
    m = _LETTER_ONLY.fullmatch(s) or _LETTER_THEN_TEXT.match(s)
    if m and m.group(1).upper() in letters:
        return m.group(1).upper()
    norm = normalize_answer(s)
    hits = [letters[i] for i, o in enumerate(options) if norm and normalize_answer(o) == norm]
    return hits[0] if len(hits) == 1 else None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace("$", ""))
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def score_answer(pred: str | None, ex: Example) -> tuple[float, float]:
    """(EM, F1) of a prediction for an example, max over its gold answers."""
    if pred is None or not pred.strip():
        return 0.0, 0.0
    if ex.kind == "mc":
        hit = float(choice_letter(pred, ex.options or ()) in {a.strip().upper() for a in ex.answers})
        return hit, hit
    if ex.kind == "math":
        value = last_number(pred)
        hit = float(value is not None and any(last_number(a) is not None and abs(value - last_number(a)) < 1e-6
                                              for a in ex.answers))
        return hit, hit
    return max(exact_match(pred, a) for a in ex.answers), max(token_f1(pred, a) for a in ex.answers)
