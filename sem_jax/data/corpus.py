"""A passage corpus from the data sets' own paragraphs (when no Wikipedia dump is given)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from sem_jax.data.sources import read_rows
from sem_jax.rows import by_reason, reason


def _musique_passages(row: dict) -> Iterable[tuple[str, str] | str]:
    paragraphs = row.get("paragraphs")
    if not isinstance(paragraphs, (list, tuple)):
        yield "no 'paragraphs' list"
        return
    for p in paragraphs:
        if isinstance(p, dict) and isinstance(p.get("paragraph_text"), str):
            yield str(p.get("title") or ""), p["paragraph_text"].strip()
        else:
            yield "a paragraph without 'paragraph_text'"


def _hotpot_passages(row: dict) -> Iterable[tuple[str, str] | str]:
    context = row.get("context")
    if isinstance(context, dict):  # the hub's layout: {"title": [...], "sentences": [[...], ...]}
        titles, sentences = context.get("title"), context.get("sentences")
        if not (isinstance(titles, (list, tuple)) and isinstance(sentences, (list, tuple)) and len(titles) == len(sentences)):
            yield "a 'context' whose 'title' and 'sentences' lists differ"
            return
        context = list(zip(titles, sentences))
    if not isinstance(context, (list, tuple)):
        yield "no 'context' list"
        return
    for item in context:  # the original layout: [[title, [sentence, ...]], ...]
        if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], (list, tuple)):
            yield str(item[0]), "".join(str(s) for s in item[1]).strip()
        else:
            yield "a context item that is not [title, sentences]"


def corpus_from_datasets(musique: Sequence[str] = (), hotpotqa: Sequence[str] = (),
                         split: str = "train") -> list[dict[str, str]]:
    """{id, title, text} passages from MuSiQue paragraphs and HotpotQA contexts (either layout,
    local or `hub_id[:config]`), deduplicated by (title, text), in first-seen order. One line per
    source says rows read and broken, paragraphs found, skipped (by reason), repeated and new."""
    seen: set[tuple[str, str]] = set()
    out = []
    for name, paths, extract in (("musique", musique, _musique_passages), ("hotpotqa", hotpotqa, _hotpot_passages)):
        for path in paths:
            rows, found, repeated, before = 0, 0, 0, len(out)
            skipped: Counter[str] = Counter()
            broken: Counter[str] = Counter()
            for _, row in read_rows(path, split, name):
                rows += 1
                if isinstance(row, ValueError) or not isinstance(row, dict):
                    broken[reason(row, "") if isinstance(row, ValueError) else "not a JSON object"] += 1
                    continue
                for item in extract(row):
                    if isinstance(item, str):
                        skipped[item] += 1
                        continue
                    title, text = item
                    found += 1
                    if not text:
                        skipped["an empty paragraph"] += 1
                    elif (title, text) in seen:
                        repeated += 1
                    else:
                        seen.add((title, text))
                        out.append({"id": str(len(out)), "title": title, "text": text})
            print(f"{path} ({name}): {rows} rows read"
                  + (f", {sum(broken.values())} broken ({by_reason(broken)})" if broken else "")
                  + f"; {found} paragraphs, {len(out) - before} new, {repeated} seen before"
                  + (f"; skipped {sum(skipped.values())} ({by_reason(skipped)})" if skipped else ""), flush=True)
    if not out:
        raise ValueError(f"no passages found in musique={list(musique)} hotpotqa={list(hotpotqa)}")
    return out
