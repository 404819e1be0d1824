"""A passage corpus from the data sets' own paragraphs (when no Wikipedia dump is given)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sem_jax.data.sources import read_rows


def _musique_passages(row: dict) -> Iterable[tuple[str, str]]:
    for p in row.get("paragraphs") or []:
        if isinstance(p, dict) and isinstance(p.get("paragraph_text"), str):
            yield str(p.get("title") or ""), p["paragraph_text"].strip()


def _hotpot_passages(row: dict) -> Iterable[tuple[str, str]]:
    for item in row.get("context") or []:
        if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], (list, tuple)):
            yield str(item[0]), "".join(str(s) for s in item[1]).strip()


def corpus_from_datasets(musique: Sequence[str] = (), hotpotqa: Sequence[str] = ()) -> list[dict[str, str]]:
    """{id, title, text} passages from MuSiQue paragraphs and HotpotQA contexts, deduplicated by
    (title, text), in first-seen order."""
    seen: set[tuple[str, str]] = set()
    out = []
    for paths, extract in ((musique, _musique_passages), (hotpotqa, _hotpot_passages)):
        for path in paths:
            rows, broken, first, before = 0, 0, None, len(out)
            for where, row in read_rows(path):
                rows += 1
                if isinstance(row, ValueError):
                    broken += 1
                    first = first or f"{where}: {row}"
                    continue
                for title, text in extract(row):
                    if text and (title, text) not in seen:
                        seen.add((title, text))
                        out.append({"id": str(len(out)), "title": title, "text": text})
            print(f"{path}: {rows} rows read, {broken} broken and skipped"
                  + (f" (first: {first})" if first else "") + f", {len(out) - before} new passages", flush=True)
    if not out:
        raise ValueError(f"no passages found in musique={list(musique)} hotpotqa={list(hotpotqa)}")
    return out
