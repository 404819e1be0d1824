"""The one example type every data source is turned into."""

from __future__ import annotations

import dataclasses

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # multiple-choice options' letters, in order


@dataclasses.dataclass(frozen=True)
class Example:
    id: str
    question: str
    answers: tuple[str, ...]            # gold answers (aliases); for multiple choice the letter
    source: str                          # data set name, e.g. "musique", "mmlu"
    needs_search: bool                   # expected to need retrieval (MuSiQue) or not (MMLU)
    options: tuple[str, ...] | None = None  # multiple-choice option texts, in letter order
    kind: str = "qa"                     # "qa" (EM/F1), "mc" (option letter or text), "math" (numeric)
    category: str = ""                   # the data set's own grouping (MMLU subject, MuSiQue hops, HotpotQA
                                         # type): seeded samples are stratified by it

    def __post_init__(self):
        if self.kind not in ("qa", "mc", "math"):
            raise ValueError(f"example {self.id}: kind must be qa, mc or math, got {self.kind!r}")
        if not self.question.strip():
            raise ValueError(f"example {self.id}: empty question")
        if not self.answers or not all(isinstance(a, str) and a.strip() for a in self.answers):
            raise ValueError(f"example {self.id}: needs at least one non-empty answer")
        if self.kind == "mc" and not self.options:
            raise ValueError(f"example {self.id}: multiple choice needs options")
        if self.kind == "mc":
            letters = LETTERS[:len(self.options)]
            wrong = [a for a in self.answers if a.strip() not in letters and a not in self.options]
            if wrong:
                raise ValueError(f"multiple-choice answer neither an option's letter nor its text (example "
                                 f"{self.id}: {wrong[0]!r}; letters {letters[0]}-{letters[-1]})")
