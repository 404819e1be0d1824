"""BM25 retrieval over a passage corpus, on the host: bm25s's tokenizer, index and files
(PyStemmer stems), searched as a sparse product (`scoring.TermMatrix`).

bm25s is imported inside functions only: importing it initialises the XLA
backend, which must not happen before `jax.distributed.initialize()`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from sem_jax.retrieval.scoring import TermMatrix
from sem_jax.rows import jsonl_lines, parse_rows


FORMAT = "sem_jax.bm25/1"


@dataclasses.dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str
    score: float = 0.0


def parse_corpus_row(row: Any, where: str, allow_blank: bool = False) -> dict[str, str]:
    """One corpus row -> {id, title, text}. Accepts {id, title, text} and {id, contents}
    (FlashRAG/Search-R1 style, the first line of `contents` being the title). A blank passage is
    an error unless `allow_blank` (the streaming build counts and refuses them itself)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "id" not in row:
        raise ValueError(f"{where}: missing field 'id'")
    if isinstance(row.get("text"), str):
        title = row.get("title") or ""
        if not isinstance(title, str):
            raise ValueError(f"{where}: field 'title' must be a string")
        text = row["text"]
    elif isinstance(row.get("contents"), str):
        first, _, rest = row["contents"].partition("\n")
        title, text = first.strip().strip('"'), rest.strip()
    else:
        raise ValueError(f"{where}: needs a string 'text' (with optional 'title') or 'contents'")
    if not (allow_blank or title.strip() or text.strip()):
        raise ValueError(f"{where}: empty passage")
    return {"id": str(row["id"]), "title": title, "text": text}


def read_corpus(path: str, show_progress: bool = True) -> list[dict[str, str]]:
    """Read a jsonl corpus; broken rows are reported (count and first example) and skipped."""
    return parse_rows(jsonl_lines(path, show_progress), lambda line, where: parse_corpus_row(json.loads(line), where),
                      source=path, what="passage")


class Retriever:
    """Batched BM25 search. `search(queries, k)` answers all queries in one call."""

    def __init__(self, bm25: Any, corpus: Any, settings: dict[str, Any], threads: int = 0):
        self.bm25 = bm25
        self.corpus = corpus  # list of dicts, or bm25s' memory-mapped JsonlCorpus
        self.settings = settings
        self.threads = threads or os.cpu_count() or 1  # 0: every core of the host
        self.calls = 0  # search() invocations, for telling batched from per-row use
        self._matrix: TermMatrix | None = None

    def __len__(self) -> int:
        return int(self.settings["num_docs"])

    @classmethod
    def build(cls, docs: Sequence[dict[str, str]], *, stemmer: str | None = "english",
              stopwords: str | None = "en", k1: float = 1.5, b: float = 0.75,
              method: str = "lucene", show_progress: bool = True, threads: int = 0) -> "Retriever":
        """Index passages ({id, title, text}); the title is indexed with the text."""
        import bm25s

        _quiet_bm25s()
        settings = {"format": FORMAT, "stemmer": stemmer, "stopwords": stopwords, "k1": k1, "b": b,
                    "method": method, "num_docs": len(docs)}
        tokens = bm25s.tokenize([f"{d['title']}\n{d['text']}" for d in docs], stopwords=stopwords,
                                stemmer=_stemmer(stemmer), show_progress=show_progress)
        bm25 = bm25s.BM25(k1=k1, b=b, method=method, backend="numpy")
        bm25.index(tokens, show_progress=show_progress)
        return cls(bm25, list(docs), settings, threads)

    @classmethod
    def from_jsonl(cls, path: str, **kwargs) -> "Retriever":
        return cls.build(read_corpus(path, kwargs.get("show_progress", True)), **kwargs)

    def save(self, out_dir: str) -> None:
        """Index, corpus and the tokenizer/stemmer settings, side by side."""
        os.makedirs(out_dir, exist_ok=True)
        self.bm25.save(out_dir, corpus=list(self.passages()), show_progress=False)
        with open(os.path.join(out_dir, "sem_jax_index.json"), "w") as fh:
            json.dump(self.settings, fh, indent=2)

    @classmethod
    def load(cls, index_dir: str, mmap: bool = True, threads: int = 0) -> "Retriever":
        """Load a saved index; `mmap` keeps the index and corpus on disk, in the page cache that
        the processes of one host share (big corpora); `threads` searching (0: every core)."""
        import bm25s

        meta = os.path.join(index_dir, "sem_jax_index.json")
        if not os.path.exists(meta):
            raise FileNotFoundError(f"{meta}: not found (build the index with scripts/build_index.py)")
        with open(meta) as fh:
            settings = json.load(fh)
        if settings.get("format") != FORMAT:
            raise ValueError(f"{meta}: format {settings.get('format')!r}, expected {FORMAT!r}")
        check_index(index_dir, int(settings["num_docs"]))
        bm25 = bm25s.BM25.load(index_dir, load_corpus=True, mmap=mmap, show_progress=False)
        # We look passages up ourselves; with a corpus attached bm25s returns documents, not ids.
        corpus, bm25.corpus = bm25.corpus, None
        return cls(bm25, corpus, settings, threads)

    def passages(self) -> Iterable[dict[str, str]]:
        """Every indexed passage ({id, title, text}), in index order."""
        for i in range(len(self)):
            yield self.corpus[i]

    def search(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        """Top-k passages per query, best first (k clipped to the corpus size; passages
        with no matching term are left out, and so a blank query gets none)."""
        import bm25s

        self.calls += 1
        k = max(1, min(int(k), len(self)))
        out: list[list[Passage]] = [[] for _ in queries]
        live = [i for i, q in enumerate(queries) if q.strip()]
        if not live:
            return out
        tokens = bm25s.tokenize([queries[i] for i in live], stopwords=self.settings["stopwords"],
                                stemmer=_stemmer(self.settings["stemmer"]), return_ids=False,
                                show_progress=False)
        vocab = self.bm25.vocab_dict
        hits = self.term_matrix().top_k([[vocab[w] for w in q if w in vocab] for q in tokens], k, self.threads)
        for i, (docs, scores) in zip(live, hits):
            for doc, score in zip(docs, scores):
                if score > 0:
                    d = self.corpus[int(doc)]
                    out[i].append(Passage(id=d["id"], title=d.get("title", ""), text=d["text"],
                                          score=float(score)))
        return out

    def term_matrix(self) -> TermMatrix:
        """The index's scores as a sparse terms x passages matrix (over the same arrays)."""
        if self._matrix is None:
            s = self.bm25.scores
            self._matrix = TermMatrix(s["data"], s["indices"], s["indptr"], int(s["num_docs"]))
        return self._matrix


def _quiet_bm25s() -> None:
    # bm25s logs every index build at INFO; progress bars already say what is happening.
    logging.getLogger("bm25s").setLevel(logging.WARNING)


def _stemmer(language: str | None):
    if not language:
        return None
    import Stemmer
    return Stemmer.Stemmer(language)


INDEX_ARRAYS = ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy")
INDEX_JSON = ("params.index.json", "vocab.index.json", "corpus.mmindex.json")


def check_index(index_dir: str, num_docs: int) -> None:
    """The saved index whole, before bm25s reads it: every file there, the arrays' lengths
    consistent with each other, the vocabulary and the corpus, so that a missing or cut file is
    named at load instead of failing at the first search."""
    missing = [f for f in (*INDEX_ARRAYS, *INDEX_JSON, "corpus.jsonl") if not os.path.exists(os.path.join(index_dir, f))]
    if missing:
        raise FileNotFoundError(f"{index_dir}: incomplete index, missing {', '.join(missing)} (rebuild it with "
                                "scripts/build_index.py)")
    arrays, docs = {}, {}
    for name in INDEX_ARRAYS:
        try:
            arrays[name] = np.load(os.path.join(index_dir, name), mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"{os.path.join(index_dir, name)}: unreadable or truncated ({e})") from None
    for name in INDEX_JSON:
        try:
            with open(os.path.join(index_dir, name)) as fh:
                docs[name] = json.load(fh)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{os.path.join(index_dir, name)}: unreadable or truncated ({e})") from None
    data, indices, indptr = (arrays[n] for n in INDEX_ARRAYS)
    where = f"{index_dir}: inconsistent index"
    if not (len(data) == len(indices) == int(indptr[-1])):
        raise ValueError(f"{where}: {len(data)} scores, {len(indices)} document ids and {int(indptr[-1])} in "
                         "indptr (a truncated array)")
    if len(indptr) != len(docs["vocab.index.json"]):  # bm25s: one column per vocabulary id
        raise ValueError(f"{where}: indptr has {len(indptr)} entries for a vocabulary of "
                         f"{len(docs['vocab.index.json'])} (vocab.index.json)")
    offsets = docs["corpus.mmindex.json"]
    if docs["params.index.json"].get("num_docs") != num_docs or len(offsets) != num_docs:
        raise ValueError(f"{where}: sem_jax_index.json says {num_docs} passages, params.index.json "
                         f"{docs['params.index.json'].get('num_docs')}, corpus.mmindex.json {len(offsets)}")
    corpus = os.path.join(index_dir, "corpus.jsonl")
    if offsets:  # the last passage is whole
        with open(corpus, "rb") as fh:
            fh.seek(offsets[-1])
            last = fh.read()
        try:
            json.loads(last)
        except ValueError:
            raise ValueError(f"{corpus}: truncated ({os.path.getsize(corpus)} bytes; passage {num_docs - 1} at byte "
                             f"{offsets[-1]} is not a whole row)") from None
